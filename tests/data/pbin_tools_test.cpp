// merge_packed_data, the shuffles and the shuffled chunks (docs/data.md)
//: outputs against a Python reference that uses the real `random`,
// numpy and hashlib (expected sizes and SHA-256 in data_tools_reference.inc,
// from scripts/reference/data_tools_reference.py), the fixed quirks Q4 and
// Q11, file-existence policies, bad inputs, and that no partial output is left
// after a failure. The last group runs the `modalities` binary.
#include <modalities/core/data/pbin_tools.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/packed_data.h>
#include <modalities/sdk/formats/packed_file.h>
#include <modalities/testing/shared_fixtures.h>

#include "../cli/run_command.h"
#include "../cli/scratch_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

#include "data_tools_reference.inc"

namespace fs = std::filesystem;
namespace data = modalities::core::data;
using modalities::Error;
using modalities::formats::IndexEntry;
using modalities::formats::PackedFile;
using modalities::testing::CommandResult;
using modalities::testing::run_command;
using modalities::testing::ScratchDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAreArray;

// The inputs of scripts/reference/data_tools_reference.py: this repository's own files, and
// "tiny/..." for the worked example written by modalities::testing::tiny_example_dir().
const fs::path kRoot = fs::path(MODALITIES_TEST_SOURCE_ROOT);
fs::path input(const std::string& rel) {
  return rel.starts_with("tiny/") ? modalities::testing::tiny_example_dir() / rel.substr(5) : kRoot / rel;
}
const fs::path kTiny = modalities::testing::tiny_example_dir() / "tiny.pbin";

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string hex_to_bytes(std::string_view hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  return out;
}

std::string u64le(std::uint64_t v, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return s;
}

// A .pbin built by hand: header, data, pickled index.
std::string pbin_bytes(std::uint32_t token_size, const std::string& data, const std::vector<IndexEntry>& index) {
  return u64le(data.size(), 8) + u64le(token_size, 4) + data + modalities::formats::pickle_index(index);
}

// Names in `dir` (not recursive), to check that no temporary file was left behind.
std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  return names;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

// --- merge_packed_data ---------------------------------------------------------------------

TEST(MergePackedDataTest, TinyWithItselfHasCorrectOffsets) {
  ScratchDir dir;
  const fs::path out = dir.path() / "merged.pbin";
  const std::vector<fs::path> src{kTiny, kTiny};
  const data::ToolResult r = data::merge_packed_data(src, out);
  EXPECT_EQ(r.documents, 4u);
  PackedFile f(out);
  EXPECT_EQ(f.header().data_len, 20u);
  EXPECT_EQ(f.token_size(), 2u);
  // Modalities writes [(0,4),(4,6),(-2,4),(2,6)] here (quirk Q4).
  EXPECT_THAT(f.index(), ElementsAre(IndexEntry{0, 4}, IndexEntry{4, 6}, IndexEntry{10, 4}, IndexEntry{14, 6}));
  const std::string tiny = slurp(kTiny);
  const std::string tiny_data = tiny.substr(12, 10);
  EXPECT_EQ(slurp(out), pbin_bytes(2, tiny_data + tiny_data, {{0, 4}, {4, 6}, {10, 4}, {14, 6}}));
  EXPECT_EQ(r.bytes, fs::file_size(out));
}

TEST(MergePackedDataTest, DocumentsOfEveryInputSurvive) {
  ScratchDir dir;
  const fs::path a = kRoot / "data" / "sample" / "eval.pbin";
  const fs::path b = kRoot / "data" / "sample" / "train.pbin";
  const fs::path out = dir.path() / "m.pbin";
  const std::vector<fs::path> src{a, b, kTiny};
  data::merge_packed_data(src, out);
  PackedFile m(out), fa(a), fb(b), ft(kTiny);
  ASSERT_EQ(m.num_documents(), fa.num_documents() + fb.num_documents() + ft.num_documents());
  std::uint64_t k = 0;
  for (const PackedFile* f : {&fa, &fb, &ft})
    for (std::uint64_t d = 0; d < f->num_documents(); ++d, ++k)
      ASSERT_EQ(m.document(k), f->document(d)) << "merged doc " << k;
  EXPECT_EQ(m.num_tokens(), fa.num_tokens() + fb.num_tokens() + ft.num_tokens());
}

