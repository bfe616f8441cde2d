// layer_norm: each variant built through the registry from the example
// config, compared with plain LibTorch (and the RMSLayerNorm formula of
// Modalities) on random inputs; parameters named as in PyTorch.
#include <modalities/sdk/interfaces/module.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

namespace modalities::plugins::layer_norm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const std::filesystem::path kExample =
    std::filesystem::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml";

std::vector<std::string> names(const Module& m) {
  std::vector<std::string> out;
  for (const auto& [n, t] : m.named_parameters()) out.push_back(n);
  return out;
}

// Stated tolerance: identical kernels on identical inputs, so differences are rounding only.
void expect_close(const at::Tensor& a, const at::Tensor& b, double tol = 1e-6) {
  const double maxdiff = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  EXPECT_LE(maxdiff, tol) << "max difference " << maxdiff;
}

class LayerNormTest : public ::testing::Test {
 protected:
  void SetUp() override { at::manual_seed(0); }
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
};

TEST_F(LayerNormTest, PytorchRmsNormMatchesLibTorch) {
  auto m = h.get<Module>("attention_norm");
  ASSERT_NE(m, nullptr);
  EXPECT_THAT(names(*m), ElementsAre("weight"));
  const at::Tensor x = at::randn({2, 5, 64});
  const at::Tensor w = at::randn({64});
  m->load_state_dict({{"weight", w}}, true);
  expect_close(m->forward({{"input", x}}).at("output"), x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-5) * w);
}

TEST_F(LayerNormTest, LayerNormWithoutBiasMatchesLibTorch) {
  auto m = h.get<Module>("ffn_norm");
  EXPECT_THAT(names(*m), ElementsAre("weight"));
  const at::Tensor x = at::randn({3, 64});
  const at::Tensor w = at::randn({64});
  m->load_state_dict({{"weight", w}}, true);
  expect_close(m->forward({{"input", x}}).at("output"), at::layer_norm(x, {64}, w, {}, 1e-5));
}

TEST_F(LayerNormTest, RmsLayerNormNormalisesInFloat32ThenScales) {
  auto m = h.get<Module>("lm_head_norm");
  EXPECT_THAT(names(*m), ElementsAre("weight", "bias"));
  const at::Tensor w = at::randn({64}), b = at::randn({64});
  m->load_state_dict({{"weight", w}, {"bias", b}}, true);
  const at::Tensor x = at::randn({4, 64}).to(at::kBFloat16);
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor expected = (xf * at::rsqrt(xf.pow(2).mean(-1, true) + 1e-6)).to(at::kBFloat16) * w + b;
  const at::Tensor y = m->forward({{"input", x}}).at("output");
  EXPECT_EQ(y.scalar_type(), expected.scalar_type());
  expect_close(y, expected, 0.0);
}

TEST_F(LayerNormTest, RejectsWrongInputWidth) {
  auto m = h.get<Module>("attention_norm");
  EXPECT_THROW(m->forward({{"input", at::randn({2, 63})}}), std::exception);
  EXPECT_THROW(m->forward({{"wrong_key", at::randn({2, 64})}}), std::exception);
}

TEST_F(LayerNormTest, ValidatorsNameTheConfigPath) {
  h.set("attention_norm.config.normalized_shape", Value(0));
  EXPECT_THAT(h.build_error(), HasSubstr("attention_norm.config.normalized_shape: must be >= 1, got 0"));
  h.set("attention_norm.config.normalized_shape", Value(1.5));
  EXPECT_THAT(h.build_error(), HasSubstr("attention_norm.config.normalized_shape: expected an integer"));
  h.set("attention_norm.config.normalized_shape", Value(64));
  h.set("lm_head_norm.config.epsilon", Value(-1.0));
  EXPECT_THAT(h.build_error(), HasSubstr("lm_head_norm.config.epsilon: must be > 0"));
  h.set("lm_head_norm.config.epsilon", Value(1e-6));
  h.set("ffn_norm.config.eps_typo", Value(1e-6));
  EXPECT_THAT(h.build_error(), HasSubstr("ffn_norm.config.eps_typo: unknown key"));
}

}  // namespace
}  // namespace modalities::plugins::layer_norm
