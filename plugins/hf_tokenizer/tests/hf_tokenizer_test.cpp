// tokenizer/pretrained_hf_tokenizer against the real Hugging Face libraries:
// every line of data/multilingual/multilingual.jsonl with the GPT-2 fixture
// and the Llama-3- and Qwen2-style test tokenizers (ids and decodes from
// `tokenizers`/`transformers`, see scripts/reference/make_tokenizer_reference.py),
// pipeline variants (split behaviours, normalizers, BPE options), the
// Modalities padding/truncation/special_tokens matrix, the shipped GPT-2 .pbin
// files, concurrency, and one test per refused input with its message.
#include "onig_regex.h"
#include "tokenizer_json.h"
#include "unicode.h"

#include <modalities/sdk/formats/packed_data.h>
#include <modalities/sdk/interfaces/tokenizer.h>
#include <modalities/sdk/schema.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/scratch_dir.h>
#include <modalities/testing/shared_fixtures.h>

#include <absl/strings/escaping.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <simdjson.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <thread>

#include <unistd.h>
#include <utf8proc.h>

namespace modalities::plugins::hf_tokenizer {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;
namespace dom = simdjson::dom;

const fs::path kPluginDir = MODALITIES_TEST_PLUGIN_SOURCE_DIR;
const fs::path kData = kPluginDir / "tests" / "data";
const fs::path kFixtures = fs::path(MODALITIES_TEST_FIXTURES_DIR);
const fs::path kCorpus = fs::path(MODALITIES_TEST_SOURCE_ROOT) / "data" / "multilingual" / "multilingual.jsonl";

// "gpt2" is Modalities' copy of GPT-2 in ../shared/fixtures (tests that use it skip where it is
// absent); "gpt2_style_8k" is the main job's own tokenizer, GPT-2's pipeline with 8 192 tokens.
fs::path folder_of(const std::string& name) {
  if (name == "gpt2") return kFixtures / "data" / "tokenizer" / "hf_gpt2";
  if (name == "gpt2_style_8k") return fs::path(MODALITIES_TEST_SOURCE_ROOT) / "data" / "tokenizer" / "gpt2_style_8k";
  return kData / name;
}

// GPT-2 (Modalities' copy) lives in ../shared: where it is absent, the cases of it are left out with
// a note and the others still run.
bool absent_gpt2(std::string_view name) {
  if (name != "gpt2" || fs::exists(folder_of("gpt2"))) return false;
  static bool said = false;
  if (!said) std::cout << "gpt2 cases skipped: needs " << folder_of("gpt2").string() << " (../shared, absent here)\n";
  said = true;
  return true;
}

std::vector<std::string> lines_of(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  EXPECT_TRUE(in) << file;
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The "text" field of each JSONL line.
std::vector<std::string> texts_of(const fs::path& jsonl) {
  std::vector<std::string> out;
  dom::parser parser;
  for (const auto& line : lines_of(jsonl)) {
    std::string_view s;
    EXPECT_EQ(parser.parse(line)["text"].get_string().get(s), simdjson::SUCCESS) << jsonl;
    out.emplace_back(s);
  }
  return out;
}

// Named handles: GCC 12 warns (falsely) about range-for over simdjson temporaries.
dom::array array_of(dom::element e) {
  dom::array a;
  EXPECT_EQ(e.get_array().get(a), simdjson::SUCCESS);
  return a;
}
dom::object object_of(dom::element e) {
  dom::object o;
  EXPECT_EQ(e.get_object().get(o), simdjson::SUCCESS);
  return o;
}

std::vector<std::int64_t> ids_of(dom::element e) {
  std::vector<std::int64_t> out;
  const dom::array a = array_of(e);
  for (dom::element x : a) out.push_back(x.get_int64().value());
  return out;
}

std::optional<std::string> string_field(dom::element obj, std::string_view key) {
  std::string_view s;
  if (obj[key].get_string().get(s) != simdjson::SUCCESS) return std::nullopt;
  return std::string(s);
}

std::string show(std::span<const std::int64_t> ids) {
  std::string s = "[";
  for (std::size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s + "]";
}

// A tokenizer built through the registry from an inline config table.
struct Built {
  std::unique_ptr<testing::Harness> harness;
  std::shared_ptr<Tokenizer> tok;
  std::string error;
};

Built build(const std::string& config_inline) {
  Built b;
  b.harness = std::make_unique<testing::Harness>(MODALITIES_TEST_PLUGIN);
  b.harness->set_config_text(
      "[tok]\ncomponent_key = \"tokenizer\"\nvariant_key = \"pretrained_hf_tokenizer\"\nconfig = " + config_inline +
      "\n");
  b.error = b.harness->build_error();
  if (b.error.empty()) b.tok = b.harness->get<Tokenizer>("tok");
  return b;
}

std::string folder_config(const fs::path& folder, const std::string& extra = "") {
  return "{ pretrained_model_name_or_path = " + toml_quote(folder.string()) + (extra.empty() ? "" : ", " + extra) +
         " }";
}

// The returned pointer keeps its harness (and so the plugin) alive; the tokenizer goes first.
std::shared_ptr<Tokenizer> build_ok(const fs::path& folder, const std::string& extra = "") {
  Built b = build(folder_config(folder, extra));
  EXPECT_EQ(b.error, "") << folder;
  if (!b.tok) return nullptr;
  struct Holder {
    std::unique_ptr<testing::Harness> harness;
    std::shared_ptr<Tokenizer> tok;
  };
  auto holder = std::make_shared<Holder>(Holder{std::move(b.harness), std::move(b.tok)});
  return std::shared_ptr<Tokenizer>(holder, holder->tok.get());
}

std::string build_error(const fs::path& folder, const std::string& extra = "") {
  return build(folder_config(folder, extra)).error;
}

using TempDir = modalities::testing::ScratchDir;

// ---------------------------------------------------------------------------

TEST(HfTokenizerTest, BuildsFromExampleConfig) {
  const fs::path cwd = fs::current_path();
  fs::current_path(MODALITIES_TEST_SOURCE_ROOT);  // the example names a repository-relative folder
  testing::Harness h{MODALITIES_TEST_PLUGIN, kPluginDir / "configs" / "example.toml"};
  auto tok = h.get<Tokenizer>("tokenizer");
  fs::current_path(cwd);
  ASSERT_NE(tok, nullptr) << h.build_error();
  const auto ids = tok->tokenize("Hello world");
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), tok->token_id("<|begin_of_text|>"));
  EXPECT_EQ(tok->decode(std::vector<std::int64_t>(ids.begin() + 1, ids.end())), "Hello world");
}

class CorpusTest : public ::testing::TestWithParam<std::string> {};

// Every corpus line: ids as transformers produces them (= `tokenizers` encode),
// decode of the text's ids (`tokenizers`, no clean-up) and transformers' decode.
TEST_P(CorpusTest, MatchesHuggingFaceOnEveryLine) {
  const std::string name = GetParam();
  if (name == "gpt2") MODALITIES_REQUIRE_SHARED(folder_of(name));
  const auto texts = texts_of(kCorpus);
  const auto expected = lines_of(kData / "expected" / (name + ".jsonl"));
  ASSERT_EQ(texts.size(), expected.size());
  auto tok = build_ok(folder_of(name));
  ASSERT_NE(tok, nullptr);
  TokenizerJson engine(folder_of(name) / "tokenizer.json");
  const std::size_t n_template = engine.template_prefix().size();

  dom::parser parser;
  std::size_t id_mismatches = 0, decode_mismatches = 0, hf_decode_mismatches = 0;
  for (std::size_t i = 0; i < texts.size(); ++i) {
    dom::element row = parser.parse(expected[i]).value();
    const auto want = ids_of(row["ids"].value());
    const auto got = tok->tokenize(texts[i]);
    if (got != want && id_mismatches++ < 5)
      ADD_FAILURE() << name << " line " << i + 1 << " ids differ\n  text: " << texts[i] << "\n  want: " << show(want)
                    << "\n  got:  " << show(got);
    const std::span<const std::int64_t> content(want.begin() + static_cast<std::ptrdiff_t>(n_template), want.end());
    const std::string decoded = engine.decode(content);
    const std::string want_decoded = string_field(row, "decoded").value_or(texts[i]);
    if (decoded != want_decoded && decode_mismatches++ < 5)
      ADD_FAILURE() << name << " line " << i + 1 << " decode differs\n  want: " << want_decoded
                    << "\n  got:  " << decoded;
    const std::string full = engine.decode(std::span<const std::int64_t>(want.data(), n_template)) + want_decoded;
    const std::string want_hf = string_field(row, "decoded_hf").value_or(full);
    if (tok->decode(want) != want_hf && hf_decode_mismatches++ < 5)
      ADD_FAILURE() << name << " line " << i + 1 << " transformers decode differs\n  want: " << want_hf
                    << "\n  got:  " << tok->decode(want);
  }
  EXPECT_EQ(id_mismatches, 0u) << "of " << texts.size() << " lines";
  EXPECT_EQ(decode_mismatches, 0u);
  EXPECT_EQ(hf_decode_mismatches, 0u);
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, CorpusTest,
                         ::testing::Values("gpt2", "gpt2_style_8k", "llama3_style", "qwen2_style"));

// ---------------------------------------------------------------------------
// Tokenizer families (scripts/reference/make_tokenizer_families.py): small tokenizers built with the
// pipelines, classes and config flags of real model families, against transformers' AutoTokenizer
// on 200 mixed documents (scripts, new emoji, NFD text, whitespace runs, control characters,
// literal special-token strings).

const fs::path kFamilies = kData / "families";

fs::path family_folder(const std::string& name) {
  if (name == "gpt2" || name == "llama3_style" || name == "qwen2_style") return folder_of(name);
  return kFamilies / name;
}

class FamilyTest : public ::testing::TestWithParam<std::string> {};

// ids = AutoTokenizer(folder)(text)["input_ids"]; decode = transformers' decode (special tokens
// kept); the engine alone (tokenizer.json without transformers' class rules) = `tokenizers`.
TEST_P(FamilyTest, MatchesTransformersOnEveryDocument) {
  const std::string name = GetParam();
  if (name == "gpt2") MODALITIES_REQUIRE_SHARED(folder_of(name));
  const auto texts = texts_of(kFamilies / "corpus.jsonl");
  const auto expected = lines_of(kFamilies / "expected" / (name + ".jsonl"));
  ASSERT_EQ(texts.size(), expected.size());
  auto tok = build_ok(family_folder(name));
  ASSERT_NE(tok, nullptr);
  TokenizerJson engine(family_folder(name) / "tokenizer.json");
  dom::parser parser;
  std::size_t ids = 0, raw = 0, decodes = 0, raw_decodes = 0;
  std::vector<std::vector<std::int64_t>> wanted_raw;
  for (std::size_t i = 0; i < texts.size(); ++i) {
    dom::element row = parser.parse(expected[i]).value();
    const auto want = ids_of(row["ids"].value());
    std::vector<std::int64_t> got;
    try {
      got = tok->tokenize(texts[i]);
    } catch (const std::exception& e) {
      ADD_FAILURE() << name << " document " << i + 1 << " threw: " << e.what();
      ++ids;
      continue;
    }
    if (got != want && ids++ < 4)
      ADD_FAILURE() << name << " document " << i + 1 << " ids differ\n  text: " << texts[i]
                    << "\n  want: " << show(want) << "\n  got:  " << show(got);
    dom::element raw_row;
    const auto want_raw = row["raw_ids"].get(raw_row) == simdjson::SUCCESS ? ids_of(raw_row) : want;
    wanted_raw.push_back(want_raw);
    if (engine.encode(texts[i]) != want_raw && raw++ < 2)
      ADD_FAILURE() << name << " document " << i + 1 << " tokenizers ids differ\n  want: " << show(want_raw)
                    << "\n  got:  " << show(engine.encode(texts[i]));
    const std::string want_decoded = string_field(row, "decoded").value();
    if (tok->decode(want) != want_decoded && decodes++ < 4)
      ADD_FAILURE() << name << " document " << i + 1 << " decode differs\n  want: " << want_decoded
                    << "\n  got:  " << tok->decode(want);
    const std::string want_raw_decoded = string_field(row, "decoded_raw").value_or(want_decoded);
    if (engine.decode(want) != want_raw_decoded && raw_decodes++ < 2)
      ADD_FAILURE() << name << " document " << i + 1 << " tokenizers decode differs\n  want: " << want_raw_decoded
                    << "\n  got:  " << engine.decode(want);
  }
  // Again: now every word under 256 bytes comes from the engine's word cache (Note [Word cache]).
  std::size_t cached = 0;
  for (std::size_t i = 0; i < texts.size(); ++i)
    if (engine.encode(texts[i]) != wanted_raw[i] && cached++ < 2)
      ADD_FAILURE() << name << " document " << i + 1
                    << " differs when encoded again (word cache)\n  want: " << show(wanted_raw[i])
                    << "\n  got:  " << show(engine.encode(texts[i]));
  EXPECT_EQ(ids, 0u) << "documents with other ids, of " << texts.size();
  EXPECT_EQ(raw, 0u);
  EXPECT_EQ(cached, 0u);
  EXPECT_EQ(decodes, 0u);
  EXPECT_EQ(raw_decodes, 0u);

  // Facts: vocab_size, special ids, the template of an empty text.
  dom::element facts = parser.load((kFamilies / "expected" / "facts.json").string()).value()[name].value();
  EXPECT_EQ(tok->vocab_size(), facts["vocab_size"].get_int64().value()) << name;
  for (std::int64_t id : ids_of(facts["all_special_ids"].value()))
    EXPECT_TRUE(tok->is_special_token_id(id)) << name << " " << id;
  EXPECT_EQ(show(tok->tokenize("")), show(ids_of(facts["empty_ids"].value()))) << name;
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyTest,
                         ::testing::Values("gpt2", "llama3_style", "qwen2_style", "starcoder_style", "tekken_style",
                                           "gpt4o_style", "deepseek_v3_style", "gptneox_style", "gptneox_bos_style",
                                           "roberta_style", "bloom_style", "llama2_style", "mistral_style",
                                           "gemma_style", "bert_style", "bert_cased_style", "t5_style", "t5_nmt_style",
                                           "xlm_roberta_style", "unigram_style", "pretok_sequences_style",
                                           "whitespace_style", "falcon_style"));

TEST(HfTokenizerTest, OldGpt2SerialisationEncodesLikeTheNewOne) {
  MODALITIES_REQUIRE_SHARED(MODALITIES_TEST_FIXTURES_DIR);
  // data/tokenizer/tokenizer_gpt2.json: no model "type", ByteLevel without use_regex, "a b" merges.
  TokenizerJson old_json(kFixtures / "data" / "tokenizer" / "tokenizer_gpt2.json");
  const auto texts = texts_of(kCorpus);
  const auto expected = lines_of(kData / "expected" / "gpt2.jsonl");
  dom::parser parser;
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < texts.size(); ++i)
    mismatches += old_json.encode(texts[i]) != ids_of(parser.parse(expected[i])["ids"].value());
  EXPECT_EQ(mismatches, 0u);
}