TEST(MergePackedDataTest, DirectoriesAreSearchedRecursivelyAndSorted) {
  ScratchDir dir;
  const std::string tiny = slurp(kTiny);
  fs::create_directories(dir.path() / "in" / "sub");
  dir.write("in/sub/a.pbin", tiny);
  dir.write("in/b.pbin", tiny);
  dir.write("in/notes.txt", "not a pbin");
  const std::vector<fs::path> src{dir.path() / "in", kTiny};
  EXPECT_THAT(data::find_pbin_inputs(src),
              ElementsAre(dir.path() / "in" / "b.pbin", dir.path() / "in" / "sub" / "a.pbin", kTiny));
  const data::ToolResult r = data::merge_packed_data(src, dir.path() / "out.pbin");
  EXPECT_EQ(r.documents, 6u);
}

TEST(MergePackedDataTest, TokenSizeMismatchNamesBothFiles) {
  ScratchDir dir;
  const fs::path one = dir.write("bytes.pbin", pbin_bytes(1, "abc", {{0, 3}}));
  const fs::path out = dir.path() / "out.pbin";
  const std::vector<fs::path> src{kTiny, one};
  const std::string msg = error_of([&] { data::merge_packed_data(src, out); });
  EXPECT_THAT(msg, HasSubstr("token size mismatch"));
  EXPECT_THAT(msg, HasSubstr(kTiny.string()));
  EXPECT_THAT(msg, HasSubstr(one.string()));
  EXPECT_THAT(msg, HasSubstr("2-byte"));
  EXPECT_THAT(msg, HasSubstr("1-byte"));
  EXPECT_FALSE(fs::exists(out));
}

TEST(MergePackedDataTest, RefusesExistingTargetAndMissingSources) {
  ScratchDir dir;
  const fs::path out = dir.write("exists.pbin", "keep me");
  const std::vector<fs::path> src{kTiny};
  EXPECT_THAT(error_of([&] { data::merge_packed_data(src, out); }), HasSubstr("already exists"));
  EXPECT_EQ(slurp(out), "keep me");
  const std::vector<fs::path> missing{dir.path() / "nope.pbin"};
  EXPECT_THAT(error_of([&] { data::merge_packed_data(missing, dir.path() / "o.pbin"); }),
              HasSubstr((dir.path() / "nope.pbin").string() + "' does not exist"));
  const std::vector<fs::path> empty_dir{dir.mkdir("empty")};
  EXPECT_THAT(error_of([&] { data::merge_packed_data(empty_dir, dir.path() / "o.pbin"); }),
              HasSubstr("no .pbin files found"));
}

TEST(MergePackedDataTest, ConvertsLegacyInputs) {
  ScratchDir dir;
  const std::string tiny_data = slurp(kTiny).substr(12, 10);
  const fs::path legacy = dir.write("legacy.pbin", pbin_bytes(2, tiny_data, {{12, 4}, {16, 6}}));
  const fs::path out = dir.path() / "out.pbin";
  const std::vector<fs::path> src{kTiny, legacy};
  const data::ToolResult r = data::merge_packed_data(src, out);
  EXPECT_EQ(r.legacy_inputs, 1u);
  EXPECT_EQ(slurp(out), pbin_bytes(2, tiny_data + tiny_data, {{0, 4}, {4, 6}, {10, 4}, {14, 6}}));
}

TEST(MergePackedDataTest, DamagedIndexMidWayLeavesNoOutput) {
  ScratchDir dir;
  // The data of the first file is already written when the second one's index fails to parse.
  const std::string tiny = slurp(kTiny);
  const fs::path bad = dir.write("bad.pbin", tiny.substr(0, 22) + "garbage");
  const fs::path out = dir.path() / "out.pbin";
  const std::vector<fs::path> src{kTiny, bad};
  EXPECT_THAT(error_of([&] { data::merge_packed_data(src, out); }), HasSubstr(bad.string()));
  EXPECT_THAT(names_in(dir.path()), ElementsAre("bad.pbin"));
}

// --- shuffle_tokenized_data --------------------------------------------------------------------

