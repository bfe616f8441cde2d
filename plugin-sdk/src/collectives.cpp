// Differentiable all-to-all of rows (collectives.h), on c10d's alltoall_base with split sizes.
#include "autograd_node.h"

#include <modalities/sdk/collectives.h>
#include <modalities/sdk/error.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <numeric>
#include <vector>

namespace modalities::dist {

namespace {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

bool active(const Group& g) { return g && g->getSize() > 1; }

std::int64_t total(const std::vector<std::int64_t>& counts) {
  return std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
}

void check_counts(const std::vector<std::int64_t>& counts, const char* what, int ranks) {
  if (static_cast<int>(counts.size()) != ranks)
    throw Error(fmt::format("all_to_all_rows: {} has {} entries, one per rank of the group ({}) expected", what,
                            counts.size(), ranks));
  for (const std::int64_t n : counts)
    if (n < 0) throw Error(fmt::format("all_to_all_rows: {} has a negative row count: {}", what, counts));
}

// The rows of x in blocks to the ranks: a new tensor of sum(recv) rows (no autograd).
at::Tensor exchange_rows(const at::Tensor& x, std::vector<std::int64_t> send, std::vector<std::int64_t> recv,
                         const Group& g) {
  std::vector<std::int64_t> shape = x.sizes().vec();
  shape[0] = total(recv);
  at::Tensor in = x.contiguous();
  at::Tensor out = at::empty(shape, x.options());
  g->alltoall_base(out, in, recv, send)->wait();
  return out;
}

}  // namespace

at::Tensor all_to_all_rows(const at::Tensor& x, const std::vector<std::int64_t>& send,
                           const std::vector<std::int64_t>& recv, const Group& group) {
  const int ranks = active(group) ? group->getSize() : 1;
  check_counts(send, "send", ranks);
  check_counts(recv, "recv", ranks);
  if (x.dim() < 1 || x.size(0) != total(send))
    throw Error(fmt::format("all_to_all_rows: x has {} rows (shape {}), but send adds up to {}",
                            x.dim() < 1 ? 0 : x.size(0), x.sizes().vec(), total(send)));
  if (!active(group)) {
    if (send != recv)
      throw Error(
          fmt::format("all_to_all_rows: without a group every row stays here, but send {} != recv {}", send, recv));
    return x;
  }
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = exchange_rows(x.detach(), send, recv, group);
  }
  return detail::attach(
      x, y, "AllToAllRowsBackward",
      [send, recv, group](const at::Tensor& grad) { return exchange_rows(grad, recv, send, group); },
      /*collective=*/true);
}

at::Tensor exchange_counts(const at::Tensor& counts, const Group& group) {
  if (!active(group)) return counts;
  const std::int64_t ranks = group->getSize();
  if (counts.dim() != 1 || counts.numel() % ranks != 0)
    throw Error(
        fmt::format("exchange_counts: expected a 1-d tensor whose size is a multiple of the {} ranks, got "
                    "shape {}",
                    ranks, counts.sizes().vec()));
  at::NoGradGuard no_grad;
  at::Tensor in = counts.contiguous();
  at::Tensor out = at::empty_like(in);
  std::vector<std::int64_t> equal;  // empty split sizes: equal blocks
  group->alltoall_base(out, in, equal, equal)->wait();
  return out;
}

}  // namespace modalities::dist
