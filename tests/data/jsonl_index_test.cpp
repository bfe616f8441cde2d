// `modalities data create_raw_index`: the line rule of docs/data.md, Python
// json.loads acceptance, jq paths, byte-identical .idx files for every
// JSONL fixture, and the CLI's policies and error messages.
#include "../cli/run_command.h"
#include "../cli/scratch_dir.h"

#include <modalities/core/data/jsonl.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/packed_data.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/shared_fixtures.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace modalities::core::data {
namespace {

using modalities::testing::read_file;
using modalities::testing::run_command;
using modalities::testing::ScratchDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

const std::filesystem::path kFixtures = std::filesystem::path(MODALITIES_TEST_FIXTURES_DIR);

testing::CommandResult modalities(std::vector<std::string> args) {
  args.insert(args.begin(), MODALITIES_TEST_BINARY);
  return run_command(args);
}

TEST(SplitLines, FollowsSpecRule) {
  EXPECT_THAT(split_lines(""), ElementsAre(Pair(0, 0)));
  EXPECT_THAT(split_lines("a\n"), ElementsAre(Pair(0, 1)));
  EXPECT_THAT(split_lines("a"), ElementsAre(Pair(0, 1)));
  EXPECT_THAT(split_lines("a\n\n"), ElementsAre(Pair(0, 1), Pair(2, 0)));
  EXPECT_THAT(split_lines("ab\r\n\ncd"), ElementsAre(Pair(0, 3), Pair(4, 0), Pair(5, 2)));
}

TEST(JsonValidity, MatchesPythonJsonLoads) {
  JsonLineParser p;
  // Accepted by json.loads (several of them rejected by simdjson alone).
  for (const char* ok : {"{\"text\": \"a\"}", "[1, 2]", "\"s\"", "3", "null", " {} ", "{\"x\": NaN}", "-Infinity",
                         "{\"x\": 123456789012345678901234567890}", "1e400", "{\"s\": \"\\ud800\"}",
                         "\xEF\xBB\xBF{\"a\": 1}", "{\"a\": 1}\r", "{\"a\":1,\"a\":2}"}) {
    EXPECT_TRUE(p.valid(ok)) << ok;
  }
  // Rejected by json.loads.
  for (const char* bad : {"", "   ", "{\"a\": 1} x", "{'a': 1}", "{\"a\": \"\x01\"}", "[1,]", "01", "nan",
                          "{\"t\": \"\xff\"}", "{\"a\": 1", "+1", ".5", "[Infinity", "\"\\x\""}) {
    std::string why;
    EXPECT_FALSE(p.valid(bad, &why)) << bad;
    EXPECT_FALSE(why.empty()) << bad;
  }
}

TEST(JqPath, ParsesSupportedSubsetAndRefusesTheRest) {
  EXPECT_EQ(JqPath::parse(".text").steps().size(), 1u);
  EXPECT_EQ(JqPath::parse(".a.b").steps().at(1).key, "b");
  EXPECT_EQ(JqPath::parse(".[\"my key\"]").steps().at(0).key, "my key");
  EXPECT_EQ(JqPath::parse(".messages[-1].content").steps().at(1).index, -1);
  EXPECT_TRUE(JqPath::parse(".").steps().empty());
  for (const char* bad : {"text", "..", ".a | .b", ".[]", ".a[1:2]", "select(.x)", ".a,.b"}) {
    try {
      (void)JqPath::parse(bad);
      ADD_FAILURE() << bad << " parsed";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("unsupported jq_pattern")) << bad;
    }
  }
}

