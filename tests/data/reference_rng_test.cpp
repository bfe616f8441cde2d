// CPythonRandom and NumpyRandom against vectors from the real CPython `random`
// module and numpy (docs/data.md, "Shuffles and chunks"; generated values in
// data_tools_reference.inc by scripts/reference/data_tools_reference.py).
#include <modalities/core/data/pbin_tools.h>
#include <modalities/core/data/reference_rng.h>
#include <modalities/sdk/error.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace {

#include "data_tools_reference.inc"

using modalities::core::data::CPythonRandom;
using modalities::core::data::NumpyRandom;
using modalities::core::data::PyInt;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

std::vector<std::uint64_t> iota(std::size_t n) {
  std::vector<std::uint64_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

std::string sha256_of_u64(const std::vector<std::uint64_t>& v) {
  // little-endian uint64 bytes, as numpy's tobytes() of dtype "<u8"
  std::string bytes;
  for (auto x : v)
    for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((x >> (8 * i)) & 0xff));
  return modalities::core::data::sha256_hex(bytes);
}

// --- PyInt ------------------------------------------------------------------------------

TEST(PyIntTest, ParsesLikePythonInt) {
  EXPECT_EQ(PyInt::parse("0").decimal(), "0");
  EXPECT_EQ(PyInt::parse("-0").decimal(), "0");
  EXPECT_EQ(PyInt::parse("  +007 ").decimal(), "7");
  EXPECT_EQ(PyInt::parse("1_000").decimal(), "1000");
  EXPECT_EQ(PyInt::parse("-42").decimal(), "-42");
  EXPECT_EQ(PyInt::parse("18446744073709551616").magnitude, (std::vector<std::uint32_t>{0, 0, 1}));
  const std::string big =
      "265613988875874769338781322035779626829233452653394495974574961739092490901302182994384699044001";
  EXPECT_EQ(PyInt::parse(big).decimal(), big);
  EXPECT_EQ(PyInt::parse("18446744073709551615").to_u64(), 18446744073709551615ULL);
}

TEST(PyIntTest, RejectsWhatPythonRejects) {
  for (const char* bad : {"", " ", "+", "1.5", "0x10", "1__0", "_1", "1_", "12a", "- 1"})
    EXPECT_THROW(PyInt::parse(bad), modalities::Error) << bad;
  EXPECT_THAT([] { (void)PyInt::parse("-1").to_u64(); }, ::testing::Throws<modalities::Error>());
}

// --- CPython random ----------------------------------------------------------------------

TEST(CPythonRandomTest, SpecShuffleVectors) {
  auto v = iota(10);
  CPythonRandom(0).shuffle(v);
  EXPECT_THAT(v, ElementsAre(7, 8, 1, 5, 3, 4, 2, 0, 9, 6));
  v = iota(10);
  CPythonRandom(42).shuffle(v);
  EXPECT_THAT(v, ElementsAre(7, 3, 2, 8, 5, 6, 9, 4, 0, 1));
}

TEST(CPythonRandomTest, MatchesCPythonForManySeeds) {
  for (const auto& c : kCPythonVectors) {
    SCOPED_TRACE(c.seed);
    const PyInt seed = PyInt::parse(c.seed);
    CPythonRandom words(seed);
    for (std::uint64_t expected : c.u32) EXPECT_EQ(words.next_u32(), expected);

    auto v = iota(100);
    CPythonRandom(seed).shuffle(v);
    EXPECT_THAT(v, ElementsAreArray(c.shuffle100));

    CPythonRandom bits(seed);
    const unsigned widths[] = {1, 5, 31, 32, 33, 40, 63, 64, 17};
    for (std::size_t i = 0; i < c.bits.size(); ++i)
      EXPECT_EQ(bits.getrandbits(widths[i]), c.bits[i]) << "k=" << widths[i];

    EXPECT_EQ(CPythonRandom(seed).random(), c.random0);
  }
}

TEST(CPythonRandomTest, RandbelowAbove32Bits) {
  CPythonRandom r(5);
  const std::uint64_t ns[] = {(1ULL << 32) + 1, (1ULL << 40) + 3, (1ULL << 63) + 11, ~0ULL, 3, 1000};
  for (std::size_t i = 0; i < kCPythonRandbelowSeed5.size(); ++i)
    EXPECT_EQ(r.randbelow(ns[i]), kCPythonRandbelowSeed5[i]);
}

