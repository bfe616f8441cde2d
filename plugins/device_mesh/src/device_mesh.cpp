// device_mesh/default (README.md): the ranks of the run as a named row-major grid
// (pp, dp_replicate, dp_shard, cp, tp), with Modalities' DeviceMeshConfig validation, and c10d
// process groups along its dims built on the host's runtime (modalities/sdk/distributed.h).
//
// Process groups are created when the mesh is built, on every rank in the same order (a
// collective): one per dim and one per run of adjacent dims (the flattened groups, e.g.
// dp_replicate x dp_shard for hybrid sharding, or the whole mesh). A sub-mesh over dims that are
// not adjacent has no flattened group (its per-dim groups exist); asking for one is an error
// that says so. In a single process the mesh has every dim of size 1 and no process groups.
//
// Expert parallelism (expert_parallel_degree > 1) adds no dim to the grid: the ep dim overlays
// dp_shard x cp, as torchtitan carves it. With f = coordinate(dp_shard) x cp + coordinate(cp),
// this rank's ep coordinate is f mod ep and its ep group the ranks with the same f / ep (and the
// same pp, dp_replicate, tp); the ranks with the same f mod ep hold the same experts (the expert
// shard group, dp_shard x cp / ep ranks).
#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/plugin.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace modalities::plugins::device_mesh {
namespace {

using i64 = std::int64_t;

// The dims this variant builds, in mesh order (kMeshDims without ep).
constexpr std::array<MeshDim, 5> kDimOrder = {MeshDim::pp, MeshDim::dp_replicate, MeshDim::dp_shard, MeshDim::cp,
                                              MeshDim::tp};

struct DeviceMeshConfig {
  std::string device_type = "cuda";
  i64 data_parallel_replicate_degree = 1;
  std::optional<i64> data_parallel_shard_degree;
  i64 tensor_parallel_degree = 1;
  i64 pipeline_parallel_degree = 1;
  i64 context_parallel_degree = 1;
  i64 expert_parallel_degree = 1;
  std::optional<bool> enable_loss_parallel = false;
  std::optional<i64> world_size;