// tokenizer.json files of the older serialisation whose model has no "type" (the real t5-small file):
// the model is inferred from its fields as `tokenizers` does (0.22.2 loads these type-less copies as
// Unigram and WordPiece and encodes the corpus identically), and encodes like the typed file.
TEST(HfTokenizerTest, ModelsWithoutTypeAreInferredAsTokenizersDoes) {
  const auto texts = texts_of(kFamilies / "corpus.jsonl");
  for (const std::string family : {"t5_style", "unigram_style", "bert_style"}) {
    const std::string json = testing::read_file(kFamilies / family / "tokenizer.json");
    const std::string typed = json.find(R"("model":{"type":"Unigram",)") != std::string::npos
                                  ? R"("model":{"type":"Unigram",)"
                                  : R"("model":{"type":"WordPiece",)";
    ASSERT_NE(json.find(typed), std::string::npos) << family;
    std::string untyped = json;
    untyped.replace(untyped.find(typed), typed.size(), R"("model":{)");
    TempDir dir;
    dir.write("tokenizer.json", untyped);
    TokenizerJson with_type(kFamilies / family / "tokenizer.json");
    TokenizerJson without_type(dir.path() / "tokenizer.json");
    std::size_t mismatches = 0;
    for (const std::string& text : texts) mismatches += with_type.encode(text) != without_type.encode(text);
    EXPECT_EQ(mismatches, 0u) << family;
  }
  TempDir dir;
  dir.write("tokenizer.json", R"({"version":"1.0","added_tokens":[],"normalizer":null,"pre_tokenizer":null,)"
                              R"("post_processor":null,"decoder":null,"model":{"vocab":{"a":0}}})");
  EXPECT_THAT([&] { TokenizerJson t(dir.path() / "tokenizer.json"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("has no 'type', and its fields fit none of")));
}

// Hand-written strings for the added-token rules (lstrip, rstrip, single_word,
// normalized) and other corners, through the engine (`tokenizers` encode/decode).
TEST(HfTokenizerTest, ProbeStringsMatchTokenizers) {
  dom::parser parser;
  dom::element root = parser.load((kData / "probes.json").string()).value();
  const dom::object by_name = object_of(root);
  for (auto [name, list] : by_name) {
    if (absent_gpt2(name)) continue;
    TokenizerJson engine(folder_of(std::string(name)) / "tokenizer.json");
    const dom::array probes = array_of(list);
    for (dom::element probe : probes) {
      const std::string text(probe["text"].get_string().value());
      const auto want = ids_of(probe["ids"].value());
      EXPECT_EQ(show(engine.encode(text)), show(want)) << name << ": '" << text << "'";
      EXPECT_EQ(engine.decode(want), std::string(probe["decoded"].get_string().value()))
          << name << ": '" << text << "'";
    }
  }
}

// Split behaviours, invert, Digits, String patterns, empty regex matches,
// ByteLevel with prefix space, normalizers and the BPE options (unk, fuse_unk,
// byte_fallback, subword prefix / word suffix, character-level models).
TEST(HfTokenizerTest, PipelineVariantsMatchTokenizers) {
  dom::parser parser;
  dom::element root = parser.load((kData / "variants" / "expected.json").string()).value();
  std::vector<std::string> texts;
  const dom::array text_list = array_of(root["texts"].value());
  for (dom::element t : text_list) texts.emplace_back(t.get_string().value());
  std::size_t checked = 0;
  const dom::object by_name = object_of(root["expected"].value());
  for (auto [name, rows] : by_name) {
    TokenizerJson engine(kData / "variants" / (std::string(name) + ".json"));
    std::size_t mismatches = 0, i = 0;
    const dom::array row_list = array_of(rows);
    for (dom::element row : row_list) {
      const std::string& text = texts.at(i++);
      const auto want = ids_of(row["ids"].value());
      const auto got = engine.encode(text);
      if (got != want && mismatches++ < 3)
        ADD_FAILURE() << name << ": '" << text << "'\n  want: " << show(want) << "\n  got:  " << show(got);
      EXPECT_EQ(engine.decode(want), string_field(row, "decoded").value_or(text)) << name << ": '" << text << "'";
      ++checked;
    }
    EXPECT_EQ(mismatches, 0u) << name;
  }
  EXPECT_GT(checked, 1000u);
}

// transformers-level behaviour that Modalities relies on (its
// tests/test_tokenization.py matrix and more), from wrapper_cases.json.
TEST(HfTokenizerTest, PaddingTruncationAndSpecialTokensMatchTransformers) {
  dom::parser parser;
  dom::element root = parser.load((kData / "wrapper_cases.json").string()).value();
  const dom::array cases = array_of(root["cases"].value());
  for (dom::element c : cases) {
    const std::string name(c["tokenizer"].get_string().value());
    if (absent_gpt2(name)) continue;
    std::string extra;
    const dom::object config = object_of(c["config"].value());
    for (auto [key, value] : config) {
      std::string v;
      if (value.is_null()) continue;
      if (value.is_bool()) v = value.get_bool().value() ? "true" : "false";
      else if (value.is_int64()) v = std::to_string(value.get_int64().value());
      else if (value.is_string()) v = toml_quote(std::string(value.get_string().value()));
      else {
        v = "{ ";
        bool first = true;
        const dom::object table = object_of(value);
        for (auto [k, x] : table) {
          v += (first ? "" : ", ") + std::string(k) + " = ";
          if (x.is_string()) v += toml_quote(std::string(x.get_string().value()));
          else {
            v += "[";
            bool f2 = true;
            const dom::array strings = array_of(x);
            for (dom::element s : strings) {
              v += (f2 ? "" : ", ") + toml_quote(std::string(s.get_string().value()));
              f2 = false;
            }
            v += "]";
          }
          first = false;
        }
        v += " }";
      }
      extra += (extra.empty() ? "" : ", ") + std::string(key) + " = " + v;
    }
    auto tok = build_ok(folder_of(name), extra);
    ASSERT_NE(tok, nullptr) << extra;
    const std::string text(c["text"].get_string().value());
    const auto want = ids_of(c["ids"].value());
    const auto got = tok->tokenize(text);
    EXPECT_EQ(got.size(), want.size()) << name << " {" << extra << "} '" << text.substr(0, 40) << "'";
    EXPECT_EQ(show(got), show(want)) << name << " {" << extra << "}";
  }
  const dom::object tokenizers = object_of(root["tokenizers"].value());
  for (auto [name, facts] : tokenizers) {
    if (absent_gpt2(name)) continue;
    auto tok = build_ok(folder_of(std::string(name)));
    ASSERT_NE(tok, nullptr);
    EXPECT_EQ(tok->vocab_size(), facts["vocab_size"].get_int64().value()) << name;
    const auto special = ids_of(facts["special_ids"].value());
    for (std::int64_t id : special) EXPECT_TRUE(tok->is_special_token_id(id)) << name << " id " << id;
    std::size_t n_special = 0;
    for (std::int64_t id = 0; id < tok->vocab_size() + 64; ++id) n_special += tok->is_special_token_id(id);
    EXPECT_EQ(n_special, special.size()) << name;
    const dom::object token_ids = object_of(facts["token_ids"].value());
    for (auto [token, id] : token_ids)
      EXPECT_EQ(tok->token_id(token), id.get_int64().value()) << name << " '" << token << "'";
  }
}

// transformers' loading rules (legacy special_tokens_map.json, class defaults,
// add_prefix_space override, added_tokens_decoder re-adds, model_max_length of
// int(1e30), truncation/padding sides) on synthetic folders, from config_cases.json.
TEST(HfTokenizerTest, LoadsConfigFilesLikeTransformers) {
  dom::parser parser;
  dom::element root = parser.load((kData / "config_cases.json").string()).value();
  std::vector<std::string> texts;
  const dom::array text_list = array_of(root["texts"].value());
  for (dom::element t : text_list) texts.emplace_back(t.get_string().value());
  const std::string base = testing::read_file(kData / "variants" / "bl_gpt2_regex.json");
  const dom::object folders = object_of(root["folders"].value());
  for (auto [name, c] : folders) {
    TempDir dir;
    std::string json = base;
    const dom::array added = array_of(c["tokenizer_json_added_tokens"].value());
    if (added.size() > 0) {
      const std::string entries = simdjson::minify(c["tokenizer_json_added_tokens"].value());
      const std::string empty = "\"added_tokens\": []";
      json.replace(json.find(empty), empty.size(), "\"added_tokens\": " + entries);
    }
    dir.write("tokenizer.json", json);
    const dom::object files = object_of(c["files"].value());
    for (auto [file, text] : files) dir.write(std::string(file), std::string(text.get_string().value()));
    auto check = [&](const std::string& extra, std::string_view key) {
      auto tok = build_ok(dir.path(), extra);
      ASSERT_NE(tok, nullptr) << name << " " << extra;
      const dom::array rows = array_of(c[key].value());
      std::size_t i = 0;
      for (dom::element row : rows) {
        EXPECT_EQ(show(tok->tokenize(texts[i])), show(ids_of(row))) << name << " " << key << " '" << texts[i] << "'";
        ++i;
      }
    };
    check("", "ids");
    check("truncation = true", "ids_truncated");
    if (!c["ids_padded"].is_null()) check("truncation = true, padding = \"max_length\"", "ids_padded");
    auto tok = build_ok(dir.path());
    EXPECT_EQ(tok->vocab_size(), c["vocab_size"].get_int64().value()) << name;
    const auto special = ids_of(c["special_ids"].value());
    std::size_t n_special = 0;
    for (std::int64_t id = 0; id < 500; ++id) n_special += tok->is_special_token_id(id);
    EXPECT_EQ(n_special, special.size()) << name;
    for (std::int64_t id : special) EXPECT_TRUE(tok->is_special_token_id(id)) << name << " " << id;
    const dom::array decoded = array_of(c["decoded"].value());
    std::size_t i = 0;
    for (dom::element d : decoded) {
      EXPECT_EQ(tok->decode(tok->tokenize(texts[i])), std::string(d.get_string().value())) << name;
      ++i;
    }
  }
}

// A literal <mask> in RoBERTa-style text: tokenizer_config.json gives mask_token as a plain string and has
// no added_tokens_decoder, and tokenizer.json has <mask> with lstrip false. transformers keeps
// tokenizer.json's flags (RobertaTokenizerFast's lstrip=True mask applies only to a token it has to add),
// also when special_tokens_map.json says lstrip true. Ids from AutoTokenizer of transformers 4.57.6
// (tokenizers 0.22.2) on these folders, with and without special_tokens_map.json.
TEST(HfTokenizerTest, ARobertaMaskTokenOfTokenizerJsonKeepsItsFlags) {
  const fs::path from = family_folder("roberta_style");
  std::string json = testing::read_file(from / "tokenizer.json");
  const std::string lstrip = R"("content":"<mask>","single_word":false,"lstrip":true)";
  ASSERT_NE(json.find(lstrip), std::string::npos);
  json.replace(json.find(lstrip), lstrip.size(), R"("content":"<mask>","single_word":false,"lstrip":false)");
  for (const bool with_map : {false, true}) {
    TempDir dir;
    dir.write("tokenizer.json", json);
    dir.write(
        "tokenizer_config.json",
        R"({"add_prefix_space": false, "bos_token": "<s>", "clean_up_tokenization_spaces": false, "cls_token": "<s>", )"
        R"("eos_token": "</s>", "errors": "replace", "mask_token": "<mask>", "model_max_length": 512, )"
        R"("pad_token": "<pad>", "sep_token": "</s>", "tokenizer_class": "RobertaTokenizer", "trim_offsets": true, )"
        R"("unk_token": "<unk>"})");
    if (with_map) dir.write("special_tokens_map.json", testing::read_file(from / "special_tokens_map.json"));
    auto tok = build_ok(dir.path());
    ASSERT_NE(tok, nullptr);
    EXPECT_EQ(show(tok->tokenize("<mask><mask> <mask>")), show(std::vector<std::int64_t>{0, 1280, 1280, 224, 1280, 2}))
        << with_map;
    EXPECT_EQ(show(tok->tokenize("a <mask> b")), show(std::vector<std::int64_t>{0, 68, 224, 1280, 575, 2})) << with_map;
    EXPECT_EQ(show(tok->tokenize(" <mask>")), show(std::vector<std::int64_t>{0, 224, 1280, 2})) << with_map;
  }
}

TEST(HfTokenizerTest, Gpt2Facts) {
  MODALITIES_REQUIRE_SHARED(folder_of("gpt2"));
  auto tok = build_ok(folder_of("gpt2"));
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->token_id("<|endoftext|>"), 50256);
  EXPECT_TRUE(tok->is_special_token_id(50256));
  EXPECT_FALSE(tok->is_special_token_id(15496));
  EXPECT_EQ(tok->tokenize("Hello"), (std::vector<std::int64_t>{15496}));
  EXPECT_EQ(tok->tokenize("World!"), (std::vector<std::int64_t>{10603, 0}));
  EXPECT_EQ(tok->tokenize(""), std::vector<std::int64_t>{});
  // clean_up_tokenization_spaces = true in its tokenizer_config.json (as transformers decodes).
  EXPECT_EQ(tok->decode(tok->tokenize("Hello , world . isn 't it ?")), "Hello, world. isn 't it?");
}