TEST(CPythonRandomTest, LargeShuffle) {
  auto v = iota(70000);
  CPythonRandom(123).shuffle(v);
  EXPECT_EQ(sha256_of_u64(v), kCPythonShuffle70000Seed123Sha);
}

TEST(CPythonRandomTest, ChoicesSplitVectorOfSpec) {
  // random.seed(1234); random.choices(["train", "val", "test"], weights=[70, 0, 30]) per entry (Modalities' instruction-tuning split).
  CPythonRandom r(1234);
  const double weights[] = {70, 0, 30};
  std::vector<int> got;
  for (std::size_t i = 0; i < kChoices1234.size(); ++i) got.push_back(static_cast<int>(r.choice(weights)));
  EXPECT_THAT(got, ElementsAreArray(kChoices1234));
  // Python's first 12: test, train, train, test, test, train, train, train, test, train, train, test
  EXPECT_THAT(std::vector<int>(got.begin(), got.begin() + 12), ElementsAre(2, 0, 0, 2, 2, 0, 0, 0, 2, 0, 0, 2));

  CPythonRandom f(99);
  const double fw[] = {0.1, 2.5, 0.0, 1e-3, 7.25};
  got.clear();
  for (std::size_t i = 0; i < kChoices99Float.size(); ++i) got.push_back(static_cast<int>(f.choice(fw)));
  EXPECT_THAT(got, ElementsAreArray(kChoices99Float));
}

TEST(CPythonRandomTest, ChoicesRejectsZeroTotal) {
  CPythonRandom r(1);
  const double zero[] = {0, 0};
  EXPECT_THROW(r.choice(zero), modalities::Error);
}

// --- numpy default_rng ----------------------------------------------------------------------

TEST(NumpyRandomTest, SpecVectors) {
  auto v = iota(10);
  NumpyRandom(0).shuffle(v);
  EXPECT_THAT(v, ElementsAre(4, 6, 2, 7, 3, 5, 9, 0, 8, 1));
  v = iota(10);
  NumpyRandom(42).shuffle(v);
  EXPECT_THAT(v, ElementsAre(5, 6, 0, 7, 3, 2, 4, 9, 1, 8));
  EXPECT_EQ(NumpyRandom(42).next64(), 14276969152011380360ULL);
}

TEST(NumpyRandomTest, MatchesNumpyForManySeeds) {
  for (const auto& c : kNumpyVectors) {
    SCOPED_TRACE(c.seed);
    const PyInt seed = PyInt::parse(c.seed);
    const std::vector<std::uint32_t> entropy = seed.is_zero() ? std::vector<std::uint32_t>{0} : seed.magnitude;
    const auto state = NumpyRandom::seed_sequence_state(entropy);
    EXPECT_THAT(std::vector<std::uint64_t>(state.begin(), state.end()), ElementsAreArray(c.state));

    NumpyRandom raw(seed);
    for (std::uint64_t expected : c.next64) EXPECT_EQ(raw.next64(), expected);

    auto v = iota(100);
    NumpyRandom(seed).shuffle(v);
    EXPECT_THAT(v, ElementsAreArray(c.shuffle100));
  }
}

TEST(NumpyRandomTest, LargeShuffle) {
  auto v = iota(70000);
  NumpyRandom(123).shuffle(v);
  EXPECT_EQ(sha256_of_u64(v), kNumpyShuffle70000Seed123Sha);
}

TEST(NumpyRandomTest, Next32UsesBothHalves) {
  NumpyRandom a(7);
  NumpyRandom b(7);
  const std::uint64_t w = a.next64();
  EXPECT_EQ(b.next32(), static_cast<std::uint32_t>(w));
  EXPECT_EQ(b.next32(), static_cast<std::uint32_t>(w >> 32));
}

TEST(NumpyRandomTest, RejectsNegativeSeed) { EXPECT_THROW(NumpyRandom(PyInt::parse("-1")), modalities::Error); }

}  // namespace