TEST(JqPath, ExtractsLikeJq) {
  JsonLineParser p;
  EXPECT_EQ(p.extract_string(R"({"text": "H\u00e9llo\n"})", JqPath::parse(".text")), "H\xC3\xA9llo\n");
  EXPECT_EQ(p.extract_string(R"({"m": [{"c": "x"}, {"c": "y"}]})", JqPath::parse(".m[-1].c")), "y");
  EXPECT_EQ(p.extract_string(R"("a bare string line")", JqPath::parse(".")), "a bare string line");
  EXPECT_EQ(p.extract_string(R"({"text": "ok", "score": NaN, "n": 1e999})", JqPath::parse(".text")), "ok");
  auto error_of = [&](std::string_view line, std::string_view jq) {
    try {
      (void)p.extract_string(line, JqPath::parse(jq));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(error_of(R"({"txt": "a"})", ".text"), HasSubstr("the key \"text\" is missing"));
  EXPECT_THAT(error_of(R"({"text": null})", ".text"), HasSubstr("selects null"));
  EXPECT_THAT(error_of(R"({"text": 5})", ".text"), HasSubstr("selects a number, not a string"));
  EXPECT_THAT(error_of(R"(["a"])", ".text"), HasSubstr("cannot index an array"));
  EXPECT_THAT(error_of(R"({"text": "a"} junk)", ".text"), HasSubstr("invalid JSON"));
  EXPECT_THAT(error_of(R"({"text": "\ud800"})", ".text"), HasSubstr("lone UTF-16 surrogate"));
  EXPECT_THAT(error_of(R"({"meta": "x", "text": "a\udc00b"})", ".text"),
              HasSubstr("the text selected by .text contains a lone UTF-16 surrogate"));
}

// Like Python, a lone surrogate in a field other than the selected text does not matter (it used
// to refuse the whole line although the docs said only the text is checked).
TEST(JsonLineParser, LoneSurrogatesOutsideTheSelectedTextAreAccepted) {
  JsonLineParser p;
  const JqPath text = JqPath::parse(".text");
  EXPECT_EQ(p.extract_string(R"({"title": "\ud800", "text": "caf\u00e9 \ud83d\ude00", "n": 1e400})", text),
            "caf\xc3\xa9 \xf0\x9f\x98\x80");
  EXPECT_EQ(p.extract_string(R"({"meta": {"a": ["\udfff\ud800x"]}, "text": "plain"})", text), "plain");
  EXPECT_EQ(p.extract_string(R"({"text": "\ufffd and \ufffe", "t": "\ud800"})", text), "\xef\xbf\xbd and \xef\xbf\xbe");
}

// The bundled corpus indexes to the .idx Modalities 0.5.0 wrote from it (data/sample/README.md), and
// the tiny worked example to its own index; no ../shared needed.
TEST(CreateRawIndex, ByteIdenticalToModalitiesOnTheSampleCorpus) {
  const std::filesystem::path sample = std::filesystem::path(MODALITIES_TEST_SOURCE_ROOT) / "data" / "sample";
  const std::filesystem::path tiny = modalities::testing::tiny_example_dir();
  const std::pair<std::filesystem::path, std::filesystem::path> cases[] = {
      {sample / "train.jsonl", sample / "train.idx"},
      {sample / "eval.jsonl", sample / "eval.idx"},
      {tiny / "tiny.jsonl", tiny / "tiny.idx"},
  };
  ScratchDir dir;
  int n = 0;
  for (const auto& [src, expected] : cases) {
    for (unsigned threads : {1u, 3u}) {
      const auto out = dir.path() / fmt::format("{}.{}.idx", src.stem().string(), n++);
      const auto r = modalities({"data", "create_raw_index", src.string(), "--index_path", out.string(),
                                 "--num_threads", std::to_string(threads)});
      ASSERT_EQ(r.exit_code, 0) << r;
      EXPECT_EQ(read_file(out), read_file(expected)) << src << " with " << threads << " threads";
    }
  }
}

// Every JSONL file of Modalities' repository (../shared) indexes to its shipped (or derived) .idx byte for byte.
TEST(CreateRawIndex, ByteIdenticalToFixtures) {
  MODALITIES_REQUIRE_SHARED(MODALITIES_TEST_FIXTURES_DIR);
  const std::pair<const char*, const char*> cases[] = {
      {"data/lorem_ipsum.jsonl", "data/lorem_ipsum.idx"},
      {"data/lorem_ipsum_long.jsonl", "data/lorem_ipsum_long.idx"},
      {"tests/data/datasets/lorem_ipsum_long.jsonl", "data/lorem_ipsum_long.idx"},  // trailing '\n': same index
      {"tests/data/datasets/danish_test_dataset.jsonl", "derived/tests/data/datasets/danish_test_dataset.idx"},
      {"tests/data/datasets/lorem_ipsum_without_last_newline.jsonl",
       "derived/tests/data/datasets/lorem_ipsum_without_last_newline.idx"},
  };
  ScratchDir dir;
  int n = 0;
  for (const auto& [src, expected] : cases) {
    for (unsigned threads : {1u, 3u}) {
      const auto out = dir.path() / fmt::format("{}.{}.idx", std::filesystem::path(src).stem().string(), n++);
      const auto r = modalities({"data", "create_raw_index", (kFixtures / src).string(), "--index_path", out.string(),
                                 "--num_threads", std::to_string(threads)});
      ASSERT_EQ(r.exit_code, 0) << r;
      EXPECT_EQ(read_file(out), read_file(kFixtures / expected)) << src << " with " << threads << " threads";
    }
  }
}

TEST(CreateRawIndex, DefaultPathAndPolicies) {
  ScratchDir dir;
  const auto src = dir.write("docs.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"}\n");
  auto r = modalities({"data", "create_raw_index", src.string()});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr("2 entries"));
  const auto idx = dir.path() / "docs.idx";
  EXPECT_EQ(formats::read_raw_index(idx), (std::vector<formats::IndexEntry>{{0, 13}, {14, 13}}));

  r = modalities({"data", "create_raw_index", src.string()});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("already exists"));

  dir.write("docs.jsonl", "{\"text\": \"a\"}\n");
  r = modalities({"data", "create_raw_index", src.string(), "--file_existence_policy", "skip"});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.err, HasSubstr("skipped"));
  EXPECT_EQ(formats::read_raw_index(idx).size(), 2u);

  r = modalities({"data", "create_raw_index", src.string(), "--file_existence_policy", "override"});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_EQ(formats::read_raw_index(idx).size(), 1u);

  r = modalities({"data", "create_raw_index", src.string(), "--file_existence_policy", "maybe"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("must be one of skip, error, override"));

  r = modalities({"data", "create_raw_index", src.string(), "--index_path", src.string()});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("is the source file itself"));
}

