// modalities/sdk/tensor_parallel.h on 2 Gloo ranks against the same computation in one process:
// every rank draws the same full tensors (same seed), runs the parallel version on its shards and
// compares values and gradients with the unsplit computation's (its own rows/columns of them).
// Sums over the split dimension are added in another order, hence 1e-6 relative (+1e-7).
#include "worker_case.h"

#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/tensor_parallel.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <string>

namespace modalities {
namespace {

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got - want).abs().max().item<double>();
  EXPECT_LE(err, 1e-6 * want.abs().max().item<double>() + 1e-7) << what << ": max |difference| " << err;
}

struct TpRuntime {
  TpRuntime() {
    dist::RuntimeOptions o;
    o.backend = "gloo";
    o.timeout = std::chrono::seconds(30);
    dist::init(dist::launch_env(), o);
  }
  ~TpRuntime() { dist::shutdown(); }
};

at::Tensor leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

// A column-parallel then row-parallel MLP (Megatron's f and g), plain and with sequence
// parallelism (activations split on the sequence dim outside the parallel region).
MODALITIES_WORKER_CASE(TpWorker, ColumnThenRowParallelMlpWithAndWithoutSequenceParallel) {
  const TpRuntime runtime;
  const tp::Group g = dist::world();
  const int r = dist::rank(), n = dist::world_size();
  at::manual_seed(3);
  const at::Tensor x0 = at::randn({2, 8, 6}), w1_0 = at::randn({10, 6}), w2_0 = at::randn({6, 10}),
                   c = at::randn({2, 8, 6});
  // One process.
  const at::Tensor x = leaf(x0), w1 = leaf(w1_0), w2 = leaf(w2_0);
  const at::Tensor y = at::matmul(at::tanh(at::matmul(x, w1.t())), w2.t());
  (y * c).sum().backward();
  // Tensor parallel: W1 split on rows (column-parallel), W2 on columns (row-parallel).
  for (const bool sequence_parallel : {false, true}) {
    const std::string what = sequence_parallel ? "sequence parallel" : "tensor parallel";
    const at::Tensor w1_local = leaf(w1_0.chunk(n, 0)[r]), w2_local = leaf(w2_0.chunk(n, 1)[r]);
    const at::Tensor x_in = sequence_parallel ? leaf(x0.chunk(n, 1)[r]) : leaf(x0);
    const at::Tensor full = sequence_parallel ? tp::gather_sequence(x_in, 1, g) : tp::copy_to_tensor_parallel(x_in, g);
    const at::Tensor partial = at::matmul(at::tanh(at::matmul(full, w1_local.t())), w2_local.t());
    const at::Tensor out =
        sequence_parallel ? tp::reduce_scatter_sequence(partial, 1, g) : tp::reduce_from_tensor_parallel(partial, g);
    const at::Tensor c_mine = sequence_parallel ? c.chunk(n, 1)[r] : c;
    // Each rank back-propagates the loss of what it holds: the whole output (Megatron's way: the
    // row-parallel sum's backward passes the gradient as is) or its chunk of the sequence.
    (out * c_mine).sum().backward();
    expect_close(out.detach(), sequence_parallel ? y.detach().chunk(n, 1)[r] : y.detach(), what + ": output");
    expect_close(w1_local.grad(), w1.grad().chunk(n, 0)[r], what + ": W1 gradient");
    expect_close(w2_local.grad(), w2.grad().chunk(n, 1)[r], what + ": W2 gradient");
    // The input gradient: whole on every rank, or this rank's chunk of the sequence.
    expect_close(x_in.grad(), sequence_parallel ? x.grad().chunk(n, 1)[r] : x.grad(), what + ": input gradient");
  }
}

MODALITIES_WORKER_CASE(TpWorker, SplitAndGatherAreEachOthersConjugates) {
  const TpRuntime runtime;
  const tp::Group g = dist::world();
  const int r = dist::rank(), n = dist::world_size();
  at::manual_seed(4);
  const at::Tensor a0 = at::randn({4, 6}), c = at::randn({4, 6});
  const at::Tensor a = leaf(a0);
  const at::Tensor mine = tp::split_to_tensor_parallel(a, -1, g);
  EXPECT_TRUE(at::equal(mine.detach(), a0.chunk(n, 1)[r]));
  const at::Tensor back = tp::gather_from_tensor_parallel(mine * 2, -1, g);
  EXPECT_TRUE(at::equal(back.detach(), a0 * 2));
  (back * c).sum().backward();
  // d/da of sum(gather(2 split(a)) c) is 2c, gathered from every rank's columns.
  EXPECT_TRUE(at::equal(a.grad(), c * 2));
  // Sizes that do not divide are errors, not silent truncation.
  EXPECT_THROW(tp::split_to_tensor_parallel(at::randn({3, 5}), 1, g), Error);
}

MODALITIES_WORKER_CASE(TpWorker, VocabParallelCrossEntropyMatchesCrossEntropy) {
  const TpRuntime runtime;
  const tp::Group g = dist::world();
  const int r = dist::rank(), n = dist::world_size();
  at::manual_seed(5);
  const std::int64_t N = 12, V = 16;
  const at::Tensor logits0 = at::randn({N, V}) * 4;
  at::Tensor target = at::randint(0, V, {N}, at::kLong);
  target[3] = -100;  // ignored rows count nothing
  target[7] = -100;
  const at::Tensor full = leaf(logits0);
  const at::Tensor want = at::cross_entropy_loss(full, target, {}, at::Reduction::None, -100);
  at::cross_entropy_loss(full, target, {}, at::Reduction::Mean, -100).backward();
  const at::Tensor local = leaf(logits0.chunk(n, 1)[r]);
  const at::Tensor got = tp::vocab_parallel_cross_entropy(local, target, r * (V / n), g);
  expect_close(got.detach(), want.detach(), "per-row loss");
  const at::Tensor valid = (target != -100).to(at::kFloat);
  ((got * valid).sum() / valid.sum()).backward();
  expect_close(local.grad(), full.grad().chunk(n, 1)[r], "logit gradient");
}

void run(const std::string& name) {
  testing::expect_workers_pass(testing::run_workers(MODALITIES_TEST_HOST_BINARY, 2, "TpWorker." + name, {}, 120), 2);
}

TEST(TensorParallelTest, ColumnThenRowParallelMlpMatchesOneProcessWithAndWithoutSequenceParallel) {
  run("ColumnThenRowParallelMlpWithAndWithoutSequenceParallel");
}
TEST(TensorParallelTest, SplitAndGatherAreEachOthersConjugates) { run("SplitAndGatherAreEachOthersConjugates"); }
TEST(TensorParallelTest, VocabParallelCrossEntropyMatchesCrossEntropyWithoutGatheringTheLogits) {
  run("VocabParallelCrossEntropyMatchesCrossEntropy");
}

// One process (no group): every op is the identity and keeps the graph.
TEST(TensorParallelTest, WithoutAGroupEveryOpIsTheIdentity) {
  const at::Tensor x = at::randn({4, 6}).requires_grad_(true);
  const tp::Group none;
  EXPECT_TRUE(tp::copy_to_tensor_parallel(x, none).is_same(x));
  EXPECT_TRUE(tp::gather_sequence(x, 0, none).is_same(x));
  const at::Tensor target = at::randint(0, 6, {4}, at::kLong);
  const at::Tensor got = tp::vocab_parallel_cross_entropy(x, target, 0, none);
  const at::Tensor want = at::cross_entropy_loss(x, target, {}, at::Reduction::None, -100);
  expect_close(got.detach(), want.detach(), "loss");
}

}  // namespace
}  // namespace modalities
