// The gradient_clipper variants against PyTorch (tests/data/clipper_reference.inc, made by
// scripts/reference/optim_reference.py): torch.nn.utils.clip_grad_norm_ (norm, logging_only),
// clip_grad_value_ (value) and FSDP1's fp32 norm formula (fsdp1, fsdp1_logging_only) for the
// three norm types, clipping and not clipping. Norms and clipped gradients must be bit-identical.
// Then: no gradients, non-finite norms (returned, not thrown), bf16 gradients, model parts, errors.
#include <modalities/sdk/interfaces/gradient_clipper.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

namespace modalities::plugins::gradient_clippers {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

struct RefClipCase {
  std::string norm_type;
  double max_norm;
  double total;        // torch.nn.utils.clip_grad_norm_
  double fsdp1_total;  // FSDP1's fp32 formula
  std::vector<std::vector<float>> clipped;
};
#include "data/clipper_reference.inc"

const fs::path kExample = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml";

// model/grad_probe: one 1-D parameter per reference gradient (the one without a gradient has 4
// elements), named p0, p1, ...
struct ProbeConfig {
  std::int64_t copies = 1;  // unused; a config needs a key
  static void describe(Schema<ProbeConfig>& s) { s.field("copies", &ProbeConfig::copies, "unused"); }
};

class Probe final : public Module {
 public:
  Probe() {
    root_ = std::make_shared<torch::nn::Module>("Probe");
    for (std::size_t i = 0; i < kClipGrads.size(); ++i) {
      const std::int64_t n = kClipGrads[i].empty() ? 4 : static_cast<std::int64_t>(kClipGrads[i].size());
      root_->register_parameter(fmt::format("p{}", i), at::zeros({n}));
    }
  }
  TensorMap forward(const TensorMap&) override { throw Error("no forward"); }
  torch::nn::Module& module() override { return *root_; }
  const torch::nn::Module& module() const override { return *root_; }

 private:
  std::shared_ptr<torch::nn::Module> root_;
};

at::Tensor floats(const std::vector<float>& v) { return at::tensor(at::ArrayRef<float>(v), at::kFloat); }

void set_reference_grads(Module& m, at::ScalarType dtype = at::kFloat) {
  std::size_t i = 0;
  for (auto& [name, p] : m.named_parameters()) {
    p.mutable_grad() = kClipGrads[i].empty() ? at::Tensor() : floats(kClipGrads[i]).to(dtype);
    ++i;
  }
}

std::string config_text(const std::string& variant, const std::string& config) {
  return fmt::format(R"(
[model]
component_key = "model"
variant_key = "grad_probe"
config = {{}}

[clipper]
component_key = "gradient_clipper"
variant_key = "{}"
config = {{ {} }}
)",
                     variant, config);
}

const std::string kModelRef = R"(wrapped_model = { instance_key = "model", pass_type = "BY_REFERENCE" })";
const std::string kPartsRef = R"(model_parts = { instance_key = "model", pass_type = "BY_REFERENCE" })";

class ClipperTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto problem = h.registry().register_plugin({"clipper_test_fakes", "0.0.0", {}, {}, {}}, [](Registrar& r) {
      r.add<Module, ProbeConfig>("grad_probe", "test model",
                                 [](const ProbeConfig&) { return std::make_shared<Probe>(); });
    });
    ASSERT_FALSE(problem.has_value()) << *problem;
  }

  // Builds `variant`, sets the reference gradients, clips; returns (norm, gradients after).
  std::pair<at::Tensor, std::vector<at::Tensor>> clip(const std::string& variant, const std::string& config,
                                                      at::ScalarType dtype = at::kFloat) {
    h.set_config_text(config_text(variant, config));
    auto model = h.get<Module>("model");
    auto clipper = h.get<GradientClipper>("clipper");
    EXPECT_NE(clipper, nullptr) << h.build_error();
    if (!clipper) return {};
    set_reference_grads(*model, dtype);
    at::Tensor norm = clipper->clip_gradients();
    std::vector<at::Tensor> grads;
    for (auto& [name, p] : model->named_parameters()) grads.push_back(p.grad());
    return {norm, grads};
  }

  testing::Harness h{MODALITIES_TEST_PLUGIN};
};

void expect_grads(const std::vector<at::Tensor>& actual, const std::vector<std::vector<float>>& expected,
                  const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size());
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (expected[i].empty()) {
      EXPECT_FALSE(actual[i].defined()) << what << " p" << i;
      continue;
    }
    const at::Tensor e = floats(expected[i]);
    EXPECT_TRUE(at::equal(actual[i], e)) << what << " p" << i << ": max diff "
                                         << (actual[i] - e).abs().max().item<double>();
  }
}

