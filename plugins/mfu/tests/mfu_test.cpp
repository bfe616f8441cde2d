// mfu: mfu_calculator/gpt2 built from TOML over a stand-in model with the
// parameter shapes of the Modalities tutorial config (plugins/gpt2/README.md; meta-device
// tensors, so nothing is allocated). Checks flops_per_token = 6·N + 12·L·T·d
// against Modalities' numbers (79,830,528 untied, 41,197,056 tied) exactly, the
// peak table, and the -1 cases.
#include "../src/peak_flops.h"

#include <modalities/sdk/interfaces/mfu_calculator.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/run_context.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <string>
#include <vector>

namespace modalities::plugins::mfu {
namespace {

using ::testing::HasSubstr;

// GPT-2 tutorial config: n_layer 2, n_embd 128, vocab 50304, SwiGLU hidden 256,
// k/v width 64, rms_norm with bias, no linear biases.
struct TutorialModelConfig {
  bool use_weight_tying = false;
  bool shard_wte = false;   // wte stored as a half shard, with its global shape in shard_placements()
  bool freeze_wpe = false;  // adds a frozen transformer.wpe.weight [256, 128] (requires_grad = false)
  static void describe(Schema<TutorialModelConfig>& s) {
    s.field("use_weight_tying", &TutorialModelConfig::use_weight_tying, "");
    s.field("shard_wte", &TutorialModelConfig::shard_wte, "");
    s.field("freeze_wpe", &TutorialModelConfig::freeze_wpe, "");
  }
};

class TutorialModel final : public Module {
 public:
  explicit TutorialModel(const TutorialModelConfig& c) : c_(c), root_(std::make_shared<torch::nn::Module>("GPT2LLM")) {
    auto& transformer = child(*root_, "transformer");
    const at::Tensor wte = meta({c.shard_wte ? 25152 : 50304, 128});
    child(transformer, "wte").register_parameter("weight", wte);
    if (c.freeze_wpe) child(transformer, "wpe").register_parameter("weight", meta({256, 128}), /*requires_grad=*/false);
    auto& h = child(transformer, "h");
    for (int i = 0; i < 2; ++i) {
      auto& block = child(h, std::to_string(i));
      for (const char* norm : {"attention_norm", "ffn_norm"}) {
        child(block, norm).register_parameter("weight", meta({128}));
        child(block, norm).register_parameter("bias", meta({128}));
      }
      auto& attn = child(block, "attn");
      child(attn, "q_attn").register_parameter("weight", meta({128, 128}));
      child(attn, "k_attn").register_parameter("weight", meta({64, 128}));
      child(attn, "v_attn").register_parameter("weight", meta({64, 128}));
      child(attn, "c_proj").register_parameter("weight", meta({128, 128}));
      child(child(attn, "qkv_transforms"), "0").register_buffer("inv_freq", meta({8}));
      auto& mlp = child(block, "mlp");
      child(mlp, "W").register_parameter("weight", meta({256, 128}));
      child(mlp, "V").register_parameter("weight", meta({256, 128}));
      child(mlp, "W_2").register_parameter("weight", meta({128, 256}));
    }
    child(transformer, "lm_head_norm").register_parameter("weight", meta({128}));
    child(transformer, "lm_head_norm").register_parameter("bias", meta({128}));
    child(transformer, "lm_head").register_parameter("weight", c.use_weight_tying ? wte : meta({50304, 128}));
  }
  TensorMap forward(const TensorMap&) override { return {}; }
  torch::nn::Module& module() override { return *root_; }
  const torch::nn::Module& module() const override { return *root_; }
  std::map<std::string, ShardPlacement> shard_placements() const override {
    if (!c_.shard_wte) return {};
    return {{"transformer.wte.weight", ShardPlacement{{50304, 128}, {0, 0}}}};
  }

 private:
  static at::Tensor meta(std::vector<std::int64_t> shape) { return at::empty(shape, at::device(at::kMeta)); }
  static torch::nn::Module& child(torch::nn::Module& parent, const std::string& name) {
    auto children = parent.named_children();
    if (auto* found = children.find(name)) return **found;
    return *parent.register_module(name, std::make_shared<torch::nn::Module>(name));
  }
  TutorialModelConfig c_;
  std::shared_ptr<torch::nn::Module> root_;
};

constexpr double kUntiedFlopsPerToken = 79'830'528;  // 6 * 13,174,016 + 12 * 2 * 256 * 128
constexpr double kTiedFlopsPerToken = 41'197'056;    // 6 * 6,735,104 + 12 * 2 * 256 * 128

std::string graph(const std::string& model_config, const std::string& mfu_extra) {
  return fmt::format(R"(
[wrapped_model]
component_key = "model"
variant_key = "tutorial_gpt2"
config = {{ {} }}

[mfu_calculator]
component_key = "mfu_calculator"
variant_key = "gpt2"

[mfu_calculator.config]
n_layer = 2
sequence_length = 256
n_embd = 128
world_size = 1
wrapped_model = {{ instance_key = "wrapped_model", pass_type = "BY_REFERENCE" }}
{}
)",
                     model_config, mfu_extra);
}

class MfuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto failure = h.registry().register_plugin(
        core::PluginInfo{"tutorial_gpt2_for_tests", "0.0.0", {}, {}, {}}, [](Registrar& r) {
          r.add<Module, TutorialModelConfig>(
              "tutorial_gpt2", "Tutorial GPT-2 shapes on the meta device.",
              [](const TutorialModelConfig& c) { return std::make_shared<TutorialModel>(c); });
        });
    ASSERT_FALSE(failure) << *failure;
  }
  // flops_per_token read back through compute(): with a peak of 1 FLOP/s on one
  // device, compute(1 / sequence_length) = flops_per_token (1/256 is exact).
  double flops_per_token(const std::string& model_config) {
    h.set_config_text(graph(model_config, "peak_flops_per_device = 1.0"));
    auto mfu = h.get<MFUCalculator>("mfu_calculator");
    EXPECT_NE(mfu, nullptr) << h.build_error();
    return mfu ? mfu->compute(1.0 / 256) : 0.0;
  }
  testing::Harness h{MODALITIES_TEST_PLUGIN};
};

