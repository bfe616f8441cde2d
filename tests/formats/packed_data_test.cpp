// The pickle subset and .pbin header against real Modalities files
// (tests/fixtures/modalities, byte-for-byte CPython output) and the frame
// layout of docs/data.md ("Index pickle").
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/packed_data.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/shared_fixtures.h>

#include "../cli/scratch_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace modalities::formats {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(MODALITIES_TEST_FIXTURES_DIR);
// The bundled corpus: its .idx/.pbin were written by Modalities 0.5.0 (data/sample/README.md).
const fs::path kSample = fs::path(MODALITIES_TEST_SOURCE_ROOT) / "data" / "sample";

std::span<const std::byte> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(PickleIndexTest, ReproducesModalitiesIndexesOfTheSampleCorpusByteForByte) {
  for (const fs::path& file : {kSample / "train.idx", kSample / "eval.idx", testing::tiny_example_dir() / "tiny.idx"}) {
    const std::string original = testing::read_file(file);
    ASSERT_FALSE(original.empty()) << file;
    const auto entries = unpickle_index(bytes_of(original), file.string());
    EXPECT_EQ(pickle_index(entries), original) << file;
  }
}

TEST(PickleIndexTest, ReproducesEveryFixtureIndexByteForByte) {
  MODALITIES_REQUIRE_SHARED(MODALITIES_TEST_FIXTURES_DIR);
  for (const char* name :
       {"data/lorem_ipsum.idx", "data/lorem_ipsum_long.idx", "derived/tests/data/datasets/danish_test_dataset.idx"}) {
    const std::string original = testing::read_file(kFixtures / name);
    ASSERT_FALSE(original.empty()) << name;
    const auto entries = unpickle_index(bytes_of(original), name);
    EXPECT_EQ(pickle_index(entries), original) << name;
  }
}

TEST(PickleIndexTest, ReadsTheKnownValues) {
  const auto tiny = read_raw_index(testing::tiny_example_dir() / "tiny.idx");
  EXPECT_EQ(tiny, (std::vector<IndexEntry>{{0, 17}, {18, 18}}));
  const auto train = read_raw_index(kSample / "train.idx");  // values read with Python's pickle
  ASSERT_EQ(train.size(), 500u);
  EXPECT_EQ(train.front(), (IndexEntry{0, 1869}));
  EXPECT_EQ(train.back(), (IndexEntry{1526956, 882}));
}

TEST(PickleIndexTest, ReadsTheKnownFixtureValues) {
  MODALITIES_REQUIRE_SHARED(MODALITIES_TEST_FIXTURES_DIR);
  const auto lorem = read_raw_index(kFixtures / "data/lorem_ipsum_long.idx");
  ASSERT_EQ(lorem.size(), 500u);
  EXPECT_EQ(lorem.front(), (IndexEntry{0, 53}));
  EXPECT_EQ(lorem.back(), (IndexEntry{907943, 71}));
}

TEST(PickleIndexTest, ReproducesThePbinIndexSegments) {
  std::vector<fs::path> files = {kSample / "train.pbin", kSample / "eval.pbin"};
  if (fs::exists(kFixtures)) {  // and Modalities' own files where ../shared is present
    files.push_back(kFixtures / "data/lorem_ipsum.pbin");
    files.push_back(kFixtures / "data/lorem_ipsum_long.pbin");
  }
  for (const fs::path& name : files) {
    const std::string file = testing::read_file(name);
    const PackedHeader h = read_packed_header(name);
    const std::string segment = file.substr(kPackedHeaderSize + h.data_len);
    EXPECT_EQ(pickle_index(unpickle_index(bytes_of(segment), name.string())), segment) << name;
  }
}

