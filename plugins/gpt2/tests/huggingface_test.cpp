// Hugging Face interop of the gpt2 plugin against transformers 4.57 (fixtures from
// scripts/reference/make_hf_fixtures.py, tests/data/hf/VERSIONS):
//  * import: model/huggingface_pretrained_model on tiny Llama (sharded files), Llama-3 RoPE
//    scaling with biases, Mistral with a sliding window, Qwen2 with linear RoPE scaling, GPT-2
//    (gelu_new, tied) and GPT-2 (exact GELU, untied) reproduces transformers' logits;
//  * export: model/gpt2 configs of each family, filled with known weights, compute transformers'
//    logits themselves, export to a config.json with the family's fields, and load back with the
//    same logits and identical tensors (ours -> HF -> ours);
//  * HF -> ours -> HF gives the very tensors of the original files;
//  * errors name the file, key and what is supported.
#include "hash_weights.h"
#include "hf_folders.h"

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

#include <unistd.h>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace modalities::plugins::gpt2 {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const fs::path kHf = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "tests" / "data" / "hf";

const char* const kImports[] = {"llama", "llama3_scaled_bias", "mistral_window", "qwen2_linear",
                                "qwen3", "mistral_head_dim",   "gpt2",           "gpt2_gelu_untied"};
const char* const kExports[] = {"llama", "qwen2_llama3_rope", "mistral_window", "qwen3", "gpt2"};

using TempDir = modalities::testing::ScratchDir;
using modalities::testing::hf::copy_with_config;
using modalities::testing::hf::import_toml;

std::shared_ptr<Module> import_model(testing::Harness& h, const fs::path& folder) {
  h.set_config_text(import_toml(folder));
  auto m = h.get<Module>("model");
  if (m) m->eval();
  return m;
}

// Worst |a - b| relative to the largest |b| (at least 1): logits here reach ~80.
double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  return ((x - y).abs().max() / at::clamp_min(y.abs().max(), 1.0)).item<double>();
}

at::Tensor logits_of(Module& m, const at::Tensor& ids) {
  at::NoGradGuard g;
  return m.forward({{"input_ids", ids}}).at("logits");
}

// Stated tolerance: transformers' and our kernels differ (fused GELU/RMSNorm/SDPA vs its eager
// ops); 2e-5 of the largest logit is about 150 float32 ulps there. Measured worst: see the test.
constexpr double kTol = 2e-5;

TEST(HuggingFaceImportTest, ReproducesTransformersLogits) {
  for (const char* family : kImports) {
    SCOPED_TRACE(family);
    const fs::path folder = kHf / fmt::format("import_{}", family);
    testing::Harness h{MODALITIES_TEST_PLUGIN};
    auto m = import_model(h, folder);
    ASSERT_NE(m, nullptr) << h.build_error();
    const StateDict ref = formats::read_safetensors(folder / "reference.safetensors");
    const at::Tensor logits = logits_of(*m, ref.at("input_ids"));
    EXPECT_EQ(logits.sizes(), ref.at("logits").sizes());
    const double d = rel_diff(logits, ref.at("logits"));
    EXPECT_LE(d, kTol) << family;
    std::cout << fmt::format("[ import {:20s} ] max |ours - transformers| / max|logit| = {:.2e}\n", family, d);
  }
}

// Tensors of a Hugging Face folder without what transformers recreates itself.
StateDict hf_weights(const fs::path& folder, bool tied) {
  StateDict w = formats::read_huggingface_weights(folder);
  for (auto it = w.begin(); it != w.end();) {
    const bool drop = it->first.ends_with(".attn.bias") || it->first.ends_with(".attn.masked_bias") ||
                      (tied && it->first == "lm_head.weight");
    it = drop ? w.erase(it) : std::next(it);
  }
  return w;
}

void expect_same_tensors(const StateDict& a, const StateDict& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(t.scalar_type() == b.at(name).scalar_type() && at::equal(t, b.at(name))) << name << " differs";
  }
}

// --- JSON comparison -------------------------------------------------------------------------------

bool json_equal(simdjson::dom::element a, simdjson::dom::element b) {
  using simdjson::dom::element_type;
  const auto numeric = [](element_type t) {
    return t == element_type::INT64 || t == element_type::UINT64 || t == element_type::DOUBLE;
  };
  if (numeric(a.type()) && numeric(b.type())) {
    double x = 0, y = 0;
    if (a.get_double().get(x)) x = static_cast<double>(std::int64_t(a));
    if (b.get_double().get(y)) y = static_cast<double>(std::int64_t(b));
    return x == y;
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case element_type::STRING: return std::string_view(a) == std::string_view(b);
    case element_type::BOOL: return bool(a) == bool(b);
    case element_type::NULL_VALUE: return true;
    case element_type::ARRAY: {
      simdjson::dom::array x = a, y = b;
      if (x.size() != y.size()) return false;
      for (std::size_t i = 0; i < x.size(); ++i)
        if (!json_equal(x.at(i), y.at(i))) return false;
      return true;
    }
    case element_type::OBJECT: {
      simdjson::dom::object x = a, y = b;
      if (x.size() != y.size()) return false;
      for (auto f : x) {
        simdjson::dom::element other;
        if (y[f.key].get(other) || !json_equal(f.value, other)) return false;
      }
      return true;
    }
    default: return false;
  }
}

