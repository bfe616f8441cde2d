// Hugging Face interop of the Mixture-of-Experts families (README.md, "Hugging Face interop"):
// Modalities' model/huggingface_pretrained_model hands Mixtral, Qwen2-MoE and Qwen3-MoE folders to
// model/huggingface_pretrained_moe_model, which loads them into model/gpt2_moe; the export writes
// them back. The references are transformers 4.57.6's own models on the same weights and tokens
// (tests/data/hf, written by scripts/reference/make_hf_fixtures.py; no Python in CI).
#include "huggingface.h"  // plugins/gpt2: hf::read_config, hf::to_huggingface
#include "hf_folders.h"   // plugins/gpt2/tests: import_toml, copy_with_config

#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/safetensors.h>
#include <modalities/sdk/huggingface.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/scratch_dir.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <simdjson.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>

namespace modalities::plugins::moe {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::hf::copy_with_config;
using testing::hf::import_toml;

const fs::path kHf = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "tests" / "data" / "hf";
const fs::path kExample = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml";
const char* const kFamilies[] = {"mixtral", "qwen2_moe", "qwen3_moe"};

// The bound: logits within 1e-5 of the largest logit; gradients within 1e-5 of their
// largest entry (the block test's bound, tests/moe_test.cpp).
constexpr double kTol = 1e-5;

// A harness with both plugins: gpt2 registers model/huggingface_pretrained_model, this one the
// variant it hands the MoE families to.
std::unique_ptr<testing::Harness> harness() {
  auto h = std::make_unique<testing::Harness>(MODALITIES_TEST_PLUGIN);
  h->load_plugin(MODALITIES_TEST_GPT2_PLUGIN);
  return h;
}

std::shared_ptr<Module> import_model(testing::Harness& h, const fs::path& folder) {
  h.set_config_text(import_toml(folder));
  return h.get<Module>("model");
}

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  return ((x - y).abs().max() / at::clamp_min(y.abs().max(), 1e-30)).item<double>();
}

at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& ids) {
  const std::int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.narrow(1, 0, logits.size(1) - 1).reshape({-1, V}),
                                ids.narrow(1, 1, ids.size(1) - 1).reshape({-1}));
}

TEST(MoeHuggingFaceTest, ImportsReproduceTransformersLogitsAndGradients) {
  for (const char* family : kFamilies) {
    SCOPED_TRACE(family);
    const fs::path folder = kHf / fmt::format("import_{}", family);
    auto h = harness();
    auto m = import_model(*h, folder);
    ASSERT_NE(m, nullptr) << h->build_error();
    m->eval();
    // It is model/gpt2_moe: routed experts stacked.
    const StateDict sd = m->state_dict();
    EXPECT_TRUE(sd.contains("transformer.h.1.mlp.experts.w1") || sd.contains("transformer.h.0.mlp.experts.w1"));
    const StateDict ref = formats::read_safetensors(folder / "reference.safetensors");
    const at::Tensor& ids = ref.at("input_ids");
    const at::Tensor logits = m->forward({{"input_ids", ids}}).at("logits");
    const double d = rel_diff(logits.detach(), ref.at("logits"));
    EXPECT_LE(d, kTol);
    const at::Tensor loss = next_token_loss(logits, ids);
    EXPECT_NEAR(loss.item<double>(), ref.at("loss").item<double>(), 1e-5 * ref.at("loss").item<double>());
    loss.backward();
    // Our gradients under transformers' names (the export's mapping: experts unstacked).
    StateDict grads;
    for (const auto& [name, p] : m->named_parameters()) {
      ASSERT_TRUE(p.grad().defined()) << name;
      grads.emplace(name, p.grad());
    }
    const gpt2::hf::ImportedConfig config = gpt2::hf::read_config(folder);
    const HuggingFaceCheckpoint g = gpt2::hf::to_huggingface(config.spec, grads, {});
    double worst = 0;
    std::size_t checked = 0;
    for (const auto& [name, theirs] : ref) {
      if (!name.starts_with("grad/")) continue;
      const std::string hf_name = name.substr(5);
      if (config.spec.tie_word_embeddings && hf_name == "lm_head.weight") continue;  // the embedding's
      ASSERT_TRUE(g.tensors.contains(hf_name)) << hf_name;
      const double e = rel_diff(g.tensors.at(hf_name), theirs);
      EXPECT_LE(e, kTol) << hf_name;
      worst = std::max(worst, e);
      ++checked;
    }
    EXPECT_EQ(checked, g.tensors.size());
    std::cout << fmt::format("[ import {:10s} ] logits {:.2e}, {} gradients worst {:.2e} (of their largest entry)\n",
                             family, d, checked, worst);
  }
}