TEST(ShuffleTokenizedDataTest, MatchesPythonReference) {
  ScratchDir dir;
  for (const auto& [seed, v] : kShuffleTokenized) {
    SCOPED_TRACE(std::string(v.name) + " seed " + seed);
    const fs::path out = dir.path() / "shuffled.pbin";
    fs::remove(out);
    const data::ToolResult r =
        data::shuffle_tokenized_data(input(v.name), out, data::PyInt::parse(seed), data::FileExistencePolicy::kError);
    EXPECT_EQ(fs::file_size(out), v.size);
    EXPECT_EQ(data::sha256_hex(slurp(out)), v.sha256);
    EXPECT_EQ(r.bytes, v.size);
  }
  const fs::path out = dir.path() / "tiny3.pbin";
  data::shuffle_tokenized_data(kTiny, out, data::PyInt::from(3), data::FileExistencePolicy::kError);
  EXPECT_EQ(slurp(out), hex_to_bytes(kTinyShuffledSeed3Hex));
}

TEST(ShuffleTokenizedDataTest, LegacyInputIsConverted) {
  ScratchDir dir;
  const std::string tiny_data = slurp(kTiny).substr(12, 10);
  const fs::path legacy = dir.write("legacy.pbin", pbin_bytes(2, tiny_data, {{12, 4}, {16, 6}}));
  const data::ToolResult r = data::shuffle_tokenized_data(legacy, dir.path() / "out.pbin", data::PyInt::from(3),
                                                          data::FileExistencePolicy::kError);
  EXPECT_EQ(r.legacy_inputs, 1u);
  EXPECT_EQ(slurp(dir.path() / "out.pbin"), hex_to_bytes(kTinyShuffledSeed3Hex));
}

TEST(ShuffleTokenizedDataTest, FileExistencePolicies) {
  ScratchDir dir;
  const fs::path out = dir.write("out.pbin", "old");
  const auto seed = data::PyInt::from(3);
  EXPECT_THAT(error_of([&] { data::shuffle_tokenized_data(kTiny, out, seed, data::FileExistencePolicy::kError); }),
              HasSubstr("already exists"));
  EXPECT_EQ(slurp(out), "old");
  const data::ToolResult skipped = data::shuffle_tokenized_data(kTiny, out, seed, data::FileExistencePolicy::kSkip);
  EXPECT_TRUE(skipped.skipped);
  EXPECT_EQ(slurp(out), "old");
  const data::ToolResult replaced =
      data::shuffle_tokenized_data(kTiny, out, seed, data::FileExistencePolicy::kOverride);
  EXPECT_TRUE(replaced.replaced);
  EXPECT_EQ(slurp(out), hex_to_bytes(kTinyShuffledSeed3Hex));
  EXPECT_THAT(names_in(dir.path()), ElementsAre("out.pbin"));
}

TEST(ShuffleTokenizedDataTest, BadInputsFailWithoutOutput) {
  ScratchDir dir;
  const auto seed = data::PyInt::from(1);
  const auto policy = data::FileExistencePolicy::kError;
  // input == output, also when spelled differently; even with override
  const fs::path copy = dir.write("t.pbin", slurp(kTiny));
  EXPECT_THAT(error_of([&] {
                data::shuffle_tokenized_data(copy, dir.path() / "." / "t.pbin", seed,
                                             data::FileExistencePolicy::kOverride);
              }),
              HasSubstr("are the same file"));
  EXPECT_EQ(slurp(copy), slurp(kTiny));
  // missing input
  EXPECT_THAT(
      error_of([&] { data::shuffle_tokenized_data(dir.path() / "missing.pbin", dir.path() / "o.pbin", seed, policy); }),
      HasSubstr("missing.pbin' does not exist"));
  // corrupt header: data_len beyond the end of the file
  std::string corrupt = slurp(kTiny);
  corrupt.replace(0, 8, u64le(1000, 8));
  const fs::path bad = dir.write("corrupt.pbin", corrupt);
  const std::string msg = error_of([&] { data::shuffle_tokenized_data(bad, dir.path() / "o.pbin", seed, policy); });
  EXPECT_THAT(msg, HasSubstr(bad.string()));
  // token size 3
  std::string ts3 = slurp(kTiny);
  ts3[8] = 3;
  const fs::path bad3 = dir.write("ts3.pbin", ts3);
  EXPECT_THAT(error_of([&] { data::shuffle_tokenized_data(bad3, dir.path() / "o.pbin", seed, policy); }),
              HasSubstr(bad3.string()));
  // unwritable output location: a directory below a regular file
  const fs::path blocker = dir.write("blocker", "x");
  EXPECT_THAT(error_of([&] { data::shuffle_tokenized_data(kTiny, blocker / "sub" / "o.pbin", seed, policy); }),
              HasSubstr((blocker / "sub" / "o.pbin").string()));
  EXPECT_THAT(names_in(dir.path()), UnorderedElementsAreArray({"t.pbin", "corrupt.pbin", "ts3.pbin", "blocker"}));
}

