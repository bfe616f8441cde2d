// The sharding engine of model/fsdp2_wrapped (README.md): PyTorch FSDP2's `fully_shard`
// re-created on LibTorch's c10d, for any Module that reports its blocks (block FQNs) and calls
// module hooks on them (Module::add_hook).
//
// Per parameter: the full tensor is split on dim 0 into world-size chunks of equal row count
// (the last ones padded with zero rows), and this rank keeps its chunk as the parameter the
// optimizer sees. Per unit (k consecutive blocks, plus the root for everything else) the chunks
// live in one flat buffer, so a unit is gathered by one all-gather and its gradients reduced by
// one reduce-scatter:
//   * before a unit's forward: all-gather, copy out into the model's own parameter tensors;
//   * after it (reshard_after_forward): free their storage (the tensors keep their identity,
//     shapes and autograd history; only the bytes go, FSDP2's storage resize);
//   * when the gradient of the unit's output arrives in backward: gather again;
//   * when every parameter of the unit has accumulated its gradient: one reduce-scatter (mean
//     over the shard group; HSDP then all-reduces the result over the replicate group), added
//     into the shards' gradients, and the full gradients and parameters are freed.
// The root unit is gathered for the whole forward and backward, as FSDP2 does.
#pragma once

#include <modalities/sdk/interfaces/module.h>

#include <c10/core/ScalarType.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace modalities::plugins::fsdp {

struct ShardingOptions {
  /// Ranks a replica is sharded over (mesh dim dp_shard); null in a single process.
  c10::intrusive_ptr<c10d::ProcessGroup> shard_group;
  /// HSDP: ranks holding the same shard (mesh dim dp_replicate); null for plain FSDP.
  c10::intrusive_ptr<c10d::ProcessGroup> replicate_group;
  /// Free a unit's gathered parameters after its forward (ZeRO-3); false keeps them until its
  /// backward (ZeRO-2). The root unit always stays gathered until its backward.
  bool reshard_after_forward = true;
  /// Consecutive blocks per unit (Modalities' layers_per_fsdp_unit).
  std::int64_t blocks_per_unit = 1;
  /// FQNs of the blocks, in forward order (each becomes part of a unit); the rest is the root unit.
  std::vector<std::string> block_fqns;
  /// Mixed precision: the dtype units are all-gathered and computed in (the model's parameters
  /// are param_dtype tensors while gathered; fp32 master shards) and the dtype of the gradient
  /// reduction (default: the master dtype). Note [Mixed precision] in fully_shard.cpp.
  std::optional<c10::ScalarType> param_dtype, reduce_dtype;
  /// Start the next unit's all-gather while this one computes (Note [Prefetching]); false waits
  /// for every gather where it is needed (for measurement).
  bool prefetch = true;
};

/// The sharded Module. Wraps `inner`: its parameters become views of gathered buffers, and
/// named_parameters() / state_dict() expose this rank's shards under the canonical names, with
/// their placement (shard_placements()).
std::shared_ptr<Module> fully_shard(std::shared_ptr<Module> inner, ShardingOptions options);

}  // namespace modalities::plugins::fsdp