TEST(PickleIndexTest, FramesLargeListsLikeCPython) {
  // Test vector (CPython pickle.dumps): [(3*i, 7) for i in range(10000)] -> 69 957 bytes, frames of 65 539 and 4 398 bytes.
  std::vector<IndexEntry> entries;
  for (std::uint64_t i = 0; i < 10000; ++i) entries.emplace_back(3 * i, 7);
  const std::string p = pickle_index(entries);
  EXPECT_EQ(p.size(), 69957u);
  ASSERT_EQ(static_cast<unsigned char>(p[2]), 0x95);
  std::uint64_t first = 0;
  for (int i = 0; i < 8; ++i) first |= static_cast<std::uint64_t>(static_cast<unsigned char>(p[3 + i])) << (8 * i);
  EXPECT_EQ(first, 65539u);
  EXPECT_EQ(unpickle_index(bytes_of(p), "vector"), entries);
  // [(300000*i, 70000+i) for i in range(20000)] -> 265 769 bytes.
  std::vector<IndexEntry> big;
  for (std::uint64_t i = 0; i < 20000; ++i) big.emplace_back(300000 * i, 70000 + i);
  EXPECT_EQ(pickle_index(big).size(), 265769u);
  EXPECT_EQ(unpickle_index(bytes_of(pickle_index(big)), "big"), big);
}

TEST(PickleIndexTest, EncodesIntegerWidthsLikeCPython) {
  EXPECT_EQ(pickle_index(std::vector<IndexEntry>{}), std::string("\x80\x04\x5d\x94\x2e", 5));
  // 2^31 -> LONG1 with 5 bytes (sign byte kept), 2^40 -> 6 bytes.
  const std::string p = pickle_index(std::vector<IndexEntry>{{1ULL << 31, 1ULL << 40}});
  EXPECT_NE(p.find(std::string("\x8a\x05\x00\x00\x00\x80\x00", 7)), std::string::npos);
  EXPECT_NE(p.find(std::string("\x8a\x06\x00\x00\x00\x00\x00\x01", 8)), std::string::npos);
  EXPECT_EQ(unpickle_index(bytes_of(p), "wide"), (std::vector<IndexEntry>{{1ULL << 31, 1ULL << 40}}));
}

TEST(PickleIndexTest, RefusesAnythingButAListOfPairs) {
  // GLOBAL opcode (what pickling numpy scalars produces) must never be executed.
  const std::string global("\x80\x04\x63numpy\ncore\n\x2e", 15);
  try {
    unpickle_index(bytes_of(global), "evil.idx");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("evil.idx"));
    EXPECT_THAT(e.what(), HasSubstr("opcode 0x63 is not allowed"));
  }
  EXPECT_THROW(unpickle_index(bytes_of(std::string("\x80\x04\x5d\x94", 4)), "trunc"), Error);
}

// What CPython's pickle.dumps([(0, 17), (18, 18), (2**40, 3)], protocol=p) writes, p = 0..5.
TEST(PickleIndexTest, ReadsEveryProtocolCPythonWrites) {
  const std::vector<std::string> pickles = {
      std::string("(lp0\n(I0\nI17\ntp1\na(I18\nI18\ntp2\na(L1099511627776L\nI3\ntp3\na."),
      std::string("]q\x00((K\x00K\x11tq\x01(K\x12K\x12tq\x02(L1099511627776L\nK\x03tq\x03"
                  "e.",
                  44),
      std::string("\x80\x02]q\x00(K\x00K\x11\x86q\x01K\x12K\x12\x86q\x02\x8a\x06\x00\x00\x00\x00\x00\x01K\x03\x86q\x03"
                  "e.",
                  35),
      std::string("\x80\x03]q\x00(K\x00K\x11\x86q\x01K\x12K\x12\x86q\x02\x8a\x06\x00\x00\x00\x00\x00\x01K\x03\x86q\x03"
                  "e.",
                  35),
      std::string("\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00]\x94(K\x00K\x11\x86\x94K\x12K\x12\x86\x94\x8a\x06\x00"
                  "\x00\x00\x00\x00\x01K\x03\x86\x94"
                  "e.",
                  40),
      std::string("\x80\x05\x95\x1d\x00\x00\x00\x00\x00\x00\x00]\x94(K\x00K\x11\x86\x94K\x12K\x12\x86\x94\x8a\x06\x00"
                  "\x00\x00\x00\x00\x01K\x03\x86\x94"
                  "e.",
                  40)};
  const std::vector<IndexEntry> expected = {{0, 17}, {18, 18}, {1ULL << 40, 3}};
  for (std::size_t p = 0; p < pickles.size(); ++p)
    EXPECT_EQ(unpickle_index(bytes_of(pickles[p]), "p.idx"), expected) << "protocol " << p;
  // The same tuple pickled twice is a memo reference (BINGET).
  const std::string twice(
      "\x80\x02]q\x00(K\x05K\x06\x86q\x01h\x01"
      "e.",
      17);
  EXPECT_EQ(unpickle_index(bytes_of(twice), "twice"), (std::vector<IndexEntry>{{5, 6}, {5, 6}}));
  // Negative offsets (Modalities' merged files) are kept by the signed reader only.
  const std::string negative(
      "\x80\x04\x95\x0d\x00\x00\x00\x00\x00\x00\x00]\x94J\xfe\xff\xff\xffK\x04\x86\x94"
      "a.",
      24);
  EXPECT_EQ(unpickle_signed_index(bytes_of(negative), "neg"), (std::vector<SignedIndexEntry>{{-2, 4}}));
  EXPECT_THAT(error_of([&] { unpickle_index(bytes_of(negative), "neg.idx"); }),
              AllOf(HasSubstr("neg.idx"), HasSubstr("negative offset -2")));
}

