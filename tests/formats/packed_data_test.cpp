// The pickle subset and .pbin header against real Modalities files
// (shared/fixtures/modalities, byte-for-byte CPython output) and the frame
// layout of spec data.md §2.1.
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/packed_data.h>
#include <modalities/testing/harness.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace modalities::formats {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(MODALITIES_TEST_SHARED_DIR) / "fixtures" / "modalities";

std::span<const std::byte> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

TEST(PickleIndexTest, ReproducesEveryFixtureIndexByteForByte) {
  for (const char* name : {"data/lorem_ipsum.idx", "data/lorem_ipsum_long.idx", "derived/tiny/tiny.idx",
                           "derived/tests/data/datasets/danish_test_dataset.idx"}) {
    const std::string original = testing::read_file(kFixtures / name);
    ASSERT_FALSE(original.empty()) << name;
    const auto entries = unpickle_index(bytes_of(original), name);
    EXPECT_EQ(pickle_index(entries), original) << name;
  }
}

TEST(PickleIndexTest, ReadsTheKnownFixtureValues) {
  const auto tiny = read_raw_index(kFixtures / "derived/tiny/tiny.idx");
  EXPECT_EQ(tiny, (std::vector<IndexEntry>{{0, 17}, {18, 18}}));
  const auto lorem = read_raw_index(kFixtures / "data/lorem_ipsum_long.idx");
  ASSERT_EQ(lorem.size(), 500u);
  EXPECT_EQ(lorem.front(), (IndexEntry{0, 53}));
  EXPECT_EQ(lorem.back(), (IndexEntry{907943, 71}));
}

TEST(PickleIndexTest, ReproducesThePbinIndexSegments) {
  for (const char* name : {"data/lorem_ipsum.pbin", "data/lorem_ipsum_long.pbin"}) {
    const std::string file = testing::read_file(kFixtures / name);
    const PackedHeader h = read_packed_header(kFixtures / name);
    const std::string segment = file.substr(kPackedHeaderSize + h.data_len);
    EXPECT_EQ(pickle_index(unpickle_index(bytes_of(segment), name)), segment) << name;
  }
}

TEST(PickleIndexTest, FramesLargeListsLikeCPython) {
  // Spec test vector: [(3*i, 7) for i in range(10000)] -> 69 957 bytes, frames of 65 539 and 4 398 bytes.
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
  const std::string global("\x80\x04\x63numpy\ncore\n\x2e", 17);
  try {
    unpickle_index(bytes_of(global), "evil.idx");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("evil.idx"));
    EXPECT_THAT(e.what(), HasSubstr("opcode 0x63 is not allowed"));
  }
  EXPECT_THROW(unpickle_index(bytes_of(std::string("\x80\x04\x5d\x94", 4)), "trunc"), Error);
}

TEST(PackedHeaderTest, ReadsFixtureHeaders) {
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
  const std::string good = testing::read_file(kFixtures / "data/lorem_ipsum.pbin");
  EXPECT_THAT([&] {
    try { read_packed_header(write("short.pbin", "abc")); } catch (const Error& e) { return std::string(e.what()); }
    return std::string();
  }(), HasSubstr("too short"));
  EXPECT_THAT([&] {
    try { read_packed_header(write("trunc.pbin", good.substr(0, 100))); } catch (const Error& e) { return std::string(e.what()); }
    return std::string();
  }(), HasSubstr("truncated"));
  EXPECT_THAT([&] {
    try { read_packed_header(write("json.pbin", "{\"text\": \"not a pbin\"}\n")); } catch (const Error& e) { return std::string(e.what()); }
    return std::string();
  }(), HasSubstr("token size"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace modalities::formats
