// tensor_parallel.h. Each op computes its forward without autograd and gives the result a
// hand-made node whose backward is the conjugate collective (one next edge: the input's).
#include "autograd_node.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/tensor_parallel.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace modalities::tp {

VocabShard::VocabShard(Group g, std::int64_t s, std::int64_t v) : group(std::move(g)), start(s), vocab_size(v) {}
VocabShard::VocabShard(const VocabShard&) = default;
VocabShard::VocabShard(VocabShard&&) noexcept = default;
VocabShard& VocabShard::operator=(const VocabShard&) = default;
VocabShard& VocabShard::operator=(VocabShard&&) noexcept = default;
VocabShard::~VocabShard() = default;

Plan::Plan() = default;
Plan::Plan(const Plan&) = default;
Plan::Plan(Plan&&) noexcept = default;
Plan& Plan::operator=(const Plan&) = default;
Plan& Plan::operator=(Plan&&) noexcept = default;
Plan::~Plan() = default;

Plan Plan::from(const ParallelDims& dims, const Options& options) {
  if (!dims.enabled(MeshDim::tp))
    throw Error(
        fmt::format("tensor parallelism needs a device mesh with a tp dim (tensor_parallel_degree > 1); "
                    "this run's layout is {}",
                    dims.describe()));
  Plan plan;
  plan.group = dims.group(MeshDim::tp);
  plan.rank = dims.coordinate(MeshDim::tp);
  plan.size = dims.degree(MeshDim::tp);
  plan.sequence_parallel = options.sequence_parallel;
  plan.loss_parallel = dims.loss_parallel();
  return plan;
}

at::Tensor Plan::enter(const at::Tensor& x, std::int64_t B, std::int64_t T) const {
  if (!sequence_parallel) return copy_to_tensor_parallel(x, group);
  const std::int64_t d = x.size(-1);
  return gather_sequence(x.view({B, T / size, d}), 1, group).reshape({B * T, d});
}

at::Tensor Plan::leave(const at::Tensor& partial, std::int64_t B, std::int64_t T) const {
  const std::int64_t d = partial.size(-1);
  if (!sequence_parallel) return reduce_from_tensor_parallel(partial, group);
  return reduce_scatter_sequence(partial.view({B, T, d}), 1, group).reshape({B * (T / size), d});
}

at::Tensor Plan::shared(const at::Tensor& w) const { return w.defined() ? copy_to_tensor_parallel(w, group) : w; }

namespace {

using detail::attach;

bool active(const Group& g) { return g && g->getSize() > 1; }

at::Tensor all_reduce(const at::Tensor& x, const Group& g, c10d::ReduceOp op = c10d::ReduceOp::SUM) {
  std::vector<at::Tensor> t = {x.clone(at::MemoryFormat::Contiguous)};
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  g->allreduce(t, o)->wait();
  return t[0];
}

// The collectives along one dim, all with the signature of AlongDim. `op` names the public op in
// errors.
using AlongDim = at::Tensor (*)(const at::Tensor& x, std::int64_t dim, const Group& g, const char* op);

void check_divisible(const at::Tensor& x, std::int64_t dim, const Group& g, const char* op) {
  if (x.size(dim) % g->getSize() != 0)
    throw Error(fmt::format("tensor parallel {}: size {} of dim {} is not divisible by the {} ranks", op, x.size(dim),
                            dim, g->getSize()));
}

// The ranks' x concatenated along dim.
at::Tensor all_gather_along(const at::Tensor& x, std::int64_t dim, const Group& g, const char* /*op*/) {
  // Flat buffers: Gloo checks that the output is the input's shape with world x its elements.
  at::Tensor src = x.contiguous().view({-1});
  at::Tensor buffer = at::empty({src.numel() * g->getSize()}, src.options());
  g->_allgather_base(buffer, src)->wait();
  std::vector<std::int64_t> sizes = x.sizes().vec();
  sizes.insert(sizes.begin(), g->getSize());
  return at::cat(buffer.view(sizes).unbind(0), dim);
}

// The sum over the ranks, this rank's chunk along dim.
at::Tensor reduce_scatter_along(const at::Tensor& x, std::int64_t dim, const Group& g, const char* op) {
  check_divisible(x, dim, g, op);
  const std::int64_t n = g->getSize();
  at::Tensor stacked = at::stack(x.chunk(n, dim), 0).contiguous();  // [n, chunk...]
  at::Tensor out = at::empty({stacked.numel() / n}, x.options());
  at::Tensor flat = stacked.view({-1});
  g->_reduce_scatter_base(out, flat)->wait();
  return out.view(stacked.sizes().slice(1));
}

// This rank's chunk along dim.
at::Tensor own_chunk(const at::Tensor& x, std::int64_t dim, const Group& g, const char* op) {
  check_divisible(x, dim, g, op);
  return x.chunk(g->getSize(), dim)[g->getRank()].contiguous();
}

// forward(x) as an op along `dim` whose backward is backward(grad); the identity without a group.
at::Tensor along(const at::Tensor& x, std::int64_t dim, const Group& group, const char* op, const char* node,
                 AlongDim forward, AlongDim backward) {
  if (!active(group)) return x;
  const std::int64_t d = dim < 0 ? dim + x.dim() : dim;
  if (d < 0 || d >= x.dim())
    throw Error(fmt::format("tensor parallel {}: dim {} is out of range for a tensor of {} dims", op, dim, x.dim()));
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = forward(x, d, group, op);
  }
  return attach(x, y, node, [=](const at::Tensor& g) { return backward(g, d, group, op); });
}

}  // namespace

