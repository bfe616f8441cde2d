// CPython random.Random and numpy default_rng streams (see reference_rng.h and
// docs/data.md, "Shuffles and chunks"). Hand-written: the outputs must equal Python's bit
// for bit, which no C++ library RNG guarantees.
#include <modalities/core/data/reference_rng.h>
#include <modalities/sdk/error.h>

#include <fmt/core.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>

namespace modalities::core::data {

// ---------------------------------------------------------------------------
// PyInt

PyInt PyInt::parse(std::string_view text) {
  const auto fail = [&] { return Error(fmt::format("'{}' is not a valid integer", text)); };
  std::size_t b = 0;
  std::size_t e = text.size();
  while (b < e && std::isspace(static_cast<unsigned char>(text[b])) != 0) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(text[e - 1])) != 0) --e;
  PyInt out;
  if (b < e && (text[b] == '+' || text[b] == '-')) {
    out.negative = text[b] == '-';
    ++b;
  }
  if (b == e) throw fail();
  bool previous_digit = false;
  for (std::size_t i = b; i < e; ++i) {
    const char c = text[i];
    if (c == '_') {
      // Python allows single underscores between digits only.
      if (!previous_digit || i + 1 == e || text[i + 1] < '0' || text[i + 1] > '9') throw fail();
      previous_digit = false;
      continue;
    }
    if (c < '0' || c > '9') throw fail();
    previous_digit = true;
    // magnitude = magnitude * 10 + digit
    std::uint64_t carry = static_cast<std::uint64_t>(c - '0');
    for (auto& w : out.magnitude) {
      const std::uint64_t v = static_cast<std::uint64_t>(w) * 10 + carry;
      w = static_cast<std::uint32_t>(v);
      carry = v >> 32;
    }
    if (carry != 0) out.magnitude.push_back(static_cast<std::uint32_t>(carry));
  }
  if (out.magnitude.empty()) out.negative = false;  // "-0" is 0
  return out;
}

PyInt PyInt::from(std::uint64_t value) {
  PyInt out;
  while (value != 0) {
    out.magnitude.push_back(static_cast<std::uint32_t>(value));
    value >>= 32;
  }
  return out;
}

std::string PyInt::decimal() const {
  if (magnitude.empty()) return "0";
  std::vector<std::uint32_t> words = magnitude;
  std::vector<std::uint32_t> groups;  // base 10^9 digits, least significant first
  while (!words.empty()) {
    std::uint64_t rem = 0;
    for (std::size_t i = words.size(); i-- > 0;) {
      const std::uint64_t cur = (rem << 32) | words[i];
      words[i] = static_cast<std::uint32_t>(cur / 1000000000u);
      rem = cur % 1000000000u;
    }
    groups.push_back(static_cast<std::uint32_t>(rem));
    while (!words.empty() && words.back() == 0) words.pop_back();
  }
  std::string s = negative ? "-" : "";
  s += std::to_string(groups.back());
  for (std::size_t i = groups.size() - 1; i-- > 0;) s += fmt::format("{:09d}", groups[i]);
  return s;
}

std::uint64_t PyInt::to_u64() const {
  MODALITIES_CHECK(!negative && magnitude.size() <= 2, "{} does not fit into an unsigned 64-bit integer", decimal());
  std::uint64_t v = 0;
  for (std::size_t i = magnitude.size(); i-- > 0;) v = (v << 32) | magnitude[i];
  return v;
}

// ---------------------------------------------------------------------------
// CPythonRandom: MT19937 as in Modules/_randommodule.c.

namespace {
constexpr std::size_t kN = 624;
constexpr std::size_t kM = 397;
constexpr std::uint32_t kMatrixA = 0x9908b0dfU;
constexpr std::uint32_t kUpperMask = 0x80000000U;
constexpr std::uint32_t kLowerMask = 0x7fffffffU;

std::vector<std::uint32_t> key_of(const std::vector<std::uint32_t>& magnitude) {
  // CPython seeds with abs(seed) split into 32-bit words; 0 becomes [0].
  if (magnitude.empty()) return {0};
  return magnitude;
}
}  // namespace

CPythonRandom::CPythonRandom(std::uint64_t seed) : CPythonRandom(PyInt::from(seed)) {}

CPythonRandom::CPythonRandom(const PyInt& seed) {
  const auto key = key_of(seed.magnitude);
  init_by_array(key);
}

void CPythonRandom::init_genrand(std::uint32_t s) {
  mt_[0] = s;
  for (std::size_t i = 1; i < kN; ++i)
    mt_[i] = 1812433253U * (mt_[i - 1] ^ (mt_[i - 1] >> 30)) + static_cast<std::uint32_t>(i);
  index_ = kN;
}