// Every key of `expected` has the same value in `actual` (a JSON file each).
void expect_config_fields(const fs::path& actual, const fs::path& expected) {
  simdjson::dom::parser pa, pe;
  simdjson::dom::element a, e;
  ASSERT_FALSE(pa.load(actual.string()).get(a)) << actual;
  ASSERT_FALSE(pe.load(expected.string()).get(e)) << expected;
  for (auto f : simdjson::dom::object(e)) {
    simdjson::dom::element v;
    if (a[f.key].get(v)) {
      ADD_FAILURE() << actual << " lacks '" << f.key << "'";
      continue;
    }
    EXPECT_TRUE(json_equal(v, f.value)) << "'" << f.key << "': " << simdjson::to_string(v) << " vs expected "
                                        << simdjson::to_string(f.value);
  }
}

// --- export cases -----------------------------------------------------------------------------------

void fill(Module& m, const fs::path& weights_txt) {
  std::ifstream in(weights_txt);
  ASSERT_TRUE(in) << weights_txt;
  const StateDict live = m.state_dict();
  StateDict values;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream s(line);
    std::string key;
    std::uint32_t salt = 0;
    double offset = 0, scale = 0;
    s >> key >> salt >> offset >> scale;
    ASSERT_TRUE(live.count(key)) << "model/gpt2 has no " << key;
    values[key] = hash_tensor(live.at(key).sizes(), salt, offset, scale);
  }
  for (const auto& [key, t] : live)
    if (key.ends_with("inv_freq")) values[key] = t;
  m.load_state_dict(values, /*strict=*/false);
}