// Regression: FRAME (0x95) was skipped wherever it appeared, so turning one MEMOIZE (0x94) into
// 0x95 silently dropped an entry (11 of 12 documents). Python's pickle refuses every such file,
// and so must we: every single flip of that kind, in an .idx and in a .pbin index segment.
TEST(PickleIndexTest, AFlippedMemoizeByteNeverDropsAnEntrySilently) {
  for (const std::string name : {"eval.idx", "train.idx"}) {
    const std::string original = testing::read_file(kSample / name);
    const std::size_t n = unpickle_index(bytes_of(original), name).size();
    int refused = 0;
    for (std::size_t i = 0; i < original.size(); ++i) {
      if (original[i] != '\x94') continue;
      std::string bad = original;
      bad[i] = '\x95';
      // A 0x94 inside an integer's bytes is data: the flip changes that number (Python reads the
      // same), and the entry count stays. A MEMOIZE turned into FRAME must be refused.
      std::vector<IndexEntry> got;
      const std::string error = error_of([&] { got = unpickle_index(bytes_of(bad), name); });
      if (error.empty()) {
        EXPECT_EQ(got.size(), n) << "byte " << i << " flipped: an entry was dropped silently";
      } else {
        EXPECT_THAT(error, HasSubstr(name)) << "byte " << i << " flipped";
        ++refused;
      }
    }
    EXPECT_GT(refused, 10) << name;
  }
}

TEST(PickleIndexTest, FramesAreCheckedLikePythonsUnframer) {
  // A FRAME whose length runs past the data.
  EXPECT_THAT(error_of([&] {
                unpickle_index(bytes_of(std::string("\x80\x04\x95\xff\x00\x00\x00\x00\x00\x00\x00]\x94.", 14)), "f");
              }),
              HasSubstr("FRAME of 255 bytes, but only 3 bytes follow"));
  // A FRAME inside a frame that is not used up.
  EXPECT_THAT(error_of([&] {
                unpickle_index(bytes_of(std::string(
                                   "\x80\x04\x95\x03\x00\x00\x00\x00\x00\x00\x00]\x95\x01\x00\x00\x00\x00\x00\x00\x00"
                                   "\x94.",
                                   23)),
                               "f");
              }),
              HasSubstr("FRAME inside a frame"));
  // An argument crossing the end of its frame (BININT2's second byte lies outside the frame).
  EXPECT_THAT(error_of([&] {
                unpickle_index(bytes_of(std::string("\x80\x04\x95\x04\x00\x00\x00\x00\x00\x00\x00](M\x01\x00K\x02\x86"
                                                    "e.",
                                                    21)),
                               "f");
              }),
              HasSubstr("the frame ends"));
  // Bytes after STOP, a leftover stack, booleans, nested containers.
  EXPECT_THAT(error_of([&] { unpickle_index(bytes_of(std::string("\x80\x04]\x94.junk", 9)), "f"); }),
              HasSubstr("4 bytes after STOP"));
  EXPECT_THAT(error_of([&] { unpickle_index(bytes_of(std::string("\x80\x04K\x01]\x94.", 7)), "f"); }),
              HasSubstr("left on the stack"));
  EXPECT_THAT(error_of([&] {
                unpickle_index(bytes_of(std::string("\x80\x04]\x88K\x01\x86"
                                                    "a.",
                                                    9)),
                               "f");
              }),
              HasSubstr("boolean"));
  EXPECT_THAT(error_of([&] {
                unpickle_index(bytes_of(std::string("\x80\x04]]\x85"
                                                    "a.",
                                                    7)),
                               "f");
              }),
              HasSubstr("other than integers"));
}

