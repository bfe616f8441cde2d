// context_parallel.h: the head-tail split of a sequence over the cp ranks.
#include <modalities/sdk/context_parallel.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/tensor_parallel.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <fmt/format.h>

#include <utility>
#include <vector>

namespace modalities::cp {

SequenceShard::SequenceShard(Group g, std::int64_t r, std::int64_t n) : group(std::move(g)), rank(r), size(n) {
  if (n < 1 || r < 0 || r >= n)
    throw Error(fmt::format("context parallelism: rank {} of {} ranks is not a place in the cp group", r, n));
}
SequenceShard::SequenceShard(const SequenceShard&) = default;
SequenceShard::SequenceShard(SequenceShard&&) noexcept = default;
SequenceShard& SequenceShard::operator=(const SequenceShard&) = default;
SequenceShard& SequenceShard::operator=(SequenceShard&&) noexcept = default;
SequenceShard::~SequenceShard() = default;

void SequenceShard::check_length(std::int64_t length, std::string_view what) const {
  if (length % (2 * size) != 0)
    throw Error(
        fmt::format("{} = {} is not divisible by 2 x the context-parallel degree {} = {}: context "
                    "parallelism cuts every sequence into {} equal chunks (rank r holds chunks r and {} - r)",
                    what, length, size, 2 * size, 2 * size, 2 * size - 1));
}

std::int64_t SequenceShard::chunk_length(std::int64_t length) const { return length / (2 * size); }

at::Tensor SequenceShard::positions(std::int64_t length, const at::TensorOptions& options) const {
  check_length(length, "the sequence length");
  const std::int64_t L = chunk_length(length);
  const at::TensorOptions o = options.dtype(at::kLong);
  return at::cat({at::arange(first_chunk() * L, (first_chunk() + 1) * L, o),
                  at::arange(second_chunk() * L, (second_chunk() + 1) * L, o)});
}

at::Tensor SequenceShard::shard(const at::Tensor& x, std::int64_t dim) const {
  if (size == 1) return x;
  const std::int64_t length = x.size(dim);
  check_length(length, "the sequence length");
  const std::int64_t L = chunk_length(length);
  return at::cat({x.narrow(dim, first_chunk() * L, L), x.narrow(dim, second_chunk() * L, L)}, dim);
}

at::Tensor SequenceShard::gather(const at::Tensor& x, std::int64_t dim) const {
  if (size == 1) return x;
  dim = dim < 0 ? dim + x.dim() : dim;
  if (x.size(dim) % 2 != 0)
    throw Error(fmt::format("context parallelism: a rank's tokens ({}) are two chunks of equal length", x.size(dim)));
  // Rank q's block of the all-gather holds chunks q and 2 size - 1 - q: chunk c sits at block
  // slot 2c (c < size) or 2 (2 size - 1 - c) + 1.
  // The index is made on x's device (no host copy); index_select's backward adds into one buffer.
  const at::Tensor all = tp::gather_sequence(x.contiguous(), dim, group);
  const std::int64_t L = x.size(dim) / 2;
  const at::TensorOptions o = at::TensorOptions().dtype(at::kLong).device(x.device());
  const at::Tensor c = at::arange(2 * size, o);
  const at::Tensor slot = at::where(c < size, 2 * c, 4 * size - 1 - 2 * c);
  const at::Tensor index = (slot.unsqueeze(1) * L + at::arange(L, o).unsqueeze(0)).reshape({-1});
  return all.index_select(dim, index);
}

}  // namespace modalities::cp