TEST_F(ClipperTest, BuildsFromExampleConfig) {
  h.load_plugin(MODALITIES_TEST_LAYER_NORM_PLUGIN);
  h.set_config_text(testing::read_file(kExample), kExample.string());
  ASSERT_EQ(h.build_error(), "");
  for (const char* key : {"gradient_clipper", "fsdp1_logging_only", "norm", "logging_only", "value"}) {
    auto c = h.get<GradientClipper>(key);
    ASSERT_NE(c, nullptr) << key;
    const at::Tensor n = c->clip_gradients();  // no gradients yet: 0, as PyTorch
    EXPECT_EQ(n.item<double>(), 0.0) << key;
    EXPECT_EQ(n.scalar_type(), at::kFloat) << key;
  }
}

TEST_F(ClipperTest, NormMatchesClipGradNormBitForBit) {
  for (const RefClipCase& c : kClipCases) {
    const std::string what = fmt::format("norm {} max_norm {}", c.norm_type, c.max_norm);
    auto [norm, grads] = clip("norm", fmt::format(R"({}, max_norm = {}, norm_type = "{}")", kPartsRef,
                                                  format_float(c.max_norm), c.norm_type));
    ASSERT_TRUE(norm.defined()) << what;
    EXPECT_EQ(norm.dim(), 0);
    EXPECT_EQ(norm.item<double>(), c.total) << what;
    expect_grads(grads, c.clipped, what);
  }
}

TEST_F(ClipperTest, Fsdp1MatchesItsNormFormula) {
  for (const RefClipCase& c : kClipCases) {
    const std::string what = fmt::format("fsdp1 {} max_norm {}", c.norm_type, c.max_norm);
    auto [norm, grads] = clip("fsdp1", fmt::format(R"({}, max_norm = {}, norm_type = "{}")", kModelRef,
                                                   format_float(c.max_norm), c.norm_type));
    ASSERT_TRUE(norm.defined()) << what;
    EXPECT_EQ(norm.item<double>(), c.fsdp1_total) << what;
    // For fp32 gradients FSDP1's norm is torch's, so the clipped gradients are too.
    ASSERT_EQ(c.fsdp1_total, c.total) << what;
    expect_grads(grads, c.clipped, what);
  }
}

TEST_F(ClipperTest, LoggingOnlyVariantsLeaveGradientsAlone) {
  for (const RefClipCase& c : kClipCases) {
    if (c.max_norm != 1.0) continue;
    const std::string norm_type = fmt::format(R"(norm_type = "{}")", c.norm_type);
    auto [norm, grads] = clip("logging_only", kPartsRef + ", " + norm_type);
    EXPECT_EQ(norm.item<double>(), c.total) << c.norm_type;
    expect_grads(grads, kClipGrads, "logging_only " + c.norm_type);
    auto [norm1, grads1] = clip("fsdp1_logging_only", kModelRef + ", " + norm_type);
    EXPECT_EQ(norm1.item<double>(), c.fsdp1_total) << c.norm_type;
    expect_grads(grads1, kClipGrads, "fsdp1_logging_only " + c.norm_type);
  }
}

TEST_F(ClipperTest, ValueClampsAndReturnsThePreClipL2Norm) {
  auto [norm, grads] = clip("value", kPartsRef + ", clip_value = " + format_float(kClipValue));
  EXPECT_EQ(norm.item<double>(), kClipValueNorm);
  expect_grads(grads, kClipValueGrads, "value");
}

TEST_F(ClipperTest, NonFiniteNormsAreReturnedNotThrown) {
  for (const char* variant : {"norm", "fsdp1"}) {
    h.set_config_text(config_text(variant, fmt::format(R"({}, max_norm = 1.0, norm_type = "P2_NORM")",
                                                       std::string(variant) == "norm" ? kPartsRef : kModelRef)));
    auto model = h.get<Module>("model");
    auto clipper = h.get<GradientClipper>("clipper");
    set_reference_grads(*model);
    model->named_parameters()[0].second.mutable_grad()[1] = INFINITY;
    EXPECT_TRUE(std::isinf(clipper->clip_gradients().item<double>())) << variant;
    set_reference_grads(*model);
    model->named_parameters()[2].second.mutable_grad()[0] = NAN;
    EXPECT_TRUE(std::isnan(clipper->clip_gradients().item<double>())) << variant;
  }
}

