// model/fsdp2_wrapped (README.md): Modalities' FSDP2WrappedModelConfig on the engine of
// fully_shard.cpp, over the dp_shard (and dp_replicate, HSDP) dims of a device_mesh.
// model/fsdp1_wrapped: Modalities' FSDP1 config (sharding_strategy, mixed-precision preset) on the
// same engine, with FSDP1's fixed groups: the world, or the node (HYBRID_SHARD).
#include "fully_shard.h"

#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/mixed_precision.h>
#include <modalities/sdk/model_parts.h>
#include <modalities/sdk/plugin.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>
#include <vector>

namespace modalities::plugins::fsdp {
namespace {

struct Fsdp2Config {
  ModelParts model;
  std::vector<std::string> block_names;
  MixedPrecisionSettings mixed_precision_settings;
  bool reshard_after_forward = true;
  Ref<DeviceMesh> device_mesh;
  std::int64_t layers_per_fsdp_unit = 1;
  bool prefetch = true;

  static void describe(Schema<Fsdp2Config>& s) {
    using C = Fsdp2Config;
    s.field("model", &C::model,
            "The model to shard (materialized; a CPU model moves to the run device), or a list of parts (a pipeline "
            "rank's stages), which gives the list of their sharded modules.")
        .required();
    Fsdp2Options::describe_fields(s);
    s.field("device_mesh", &C::device_mesh, "Mesh with a dp_shard dim (and dp_replicate for HSDP).").required();
  }
};

// --- model/fsdp1_wrapped -----------------------------------------------------------------

struct Fsdp1Config {
  ModelParts model;
  bool sync_module_states = true;
  std::string mixed_precision_settings;
  std::string sharding_strategy;
  std::vector<std::string> block_names;