  static void describe(Schema<DeviceMeshConfig>& s) {
    using C = DeviceMeshConfig;
    s.field("device_type", &C::device_type, "Device of the mesh: \"cuda\" (NCCL) or \"cpu\" (Gloo).")
        .one_of({"cuda", "cpu"});
    s.field("data_parallel_replicate_degree", &C::data_parallel_replicate_degree,
            "Replicas of the sharded model (HSDP); -1 = infer from the world size.")
        .at_least(-1);
    s.field("data_parallel_shard_degree", &C::data_parallel_shard_degree,
            "Ranks a model replica is sharded over (FSDP); -1 = infer from the world size.")
        .required()
        .at_least(-1);
    s.field("tensor_parallel_degree", &C::tensor_parallel_degree, "Tensor-parallel ranks.").positive();
    s.field("pipeline_parallel_degree", &C::pipeline_parallel_degree, "Pipeline stages.").positive();
    s.field("context_parallel_degree", &C::context_parallel_degree, "Context-parallel ranks.").positive();
    s.field("expert_parallel_degree", &C::expert_parallel_degree,
            "Expert-parallel ranks (torchtitan's key): carved out of the data-parallel dp_shard x cp ranks, so it "
            "adds no factor to world_size and must divide dp_shard x cp; the routed experts of a MoE model are "
            "split over them.")
        .positive();
    s.field("enable_loss_parallel", &C::enable_loss_parallel,
            "Loss parallelism over the tensor-parallel dim; needs tensor_parallel_degree > 1.");
    s.field("world_size", &C::world_size, "Number of ranks, usually ${cuda_env:WORLD_SIZE}.").required().positive();
    s.rule([](const C& c, ParseContext& ctx) {
      if (c.data_parallel_replicate_degree == 0)
        ctx.fail("data_parallel_replicate_degree", "must be -1 or >= 1, got 0");
      if (c.data_parallel_shard_degree && *c.data_parallel_shard_degree == 0)
        ctx.fail("data_parallel_shard_degree", "must be -1 or >= 1, got 0");
      if (c.data_parallel_replicate_degree == -1 && c.data_parallel_shard_degree == -1)
        ctx.fail("data_parallel_shard_degree", "at most one of the two data-parallel degrees may be -1 (inferred)");
      if (c.enable_loss_parallel.value_or(false) && c.tensor_parallel_degree <= 1)
        ctx.fail("enable_loss_parallel", "needs tensor_parallel_degree > 1");
    });
  }
};

// The degrees in kDimOrder, after inferring the -1 one; the product must be the world size.
std::array<i64, 5> resolve_degrees(const DeviceMeshConfig& c) {
  const i64 world = c.world_size.value_or(1);
  std::array<i64, 5> d = {c.pipeline_parallel_degree, c.data_parallel_replicate_degree,
                          c.data_parallel_shard_degree.value_or(1), c.context_parallel_degree,
                          c.tensor_parallel_degree};
  const auto product_without = [&](std::size_t skip) {
    i64 p = 1;
    for (std::size_t k = 0; k < d.size(); ++k)
      if (k != skip) p *= d[k];
    return p;
  };
  for (std::size_t k : {std::size_t{1}, std::size_t{2}}) {
    if (d[k] != -1) continue;
    const i64 others = product_without(k);
    if (world % others != 0)
      throw ConfigError(std::string(k == 1 ? "data_parallel_replicate_degree" : "data_parallel_shard_degree"),
                        fmt::format("cannot infer -1: world_size {} is not divisible by the product {} of the other "
                                    "degrees",
                                    world, others));
    d[k] = world / others;
  }
  i64 product = 1;
  for (i64 x : d) product *= x;
  if (product != world)
    throw ConfigError("world_size",
                      fmt::format("the degrees multiply to {} (pp {} x dp_replicate {} x dp_shard {} x cp {} "
                                  "x tp {}), but world_size is {}",
                                  product, d[0], d[1], d[2], d[3], d[4], world));
  if (c.expert_parallel_degree > 1 && (d[2] * d[3]) % c.expert_parallel_degree != 0)
    throw ConfigError("expert_parallel_degree",
                      fmt::format("is {}, which does not divide the data_parallel_shard_degree {} x "
                                  "context_parallel_degree {} = {} it is carved out of",
                                  c.expert_parallel_degree, d[2], d[3], d[2] * d[3]));
  return d;
}

// State shared by a mesh and its sub-meshes.
struct MeshState {
  std::vector<MeshDim> names;  // mesh dims, in kDimOrder
  std::vector<i64> sizes;
  std::vector<i64> coord;  // this rank's coordinate per dim
  std::string device_type;
  std::map<std::vector<std::size_t>, c10::intrusive_ptr<c10d::ProcessGroup>> groups;  // by adjacent dim run
  bool distributed = false;
  bool loss_parallel = false;
  // Expert parallelism (overlaying dp_shard x cp): degree, this rank's coordinate and groups.
  i64 ep = 1, ep_coord = 0;
  c10::intrusive_ptr<c10d::ProcessGroup> ep_group, ep_shard_group;
};

class Mesh final : public DeviceMesh {
 public:
  Mesh(std::shared_ptr<const MeshState> state, std::vector<std::size_t> dims)
      : s_(std::move(state)), dims_(std::move(dims)) {}

  // The ep dim overlays dp_shard x cp and is answered by the whole mesh only.
  bool has_ep() const { return s_->ep > 1 && dims_.size() == s_->names.size(); }

  std::vector<MeshDim> dims() const override {
    std::vector<MeshDim> out;
    for (std::size_t d : dims_) out.push_back(s_->names[d]);
    return out;
  }
  bool has_dim(MeshDim dim) const override { return dim == MeshDim::ep ? has_ep() : find(dim).has_value(); }
  std::int64_t size() const override {
    i64 n = 1;
    for (std::size_t d : dims_) n *= s_->sizes[d];
    return n;
  }
  std::int64_t size(MeshDim dim) const override {
    if (dim == MeshDim::ep) {
      ep_or_throw();
      return s_->ep;
    }
    return s_->sizes[at(dim)];
  }
  std::int64_t coordinate(MeshDim dim) const override {
    if (dim == MeshDim::ep) {
      ep_or_throw();
      return s_->ep_coord;
    }
    return s_->coord[at(dim)];
  }
  std::int64_t rank() const override {
    i64 r = 0;
    for (std::size_t d : dims_) r = r * s_->sizes[d] + s_->coord[d];
    return r;
  }
  std::string device_type() const override { return s_->device_type; }