void CPythonRandom::init_by_array(std::span<const std::uint32_t> key) {
  init_genrand(19650218U);
  std::size_t i = 1;
  std::size_t j = 0;
  for (std::size_t k = std::max(kN, key.size()); k > 0; --k) {
    mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1664525U)) + key[j] + static_cast<std::uint32_t>(j);
    ++i;
    ++j;
    if (i >= kN) {
      mt_[0] = mt_[kN - 1];
      i = 1;
    }
    if (j >= key.size()) j = 0;
  }
  for (std::size_t k = kN - 1; k > 0; --k) {
    mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1566083941U)) - static_cast<std::uint32_t>(i);
    ++i;
    if (i >= kN) {
      mt_[0] = mt_[kN - 1];
      i = 1;
    }
  }
  mt_[0] = 0x80000000U;
  index_ = kN;
}

void CPythonRandom::twist() {
  const auto mag = [](std::uint32_t y) { return (y & 1U) != 0 ? kMatrixA : 0U; };
  std::size_t kk = 0;
  for (; kk < kN - kM; ++kk) {
    const std::uint32_t y = (mt_[kk] & kUpperMask) | (mt_[kk + 1] & kLowerMask);
    mt_[kk] = mt_[kk + kM] ^ (y >> 1) ^ mag(y);
  }
  for (; kk < kN - 1; ++kk) {
    const std::uint32_t y = (mt_[kk] & kUpperMask) | (mt_[kk + 1] & kLowerMask);
    mt_[kk] = mt_[kk + kM - kN] ^ (y >> 1) ^ mag(y);
  }
  const std::uint32_t y = (mt_[kN - 1] & kUpperMask) | (mt_[0] & kLowerMask);
  mt_[kN - 1] = mt_[kM - 1] ^ (y >> 1) ^ mag(y);
  index_ = 0;
}

std::uint32_t CPythonRandom::next_u32() {
  if (index_ >= kN) twist();
  std::uint32_t y = mt_[index_++];
  y ^= (y >> 11);
  y ^= (y << 7) & 0x9d2c5680U;
  y ^= (y << 15) & 0xefc60000U;
  y ^= (y >> 18);
  return y;
}

std::uint64_t CPythonRandom::getrandbits(unsigned k) {
  MODALITIES_CHECK(k <= 64, "getrandbits({}) is limited to 64 bits here", k);
  if (k == 0) return 0;
  if (k <= 32) return next_u32() >> (32 - k);
  // Words from least to most significant; the last (partial) word keeps its top bits.
  const std::uint64_t low = next_u32();
  const std::uint64_t high = next_u32() >> (64 - k);
  return low | (high << 32);
}

std::uint64_t CPythonRandom::randbelow(std::uint64_t n) {
  MODALITIES_CHECK(n > 0, "randbelow needs n >= 1");
  const unsigned k = static_cast<unsigned>(std::bit_width(n));
  std::uint64_t r = getrandbits(k);
  while (r >= n) r = getrandbits(k);
  return r;
}

double CPythonRandom::random() {
  const std::uint32_t a = next_u32() >> 5;
  const std::uint32_t b = next_u32() >> 6;
  return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0);
}

std::size_t CPythonRandom::choice(std::span<const double> weights) {
  MODALITIES_CHECK(!weights.empty(), "choices needs at least one weight");
  std::vector<double> cumulative(weights.size());
  double sum = 0.0;
  for (std::size_t i = 0; i < weights.size(); ++i) cumulative[i] = sum += weights[i];
  const double total = cumulative.back() + 0.0;
  MODALITIES_CHECK(total > 0.0, "the total of the weights must be greater than zero, got {}", total);
  MODALITIES_CHECK(std::isfinite(total), "the total of the weights must be finite, got {}", total);
  const double x = random() * total;
  // bisect_right(cumulative, x, 0, hi=len-1)
  const auto hi = cumulative.begin() + static_cast<std::ptrdiff_t>(cumulative.size() - 1);
  return static_cast<std::size_t>(std::upper_bound(cumulative.begin(), hi, x) - cumulative.begin());
}

// ---------------------------------------------------------------------------
// NumpyRandom: numpy/random/bit_generator.pyx (SeedSequence) and
// numpy/random/src/pcg64 (PCG64), numpy/random/src/distributions (random_interval).