// A raw index whose entries overlap or go backwards (a corrupt entry) is refused; gaps are lines
// dropped as faulty when the index was made.
TEST(PickleIndexTest, RawIndexEntriesMustBeOrderedLines) {
  testing::ScratchDir dir;
  std::ofstream(dir.path() / "overlap.idx", std::ios::binary)
      << pickle_index(std::vector<IndexEntry>{{0, 17}, {10, 5}});
  EXPECT_THAT(
      error_of([&] { read_raw_index(dir.path() / "overlap.idx"); }),
      AllOf(HasSubstr("overlap.idx"), HasSubstr("entry 1 starts at byte 10, inside or before the line of entry 0")));
  std::ofstream(dir.path() / "back.idx", std::ios::binary) << pickle_index(std::vector<IndexEntry>{{30, 5}, {0, 17}});
  EXPECT_THAT(error_of([&] { read_raw_index(dir.path() / "back.idx"); }), HasSubstr("entry 1 starts at byte 0"));
  std::ofstream(dir.path() / "gap.idx", std::ios::binary) << pickle_index(std::vector<IndexEntry>{{0, 17}, {30, 0}});
  EXPECT_EQ(read_raw_index(dir.path() / "gap.idx").size(), 2u);
  // Against the JSONL: an entry must be a whole line.
  const std::string jsonl = "{\"a\": 1}\n{\"b\": 22}\n";
  EXPECT_EQ(raw_index_entry_mismatch(jsonl, {0, 8}), std::nullopt);
  EXPECT_EQ(raw_index_entry_mismatch(jsonl, {9, 9}), std::nullopt);
  EXPECT_EQ(raw_index_entry_mismatch(jsonl, {1, 7}), "it does not start at the beginning of a line");
  EXPECT_EQ(raw_index_entry_mismatch(jsonl, {0, 7}), "it does not end at the end of a line");
  EXPECT_EQ(raw_index_entry_mismatch(jsonl, {9, 40}), "it lies beyond the end of the file");
}

TEST(PackedHeaderTest, ReadsTheSampleHeader) {
  const PackedHeader h = read_packed_header(kSample / "train.pbin");
  EXPECT_EQ(h.data_len, 466600u);
  EXPECT_EQ(h.token_size, 2u);
  EXPECT_EQ(h.num_tokens(), 233300u);
}

TEST(PackedHeaderTest, ReadsFixtureHeaders) {
  MODALITIES_REQUIRE_SHARED(MODALITIES_TEST_FIXTURES_DIR);
  const PackedHeader h = read_packed_header(kFixtures / "data/lorem_ipsum_long.pbin");
  EXPECT_EQ(h.data_len, 665750u);
  EXPECT_EQ(h.token_size, 2u);
  EXPECT_EQ(h.num_tokens(), 332875u);
}

TEST(PackedHeaderTest, RejectsTruncatedAndForeignFiles) {
  const fs::path dir = fs::temp_directory_path() / "modalities_packed_header_test";
  fs::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(dir / name, std::ios::binary) << bytes;
    return dir / name;
  };
  const std::string good = testing::read_file(kSample / "eval.pbin");
  EXPECT_THAT(
      [&] {
        try {
          read_packed_header(write("short.pbin", "abc"));
        } catch (const Error& e) {
          return std::string(e.what());
        }
        return std::string();
      }(),
      HasSubstr("too short"));
  EXPECT_THAT(
      [&] {
        try {
          read_packed_header(write("trunc.pbin", good.substr(0, 100)));
        } catch (const Error& e) {
          return std::string(e.what());
        }
        return std::string();
      }(),
      HasSubstr("truncated"));
  EXPECT_THAT(
      [&] {
        try {
          read_packed_header(write("json.pbin", "{\"text\": \"not a pbin\"}\n"));
        } catch (const Error& e) {
          return std::string(e.what());
        }
        return std::string();
      }(),
      HasSubstr("token size"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace modalities::formats
