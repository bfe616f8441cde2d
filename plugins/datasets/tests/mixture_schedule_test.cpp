// The weighted-mixture arithmetic (src/mixture_schedule.h) checked directly:
// positions map one-to-one onto (source, draw) in the order of the divisor
// keys (2t+1)/w_j, every prefix is close to its quota, passes over an
// oversampled source are permutations, and everything is a pure function of
// the configuration.
#include "../src/mixture_schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <tuple>

namespace modalities::plugins::datasets {
namespace {

// The schedule by brute force: sort all keys (2t+1)/w_j, ties by source index.
std::vector<std::size_t> brute_force_sources(const std::vector<double>& w, std::int64_t m) {
  std::vector<std::tuple<long double, std::size_t>> keys;
  for (std::size_t j = 0; j < w.size(); ++j)
    if (w[j] > 0)
      for (std::int64_t t = 0; t <= m; ++t) keys.emplace_back((2.0L * t + 1) / w[j], j);
  std::sort(keys.begin(), keys.end());
  std::vector<std::size_t> out;
  for (std::int64_t g = 0; g < m; ++g) out.push_back(std::get<1>(keys[g]));
  return out;
}

TEST(MixtureScheduleTest, MatchesTheSortedDivisorKeys) {
  // Integer weights keep the long-double keys exact, so sorting is a valid reference.
  for (const auto& w :
       std::vector<std::vector<double>>{{1, 1}, {1, 3}, {2, 3, 5}, {7, 1, 1, 1}, {1, 0, 4}, {13, 8, 5, 3, 2, 1, 1}}) {
    const std::int64_t m = 600;
    MixtureSchedule s(w, std::vector<std::int64_t>(w.size(), 1000), m, 0, false);
    const auto expected = brute_force_sources(w, m);
    std::vector<std::int64_t> draws(w.size(), 0);
    for (std::int64_t g = 0; g < m; ++g) {
      const auto [j, t] = s.locate(g);
      ASSERT_EQ(j, expected[g]) << "position " << g;
      ASSERT_EQ(t, draws[j]++) << "draws of a source come in order";
    }
  }
}

TEST(MixtureScheduleTest, EveryPrefixStaysCloseToItsQuota) {
  std::mt19937_64 rng(7);
  double worst = 0, worst_two = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const std::size_t k = 2 + trial % 7;
    std::vector<double> w(k);
    // Skewed, non-dyadic weights in [e^-4, e^2]; uniform doubles from raw bits (portable across libraries).
    for (auto& x : w) x = std::exp(-4.0 + 6.0 * static_cast<double>(rng() >> 11) * 0x1p-53);
    const double total = [&] {
      double s = 0;
      for (double x : w) s += x;
      return s;
    }();
    const std::int64_t m = 3000;
    MixtureSchedule s(w, std::vector<std::int64_t>(k, 1 << 20), m, 1, true);
    std::vector<std::int64_t> c(k, 0);
    for (std::int64_t g = 0; g < m; ++g) {
      const auto [j, t] = s.locate(g);
      ASSERT_EQ(t, c[j]);
      ++c[j];
      for (std::size_t i = 0; i < k; ++i) {
        const double dev = std::abs(static_cast<double>(c[i]) - static_cast<double>(g + 1) * w[i] / total);
        worst = std::max(worst, dev);
        if (k == 2) worst_two = std::max(worst_two, dev);
      }
    }
    EXPECT_EQ(s.counts(m), c);
    EXPECT_EQ(s.counts(1234), [&] {
      std::vector<std::int64_t> d(k, 0);
      for (std::int64_t g = 0; g < 1234; ++g) ++d[s.locate(g).first];
      return d;
    }());
  }
  EXPECT_LT(worst_two, 1.0);
  EXPECT_LT(worst, 2.0);
  std::printf("max |count - m * p| over all prefixes: %.3f (two sources: %.3f)\n", worst, worst_two);
}

TEST(MixtureScheduleTest, LocatesFarPositionsAndLargeSkews) {
  // A 1:10^6 skew and positions near 2^40: the fast path or the exact fallback must find them.
  MixtureSchedule s({1e-6, 1.0}, {1000, std::int64_t{1} << 40}, std::int64_t{1} << 40, 3, true);
  for (std::int64_t g : {std::int64_t{0}, std::int64_t{499999}, std::int64_t{500000}, std::int64_t{1} << 39,
                         (std::int64_t{1} << 40) - 1}) {
    const auto [j, t] = s.locate(g);
    const auto c = s.counts(g + 1);
    EXPECT_EQ(c[0] + c[1], g + 1);
    EXPECT_EQ(c[j], t + 1);
  }
  // The rare source is drawn once per 10^6 positions, first at the middle of its slot.
  EXPECT_EQ(s.locate(500000).first, 0u);
  EXPECT_EQ(s.counts(500000)[0], 0);
}

TEST(MixtureScheduleTest, ExactWeightsIgnoreCommonScaling) {
  MixtureSchedule a({1, 2, 7}, {50, 50, 50}, 300, 5, true), b({0.5, 1, 3.5}, {50, 50, 50}, 300, 5, true);
  for (std::int64_t g = 0; g < 300; ++g) ASSERT_EQ(a.at(g), b.at(g)) << g;
}

TEST(MixtureScheduleTest, OversampledSourcesCycleThroughNewPermutations) {
  const std::int64_t n = 17;
  MixtureSchedule s({1, 1}, {n, 1000}, 200, 11, true);  // 100 draws of a 17-sample source
  std::vector<std::int64_t> locals;
  for (std::int64_t g = 0; g < 200; ++g)
    if (auto [j, local] = s.at(g); j == 0) locals.push_back(local);
  ASSERT_EQ(locals.size(), 100u);
  std::set<std::vector<std::int64_t>> orders;
  for (std::size_t pass = 0; pass + 1 <= locals.size() / n; ++pass) {
    std::vector<std::int64_t> order(locals.begin() + pass * n, locals.begin() + (pass + 1) * n);
    std::vector<std::int64_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[i], i) << "pass " << pass << " is not a permutation";
    orders.insert(order);
  }
  EXPECT_EQ(orders.size(), 5u) << "each pass should have its own order";
  // Without shuffling, passes read the source in order.
  MixtureSchedule plain({1, 1}, {n, 1000}, 200, 11, false);
  std::int64_t expected = 0;
  for (std::int64_t g = 0; g < 200; ++g) {
    if (auto [j, local] = plain.at(g); j == 0) {
      EXPECT_EQ(local, expected++ % n);
    }
  }
}