// Every key of the original config.json in `keys` has the same value in the export's.
void expect_same_fields(const fs::path& original, const fs::path& exported, std::initializer_list<const char*> keys) {
  simdjson::dom::parser pa, pb;
  simdjson::dom::element a, b;
  ASSERT_FALSE(pa.load(original.string()).get(a));
  ASSERT_FALSE(pb.load(exported.string()).get(b));
  for (const char* key : keys) {
    simdjson::dom::element x, y;
    if (a[key].get(x) || x.is_null()) continue;  // absent or null: transformers' default
    ASSERT_FALSE(b[key].get(y)) << exported << " lacks " << key;
    EXPECT_EQ(simdjson::minify(x), simdjson::minify(y)) << key;
  }
}

TEST(MoeHuggingFaceTest, ImportThenExportGivesTheOriginalTensorsAndConfig) {
  for (const char* family : kFamilies) {
    SCOPED_TRACE(family);
    const fs::path folder = kHf / fmt::format("import_{}", family);
    auto h = harness();
    auto m = import_model(*h, folder);
    ASSERT_NE(m, nullptr) << h->build_error();
    const HuggingFaceCheckpoint c = dynamic_cast<const HuggingFaceExportable&>(*m).to_huggingface({});
    StateDict original = formats::read_huggingface_weights(folder);
    if (!c.tensors.contains("lm_head.weight")) original.erase("lm_head.weight");  // tied: stored once
    ASSERT_EQ(c.tensors.size(), original.size());
    for (const auto& [name, t] : original) {
      ASSERT_TRUE(c.tensors.contains(name)) << name;
      EXPECT_TRUE(at::equal(c.tensors.at(name), t)) << name;
    }
    const modalities::testing::ScratchDir tmp;
    const fs::path out = tmp.path() / "hf";
    formats::write_huggingface_folder(out, c, 5'000'000'000ULL);
    expect_same_fields(folder / "config.json", out / "config.json",
                       {"model_type",
                        "architectures",
                        "vocab_size",
                        "hidden_size",
                        "intermediate_size",
                        "num_hidden_layers",
                        "num_attention_heads",
                        "num_key_value_heads",
                        "head_dim",
                        "rope_theta",
                        "rms_norm_eps",
                        "tie_word_embeddings",
                        "sliding_window",
                        "attention_bias",
                        "qkv_bias",
                        "num_local_experts",
                        "num_experts",
                        "num_experts_per_tok",
                        "moe_intermediate_size",
                        "shared_expert_intermediate_size",
                        "norm_topk_prob",
                        "decoder_sparse_step",
                        "mlp_only_layers"});
    // ... and it loads back to the same model.
    auto h2 = harness();
    auto back = import_model(*h2, out);
    ASSERT_NE(back, nullptr) << h2->build_error();
    for (const auto& [name, t] : m->state_dict()) EXPECT_TRUE(at::equal(back->state_dict().at(name), t)) << name;
  }
}

// model/gpt2_moe's example (Qwen2-MoE style: a gated shared expert, block 0 dense) is exported as
// Qwen2-MoE and reads back to the same logits.
TEST(MoeHuggingFaceTest, AGpt2MoeModelExportsAsItsFamily) {
  testing::Harness h(MODALITIES_TEST_PLUGIN, kExample);
  h.load_plugin(MODALITIES_TEST_GPT2_PLUGIN);
  auto m = h.get<Module>("model_raw");
  ASSERT_NE(m, nullptr) << h.build_error();
  m->eval();
  const HuggingFaceCheckpoint c = dynamic_cast<const HuggingFaceExportable&>(*m).to_huggingface({});
  EXPECT_EQ(c.architecture, "Qwen2MoeForCausalLM");
  EXPECT_THAT(c.config_json, HasSubstr("\"mlp_only_layers\": [0]"));
  EXPECT_THAT(c.config_json, HasSubstr("\"shared_expert_intermediate_size\": 256"));
  EXPECT_TRUE(c.tensors.contains("model.layers.1.mlp.experts.7.down_proj.weight"));
  EXPECT_TRUE(c.tensors.contains("model.layers.0.mlp.gate_proj.weight"));
  const modalities::testing::ScratchDir tmp;
  formats::write_huggingface_folder(tmp.path() / "hf", c, 5'000'000'000ULL);
  auto h2 = harness();
  auto back = import_model(*h2, tmp.path() / "hf");
  ASSERT_NE(back, nullptr) << h2->build_error();
  back->eval();
  const at::Tensor ids = at::randint(0, 256, {2, 16}, at::kLong);
  at::NoGradGuard g;
  EXPECT_TRUE(
      at::equal(back->forward({{"input_ids", ids}}).at("logits"), m->forward({{"input_ids", ids}}).at("logits")));
  // Routing without a transformers counterpart is refused, naming the key.
  testing::Harness sig(MODALITIES_TEST_PLUGIN, kExample);
  sig.set("model_raw.config.moe_config.score_function", std::string("sigmoid"));
  auto s = sig.get<Module>("model_raw");
  ASSERT_NE(s, nullptr) << sig.build_error();
  EXPECT_THAT([&] { dynamic_cast<const HuggingFaceExportable&>(*s).to_huggingface({}); },
              ::testing::ThrowsMessage<Error>(HasSubstr("score_function 'sigmoid'")));
}

std::string import_error(const fs::path& folder, bool with_moe = true) {
  testing::Harness h(with_moe ? MODALITIES_TEST_PLUGIN : MODALITIES_TEST_GPT2_PLUGIN);
  if (with_moe) h.load_plugin(MODALITIES_TEST_GPT2_PLUGIN);
  h.set_config_text(import_toml(folder));
  return h.build_error();
}

TEST(MoeHuggingFaceTest, WhatCannotBeImportedIsNamed) {
  // Without this plugin, model/gpt2 says who imports the family.
  EXPECT_THAT(import_error(kHf / "import_mixtral", /*with_moe=*/false),
              ::testing::AllOf(HasSubstr("(mixtral) is a Mixture-of-Experts family"), HasSubstr("plugins/moe"),
                               HasSubstr("model/huggingface_pretrained_moe_model is not registered")));
  const modalities::testing::ScratchDir tmp;
  copy_with_config(kHf / "import_mixtral", tmp.path() / "jitter", "\"router_jitter_noise\": 0.0",
                   "\"router_jitter_noise\": 0.1");
  EXPECT_THAT(import_error(tmp.path() / "jitter"), HasSubstr("'router_jitter_noise' must be 0"));
  copy_with_config(kHf / "import_mixtral", tmp.path() / "topk", "\"num_experts_per_tok\": 2",
                   "\"num_experts_per_tok\": 5");
  EXPECT_THAT(import_error(tmp.path() / "topk"), HasSubstr("'num_experts_per_tok' is 5, more than the 4 experts"));
  copy_with_config(kHf / "import_qwen2_moe", tmp.path() / "layers", "\"mlp_only_layers\": [\n    1\n  ]",
                   "\"mlp_only_layers\": [\n    7\n  ]");
  EXPECT_THAT(import_error(tmp.path() / "layers"), HasSubstr("'mlp_only_layers' has 7, which is not a layer"));
  copy_with_config(kHf / "import_qwen2_moe", tmp.path() / "experts", "\"num_experts\": 4", "\"num_experts\": 3");
  EXPECT_THAT(import_error(tmp.path() / "experts"),
              HasSubstr("'model.layers.0.mlp.gate.weight' is [4, 32]; config.json implies [3, 32]"));
}

}  // namespace
}  // namespace modalities::plugins::moe