  std::shared_ptr<const DeviceMesh> sub_mesh(const std::vector<MeshDim>& dims) const override {
    if (dims.empty()) throw Error("device_mesh: sub_mesh needs at least one dim");
    std::vector<std::size_t> picked;
    for (const MeshDim name : dims) {
      const std::size_t d = at(name);
      if (!picked.empty() && d <= picked.back())
        throw Error(fmt::format("device_mesh: sub_mesh dims [{}] must be distinct and in mesh order ({})",
                                join_mesh_dims(dims), join_mesh_dims(this->dims())));
      picked.push_back(d);
    }
    return std::make_shared<Mesh>(s_, std::move(picked));
  }

  c10::intrusive_ptr<c10d::ProcessGroup> process_group(MeshDim dim) const override {
    if (dim == MeshDim::ep) {
      ep_or_throw();
      if (!s_->distributed) throw Error("device_mesh: a single-process mesh has no process groups");
      return s_->ep_group;
    }
    return group({at(dim)});
  }
  c10::intrusive_ptr<c10d::ProcessGroup> expert_shard_process_group() const override {
    return has_ep() ? s_->ep_shard_group : nullptr;
  }
  c10::intrusive_ptr<c10d::ProcessGroup> flattened_process_group() const override { return group(dims_); }
  bool loss_parallel() const override { return s_->loss_parallel; }

 private:
  void ep_or_throw() const {
    if (has_ep()) return;
    throw Error(s_->ep > 1
                    ? fmt::format("device_mesh: the ep dim overlays dp_shard x cp and is known to the whole mesh "
                                  "only, not to a sub-mesh over {}",
                                  join_mesh_dims(dims()))
                    : fmt::format("device_mesh: no dim 'ep' in this mesh (dims: {}; set "
                                  "expert_parallel_degree > 1 for one)",
                                  join_mesh_dims(dims())));
  }

  std::optional<std::size_t> find(MeshDim dim) const {
    for (std::size_t d : dims_)
      if (s_->names[d] == dim) return d;
    return std::nullopt;
  }
  std::size_t at(MeshDim dim) const {
    if (auto d = find(dim)) return *d;
    throw Error(
        fmt::format("device_mesh: no dim '{}' in this mesh (dims: {})", mesh_dim_name(dim), join_mesh_dims(dims())));
  }
  c10::intrusive_ptr<c10d::ProcessGroup> group(const std::vector<std::size_t>& dims) const {
    if (!s_->distributed)
      throw Error("device_mesh: a single-process mesh has no process groups (every dim has size 1)");
    const auto it = s_->groups.find(dims);
    if (it == s_->groups.end()) {
      std::vector<MeshDim> names;
      for (std::size_t d : dims) names.push_back(s_->names[d]);
      throw Error(
          fmt::format("device_mesh: no process group over [{}]: flattened groups exist for adjacent mesh dims "
                      "only (mesh: {})",
                      join_mesh_dims(names), join_mesh_dims(s_->names)));
    }
    return it->second;
  }

