// modalities/sdk/collectives.h on 3 Gloo ranks: every rank draws the same tensors of every rank
// (same seed), so it knows what each rank sends and can check what it receives, and the
// gradients the backward sends back, exactly (all-to-all moves rows; it adds nothing).
#include "worker_case.h"

#include <modalities/sdk/collectives.h>
#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace modalities {
namespace {

struct Runtime {
  Runtime() {
    dist::RuntimeOptions o;
    o.backend = "gloo";
    o.timeout = std::chrono::seconds(30);
    dist::init(dist::launch_env(), o);
  }
  ~Runtime() { dist::shutdown(); }
};

// Rows rank `from` sends to rank `to`: uneven, and none from rank 0 or rank 2 to itself.
std::int64_t rows(int from, int to) { return (from + 2 * to) % 3 + (from == 1 ? 1 : 0); }

std::vector<std::int64_t> send_of(int r, int n) {
  std::vector<std::int64_t> s;
  for (int j = 0; j < n; ++j) s.push_back(rows(r, j));
  return s;
}

std::vector<std::int64_t> recv_of(int r, int n) {
  std::vector<std::int64_t> s;
  for (int i = 0; i < n; ++i) s.push_back(rows(i, r));
  return s;
}

std::int64_t sum(const std::vector<std::int64_t>& v) {
  std::int64_t t = 0;
  for (const std::int64_t x : v) t += x;
  return t;
}

MODALITIES_WORKER_CASE(CollectivesWorker, AllToAllRowsMovesRowsAndTheirGradientsBack) {
  const Runtime runtime;
  const auto g = dist::world();
  const int r = dist::rank(), n = dist::world_size();
  ASSERT_EQ(n, 3);
  // Every rank's input rows and its loss weights, known to all.
  std::vector<at::Tensor> x, c;
  at::manual_seed(11);
  for (int i = 0; i < n; ++i) x.push_back(at::randn({sum(send_of(i, n)), 4}));
  for (int i = 0; i < n; ++i) c.push_back(at::randn({sum(recv_of(i, n)), 4}));
  const at::Tensor mine = x[static_cast<std::size_t>(r)].clone().requires_grad_(true);
  const at::Tensor got = dist::all_to_all_rows(mine, send_of(r, n), recv_of(r, n), g);
  // What arrives: rank i's block for r, i = 0, 1, 2.
  std::vector<at::Tensor> want;
  for (int i = 0; i < n; ++i) {
    std::int64_t offset = 0;
    for (int j = 0; j < r; ++j) offset += rows(i, j);
    want.push_back(x[static_cast<std::size_t>(i)].narrow(0, offset, rows(i, r)));
  }
  EXPECT_TRUE(at::equal(got.detach(), at::cat(want, 0))) << "rank " << r;
  // Backward: d/d mine of sum_j sum(got_j * c_j): the rows mine sent to j get j's weights.
  (got * c[static_cast<std::size_t>(r)]).sum().backward();
  std::vector<at::Tensor> grad;
  for (int j = 0; j < n; ++j) {
    std::int64_t offset = 0;
    for (int i = 0; i < r; ++i) offset += rows(i, j);
    grad.push_back(c[static_cast<std::size_t>(j)].narrow(0, offset, rows(r, j)));
  }
  EXPECT_TRUE(at::equal(mine.grad(), at::cat(grad, 0))) << "rank " << r;
  // There and back: the same rows in the same order.
  const at::Tensor back = dist::all_to_all_rows(got.detach(), recv_of(r, n), send_of(r, n), g);
  EXPECT_TRUE(at::equal(back, x[static_cast<std::size_t>(r)]));
  // Counts: block j of rank i's tensor reaches rank j as its block i.
  at::Tensor counts = at::empty({n * 2}, at::kLong);
  for (int j = 0; j < n; ++j) {
    counts[2 * j] = rows(r, j);
    counts[2 * j + 1] = 100 * r + j;
  }
  const at::Tensor in = dist::exchange_counts(counts, g);
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(in[2 * i].item<std::int64_t>(), rows(i, r));
    EXPECT_EQ(in[2 * i + 1].item<std::int64_t>(), 100 * i + r);
  }
  // Bad sizes are errors before anything is sent (every rank throws alike).
  EXPECT_THROW(dist::all_to_all_rows(mine, {1, 2}, recv_of(r, n), g), Error);
  EXPECT_THROW(dist::all_to_all_rows(mine.narrow(0, 0, 0), send_of(r, n), recv_of(r, n), g), Error);
  EXPECT_THROW(dist::exchange_counts(at::zeros({4}, at::kLong), g), Error);
}

// A rank whose loss ignores the rows it received still takes part in the backward, so the others'
// backward completes, and the rows they sent it get a zero gradient.
MODALITIES_WORKER_CASE(CollectivesWorker, ARankWhoseLossIgnoresTheRowsStillTakesPart) {
  const Runtime runtime;
  const auto g = dist::world();
  const int r = dist::rank(), n = dist::world_size();
  const at::Tensor mine = at::ones({sum(send_of(r, n)), 2}).requires_grad_(true);
  const at::Tensor got = dist::all_to_all_rows(mine, send_of(r, n), recv_of(r, n), g);
  // Rank 1's loss uses none of the rows: the gradient it sends back is zeros.
  const at::Tensor loss = r == 1 ? got.narrow(0, 0, 0).sum() : got.sum();
  loss.backward();
  // mine's rows sent to rank 1 get 0, the others 1.
  std::int64_t offset = 0;
  for (int j = 0; j < n; ++j) {
    const at::Tensor block = mine.grad().narrow(0, offset, rows(r, j));
    EXPECT_TRUE(at::equal(block, at::full_like(block, j == 1 ? 0.0 : 1.0))) << "to rank " << j;
    offset += rows(r, j);
  }
}

void run(const std::string& name) {
  testing::expect_workers_pass(
      testing::run_workers(MODALITIES_TEST_HOST_BINARY, 3, "CollectivesWorker." + name, {}, 120), 3);
}

TEST(AllToAllRowsTest, MovesRowsAndTheirGradientsBackOnThreeRanks) {
  run("AllToAllRowsMovesRowsAndTheirGradientsBack");
}
TEST(AllToAllRowsTest, ARankWhoseLossIgnoresTheRowsStillTakesPartInTheBackward) {
  run("ARankWhoseLossIgnoresTheRowsStillTakesPart");
}

// One process: the identity (same tensor, graph kept); send and recv must agree.
TEST(AllToAllRowsTest, WithoutAGroupEveryRowStays) {
  const at::Tensor x = at::randn({5, 3}).requires_grad_(true);
  const c10::intrusive_ptr<c10d::ProcessGroup> none;
  EXPECT_TRUE(dist::all_to_all_rows(x, {5}, {5}, none).is_same(x));
  EXPECT_THROW(dist::all_to_all_rows(x, {5}, {4}, none), Error);
  EXPECT_THROW(dist::all_to_all_rows(x, {4}, {4}, none), Error);
  const at::Tensor counts = at::arange(4, at::kLong);
  EXPECT_TRUE(dist::exchange_counts(counts, none).is_same(counts));
}

}  // namespace
}  // namespace modalities
