// The typed parallel layout: the dims a device mesh can have (MeshDim), their names (the one
// codec between configs and code), and ParallelDims, what every parallelism asks of the mesh
// (degrees, groups, the data-parallel size and rank, tokens per step). Plugins never spell a
// mesh dim as a string: configs do, and parse_mesh_dim turns them into MeshDim.
#pragma once

#include <modalities/sdk/export.h>

#include <c10/util/intrusive_ptr.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace modalities {

class DeviceMesh;

/// The dims of a device mesh. A mesh lists the dims it has in this order, outermost first:
/// ranks that differ only along the last dim are neighbours (consecutive ranks), as in
/// Modalities and torchtitan. `ep` (expert parallel) is carved out of dp_shard x cp, as torchtitan
/// does: ranks that differ there read different data and, grouped by `ep`, hold different experts.
enum class MeshDim : std::uint8_t { pp, dp_replicate, dp_shard, cp, tp, ep };

/// Every dim, in mesh order. `ep` is last but overlays dp_shard x cp: it adds no factor to the
/// world size (DeviceMesh::expert_shard_process_group).
inline constexpr std::array<MeshDim, 6> kMeshDims = {MeshDim::pp, MeshDim::dp_replicate, MeshDim::dp_shard,
                                                     MeshDim::cp, MeshDim::tp,           MeshDim::ep};

/// The name configs and messages use: Modalities' spelling ("dp_shard").
MODALITIES_SDK_API std::string_view mesh_dim_name(MeshDim dim);

/// The dim a name stands for, or nullopt for any other string.
MODALITIES_SDK_API std::optional<MeshDim> parse_mesh_dim(std::string_view name);

/// Every name in mesh order (for a Schema's one_of).
MODALITIES_SDK_API std::vector<std::string> mesh_dim_names();

/// "dp_shard, tp"; "(none)" when empty.
MODALITIES_SDK_API std::string join_mesh_dims(const std::vector<MeshDim>& dims);

/// Whether ranks along `dim` read different data: the data-parallel dims. Ranks that differ only
/// in pp, cp or tp read the same samples; ep is carved out of dp_shard (and cp), so its ranks
/// read what their dp_shard coordinates say.
constexpr bool shards_data(MeshDim dim) { return dim == MeshDim::dp_replicate || dim == MeshDim::dp_shard; }

/// Tokens one optimizer step trains on over all ranks: local micro batch x sequence length x
/// gradient accumulation steps x data-parallel degree. The one place this product is formed (the
/// gym, the settings checks, number conversions and the examples call it). Throws
/// modalities::Error naming the factors when one is below 1 or the product overflows 64 bits.
MODALITIES_SDK_API std::int64_t tokens_per_step(std::int64_t local_micro_batch_size, std::int64_t sequence_length,
                                                std::int64_t gradient_accumulation_steps, std::int64_t dp_degree);

/// What the parallelisms need of a run's layout, answered for every dim whether or not the mesh
/// has it (an absent dim has degree 1, coordinate 0 and no group). A value: cheap to copy, it
/// shares the mesh it was made from.
///
/// \code
///   const ParallelDims dims(mesh);                       // or ParallelDims{} in one process
///   if (dims.enabled(MeshDim::tp)) split(dims.group(MeshDim::tp), dims.coordinate(MeshDim::tp));
///   sampler.shard(dims.dp_rank(), dims.dp_size());
/// \endcode
///
/// Since: SDK 0.1 (ABI 6; the expert shard group: ABI 7).
class MODALITIES_SDK_API ParallelDims {
 public:
  using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

  /// No mesh: `world_size` ranks, all data parallel (this rank is dist::rank()); one process by
  /// default.
  explicit ParallelDims(std::int64_t world_size = 1);
  /// The layout of `mesh` (not null).
  explicit ParallelDims(std::shared_ptr<const DeviceMesh> mesh);
  /// `mesh`, or the world of `world_size` data-parallel ranks when it is null.
  static ParallelDims of(std::shared_ptr<const DeviceMesh> mesh, std::int64_t world_size);

  ParallelDims(const ParallelDims&);
  ParallelDims(ParallelDims&&) noexcept;
  ParallelDims& operator=(const ParallelDims&);
  ParallelDims& operator=(ParallelDims&&) noexcept;
  ~ParallelDims();

  /// The mesh, or null when there is none.
  const std::shared_ptr<const DeviceMesh>& mesh() const { return mesh_; }
  /// The dims the mesh lists, in mesh order (without a mesh: dp_shard).
  std::vector<MeshDim> dims() const;
  /// Whether the mesh lists `dim` (dp_shard is always listed, also with degree 1).
  bool has(MeshDim dim) const;
  /// Ranks along `dim`; 1 when the mesh does not have it.
  std::int64_t degree(MeshDim dim) const;
  /// degree(dim) > 1.
  bool enabled(MeshDim dim) const { return degree(dim) > 1; }
  /// This rank's coordinate along `dim`; 0 when the mesh does not have it.
  std::int64_t coordinate(MeshDim dim) const;
  /// The communicator of the ranks that differ from this one only along `dim`; null when
  /// degree(dim) is 1 (nothing to talk to).
  Group group(MeshDim dim) const;

  /// The ranks FSDP shards the (dense) parameters over: dp_shard x cp (context-parallel ranks
  /// hold the same parameters and their gradients are averaged over them, as torchtitan's
  /// dp_shard_cp), and their communicator (null for one rank). Since: SDK 0.1 (ABI 9).
  std::int64_t shard_degree() const;
  Group shard_group() const;

  /// Expert parallelism: the ranks holding the same experts as this one (degree(dp_shard) x
  /// degree(cp) / degree(ep) of them; all data parallel), over which FSDP shards the expert
  /// weights, and their communicator (null for one rank). Without an ep dim: shard_group().
  std::int64_t expert_shard_degree() const;
  Group expert_shard_group() const;

  /// Ranks of the run.
  std::int64_t world_size() const;
  /// Data-parallel degree: the product of the degrees of the dims that shard data.
  std::int64_t dp_size() const;
  /// This rank's data-parallel rank, in [0, dp_size()): row-major over dp_replicate, dp_shard.
  std::int64_t dp_rank() const;
  /// Whether this rank is the one of its data-parallel slice that counts the slice's samples
  /// (coordinate 0 along every dim that does not shard data; the data ledger's rule).
  bool counts_data() const;
  /// tokens_per_step(micro batch, sequence length, accumulation, dp_size()).
  std::int64_t tokens_per_step(std::int64_t local_micro_batch_size, std::int64_t sequence_length,
                               std::int64_t gradient_accumulation_steps) const;
  /// The mesh's enable_loss_parallel (false without a mesh).
  bool loss_parallel() const;
  /// "dp_shard 2 x tp 2" (every listed dim with its degree; "dp_shard 4 (ep 2)" under expert
  /// parallelism), for messages.
  std::string describe() const;

 private:
  std::shared_ptr<const DeviceMesh> mesh_;
  std::int64_t world_size_ = 1;
};

}  // namespace modalities
