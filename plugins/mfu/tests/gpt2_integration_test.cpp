// mfu with the real model/gpt2 (in-tree only: loads the bundled gpt2 plugin).
// The Modalities tutorial model must give Modalities'
// flops_per_token exactly: 79,830,528 untied (built on the meta device, nothing
// allocated) and 41,197,056 tied (the shared matrix counts once).
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

TEST(MfuGpt2Test, TutorialModelTied) { EXPECT_EQ(flops_per_token(true), 41'197'056); }

}  // namespace
}  // namespace modalities::plugins::mfu
