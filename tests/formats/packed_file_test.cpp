// The memory-mapped .pbin reader against the real Modalities files of
// tests/fixtures/modalities (expected values from its README; format in docs/data.md)
// and against broken files written into a scratch directory.
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/packed_file.h>
#include <modalities/sdk/formats/packed_writer.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/shared_fixtures.h>

#include "../cli/scratch_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

namespace modalities::formats {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(MODALITIES_TEST_FIXTURES_DIR);
const fs::path kSample = fs::path(MODALITIES_TEST_SOURCE_ROOT) / "data" / "sample";

// A .pbin built in memory: header, tokens of width `token_size`, pickled index.
std::string make_pbin(std::uint32_t token_size, const std::vector<std::uint64_t>& tokens,
                      const std::vector<IndexEntry>& index, std::uint64_t data_len_override = ~0ULL) {
  std::string out;
  const std::uint64_t data_len = data_len_override != ~0ULL ? data_len_override : tokens.size() * token_size;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((data_len >> (8 * i)) & 0xff));
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((token_size >> (8 * i)) & 0xff));
  for (std::uint64_t t : tokens)
    for (std::uint32_t i = 0; i < token_size; ++i) out.push_back(static_cast<char>((t >> (8 * i)) & 0xff));
  return out + pickle_index(index);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// data/sample/eval.pbin (Modalities 0.5.0's output; the values were read with Python's struct and pickle).
TEST(PackedFileTest, ReadsTheSampleCorpus) {
  PackedFile f(kSample / "eval.pbin");
  EXPECT_EQ(f.header().data_len, 20570u);
  EXPECT_EQ(f.header().file_size, 20784u);
  EXPECT_EQ(f.token_size(), 2u);
  EXPECT_EQ(f.num_tokens(), 10285u);
  EXPECT_EQ(f.data().size(), 20570u);
  EXPECT_EQ(f.index_bytes().size(), 202u);
  EXPECT_THAT(f.tokens(0, 4), ElementsAre(53, 5074, 334, 12));
  EXPECT_EQ(f.token(1), 5074u);
  ASSERT_EQ(f.num_documents(), 24u);
  EXPECT_FALSE(f.legacy());
  EXPECT_EQ(f.index()[0], (IndexEntry{0, 1222}));
  EXPECT_EQ(f.index()[1], (IndexEntry{1222, 304}));
  EXPECT_EQ(f.index()[2], (IndexEntry{1526, 1150}));
  std::uint64_t total = 0;
  for (std::uint64_t k = 0; k < f.num_documents(); ++k) {
    const auto doc = f.document(k);
    ASSERT_FALSE(doc.empty());
    EXPECT_EQ(doc.back(), 0) << "document " << k;  // EOD <|endoftext|> of gpt2_style_8k
    total += doc.size();
  }
  EXPECT_EQ(total, 10285u);
}

TEST(PackedFileTest, ReadsLoremIpsum) {
  MODALITIES_REQUIRE_SHARED(MODALITIES_TEST_FIXTURES_DIR);
  PackedFile f(kFixtures / "data/lorem_ipsum.pbin");
  EXPECT_EQ(f.header().data_len, 15978u);
  EXPECT_EQ(f.header().file_size, 16095u);
  EXPECT_EQ(f.token_size(), 2u);
  EXPECT_EQ(f.num_tokens(), 7989u);
  EXPECT_EQ(f.data().size(), 15978u);
  EXPECT_EQ(f.index_bytes().size(), 105u);
  EXPECT_THAT(f.tokens(0, 4), ElementsAre(15, 15639, 76, 220));
  EXPECT_EQ(f.token(1), 15639u);
  ASSERT_EQ(f.num_documents(), 12u);
  EXPECT_FALSE(f.legacy());
  EXPECT_EQ(f.index()[0], (IndexEntry{0, 3276}));
  EXPECT_EQ(f.index()[1], (IndexEntry{3276, 1966}));
  EXPECT_EQ(f.index()[2], (IndexEntry{5242, 48}));
  std::uint64_t total = 0;
  for (std::uint64_t k = 0; k < f.num_documents(); ++k) {
    const auto doc = f.document(k);
    ASSERT_FALSE(doc.empty());
    EXPECT_EQ(doc.back(), 50256) << "document " << k;
    total += doc.size();
  }
  EXPECT_EQ(total, 7989u);
}

