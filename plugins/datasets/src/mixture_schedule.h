// The arithmetic behind `dataset/weighted_mixture`: which source and which
// local sample each global mixture position g reads. Everything is a pure
// function of (weights, source sizes, length, seed, g): no state, no caches,
// so a run resumes at any sample and loader workers share one instance.
// Header-only and LibTorch-free so the tests can exercise it directly.
//
// Note [Mixture order]
// Interleaving: source j's t-th draw (t = 0, 1, ...) gets the key
// (2t + 1) / w_j, the Sainte-Lague (Webster) divisor sequence; the mixture is
// all keys in increasing order, ties broken by source index. Over every
// prefix of length m, source j has then been drawn round(m * p_j) times up to
// a bounded error (< 1 for two sources; measured < 2 for up to 8 skewed
// sources in the tests), and the sequence is spread as evenly as possible
// ("smooth" round robin). Position g is found by counting keys: rank(j, t) =
// t + sum over i != j of #{t' : key(i, t') before key(j, t)}, an O(k) integer
// formula, and the t with rank(j, t) == g lies within a few draws of g * p_j.
// Weights are converted exactly from their double values into integers
// (a double is m * 2^e), so no floating-point rounding enters the order.
//
// Local index: draw t of source j (size n_j) is in pass t / n_j at position
// t mod n_j; with shuffling, a keyed Feistel permutation of [0, n_j), keyed by
// (seed, j, pass), maps that position to the local sample, so every pass
// visits each sample exactly once, in a different order per pass.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace modalities::plugins::datasets {

using i128 = __int128;

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// A keyed pseudorandom permutation of [0, n): a balanced 6-round Feistel
/// network on the smallest even number of bits covering n, with cycle
/// walking back into range (expected < 4 steps). O(1) memory and time per
/// lookup, unlike a materialised randperm of a billion-sample source.
class KeyedPermutation {
 public:
  KeyedPermutation(std::uint64_t n, std::uint64_t key) : n_(n), key_(splitmix64(key)) {
    int bits = 2;
    while (bits < 64 && (std::uint64_t{1} << bits) < n) bits += 2;
    half_ = bits / 2;
    mask_ = (std::uint64_t{1} << half_) - 1;
  }
  std::uint64_t operator()(std::uint64_t i) const {
    if (n_ <= 1) return 0;
    std::uint64_t x = i;
    do x = encrypt(x);
    while (x >= n_);
    return x;
  }

 private:
  std::uint64_t encrypt(std::uint64_t x) const {
    std::uint64_t l = x >> half_, r = x & mask_;
    for (std::uint64_t round = 0; round < 6; ++round) {
      const std::uint64_t f = splitmix64(key_ ^ (round * 0x632be59bd9b4e019ULL) ^ r) & mask_;
      const std::uint64_t next = l ^ f;
      l = r;
      r = next;
    }
    return (l << half_) | r;
  }
  std::uint64_t n_, key_;
  int half_ = 1;
  std::uint64_t mask_ = 1;
};

/// Exact integer weights proportional to the given non-negative doubles.
/// Throws std::invalid_argument naming the offending index.
inline std::vector<i128> exact_integer_weights(const std::vector<double>& weights) {
  std::vector<std::pair<std::uint64_t, int>> parts;  // w = m * 2^e, m odd
  int emin = std::numeric_limits<int>::max();
  for (std::size_t i = 0; i < weights.size(); ++i) {
    const double w = weights[i];
    if (!std::isfinite(w) || w < 0)
      throw std::invalid_argument("weights[" + std::to_string(i) + "]: must be finite and >= 0");
    if (w == 0) {
      parts.emplace_back(0, 0);
      continue;
    }
    int e = 0;
    const double f = std::frexp(w, &e);
    auto m = static_cast<std::uint64_t>(std::ldexp(f, 53));
    e -= 53;
    while ((m & 1) == 0) {
      m >>= 1;
      ++e;
    }
    parts.emplace_back(m, e);
    emin = std::min(emin, e);
  }
  std::vector<i128> out;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const auto [m, e] = parts[i];
    if (m == 0) {
      out.push_back(0);
      continue;
    }
    const int shift = e - emin;
    const int bits = 64 - __builtin_clzll(m);
    if (shift + bits > 80)
      throw std::invalid_argument("weights[" + std::to_string(i) +
                                  "]: the weights span too many orders of magnitude to be compared exactly");
    out.push_back(static_cast<i128>(m) << shift);
  }
  return out;
}

class MixtureSchedule {
 public:
  static constexpr std::int64_t kMaxSamples = std::int64_t{1} << 40;