TEST(CreateRawIndex, InvalidLineNamesFileAndLineAndWritesNothing) {
  ScratchDir dir;
  const auto src = dir.write("bad.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"\n{\"text\": \"c\"}\n");
  const auto idx = dir.path() / "bad.idx";
  auto r = modalities({"data", "create_raw_index", src.string()});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("bad.jsonl:2: "));
  EXPECT_THAT(r.err, HasSubstr("no index was written"));
  EXPECT_FALSE(std::filesystem::exists(idx));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 1) << "temporary file left behind";

  // Invalid UTF-8 and an empty line in the middle are errors too.
  dir.write("bad.jsonl", "{\"text\": \"a\"}\n\n");
  dir.write("utf8.jsonl", "{\"text\": \"\xC3\x28\"}\n");
  r = modalities({"data", "create_raw_index", (dir.path() / "utf8.jsonl").string()});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("utf8.jsonl:1: invalid UTF-8"));

  dir.write("blank.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \"c\"}\n");
  r = modalities({"data", "create_raw_index", (dir.path() / "blank.jsonl").string()});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("blank.jsonl:2: empty line"));

  // Opt-in: drop faulty lines, report each.
  r = modalities({"data", "create_raw_index", (dir.path() / "blank.jsonl").string(), "--drop_faulty_entries"});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.err, HasSubstr("blank.jsonl:2: empty line"));
  EXPECT_EQ(formats::read_raw_index(dir.path() / "blank.idx"), (std::vector<formats::IndexEntry>{{0, 13}, {15, 13}}));
}

TEST(CreateRawIndex, FirstErrorWinsWithManyThreads) {
  std::string text;
  for (int i = 0; i < 20000; ++i) text += (i == 15000 || i == 17000) ? "{oops}\n" : "{\"text\": \"x\"}\n";
  ScratchDir dir;
  const auto src = dir.write("many.jsonl", text);
  const auto r = modalities({"data", "create_raw_index", src.string(), "--num_threads", "4"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("many.jsonl:15001: "));
}

TEST(CreateRawIndex, MissingSourceAndUnwritableTarget) {
  ScratchDir dir;
  auto r = modalities({"data", "create_raw_index", (dir.path() / "nope.jsonl").string()});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("nope.jsonl' does not exist"));

  const auto src = dir.write("ok.jsonl", "{}\n");
  const auto blocker = dir.write("file", "x");  // a regular file where a directory is expected
  r = modalities({"data", "create_raw_index", src.string(), "--index_path", (blocker / "sub" / "ok.idx").string()});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("cannot create the directory"));

  r = modalities({"data", "create_raw_index"});
  EXPECT_EQ(r.exit_code, 2) << r;
}

}  // namespace
}  // namespace modalities::core::data
