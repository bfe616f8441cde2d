// model/fsdp2_wrapped (README.md): Modalities' FSDP2WrappedModelConfig on the engine of
// fully_shard.cpp, over the dp_shard (and dp_replicate, HSDP) dims of a device_mesh.
#include "fully_shard.h"

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

  static void describe(Schema<Fsdp2Config>& s) {
    using C = Fsdp2Config;
    s.field("model", &C::model, "The model to shard (materialized, on the run device).").required();
    s.field("block_names", &C::block_names,
            "Class names of the blocks sharded as units, e.g. [\"GPT2Block\"]; names the model does not have are "
            "ignored, as in Modalities.")
        .required();
    s.field("mixed_precision_settings", &C::mixed_precision_settings, "{param_dtype, reduce_dtype}.").required();
    s.field("reshard_after_forward", &C::reshard_after_forward,
            "Free each unit's gathered parameters after its forward (gather again for backward).");
    s.field("device_mesh", &C::device_mesh, "Mesh with a dp_shard dim (and dp_replicate for HSDP).").required();
    s.field("layers_per_fsdp_unit", &C::layers_per_fsdp_unit, "Consecutive blocks per unit.").positive();
  }
};

std::shared_ptr<Module> wrap(const Fsdp2Config& c) {
  if (c.model.parts.size() != 1)
    throw ConfigError("model", fmt::format("fsdp2_wrapped shards one model here; got {} model parts (pipeline "
                                           "stages are not supported yet)",
                                           c.model.parts.size()));
  std::shared_ptr<Module> inner = c.model.parts.front().shared();
  const DeviceMesh& mesh = *c.device_mesh;
  if (!mesh.has_dim("dp_shard"))
    throw ConfigError("device_mesh", fmt::format("needs a dp_shard dim; the mesh has {}", mesh.dim_names()));
  for (const char* dim : {"tp", "pp", "cp"})
    if (mesh.has_dim(dim))
      throw ConfigError("device_mesh", fmt::format("has a '{}' dim; fsdp2_wrapped shards over dp_shard and "
                                                   "dp_replicate only in this version",
                                                   dim));
  ShardingOptions o;
  if (mesh.size() > 1) {
    o.shard_group = mesh.process_group("dp_shard");
    if (mesh.has_dim("dp_replicate")) o.replicate_group = mesh.process_group("dp_replicate");
  }
  o.reshard_after_forward = c.reshard_after_forward;
  o.blocks_per_unit = c.layers_per_fsdp_unit;
  o.param_dtype = mixed_precision_dtype(c.mixed_precision_settings.param_dtype);
  if (*o.param_dtype == at::kFloat) o.param_dtype.reset();
  o.reduce_dtype = mixed_precision_dtype(c.mixed_precision_settings.reduce_dtype);
  for (const std::string& name : c.block_names)
    for (const std::string& fqn : inner->submodules_of_class(name))
      if (std::find(o.block_fqns.begin(), o.block_fqns.end(), fqn) == o.block_fqns.end()) o.block_fqns.push_back(fqn);
  return fully_shard(std::move(inner), std::move(o));
}

void register_components(Registrar& r) {
  r.add<Module, Fsdp2Config>(
      "fsdp2_wrapped",
      "FSDP2-style fully sharded data parallelism: parameters sharded on dim 0 over dp_shard, one all-gather and "
      "one reduce-scatter per unit of blocks; HSDP with dp_replicate.",
      [](const Fsdp2Config& c) { return wrap(c); });
}

}  // namespace
}  // namespace modalities::plugins::fsdp

MODALITIES_PLUGIN(fsdp, "0.1.0", modalities::plugins::fsdp::register_components)