TEST(MixtureScheduleTest, IsAPureFunctionOfConfigAndSeed) {
  MixtureSchedule a({0.3, 0.7}, {100, 100}, 250, 1, true), b({0.3, 0.7}, {100, 100}, 250, 1, true),
      c({0.3, 0.7}, {100, 100}, 250, 2, true);
  bool differs = false;
  for (std::int64_t g = 249; g >= 0; --g) {  // any access order
    ASSERT_EQ(a.at(g), b.at(g));
    differs = differs || a.at(g) != c.at(g);
    EXPECT_EQ(a.locate(g), c.locate(g)) << "the interleaving does not depend on the seed";
  }
  EXPECT_TRUE(differs) << "the seed should change the local order";
}

TEST(MixtureScheduleTest, DefaultLengthRepeatsNoSample) {
  MixtureSchedule s({1, 1}, {100, 1000}, std::nullopt, 0, true);
  EXPECT_EQ(s.size(), 200);
  EXPECT_EQ(s.counts(200), (std::vector<std::int64_t>{100, 100}));
  MixtureSchedule skew({1, 3}, {31, 1300}, std::nullopt, 0, true);
  EXPECT_EQ(skew.size(), 125);  // the 32nd draw of source 0 has key 63 = (2 * 94 + 1) / 3, after 94 draws of source 1
  EXPECT_EQ(skew.counts(125)[0], 31);
  EXPECT_EQ(skew.counts(126)[0], 32);
}

TEST(MixtureScheduleTest, RejectsBadArguments) {
  EXPECT_THROW(MixtureSchedule({1, -1}, {1, 1}, 1, 0, true), std::invalid_argument);
  EXPECT_THROW(MixtureSchedule({0, 0}, {1, 1}, 1, 0, true), std::invalid_argument);
  EXPECT_THROW(MixtureSchedule({1, 1}, {1, 0}, 1, 0, true), std::invalid_argument);
  EXPECT_THROW(MixtureSchedule({1e-30, 1e30}, {1, 1}, 1, 0, true), std::invalid_argument);
  EXPECT_NO_THROW(MixtureSchedule({0, 1}, {0, 1}, 1, 0, true));  // an empty source with weight 0 is fine
}

TEST(KeyedPermutationTest, IsABijection) {
  for (std::uint64_t n : {1ULL, 2ULL, 3ULL, 5ULL, 17ULL, 1000ULL, 4097ULL}) {
    KeyedPermutation p(n, 99);
    std::vector<bool> hit(n, false);
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint64_t x = p(i);
      ASSERT_LT(x, n);
      ASSERT_FALSE(hit[x]) << "n " << n << " value " << x << " twice";
      hit[x] = true;
    }
  }
}

}  // namespace
}  // namespace modalities::plugins::datasets