TEST(PackedFileTest, ReadsLoremIpsumLongAtTheSpecSample) {
  MODALITIES_REQUIRE_SHARED(MODALITIES_TEST_FIXTURES_DIR);
  PackedFile f(kFixtures / "data/lorem_ipsum_long.pbin");
  EXPECT_EQ(f.num_tokens(), 332875u);
  EXPECT_EQ(f.num_documents(), 500u);
  // Continuous dataset, S = 256: sample 642 starts at token 164 352 (plugins/datasets/README.md).
  EXPECT_THAT(f.tokens(164352, 6), ElementsAre(2797, 3384, 2248, 382, 2123, 288));
  EXPECT_EQ(f.token(f.num_tokens() - 1), 50256u);
}

TEST(PackedFileTest, ReadsTinyDocuments) {
  PackedFile f(testing::tiny_example_dir() / "tiny.pbin");
  EXPECT_EQ(f.index(), (std::vector<IndexEntry>{{0, 4}, {4, 6}}));
  EXPECT_THAT(f.document(0), ElementsAre(15496, 50256));
  EXPECT_THAT(f.document(1), ElementsAre(10603, 0, 50256));
  EXPECT_THAT(error_of([&] { f.document(2); }), HasSubstr("document 2 is out of range"));
}

TEST(PackedFileTest, WidensOneAndFourByteTokens) {
  testing::ScratchDir dir;
  PackedFile one(dir.write("one.pbin", make_pbin(1, {0, 7, 255}, {{0, 3}})));
  EXPECT_THAT(one.tokens(0, 3), ElementsAre(0, 7, 255));
  PackedFile four(dir.write("four.pbin", make_pbin(4, {1, 65536, 4294967295ULL}, {{0, 8}, {8, 4}})));
  EXPECT_THAT(four.tokens(0, 3), ElementsAre(1, 65536, 4294967295LL));
  EXPECT_THAT(four.document(1), ElementsAre(4294967295LL));
}

TEST(PackedFileTest, ConvertsLegacyAbsoluteOffsets) {
  testing::ScratchDir dir;
  // tiny.pbin written before Modalities PR #164: offsets count from the file start.
  PackedFile f(dir.write("legacy.pbin", make_pbin(2, {15496, 50256, 10603, 0, 50256}, {{12, 4}, {16, 6}})));
  EXPECT_TRUE(f.legacy());
  EXPECT_EQ(f.index(), (std::vector<IndexEntry>{{0, 4}, {4, 6}}));
  EXPECT_THAT(f.document(1), ElementsAre(10603, 0, 50256));
}

TEST(PackedFileTest, AcceptsAnEmptyFileAsWrittenByModalities) {
  testing::ScratchDir dir;
  PackedFile f(dir.write("empty.pbin", make_pbin(2, {}, {})));  // the 17-byte "nothing written" file
  EXPECT_EQ(f.header().file_size, 17u);
  EXPECT_EQ(f.num_tokens(), 0u);
  EXPECT_EQ(f.num_documents(), 0u);
  EXPECT_FALSE(f.legacy());
}

TEST(PackedFileTest, RejectsEmptyAndTruncatedHeaders) {
  testing::ScratchDir dir;
  const fs::path empty = dir.write("empty.pbin", "");
  EXPECT_THAT(error_of([&] { PackedFile f(empty); }),
              AllOf(HasSubstr("empty.pbin"), HasSubstr("0 bytes is too short")));
  const fs::path shorty = dir.write("short.pbin", std::string("\x0a\x00\x00\x00\x00", 5));
  EXPECT_THAT(error_of([&] { PackedFile f(shorty); }),
              AllOf(HasSubstr("short.pbin"), HasSubstr("5 bytes is too short")));
  EXPECT_THAT(error_of([&] { PackedFile f(dir.path() / "missing.pbin"); }),
              AllOf(HasSubstr("missing.pbin"), HasSubstr("cannot open")));
}

TEST(PackedFileTest, RejectsTokenSizeThree) {
  testing::ScratchDir dir;
  const fs::path p = dir.write("ts3.pbin", make_pbin(3, {1, 2}, {{0, 6}}));
  EXPECT_THAT(error_of([&] { PackedFile f(p); }),
              AllOf(HasSubstr("ts3.pbin"), HasSubstr("token size 3"), HasSubstr("not 1, 2 or 4")));
}

TEST(PackedFileTest, RejectsDataLengthBeyondTheFile) {
  testing::ScratchDir dir;
  const fs::path p = dir.write("long.pbin", make_pbin(2, {1, 2}, {{0, 4}}, /*data_len=*/1000));
  EXPECT_THAT(error_of([&] { PackedFile f(p); }),
              AllOf(HasSubstr("long.pbin"), HasSubstr("header says 1000 data bytes"), HasSubstr("truncated")));
}

