// mfu with the real model/gpt2 (in-tree only: loads the bundled gpt2 plugin).
// The Modalities tutorial model must give Modalities'
// flops_per_token exactly: 79,830,528 untied (built on the meta device, nothing
// allocated) and 41,197,056 tied (the shared matrix counts once); a MoE model its active parameters.
#include <modalities/sdk/interfaces/mfu_calculator.h>
#include <modalities/testing/harness.h>

#include <gtest/gtest.h>

#include <string>

namespace modalities::plugins::mfu {
namespace {

const std::string kTutorial = R"(
[wrapped_model]
component_key = "model"
variant_key = "gpt2"

[wrapped_model.config]
sample_key = "input_ids"
prediction_key = "logits"
use_meta_device = @META@
poe_type = "NOPE"
sequence_length = 256
vocab_size = 50304
n_layer = 2
n_head_q = 8
n_head_kv = 4
n_embd = 128
ffn_hidden = 128
dropout = 0.0
bias = false
attention_implementation = "manual"
activation_type = "swiglu"
use_weight_tying = @TIED@

[[wrapped_model.config.attention_config.qkv_transforms]]
type_hint = "RotaryTransform"
config = { n_embd = 128, n_head = 8, seq_length_dim = -2, base_freq = 100000 }

[wrapped_model.config.attention_norm_config]
norm_type = "rms_norm"
config = { ndim = 128, bias = true, epsilon = 1e-5 }

[wrapped_model.config.ffn_norm_config]
norm_type = "rms_norm"
config = { ndim = 128, bias = true, epsilon = 1e-5 }

[wrapped_model.config.lm_head_norm_config]
norm_type = "rms_norm"
config = { ndim = 128, bias = true, epsilon = 1e-5 }

[mfu_calculator]
component_key = "mfu_calculator"
variant_key = "gpt2"
config = { n_layer = 2, sequence_length = 256, n_embd = 128, world_size = 1, peak_flops_per_device = 1.0, wrapped_model = { instance_key = "wrapped_model", pass_type = "BY_REFERENCE" } }
)";

double flops_per_token(bool tied) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.load_plugin(MODALITIES_TEST_GPT2_PLUGIN);
  std::string text = kTutorial;
  text.replace(text.find("@META@"), 6, tied ? "false" : "true");  // meta + tying is not allowed
  text.replace(text.find("@TIED@"), 6, tied ? "true" : "false");
  h.set_config_text(text);
  auto mfu = h.get<MFUCalculator>("mfu_calculator");
  EXPECT_NE(mfu, nullptr) << h.build_error();
  // peak 1 FLOP/s on one device: compute(1 / sequence_length) = flops_per_token (1/256 is exact)
  return mfu ? mfu->compute(1.0 / 256) : 0.0;
}

TEST(MfuGpt2Test, TutorialModelUntied) { EXPECT_EQ(flops_per_token(false), 79'830'528); }

// The tutorial model (untied, meta device) as model/gpt2_moe with block 1 a MoE block: 8 experts
// of hidden 64, top-2, one gated shared expert of hidden 96. MFU counts what one token computes
// with, by hand: the tutorial's 13,174,016 parameters, less block 1's SwiGLU (3 x 256 x 128 =
// 98,304), plus the router (8 x 128 = 1,024), 2/8 of the routed experts (3 x 8 x 64 x 128 =
// 196,608: 49,152), the shared expert (3 x 96 x 128 = 36,864) and its gate (128): 13,162,880, so
// 6 N + 12 L T d = 78,977,280 + 786,432. (Every expert would give 13,310,336 and 80,648,448.)
TEST(MfuGpt2Test, MoeModelCountsTheActiveParameters) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.load_plugin(MODALITIES_TEST_GPT2_PLUGIN);
  h.load_plugin(MODALITIES_TEST_MOE_PLUGIN);
  std::string text = kTutorial;
  text.replace(text.find("@META@"), 6, "true");
  text.replace(text.find("@TIED@"), 6, "false");
  text.replace(text.find("variant_key = \"gpt2\""), 20, "variant_key = \"gpt2_moe\"");
  text.replace(text.find("[mfu_calculator]"), 16,
               "[wrapped_model.config.moe_config]\nnum_experts = 8\ntop_k = 2\nmoe_ffn_hidden = 64\n"
               "score_function = \"softmax\"\nnum_shared_experts = 1\nshared_expert_ffn_hidden_per_expert = 96\n"
               "shared_expert_gate = true\nfirst_k_dense_replace = 1\n\n[mfu_calculator]");
  h.set_config_text(text);
  auto mfu = h.get<MFUCalculator>("mfu_calculator");
  ASSERT_NE(mfu, nullptr) << h.build_error();
  EXPECT_EQ(mfu->compute(1.0 / 256), 79'763'712);
}

TEST(MfuGpt2Test, TutorialModelTied) { EXPECT_EQ(flops_per_token(true), 41'197'056); }

}  // namespace
}  // namespace modalities::plugins::mfu
