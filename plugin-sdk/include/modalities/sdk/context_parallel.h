// Context parallelism: each sample's sequence split over the ranks of the mesh's cp dim, in the
// head-tail order that balances causal attention (Modalities' "headtail" load balancer, torch's
// _HeadTailLoadBalancer): the sequence is cut into 2 x size equal chunks and rank r holds chunks
// r and 2 size - 1 - r, so every rank's queries see (2 size + 1) / 2 chunks of keys on average.
//
//   const cp::SequenceShard shard(dims.group(MeshDim::cp), dims.coordinate(MeshDim::cp), dims.degree(MeshDim::cp));
//   at::Tensor mine = shard.shard(ids, 1);          // [B, T] -> [B, T / size], this rank's tokens
//   at::Tensor where = shard.positions(T, opts);    // [T / size]: their places in the sequence
//   at::Tensor keys = shard.gather(k_local, 2);     // every rank's keys, in sequence order
//
// A model that takes part (Module::apply_context_parallel) returns predictions for its tokens
// only and says so (Module::sequence_shard); the loss picks the same tokens of the targets
// (InferenceResultBatch::sequence_shard, Loss::accepts_sequence_shards).
#pragma once

#include <modalities/sdk/export.h>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <string_view>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace modalities::cp {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

/// This rank's place in the head-tail split of a sequence over the `size` ranks of `group`.
/// Special members are defined in the SDK library (headers holding one need no complete
/// c10d::ProcessGroup). Since: SDK 0.1 (ABI 9).
struct MODALITIES_SDK_API SequenceShard {
  SequenceShard(Group group, std::int64_t rank, std::int64_t size);
  SequenceShard(const SequenceShard&);
  SequenceShard(SequenceShard&&) noexcept;
  SequenceShard& operator=(const SequenceShard&);
  SequenceShard& operator=(SequenceShard&&) noexcept;
  ~SequenceShard();

  Group group;
  std::int64_t rank = 0, size = 1;

  /// Throws modalities::Error naming `what` unless `length` splits into 2 x size equal chunks.
  void check_length(std::int64_t length, std::string_view what) const;
  /// The chunk length, length / (2 size).
  std::int64_t chunk_length(std::int64_t length) const;
  /// The two chunks this rank holds, in its order: rank and 2 size - 1 - rank.
  std::int64_t first_chunk() const { return rank; }
  std::int64_t second_chunk() const { return 2 * size - 1 - rank; }
  /// The positions in the whole sequence of this rank's tokens, in its order: int64 [length / size].
  at::Tensor positions(std::int64_t length, const at::TensorOptions& options) const;
  /// This rank's tokens of `x` along `dim` (of size `length`): its two chunks, concatenated.
  /// Differentiable (the gradient of the other tokens is zero).
  at::Tensor shard(const at::Tensor& x, std::int64_t dim) const;
  /// The whole sequence along `dim` from every rank's tokens `x` (all-gather over the group, the
  /// chunks put back in sequence order). Backward: each rank gets, for its tokens, the sum of the
  /// gradients over the ranks (reduce-scatter): keys and values gathered for attention receive
  /// the gradients of every rank's queries. A collective; identity for one rank.
  at::Tensor gather(const at::Tensor& x, std::int64_t dim) const;
};

}  // namespace modalities::cp
