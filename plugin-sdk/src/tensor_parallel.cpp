// tensor_parallel.h. Each op computes its forward without autograd and gives the result a
// hand-made node whose backward is the conjugate collective (one next edge: the input's).
#include <modalities/sdk/error.h>
#include <modalities/sdk/tensor_parallel.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace modalities::tp {
namespace {

using Backward = std::function<at::Tensor(const at::Tensor& grad)>;

class Conjugate final : public torch::autograd::Node {
 public:
  Conjugate(std::string name, Backward backward) : name_(std::move(name)), backward_(std::move(backward)) {}
  std::string name() const override { return name_; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    return {backward_(grads[0])};
  }
  void release_variables() override { backward_ = nullptr; }

 private:
  std::string name_;
  Backward backward_;
};

// `output` (computed without autograd) as the result of an op on `input` with this backward.
at::Tensor attach(const at::Tensor& input, at::Tensor output, const char* name, Backward backward) {
  if (!at::GradMode::is_enabled() || !input.requires_grad()) return output;
  auto node = std::shared_ptr<Conjugate>(new Conjugate(name, std::move(backward)), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  torch::autograd::create_gradient_edge(output, node);
  return output;
}

bool active(const Group& g) { return g && g->getSize() > 1; }

std::int64_t normalized(std::int64_t dim, const at::Tensor& x, const char* op) {
  const std::int64_t d = dim < 0 ? dim + x.dim() : dim;
  if (d < 0 || d >= x.dim())
    throw Error(fmt::format("tensor parallel {}: dim {} is out of range for a tensor of {} dims", op, dim, x.dim()));
  return d;
}

at::Tensor all_reduce(const at::Tensor& x, const Group& g, c10d::ReduceOp op = c10d::ReduceOp::SUM) {
  std::vector<at::Tensor> t = {x.contiguous().clone()};
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  g->allreduce(t, o)->wait();
  return t[0];
}

at::Tensor all_gather_along(const at::Tensor& x, std::int64_t dim, const Group& g) {
  // Flat buffers: Gloo checks that the output is the input's shape with world x its elements.
  at::Tensor src = x.contiguous().view({-1});
  at::Tensor buffer = at::empty({src.numel() * g->getSize()}, src.options());
  g->_allgather_base(buffer, src)->wait();
  std::vector<std::int64_t> sizes = x.sizes().vec();
  sizes.insert(sizes.begin(), g->getSize());
  return at::cat(buffer.view(sizes).unbind(0), dim);
}

at::Tensor reduce_scatter_along(const at::Tensor& x, std::int64_t dim, const Group& g, const char* op) {
  const std::int64_t n = g->getSize();
  if (x.size(dim) % n != 0)
    throw Error(fmt::format("tensor parallel {}: size {} of dim {} is not divisible by the {} ranks", op,
                            x.size(dim), dim, n));
  at::Tensor stacked = at::stack(x.chunk(n, dim), 0).contiguous();  // [n, chunk...]
  at::Tensor out = at::empty({stacked.numel() / n}, x.options());
  at::Tensor flat = stacked.view({-1});
  g->_reduce_scatter_base(out, flat)->wait();
  return out.view(stacked.sizes().slice(1));
}

at::Tensor own_chunk(const at::Tensor& x, std::int64_t dim, const Group& g, const char* op) {
  const std::int64_t n = g->getSize();
  if (x.size(dim) % n != 0)
    throw Error(fmt::format("tensor parallel {}: size {} of dim {} is not divisible by the {} ranks", op,
                            x.size(dim), dim, n));
  return x.chunk(n, dim)[g->getRank()].contiguous();
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
  if (!active(group)) return x;
  const std::int64_t d = normalized(dim, x, "gather_sequence");
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = all_gather_along(x, d, group);
  }
  return attach(x, y, "GatherSequenceBackward",
                [group, d](const at::Tensor& g) { return reduce_scatter_along(g, d, group, "gather_sequence"); });
}

at::Tensor reduce_scatter_sequence(const at::Tensor& x, std::int64_t dim, const Group& group) {
  if (!active(group)) return x;
  const std::int64_t d = normalized(dim, x, "reduce_scatter_sequence");
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = reduce_scatter_along(x, d, group, "reduce_scatter_sequence");
  }
  return attach(x, y, "ReduceScatterSequenceBackward",
                [group, d](const at::Tensor& g) { return all_gather_along(g, d, group); });
}

at::Tensor split_to_tensor_parallel(const at::Tensor& x, std::int64_t dim, const Group& group) {
  if (!active(group)) return x;
  const std::int64_t d = normalized(dim, x, "split_to_tensor_parallel");
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = own_chunk(x, d, group, "split_to_tensor_parallel");
  }
  return attach(x, y, "SplitToTensorParallelBackward",
                [group, d](const at::Tensor& g) { return all_gather_along(g, d, group); });
}

at::Tensor gather_from_tensor_parallel(const at::Tensor& x, std::int64_t dim, const Group& group) {
  if (!active(group)) return x;
  const std::int64_t d = normalized(dim, x, "gather_from_tensor_parallel");
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = all_gather_along(x, d, group);
  }
  return attach(x, y, "GatherFromTensorParallelBackward",
                [group, d](const at::Tensor& g) { return own_chunk(g, d, group, "gather_from_tensor_parallel"); });
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