TEST_F(MfuTest, FlopsPerTokenOfTheTutorialModel) {
  EXPECT_EQ(flops_per_token(""), kUntiedFlopsPerToken);
  EXPECT_EQ(flops_per_token("use_weight_tying = true"), kTiedFlopsPerToken) << "the tied matrix counts once";
  EXPECT_EQ(flops_per_token("shard_wte = true"), kUntiedFlopsPerToken) << "sharded parameters count globally";
  EXPECT_EQ(flops_per_token("freeze_wpe = true"), kUntiedFlopsPerToken) << "frozen parameters do not count";
}

TEST_F(MfuTest, MfuScalesWithThroughputAndWorldSize) {
  h.set_config_text(graph("", "peak_flops_per_device = 989e12"));
  h.set("mfu_calculator.config.world_size", Value(8));
  auto mfu = h.get<MFUCalculator>("mfu_calculator");
  ASSERT_NE(mfu, nullptr) << h.build_error();
  EXPECT_DOUBLE_EQ(mfu->compute(1000.0), 1000.0 * 256 * kUntiedFlopsPerToken / (989e12 * 8));
}

TEST_F(MfuTest, UnknownPeakGivesMinusOne) {
  if (run_device().is_cuda()) GTEST_SKIP() << "needs a CPU run device";
  h.set_config_text(graph("", ""));
  auto mfu = h.get<MFUCalculator>("mfu_calculator");
  ASSERT_NE(mfu, nullptr) << h.build_error();
  EXPECT_EQ(mfu->compute(1000.0), -1.0);
}

TEST_F(MfuTest, KnownGpuUsesTheTable) {
  if (!run_device().is_cuda()) GTEST_SKIP() << "needs CUDA";
  h.set_config_text(graph("", ""));
  auto mfu = h.get<MFUCalculator>("mfu_calculator");
  ASSERT_NE(mfu, nullptr) << h.build_error();
  const double value = mfu->compute(1000.0);
  // -1 on GPUs outside the table; otherwise one of the table's peaks.
  if (value != -1.0) {
    bool found = false;
    for (const auto& [prefix, peak] : kPeakFlops16Bit) found |= value == 1000.0 * 256 * kUntiedFlopsPerToken / peak;
    EXPECT_TRUE(found) << value;
  }
}

TEST(PeakFlopsTest, DeviceNamePrefixes) {
  EXPECT_EQ(peak_flops_for_device_name("NVIDIA A100-SXM4-80GB"), 312e12);
  EXPECT_EQ(peak_flops_for_device_name("NVIDIA H100 80GB HBM3"), 989e12);
  EXPECT_EQ(peak_flops_for_device_name("NVIDIA H200"), 989e12) << "added: Modalities reports -1 on H200";
  EXPECT_EQ(peak_flops_for_device_name("NVIDIA GH200 480GB"), 989e12);
  EXPECT_EQ(peak_flops_for_device_name("NVIDIA B200"), 2.25e15);
  EXPECT_EQ(peak_flops_for_device_name("Tesla V100-SXM2-16GB"), std::nullopt);
  EXPECT_EQ(peak_flops_for_device_name("NVIDIA L40S"), std::nullopt);
}

TEST_F(MfuTest, ValidatorsNameTheConfigPath) {
  h.set_config_text(graph("", ""));
  h.set("mfu_calculator.config.n_layer", Value(0));
  EXPECT_THAT(h.build_error(), HasSubstr("mfu_calculator.config.n_layer: must be > 0, got 0"));
  h.set_config_text(graph("", "peak_flops_per_device = 0.0"));
  EXPECT_THAT(h.build_error(), HasSubstr("mfu_calculator.config.peak_flops_per_device: must be > 0"));
  h.set_config_text(graph("", "model_parts = { instance_key = \"wrapped_model\", pass_type = \"BY_REFERENCE\" }"));
  EXPECT_THAT(h.build_error(), HasSubstr("both given"));
  h.set_config_text(graph("", ""));
  h.erase("mfu_calculator.config.wrapped_model");
  EXPECT_THAT(h.build_error(), HasSubstr("mfu_calculator.config.model_parts: missing required key"));
}

}  // namespace
}  // namespace modalities::plugins::mfu