// Packs like Modalities (tokenize, append EOD 50256 unless present) and
// compares with the shipped/derived GPT-2 .pbin files, document by document.
void expect_same_as_pbin(const fs::path& jsonl, const fs::path& pbin) {
  auto tok = build_ok(folder_of("gpt2"));
  const auto header = formats::read_packed_header(pbin);
  ASSERT_EQ(header.token_size, 2u);
  std::ifstream in(pbin, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto index = formats::unpickle_index(
      std::as_bytes(std::span(bytes).subspan(formats::kPackedHeaderSize + header.data_len)), pbin.string());
  const auto texts = texts_of(jsonl);
  ASSERT_EQ(texts.size(), index.size()) << pbin;
  const std::int64_t eod = tok->token_id("<|endoftext|>");
  std::size_t mismatches = 0;
  for (std::size_t d = 0; d < texts.size(); ++d) {
    auto ids = tok->tokenize(texts[d]);
    if (ids.empty() || ids.back() != eod) ids.push_back(eod);
    const auto [offset, length] = index[d];
    std::vector<std::int64_t> want(length / 2);
    for (std::size_t t = 0; t < want.size(); ++t) {
      const std::size_t at = formats::kPackedHeaderSize + offset + 2 * t;
      want[t] = static_cast<unsigned char>(bytes[at]) | (static_cast<unsigned char>(bytes[at + 1]) << 8);
    }
    if (ids != want && mismatches++ < 3)
      ADD_FAILURE() << pbin.filename() << " document " << d << ": " << ids.size() << " vs " << want.size() << " tokens";
  }
  EXPECT_EQ(mismatches, 0u) << pbin;
}

TEST(HfTokenizerTest, ReproducesTheShippedGpt2PackedFiles) {
  MODALITIES_REQUIRE_SHARED(MODALITIES_TEST_FIXTURES_DIR);
  expect_same_as_pbin(kFixtures / "data" / "lorem_ipsum.jsonl", kFixtures / "data" / "lorem_ipsum.pbin");
  expect_same_as_pbin(kFixtures / "data" / "lorem_ipsum_long.jsonl", kFixtures / "data" / "lorem_ipsum_long.pbin");
  const fs::path datasets = kFixtures / "tests" / "data" / "datasets";
  const fs::path derived = kFixtures / "derived" / "tests" / "data" / "datasets";
  expect_same_as_pbin(datasets / "danish_test_dataset.jsonl", derived / "danish_test_dataset.gpt2_eod50256.pbin");
  expect_same_as_pbin(datasets / "lorem_ipsum_without_last_newline.jsonl",
                      derived / "lorem_ipsum_without_last_newline.gpt2_eod50256.pbin");
}

TEST(HfTokenizerTest, OneInstanceIsSafeToUseFromManyThreads) {
  for (const std::string name : {"gpt2_style_8k", "qwen2_style"}) {
    auto tok = build_ok(folder_of(name));
    const auto texts = texts_of(kCorpus);
    std::vector<std::vector<std::int64_t>> serial;
    for (const auto& t : texts) serial.push_back(tok->tokenize(t));
    std::vector<std::size_t> mismatches(4, 0);
    std::vector<std::thread> threads;
    for (std::size_t w = 0; w < 4; ++w)
      threads.emplace_back([&, w] {
        for (std::size_t round = 0; round < 2; ++round)
          for (std::size_t i = w; i < texts.size(); i += (round == 0 ? 1 : 3))
            mismatches[w] += tok->tokenize(texts[i]) != serial[i];
      });
    for (auto& t : threads) t.join();
    for (std::size_t w = 0; w < 4; ++w) EXPECT_EQ(mismatches[w], 0u) << name << " thread " << w;
  }
}

// ---------------------------------------------------------------------------
// Refused inputs, with their messages.

// A minimal valid byte-level BPE tokenizer.json whose parts can be swapped.
std::string tiny_json(
    const std::string& normalizer = "null",
    const std::string& pre = R"({"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true})",
    const std::string& model_extra = "", const std::string& post = "null",
    const std::string& decoder = R"({"type":"ByteLevel"})") {
  std::string vocab;
  // The 256 byte-level characters of 'a', 'b' and a few others would suffice; use all via escapes.
  std::map<int, std::string> chars;
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool direct = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = direct ? b : 256 + n++;
    char buf[16];
    std::snprintf(buf, sizeof buf, "\\u%04x", cp);
    vocab += (b ? "," : "") + std::string("\"") + buf + "\":" + std::to_string(b);
  }
  vocab += R"(,"ab":256)";
  return R"({"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":)" + normalizer +
         R"(,"pre_tokenizer":)" + pre + R"(,"post_processor":)" + post + R"(,"decoder":)" + decoder +
         R"(,"model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,)"
         R"("end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false)" +
         model_extra + R"(,"vocab":{)" + vocab + R"(},"merges":["a b"]}})";
}