// --- shuffle_jsonl_data ---------------------------------------------------------------------------

TEST(ShuffleJsonlDataTest, MatchesPythonReference) {
  ScratchDir dir;
  for (const auto& [seed, v] : kShuffleJsonl) {
    SCOPED_TRACE(std::string(v.name) + " seed " + seed);
    const fs::path out = dir.path() / "shuffled.jsonl";
    fs::remove(out);
    data::shuffle_jsonl_data(input(v.name), out, data::PyInt::parse(seed), data::FileExistencePolicy::kError);
    EXPECT_EQ(fs::file_size(out), v.size);
    EXPECT_EQ(data::sha256_hex(slurp(out)), v.sha256);
  }
}

TEST(ShuffleJsonlDataTest, MissingFinalNewlineIsAdded) {
  ScratchDir dir;
  // Q11: Modalities would write e.g. "b\nca\n" for seed 0 (the last line glued to the next).
  const fs::path in = dir.write("in.jsonl", "a\nb\nc");
  const data::ToolResult r =
      data::shuffle_jsonl_data(in, dir.path() / "out.jsonl", data::PyInt::from(0), data::FileExistencePolicy::kError);
  EXPECT_EQ(r.newline_added, 1u);
  EXPECT_EQ(r.documents, 3u);
  const std::string out = slurp(dir.path() / "out.jsonl");
  EXPECT_EQ(out.size(), 6u);
  std::vector<std::string> lines;
  std::istringstream ss(out);
  for (std::string l; std::getline(ss, l);) lines.push_back(l);
  EXPECT_THAT(lines, UnorderedElementsAreArray({"a", "b", "c"}));
  // Same lines, same seed: the output equals that of the file with its final newline.
  const fs::path full = dir.write("full.jsonl", "a\nb\nc\n");
  data::shuffle_jsonl_data(full, dir.path() / "full_out.jsonl", data::PyInt::from(0),
                           data::FileExistencePolicy::kError);
  EXPECT_EQ(out, slurp(dir.path() / "full_out.jsonl"));
}

TEST(ShuffleJsonlDataTest, EmptyFileGivesEmptyOutput) {
  ScratchDir dir;
  const fs::path in = dir.write("empty.jsonl", "");
  const data::ToolResult r =
      data::shuffle_jsonl_data(in, dir.path() / "out.jsonl", data::PyInt::from(0), data::FileExistencePolicy::kError);
  EXPECT_EQ(r.documents, 0u);
  EXPECT_EQ(slurp(dir.path() / "out.jsonl"), "");
}

// --- chunks ---------------------------------------------------------------------------------------------

TEST(ChunkTest, Ranges) {
  auto r = [](std::uint64_t n, std::uint64_t k, std::uint64_t c) {
    const auto cr = data::chunk_range(n, k, c);
    return std::pair<std::uint64_t, std::uint64_t>{cr.begin, cr.end};
  };
  using P = std::pair<std::uint64_t, std::uint64_t>;
  EXPECT_EQ(r(10, 3, 0), (P{0, 4}));
  EXPECT_EQ(r(10, 3, 1), (P{4, 7}));
  EXPECT_EQ(r(10, 3, 2), (P{7, 10}));
  EXPECT_EQ(r(9, 3, 2), (P{6, 9}));
  EXPECT_EQ(r(2, 3, 2), (P{2, 2}));
  EXPECT_EQ(r(0, 3, 1), (P{0, 0}));
  EXPECT_EQ(r(12, 5, 4), (P{10, 12}));
  EXPECT_THAT(error_of([] { data::chunk_range(5, 0, 0); }), HasSubstr("greater than 0"));
  EXPECT_THAT(error_of([] { data::chunk_range(5, 3, 3); }), HasSubstr("must be less than"));
}

TEST(ChunkTest, HashedSeeds) {
  for (const auto& v : kHashedSeeds)
    EXPECT_EQ(data::chunk_seed(data::PyInt::parse(v.global_seed), v.chunk_id), v.seed)
        << v.global_seed << " " << v.chunk_id;
  // Modalities' hashed chunk seed (docs/data.md)
  EXPECT_EQ(data::chunk_seed(data::PyInt::from(42), 0), 769357083u);
  EXPECT_EQ(data::chunk_seed(data::PyInt::from(42), 1), 3240006108u);
}

