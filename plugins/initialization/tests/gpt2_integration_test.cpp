// initialization with the real model/gpt2 (in-tree only: loads the bundled gpt2
// plugin next to this one). A small tutorial-style GPT-2 built on the meta
// device is materialized, reset and initialized by model/model_initialized,
// then runs a forward pass. Distribution tolerance: 6 standard errors, as in
// initialization_test.cpp.
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/run_context.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <regex>
#include <string>
#include <vector>

namespace modalities::plugins::initialization {
namespace {

using ::testing::HasSubstr;

// Tutorial architecture (Modalities' tutorial config) with a small vocabulary: RoPE, GQA 8/4,
// SwiGLU (hidden 256), bias-free linears and norms, untied.
const std::string kGraph = R"(
[model_raw]
component_key = "model"
variant_key = "gpt2"

[model_raw.config]
sample_key = "input_ids"
prediction_key = "logits"
use_meta_device = @META@
poe_type = "NOPE"
sequence_length = 64
vocab_size = 1024
n_layer = 2
n_head_q = 8
n_head_kv = 4
n_embd = 128
ffn_hidden = 128
dropout = 0.0
bias = false
attention_implementation = "pytorch_flash"
activation_type = "swiglu"
use_weight_tying = false
seed = 42

[[model_raw.config.attention_config.qkv_transforms]]
type_hint = "RotaryTransform"
config = { n_embd = 128, n_head = 8, seq_length_dim = -2, base_freq = 100000 }

[model_raw.config.attention_norm_config]
norm_type = "pytorch_rms_norm"
config = { normalized_shape = 128, eps = 1e-5 }

[model_raw.config.ffn_norm_config]
norm_type = "pytorch_rms_norm"
config = { normalized_shape = 128, eps = 1e-5 }

[model_raw.config.lm_head_norm_config]
norm_type = "pytorch_rms_norm"
config = { normalized_shape = 128, eps = 1e-5 }

[model]
component_key = "model"
variant_key = "model_initialized"

[model.config]
model = { instance_key = "model_raw", pass_type = "BY_REFERENCE" }

[model.config.model_initializer]
component_key = "model_initialization"
variant_key = "@VARIANT@"
config = { @INIT@ }
)";

std::string graph(bool meta, const std::string& variant, const std::string& init) {
  std::string s = kGraph;
  s.replace(s.find("@META@"), 6, meta ? "true" : "false");
  s.replace(s.find("@VARIANT@"), 9, variant);
  s.replace(s.find("@INIT@"), 6, init);
  return s;
}

at::Tensor select(const Module& m, const std::string& pattern) {
  const std::regex re(pattern);
  std::vector<at::Tensor> parts;
  for (const auto& [name, t] : m.named_parameters())
    if (std::regex_match(name, re)) parts.push_back(t.detach().reshape({-1}).to(at::kDouble));
  EXPECT_FALSE(parts.empty()) << pattern;
  return parts.empty() ? at::zeros({1}, at::kDouble) : at::cat(parts);
}

void expect_normal(const at::Tensor& x, double std, const std::string& what) {
  const double n = static_cast<double>(x.numel());
  EXPECT_NEAR(x.mean().item<double>(), 0.0, 6 * std / std::sqrt(n)) << what;
  EXPECT_NEAR(x.std().item<double>(), std, 6 * std / std::sqrt(2 * n)) << what;
}

class Gpt2InitializationTest : public ::testing::Test {
 protected:
  void SetUp() override { h.load_plugin(MODALITIES_TEST_GPT2_PLUGIN); }
  std::shared_ptr<Module> build(bool meta, const std::string& variant, const std::string& init) {
    h.set_config_text(graph(meta, variant, init));
    auto m = h.get<Module>("model");
    EXPECT_NE(m, nullptr) << h.build_error();
    return m;
  }
  // Every tensor materialized on the run device, and a forward pass gives finite logits.
  void expect_usable(Module& m) {
    for (const auto& [name, t] : m.state_dict()) EXPECT_EQ(t.device(), run_device()) << name;
    const at::Tensor ids = at::randint(0, 1024, {2, 16}, at::TensorOptions(at::kLong).device(run_device()));
    const at::Tensor logits = m.forward({{"input_ids", ids}}).at("logits");
    EXPECT_EQ(logits.sizes(), (std::vector<std::int64_t>{2, 16, 1024}));
    EXPECT_TRUE(at::isfinite(logits).all().item<bool>());
  }
  testing::Harness h{MODALITIES_TEST_PLUGIN};
};

TEST_F(Gpt2InitializationTest, ComposedScaledOnAMetaDeviceGpt2) {
  auto m = build(true, "composed",
                 R"(model_type = "gpt2", weight_init_type = "scaled", mean = 0.0, std = 0.02, num_layers = 2)");
  ASSERT_NE(m, nullptr);
  expect_usable(*m);
  expect_normal(select(*m, R"(transformer\.(wte|lm_head)\.weight)"), 0.02, "embeddings");
  expect_normal(select(*m, R"(transformer\.h\.\d+\.(attn\.(q_attn|k_attn|v_attn)|mlp\.(W|V))\.weight)"), 0.02,
                "q/k/v/W/V");
  expect_normal(select(*m, R"(transformer\.h\.\d+\.(attn\.c_proj|mlp\.W_2)\.weight)"), 0.01,
                "c_proj/W_2: 0.02/sqrt(4)");
  EXPECT_TRUE(select(*m, R"(.*norm\.weight)").eq(1.0).all().item<bool>()) << "norms reset to 1";
  // RoPE inv_freq recomputed by reset_parameters: 1 / 100000^(2j/16)
  const at::Tensor inv_freq = m->state_dict().at("transformer.h.0.attn.qkv_transforms.0.inv_freq");
  EXPECT_NEAR(inv_freq[1].item<double>(), 0.237137362, 1e-7);
}

TEST_F(Gpt2InitializationTest, Llama3LikeOnAMetaDeviceGpt2) {
  auto m = build(true, "gpt2_llama3_like", "num_layers = 2, n_embd = 128");
  ASSERT_NE(m, nullptr);
  expect_usable(*m);
  expect_normal(select(*m, R"(transformer\.wte\.weight)"), 1.0, "wte");
  const at::Tensor lm_head = select(*m, R"(transformer\.lm_head\.weight)");
  EXPECT_LE(lm_head.abs().max().item<double>(), 3.0 / std::sqrt(128.0));
  expect_normal(lm_head, 0.986582 / std::sqrt(128.0), "lm_head (truncated at 3 sigma)");
  expect_normal(select(*m, R"(transformer\.h\.1\.(attn\.c_proj|mlp\.(V|W_2))\.weight)"), 0.01, "layer 1: 0.02/sqrt(4)");
}

TEST_F(Gpt2InitializationTest, MaterializedGpt2IsResetThenInitialized) {
  auto m = build(false, "composed", R"(model_type = "gpt2", weight_init_type = "plain", mean = 0.0, std = 0.05)");
  ASSERT_NE(m, nullptr);
  expect_usable(*m);
  expect_normal(select(*m, R"(transformer\.h\.\d+\.attn\.c_proj\.weight)"), 0.05, "c_proj (plain)");
}

TEST_F(Gpt2InitializationTest, Llama3LikeRejectsATiedGpt2) {
  h.set_config_text(graph(false, "gpt2_llama3_like", "num_layers = 2, n_embd = 128"));
  h.set("model_raw.config.use_weight_tying", Value(true));
  EXPECT_THAT(h.build_error(), HasSubstr(R"(rule 'transformer\.lm_head\.weight' matches no parameter)"));
}

}  // namespace
}  // namespace modalities::plugins::initialization