std::string engine_error(const std::string& json) {
  TempDir dir;
  dir.write("tokenizer.json", json);
  try {
    TokenizerJson t(dir.path() / "tokenizer.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Regression: invalid `padding` / `truncation` blocks were accepted although `tokenizers` refuses
// the file (cases and verdicts checked with tokenizers 0.22.2 from Python).
TEST(HfTokenizerTest, PaddingAndTruncationBlocksHaveTheShapeTokenizersRequires) {
  const auto with = [](const std::string& key, const std::string& value) {
    std::string json = tiny_json();
    const std::string null_block = "\"" + key + "\":null";
    json.replace(json.find(null_block), null_block.size(), "\"" + key + "\":" + value);
    return engine_error(json);
  };
  const std::string pad =
      R"("direction":"Right","pad_to_multiple_of":null,"pad_id":0,"pad_type_id":0,"pad_token":"[PAD]")";
  EXPECT_EQ(with("padding", R"({"strategy":"BatchLongest",)" + pad + "}"), "");
  EXPECT_EQ(with("padding", R"({"strategy":{"Fixed":12},"x":1,)" + pad + "}"), "");
  EXPECT_EQ(with("truncation", R"({"max_length":10,"strategy":"LongestFirst","stride":0})"), "");
  EXPECT_THAT(with("padding", "{}"), HasSubstr("padding.strategy"));
  EXPECT_THAT(with("padding", R"({"strategy":"Longest",)" + pad + "}"), HasSubstr("padding.strategy"));
  EXPECT_THAT(with("padding", R"({"strategy":{"Fixed":-1},)" + pad + "}"), HasSubstr("padding.strategy.Fixed"));
  EXPECT_THAT(
      with("padding", R"({"strategy":"BatchLongest","direction":"Up","pad_id":0,"pad_type_id":0,"pad_token":"x"})"),
      HasSubstr("padding.direction: expected one of Left, Right"));
  EXPECT_THAT(
      with("padding",
           R"({"strategy":"BatchLongest","direction":"Left","pad_id":4294967296,"pad_type_id":0,"pad_token":"x"})"),
      HasSubstr("padding.pad_id: expected an unsigned integer below 2^32"));
  EXPECT_THAT(with("padding", R"({"strategy":"BatchLongest","direction":"Left","pad_id":0,"pad_type_id":0})"),
              HasSubstr("padding.pad_token"));
  EXPECT_THAT(with("padding", R"("x")"), HasSubstr("padding: expected null or an object"));
  EXPECT_THAT(with("truncation", R"({"max_length":10,"strategy":"LongestFirst"})"), HasSubstr("truncation.stride"));
  EXPECT_THAT(with("truncation", R"({"max_length":"10","strategy":"LongestFirst","stride":0})"),
              HasSubstr("truncation.max_length: expected an unsigned integer"));
  EXPECT_THAT(with("truncation", R"({"max_length":10,"strategy":"LongestFirst","stride":0.5})"),
              HasSubstr("truncation.stride"));
  EXPECT_THAT(with("truncation", R"({"direction":null,"max_length":10,"strategy":"LongestFirst","stride":0})"),
              HasSubstr("truncation.direction"));
  EXPECT_THAT(with("truncation", "true"), HasSubstr("truncation: expected null or an object"));
}

// A piece listed twice: tokenizers keeps the last id (and its score) for both the lattice and the
// id; expected ids from tokenizers 0.22.2.
TEST(HfTokenizerTest, UnigramDuplicatePiecesTakeTheLastId) {
  TempDir dir;
  dir.write("tokenizer.json",
            R"({"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,)"
            R"("pre_tokenizer":null,"post_processor":null,"decoder":null,"model":{"type":"Unigram","unk_id":0,)"
            R"("byte_fallback":false,"vocab":[["<unk>",0.0],["a",-2.0],["b",-2.0],["ab",-1.0],["c",-2.0],)"
            R"(["ab",-1.5],["c",-3.0]]}})");
  const TokenizerJson t(dir.path() / "tokenizer.json");
  EXPECT_EQ(t.encode("ab"), (std::vector<std::int64_t>{5}));
  EXPECT_EQ(t.encode("abc"), (std::vector<std::int64_t>{5, 6}));
  EXPECT_EQ(t.encode("cab"), (std::vector<std::int64_t>{6, 5}));
  EXPECT_EQ(t.encode("xab"), (std::vector<std::int64_t>{0, 5}));
}

// Added tokens are found by searching the text for each of their first bytes (memchr) when they
// have at most four, and byte by byte otherwise. Tokens that never occur cannot change the ids, so
// two, four and six first bytes (the last taking the byte-by-byte path) must give the same ids;
// a token of each path must be found wherever it occurs.
TEST(HfTokenizerTest, AddedTokensAreFoundWithAnyNumberOfFirstBytes) {
  const fs::path file = folder_of("gpt2_style_8k") / "tokenizer.json";
  auto with = [&](std::vector<std::string> contents) {
    auto t = std::make_unique<TokenizerJson>(file);
    std::vector<AddedToken> tokens;
    for (auto& c : contents) tokens.push_back(AddedToken{.content = c, .normalized = false, .special = true});
    t->add_tokens(tokens);
    return t;
  };
  const auto two = with({"<a>", "[b]"});
  const auto four = with({"<a>", "[b]", "#zz#", "%y%"});
  const auto six = with({"<a>", "[b]", "#zz#", "%y%", "~w~", "\x01q"});
  const std::vector<std::string> texts = {"<a>",
                                          "x<a>y [b]<a><a",
                                          "<<a>[[b]] <a [b",
                                          "<a>[b]<a>",
                                          "no tokens here",
                                          "<",
                                          "[",
                                          "[b",
                                          "tail <a>",
                                          "\xC3\xA9<a>\xE2\x96\x81[b]\xF0\x9F\x98\x80<a>"};
  const std::int64_t a = two->encode("<a>").at(0), b = two->encode("[b]").at(0);
  EXPECT_EQ(two->encode("x<a>y"), (std::vector<std::int64_t>{two->encode("x").at(0), a, two->encode("y").at(0)}));
  EXPECT_EQ(two->encode("[b]<a>"), (std::vector<std::int64_t>{b, a}));
  for (const std::string& text : texts) {
    const auto want = two->encode(text);
    EXPECT_EQ(four->encode(text), want) << text;
    EXPECT_EQ(six->encode(text), want) << text;
  }
  for (const auto* t : {four.get(), six.get()}) {
    const std::int64_t zz = t->encode("#zz#").at(0), y = t->encode("%y%").at(0);
    EXPECT_EQ(t->encode("#zz#%y%<a>"), (std::vector<std::int64_t>{zz, y, a}));
  }
  const std::int64_t w = six->encode("~w~").at(0), q = six->encode("\x01q").at(0);
  EXPECT_EQ(six->encode("~w~<a>\x01q[b]"), (std::vector<std::int64_t>{w, a, q, b}));
  EXPECT_EQ(six->encode("~w~"), (std::vector<std::int64_t>{w}));
}

TEST(HfTokenizerTest, TinyJsonLoadsAndMerges) {
  TempDir dir;
  dir.write("tokenizer.json", tiny_json());
  dir.write("tokenizer_config.json", R"({"tokenizer_class": "PreTrainedTokenizerFast"})");
  auto tok = build_ok(dir.path());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->tokenize("ab a"), (std::vector<std::int64_t>{256, 32, 97}));  // "ab", then " " and "a"
}

TEST(HfTokenizerTest, RejectsMissingFolderAndHubNames) {
  EXPECT_THAT(build_error("/nonexistent/folder"), HasSubstr("not a local folder; downloads are not supported"));
  EXPECT_THAT(build_error("gpt2"), HasSubstr("tok.config.pretrained_model_name_or_path"));
  EXPECT_THAT(build_error("openai-community/gpt2"), HasSubstr("downloads are not supported, give a local folder"));
}

TEST(HfTokenizerTest, RejectsFolderWithoutTokenizerJson) {
  TempDir dir;
  dir.write("vocab.json", "{}");
  EXPECT_THAT(build_error(dir.path()), HasSubstr("has no tokenizer.json"));
}

TEST(HfTokenizerTest, RejectsMalformedJson) {
  TempDir dir;
  dir.write("tokenizer.json", R"({"version": "1.0", "model": {"type": "BPE", )");
  EXPECT_THAT(build_error(dir.path()), HasSubstr("malformed JSON"));
  TempDir dir2;
  dir2.write("tokenizer.json", tiny_json());
  dir2.write("tokenizer_config.json", "{ not json");
  EXPECT_THAT(build_error(dir2.path()), HasSubstr("tokenizer_config.json: malformed JSON"));
}

// Decoders on hand-made token lists (tokenizers 0.22 outputs): Strip counts characters and refuses
// what tokenizers panics on; ByteFallback turns an invalid run into one U+FFFD per byte.
TEST(HfTokenizerTest, StripAndByteFallbackDecodersAtTheirEdges) {
  TempDir dir;
  dir.write("tokenizer.json", tiny_json("null", "null", "", "null",
                                        R"({"type":"Sequence","decoders":[{"type":"ByteFallback"},)"
                                        R"({"type":"Strip","content":"a","start":1,"stop":1}]})"));
  TokenizerJson t(dir.path() / "tokenizer.json");
  const std::int64_t a = *t.token_to_id("a"), ab = *t.token_to_id("ab"), b = *t.token_to_id("b");
  // Expected values from tokenizers 0.22.2: Strip('a', 1, 1) on ["ab", "b"] gives "bb"; on a token "a"
  // the cuts cross (start 1 > stop 0) and tokenizers panics.
  EXPECT_EQ(t.decode(std::vector<std::int64_t>{ab, b}), "bb");
  EXPECT_THROW(t.decode(std::vector<std::int64_t>{ab, b, a}), Error);
  TempDir dir2;
  dir2.write("tokenizer.json",
             tiny_json("null", "null", "", "null", R"({"type":"Strip","content":"a","start":0,"stop":3})"));
  TokenizerJson t2(dir2.path() / "tokenizer.json");
  EXPECT_EQ(t2.decode(std::vector<std::int64_t>{b}), "b");
  // Strip('a', 0, 3): a token of content characters only, shorter than stop, makes tokenizers panic.
  EXPECT_THROW(t2.decode(std::vector<std::int64_t>{b, a}), Error);
}

TEST(HfTokenizerTest, RejectsOtherModelTypesByName) {
  TempDir dir;
  dir.write("tokenizer.json", R"({"version":"1.0","added_tokens":[],"normalizer":null,"pre_tokenizer":null,)"
                              R"("post_processor":null,"decoder":null,"model":{"type":"Whatever","vocab":{"a":0}}})");
  const std::string e = build_error(dir.path());
  EXPECT_THAT(e, HasSubstr("model 'Whatever' is not supported"));
  EXPECT_THAT(e, HasSubstr("supported: BPE, Unigram, WordPiece and WordLevel"));
  EXPECT_THAT(e, HasSubstr("model.type"));
}

// SentencePiece charsmaps (Precompiled): the t5_nmt_style family (a real nmt_nfkc charsmap) is
// exact on the corpus (FamilyTest); here malformed charsmaps and the one refused case.
TEST(HfTokenizerTest, PrecompiledCharsmapsLoadOrFailByName) {
  EXPECT_EQ(engine_error(tiny_json(R"({"type":"Precompiled","precompiled_charsmap":""})")), "");  // identity
  EXPECT_THAT(engine_error(tiny_json(R"({"type":"Precompiled","precompiled_charsmap":"!!"})")),
              HasSubstr("normalizer.precompiled_charsmap: not valid base64"));
  EXPECT_THAT(engine_error(tiny_json(R"({"type":"Precompiled","precompiled_charsmap":"AAAA"})")),
              HasSubstr("shorter than its 4-byte header"));
  EXPECT_THAT(engine_error(tiny_json(R"({"type":"Precompiled","precompiled_charsmap":"/wAAAA=="})")),
              HasSubstr("trie size 255 does not fit"));
  const TokenizerJson t5(kFamilies / "t5_nmt_style" / "tokenizer.json");
  // NFKC maps NO-BREAK SPACE; U+2FFC (Unicode 15.1) right after it could join its grapheme cluster.
  EXPECT_EQ(t5.encode("a\u00a0b"), t5.encode("a b"));
  EXPECT_THAT([&] { (void)t5.encode("a\u00a0\u2ffc b"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("cannot decide U+2FFC after U+00A0")));
}

// A charsmap that maps characters which join grapheme clusters (nmt_nfkc maps none of the Prepend
// characters): U+0600 (Prepend) -> "X", U+200D (ZWJ) -> "Z", "A" U+0301 -> U+00C1. Printed by
// scripts/reference/make_test_charsmap.py (SentencePiece 0.2.3).
constexpr std::string_view kPrependCharsmap =
    "AAQAAAAAAQBBPAMAzAACAIEdAAAEAACAgA0AAAAAAICADAIAAgAAgI0FAAALAAAACgAAAA0AAAAMAAAADwAAAA4AAAARAAAAEAAA"
    "ABMAAAASAAAAFQAAABQAAAAXAAAAFgAAABkAAAAYAAAAGwAAABoAAAAdAAAAHAAAAB8AAAAeAAAAIQAAACAAAAAjAAAAIgAAACUA"
    "AAAkAAAAJwAAACYAAAApAAAAKAAAACsAAAAqAAAALQAAACwAAAAvAAAALgAAADEAAAAwAAAAMwAAADIAAAA1AAAANAAAADcAAAA2"
    "AAAAOQAAADgAAAA7AAAAOgAAAD0AAAA8AAAAPwAAAD4AAABBAAAAQAAAAEMAAABCAAAARQAAAEQAAABHAAAARgAAAEkAAABIAAAA"
    "SwAAAEoAAABNAAAATAAAAE8AAABOAAAAUQAAAFAAAABTAAAAUgAAAFUAAABUAAAAVwAAAFYAAABZAAAAWAAAAFsAAABaAAAAXQAA"
    "AFwAAABfAAAAXgAAAGEAAABgAAAAYwAAAGIAAABlAAAAZAAAAGcAAABmAAAAaQAAAGgAAABrAAAAagAAAG0AAABsAAAAbwAAAG4A"
    "AABxAAAAcAAAAHMAAAByAAAAdQAAAHQAAAB3AAAAdgAAAHkAAAB4AAAAewAAAHoAAAB9AAAAfAAAAH8AAAB+AAAAgQAAAIAAAACD"
    "AAAAggAAAIUAAACEAAAAhwAAAIYAAACJAAAAiAAAAIsAAACKAAAAjQAAAIwAAACPAAAAjgAAAJEAAACQAAAAkwAAAJIAAACVAAAA"
    "lAAAAJcAAACWAAAA2HQAAJgAAACbAAAAmgAAAJ0AAACcAAAAnwAAAJ4AAAChAAAAoAAAAOKUAACiAAAApQAAAKQAAACnAAAApgAA"
    "AKkAAACoAAAAqwAAAKoAAACtAAAArAAAAK8AAACuAAAAsQAAALAAAACzAAAAsgAAALUAAAC0AAAAtwAAALYAAAC5AAAAuAAAALsA"
    "AAC6AAAAvQAAALwAAAC/AAAAvgAAAMEAAADAAAAAwwAAAMIAAADFAAAAxAAAAMcAAADGAAAAyQAAAMgAAADLAAAAygAAAM0AAADM"
    "AAAAzwAAAM4AAADRAAAA0AAAANMAAADSAAAA1QAAANQAAADXAAAA1gAAANkAAADYAAAA2wAAANoAAADdAAAA3AAAAN8AAADeAAAA"
    "4QAAAOAAAADjAAAA4gAAAOUAAADkAAAA5wAAAOYAAADpAAAA6AAAAOsAAADqAAAA7QAAAOwAAADvAAAA7gAAAPEAAADwAAAA8wAA"
    "APIAAAD1AAAA9AAAAPcAAAD2AAAA+QAAAPgAAAD7AAAA+gAAAP0AAAD8AAAA/wAAAP4AAABYAFoAw4EA";

// Note [Precompiled on ASCII] and Note [Lone grapheme clusters]: with and without the shortcuts,
// the real nmt_nfkc charsmap and kPrependCharsmap give the same text for every code point at the
// start, between ASCII neighbours (letters, controls, the halves of "\r\n"), before and after
// characters of class Other (which the second shortcut maps alone) and next to those that join
// clusters (Prepend U+0600, Extend U+0301, SpacingMark U+0903, ZWJ, a regional indicator, a Hangul
// L jamo), and on the corpora.
// `json` with the value of its top-level "key" (an object or null) replaced by `value`.
std::string with_json_value(std::string json, const std::string& key, const std::string& value) {
  const std::size_t at = json.find("\"" + key + "\":");
  if (at == std::string::npos) throw std::runtime_error("no " + key);
  const std::size_t begin = at + key.size() + 3;
  std::size_t end = begin;
  if (json.compare(begin, 4, "null") == 0) {
    end = begin + 4;
  } else {
    int depth = 0;
    bool in_string = false;
    for (; end < json.size(); ++end) {
      const char c = json[end];
      if (in_string) {
        if (c == '\\') ++end;
        else if (c == '"') in_string = false;
      } else if (c == '"') {
        in_string = true;
      } else if (c == '{' || c == '[') {
        ++depth;
      } else if ((c == '}' || c == ']') && --depth == 0) {
        ++end;
        break;
      }
    }
  }
  return json.replace(begin, end - begin, value);
}

// Note [Cached chunks]: the ids of a text cut into chunks at safe spaces (each chunk after the
// first from the per-thread cache) equal those of whole segments, for every pipeline that allows
// the cuts, on random text made of spaces and of characters that are neutral or just not: case,
// marks that compose or not, Prepend, jamo, ZWJ, emoji, regional indicators, controls that Nmt
// removes or turns into spaces, ideographic and no-break spaces, the replacement character, and
// characters that NFKC or the charsmap change. Pipelines that do not allow cuts must say so.
TEST(HfTokenizerTest, CachedChunksChangeNothing) {
  const std::string unigram = testing::read_file(kData / "families" / "unigram_style" / "tokenizer.json");
  const std::string metaspace = R"({"type":"Metaspace","replacement":"\u2581","prepend_scheme":"%s","split":%s})";
  const auto meta = [&](const std::string& scheme, bool split) {
    std::string m = metaspace;
    m.replace(m.find("%s"), 2, scheme);
    m.replace(m.find("%s"), 2, split ? "true" : "false");
    return m;
  };
  const auto seq = [](const std::string& items) { return R"({"type":"Sequence","normalizers":[)" + items + "]}"; };
  struct Variant {
    std::string name, json;
    bool chunked;
  };
  std::vector<Variant> variants = {
      {"unigram_style", unigram, true},
      {"t5_nmt_style", testing::read_file(kData / "families" / "t5_nmt_style" / "tokenizer.json"), true},
      {"t5_style", testing::read_file(kData / "families" / "t5_style" / "tokenizer.json"), true},
      {"nfd_strip_lower_first",
       with_json_value(with_json_value(unigram, "normalizer",
                                       seq(R"({"type":"NFD"},{"type":"StripAccents"},{"type":"Lowercase"})")),
                       "pre_tokenizer", meta("first", true)),
       true},
      {"nfc_lower_strip_right_never",
       with_json_value(
           with_json_value(
               unigram, "normalizer",
               seq(R"({"type":"NFC"},{"type":"Lowercase"},{"type":"Strip","strip_left":false,"strip_right":true})")),
           "pre_tokenizer", meta("never", true)),
       true},
      {"nfkd_no_normalizer_split", with_json_value(unigram, "normalizer", R"({"type":"NFKD"})"), true},
      {"none", with_json_value(unigram, "normalizer", "null"), true},
      {"whitespace_style", testing::read_file(kData / "families" / "whitespace_style" / "tokenizer.json"), true},
      {"pretok_sequences_style", testing::read_file(kData / "families" / "pretok_sequences_style" / "tokenizer.json"),
       true},
      {"whitespace_split_then_metaspace_strip_both",
       with_json_value(
           with_json_value(unigram, "normalizer",
                           seq(R"({"type":"NFKC"},{"type":"Strip","strip_left":true,"strip_right":true})")),
           "pre_tokenizer",
           R"({"type":"Sequence","pretokenizers":[{"type":"WhitespaceSplit"},)" + meta("first", true) + "]}"),
       true},
      {"bert_pre_tokenizer_lowercase",
       with_json_value(with_json_value(unigram, "normalizer", R"({"type":"Lowercase"})"), "pre_tokenizer",
                       R"({"type":"BertPreTokenizer"})"),
       true},
      {"metaspace_then_digits",
       with_json_value(unigram, "pre_tokenizer",
                       R"({"type":"Sequence","pretokenizers":[)" + meta("always", true) +
                           R"(,{"type":"Digits","individual_digits":true}]})"),
       true},
      {"gpt2_style_8k", testing::read_file(folder_of("gpt2_style_8k") / "tokenizer.json"), false},  // ByteLevel's regex
      {"llama3_style", testing::read_file(folder_of("llama3_style") / "tokenizer.json"), true},
      {"qwen2_style", testing::read_file(folder_of("qwen2_style") / "tokenizer.json"), true},
      {"gpt4o_style", testing::read_file(kData / "families" / "gpt4o_style" / "tokenizer.json"), true},
      {"tekken_style", testing::read_file(kData / "families" / "tekken_style" / "tokenizer.json"), true},
      {"roberta_style", testing::read_file(kData / "families" / "roberta_style" / "tokenizer.json"), false},
      {"deepseek_v3_style", testing::read_file(kData / "families" / "deepseek_v3_style" / "tokenizer.json"), false},
      {"bloom_style", testing::read_file(kData / "families" / "bloom_style" / "tokenizer.json"), false},
      {"gptneox_style", testing::read_file(kData / "families" / "gptneox_style" / "tokenizer.json"),
       false},  // tokens of spaces
      {"qwen2_rstrip_token",
       [&] {
         std::string j = testing::read_file(folder_of("qwen2_style") / "tokenizer.json");
         j.replace(j.find("false", j.find("\"rstrip\"")), 5, "true");  // of the normalized token "ñ"
         return j;
       }(),
       false},
      {"strip_left",
       with_json_value(unigram, "normalizer", R"({"type":"Strip","strip_left":true,"strip_right":false})"), false},
      {"split_space_first",
       with_json_value(unigram, "pre_tokenizer",
                       R"({"type":"Split","pattern":{"String":" "},"behavior":"Removed","invert":false})"),
       false},
      {"punctuation_first",
       with_json_value(
           unigram, "pre_tokenizer",
           R"({"type":"Sequence","pretokenizers":[{"type":"Punctuation","behavior":"Isolated"},{"type":"WhitespaceSplit"}]})"),
       false},
      {"replace_space",
       with_json_value(unigram, "normalizer", R"({"type":"Replace","pattern":{"String":" "},"content":"_"})"), false},
      {"replace_other_regex",
       with_json_value(unigram, "normalizer", R"({"type":"Replace","pattern":{"Regex":" +"},"content":" "})"), false},
      {"prepend", with_json_value(unigram, "normalizer", R"({"type":"Prepend","prepend":"_"})"), false},
      {"bert",
       with_json_value(
           unigram, "normalizer",
           R"({"type":"BertNormalizer","clean_text":true,"handle_chinese_chars":true,"strip_accents":null,"lowercase":true})"),
       false},
      {"no_split", with_json_value(unigram, "pre_tokenizer", meta("always", false)), false},
      {"whitespace_split", with_json_value(unigram, "pre_tokenizer", R"({"type":"WhitespaceSplit"})"), true},
  };
  const std::vector<std::string> alphabet = {
      " ",      " ",       " ",      " ",      "a",          "B",          "z",
      "Q",      "s",       "t",      "7",      "12",         ",",          ".",
      "'",      "-",       "/",      "\t",     "\n",         "\r",         "\x01",
      "\x0B",   "\x7F",    "\u0085", "\u2028", "\u180E",     "\u02B0",     "<|endoftext|>",
      "\u00F1", "n\u0303", "\u00A0", "\u3000", "\u2581",     "\u200B",     "\u200D",
      "\u0301", "\u0306",  "\u0308", "\u093E", "\u0600",     "\u0915",     "\u093C",
      "\u1100", "\u1161",  "\u11A8", "\uAC00", "\u00E9",     "\u00C9",     "\uFB01",
      "\u2460", "\u0419",  "\u0438", "\u0436", "\u0416",     "\u05D0",     "\u0627",
      "\u0E01", "\u0E33",  "\u4E2D", "\u3042", "\U0001F600", "\U0001F1E9", "\U0001F1EA",
      "\uFF21", "\u00B4",  "\u0130", "\u03A3", "\u1E9E"};
  std::mt19937 rng(1234);
  for (const Variant& v : variants) {
    TempDir dir;
    dir.write("tokenizer.json", v.json);
    TokenizerJson chunked(dir.path() / "tokenizer.json");
    TokenizerJson whole(dir.path() / "tokenizer.json");
    whole.set_chunked(false);
    ASSERT_EQ(chunked.chunked(), v.chunked) << v.name;
    if (!v.chunked) continue;
    std::size_t mismatches = 0;
    for (int i = 0; i < 40000; ++i) {
      std::string text;
      const int n = 2 + static_cast<int>(rng() % 10);
      for (int k = 0; k < n; ++k) text += alphabet[rng() % alphabet.size()];
      // Words that recur, so that chunks come back from the cache.
      if (i % 3 == 0) text += " word Za \u0436\u0438\u0442\u044C";
      const auto want = whole.encode(text);
      const auto got = chunked.encode(text);
      if (got != want && mismatches++ < 3)
        ADD_FAILURE() << v.name << ": '" << text << "'\n  whole:   " << show(want) << "\n  chunked: " << show(got);
    }
    // Every pair of characters before and after a space, from the characters that could matter.
    const std::vector<std::string> around = {"a",      "Z",      "7",      ".",          " ",
                                             "\u0600", "\u0301", "\u1100", "\uAC00",     "\u00B4",
                                             "\u3000", "\x01",   "\u0436", "\U0001F600", "\u200D"};
    for (const auto& x2 : around)
      for (const auto& x1 : around)
        for (const auto& y1 : around)
          for (const auto& y2 : around) {
            const std::string text = "w" + x2 + x1 + " " + y1 + y2 + " w";
            const auto want = whole.encode(text);
            const auto got = chunked.encode(text);
            if (got != want && mismatches++ < 3)
              ADD_FAILURE() << v.name << ": '" << text << "'\n  whole:   " << show(want)
                            << "\n  chunked: " << show(got);
          }
    // The same bytes as the text's first chunk and as the first chunk of a later segment (after an
    // added token: not at the origin, where Metaspace's "first" scheme prepends nothing) or after a
    // cut, in turn: the cache keeps the text's first chunk apart.
    const std::vector<AddedToken> sep = {AddedToken{.content = "<sep>", .normalized = false, .special = true}};
    chunked.add_tokens(sep);
    whole.add_tokens(sep);
    for (const std::string_view text : {"word", "<sep>word", "word", " word", "<sep> word", " word", "a word",
                                        "<sep>a word", "\u2581word", "<sep>\u2581word", "\u2581word"}) {
      const auto want = whole.encode(text);
      const auto got = chunked.encode(text);
      if (got != want && mismatches++ < 3)
        ADD_FAILURE() << v.name << ": '" << text << "'\n  whole:   " << show(want) << "\n  chunked: " << show(got);
    }
    EXPECT_EQ(mismatches, 0u) << v.name;
  }
  // A token added after encoding is found in chunks that were cached before it existed.
  TempDir dir;
  dir.write("tokenizer.json", unigram);
  TokenizerJson late(dir.path() / "tokenizer.json"), early(dir.path() / "tokenizer.json");
  const std::vector<AddedToken> token = {AddedToken{.content = "word"}};
  early.add_tokens(token);
  const std::string text = "one word and another word";
  const auto before = late.encode(text);
  late.add_tokens(token);
  EXPECT_NE(late.encode(text), before);
  EXPECT_EQ(late.encode(text), early.encode(text));
}

TEST(HfTokenizerTest, PrecompiledShortcutsChangeNothing) {
  dom::parser parser;
  dom::element root = parser.load((kFamilies / "t5_nmt_style" / "tokenizer.json").string()).value();
  std::string_view encoded;
  dom::element normalizer = root["normalizer"];
  if (normalizer["type"].get_string().value() == "Sequence") {
    for (dom::element n : normalizer["normalizers"].get_array())
      if (n["type"].get_string().value() == "Precompiled") normalizer = n;
  }
  ASSERT_EQ(normalizer["precompiled_charsmap"].get_string().get(encoded), simdjson::SUCCESS);
  std::string nmt_nfkc, prepend;
  ASSERT_TRUE(absl::Base64Unescape(absl::string_view(encoded.data(), encoded.size()), &nmt_nfkc));
  ASSERT_TRUE(absl::Base64Unescape(absl::string_view(kPrependCharsmap.data(), kPrependCharsmap.size()), &prepend));
  auto run = [](const PrecompiledCharsmap& m, const std::string& text, bool* removed) {
    std::string out;
    *removed = false;
    try {
      return m.normalize(text, out, removed) ? out : text;
    } catch (const Error& e) {
      return std::string("error: ") + e.what();
    }
  };
  for (const std::string& blob : {nmt_nfkc, prepend}) {
    const PrecompiledCharsmap fast(blob, "test");
    const PrecompiledCharsmap slow = fast.without_fast_paths();
    std::size_t differences = 0;
    auto check = [&](const std::string& text) {
      bool r1 = false, r2 = false;
      const std::string a = run(fast, text, &r1), b = run(slow, text, &r2);
      if ((a != b || r1 != r2) && differences++ < 5)
        ADD_FAILURE() << "'" << text << "': '" << a << "' vs '" << b << "'";
    };
    for (char32_t c = 0; c < 0x110000; ++c) {
      if (c >= 0xD800 && c <= 0xDFFF) continue;
      std::string cp;
      append_utf8(cp, c);
      check(cp + "\x7f ");
      check("ab" + cp + "cd");
      check("\t\r" + cp + "\nb");
      check("\u00e9" + cp + "\u4e2d\u00a0");  // é c 中 NBSP
      check("\u4e2d\u00e9" + cp);
      check(cp + "\u00e9\u4e2d");
      check("\u0600" + cp + "\u00e9");
      check("\u00e9" + cp + "\u0301");
      check("\u0416" + cp + "\u0903\u00e9");
      check("\u200d" + cp + "\u00c5\u200d");
      check("\U0001F1E6" + cp + "\uFF21\U0001F1E6");
      check("\u1100" + cp + "\u00e9");
      check("\uac00" + cp + "\uac01");        // Hangul syllables LV and LVT around c
      check("\uac01" + cp + "\u1161\u11a8");  // c before V and T jamo
    }
    for (const fs::path& corpus : {kCorpus, kFamilies / "corpus.jsonl"})
      for (const std::string& text : texts_of(corpus)) check(text);
    EXPECT_EQ(differences, 0u) << blob.size() << "-byte charsmap";
  }
  // The quirk the second charsmap exists for: a cluster takes the entry of its shortest mapped prefix.
  std::string out;
  bool removed = false;
  ASSERT_TRUE(PrecompiledCharsmap(prepend, "test").normalize("a\u0600\u00e9b", out, &removed));
  EXPECT_EQ(out, "aXb");  // tokenizers 0.22: Precompiled(blob).normalize_str("a\u0600éb") == "aXb"
}

TEST(HfTokenizerTest, RejectsUnsupportedPipelinePartsByName) {
  EXPECT_THAT(engine_error(tiny_json("null", R"({"type":"UnicodeScripts"})")),
              HasSubstr("pre-tokenizer 'UnicodeScripts' is not supported"));
  // Stages after ByteLevel are supported (Falcon; Note [Pre-tokenizers after ByteLevel]), but not a
  // second ByteLevel or a Metaspace there.
  EXPECT_THAT(engine_error(tiny_json(
                  "null", R"({"type":"Sequence","pretokenizers":[{"type":"ByteLevel"},{"type":"ByteLevel"}]})")),
              HasSubstr("pre-tokenizer 'ByteLevel' after ByteLevel is not supported"));
  EXPECT_THAT(
      engine_error(tiny_json(
          "null",
          R"({"type":"Sequence","pretokenizers":[{"type":"ByteLevel"},{"type":"Metaspace","replacement":"_"}]})")),
      HasSubstr("pre-tokenizer 'Metaspace' after ByteLevel is not supported"));
  EXPECT_THAT(engine_error(tiny_json("null", R"({"type":"ByteLevel"})", "", R"({"type":"Whatever"})")),
              HasSubstr("post-processor 'Whatever' is not supported"));
  EXPECT_THAT(engine_error(tiny_json("null", R"({"type":"ByteLevel"})", "", "null", R"({"type":"CTC"})")),
              HasSubstr("decoder 'CTC' is not supported"));
  std::string dropout = tiny_json();
  dropout.replace(dropout.find(R"("dropout":null)"), 14, R"("dropout":0.1)");
  EXPECT_THAT(engine_error(dropout), HasSubstr("dropout 0.1 is not supported"));
  auto split = [](const std::string& regex) {
    return tiny_json("null",
                     R"({"type":"Split","pattern":{"Regex":)" + regex + R"(},"behavior":"Isolated","invert":false})");
  };
  EXPECT_THAT(engine_error(split(R"x("[[:alpha:]]")x")), HasSubstr("POSIX bracket"));
  EXPECT_THAT(engine_error(split(R"x("\\p{Garay}")x")), HasSubstr("not known"));
  EXPECT_THAT(engine_error(split(R"x("(?i:\\p{Lu})")x")), HasSubstr("inside a case-insensitive group"));
  EXPECT_THAT(engine_error(split(R"x("(unclosed")x")), HasSubstr("does not compile"));
  std::string bad_merge = tiny_json();
  bad_merge.replace(bad_merge.find(R"(["a b"])"), 7, R"(["a zz"])");
  EXPECT_THAT(engine_error(bad_merge), HasSubstr("merge token 'zz' is not in the vocabulary"));
}

// Oniguruma's nested classes (unions) and intersections, which PCRE2 lacks.
TEST(HfTokenizerTest, NestedClassesAndIntersectionsMatchLikeOniguruma) {
  using Ranges = std::vector<std::pair<std::size_t, std::size_t>>;
  EXPECT_EQ(regex_matches("[a-z&&[^aeiou]]+", "strength, aeiou!"), (Ranges{{0, 3}, {4, 8}}));
  EXPECT_EQ(regex_matches("[^a-z&&[^x]]", "axb"), (Ranges{{1, 2}}));
  EXPECT_EQ(regex_matches("[a[0-9]]+", "a1b22"), (Ranges{{0, 2}, {3, 5}}));
  EXPECT_EQ(regex_matches("[^(\\s|[.,!?])]+", "hi, you (x)!"), (Ranges{{0, 2}, {4, 7}, {9, 10}}));
  EXPECT_EQ(regex_matches("[\\w&&[^\\d]]+", "ab12cd"), (Ranges{{0, 2}, {4, 6}}));
}

TEST(HfTokenizerTest, RejectsUnsupportedTokenizerClass) {
  TempDir dir;
  dir.write("tokenizer.json", tiny_json());
  dir.write("tokenizer_config.json", R"({"tokenizer_class": "CodeLlamaTokenizer"})");
  EXPECT_THAT(build_error(dir.path()), HasSubstr("tokenizer_class 'CodeLlamaTokenizer' is not supported"));
  EXPECT_THAT(build_error(dir.path()), HasSubstr("infilling"));
  dir.write("tokenizer_config.json", R"({"tokenizer_class": "MistralCommonTokenizer"})");
  EXPECT_THAT(build_error(dir.path()), HasSubstr("tokenizer_class 'MistralCommonTokenizer' is not supported"));
  // LlamaTokenizerFast with add_prefix_space rebuilds from the SentencePiece model in transformers.
  dir.write("tokenizer_config.json", R"({"tokenizer_class": "LlamaTokenizerFast", "add_prefix_space": true, )"
                                     R"("bos_token": "a", "eos_token": "b", "unk_token": "a"})");
  EXPECT_THAT(build_error(dir.path()), HasSubstr("rebuilds the tokenizer from its SentencePiece model"));
}

TEST(HfTokenizerTest, TokenIdRefusesStringsNotInTheVocabulary) {
  auto tok = build_ok(folder_of("gpt2_style_8k"));
  EXPECT_EQ(tok->token_id("<|endoftext|>"), 0);
  try {
    tok->token_id("<|endoftext|> ");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("token '<|endoftext|> ' is not in the vocabulary"));
  }
}

TEST(HfTokenizerTest, SpecialTokensMustAlreadyBeInTheVocabulary) {
  const std::string e = build_error(folder_of("gpt2_style_8k"), R"(special_tokens = { pad_token = "[PAD]" })");
  EXPECT_THAT(e, HasSubstr("tok.config.special_tokens"));
  EXPECT_THAT(e, HasSubstr("pad_token = '[PAD]' not in the vocabulary"));
  EXPECT_THAT(build_error(folder_of("gpt2_style_8k"), R"(special_tokens = { pad_tokn = "x" })"),
              HasSubstr("did you mean 'pad_token'"));
}

TEST(HfTokenizerTest, RejectsBadPaddingAndLengthSettings) {
  EXPECT_THAT(build_error(folder_of("gpt2_style_8k"), R"(padding = "max_length", max_length = 8)"),
              HasSubstr("padding needs a pad token"));
  EXPECT_THAT(build_error(folder_of("gpt2_style_8k"), R"(padding = true)"), HasSubstr("tok.config.padding"));
  EXPECT_THAT(build_error(folder_of("gpt2_style_8k"), R"(padding = "sideways")"), HasSubstr("\"max_length\""));
  EXPECT_THAT(build_error(folder_of("gpt2_style_8k"), R"(max_length = -1)"), HasSubstr("tok.config.max_length"));
  EXPECT_THAT(build_error(folder_of("llama3_style"), R"(truncation = true, max_length = 0)"),
              HasSubstr("leaves no room for the 1 template tokens"));
}

TEST(HfTokenizerTest, RejectsInvalidUtf8AndUnknownIds) {
  auto tok = build_ok(folder_of("gpt2_style_8k"));
  EXPECT_THROW(tok->tokenize(std::string("ab\xff", 3)), Error);
  try {
    tok->tokenize(std::string("ab\xc3", 3));
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("not valid UTF-8 (first bad byte at offset 2"));
  }
  EXPECT_THROW(tok->decode(std::vector<std::int64_t>{44, 8192}), Error);
  EXPECT_THROW(tok->decode(std::vector<std::int64_t>{-1}), Error);
}

// Regression: with \p{..} classes in a pre-tokenizer regex, a code point newer than PCRE2's
// Unicode 14 tables (U+1FAE8, an emoji of Unicode 15) was split unlike Hugging Face's tokenizers
// and packed as other token ids (then refused). Now such a text runs the pattern spelled with
// Oniguruma's own tables (Note [Two compiled patterns]).
TEST(HfTokenizerTest, CodePointsNewerThanPcre2SplitLikeOniguruma) {
  const Regex punct_or_symbol("[\\p{P}\\p{S}]+", "<test>", "pattern");
  EXPECT_TRUE(punct_or_symbol.delta().contains(0x1FAE8));  // So in Oniguruma, unassigned in PCRE2 10.42
  EXPECT_FALSE(punct_or_symbol.delta().contains(U'!'));
  const std::string text = "a\xF0\x9F\xAB\xA8!b";  // a U+1FAE8 ! b
  EXPECT_EQ(regex_matches("[\\p{P}\\p{S}]+", text), (std::vector<std::pair<std::size_t, std::size_t>>{{1, 6}}));
  TokenizerJson llama(folder_of("llama3_style") / "tokenizer.json");
  EXPECT_NO_THROW(llama.encode("Hi \xF0\x9F\xAB\xA8!"));
}

std::string all_code_points(const std::vector<char32_t>& cps, std::vector<std::size_t>& offsets) {
  std::string text;
  for (char32_t c : cps) {
    offsets.push_back(text.size());
    append_utf8(text, c);
  }
  return text;
}

// Every text of both corpora, then one text of every code point (surrogates and NUL excluded).
std::vector<std::string> corpora_and_every_code_point() {
  std::vector<std::string> texts = texts_of(kCorpus);
  for (std::string& t : texts_of(kFamilies / "corpus.jsonl")) texts.push_back(std::move(t));
  std::vector<char32_t> cps;
  for (char32_t c = 1; c < 0x110000; ++c)
    if (c < 0xD800 || c > 0xDFFF) cps.push_back(c);
  std::vector<std::size_t> offsets;
  texts.push_back(all_code_points(cps, offsets));
  return texts;
}

std::vector<std::pair<std::size_t, std::size_t>> matches_of(const Regex& re, std::string_view text) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  re.for_each_match(text, [&](std::size_t b, std::size_t e) { out.emplace_back(b, e); });
  return out;
}

