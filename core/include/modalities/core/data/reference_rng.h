// Bit-exact re-implementations of the two Python random streams the Modalities
// data tools depend on (docs/data.md, "Shuffles and chunks"):
//   * CPythonRandom — `random.Random(seed)` (MT19937 seeded by init_by_array),
//     used by shuffle_tokenized_data / shuffle_jsonl_data and the split of
//     prepare_instruction_tuning_data;
//   * NumpyRandom — `numpy.random.default_rng(seed)` (SeedSequence -> PCG64),
//     used by the shuffled chunk tools.
// Hand-written on purpose: std::mt19937's seeding, std::shuffle and
// std::uniform_int_distribution are implementation-defined or differ from
// CPython/numpy, and the point is to produce exactly the same permutations as
// Python for the same seed. Tests compare against vectors from the real libraries.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace modalities::core::data {

/// A Python `int` as typed on a command line (`--seed`, `--global_seed`): any
/// size and sign, kept exactly. Python seeds are arbitrary integers and the
/// chunk seed hashes the decimal text, so neither may be truncated to 64 bits.
struct PyInt {
  bool negative = false;
  std::vector<std::uint32_t> magnitude;  // 32-bit words, least significant first; empty for 0

  /// Parses what Python's int() accepts for base-10 text: optional surrounding
  /// whitespace, optional sign, digits with single underscores between them.
  /// Throws modalities::Error naming `text` otherwise.
  static PyInt parse(std::string_view text);
  static PyInt from(std::uint64_t value);
  /// Canonical decimal text, as Python's str(int) writes it.
  std::string decimal() const;
  bool is_zero() const { return magnitude.empty(); }
  /// The value if it fits into 64 bits and is non-negative (else throws).
  std::uint64_t to_u64() const;
};

/// CPython's `random.Random(seed)` (Lib/random.py on Modules/_randommodule.c).
///
/// \code
///   CPythonRandom rng(42);
///   std::vector<int> v{0, 1, 2, 3};
///   rng.shuffle(v);   // == random.Random(42).shuffle(v)
/// \endcode
class CPythonRandom {
 public:
  /// random.Random(seed) for a non-negative seed.
  explicit CPythonRandom(std::uint64_t seed);
  /// random.Random(seed) for any Python int (CPython seeds with abs(seed)).
  explicit CPythonRandom(const PyInt& seed);

  /// genrand_uint32().
  std::uint32_t next_u32();
  /// getrandbits(k) for 0 <= k <= 64 (32-bit words, least significant first;
  /// the most significant word keeps its top bits).
  std::uint64_t getrandbits(unsigned k);
  /// _randbelow(n) for n >= 1: rejection sampling on getrandbits(bit_length(n)).
  std::uint64_t randbelow(std::uint64_t n);
  /// random(): a double in [0, 1) with 53 random bits.
  double random();
  /// random.choices(range(len(weights)), weights=weights)[0]: bisect_right on the
  /// cumulative weights with random() * total (hi = len - 1, as CPython).
  std::size_t choice(std::span<const double> weights);

  /// random.shuffle(x): for i = n-1 .. 1: j = randbelow(i + 1); swap(x[i], x[j]).
  template <typename T>
  void shuffle(std::span<T> x) {
    for (std::size_t i = x.size(); i-- > 1;) {
      const std::size_t j = static_cast<std::size_t>(randbelow(static_cast<std::uint64_t>(i) + 1));
      using std::swap;
      swap(x[i], x[j]);
    }
  }
  template <typename T>
  void shuffle(std::vector<T>& x) {
    shuffle(std::span<T>(x));
  }

 private:
  void init_genrand(std::uint32_t s);
  void init_by_array(std::span<const std::uint32_t> key);
  void twist();

  std::array<std::uint32_t, 624> mt_{};
  std::size_t index_ = 625;
};

/// numpy's `default_rng(seed)`: SeedSequence(seed) -> PCG64 (XSL-RR 128/64),
/// with Generator.shuffle's bounded draws (random_interval).
///
/// \code
///   NumpyRandom rng(42);
///   rng.next64();     // 14276969152011380360 == default_rng(42).bit_generator.random_raw()
///   rng.shuffle(v);   // == default_rng(42).shuffle(v) for a list or 1-d array
/// \endcode
/// Matches numpy 1.24 - 2.4 (numpy does not promise stability across majors).
class NumpyRandom {
 public:
  explicit NumpyRandom(std::uint64_t seed);
  /// SeedSequence entropy given as 32-bit words, least significant first
  /// (what numpy derives from a non-negative Python int; `{0}` for 0).
  explicit NumpyRandom(std::span<const std::uint32_t> entropy);
  /// From a Python int; negative seeds are rejected like numpy does.
  explicit NumpyRandom(const PyInt& seed);

  /// The 4 x uint64 that SeedSequence.generate_state(4, uint64) returns.
  static std::array<std::uint64_t, 4> seed_sequence_state(std::span<const std::uint32_t> entropy);

  std::uint64_t next64();
  /// Buffered: each next64 serves two calls, low half first.
  std::uint32_t next32();
  /// random_interval(max): uniform in [0, max] by masked rejection.
  std::uint64_t bounded(std::uint64_t max);

  template <typename T>
  void shuffle(std::span<T> x) {
    for (std::size_t i = x.size(); i-- > 1;) {
      const std::size_t j = static_cast<std::size_t>(bounded(i));
      using std::swap;
      swap(x[i], x[j]);
    }
  }
  template <typename T>
  void shuffle(std::vector<T>& x) {
    shuffle(std::span<T>(x));
  }

 private:
  void seed_state(const std::array<std::uint64_t, 4>& s);
  void step();

  unsigned __int128 state_ = 0;
  unsigned __int128 inc_ = 0;
  bool has_u32_ = false;
  std::uint32_t u32_ = 0;
};

}  // namespace modalities::core::data