namespace {
constexpr std::uint32_t kInitA = 0x43b0d7e5U;
constexpr std::uint32_t kMultA = 0x931e8875U;
constexpr std::uint32_t kInitB = 0x8b51f9ddU;
constexpr std::uint32_t kMultB = 0x58f38dedU;
constexpr std::uint32_t kMixMultL = 0xca01f9ddU;
constexpr std::uint32_t kMixMultR = 0x4973f715U;
constexpr unsigned kXShift = 16;
constexpr std::size_t kPoolSize = 4;

std::uint32_t hashmix(std::uint32_t value, std::uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> kXShift;
  return value;
}

std::uint32_t mix(std::uint32_t x, std::uint32_t y) {
  std::uint32_t r = kMixMultL * x - kMixMultR * y;
  r ^= r >> kXShift;
  return r;
}

constexpr unsigned __int128 kPcgMultiplier =
    (static_cast<unsigned __int128>(0x2360ED051FC65DA4ULL) << 64) | 0x4385DF649FCCF645ULL;
}  // namespace

std::array<std::uint64_t, 4> NumpyRandom::seed_sequence_state(std::span<const std::uint32_t> entropy) {
  std::array<std::uint32_t, kPoolSize> pool{};
  std::uint32_t hash_const = kInitA;
  for (std::size_t i = 0; i < kPoolSize; ++i) pool[i] = hashmix(i < entropy.size() ? entropy[i] : 0U, hash_const);
  for (std::size_t src = 0; src < kPoolSize; ++src)
    for (std::size_t dst = 0; dst < kPoolSize; ++dst)
      if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src], hash_const));
  for (std::size_t src = kPoolSize; src < entropy.size(); ++src)
    for (std::size_t dst = 0; dst < kPoolSize; ++dst) pool[dst] = mix(pool[dst], hashmix(entropy[src], hash_const));

  // generate_state(4, uint64): 8 uint32 words viewed as 4 little-endian uint64.
  std::array<std::uint32_t, 8> words{};
  std::uint32_t h = kInitB;
  for (std::size_t i = 0; i < words.size(); ++i) {
    std::uint32_t v = pool[i % kPoolSize] ^ h;
    h *= kMultB;
    v *= h;
    v ^= v >> kXShift;
    words[i] = v;
  }
  std::array<std::uint64_t, 4> out{};
  for (std::size_t k = 0; k < out.size(); ++k)
    out[k] = static_cast<std::uint64_t>(words[2 * k]) | (static_cast<std::uint64_t>(words[2 * k + 1]) << 32);
  return out;
}

NumpyRandom::NumpyRandom(std::uint64_t seed) : NumpyRandom(PyInt::from(seed)) {}

NumpyRandom::NumpyRandom(const PyInt& seed) {
  MODALITIES_CHECK(!seed.negative, "numpy seeds must be non-negative, got {}", seed.decimal());
  const auto key = key_of(seed.magnitude);
  seed_state(seed_sequence_state(key));
}

NumpyRandom::NumpyRandom(std::span<const std::uint32_t> entropy) {
  const std::vector<std::uint32_t> key =
      entropy.empty() ? std::vector<std::uint32_t>{0} : std::vector<std::uint32_t>(entropy.begin(), entropy.end());
  seed_state(seed_sequence_state(key));
}

void NumpyRandom::seed_state(const std::array<std::uint64_t, 4>& s) {
  // pcg64_set_seed: seed = (s[0] << 64) | s[1], inc = (s[2] << 64) | s[3];
  // pcg_setseq_128_srandom_r: state = 0, inc = 2*initseq + 1, step, state += initstate, step.
  const unsigned __int128 initstate = (static_cast<unsigned __int128>(s[0]) << 64) | s[1];
  const unsigned __int128 initseq = (static_cast<unsigned __int128>(s[2]) << 64) | s[3];
  state_ = 0;
  inc_ = (initseq << 1) | 1U;
  step();
  state_ += initstate;
  step();
  has_u32_ = false;
}

void NumpyRandom::step() { state_ = state_ * kPcgMultiplier + inc_; }

std::uint64_t NumpyRandom::next64() {
  step();
  const auto hi = static_cast<std::uint64_t>(state_ >> 64);
  const auto lo = static_cast<std::uint64_t>(state_);
  const auto rot = static_cast<int>(state_ >> 122);
  return std::rotr(hi ^ lo, rot);
}

std::uint32_t NumpyRandom::next32() {
  if (has_u32_) {
    has_u32_ = false;
    return u32_;
  }
  const std::uint64_t v = next64();
  has_u32_ = true;
  u32_ = static_cast<std::uint32_t>(v >> 32);
  return static_cast<std::uint32_t>(v);
}

std::uint64_t NumpyRandom::bounded(std::uint64_t max) {
  if (max == 0) return 0;
  std::uint64_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  std::uint64_t v = 0;
  if (max <= 0xffffffffULL) {
    while ((v = (next32() & mask)) > max) {
    }
  } else {
    while ((v = (next64() & mask)) > max) {
    }
  }
  return v;
}

}  // namespace modalities::core::data