// Calls check(text) for every string of 1 to max_len pieces of `alphabet`; returns how many.
template <class F>
std::size_t for_each_short_string(const std::vector<std::string>& alphabet, std::size_t max_len, F&& check) {
  std::size_t count = 0;
  std::vector<std::size_t> digits;
  for (std::size_t len = 1; len <= max_len; ++len) {
    digits.assign(len, 0);
    while (true) {
      std::string text;
      for (std::size_t d : digits) text += alphabet[d];
      check(text);
      ++count;
      std::size_t k = 0;
      while (k < len && ++digits[k] == alphabet.size()) digits[k++] = 0;
      if (k == len) break;
    }
  }
  return count;
}

// The Oniguruma -> PCRE2 translation, class by class over every code point, against what
// Note [One-pass BertNormalizer]: the one pass gives the text of the four passes (which FamilyTest
// and the probes check against `tokenizers`) for every code point, alone, between letters and
// removed marks, and before a kept non-starter, for each flag setting that changes the work.
TEST(HfTokenizerTest, OnePassBertNormalizerEqualsTheFourPassesOnEveryCodePoint) {
  std::size_t differences = 0;
  for (char32_t c = 0; c < 0x110000; ++c) {
    if (c >= 0xD800 && c <= 0xDFFF) continue;
    std::string alone, between = "Ab", before_kept = "a";
    append_utf8(alone, c);
    append_utf8(between, c);
    between +=
        "\xcc\x81"
        "c\xcc\xa7";  // U+0301, c, U+0327 (marks that are removed)
    append_utf8(before_kept, c);
    before_kept += "\xf0\x9d\x85\xa5";  // U+1D165 (class 216, Mc: kept), reordered after a kept class 230
    for (const auto& [strip, lower] : {std::pair{true, true}, std::pair{false, true}, std::pair{true, false}})
      for (const std::string& text : {alone, between, before_kept}) {
        bool removed_one = false, removed_four = false;
        const std::string one = bert_normalize(text, strip, lower, true, &removed_one);
        const std::string four = bert_normalize(text, strip, lower, false, &removed_four);
        if ((one != four || removed_one != removed_four) && differences++ < 5)
          ADD_FAILURE() << "U+" << std::hex << static_cast<std::uint32_t>(c) << " strip " << strip << " lower " << lower
                        << ": '" << one << "' vs '" << four << "'";
      }
  }
  EXPECT_EQ(differences, 0u);
}