TEST(ChunkTest, FileListFollowsPathlibWithSuffix) {
  ScratchDir dir;
  const fs::path list =
      dir.write("list.txt", "a/b.txt\r\n  c/d.tar.gz \n\n.hidden\rtrail.\nx/y/\n/abs/z.jsonl\n   \nplain");
  EXPECT_THAT(data::read_chunk_file_list(list, "root", ".pbin"),
              ElementsAre(fs::path("root/a/b.pbin"), fs::path("root/c/d.tar.pbin"), fs::path("root/.hidden.pbin"),
                          fs::path("root/trail..pbin"), fs::path("root/x/y.pbin"), fs::path("/abs/z.pbin"),
                          fs::path("root/plain.pbin")));
  EXPECT_THAT(error_of([&] { data::read_chunk_file_list(dir.path() / "nope.txt", "root", ".pbin"); }),
              HasSubstr("nope.txt' does not exist"));
}

fs::path write_list(const ScratchDir& dir, const char* text) { return dir.write("list.txt", text); }

TEST(ChunkTest, PbinChunksMatchPythonReference) {
  ScratchDir dir;
  const auto inputs = data::read_chunk_file_list(write_list(dir, kPbinChunkList), kRoot, ".pbin");
  for (const auto& v : kPbinChunks) {
    SCOPED_TRACE(fmt::format("chunk {} of {}, global seed {}", v.chunk_id, v.num_chunks, v.global_seed));
    data::ChunkJob job{inputs,       dir.path() / "chunk.pbin",         v.chunk_id,
                       v.num_chunks, data::PyInt::parse(v.global_seed), data::FileExistencePolicy::kOverride};
    const data::ToolResult r = data::create_shuffled_dataset_chunk(job);
    EXPECT_EQ(fs::file_size(job.output), v.size);
    EXPECT_EQ(data::sha256_hex(slurp(job.output)), v.sha256);
    EXPECT_EQ(r.numpy_seed, data::chunk_seed(job.global_seed, v.chunk_id));
  }
}

TEST(ChunkTest, JsonlChunksMatchPythonReference) {
  ScratchDir dir;
  const auto inputs = data::read_chunk_file_list(write_list(dir, kJsonlChunkList), kRoot, ".jsonl");
  for (const auto& v : kJsonlChunks) {
    SCOPED_TRACE(fmt::format("chunk {} of {}, global seed {}", v.chunk_id, v.num_chunks, v.global_seed));
    data::ChunkJob job{inputs,       dir.path() / "chunk.jsonl",        v.chunk_id,
                       v.num_chunks, data::PyInt::parse(v.global_seed), data::FileExistencePolicy::kOverride};
    data::create_shuffled_jsonl_chunk(job);
    EXPECT_EQ(fs::file_size(job.output), v.size);
    EXPECT_EQ(data::sha256_hex(slurp(job.output)), v.sha256);
  }
}

TEST(ChunkTest, ChunksPartitionTheDocuments) {
  ScratchDir dir;
  const auto inputs = data::read_chunk_file_list(write_list(dir, kPbinChunkList), kRoot, ".pbin");
  std::uint64_t docs = 0, tokens = 0;
  for (std::uint64_t c = 0; c < 3; ++c) {
    data::ChunkJob job{inputs,
                       dir.path() / fmt::format("c{}.pbin", c),
                       c,
                       3,
                       data::PyInt::from(42),
                       data::FileExistencePolicy::kError};
    docs += data::create_shuffled_dataset_chunk(job).documents;
    tokens += PackedFile(job.output).num_tokens();
  }
  std::uint64_t in_docs = 0, in_tokens = 0;
  for (const auto& p : inputs) {
    PackedFile f(p);
    in_docs += f.num_documents();
    in_tokens += f.num_tokens();
  }
  EXPECT_EQ(docs, in_docs);
  EXPECT_EQ(tokens, in_tokens);
}