TEST(HuggingFaceExportTest, FamiliesMatchTransformersAndRoundTrip) {
  for (const char* name : kExports) {
    SCOPED_TRACE(name);
    const fs::path dir = kHf / fmt::format("export_{}", name);
    testing::Harness h{MODALITIES_TEST_PLUGIN};
    h.set_config_text(testing::read_file(dir / "case.toml"), "case.toml");
    auto m = h.get<Module>("model");
    ASSERT_NE(m, nullptr) << h.build_error();
    m->eval();
    fill(*m, dir / "weights.txt");
    const StateDict ref = formats::read_safetensors(dir / "reference.safetensors");
    const at::Tensor& ids = ref.at("input_ids");
    // model/gpt2 itself (gelu_tanh, q/k/v biases, Llama-3 RoPE scaling, sliding window) computes
    // what the transformers family computes.
    const double d_ours = rel_diff(logits_of(*m, ids), ref.at("logits"));
    EXPECT_LE(d_ours, kTol);
    const auto* exportable = dynamic_cast<const HuggingFaceExportable*>(m.get());
    ASSERT_NE(exportable, nullptr);
    TempDir tmp;
    const fs::path out = tmp.path() / "hf";
    formats::write_huggingface_folder(out, exportable->to_huggingface({}), /*max_shard_bytes=*/200'000);
    expect_config_fields(out / "config.json", dir / "expected_config.json");
    EXPECT_TRUE(fs::exists(out / "model.safetensors.index.json")) << "expected shards above 200 kB";
    testing::Harness h2{MODALITIES_TEST_PLUGIN};
    auto back = import_model(h2, out);
    ASSERT_NE(back, nullptr) << h2.build_error();
    const double d_back = rel_diff(logits_of(*back, ids), ref.at("logits"));
    EXPECT_LE(d_back, kTol);
    expect_same_tensors(back->state_dict(), m->state_dict());  // ours -> HF -> ours: identical
    std::cout << fmt::format("[ export {:20s} ] model/gpt2 vs transformers {:.2e}, after export+import {:.2e}\n", name,
                             d_ours, d_back);
  }
}

TEST(HuggingFaceExportTest, ImportThenExportGivesTheOriginalTensors) {
  for (const char* family : kImports) {
    SCOPED_TRACE(family);
    const fs::path folder = kHf / fmt::format("import_{}", family);
    testing::Harness h{MODALITIES_TEST_PLUGIN};
    auto m = import_model(h, folder);
    ASSERT_NE(m, nullptr) << h.build_error();
    const HuggingFaceCheckpoint c = dynamic_cast<const HuggingFaceExportable&>(*m).to_huggingface({});
    const bool tied = !c.tensors.count("lm_head.weight");
    expect_same_tensors(c.tensors, hf_weights(folder, tied));
    TempDir tmp;
    formats::write_huggingface_folder(tmp.path() / "hf", c, 5'000'000'000ULL);
    EXPECT_TRUE(fs::exists(tmp.path() / "hf" / "model.safetensors"));
    // The original config.json's architecture fields survive (transformers fills defaults for the rest).
    simdjson::dom::parser p;
    simdjson::dom::element orig;
    ASSERT_FALSE(p.load((folder / "config.json").string()).get(orig));
    const fs::path subset = tmp.path() / "subset.json";
    std::string text = "{";
    bool first = true;
    for (const char* key : {"model_type",
                            "vocab_size",
                            "hidden_size",
                            "intermediate_size",
                            "num_hidden_layers",
                            "num_attention_heads",
                            "num_key_value_heads",
                            "head_dim",
                            "rope_theta",
                            "rope_scaling",
                            "sliding_window",
                            "attention_bias",
                            "mlp_bias",
                            "tie_word_embeddings",
                            "n_embd",
                            "n_positions",
                            "n_head",
                            "n_layer",
                            "activation_function",
                            "layer_norm_epsilon",
                            "rms_norm_eps",
                            "max_position_embeddings"}) {
      simdjson::dom::element v;
      if (orig[key].get(v)) continue;
      text += fmt::format("{}\"{}\": {}", first ? "" : ", ", key, simdjson::to_string(v));
      first = false;
    }
    std::ofstream(subset) << text << "}";
    expect_config_fields(tmp.path() / "hf" / "config.json", subset);
  }
}

// --- errors -----------------------------------------------------------------------------------------

std::string import_error(const fs::path& folder, const std::string& extra = "") {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(import_toml(folder, extra));
  return h.build_error();
}

TEST(HuggingFaceErrorsTest, NameWhatIsUnsupported) {
  TempDir tmp;
  // An architecture model/gpt2 cannot express.
  copy_with_config(kHf / "import_llama", tmp.path() / "bert", "\"model_type\": \"llama\"", "\"model_type\": \"bert\"");
  EXPECT_THAT(import_error(tmp.path() / "bert"), ::testing::AllOf(HasSubstr("config.json: 'model_type' is 'bert'"),
                                                                  HasSubstr("llama"), HasSubstr("gpt2")));
  // A config.json that does not fit the weights.
  copy_with_config(kHf / "import_gpt2", tmp.path() / "wide", "\"n_embd\": 32", "\"n_embd\": 64");
  EXPECT_THAT(import_error(tmp.path() / "wide"),
              ::testing::AllOf(HasSubstr("transformer.wte.weight"), HasSubstr("[96, 32]"), HasSubstr("[96, 64]")));
  // RoPE scaling we do not implement.
  copy_with_config(kHf / "import_qwen2_linear", tmp.path() / "yarn", "\"rope_type\": \"linear\"",
                   "\"rope_type\": \"yarn\"");
  EXPECT_THAT(import_error(tmp.path() / "yarn"), HasSubstr("'rope_scaling.rope_type' is 'yarn'"));
  // Qwen2's per-layer sliding windows.
  copy_with_config(kHf / "import_qwen2_linear", tmp.path() / "qwsw", "\"use_sliding_window\": false",
                   "\"use_sliding_window\": true");
  EXPECT_THAT(import_error(tmp.path() / "qwsw"), HasSubstr("'use_sliding_window' is true"));
  // Pickle checkpoints are not read.
  fs::create_directories(tmp.path() / "bin");
  fs::copy_file(kHf / "import_gpt2" / "config.json", tmp.path() / "bin" / "config.json");
  std::ofstream(tmp.path() / "bin" / "pytorch_model.bin") << "x";
  EXPECT_THAT(import_error(tmp.path() / "bin"), HasSubstr("pytorch_model.bin is not read"));
  // A hub id.
  EXPECT_THAT(import_error("meta-llama/Llama-3.2-1B"), HasSubstr("Hub ids are not downloaded"));
  // Masked LM and from_pretrained arguments.
  EXPECT_THAT(import_error(kHf / "import_gpt2", ", kwargs = { torch_dtype = \"bfloat16\" }"),
              HasSubstr("model.config.kwargs.torch_dtype"));
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  std::string toml = import_toml(kHf / "import_gpt2");
  toml.replace(toml.find("AutoModelForCausalLM"), 20, "AutoModelForMaskedLM");
  h.set_config_text(toml);
  EXPECT_THAT(h.build_error(), HasSubstr("AutoModelForMaskedLM"));
}

// A config.json that transformers reads differently from a plain first-key reader, or whose sizes
// cannot be allocated, is refused naming the key, before any weight is allocated.
TEST(HuggingFaceErrorsTest, ConfigsReadDifferentlyFromTransformersOrTooLargeAreRefused) {
  TempDir tmp;
  // A key twice (Python's json keeps the last value).
  copy_with_config(kHf / "import_llama", tmp.path() / "twice", "\"rope_theta\": 10000.0",
                   "\"rope_theta\": 10000.0,\n  \"rope_theta\": 500000.0");
  EXPECT_THAT(import_error(tmp.path() / "twice"),
              ::testing::AllOf(HasSubstr("config.json: 'rope_theta' appears twice"), HasSubstr("keep one")));
  copy_with_config(kHf / "import_qwen2_linear", tmp.path() / "nested_twice", "\"rope_type\": \"linear\"",
                   "\"rope_type\": \"linear\", \"factor\": 3.0");
  EXPECT_THAT(import_error(tmp.path() / "nested_twice"), HasSubstr("'rope_scaling.factor' appears twice"));
  // rope_theta null (transformers refuses it; a reader treating null as absent would use 10000).
  copy_with_config(kHf / "import_llama", tmp.path() / "theta_null", "\"rope_theta\": 10000.0", "\"rope_theta\": null");
  EXPECT_THAT(import_error(tmp.path() / "theta_null"), HasSubstr("'rope_theta' is null"));
  // rope_type and the legacy type disagreeing.
  copy_with_config(kHf / "import_qwen2_linear", tmp.path() / "two_types", "\"rope_type\": \"linear\"",
                   "\"rope_type\": \"linear\", \"type\": \"dynamic\"");
  EXPECT_THAT(import_error(tmp.path() / "two_types"),
              HasSubstr("'rope_scaling' has both 'rope_type' and the older 'type', and they differ"));
  // Sizes that cannot be allocated: refused at once (they asked for 256 GB, or built layers until killed).
  copy_with_config(kHf / "import_gpt2", tmp.path() / "wide", "\"n_embd\": 32", "\"n_embd\": 2147483648");
  EXPECT_THAT(import_error(tmp.path() / "wide"),
              ::testing::AllOf(HasSubstr("n_embd 2147483648"), HasSubstr("more than this machine's")));
  copy_with_config(kHf / "import_gpt2", tmp.path() / "long", "\"n_positions\": 32", "\"n_positions\": 2147483648");
  EXPECT_THAT(import_error(tmp.path() / "long"), HasSubstr("n_positions 2147483648"));
  copy_with_config(kHf / "import_llama", tmp.path() / "deep", "\"num_hidden_layers\": 2",
                   "\"num_hidden_layers\": 2147483648");
  EXPECT_THAT(import_error(tmp.path() / "deep"), HasSubstr("num_hidden_layers 2147483648"));
}

TEST(HuggingFaceErrorsTest, ExportRefusesModelsWithoutCounterpart) {
  const fs::path dir = kHf / "export_llama";
  std::string toml = testing::read_file(dir / "case.toml");
  const std::string tail = "use_weight_tying = true";
  ASSERT_NE(toml.find(tail), std::string::npos);
  toml.replace(toml.find(tail), tail.size(),
               tail +
                   ", attention_config = { qkv_transforms = [], qk_norm_config = { norm_type = \"pytorch_rms_norm\", "
                   "config = { normalized_shape = 16 } } }");
  // The line now has attention_config twice; drop the first one.
  const auto first = toml.find("attention_config = {");
  const auto end = toml.find("] }", first);
  toml.erase(first, end + 3 - first + 2);
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(toml);
  auto m = h.get<Module>("model");
  ASSERT_NE(m, nullptr) << h.build_error();
  EXPECT_THAT([&] { dynamic_cast<const HuggingFaceExportable&>(*m).to_huggingface({}); },
              ::testing::ThrowsMessage<Error>(
                  ::testing::AllOf(HasSubstr("qk_norm_config"), HasSubstr("no position encoding"))));
  // A folder that exists and is not empty is not overwritten.
  TempDir tmp;
  std::ofstream(tmp.path() / "keep.txt") << "x";
  HuggingFaceCheckpoint c;
  c.tensors["x"] = at::zeros({2});
  EXPECT_THAT([&] { formats::write_huggingface_folder(tmp.path(), c, 1000); },
              ::testing::ThrowsMessage<Error>(HasSubstr("not an empty directory")));
  EXPECT_TRUE(fs::exists(tmp.path() / "keep.txt"));
}

}  // namespace
}  // namespace modalities::plugins::gpt2