// Note [Fused character maps]: the one pass gives the text and start flag of the steps run one by
// one (which FamilyTest checks against `tokenizers`) for every code point, alone, between letters
// and removed marks, after a removed first character, and before a kept non-starter.
TEST(HfTokenizerTest, FusedCharacterMapsEqualTheStepsOnEveryCodePoint) {
  using Steps = std::vector<std::string_view>;
  const std::vector<Steps> chains = {
      {"NFD", "StripAccents", "Lowercase"}, {"Lowercase", "StripAccents"}, {"Nmt", "Lowercase"},
      {"NFD", "Nmt", "StripAccents"},       {"NFD", "Lowercase"},          {"Lowercase"}};
  std::size_t differences = 0, fused = 0;
  for (char32_t c = 0; c < 0x110000; ++c) {
    if (c >= 0xD800 && c <= 0xDFFF) continue;
    std::string alone, between = "Ab", after_removed = "\xcc\x81\x01", before_kept = "a";
    append_utf8(alone, c);
    append_utf8(between, c);
    between +=
        "\xcc\x81"
        "c\xcc\xa7";                // U+0301, c, U+0327 (marks that StripAccents removes)
    append_utf8(after_removed, c);  // U+0301 and U+0001 first: StripAccents and Nmt remove them
    append_utf8(before_kept, c);
    before_kept += "\xf0\x9d\x85\xa5";  // U+1D165 (class 216, Mc: kept), reordered after a kept class 230
    for (const Steps& chain : chains)
      for (const std::string& text : {alone, between, after_removed, before_kept}) {
        bool removed_one = false, removed_steps = false;
        bool one_pass = false;
        const std::string one = normalize_steps(chain, text, true, &removed_one, &one_pass);
        const std::string steps = normalize_steps(chain, text, false, &removed_steps);
        if ((one != steps || removed_one != removed_steps) && differences++ < 5)
          ADD_FAILURE() << "U+" << std::hex << static_cast<std::uint32_t>(c) << " " << chain.front() << "+"
                        << chain.size() - 1 << ": '" << one << "' (" << removed_one << ") vs '" << steps << "' ("
                        << removed_steps << ")";
        fused += one_pass;
      }
  }
  EXPECT_EQ(differences, 0u);
  EXPECT_GT(fused, 23000000u) << fused;  // of 6 x 4 x 1.1M (23.3M): it gives up only on kept non-starters
}

// Note [One pass for character splits]: the one pass leaves the pieces of the stages run one by one
// (which FamilyTest checks against `tokenizers`) for every code point, alone and next to a letter,
// a digit, punctuation, a space and itself, for sequences of every behaviour.
TEST(HfTokenizerTest, OnePassCharacterSplitsEqualTheStagesOnEveryCodePoint) {
  using Stages = std::vector<std::string_view>;
  const std::vector<Stages> sequences = {{"WhitespaceSplit", "Punctuation", "Digits"},
                                         {"WhitespaceSplit", "Punctuation"},
                                         {"DigitsIndividual", "PunctuationContiguous"},
                                         {"PunctuationRemoved", "WhitespaceSplit", "DigitsIndividual"},
                                         {"CharDelimiterSplit:-", "Digits"}};
  std::size_t differences = 0;
  for (char32_t c = 0; c < 0x110000; ++c) {
    if (c >= 0xD800 && c <= 0xDFFF) continue;
    std::string alone, mixed = "a";
    append_utf8(alone, c);
    for (const char* next : {"1", ".", " ", "-", "", "b"}) {
      append_utf8(mixed, c);
      mixed += next;
    }
    for (const Stages& stages : sequences)
      for (const std::string& text : {alone, mixed}) {
        const auto one = split_characters(stages, text, true), each = split_characters(stages, text, false);
        if (one != each && differences++ < 5)
          ADD_FAILURE() << "U+" << std::hex << static_cast<std::uint32_t>(c) << " " << stages.front() << "+"
                        << stages.size() - 1 << ": " << one.size() << " vs " << each.size() << " pieces";
      }
  }
  EXPECT_EQ(differences, 0u);
  EXPECT_EQ(split_characters({{"WhitespaceSplit", "Punctuation", "Digits"}}, "ab  c.d12x", true),
            (std::vector<std::string>{"ab", "c", ".", "d", "12", "x"}));
}

// Note [Metaspace without a copy]: the words (and their "starts the text" flags) equal those of
// replacing, prepending and splitting (FamilyTest checks that path against `tokenizers`) on every
// string of up to 6 characters over spaces, both replacements, a letter and a multi-byte letter
// whose encoding shares the replacement's lead byte, for every scheme, with and without the origin.
// Long words (over a word-cache slot, under 256 bytes) go to a bounded map that, once full, takes no
// new words until four full maps' worth of misses later, when it is emptied, or, with few hits,
// rests for sixteen maps' worth of words and then fills again: through filling, resting and
// filling again every word keeps the ids it got from a tokenizer that met each word once. (Early
// words come back often, so the first full map is emptied and filled again; later ones never, so
// the second full map rests, and the map filled after the rest holds the last 300 words, which
// come back at the end: a simulation of the policy gave these phases for this sequence.)
TEST(HfTokenizerTest, LongWordCacheKeepsIdsThroughFillingAndEmptying) {
  const fs::path file = kData / "families" / "gemma_style" / "tokenizer.json";
  TokenizerJson cached(file), once(file);
  std::mt19937 rng(99);
  std::vector<std::string> words;
  for (std::size_t k = 0; k < 26 * 4096 + 500; ++k) {
    std::string w;
    for (int c = 0; c < 20; ++c) {  // 20 CJK characters: 60 bytes, one word (no U+2581 inside)
      const char32_t cp = 0x4E00 + rng() % 0x5000;
      w += static_cast<char>(0xE0 | (cp >> 12));
      w += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      w += static_cast<char>(0x80 | (cp & 0x3F));
    }
    words.push_back(std::move(w));
  }
  std::vector<std::vector<std::int64_t>> want;
  for (const std::string& w : words) want.push_back(once.encode(w));
  std::size_t mismatches = 0, checked = 0;
  const auto check = [&](std::size_t k) {
    ++checked;
    if (cached.encode(words[k]) != want[k] && mismatches++ < 3) ADD_FAILURE() << "word " << k;
  };
  for (std::size_t k = 0; k < words.size(); ++k) {
    check(k);
    if (k < 8192 && k % 3 == 0) check(k / 2);  // earlier words again, in the map or not
  }
  for (std::size_t k = words.size() - 300; k < words.size(); ++k) check(k);  // the map's words after resting
  EXPECT_EQ(mismatches, 0u) << "of " << checked;
}