TEST(ChunkTest, ErrorsLeaveNoOutput) {
  ScratchDir dir;
  const fs::path out = dir.path() / "chunk.pbin";
  // tiny has 2 documents: chunk 3 of 5 is empty
  data::ChunkJob job{{kTiny}, out, 3, 5, data::PyInt::from(1), data::FileExistencePolicy::kError};
  EXPECT_THAT(error_of([&] { data::create_shuffled_dataset_chunk(job); }), HasSubstr("chunk 3 of 5 has no samples"));
  // token sizes differ
  const fs::path one = dir.write("bytes.pbin", pbin_bytes(1, "abc", {{0, 3}}));
  job = {{kTiny, one}, out, 0, 1, data::PyInt::from(1), data::FileExistencePolicy::kError};
  EXPECT_THAT(error_of([&] { data::create_shuffled_dataset_chunk(job); }), HasSubstr("token size mismatch"));
  // an input is the output
  job = {{kTiny, one}, one, 0, 1, data::PyInt::from(1), data::FileExistencePolicy::kOverride};
  EXPECT_THAT(error_of([&] { data::create_shuffled_dataset_chunk(job); }),
              HasSubstr("is also the --output_chunk_file_path"));
  // a missing JSONL input
  job = {{dir.path() / "missing.jsonl"}, dir.path() / "c.jsonl",           0, 1,
         data::PyInt::from(1),           data::FileExistencePolicy::kError};
  EXPECT_THAT(error_of([&] { data::create_shuffled_jsonl_chunk(job); }), HasSubstr("missing.jsonl' does not exist"));
  EXPECT_THAT(names_in(dir.path()), ElementsAre("bytes.pbin"));
}

// --- the CLI ---------------------------------------------------------------------------------------------------

CommandResult modalities(std::vector<std::string> args) {
  args.insert(args.begin(), {MODALITIES_TEST_BINARY, "data"});
  return run_command(args, {{"MODALITIES_PROGRESS", "0"}});
}

TEST(DataToolsCliTest, HelpListsVerbsAndFlags) {
  const CommandResult all = modalities({"--help"});
  EXPECT_EQ(all.exit_code, 0) << all;
  for (const char* verb : {"merge_packed_data", "shuffle_tokenized_data", "shuffle_jsonl_data",
                           "create_shuffled_dataset_chunk", "create_shuffled_jsonl_chunk"})
    EXPECT_THAT(all.out, HasSubstr(verb)) << all;
  const CommandResult h = modalities({"create_shuffled_dataset_chunk", "--help"});
  EXPECT_EQ(h.exit_code, 0) << h;
  for (const char* flag : {"--input_file_list_path", "--input_data_root_path", "--output_chunk_file_path", "--chunk_id",
                           "--num_chunks", "--file_existence_policy", "--global_seed"})
    EXPECT_THAT(h.out, HasSubstr(flag)) << h;
  const CommandResult s = modalities({"shuffle_tokenized_data", "--help"});
  for (const char* flag : {"--input_data_path", "--output_data_path", "--batch_size", "--seed"})
    EXPECT_THAT(s.out, HasSubstr(flag)) << s;
}

TEST(DataToolsCliTest, MergeWritesCorrectOffsets) {
  ScratchDir dir;
  const fs::path out = dir.path() / "m.pbin";
  const CommandResult r = modalities({"merge_packed_data", kTiny.string(), kTiny.string(), out.string()});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr("4 documents")) << r;
  EXPECT_THAT(PackedFile(out).index(),
              ElementsAre(IndexEntry{0, 4}, IndexEntry{4, 6}, IndexEntry{10, 4}, IndexEntry{14, 6}));
  const CommandResult again = modalities({"merge_packed_data", kTiny.string(), out.string()});
  EXPECT_EQ(again.exit_code, 1) << again;
  EXPECT_THAT(again.err, HasSubstr("already exists")) << again;
  const CommandResult one = modalities({"merge_packed_data", kTiny.string()});
  EXPECT_EQ(one.exit_code, 2) << one;
}

TEST(DataToolsCliTest, ShuffleTokenizedWithSeedMatchesPython) {
  ScratchDir dir;
  const auto& [seed, v] = kShuffleTokenized.front();
  const fs::path out = dir.path() / "s.pbin";
  const CommandResult r = modalities({"shuffle_tokenized_data", "--input_data_path", (input(v.name)).string(),
                                      "--output_data_path", out.string(), "--seed", seed, "--batch_size", "7"});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_EQ(data::sha256_hex(slurp(out)), v.sha256);
}

