// Autograd-aware collectives for tensor and sequence parallelism over a c10d process group (the
// `tp` dim of the device mesh), for model plugins that split their layers: Megatron-LM's
// conjugate pairs, written on LibTorch (which has no DTensor parallel styles). Each is one op
// whose backward is the conjugate collective:
//
//   column-parallel linear:  y_local = copy_to_tensor_parallel(x) W_local^T        (W split on rows)
//   row-parallel linear:     y = reduce_from_tensor_parallel(x_local W_local^T)    (W split on columns)
//   sequence parallel:       full = gather_sequence(x_local, dim)  ...  local = reduce_scatter_sequence(y, dim)
//
// Every rank of the group must call the same ops in the same order with equal shapes (chunks of
// equal size along the split dim). Without a group (null) every op is the identity.
#pragma once

#include <modalities/sdk/export.h>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace modalities {
class ParallelDims;
}  // namespace modalities

namespace modalities::tp {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

/// Logits split on the vocabulary over `group` ("loss parallel"): this rank holds classes
/// [start, start + its last dim). Set by a tensor-parallel model (Module::vocab_shard) and passed
/// to the loss with the predictions (InferenceResultBatch::vocab_shard).
///
/// Special members are defined in the SDK library, so that headers holding one (batch.h) need
/// no complete c10d::ProcessGroup.
struct MODALITIES_SDK_API VocabShard {
  VocabShard(Group group, std::int64_t start, std::int64_t vocab_size);
  VocabShard(const VocabShard&);
  VocabShard(VocabShard&&) noexcept;
  VocabShard& operator=(const VocabShard&);
  VocabShard& operator=(VocabShard&&) noexcept;
  ~VocabShard();

  Group group;
  std::int64_t start = 0;
  std::int64_t vocab_size = 0;  // of the whole vocabulary
};

/// How a model takes part in tensor parallelism (Module::apply_tensor_parallel): options a
/// config sets. Since: SDK 0.1 (ABI 6).
struct Options {
  /// Norms, dropout and residuals run on each rank's chunk of the sequence between the parallel
  /// regions (all-gather / reduce-scatter at their edges); false: replicated activations
  /// (all-reduce after each row-parallel layer).
  bool sequence_parallel = true;
};

/// How this rank's part of a split model talks to the other `size` ranks of the tp group: the
/// group, this rank's place in it, and the edges of a parallel region (Megatron-LM's f and g, with
/// or without sequence parallelism). Activations are [B*T, d] matrices, one row per token; with
/// sequence parallelism, between the parallel regions each rank holds the rows of its chunk of the
/// sequence, [B*(T/size), d] (chunk `rank` of dim 1 of [B, T, d]). Since: SDK 0.1 (ABI 6).
struct MODALITIES_SDK_API Plan {
  /// The plan of the tp dim of `dims` with `options`; throws modalities::Error when dims has no tp
  /// dim of degree > 1.
  static Plan from(const ParallelDims& dims, const Options& options);

  Plan();
  Plan(const Plan&);
  Plan(Plan&&) noexcept;
  Plan& operator=(const Plan&);
  Plan& operator=(Plan&&) noexcept;
  ~Plan();

  Group group;
  std::int64_t rank = 0, size = 1;
  bool sequence_parallel = true;
  bool loss_parallel = false;  // the mesh's enable_loss_parallel: logits stay split on the vocabulary

  /// The input of a column-parallel layer, whole on every rank: gathered from the sequence chunks
  /// (backward: reduce-scatter), or the replicated activation (backward: all-reduce). Either way
  /// the backward sums the ranks' partial input gradients.
  at::Tensor enter(const at::Tensor& x, std::int64_t B, std::int64_t T) const;
  /// The output of a row-parallel layer, partial sums [B*T, d]: their sum, replicated
  /// (all-reduce) or this rank's sequence chunk (reduce-scatter).
  at::Tensor leave(const at::Tensor& partial, std::int64_t B, std::int64_t T) const;
  /// A replicated parameter that this rank applies to its part of the data only (a norm under
  /// sequence parallelism, qk-norm on the local heads): forward as is, backward the sum of the
  /// ranks' partial gradients, so every replica gets the whole gradient. Undefined stays undefined.
  at::Tensor shared(const at::Tensor& w) const;
};

/// Forward: x. Backward: the sum of the gradients over the group (all-reduce). Before a
/// column-parallel layer, whose ranks each produce a partial gradient of the shared input.
MODALITIES_SDK_API at::Tensor copy_to_tensor_parallel(const at::Tensor& x, const Group& group);

/// Forward: the sum of x over the group (all-reduce). Backward: the gradient as is. After a
/// row-parallel layer, whose ranks each hold a partial sum.
MODALITIES_SDK_API at::Tensor reduce_from_tensor_parallel(const at::Tensor& x, const Group& group);

/// Forward: the ranks' x concatenated along `dim` in rank order (all-gather). Backward: the sum
/// of the gradients over the group, this rank's chunk along `dim` (reduce-scatter). Sequence
/// parallel: from sequence-sharded activations to the full sequence before a parallel region.
MODALITIES_SDK_API at::Tensor gather_sequence(const at::Tensor& x, std::int64_t dim, const Group& group);

/// Forward: the sum of x over the group, this rank's chunk along `dim` (reduce-scatter).
/// Backward: the gradients concatenated along `dim` (all-gather). Sequence parallel: after a
/// row-parallel layer, back to sequence-sharded activations.
MODALITIES_SDK_API at::Tensor reduce_scatter_sequence(const at::Tensor& x, std::int64_t dim, const Group& group);

/// Forward: this rank's chunk of x along `dim` (x equal on every rank). Backward: the gradients
/// concatenated along `dim` (all-gather). Enters a sequence-parallel region from replicated data.
MODALITIES_SDK_API at::Tensor split_to_tensor_parallel(const at::Tensor& x, std::int64_t dim, const Group& group);

/// Forward: the ranks' x concatenated along `dim` (all-gather). Backward: this rank's chunk of
/// the gradient along `dim` (no reduction). Gathers a column-parallel output, e.g. logits split
/// on the vocabulary, when the next op needs all of it on every rank.
MODALITIES_SDK_API at::Tensor gather_from_tensor_parallel(const at::Tensor& x, std::int64_t dim, const Group& group);

/// Cross-entropy of logits split on the vocabulary ("loss parallel"), without gathering them.
/// `logits` [N, V / size] holds classes [vocab_start, vocab_start + V / size) on this rank;
/// `target` [N] holds global class ids. Returns the per-row loss [N] (equal on every rank), 0
/// where target == ignore_index. Backward gives this rank's columns of the gradient of the
/// unsplit cross-entropy. Three all-reduces of [N] values (max, sum of exponentials, target
/// logit), none of the logits.
MODALITIES_SDK_API at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                                           std::int64_t vocab_start, const Group& group,
                                                           std::int64_t ignore_index = -100);

}  // namespace modalities::tp