TEST(PackedFileTest, RejectsDataLengthNotAMultipleOfTheTokenSize) {
  testing::ScratchDir dir;
  const fs::path p = dir.write("odd.pbin", make_pbin(2, {1, 2}, {{0, 4}}, /*data_len=*/3));
  EXPECT_THAT(error_of([&] { PackedFile f(p); }),
              AllOf(HasSubstr("odd.pbin"), HasSubstr("data length 3 is not a multiple of the token size 2")));
}

TEST(PackedFileTest, CorruptIndexFailsOnlyWhenTheIndexIsRead) {
  testing::ScratchDir dir;
  std::string bytes = make_pbin(2, {5, 6, 7}, {});
  bytes.resize(12 + 6);
  bytes += "\x80\x04\x63garbage";  // GLOBAL opcode: never executed
  PackedFile f(dir.write("corrupt.pbin", bytes));
  EXPECT_THAT(f.tokens(0, 3), ElementsAre(5, 6, 7));  // continuous access does not need the index
  EXPECT_THAT(error_of([&] { f.index(); }),
              AllOf(HasSubstr("corrupt.pbin"), HasSubstr("index pickle"), HasSubstr("opcode 0x63")));
  // A failed load is not cached as success.
  EXPECT_THAT(error_of([&] { f.num_documents(); }), HasSubstr("index pickle"));

  std::string no_index = make_pbin(2, {5, 6, 7}, {});
  no_index.resize(12 + 6);
  PackedFile g(dir.write("noindex.pbin", no_index));
  EXPECT_EQ(g.num_tokens(), 3u);
  EXPECT_THAT(error_of([&] { g.index(); }), AllOf(HasSubstr("noindex.pbin"), HasSubstr("no index segment")));
}

TEST(PackedFileTest, RejectsIndexEntriesOutsideTheDataOrMisaligned) {
  testing::ScratchDir dir;
  PackedFile outside(dir.write("outside.pbin", make_pbin(2, {1, 2, 3}, {{0, 2}, {2, 6}})));
  EXPECT_THAT(error_of([&] { outside.index(); }),
              AllOf(HasSubstr("outside.pbin"), HasSubstr("document 1"), HasSubstr("outside the data section")));
  PackedFile misaligned(dir.write("misaligned.pbin", make_pbin(2, {1, 2, 3}, {{0, 3}, {3, 3}})));
  EXPECT_THAT(error_of([&] { misaligned.index(); }),
              AllOf(HasSubstr("misaligned.pbin"), HasSubstr("document 0"), HasSubstr("multiples of the token size")));
}

// Modalities' merge_packed_data shifts the k-th input's entries by the data lengths before it
// minus 12 per input: merging tiny.pbin with itself stores [(0,4),(4,6),(-2,4),(2,6)].
TEST(PackedFileTest, CorrectsTheOffsetsOfFilesMergedByModalities) {
  testing::ScratchDir dir;
  std::string bytes = make_pbin(2, {15496, 50256, 10603, 0, 50256, 15496, 50256, 10603, 0, 50256}, {});
  bytes.resize(12 + 20);
  bytes += std::string(
      "\x80\x02](K\x00K\x04\x86K\x04K\x06\x86J\xfe\xff\xff\xffK\x04\x86K\x02K\x06\x86"
      "e.",
      29);
  PackedFile f(dir.write("merged.pbin", bytes));
  EXPECT_EQ(f.index(), (std::vector<IndexEntry>{{0, 4}, {4, 6}, {10, 4}, {14, 6}}));
  EXPECT_THAT(f.document(3), ElementsAre(10603, 0, 50256));
}

