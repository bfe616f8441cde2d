// model/coca against Modalities 0.5.0's own CoCa (scripts/reference/make_coca_reference.py; no
// Python at test time): the same weights and inputs give the captioning logits, the pooled image
// and text embeddings and every parameter's gradient, in float64, within 1e-5 of the largest value
// (measured: ~1e-7, the float32 rounding of the stored results); the state dict has Modalities'
// names (the mask buffers of default_attention and the tied lm_head included) and
// named_parameters its order; bad configs are refused by key.
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/safetensors.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace modalities::plugins::coca {
namespace {

using ::testing::HasSubstr;

const std::filesystem::path kDir = MODALITIES_TEST_PLUGIN_SOURCE_DIR;
const std::filesystem::path kReference = kDir / "tests" / "data" / "coca_reference.safetensors";

// The reference cases' configs (make_coca_reference.py's CASES), as TOML.
std::string coca_toml(const std::string& engine, const std::string& activation, bool add_cls_token, bool text_bias,
                      bool bias_attn_pool, int vision_layers) {
  return fmt::format(R"(
[m]
component_key = "model"
variant_key = "coca"
[m.config]
prediction_key = "logits"
vision_embd_prediction_key = "vision_embeddings"
text_embd_prediction_key = "text_embeddings"
vision_cls_prediction_key = "vision_cls"
text_cls_prediction_key = "text_cls"
n_pool_head = 4
n_vision_queries = 3
bias_attn_pool = {4}
epsilon_attn_pool = 1e-5
[m.config.vision_encoder_config]
sample_key = "images"
prediction_key = "vision_embeddings"
img_size = 8
n_classes = "${{null:}}"
n_layer = {5}
attention_config = {{ attention_engine_type = "{0}" }}
n_head = 2
n_embd = 8
dropout = 0.0
patch_size = 4
patch_stride = 4
n_img_channels = 3
add_cls_token = {2}
bias = true
[m.config.text_decoder_config]
sample_key = "input_ids"
prediction_key = "logits"
block_size = 8
vocab_size = 64
n_layer_text = 2
n_layer_multimodal_text = 2
attention_config = {{ attention_engine_type = "{0}" }}
n_head = 2
ffn_hidden = 48
n_embd = 8
dropout = 0.0
bias = {3}
activation = "{1}"
epsilon = 1e-5
)",
                     engine, activation, add_cls_token ? "true" : "false", text_bias ? "true" : "false",
                     bias_attn_pool ? "true" : "false", vision_layers);
}

struct Case {
  const char* name;
  std::string toml;
};

std::vector<Case> cases() {
  return {{"swiglu_default", coca_toml("default_attention", "swiglu", false, true, false, 1)},
          {"gelu_flash", coca_toml("pytorch_flash_attention", "gelu", true, false, true, 1)}};
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

double relative(const at::Tensor& got, const at::Tensor& want) {
  const double scale = want.abs().max().item<double>();
  return (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>() / (scale > 0 ? scale : 1.0);
}

TEST(CocaTest, MatchesModalitiesCocaOnTheSameWeightsAndInputs) {
  const StateDict ref = formats::read_safetensors(kReference);
  const auto meta = formats::read_safetensors_metadata(kReference);
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const std::string p = std::string(c.name) + ".";
    testing::Harness h{MODALITIES_TEST_PLUGIN};
    h.set_config_text(c.toml);
    auto m = h.get<Module>("m");
    ASSERT_NE(m, nullptr) << h.build_error();
    m->to(c10::Device(c10::kCPU), at::kDouble);

    // Names: the state dict's keys are Modalities', the parameters in its order.
    const StateDict own = m->state_dict();
    std::set<std::string> keys;
    for (const auto& [k, v] : own) keys.insert(k);
    const std::vector<std::string> want_keys = lines(meta.at(p + "state_dict_keys"));
    EXPECT_EQ(keys, std::set<std::string>(want_keys.begin(), want_keys.end()));
    std::vector<std::string> names;
    for (const auto& [k, v] : m->named_parameters()) names.push_back(k);
    EXPECT_EQ(names, lines(meta.at(p + "named_parameters")));

    // Modalities' weights (the mask buffers are tril of ones in both).
    StateDict weights;
    for (const auto& [k, v] : ref)
      if (k.starts_with(p + "state.")) weights[k.substr(p.size() + 6)] = v.to(at::kDouble);
    for (const auto& [k, v] : own)
      if (!weights.contains(k)) {
        ASSERT_EQ(v.dim(), 4) << k << " is neither in the reference nor a mask buffer";
        EXPECT_TRUE(at::equal(v, at::ones({1024, 1024}, v.options()).tril().view({1, 1, 1024, 1024}))) << k;
        weights[k] = v;
      }
    m->load_state_dict(weights, /*strict=*/true);

    const TensorMap out =
        m->forward({{"images", ref.at(p + "images").to(at::kDouble)}, {"input_ids", ref.at(p + "input_ids")}});
    at::Tensor loss = at::zeros({}, at::kDouble);
    for (const std::string key : {"logits", "vision_cls", "text_cls"}) {
      const at::Tensor& got = out.at(key);
      const at::Tensor& want = ref.at(p + "out." + key);
      ASSERT_EQ(got.sizes(), want.sizes()) << key;
      const double d = relative(got.detach(), want);
      std::printf("%s %s: %.2e of the largest value\n", c.name, key.c_str(), d);
      EXPECT_LE(d, 1e-5) << key;
      loss = loss + (got * ref.at(p + "w." + key).to(at::kDouble)).sum();
    }
    loss.backward();
    double worst = 0;
    std::string worst_name;
    for (const auto& [k, t] : m->named_parameters()) {
      ASSERT_TRUE(t.grad().defined()) << k;
      const double d = relative(t.grad(), ref.at(p + "grad." + k));
      if (d > worst) worst = d, worst_name = k;
    }
    std::printf("%s gradients: worst %.2e of its largest value (%s)\n", c.name, worst, worst_name.c_str());
    EXPECT_LE(worst, 1e-5) << worst_name;
  }
}

TEST(CocaTest, TheExampleConfigBuildsAndRunsInFloat32) {
  testing::Harness h{MODALITIES_TEST_PLUGIN, kDir / "configs" / "example.toml"};
  auto m = h.get<Module>("model_raw");
  ASSERT_NE(m, nullptr) << h.build_error();
  // Images as Modalities' dummy dataset makes them (float64): cast to the model's dtype.
  const TensorMap out = m->forward(
      {{"images", at::randn({3, 3, 8, 8}, at::kDouble)}, {"input_ids", at::randint(0, 64, {3, 5}, at::kLong)}});
  EXPECT_EQ(out.at("logits").sizes(), (std::vector<std::int64_t>{3, 5, 64}));
  EXPECT_EQ(out.at("vision_cls").sizes(), (std::vector<std::int64_t>{3, 1, 16}));
  EXPECT_EQ(out.at("text_cls").sizes(), (std::vector<std::int64_t>{3, 1, 16}));
  EXPECT_EQ(out.at("logits").scalar_type(), at::kFloat);
  // The tied weight: one tensor under two names, listed once among the parameters.
  const StateDict sd = m->state_dict();
  EXPECT_TRUE(sd.at("text_decoder.transformer.wte.weight").is_same(sd.at("multimodal_decoder.lm_head.weight")));
  std::size_t listed = 0;
  for (const auto& [k, v] : m->named_parameters()) listed += k == "multimodal_decoder.lm_head.weight";
  EXPECT_EQ(listed, 0u);
}

TEST(CocaTest, BadConfigsAndInputsAreRefusedByKey) {
  const std::string base = coca_toml("default_attention", "swiglu", false, true, false, 1);
  const auto error = [&](const std::string& key, const Value& value) {
    testing::Harness h{MODALITIES_TEST_PLUGIN};
    h.set_config_text(base);
    h.set(key, value);
    return h.build_error();
  };
  EXPECT_THAT(error("m.config.vision_encoder_config.img_size", Value(std::int64_t{10})),
              HasSubstr("m.config.vision_encoder_config.img_size: the patches (patch_size 4, patch_stride 4) do not "
                        "tile the image height 10: 2 pixels would be left over"));
  EXPECT_THAT(error("m.config.vision_encoder_config.n_head", Value(std::int64_t{3})),
              HasSubstr("m.config.vision_encoder_config.n_head: must divide n_embd (8), got 3"));
  EXPECT_THAT(error("m.config.text_decoder_config.n_head", Value(std::int64_t{5})),
              HasSubstr("m.config.text_decoder_config.n_head: must divide n_embd (8), got 5"));
  EXPECT_THAT(error("m.config.n_pool_head", Value(std::int64_t{3})),
              HasSubstr("m.config.n_pool_head: must divide vision_encoder_config.n_embd (8), got 3"));
  EXPECT_THAT(error("m.config.vision_encoder_config.n_embd", Value(std::int64_t{32})),
              HasSubstr("text_decoder_config.n_embd is 8"));
  EXPECT_THAT(error("m.config.vision_encoder_config.n_classes", Value(std::int64_t{10})),
              HasSubstr("m.config.vision_encoder_config.n_classes: is 10; CoCa pools"));
  EXPECT_THAT(error("m.config.text_decoder_config.activation", Value("relu")),
              HasSubstr("m.config.text_decoder_config.activation"));

  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(base);
  auto m = h.get<Module>("m");
  const auto forward_error = [&](const TensorMap& in) {
    try {
      m->forward(in);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const at::Tensor ids = at::randint(0, 64, {2, 5}, at::kLong);
  EXPECT_THAT(forward_error({{"input_ids", ids}}),
              HasSubstr("the input has no 'images' (vision_encoder_config.sample_key); it has 'input_ids'"));
  EXPECT_THAT(forward_error({{"images", at::randn({2, 3, 16, 16})}, {"input_ids", ids}}),
              HasSubstr("expected floating-point images [B, 3, 8, 8]"));
  EXPECT_THAT(
      forward_error({{"images", at::randn({2, 3, 8, 8})}, {"input_ids", at::randint(0, 64, {2, 9}, at::kLong)}}),
      HasSubstr("longer than text_decoder_config.block_size 8"));
}

}  // namespace
}  // namespace modalities::plugins::coca