// Note [Replace by hand]: a one-byte String pattern and the Regex " {2,}" are replaced in one pass
// over the bytes; the same replacement through the general regex path (" " and "  +" as regexes)
// gives the same ids on every short string of spaces, the pattern byte, U+2581 and other
// characters, including replacements by nothing at the start (Metaspace's "first" scheme).
TEST(HfTokenizerTest, ReplaceByHandEqualsTheRegexPath) {
  const std::string unigram =
      with_json_value(testing::read_file(kData / "families" / "unigram_style" / "tokenizer.json"), "pre_tokenizer",
                      R"({"type":"Metaspace","replacement":"\u2581","prepend_scheme":"first","split":true})");
  const std::string gemma = testing::read_file(kData / "families" / "gemma_style" / "tokenizer.json");
  const auto replace = [](const std::string& kind, const std::string& pattern, const std::string& content) {
    return R"({"type":"Replace","pattern":{")" + kind + R"(":")" + pattern + R"("},"content":")" + content + R"("})";
  };
  struct Pair {
    std::string base, by_hand, general;
  };
  const std::vector<Pair> pairs = {
      {gemma, replace("String", " ", "\u2581"), replace("Regex", " ", "\u2581")},
      {unigram, replace("String", " ", "\u2581"), replace("Regex", " ", "\u2581")},
      {unigram, replace("String", " ", ""), replace("Regex", " ", "")},
      {unigram, replace("String", "a", "xyz"), replace("Regex", "a", "xyz")},
      {unigram, replace("Regex", " {2,}", " "), replace("Regex", "  +", " ")},
      {unigram, replace("Regex", " {2,}", ""), replace("Regex", "  +", "")},
      {gemma, replace("Regex", " {2,}", "\u2581"), replace("Regex", "  +", "\u2581")},
  };
  std::size_t differences = 0, strings = 0;
  for (const Pair& p : pairs) {
    TempDir dir;
    dir.write("hand.json", with_json_value(p.base, "normalizer", p.by_hand));
    dir.write("general.json", with_json_value(p.base, "normalizer", p.general));
    TokenizerJson by_hand(dir.path() / "hand.json"), general(dir.path() / "general.json");
    strings += for_each_short_string({" ", "a", "b", "\u2581", "\u4e2d"}, 6, [&](const std::string& text) {
      const auto want = general.encode(text);
      const auto got = by_hand.encode(text);
      if (got != want && differences++ < 5)
        ADD_FAILURE() << p.by_hand << " on '" << text << "'\n  general: " << show(want) << "\n  by hand: " << show(got);
    });
  }
  EXPECT_EQ(differences, 0u) << "of " << strings;
}

TEST(HfTokenizerTest, MetaspaceInPlaceEqualsReplacingAndSplitting) {
  std::size_t differences = 0, strings = 0;
  for (const std::string_view replacement : {"\u2581", "_"})
    for (const std::string_view scheme : {"always", "first", "never"})
      for (const bool at_origin : {true, false})
        strings +=
            for_each_short_string({" ", "\u2581", "_", "a", "\u2580", "\u4e2d"}, 6, [&](const std::string& text) {
              const auto in_place = metaspace_words(text, replacement, scheme, true, at_origin, true);
              const auto replacing = metaspace_words(text, replacement, scheme, true, at_origin, false);
              if (in_place != replacing && differences++ < 5)
                ADD_FAILURE() << "'" << text << "' " << replacement << " " << scheme << " " << at_origin << ": "
                              << in_place.size() << " vs " << replacing.size() << " words";
            });
  EXPECT_EQ(differences, 0u) << "of " << strings;
  EXPECT_EQ(metaspace_words(" a\u2581b  c", "\u2581", "always", true, true, true),
            (std::vector<std::pair<std::string, bool>>{
                {"\u2581a", true}, {"\u2581b", false}, {"\u2581", false}, {"\u2581c", false}}));
  EXPECT_EQ(metaspace_words("a b", "\u2581", "first", true, false, true),
            (std::vector<std::pair<std::string, bool>>{{"a", true}, {"\u2581b", false}}));
}

// CodePointSet::find_in skips ASCII words and lead bytes of blocks outside the set: the first
// code point in the set as a plain scan finds it, for sets in each UTF-8 length, on every text of
// the corpora and on a text of every code point.
TEST(HfTokenizerTest, CodePointSetFindInEqualsAScan) {
  std::vector<std::string> texts = corpora_and_every_code_point();
  // Each ASCII byte at every offset of an eight-byte word, after ASCII that is not in most sets.
  for (int c = 0; c < 0x80; ++c)
    for (std::size_t k = 0; k < 17; ++k)
      texts.push_back(std::string(k, 'a') + static_cast<char>(c) + std::string(9, 'b'));
  const Regex gpt4o(std::string(kGpt4oPattern), "<test>", "pattern");
  const std::vector<CodePointSet> sets = {
      gpt4o.delta(), *oniguruma_class("Lo"), CodePointSet::from_ranges({{'x', 'x'}}),
      CodePointSet::from_ranges({{0xE9, 0xE9}}), CodePointSet::from_ranges({{0x4E2D, 0x4E2D}}),
      CodePointSet::from_ranges({{0x1F600, 0x1F64F}}), CodePointSet::from_ranges({{0x10FFFF, 0x10FFFF}}),
      // ASCII members in one range (the eight-byte skip), at both ends of ASCII, and not in one range
      *oniguruma_class("N"), CodePointSet::from_ranges({{'0', '9'}}), CodePointSet::from_ranges({{0, 5}}),
      CodePointSet::from_ranges({{'z', 0x7F}}), CodePointSet::from_ranges({{0, 0x7F}}), *oniguruma_class("\\s"),
      CodePointSet::from_ranges({{'a', 'a'}, {'c', 'c'}})};
  std::size_t found = 0;
  for (const CodePointSet& set : sets)
    for (const std::string& text : texts) {
      std::size_t scan = std::string_view::npos;
      for (std::size_t i = 0, len; i < text.size(); i += len)
        if (set.contains(decode_at(text, i, &len))) {
          scan = i;
          break;
        }
      ASSERT_EQ(set.find_in(text), scan) << text.substr(0, 80);
      found += scan != std::string_view::npos;
    }
  EXPECT_GT(found, 500u);
}

// Note [Common patterns on every code point]: the hand-written matchers (and deepseek_v3_match)
// must give PCRE2's matches. Every string of up to 4 characters over an alphabet of the cases
// the ASCII logic distinguishes (spaces and line breaks of both kinds, contractions in both cases,
// letters, numbers and others, ASCII and not, "ſ" that folds to "s"), and over one of a
// representative of every class combination the matchers read (Lu, Ll, Lt, Lm, Lo, Mn, Mc, Nd,
// Nl, Po, Cc, spaces, astral letters and symbols, a symbol newer than PCRE2's tables); then the corpora
// and, for the patterns that tile the text, a text of every code point.
TEST(HfTokenizerTest, WordMatchersGiveThePcreMatches) {
  const std::vector<std::string> ascii_cases = {" ",
                                                "\t",
                                                "\n",
                                                "\r",
                                                "\x1c",
                                                "'",
                                                "s",
                                                "R",
                                                "e",
                                                "l",
                                                "Q",
                                                "7",
                                                "!",
                                                "\xc3\xa9" /* é */,
                                                "\xc5\xbf" /* ſ */,
                                                "\xd9\xa3" /* Arabic 3 */,
                                                "\xc2\xa0" /* NBSP */,
                                                "\xc2\xa7" /* § */,
                                                "\xe2\x80\xa8" /* U+2028 */,
                                                "/",
                                                "\xc3\x89" /* É */,
                                                "\xcc\x81" /* combining acute */,
                                                "\x01"};
  const std::vector<std::string> classes = {" ",
                                            "\n",
                                            "'",
                                            "S",
                                            "a",
                                            "\xc7\x85" /* ǅ Lt */,
                                            "\xca\xb0" /* ʰ Lm */,
                                            "\xe4\xb8\xad" /* 中 Lo */,
                                            "\xcc\x81" /* Mn */,
                                            "\xe0\xa4\x83" /* U+0903 Mc */,
                                            "\xe2\x85\xa0" /* Ⅰ Nl */,
                                            "\xe3\x80\x80" /* U+3000 */,
                                            "\xf0\x9d\x90\x80" /* U+1D400 Lu */,
                                            "\xf0\x9f\x98\x80" /* U+1F600 So */,
                                            "\xf0\x9f\xab\xa8" /* U+1FAE8 */,
                                            "\xc5\xbf" /* ſ */,
                                            "/",
                                            "7",
                                            "\xe3\x80\x81" /* 、 Po */,
                                            "\x01"};
  const std::vector<std::string> every = corpora_and_every_code_point();
  for (const std::string_view pattern :
       {kGpt2Pattern, kLlama3Pattern, kQwen2Pattern, kGpt4oPattern, kTekkenPattern, kDeepSeekV3Pattern}) {
    const Regex fast(std::string(pattern), "<test>", "pattern");
    ASSERT_TRUE(fast.has_hand_written_matcher()) << pattern;
    const Regex pcre = fast.without_hand_written_matchers();
    for (const auto* alphabet : {&ascii_cases, &classes}) {
      const std::size_t checked = for_each_short_string(*alphabet, 4, [&](const std::string& text) {
        ASSERT_EQ(matches_of(fast, text), matches_of(pcre, text)) << pattern << " on '" << text << "'";
      });
      EXPECT_GT(checked, 100000u);
    }
    for (const std::string& text : every)
      ASSERT_EQ(matches_of(fast, text), matches_of(pcre, text)) << pattern << ": " << text.substr(0, 200);
    // Every contraction in every case (and "ſ" for "s"), after nothing, a word or a space, before
    // a letter, a space or the end.
    for (const std::string c : {"s",  "t",  "re", "ve", "m",  "ll", "d", "S",        "T", "RE", "Re", "rE", "VE",
                                "Ve", "vE", "M",  "LL", "Ll", "lL", "D", "\xc5\xbf", "r", "v",  "l",  "x"})
      for (const std::string before : {"", "ab", "AB", " "})
        for (const std::string after : {"", "a", " ", "'"}) {
          const std::string text = before + "'" + c + after;
          ASSERT_EQ(matches_of(fast, text), matches_of(pcre, text)) << pattern << " on '" << text << "'";
        }
  }
  // The classes the matchers read, on every code point, against Oniguruma's sets.
  const CodePointSet upper = *oniguruma_class("Lu") | *oniguruma_class("Lt") | *oniguruma_class("Lm") |
                             *oniguruma_class("Lo") | *oniguruma_class("M");
  const CodePointSet lower =
      *oniguruma_class("Ll") | *oniguruma_class("Lm") | *oniguruma_class("Lo") | *oniguruma_class("M");
  std::size_t wrong = 0;
  for (char32_t c = 0; c < 0x110000; ++c) {
    if (c >= 0xD800 && c <= 0xDFFF) continue;
    const int want = (oniguruma_class("L")->contains(c) ? 1 : 0) | (oniguruma_class("N")->contains(c) ? 2 : 0) |
                     (oniguruma_class("\\s")->contains(c) ? 4 : 0) | (upper.contains(c) ? 8 : 0) |
                     (lower.contains(c) ? 16 : 0) | (oniguruma_class("M")->contains(c) ? 64 : 0) |
                     (oniguruma_class("P")->contains(c) || oniguruma_class("S")->contains(c) ? 128 : 0);
    if (word_match_classes(c) != want && wrong++ < 5)
      ADD_FAILURE() << "U+" << std::hex << static_cast<std::uint32_t>(c) << ": " << int{word_match_classes(c)} << " vs "
                    << want;
  }
  EXPECT_EQ(wrong, 0u);
  // Only these patterns take the fast path, and the family fixtures use them as real exports write them.
  EXPECT_FALSE(Regex(" ?\\p{L}+|\\s+", "<test>", "pattern").has_hand_written_matcher());
  for (const auto& [family, split, pattern] :
       {std::tuple{"gpt4o_style", 0, kGpt4oPattern}, std::tuple{"tekken_style", 0, kTekkenPattern},
        std::tuple{"deepseek_v3_style", 2, kDeepSeekV3Pattern}}) {
    dom::parser parser;
    std::string_view regex;
    ASSERT_EQ(parser.load((kFamilies / family / "tokenizer.json").string())["pre_tokenizer"]["pretokenizers"]
                  .at(split)["pattern"]["Regex"]
                  .get(regex),
              simdjson::SUCCESS)
        << family;
    EXPECT_EQ(regex, pattern) << family;
  }
}