at::Tensor copy_to_tensor_parallel(const at::Tensor& x, const Group& group) {
  if (!active(group)) return x;
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = x.detach();
  }
  return attach(x, y, "CopyToTensorParallelBackward", [group](const at::Tensor& g) { return all_reduce(g, group); });
}

at::Tensor reduce_from_tensor_parallel(const at::Tensor& x, const Group& group) {
  if (!active(group)) return x;
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = all_reduce(x, group);
  }
  return attach(x, y, "ReduceFromTensorParallelBackward", [](const at::Tensor& g) { return g; });
}

at::Tensor gather_sequence(const at::Tensor& x, std::int64_t dim, const Group& group) {
  return along(x, dim, group, "gather_sequence", "GatherSequenceBackward", all_gather_along, reduce_scatter_along);
}

at::Tensor reduce_scatter_sequence(const at::Tensor& x, std::int64_t dim, const Group& group) {
  return along(x, dim, group, "reduce_scatter_sequence", "ReduceScatterSequenceBackward", reduce_scatter_along,
               all_gather_along);
}

at::Tensor split_to_tensor_parallel(const at::Tensor& x, std::int64_t dim, const Group& group) {
  return along(x, dim, group, "split_to_tensor_parallel", "SplitToTensorParallelBackward", own_chunk, all_gather_along);
}

at::Tensor gather_from_tensor_parallel(const at::Tensor& x, std::int64_t dim, const Group& group) {
  return along(x, dim, group, "gather_from_tensor_parallel", "GatherFromTensorParallelBackward", all_gather_along,
               own_chunk);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target, std::int64_t vocab_start,
                                        const Group& group, std::int64_t ignore_index) {
  if (logits.dim() != 2 || target.dim() != 1 || target.size(0) != logits.size(0))
    throw Error(fmt::format("vocab_parallel_cross_entropy: expected logits [N, V_local] and target [N], got {} and {}",
                            logits.sizes().vec(), target.sizes().vec()));
  const std::int64_t local_vocab = logits.size(1);
  at::Tensor loss, softmax, hit, column, valid;
  {
    at::NoGradGuard no_grad;
    // In fp32 (as cross_entropy's upcast): shift by the global row max, sum the exponentials
    // over all ranks, and take the target's shifted logit from the rank that holds it.
    at::Tensor z = logits.detach().to(at::kFloat);
    at::Tensor max = z.amax(1);
    if (active(group)) max = all_reduce(max, group, c10d::ReduceOp::MAX);
    z = z - max.unsqueeze(1);
    const at::Tensor exp = z.exp();
    at::Tensor sum = exp.sum(1);
    if (active(group)) sum = all_reduce(sum, group);
    valid = target != ignore_index;
    const at::Tensor local = target - vocab_start;
    hit = valid & (local >= 0) & (local < local_vocab);
    column = local.clamp(0, local_vocab - 1);
    at::Tensor picked = z.gather(1, column.unsqueeze(1)).squeeze(1) * hit.to(at::kFloat);
    if (active(group)) picked = all_reduce(picked, group);
    loss = (sum.log() - picked) * valid.to(at::kFloat);
    softmax = exp / sum.unsqueeze(1);
  }
  const c10::ScalarType dtype = logits.scalar_type();
  return attach(logits, loss, "VocabParallelCrossEntropyBackward",
                [softmax, hit, column, valid, dtype](const at::Tensor& grad_loss) {
                  // d loss_i / d z_ij = softmax_ij - [j == target_i], zero for ignored rows.
                  at::Tensor g = softmax.clone();
                  g.scatter_add_(1, column.unsqueeze(1), -hit.to(at::kFloat).unsqueeze(1));
                  g.mul_((grad_loss.to(at::kFloat) * valid.to(at::kFloat)).unsqueeze(1));
                  return g.to(dtype);
                });
}

}  // namespace modalities::tp
