// modalities/sdk/parallel.h: the mesh-dim codec, tokens per step and ParallelDims.
#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/parallel.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <fmt/format.h>

#include <limits>
#include <utility>

namespace modalities {

std::string_view mesh_dim_name(MeshDim dim) {
  switch (dim) {
    case MeshDim::pp: return "pp";
    case MeshDim::dp_replicate: return "dp_replicate";
    case MeshDim::dp_shard: return "dp_shard";
    case MeshDim::cp: return "cp";
    case MeshDim::tp: return "tp";
    case MeshDim::ep: return "ep";
  }
  throw Error(fmt::format("mesh dim {} is not one of MeshDim's values", static_cast<int>(dim)));
}

std::optional<MeshDim> parse_mesh_dim(std::string_view name) {
  for (MeshDim d : kMeshDims)
    if (mesh_dim_name(d) == name) return d;
  return std::nullopt;
}

std::vector<std::string> mesh_dim_names() {
  std::vector<std::string> out;
  for (MeshDim d : kMeshDims) out.emplace_back(mesh_dim_name(d));
  return out;
}

std::string join_mesh_dims(const std::vector<MeshDim>& dims) {
  if (dims.empty()) return "(none)";
  std::string out;
  for (MeshDim d : dims) {
    if (!out.empty()) out += ", ";
    out += mesh_dim_name(d);
  }
  return out;
}

std::int64_t tokens_per_step(std::int64_t local_micro_batch_size, std::int64_t sequence_length,
                             std::int64_t gradient_accumulation_steps, std::int64_t dp_degree) {
  const std::pair<const char*, std::int64_t> factors[] = {{"local_micro_batch_size", local_micro_batch_size},
                                                          {"sequence_length", sequence_length},
                                                          {"gradient_accumulation_steps", gradient_accumulation_steps},
                                                          {"dp_degree", dp_degree}};
  std::int64_t product = 1;
  for (const auto& [name, value] : factors) {
    if (value < 1) throw Error(fmt::format("tokens per step: {} must be at least 1, got {}", name, value));
    if (product > std::numeric_limits<std::int64_t>::max() / value)
      throw Error(
          fmt::format("tokens per step overflows 64 bits: local_micro_batch_size {} x sequence_length {} x "
                      "gradient_accumulation_steps {} x dp_degree {}",
                      local_micro_batch_size, sequence_length, gradient_accumulation_steps, dp_degree));
    product *= value;
  }
  return product;
}

ParallelDims::ParallelDims(std::int64_t world_size) : world_size_(world_size) {
  if (world_size < 1) throw Error(fmt::format("ParallelDims: the world size must be at least 1, got {}", world_size));
}

ParallelDims::ParallelDims(std::shared_ptr<const DeviceMesh> mesh) : mesh_(std::move(mesh)) {
  if (mesh_ == nullptr) throw Error("ParallelDims: no device mesh given (use ParallelDims(world_size) without one)");
  world_size_ = mesh_->size();
}

ParallelDims ParallelDims::of(std::shared_ptr<const DeviceMesh> mesh, std::int64_t world_size) {
  return mesh ? ParallelDims(std::move(mesh)) : ParallelDims(world_size);
}

ParallelDims::ParallelDims(const ParallelDims&) = default;
ParallelDims::ParallelDims(ParallelDims&&) noexcept = default;
ParallelDims& ParallelDims::operator=(const ParallelDims&) = default;
ParallelDims& ParallelDims::operator=(ParallelDims&&) noexcept = default;
ParallelDims::~ParallelDims() = default;

std::vector<MeshDim> ParallelDims::dims() const {
  return mesh_ ? mesh_->dims() : std::vector<MeshDim>{MeshDim::dp_shard};
}

bool ParallelDims::has(MeshDim dim) const { return mesh_ ? mesh_->has_dim(dim) : dim == MeshDim::dp_shard; }

std::int64_t ParallelDims::degree(MeshDim dim) const {
  if (mesh_) return mesh_->has_dim(dim) ? mesh_->size(dim) : 1;
  return dim == MeshDim::dp_shard ? world_size_ : 1;
}

std::int64_t ParallelDims::coordinate(MeshDim dim) const {
  if (mesh_) return mesh_->has_dim(dim) ? mesh_->coordinate(dim) : 0;
  return dim == MeshDim::dp_shard && world_size_ > 1 ? dist::rank() : 0;
}

ParallelDims::Group ParallelDims::group(MeshDim dim) const {
  if (degree(dim) <= 1) return {};
  return mesh_ ? mesh_->process_group(dim) : dist::world();
}

std::int64_t ParallelDims::shard_degree() const { return degree(MeshDim::dp_shard) * degree(MeshDim::cp); }

ParallelDims::Group ParallelDims::shard_group() const {
  if (!enabled(MeshDim::cp)) return group(MeshDim::dp_shard);
  return mesh_->sub_mesh({MeshDim::dp_shard, MeshDim::cp})->flattened_process_group();
}

std::int64_t ParallelDims::expert_shard_degree() const {
  return degree(MeshDim::dp_shard) * degree(MeshDim::cp) / degree(MeshDim::ep);
}

ParallelDims::Group ParallelDims::expert_shard_group() const {
  if (!enabled(MeshDim::ep)) return shard_group();
  return mesh_->expert_shard_process_group();  // null for one rank
}

std::int64_t ParallelDims::world_size() const { return world_size_; }

std::int64_t ParallelDims::dp_size() const {
  std::int64_t n = 1;
  for (MeshDim d : kMeshDims)
    if (shards_data(d)) n *= degree(d);
  return n;
}

std::int64_t ParallelDims::dp_rank() const {
  std::int64_t r = 0;
  for (MeshDim d : kMeshDims)
    if (shards_data(d)) r = r * degree(d) + coordinate(d);
  return r;
}

bool ParallelDims::counts_data() const {
  for (MeshDim d : kMeshDims)  // ep overlays dp_shard: its ranks count their own data
    if (!shards_data(d) && d != MeshDim::ep && coordinate(d) != 0) return false;
  return true;
}

std::int64_t ParallelDims::tokens_per_step(std::int64_t local_micro_batch_size, std::int64_t sequence_length,
                                           std::int64_t gradient_accumulation_steps) const {
  return modalities::tokens_per_step(local_micro_batch_size, sequence_length, gradient_accumulation_steps, dp_size());
}

bool ParallelDims::loss_parallel() const { return mesh_ && mesh_->loss_parallel(); }

std::string ParallelDims::describe() const {
  std::string out;
  for (MeshDim d : dims()) out += fmt::format("{}{} {}", out.empty() ? "" : " x ", mesh_dim_name(d), degree(d));
  if (enabled(MeshDim::ep)) out += fmt::format(" (ep {})", degree(MeshDim::ep));
  return out;
}

}  // namespace modalities