  /// `sizes[j]` = number of samples of source j. `num_samples` = mixture length,
  /// or the longest mixture that repeats no sample when absent.
  MixtureSchedule(const std::vector<double>& weights, std::vector<std::int64_t> sizes,
                  std::optional<std::int64_t> num_samples, std::uint64_t seed, bool shuffle)
      : w_(exact_integer_weights(weights)), sizes_(std::move(sizes)), seed_(seed), shuffle_(shuffle) {
    if (w_.size() != sizes_.size()) throw std::invalid_argument("weights: one weight per dataset expected");
    for (std::size_t j = 0; j < w_.size(); ++j) {
      if (w_[j] == 0) continue;
      if (sizes_[j] <= 0)
        throw std::invalid_argument("datasets[" + std::to_string(j) + "]: is empty but has a positive weight");
      active_.push_back(j);
      total_ += w_[j];
    }
    if (active_.empty()) throw std::invalid_argument("weights: at least one weight must be positive");
    if (num_samples) {
      if (*num_samples < 0 || *num_samples > kMaxSamples)
        throw std::invalid_argument("num_samples: must be in [0, 2^40]");
      size_ = *num_samples;
    } else {
      size_ = largest_without_repetition();
    }
  }

  std::int64_t size() const { return size_; }
  std::size_t num_sources() const { return w_.size(); }

  /// (source j, draw number t) of global position g in [0, size()).
  std::pair<std::size_t, std::int64_t> locate(std::int64_t g) const {
    // Fast path: the answer's t is within a few draws of g * p_j (see Note [Mixture order]).
    for (std::size_t j : active_) {
      const double p = static_cast<double>(w_[j]) / static_cast<double>(total_);
      const auto guess = static_cast<std::int64_t>(std::floor(static_cast<double>(g) * p));
      for (std::int64_t t = std::max<std::int64_t>(0, guess - 3); t <= guess + 3; ++t) {
        const std::int64_t r = rank(j, t);
        if (r == g) return {j, t};
        if (r > g) break;
      }
    }
    // Exact fallback: rank(j, .) is strictly increasing; binary search each source.
    for (std::size_t j : active_) {
      std::int64_t lo = 0, hi = g;
      while (lo <= hi) {
        const std::int64_t mid = lo + (hi - lo) / 2;
        const std::int64_t r = rank(j, mid);
        if (r == g) return {j, mid};
        if (r < g) lo = mid + 1;
        else hi = mid - 1;
      }
    }
    throw std::logic_error("weighted mixture: no source found for position " + std::to_string(g));
  }

  /// Local sample index in source j of its t-th draw.
  std::int64_t local_index(std::size_t j, std::int64_t t) const {
    const auto n = static_cast<std::uint64_t>(sizes_[j]);
    const std::uint64_t pass = static_cast<std::uint64_t>(t) / n, pos = static_cast<std::uint64_t>(t) % n;
    if (!shuffle_) return static_cast<std::int64_t>(pos);
    const std::uint64_t key = splitmix64(splitmix64(splitmix64(seed_) ^ j) ^ pass);
    return static_cast<std::int64_t>(KeyedPermutation(n, key)(pos));
  }

  /// (source, local index) of global position g.
  std::pair<std::size_t, std::int64_t> at(std::int64_t g) const {
    const auto [j, t] = locate(g);
    return {j, local_index(j, t)};
  }

  /// Draws per source among the first m positions.
  std::vector<std::int64_t> counts(std::int64_t m) const {
    std::vector<std::int64_t> c(w_.size(), 0);
    if (m <= 0) return c;
    const auto [j, t] = locate(m - 1);
    for (std::size_t i : active_) c[i] = i == j ? t + 1 : before(i, j, t);
    return c;
  }

 private:
  // Number of draws of source i ordered before draw t of source j (i != j).
  std::int64_t before(std::size_t i, std::size_t j, std::int64_t t) const {
    // key(i, t') < key(j, t)  <=>  (2t'+1) * w_j < (2t+1) * w_i = a; ties count when i < j.
    const i128 a = (2 * static_cast<i128>(t) + 1) * w_[i];
    const i128 wj = w_[j];
    if (i < j) {
      const i128 f = a / wj;  // odd o <= f
      return static_cast<std::int64_t>((f + 1) / 2);
    }
    const i128 c = (a + wj - 1) / wj;  // odd o <= c - 1
    return static_cast<std::int64_t>(c / 2);
  }
  std::int64_t rank(std::size_t j, std::int64_t t) const {
    std::int64_t r = t;
    for (std::size_t i : active_)
      if (i != j) r += before(i, j, t);
    return r;
  }

  // The (n_j + 1)-th draw of source j would repeat a sample; the longest
  // mixture without repetition ends just before the first such draw.
  std::int64_t largest_without_repetition() const {
    std::int64_t out = kMaxSamples;
    for (std::size_t j : active_) out = std::min(out, rank(j, std::min(sizes_[j], kMaxSamples)));
    return out;
  }

  std::vector<i128> w_;
  std::vector<std::int64_t> sizes_;
  std::vector<std::size_t> active_;
  i128 total_ = 0;
  std::int64_t size_ = 0;
  std::uint64_t seed_;
  bool shuffle_;
};

}  // namespace modalities::plugins::datasets