// Note [Runs of one class]: DeepSeek-V3's first two splits (and single-class number splits), and
// BLOOM's split, scanned with Oniguruma's table give PCRE2's matches on every short string over
// their distinguishing characters, on a text of every code point and on the corpora.
TEST(HfTokenizerTest, RunsOfOneClassGiveThePcreMatches) {
  const std::vector<std::string> texts = corpora_and_every_code_point();
  const std::vector<std::string> alphabet = {"7",
                                             "\xd9\xa3" /* Arabic 3 */,
                                             "\xe2\x85\xa0" /* Roman numeral I */,
                                             "a",
                                             "\xe4\xb8\xad" /* U+4E2D */,
                                             "\xe3\x82\xa2" /* katakana a */,
                                             "\xe9\xbe\xa6" /* U+9FA6, after the range */,
                                             " "};
  for (const std::string pattern : {"\\p{N}{1,3}", "\\p{N}", "\\p{N}+", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"}) {
    const Regex fast(pattern, "<test>", "pattern");
    ASSERT_TRUE(fast.has_hand_written_matcher()) << pattern;
    const Regex pcre = fast.without_hand_written_matchers();
    for (const std::string& text : texts) ASSERT_EQ(matches_of(fast, text), matches_of(pcre, text)) << pattern;
    for_each_short_string(alphabet, 5, [&](const std::string& text) {
      ASSERT_EQ(matches_of(fast, text), matches_of(pcre, text)) << pattern << " on '" << text << "'";
    });
  }
  // The DeepSeek-V3 family fixture uses these two patterns as its first splits.
  dom::parser parser;
  std::string_view first, second;
  dom::element splits =
      parser.load((kFamilies / "deepseek_v3_style" / "tokenizer.json").string())["pre_tokenizer"]["pretokenizers"];
  ASSERT_EQ(splits.at(0)["pattern"]["Regex"].get(first), simdjson::SUCCESS);
  ASSERT_EQ(splits.at(1)["pattern"]["Regex"].get(second), simdjson::SUCCESS);
  EXPECT_TRUE(Regex(std::string(first), "<test>", "pattern").has_hand_written_matcher()) << first;
  EXPECT_TRUE(Regex(std::string(second), "<test>", "pattern").has_hand_written_matcher()) << second;
  // BLOOM's " ?[^C]+" (an optional space, then characters outside a nested class), on spaces of
  // every kind, the class's literals, letters and CJK, and its family fixture's pattern.
  const Regex bloom(std::string(kBloomPattern), "<test>", "pattern");
  ASSERT_TRUE(bloom.has_hand_written_matcher());
  const Regex bloom_pcre = bloom.without_hand_written_matchers();
  for (const std::string& text : texts) ASSERT_EQ(matches_of(bloom, text), matches_of(bloom_pcre, text)) << "BLOOM";
  for_each_short_string({" ", "a", "(", "|", ".", "\t", "\u2026", "\u3002", "\u3000", "\u0085", "\u4e2d", "["}, 5,
                        [&](const std::string& text) {
                          ASSERT_EQ(matches_of(bloom, text), matches_of(bloom_pcre, text))
                              << "BLOOM on '" << text << "'";
                        });
  std::string_view bloom_regex;
  ASSERT_EQ(parser.load((kFamilies / "bloom_style" / "tokenizer.json").string())["pre_tokenizer"]["pretokenizers"]
                .at(0)["pattern"]["Regex"]
                .get(bloom_regex),
            simdjson::SUCCESS);
  EXPECT_EQ(bloom_regex, kBloomPattern);
}

// Oniguruma inside `tokenizers` matches (regex_classes.json, probed by
// make_tokenizer_reference.py): identical with the explicit tables, and identical with PCRE2's
// own tables on every code point outside the pattern's delta.
TEST(HfTokenizerTest, RegexClassesMatchOnigurumaOnEveryCodePoint) {
  std::vector<char32_t> all;
  for (char32_t c = 1; c < 0x110000; ++c)
    if (c < 0xD800 || c > 0xDFFF) all.push_back(c);
  auto matched = [](const Regex& re, const std::vector<char32_t>& cps) {
    std::vector<std::size_t> offsets;
    const std::string text = all_code_points(cps, offsets);
    std::vector<bool> in(0x110000, false);
    re.for_each_match(text, [&](std::size_t b, std::size_t e) {
      auto i = static_cast<std::size_t>(std::lower_bound(offsets.begin(), offsets.end(), b) - offsets.begin());
      for (; i < offsets.size() && offsets[i] < e; ++i) in[cps[i]] = true;
    });
    return in;
  };
  dom::parser parser;
  dom::element root = parser.load((kData / "regex_classes.json").string()).value();
  const dom::object classes = object_of(root);
  std::size_t patterns = 0, delta_total = 0;
  for (auto [pattern, ranges] : classes) {
    std::vector<bool> want(0x110000, false);
    const dom::array list = array_of(ranges);
    for (dom::element r : list) {
      const dom::array pair = array_of(r);
      for (std::int64_t c = pair.at(0).get_int64().value(); c <= pair.at(1).get_int64().value(); ++c) want[c] = true;
    }
    const Regex re(std::string(pattern), "<test>", "pattern");
    const auto exact = matched(re.with_exact_tables(), all);
    std::vector<char32_t> outside_delta;
    for (char32_t c : all)
      if (!re.delta().contains(c)) outside_delta.push_back(c);
    const auto native = matched(re, outside_delta);
    std::size_t differences = 0;
    for (char32_t c : all) {
      const bool native_ok = re.delta().contains(c) || native[c] == want[c];
      if ((exact[c] != want[c] || !native_ok) && differences++ < 5)
        ADD_FAILURE() << pattern << ": U+" << std::hex << static_cast<std::uint32_t>(c) << " is "
                      << (want[c] ? "" : "not ") << "matched by Oniguruma" << (native_ok ? " (exact)" : " (native)");
    }
    EXPECT_EQ(differences, 0u) << pattern;
    delta_total += re.delta().ranges().size();
    ++patterns;
  }
  EXPECT_EQ(patterns, 14u);
  EXPECT_GT(delta_total, 0u);  // PCRE2 10.42 (Unicode 14) is older than Oniguruma's tables
}

// Every property class that real pre-tokenizer regexes use (GPT-2, Llama-3, Qwen2, Tekken, o200k,
// DeepSeek-V3, BLOOM), on every code point: the pattern matches exactly Oniguruma's table (probed
// from tokenizers by make_unicode_tables.py), natively outside the delta and with the explicit
// ranges everywhere.
TEST(HfTokenizerTest, EveryRegexClassOfRealPreTokenizersMatchesItsTable) {
  std::vector<char32_t> all;
  for (char32_t c = 1; c < 0x110000; ++c)
    if (c < 0xD800 || c > 0xDFFF) all.push_back(c);
  for (const char* name : {"L", "Lu", "Ll", "Lt", "Lm", "Lo", "M", "N", "Nd", "P", "S", "Z", "\\s", "\\w", "\\d"}) {
    const std::string n = name;
    const std::string pattern = n[0] == '\\' ? n : "\\p{" + n + "}";
    const CodePointSet* table = oniguruma_class(n);
    ASSERT_NE(table, nullptr) << name;
    const Regex re(pattern + "+", "<test>", "pattern");
    for (const bool exact : {false, true}) {
      const Regex r = exact ? re.with_exact_tables() : re;
      std::vector<bool> in(0x110000, false);
      // The native pattern runs on text without delta code points (as it would in use).
      std::string part;
      std::vector<char32_t> cps;
      for (char32_t c : all)
        if (exact || !re.delta().contains(c)) {
          cps.push_back(c);
          append_utf8(part, c);
        }
      std::vector<std::size_t> starts;
      for (std::size_t i = 0; i < part.size(); i += utf8_len(static_cast<unsigned char>(part[i]))) starts.push_back(i);
      r.for_each_match(part, [&](std::size_t b, std::size_t e) {
        auto i = static_cast<std::size_t>(std::lower_bound(starts.begin(), starts.end(), b) - starts.begin());
        for (; i < starts.size() && starts[i] < e; ++i) in[cps[i]] = true;
      });
      std::size_t differences = 0;
      for (char32_t c : cps)
        if (in[c] != table->contains(c) && differences++ < 3)
          ADD_FAILURE() << pattern << (exact ? " (exact)" : " (native)") << ": U+" << std::hex
                        << static_cast<std::uint32_t>(c);
      EXPECT_EQ(differences, 0u) << pattern << (exact ? " exact" : " native");
    }
  }
}

// The normalization fast path (Note [Normalization fast path]) must never skip
// a change (code points that tokenizers' older normalization tables do not know aside): every BMP character alone, after 'e'/'A'/a Hangul syllable and
// before combining marks and jamo, in all four forms, against utf8proc itself.
TEST(HfTokenizerTest, NormalizationFastPathAgreesWithUtf8proc) {
  auto utf8 = [](char32_t c) {
    utf8proc_uint8_t buf[4];
    const auto n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(c), buf);
    return std::string(reinterpret_cast<const char*>(buf), static_cast<std::size_t>(n));
  };
  auto utf8proc_form = [](const std::string& text, int options) {  // the reference
    utf8proc_uint8_t* dst = nullptr;
    const auto n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
                     &dst, static_cast<utf8proc_option_t>(options));
    std::string out(reinterpret_cast<const char*>(dst), static_cast<std::size_t>(n));
    std::free(dst);
    return out;
  };
  const std::pair<const char*, int> forms[] = {{"NFC", UTF8PROC_STABLE | UTF8PROC_COMPOSE},
                                               {"NFD", UTF8PROC_STABLE | UTF8PROC_DECOMPOSE},
                                               {"NFKC", UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT},
                                               {"NFKD", UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT}};
  const std::vector<std::string> before = {"", "e", "A", utf8(0xAC00), utf8(0x0B47), utf8(0x1100)};
  const std::vector<std::string> after = {"",           utf8(0x0301), utf8(0x0345), utf8(0x1161),
                                          utf8(0x11A8), utf8(0x0B3E), utf8(0x3099), "x"};
  std::size_t checked = 0, mismatches = 0;
  for (const auto& [form, options] : forms) {
    for (char32_t c = 0x20; c < 0x10000; ++c) {
      if (c >= 0xD800 && c <= 0xDFFF) continue;
      if (hf_normalization_unknown().contains(c)) continue;  // tokenizers leaves these alone; tested below
      for (const auto& b : before)
        for (const auto& a : after) {
          if ((c & 0xFF) != 0x41 && b.size() + a.size() > 0 && !(b.empty() || a.empty())) continue;  // sample pairs
          const std::string text = b + utf8(c) + a;
          const std::string want = utf8proc_form(text, options);
          if (unicode_normalize(text, form) != want && mismatches++ < 5)
            ADD_FAILURE() << form << " U+" << std::hex << static_cast<std::uint32_t>(c) << " in '" << text << "'";
          ++checked;
        }
    }
    for (const char32_t c : {0x1F600u, 0x1F44Du, 0x1D400u, 0x2F800u, 0x1F3FBu, 0x20000u, 0x1D15Eu, 0x11099u}) {
      const std::string text = "a" + utf8(c) + utf8(0x0301);
      EXPECT_EQ(unicode_normalize(text, form), utf8proc_form(text, options))
          << form << " U+" << std::hex << static_cast<std::uint32_t>(c);
    }
  }
  // Random mixtures of characters that compose, decompose, reorder or combine across neighbours.
  const std::vector<char32_t> pool = {
      'a',    'e',    'A',     ' ',    0x00E9, 0x0301, 0x0300, 0x0323, 0x0345, 0x0327, 0x1100, 0x1161, 0x11A8, 0xAC00,
      0xAC01, 0x0B47, 0x0B3E,  0x0B57, 0x212B, 0x2126, 0xFB01, 0x00C5, 0x030A, 0x3099, 0x304B, 0x00A0, 0x1E9B, 0x0F73,
      0x0344, 0x00BD, 0x1F600, 0x0E01, 0x0E48, 0x0E38, 0x05D0, 0x05B0, 0x05B8, 0x0628, 0x064E, 0x0651, 0x093C};
  // Note [Marks in order]: every run of up to three marks after a base (precomposed ones too), marks that only reorder
  // (Thai, Hebrew, Arabic, Devanagari, Tibetan) mixed with marks that compose or decompose.
  const std::vector<char32_t> marks = {0x0E48, 0x0E38, 0x05B0, 0x05B8, 0x064E, 0x0651, 0x093C,
                                       0x0301, 0x0323, 0x0345, 0x0F71, 0x0F72, 0x0344};
  for (const auto& [form, options] : forms)
    for (const char32_t base : {char32_t{'a'}, char32_t{0x0E01}, char32_t{0x05D0}, char32_t{0x0628}, char32_t{0x0915},
                                char32_t{0x00E9}, char32_t{0x1E0D}, char32_t{0x1E4D}})
      for (std::size_t k = 0; k < marks.size() * marks.size() * (marks.size() + 1); ++k) {
        std::string text = utf8(base) + utf8(marks[k % marks.size()]) + utf8(marks[k / marks.size() % marks.size()]);
        if (k / marks.size() / marks.size() > 0) text += utf8(marks[k / marks.size() / marks.size() - 1]);
        text += "b";
        const std::string want = utf8proc_form(text, options);
        if (unicode_normalize(text, form) != want && mismatches++ < 10) ADD_FAILURE() << form << " '" << text << "'";
        ++checked;
      }
  // Each text in every form in turn, so that a region normalized in one form comes back in the
  // others (Note [Memo of normalized regions]).
  std::uint64_t state = 12345;
  for (int k = 0; k < 20000; ++k) {
    std::string text;
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    const int n = 1 + static_cast<int>((state >> 33) % 8);
    for (int m = 0; m < n; ++m) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      text += utf8(pool[(state >> 33) % pool.size()]);
    }
    for (const auto& [form, options] : forms) {
      const std::string want = utf8proc_form(text, options);
      if (unicode_normalize(text, form) != want && mismatches++ < 10) ADD_FAILURE() << form << " '" << text << "'";
      ++checked;
    }
  }
  EXPECT_EQ(mismatches, 0u) << "of " << checked;
}

// Code points that tokenizers' normalization tables (Unicode 9) do not know stay as they are,
// while utf8proc (Unicode 15) would decompose or compose them; expected values from tokenizers 0.22.
TEST(HfTokenizerTest, NormalizationLeavesCodePointsTokenizersDoesNotKnow) {
  const std::string hangul_lv_and_old_t = "\xEA\xB0\x80\xE1\x86\xA7";  // U+AC00 U+11A7 (utf8proc 2.8 drops U+11A7)
  EXPECT_EQ(unicode_normalize(hangul_lv_and_old_t, "NFC"), hangul_lv_and_old_t);
  EXPECT_EQ(unicode_normalize(hangul_lv_and_old_t, "NFD"), "\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA7");
  const std::string dives_akuru =
      "a\xF0\x91\xA4\xB8"
      "b";  // U+11938 (Unicode 13): canonical decomposition there
  for (const char* form : {"NFC", "NFD", "NFKC", "NFKD"})
    EXPECT_EQ(unicode_normalize(dives_akuru, form), dives_akuru) << form;
  const std::string reiwa = "\xE3\x8B\xBF";  // U+32FF SQUARE ERA NAME REIWA (Unicode 12.1): NFKC -> 令和 in utf8proc
  EXPECT_EQ(unicode_normalize(reiwa, "NFKC"), reiwa);
  const std::string segmented_nine = "x\xF0\x9F\xAF\xB9";  // U+1FBF9 (Unicode 13): NFKC -> 9 in utf8proc
  EXPECT_EQ(unicode_normalize(segmented_nine, "NFKC"), segmented_nine);
  EXPECT_EQ(unicode_normalize("e\xCC\x81", "NFC"), "\xC3\xA9");  // known code points still normalize
}

TEST(HfTokenizerTest, Utf8LossyReplacesMaximalInvalidSubsequences) {
  EXPECT_EQ(utf8_lossy("abc"), "abc");
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98"), "\xEF\xBF\xBD");  // truncated 4-byte sequence: one U+FFFD
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98x"), "\xEF\xBF\xBDx");
  EXPECT_EQ(utf8_lossy("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");                  // overlong: two
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate: three
  EXPECT_EQ(utf8_lossy("\xE2\x82\xAC\xFF"), "\xE2\x82\xAC\xEF\xBF\xBD");
}

}  // namespace
}  // namespace modalities::plugins::hf_tokenizer