TEST(DataToolsCliTest, MissingSeedIsDrawnAndPrinted) {
  ScratchDir dir;
  const fs::path in = kRoot / "data" / "sample" / "eval.jsonl";
  const CommandResult r = modalities({"shuffle_jsonl_data", "--input_data_path", in.string(), "--output_data_path",
                                      (dir.path() / "a.jsonl").string()});
  ASSERT_EQ(r.exit_code, 0) << r;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m, std::regex("--seed ([0-9]+)"))) << r;
  const CommandResult again = modalities({"shuffle_jsonl_data", "--input_data_path", in.string(), "--output_data_path",
                                          (dir.path() / "b.jsonl").string(), "--seed", m[1].str()});
  ASSERT_EQ(again.exit_code, 0) << again;
  EXPECT_EQ(slurp(dir.path() / "a.jsonl"), slurp(dir.path() / "b.jsonl"));
}

TEST(DataToolsCliTest, FileExistencePolicies) {
  ScratchDir dir;
  const fs::path out = dir.write("out.jsonl", "old\n");
  const fs::path in = kRoot / "data" / "sample" / "eval.jsonl";
  auto run = [&](const char* policy) {
    return modalities({"shuffle_jsonl_data", "--input_data_path", in.string(), "--output_data_path", out.string(),
                       "--seed", "1", "--file_existence_policy", policy});
  };
  CommandResult r = run("error");
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("already exists")) << r;
  r = run("skip");
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.err, HasSubstr("skipped")) << r;
  EXPECT_EQ(slurp(out), "old\n");
  r = run("override");
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.err, HasSubstr("replaced")) << r;
  EXPECT_EQ(fs::file_size(out), fs::file_size(in));
  r = run("sometimes");
  EXPECT_EQ(r.exit_code, 2) << r;
  EXPECT_THAT(r.err, HasSubstr("skip, error, override")) << r;
}

TEST(DataToolsCliTest, ChunkMatchesPythonAndRejectsBadArguments) {
  ScratchDir dir;
  const fs::path list = write_list(dir, kJsonlChunkList);
  const auto& v = kJsonlChunks.front();
  const fs::path out = dir.path() / "c.jsonl";
  auto args = [&](std::string chunk_id, std::string num_chunks) {
    return std::vector<std::string>{"create_shuffled_jsonl_chunk",
                                    "--input_file_list_path",
                                    list.string(),
                                    "--input_data_root_path",
                                    kRoot.string(),
                                    "--output_chunk_file_path",
                                    out.string(),
                                    "--chunk_id",
                                    chunk_id,
                                    "--num_chunks",
                                    num_chunks,
                                    "--global_seed",
                                    v.global_seed};
  };
  const CommandResult ok = modalities(args(std::to_string(v.chunk_id), std::to_string(v.num_chunks)));
  ASSERT_EQ(ok.exit_code, 0) << ok;
  EXPECT_EQ(data::sha256_hex(slurp(out)), v.sha256);
  for (const auto& [c, k] :
       std::vector<std::pair<std::string, std::string>>{{"3", "3"}, {"-1", "3"}, {"0", "0"}, {"x", "2"}}) {
    const CommandResult bad = modalities(args(c, k));
    EXPECT_EQ(bad.exit_code, 2) << bad;
  }
  const CommandResult missing = modalities({"create_shuffled_dataset_chunk", "--input_file_list_path", list.string()});
  EXPECT_EQ(missing.exit_code, 2) << missing;
  EXPECT_THAT(missing.err, HasSubstr("required")) << missing;
}

TEST(DataToolsCliTest, ErrorsExitWithOneAndNameTheFile) {
  ScratchDir dir;
  const CommandResult r =
      modalities({"shuffle_tokenized_data", "--input_data_path", (dir.path() / "nope.pbin").string(),
                  "--output_data_path", (dir.path() / "o.pbin").string(), "--seed", "1"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("nope.pbin' does not exist")) << r;
  const CommandResult bad_seed = modalities({"shuffle_tokenized_data", "--input_data_path", kTiny.string(),
                                             "--output_data_path", (dir.path() / "o.pbin").string(), "--seed", "1.5"});
  EXPECT_EQ(bad_seed.exit_code, 2) << bad_seed;
  EXPECT_THAT(bad_seed.err, HasSubstr("--seed")) << bad_seed;
  EXPECT_TRUE(names_in(dir.path()).empty());
}

}  // namespace
