// The device-mesh interface: the ranks of a run arranged in typed dimensions
// (MeshDim: pp, dp_replicate, dp_shard, cp, tp; ep overlaid on dp_shard x cp), with this rank's
// coordinates and a process group per dimension. Most code asks through ParallelDims (parallel.h). LibTorch has no DeviceMesh, so this is the
// SDK's own, built on c10d process groups (`device_mesh/default`). Maps
// torch.distributed.DeviceMesh as Modalities uses it.
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/parallel.h>

#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

// Forward declaration keeps this header light (ProcessGroup.hpp pulls in all
// of ATen); code that calls into a process group includes
// <torch/csrc/distributed/c10d/ProcessGroup.hpp> itself.
namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace modalities {

/// A named, row-major grid of ranks and the communicators along its dims.
///
/// Built once per run, early (it creates process groups, a collective call on
/// every rank). Afterwards everything is const and thread-safe; consumers
/// (FSDP/TP wrappers, the multi-dim sampler, gradient clippers, the MFU
/// calculator, `number_conversion/parallel_degree`) query it at build time.
///
/// \code
///   std::int64_t data_rank = mesh->coordinate(MeshDim::dp_shard);
///   auto shard = mesh->sub_mesh({MeshDim::dp_replicate, MeshDim::dp_shard});  // hybrid sharding
///   shard->flattened_process_group()->allreduce(tensors)->wait();
///   std::int64_t dp = ParallelDims(mesh).dp_size();  // degrees of absent dims count 1
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); sub-meshes and
/// process groups are shared with it and stay valid while anyone holds them.
/// Errors: a dim the mesh does not have throws modalities::Error naming the mesh's dims; never exit().
/// Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API DeviceMesh {
 public:
  static constexpr std::string_view kInterface = "DeviceMesh";
  static constexpr std::string_view kComponentKey = "device_mesh";

  DeviceMesh() = default;
  DeviceMesh(const DeviceMesh&) = delete;
  DeviceMesh& operator=(const DeviceMesh&) = delete;
  virtual ~DeviceMesh();  // defined in the SDK library: one vtable, one typeinfo

  /// The mesh's dims, a subsequence of kMeshDims (mesh order).
  virtual std::vector<MeshDim> dims() const = 0;

  /// Whether `dim` is one of dims(). Absent dims count as size 1 for
  /// degree computations (ParallelDims).
  virtual bool has_dim(MeshDim dim) const = 0;

  /// Number of ranks in the mesh (product of all dim sizes).
  virtual std::int64_t size() const = 0;

  /// Size of one dim.
  virtual std::int64_t size(MeshDim dim) const = 0;

  /// This rank's coordinate along `dim`, in [0, size(dim)): the data-parallel
  /// rank for samplers, the pipeline rank, ...
  virtual std::int64_t coordinate(MeshDim dim) const = 0;

  /// This rank's position in the whole (sub-)mesh, row-major over its dims:
  /// the "local rank within a sub-mesh" of Modalities.
  virtual std::int64_t rank() const = 0;

  /// Device type the mesh was built for ("cuda", "cpu").
  virtual std::string device_type() const = 0;

  /// The sub-mesh over `dims` (listed in mesh order) that contains this rank.
  virtual std::shared_ptr<const DeviceMesh> sub_mesh(const std::vector<MeshDim>& dims) const = 0;

  /// Communicator of the ranks that differ from this one only along `dim`.
  virtual c10::intrusive_ptr<c10d::ProcessGroup> process_group(MeshDim dim) const = 0;

  /// Communicator over all ranks of this (sub-)mesh, its dims flattened
  /// (e.g. dp_replicate x dp_shard for data-parallel reductions).
  virtual c10::intrusive_ptr<c10d::ProcessGroup> flattened_process_group() const = 0;

  /// Expert parallelism (`expert_parallel_degree` of device_mesh/default): the ep dim is not one
  /// of dims() but overlays dp_shard x cp. Ranks that differ only there are split into ep groups
  /// of consecutive (dp_shard, cp) coordinates: has_dim(ep), size(ep), coordinate(ep) and
  /// process_group(ep) answer for it on the mesh itself (not on sub-meshes). This is the
  /// communicator of the ranks that hold the same experts as this one: same coordinates outside
  /// dp_shard x cp and the same ep coordinate (dp_shard x cp / ep of them; torchtitan's
  /// dp_shard_mod_ep), over which FSDP shards the expert weights. Null when there is no ep dim or
  /// that group has one rank. Default: null. Since: SDK 0.1 (ABI 7).
  virtual c10::intrusive_ptr<c10d::ProcessGroup> expert_shard_process_group() const;

  /// Whether the run asked for loss parallelism (`enable_loss_parallel`): a tensor-parallel model
  /// then returns logits split on the vocabulary and the loss reduces over the `tp` dim.
  virtual bool loss_parallel() const = 0;
};

}  // namespace modalities