  std::shared_ptr<const MeshState> s_;
  std::vector<std::size_t> dims_;
};

// The ep groups and the expert shard groups (the file's comment): every rank creates every group,
// in the same order (ascending keys), and keeps the two it is in.
void build_expert_groups(MeshState& state, const std::array<i64, 5>& d, int mesh_id) {
  const i64 ep = state.ep, world = d[0] * d[1] * d[2] * d[3] * d[4];
  // Coordinates of a global rank in kDimOrder (row-major).
  const auto coords = [&](i64 r) {
    std::array<i64, 5> c{};
    for (std::size_t k = 5; k-- > 0;) {
      c[k] = r % d[k];
      r /= d[k];
    }
    return c;
  };
  // (pp, dp_replicate, tp, f / ep) for the ep groups and (pp, dp_replicate, tp, f % ep) for the shard groups.
  std::map<std::array<i64, 4>, std::vector<int>> ep_groups, shard_groups;
  for (i64 r = 0; r < world; ++r) {
    const auto c = coords(r);
    const i64 f = c[2] * d[3] + c[3];
    ep_groups[{c[0], c[1], c[4], f / ep}].push_back(static_cast<int>(r));
    shard_groups[{c[0], c[1], c[4], f % ep}].push_back(static_cast<int>(r));
  }
  const auto mine = coords(dist::rank());
  state.ep_coord = (mine[2] * d[3] + mine[3]) % ep;
  if (!state.distributed) return;
  int k = 0;
  for (const auto& [key, ranks] : ep_groups)
    if (auto g = dist::new_group(ranks, fmt::format("mesh{}/ep/{}", mesh_id, k++))) state.ep_group = std::move(g);
  k = 0;
  if (d[2] * d[3] / ep > 1)
    for (const auto& [key, ranks] : shard_groups)
      if (auto g = dist::new_group(ranks, fmt::format("mesh{}/ep_shard/{}", mesh_id, k++)))
        state.ep_shard_group = std::move(g);
}

std::shared_ptr<DeviceMesh> build_mesh(const DeviceMeshConfig& c) {
  const std::array<i64, 5> degrees = resolve_degrees(c);
  auto state = std::make_shared<MeshState>();
  state->device_type = c.device_type;
  state->loss_parallel = c.enable_loss_parallel.value_or(false);
  for (std::size_t k = 0; k < kDimOrder.size(); ++k)
    if (degrees[k] > 1 || kDimOrder[k] == MeshDim::dp_shard) {
      state->names.push_back(kDimOrder[k]);
      state->sizes.push_back(degrees[k]);
    }
  const i64 world = c.world_size.value_or(1);
  if (world != dist::world_size())
    throw ConfigError(
        "world_size",
        fmt::format("is {}, but this run has {} process(es) ({}){}", world, dist::world_size(), dist::env().source,
                    dist::world_size() == 1 ? ": start it with `modalities launch`, torchrun "
                                              "or srun"
                                            : ""));
  // This rank's coordinates: row-major over the mesh dims.
  const std::size_t n = state->names.size();
  state->coord.assign(n, 0);
  i64 rest = dist::rank();
  for (std::size_t k = n; k-- > 0;) {
    state->coord[k] = rest % state->sizes[k];
    rest /= state->sizes[k];
  }
  state->distributed = world > 1;
  static int meshes_built = 0;  // every rank builds the same meshes in the same order
  const int mesh_id = meshes_built++;
  if (state->distributed) {
    // Row-major strides of the global rank.
    std::vector<i64> stride(n, 1);
    for (std::size_t k = n - 1; k-- > 0;) stride[k] = stride[k + 1] * state->sizes[k + 1];
    // For every run [a, b) of adjacent dims: one group per assignment of the other dims' coordinates.
    for (std::size_t a = 0; a < n; ++a)
      for (std::size_t b = a + 1; b <= n; ++b) {
        std::vector<std::size_t> run;
        for (std::size_t k = a; k < b; ++k) run.push_back(k);
        std::string run_name;
        for (std::size_t k : run)
          run_name += (run_name.empty() ? "" : "+") + std::string(mesh_dim_name(state->names[k]));
        // Enumerate the other dims' coordinates (row-major), then the run's (row-major): ascending ranks.
        std::vector<std::size_t> others;
        for (std::size_t k = 0; k < n; ++k)
          if (k < a || k >= b) others.push_back(k);
        i64 outer = 1, inner = 1;
        for (std::size_t k : others) outer *= state->sizes[k];
        for (std::size_t k : run) inner *= state->sizes[k];
        for (i64 o = 0; o < outer; ++o) {
          i64 base = 0, left = o;
          for (std::size_t j = others.size(); j-- > 0;) {
            base += (left % state->sizes[others[j]]) * stride[others[j]];
            left /= state->sizes[others[j]];
          }
          std::vector<int> ranks;
          for (i64 i = 0; i < inner; ++i) {
            i64 r = base, l = i;
            for (std::size_t j = run.size(); j-- > 0;) {
              r += (l % state->sizes[run[j]]) * stride[run[j]];
              l /= state->sizes[run[j]];
            }
            ranks.push_back(static_cast<int>(r));
          }
          auto g = dist::new_group(ranks, fmt::format("mesh{}/{}/{}", mesh_id, run_name, o));
          if (g) state->groups[run] = std::move(g);
        }
      }
  }
  state->ep = c.expert_parallel_degree;
  if (state->ep > 1) build_expert_groups(*state, degrees, mesh_id);
  std::vector<std::size_t> all(n);
  for (std::size_t k = 0; k < n; ++k) all[k] = k;
  return std::make_shared<Mesh>(std::move(state), std::move(all));
}

void register_components(Registrar& r) {
  r.add<DeviceMesh, DeviceMeshConfig>(
      "default",
      "The ranks as a named grid (pp, dp_replicate, dp_shard, cp, tp) with a process group per dim and per run of "
      "adjacent dims, and ep carved out of dp_shard x cp; Modalities' DeviceMeshConfig.",
      [](const DeviceMeshConfig& c) { return build_mesh(c); });
}

}  // namespace
}  // namespace modalities::plugins::device_mesh

MODALITIES_PLUGIN(device_mesh, MODALITIES_PLUGIN_VERSION, modalities::plugins::device_mesh::register_components)
