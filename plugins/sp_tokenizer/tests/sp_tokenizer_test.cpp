// tokenizer/pretrained_sp_tokenizer with Debian's libsentencepiece: ids and
// decodes of every line of data/multilingual/multilingual.jsonl against the
// Python `sentencepiece` package (scripts/reference/make_tokenizer_reference.py),
// the SentencePiece .pbin fixtures (made with SentencePiece 0.1.97), the
// Modalities id queries, concurrency and the refused inputs.
#include <modalities/sdk/formats/packed_data.h>
#include <modalities/sdk/interfaces/tokenizer.h>
#include <modalities/sdk/schema.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/shared_fixtures.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <simdjson.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include <unistd.h>

namespace modalities::plugins::sp_tokenizer {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;
namespace dom = simdjson::dom;

const fs::path kPluginDir = MODALITIES_TEST_PLUGIN_SOURCE_DIR;
const fs::path kData = kPluginDir / "tests" / "data";
const fs::path kFixtures = fs::path(MODALITIES_TEST_FIXTURES_DIR);
const fs::path kCorpus = fs::path(MODALITIES_TEST_SOURCE_ROOT) / "data" / "multilingual" / "multilingual.jsonl";

fs::path model_of(const std::string& name) {
  if (name == "en32k") return kFixtures / "data" / "tokenizer" / "sentencepiece_dclm" / "en_32k_tokenizer.model";
  return kData / (name + ".model");
}

std::vector<std::string> lines_of(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  EXPECT_TRUE(in) << file;
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

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

std::vector<std::int64_t> ids_of(dom::element e) {
  dom::array a;
  EXPECT_EQ(e.get_array().get(a), simdjson::SUCCESS);
  std::vector<std::int64_t> out;
  for (dom::element x : a) out.push_back(x.get_int64().value());
  return out;
}

std::string show(std::span<const std::int64_t> ids) {
  std::string s = "[";
  for (std::size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s + "]";
}

struct Built {
  std::shared_ptr<testing::Harness> harness;  // keeps the plugin loaded
  std::shared_ptr<Tokenizer> tok;
  std::string error;
};

Built build(const fs::path& model) {
  Built b;
  b.harness = std::make_shared<testing::Harness>(MODALITIES_TEST_PLUGIN);
  b.harness->set_config_text(
      "[tok]\ncomponent_key = \"tokenizer\"\nvariant_key = \"pretrained_sp_tokenizer\"\n"
      "config = { tokenizer_model_file = " +
      toml_quote(model.string()) + " }\n");
  b.error = b.harness->build_error();
  if (b.error.empty()) b.tok = b.harness->get<Tokenizer>("tok");
  return b;
}

TEST(SpTokenizerTest, BuildsFromExampleConfig) {
  const fs::path cwd = fs::current_path();
  fs::current_path(MODALITIES_TEST_SOURCE_ROOT);  // the example names a repository-relative file
  testing::Harness h{MODALITIES_TEST_PLUGIN, kPluginDir / "configs" / "example.toml"};
  auto tok = h.get<Tokenizer>("tokenizer");
  fs::current_path(cwd);
  ASSERT_NE(tok, nullptr) << h.build_error();
  EXPECT_EQ(tok->vocab_size(), 1200);
  EXPECT_EQ(tok->decode(tok->tokenize("Hello world")), "Hello world");
}

class SpCorpusTest : public ::testing::TestWithParam<std::string> {};

// Python sentencepiece 0.2.x made the expected ids; this is the C++ library of
// the build (Debian: 0.1.97). Any difference is reported line by line.
TEST_P(SpCorpusTest, MatchesPythonSentencePieceOnEveryLine) {
  const std::string name = GetParam();
  if (name == "en32k") MODALITIES_REQUIRE_SHARED(model_of(name));
  Built b = build(model_of(name));
  ASSERT_NE(b.tok, nullptr) << b.error;
  const auto texts = texts_of(kCorpus);
  const auto expected = lines_of(kData / "expected" / (name + ".jsonl"));
  ASSERT_EQ(texts.size(), expected.size());
  dom::parser parser;
  std::size_t id_mismatches = 0, decode_mismatches = 0;
  for (std::size_t i = 0; i < texts.size(); ++i) {
    dom::element row = parser.parse(expected[i]).value();
    const auto want = ids_of(row["ids"].value());
    const auto got = b.tok->tokenize(texts[i]);
    if (got != want && id_mismatches++ < 5)
      ADD_FAILURE() << name << " line " << i + 1 << "\n  text: " << texts[i] << "\n  want: " << show(want)
                    << "\n  got:  " << show(got);
    std::string_view d;
    const std::string want_text = row["decoded"].get_string().get(d) == simdjson::SUCCESS ? std::string(d) : texts[i];
    if (b.tok->decode(want) != want_text && decode_mismatches++ < 5)
      ADD_FAILURE() << name << " line " << i + 1 << " decode\n  want: " << want_text
                    << "\n  got:  " << b.tok->decode(want);
  }
  EXPECT_EQ(id_mismatches, 0u) << "of " << texts.size() << " lines";
  EXPECT_EQ(decode_mismatches, 0u);
}

INSTANTIATE_TEST_SUITE_P(Models, SpCorpusTest, ::testing::Values("en32k", "tiny_bpe"));

TEST(SpTokenizerTest, IdQueriesMatchPythonSentencePiece) {
  dom::parser parser;
  dom::element root = parser.load((kData / "facts.json").string()).value();
  dom::object models;
  ASSERT_EQ(root.get_object().get(models), simdjson::SUCCESS);
  for (auto [name, facts] : models) {
    if (name == "en32k" && !fs::exists(model_of("en32k"))) {
      std::cout << "en32k skipped: needs " << model_of("en32k").string() << " (../shared/fixtures, absent here)\n";
      continue;
    }
    Built b = build(model_of(std::string(name)));
    ASSERT_NE(b.tok, nullptr) << b.error;
    EXPECT_EQ(b.tok->vocab_size(), facts["vocab_size"].get_int64().value());
    const auto control = ids_of(facts["control_ids"].value());
    std::size_t n_special = 0;
    for (std::int64_t id = -2; id < b.tok->vocab_size() + 2; ++id) n_special += b.tok->is_special_token_id(id);
    EXPECT_EQ(n_special, control.size()) << name;
    for (std::int64_t id : control) EXPECT_TRUE(b.tok->is_special_token_id(id)) << name << " " << id;
    dom::object pieces;
    ASSERT_EQ(facts["piece_ids"].get_object().get(pieces), simdjson::SUCCESS);
    for (auto [piece, id] : pieces) EXPECT_EQ(b.tok->token_id(piece), id.get_int64().value()) << name << " " << piece;
    dom::array unknown;
    ASSERT_EQ(facts["unknown_pieces"].get_array().get(unknown), simdjson::SUCCESS);
    for (dom::element piece : unknown) {
      const std::string p(piece.get_string().value());
      try {
        b.tok->token_id(p);
        ADD_FAILURE() << name << ": '" << p << "' should be refused";
      } catch (const Error& e) {
        EXPECT_THAT(e.what(), HasSubstr("'" + p + "' is not a piece of"));
      }
    }
  }
}

// Packing with EOD </s> (= 2) appended, as Modalities' consistency test does,
// against the SentencePiece .pbin fixtures.
void expect_same_as_pbin(const Tokenizer& tok, const fs::path& jsonl, const fs::path& pbin) {
  const auto header = formats::read_packed_header(pbin);
  ASSERT_EQ(header.token_size, 2u);
  std::ifstream in(pbin, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto index = formats::unpickle_index(
      std::as_bytes(std::span(bytes).subspan(formats::kPackedHeaderSize + header.data_len)), pbin.string());
  const auto texts = texts_of(jsonl);
  ASSERT_EQ(texts.size(), index.size()) << pbin;
  const std::int64_t eod = tok.token_id("</s>");
  std::size_t mismatches = 0;
  for (std::size_t d = 0; d < texts.size(); ++d) {
    auto ids = tok.tokenize(texts[d]);
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

TEST(SpTokenizerTest, ReproducesTheSentencePiecePackedFixtures) {
  MODALITIES_REQUIRE_SHARED(MODALITIES_TEST_FIXTURES_DIR);
  Built b = build(model_of("en32k"));
  ASSERT_NE(b.tok, nullptr) << b.error;
  EXPECT_EQ(b.tok->token_id("</s>"), 2);
  const fs::path datasets = kFixtures / "tests" / "data" / "datasets";
  const fs::path derived = kFixtures / "derived" / "tests" / "data" / "datasets";
  for (const char* stem : {"danish_test_dataset", "lorem_ipsum_without_last_newline", "lorem_ipsum_long"})
    expect_same_as_pbin(*b.tok, datasets / (std::string(stem) + ".jsonl"),
                        derived / (std::string(stem) + ".sp_en32k_eod2.pbin"));
}

TEST(SpTokenizerTest, OneInstanceIsSafeToUseFromManyThreads) {
  Built b = build(model_of("tiny_bpe"));
  ASSERT_NE(b.tok, nullptr) << b.error;
  const auto texts = texts_of(kCorpus);
  std::vector<std::vector<std::int64_t>> serial;
  for (const auto& t : texts) serial.push_back(b.tok->tokenize(t));
  std::vector<std::size_t> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (std::size_t w = 0; w < 4; ++w)
    threads.emplace_back([&, w] {
      for (std::size_t i = w; i < texts.size(); i += 2) mismatches[w] += b.tok->tokenize(texts[i]) != serial[i];
    });
  for (auto& t : threads) t.join();
  for (std::size_t w = 0; w < 4; ++w) EXPECT_EQ(mismatches[w], 0u) << "thread " << w;
}

TEST(SpTokenizerTest, RejectsMissingAndInvalidModelFiles) {
  const std::string missing = build("/nonexistent/tokenizer.model").error;
  EXPECT_THAT(missing, HasSubstr("tok.config.tokenizer_model_file"));
  EXPECT_THAT(missing, HasSubstr("does not exist"));
  const fs::path not_a_model =
      fs::temp_directory_path() / ("sp_tokenizer_test_" + std::to_string(::getpid()) + ".model");
  std::ofstream(not_a_model) << "this is not a protobuf";
  const std::string invalid = build(not_a_model).error;
  fs::remove(not_a_model);
  EXPECT_THAT(invalid, HasSubstr("is not a SentencePiece model"));
}

TEST(SpTokenizerTest, DecodeRefusesIdsOutsideTheVocabulary) {
  Built b = build(model_of("tiny_bpe"));
  ASSERT_NE(b.tok, nullptr) << b.error;
  EXPECT_THROW(b.tok->decode(std::vector<std::int64_t>{5, 1200}), Error);
  EXPECT_THROW(b.tok->decode(std::vector<std::int64_t>{-1}), Error);
  EXPECT_FALSE(b.tok->is_special_token_id(1200));
}

}  // namespace
}  // namespace modalities::plugins::sp_tokenizer