TEST_F(ClipperTest, Bf16GradientsKeepTheirDtype) {
  const RefClipCase& c = kClipCases[2];  // P2_NORM, max_norm 1
  ASSERT_EQ(c.norm_type, "P2_NORM");
  auto [norm, grads] =
      clip("norm", fmt::format(R"({}, max_norm = 1.0, norm_type = "P2_NORM")", kPartsRef), at::kBFloat16);
  EXPECT_EQ(norm.scalar_type(), at::kBFloat16);
  EXPECT_NEAR(norm.item<double>(), c.total, c.total * 1e-2);
  EXPECT_EQ(grads[0].scalar_type(), at::kBFloat16);
  auto [norm1, grads1] =
      clip("fsdp1", fmt::format(R"({}, max_norm = 1.0, norm_type = "P2_NORM")", kModelRef), at::kBFloat16);
  EXPECT_EQ(norm1.scalar_type(), at::kBFloat16);  // fp32 internally, returned in the gradients' dtype
  EXPECT_NEAR(norm1.item<double>(), c.total, c.total * 1e-2);
  EXPECT_NEAR((grads1[0].to(at::kFloat) - floats(c.clipped[0])).abs().max().item<double>(), 0.0, 1e-2);
}

TEST_F(ClipperTest, ModelPartsAreClippedTogether) {
  const RefClipCase& c = kClipCases[2];  // P2_NORM, max_norm 1
  h.set_config_text(
      config_text(
          "norm",
          R"(model_parts = [{ instance_key = "model", pass_type = "BY_REFERENCE" }, { instance_key = "model2", pass_type = "BY_REFERENCE" }], max_norm = 1.0, norm_type = "P2_NORM")") +
      R"(
[model2]
component_key = "model"
variant_key = "grad_probe"
config = {}
)");
  auto clipper = h.get<GradientClipper>("clipper");
  ASSERT_NE(clipper, nullptr) << h.build_error();
  set_reference_grads(*h.get<Module>("model"));
  set_reference_grads(*h.get<Module>("model2"));
  // Two copies of the same gradients: the L2 norm grows by sqrt(2).
  EXPECT_NEAR(clipper->clip_gradients().item<double>(), c.total * std::sqrt(2.0), c.total * 1e-6);
}

TEST_F(ClipperTest, WrappedModelIsAnAliasOfModelParts) {
  auto [norm, grads] = clip("norm", kModelRef + R"(, max_norm = 1.0, norm_type = "P2_NORM")");
  EXPECT_EQ(norm.item<double>(), kClipCases[2].total);
  h.set_config_text(config_text("norm", kModelRef + ", " + kPartsRef + R"(, max_norm = 1.0, norm_type = "P2_NORM")"));
  EXPECT_THAT(h.build_error(), HasSubstr("and its alias are both given"));
}

TEST_F(ClipperTest, BadConfigsNameTheField) {
  h.set_config_text(config_text("fsdp1", kModelRef + R"(, max_norm = 0.0, norm_type = "P2_NORM")"));
  EXPECT_THAT(h.build_error(), HasSubstr("clipper.config.max_norm"));
  h.set_config_text(config_text("norm", kPartsRef + R"(, max_norm = -1.0, norm_type = "P2_NORM")"));
  EXPECT_THAT(h.build_error(), HasSubstr("clipper.config.max_norm"));
  h.set_config_text(config_text("fsdp1_logging_only", kModelRef + R"(, norm_type = "P3_NORM")"));
  EXPECT_THAT(h.build_error(),
              AllOf(HasSubstr("clipper.config.norm_type"), HasSubstr("'P1_NORM', 'P2_NORM', 'MAX_NORM'")));
  h.set_config_text(config_text("logging_only", kPartsRef));
  EXPECT_THAT(h.build_error(), HasSubstr("clipper.config.norm_type"));
  h.set_config_text(config_text("value", kPartsRef + ", clip_value = 0"));
  EXPECT_THAT(h.build_error(), HasSubstr("clipper.config.clip_value"));
  h.set_config_text(config_text("fsdp1", R"(max_norm = 1.0, norm_type = "P2_NORM")"));
  EXPECT_THAT(h.build_error(), HasSubstr("clipper.config.wrapped_model"));
  h.set_config_text(config_text("norm", R"(model_parts = [], max_norm = 1.0, norm_type = "P2_NORM")"));
  EXPECT_THAT(h.build_error(), HasSubstr("clipper.config.model_parts"));
}

}  // namespace
}  // namespace modalities::plugins::gradient_clippers