  static void describe(Schema<Fsdp1Config>& s) {
    using C = Fsdp1Config;
    s.field("model", &C::model, "The model to wrap (materialized, on the run device).").required();
    s.field("sync_module_states", &C::sync_module_states,
            "Broadcast rank 0's parameters and buffers to every rank before sharding.")
        .required();
    s.field("mixed_precision_settings", &C::mixed_precision_settings,
            "FSDP1 preset: FP_16 / BF_16 / MIXED_PRECISION_MEGATRON compute in fp16 / bf16 / bf16; BF_16_WORKING, "
            "FP_32, NO_MIXED_PRECISION compute in fp32. Gradients are reduced in the preset's reduce dtype "
            "(fp16, bf16, fp32, bf16, fp32, fp32). Buffers are not cast (FSDP1 casts them for FP_16/BF_16).")
        .required()
        .one_of({"FP_16", "BF_16", "BF_16_WORKING", "FP_32", "MIXED_PRECISION_MEGATRON", "NO_MIXED_PRECISION"});
    s.field("sharding_strategy", &C::sharding_strategy,
            "FULL_SHARD (ZeRO-3 over all ranks), SHARD_GRAD_OP (ZeRO-2: parameters stay gathered from forward to "
            "backward), HYBRID_SHARD / _HYBRID_SHARD_ZERO2 (the same within each node, replicated across nodes), "
            "NO_SHARD (data parallelism: whole parameters, gradients all-reduced).")
        .required()
        .one_of({"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"});
    s.field("block_names", &C::block_names, "Class names of the FSDP units, e.g. [\"GPT2Block\"]; each must exist.")
        .required();
  }
};

// Every rank takes rank 0's parameter and buffer values (FSDP1's sync_module_states).
void broadcast_module_states(Module& m) {
  if (!dist::initialized()) return;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> tensors;
  for (const auto& item : m.module().named_parameters(/*recurse=*/true)) tensors.push_back(item.value());
  for (const auto& item : m.module().named_buffers(/*recurse=*/true)) tensors.push_back(item.value());
  for (at::Tensor& t : tensors) {
    std::vector<at::Tensor> one = {t.is_contiguous() ? t : t.contiguous()};
    dist::world()->broadcast(one)->wait();
    if (!t.is_contiguous()) t.copy_(one.front());
  }
}

std::shared_ptr<Module> wrap_fsdp1(const Fsdp1Config& c) {
  static int instances = 0;  // group names must be unique per wrapped model (and equal on every rank)
  const int instance = instances++;
  if (c.model.parts.size() != 1)
    throw ConfigError("model", fmt::format("fsdp1_wrapped wraps one model; got {} model parts", c.model.parts.size()));
  std::shared_ptr<Module> inner = c.model.parts.front().shared();
  if (const auto experts = inner->expert_parallel_parameters(); !experts.empty())
    throw ConfigError("model", fmt::format("has experts split over ranks ({} and more); FSDP1 knows no device mesh "
                                           "and cannot shard them: use model/fsdp2_wrapped or model/parallelized",
                                           experts.front()));
  ShardingOptions o;
  for (const std::string& name : c.block_names) {
    const auto fqns = inner->submodules_of_class(name);
    if (fqns.empty()) throw ConfigError("block_names", fmt::format("the model has no submodule of class '{}'", name));
    for (const std::string& fqn : fqns)
      if (std::find(o.block_fqns.begin(), o.block_fqns.end(), fqn) == o.block_fqns.end()) o.block_fqns.push_back(fqn);
  }
  const std::string& preset = c.mixed_precision_settings;
  if (preset == "FP_16") o.param_dtype = o.reduce_dtype = at::kHalf;
  if (preset == "BF_16") o.param_dtype = o.reduce_dtype = at::kBFloat16;
  if (preset == "BF_16_WORKING") o.reduce_dtype = at::kBFloat16;
  if (preset == "MIXED_PRECISION_MEGATRON") o.param_dtype = at::kBFloat16, o.reduce_dtype = at::kFloat;
  const std::string& strategy = c.sharding_strategy;
  o.reshard_after_forward = strategy == "FULL_SHARD" || strategy == "HYBRID_SHARD";
  if (c.sync_module_states) broadcast_module_states(*inner);
  if (dist::initialized()) {
    const int world = dist::world_size();
    if (strategy == "FULL_SHARD" || strategy == "SHARD_GRAD_OP") {
      o.shard_group = dist::world();
    } else if (strategy == "NO_SHARD") {
      o.replicate_group = dist::world();  // one shard per rank: whole parameters, all-reduced gradients
      o.reshard_after_forward = false;
    } else {  // HYBRID_SHARD, _HYBRID_SHARD_ZERO2: shard within a node, replicate across nodes
      const int per_node = dist::env().local_world_size;
      if (per_node < 1 || world % per_node != 0)
        throw ConfigError("sharding_strategy", fmt::format("{} shards within a node: the world size {} is not a "
                                                           "multiple of the ranks per node (LOCAL_WORLD_SIZE {})",
                                                           strategy, world, per_node));
      const int nodes = world / per_node;
      // Every rank creates every group, in the same order (c10d's rule for new groups).
      for (int n = 0; n < nodes; ++n) {
        std::vector<int> ranks(static_cast<std::size_t>(per_node));
        for (int l = 0; l < per_node; ++l) ranks[static_cast<std::size_t>(l)] = n * per_node + l;
        auto g = dist::new_group(ranks, fmt::format("fsdp1_{}_node_{}", instance, n));
        if (g) o.shard_group = g;
      }
      for (int l = 0; l < per_node; ++l) {
        std::vector<int> ranks(static_cast<std::size_t>(nodes));
        for (int n = 0; n < nodes; ++n) ranks[static_cast<std::size_t>(n)] = n * per_node + l;
        auto g = dist::new_group(ranks, fmt::format("fsdp1_{}_replica_{}", instance, l));
        if (g) o.replicate_group = g;
      }
    }
  }
  return fully_shard(std::move(inner), std::move(o));
}

// Note [Several parts]
// fsdp2_wrapped takes one model or a list of parts (a pipeline rank's stages under Interleaved1F1B
// or LoopedBFS, from pipeline/selector MODEL_PART) and returns the same shape: a Module, or a list
// of Modules, each part sharded by an engine of its own over the same dp_shard group. The ranks of
// a dp_shard group hold the same stages and run the same schedule, so the engines' collectives are
// issued in the same order on all of them. One part gives a Module (not a list of one), as
// Modalities' one-model configs expect.
Value wrap_all(const Fsdp2Config& c, const std::string& origin) {
  const auto wrapped = [&](const Ref<Module>& part) -> Value {
    return Object{std::string(Module::kInterface),
                  std::static_pointer_cast<void>(shard_over_mesh(part.shared(), *c.device_mesh, Fsdp2Options::of(c))),
                  origin};
  };
  if (c.model.parts.size() == 1) return wrapped(c.model.parts.front());
  Value::List out;
  for (const auto& part : c.model.parts) out.push_back(wrapped(part));
  return out;
}

void register_components(Registrar& r) {
  r.add<Module, Fsdp1Config>(
      "fsdp1_wrapped",
      "Modalities' FSDP1 wrapper on the same engine: FULL_SHARD / SHARD_GRAD_OP over all ranks, HYBRID_SHARD "
      "within each node, NO_SHARD as data parallelism; FSDP1 mixed-precision presets.",
      [](const Fsdp1Config& c) { return wrap_fsdp1(c); });
  // A Module, or a list of them for a list of parts (Note [Several parts]): registered by hand.
  VariantSpec spec = detail::make_spec<Fsdp2Config>(
      "model", "fsdp2_wrapped",
      "FSDP2-style fully sharded data parallelism: parameters sharded on dim 0 over dp_shard, one all-gather and "
      "one reduce-scatter per unit of blocks; HSDP with dp_replicate. A list of parts (several pipeline stages per "
      "rank) gives the list of their sharded modules.",
      std::string(Module::kInterface));
  spec.build = [](const Value& config, BuildContext&) -> Value {
    return wrap_all(detail::parse_or_throw<Fsdp2Config>(config), "model/fsdp2_wrapped");
  };
  r.add_variant(std::move(spec));
}

}  // namespace
}  // namespace modalities::plugins::fsdp

MODALITIES_PLUGIN(fsdp, MODALITIES_PLUGIN_VERSION, modalities::plugins::fsdp::register_components)
