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
#include <modalities/sdk/mixed_precision.h>
#include <modalities/sdk/schema.h>

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

namespace modalities {
class DeviceMesh;
}  // namespace modalities

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
  /// Expert parallelism (Note [Expert parallelism] in fully_shard.cpp): the parameters named here
  /// (the model's expert_parallel_parameters()) are sharded over `expert_shard_group` (the ranks
  /// holding the same experts; null: one) instead of shard_group, and their reduced gradient sum
  /// is divided by its size times `expert_grad_divide` (the ep degree).
  std::vector<std::string> expert_fqns;
  c10::intrusive_ptr<c10d::ProcessGroup> expert_shard_group;
  std::int64_t expert_grad_divide = 1;
  /// Start the next unit's all-gather while this one computes (Note [Prefetching]); false waits
  /// for every gather where it is needed (for measurement).
  bool prefetch = true;
};

/// The sharded Module. Wraps `inner`: its parameters become views of gathered buffers, and
/// named_parameters() / state_dict() expose this rank's shards under the canonical names, with
/// their placement (shard_placements()).
std::shared_ptr<Module> fully_shard(std::shared_ptr<Module> inner, ShardingOptions options);

/// What model/fsdp2_wrapped (flat in its config) and model/parallelized (its `fully_shard`
/// table) say about sharding over a device mesh's dp_shard (and dp_replicate) dims.
struct Fsdp2Options {
  std::vector<std::string> block_names;
  MixedPrecisionSettings mixed_precision_settings;
  bool reshard_after_forward = true;
  std::int64_t layers_per_fsdp_unit = 1;
  bool prefetch = true;

  /// Declares the five fields in the schema of a config C that has them (fsdp2_wrapped's, and
  /// this struct's own for a nested table): one list of names, defaults and help texts.
  template <class C>
  static void describe_fields(Schema<C>& s) {
    s.field("block_names", &C::block_names,
            "Class names of the blocks sharded as units, e.g. [\"GPT2Block\"]; names the model does not have are "
            "ignored, as in Modalities.")
        .required();
    s.field("mixed_precision_settings", &C::mixed_precision_settings, "{param_dtype, reduce_dtype}.").required();
    s.field("reshard_after_forward", &C::reshard_after_forward,
            "Free each unit's gathered parameters after its forward (gather again for backward).");
    s.field("layers_per_fsdp_unit", &C::layers_per_fsdp_unit, "Consecutive blocks per unit.").positive();
    s.field("prefetch", &C::prefetch,
            "Ours: start the next unit's all-gather while the current one computes (false: for measurement).");
  }
  static void describe(Schema<Fsdp2Options>& s) { describe_fields(s); }

  template <class C>
  static Fsdp2Options of(const C& c) {
    return {c.block_names, c.mixed_precision_settings, c.reshard_after_forward, c.layers_per_fsdp_unit, c.prefetch};
  }
};

/// One model (or one pipeline stage's module) sharded over `mesh`'s dp_shard group, replicated
/// over dp_replicate (HSDP); its expert weights, under expert parallelism, over the mesh's expert
/// shard group. Throws ConfigError("device_mesh", ...) for a mesh without dp_shard.
std::shared_ptr<Module> shard_over_mesh(std::shared_ptr<Module> inner, const DeviceMesh& mesh,
                                        const Fsdp2Options& options);

}  // namespace modalities::plugins::fsdp