// Regression: a lost entry (one flipped pickle byte dropped a document) or a gap between
// documents must be an error, never a file that silently holds fewer documents.
TEST(PackedFileTest, RefusesAnIndexThatDoesNotTileTheData) {
  testing::ScratchDir dir;
  const std::vector<std::uint64_t> tokens = {1, 2, 3, 4, 5, 6};
  PackedFile lost_last(dir.write("lost_last.pbin", make_pbin(2, tokens, {{0, 4}, {4, 4}})));
  EXPECT_THAT(error_of([&] { lost_last.index(); }),
              AllOf(HasSubstr("lost_last.pbin"), HasSubstr("2 documents cover 8 of the 12 data bytes")));
  PackedFile lost_middle(dir.write("lost_middle.pbin", make_pbin(2, tokens, {{0, 4}, {8, 4}})));
  EXPECT_THAT(error_of([&] { lost_middle.index(); }),
              AllOf(HasSubstr("lost_middle.pbin"), HasSubstr("document 1: stored offset 8 does not continue")));
  PackedFile overlap(dir.write("overlap.pbin", make_pbin(2, tokens, {{0, 8}, {4, 8}})));
  EXPECT_THAT(error_of([&] { overlap.index(); }), HasSubstr("document 1: stored offset 4 does not continue"));
  PackedFile late(dir.write("late.pbin", make_pbin(2, tokens, {{2, 10}})));
  EXPECT_THAT(error_of([&] { late.index(); }), HasSubstr("document 0: stored offset 2 does not continue"));
  PackedFile none(dir.write("none.pbin", make_pbin(2, tokens, {})));
  EXPECT_THAT(error_of([&] { none.index(); }), HasSubstr("0 documents cover 0 of the 12 data bytes"));
}

TEST(PackedFileTest, RangeChecksTokenAccess) {
  PackedFile f(testing::tiny_example_dir() / "tiny.pbin");
  EXPECT_THAT(error_of([&] { f.token(5); }), AllOf(HasSubstr("tiny.pbin"), HasSubstr("token 5 is out of range")));
  EXPECT_THAT(error_of([&] { f.tokens(3, 3); }), HasSubstr("tokens [3, 6) are out of range"));
  EXPECT_TRUE(f.tokens(5, 0).empty());
  PackedFile closed;
  EXPECT_FALSE(closed.is_open());
  EXPECT_THAT(error_of([&] { closed.num_tokens(); }), HasSubstr("no file is open"));
}

TEST(PackedFileTest, MovesAndLoadsTheIndexOnceAcrossThreads) {
  PackedFile f(kSample / "train.pbin");
  PackedFile g = std::move(f);
  EXPECT_FALSE(f.is_open());  // NOLINT(bugprone-use-after-move): moved-from state is specified
  std::vector<std::thread> threads;
  std::vector<std::size_t> sizes(8);
  for (int t = 0; t < 8; ++t) threads.emplace_back([&, t] { sizes[t] = g.index().size(); });
  for (auto& t : threads) t.join();
  for (auto s : sizes) EXPECT_EQ(s, 500u);
}

// The writer reproduces the example of docs/data.md (tiny.pbin) from its
// documents, one at a time and as one block, and refuses inconsistent input.
TEST(PackedWriterTest, WritesTheWorkedExampleAndChecksItsInput) {
  modalities::testing::ScratchDir dir;
  const std::vector<std::uint16_t> doc0 = {15496, 50256}, doc1 = {10603, 0, 50256};
  auto bytes = [](const std::vector<std::uint16_t>& d) { return std::as_bytes(std::span(d)); };
  {
    PackedWriter w(dir.path() / "a.pbin", 2);
    w.add_document(bytes(doc0));
    w.add_document(bytes(doc1));
    EXPECT_EQ(w.num_documents(), 2u);
    EXPECT_EQ(w.data_len(), 10u);
    w.commit();
  }
  const std::string expected = modalities::testing::read_file(modalities::testing::tiny_example_dir() / "tiny.pbin");
  EXPECT_EQ(modalities::testing::read_file(dir.path() / "a.pbin"), expected);

  std::vector<std::uint16_t> both = doc0;
  both.insert(both.end(), doc1.begin(), doc1.end());
  {
    PackedWriter w(dir.path() / "b.pbin", 2);
    const std::uint64_t lengths[] = {4, 6};
    w.append(bytes(both), lengths);
    w.commit();
  }
  EXPECT_EQ(modalities::testing::read_file(dir.path() / "b.pbin"), expected);

  PackedWriter bad(dir.path() / "c.pbin", 2);
  const std::uint64_t wrong[] = {4, 4};
  EXPECT_THAT([&] { bad.append(bytes(both), wrong); },
              ::testing::ThrowsMessage<Error>(HasSubstr("document lengths sum to 8 but 10 bytes given")));
  EXPECT_THAT([&] { PackedWriter(dir.path() / "d.pbin", 3); },
              ::testing::ThrowsMessage<Error>(HasSubstr("token size 3 is not 1, 2 or 4")));
  EXPECT_FALSE(fs::exists(dir.path() / "c.pbin"));  // never committed
}

}  // namespace
}  // namespace modalities::formats
