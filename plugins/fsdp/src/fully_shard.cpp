// See fully_shard.h for what the engine does; the notes here are about how.
//
// Parameter identity. The inner model's parameter tensors (the ones its forward uses, "module
// parameters") keep their TensorImpl for the whole run. While their unit is gathered, each is
// pointed (set_data) at a view of a buffer of its full, padded shape; otherwise at an empty
// tensor, so that nothing outside a forward/backward can read freed bytes. Gathering and freeing
// change only the buffer's storage bytes (StorageImpl data pointer and size), never a tensor:
// views that autograd saved in forward (e.g. a transposed weight) share that storage and see the
// re-gathered bytes in backward, and set_data leaves version counters alone. The shards the optimizer updates are separate leaf tensors,
// views into one flat buffer per unit.
//
// Ordering. Every collective is issued in an order that is the same on every rank: forward in
// block order, backward in autograd's order (reverse block order on CPU, the same graph on every
// rank), reduce-scatters when a unit's last gradient has accumulated.
#include "fully_shard.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/interfaces/removable_handle.h>
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/run_context.h>

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

namespace modalities::plugins::fsdp {
namespace {

using i64 = std::int64_t;

struct Param {
  std::string fqn;
  std::size_t bucket = 0;   // in its unit (Note [Expert parallelism])
  int world = 1, rank = 0;  // of the bucket's group
  at::Tensor module_param;  // the inner model's tensor; data: a view of `full`
  at::Tensor full;          // [rows_per_rank * world, rest...] in the gather dtype; its storage bytes come and go
  at::Tensor empty;         // [0, rest...], same dtype: the module parameter's data while the unit is not gathered
  at::Tensor shard;         // leaf the optimizer sees: [local_rows, rest...], a view into the unit's flat shard
  at::Tensor shard_padded;  // [rows_per_rank, rest...] view into the flat shard (zero rows past the end)
  std::vector<i64> full_shape;
  std::vector<i64> padded_full_shape;  // full_shape with rows_per_rank * world rows
  i64 rows = 0, rows_per_rank = 0, local_rows = 0, row_numel = 0;
  i64 offset = 0;  // into the unit's flat shard, in elements
  i64 padded_numel() const { return rows_per_rank * row_numel; }
};

// Note [Expert parallelism]
// Under expert parallelism the ranks of an ep group hold different experts, so the expert weights
// (ShardingOptions::expert_fqns) cannot be sharded over dp_shard with the rest: they are sharded
// over the ranks that hold the same experts (expert_shard_group, dp_shard x cp / ep of them).
// Each unit therefore keeps one bucket per communicator, the dense one and the expert one, each
// with its own flat shard, all-gather and reduce-scatter. A rank's gradient of its experts
// already sums what every rank of its ep group sent them (the all-to-all's backward), so the
// expert bucket divides its reduced sum by the whole data-parallel count over which the loss is
// averaged, expert shard ranks x ep (expert_grad_divide), where the dense one divides by its
// shard ranks; HSDP then averages both over the replicas alike.
struct Bucket {
  c10::intrusive_ptr<c10d::ProcessGroup> group;  // null: one rank
  int world = 1, rank = 0;
  double grad_divide = 1;           // the reduce-scattered sum is divided by it
  std::vector<std::size_t> params;  // indexes into Engine::params_
  at::Tensor flat_shard;            // [shard_numel], fp32 master values
  i64 shard_numel = 0;
  // A prefetched all-gather in flight (Note [Prefetching]): its work and output buffer.
  c10::intrusive_ptr<c10d::Work> pending;
  at::Tensor pending_buffer;
  at::Tensor pending_send;  // the shard cast to the gather dtype, alive until the gather ends
};

enum : std::size_t { kDense = 0, kExperts = 1 };

struct Unit {
  std::string name;                 // "root" or the first block's FQN (+ "..last")
  std::vector<std::string> blocks;  // hook points in forward order (empty for the root)
  std::vector<std::size_t> params;  // indexes into Engine::params_, every bucket's
  std::vector<Bucket> buckets;      // kDense, kExperts
  c10::ScalarType master = at::kFloat;
  bool root = false;
  bool gathered = false;
  bool in_flight = false;  // its all-gathers were started and not yet waited for
  int pending_grads = 0;   // module parameters of this unit still to accumulate this backward
  bool awaiting_grads = false;
};

// Frees / re-allocates the bytes of a tensor's storage without touching the tensor.
void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == 0) return;
  s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
}

void allocate_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const std::size_t bytes = static_cast<std::size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == bytes) return;
  TORCH_CHECK(s->allocator() != nullptr, "fsdp: a parameter buffer has no allocator");
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

class Engine;

struct GradAccumulated final : torch::autograd::PostAccumulateGradHook {
  Engine* engine;
  std::size_t unit;
  GradAccumulated(Engine* e, std::size_t u) : engine(e), unit(u) {}
  void operator()(const torch::autograd::Variable& /*param*/) override;
};

class Engine {
 public:
  Engine(std::shared_ptr<Module> inner, ShardingOptions o) : inner_(std::move(inner)), o_(std::move(o)) {
    if (o_.blocks_per_unit < 1)
      throw Error(fmt::format("fsdp: blocks per unit must be >= 1, got {}", o_.blocks_per_unit));
    if (o_.shard_group) {  // none: one process, nothing to communicate (same code path otherwise)
      world_ = o_.shard_group->getSize();
      rank_ = o_.shard_group->getRank();
    }
    if (o_.expert_grad_divide < 1)
      throw Error(fmt::format("fsdp: the expert gradient divisor must be >= 1, got {}", o_.expert_grad_divide));
    // Mixed precision (Note [Mixed precision]): the inner model computes in param_dtype.
    if (o_.param_dtype) inner_->set_param_dtype(o_.param_dtype);
    materialize_meta();
    move_to_run_device();
    build_units();
    install_hooks();
  }

  ~Engine() {
    for (auto& h : hooks_) h->remove();
    for (Param& p : params_) torch::autograd::impl::set_post_acc_grad_hooks(p.module_param, nullptr);
  }

  Module& inner() { return *inner_; }
  const Module& inner() const { return *inner_; }
  const std::vector<Param>& params() const { return params_; }
  int world() const { return world_; }
  int rank() const { return rank_; }
  // Whether every parameter is whole on this rank (one shard rank for each bucket).
  bool unsharded() const {
    return std::all_of(params_.begin(), params_.end(), [](const Param& p) { return p.world == 1; });
  }
  int replicas() const { return o_.replicate_group ? o_.replicate_group->getSize() : 1; }

  // Gathers every unit at full (master) precision, e.g. to read or re-initialize full
  // parameters, then frees them.
  template <class F>
  void with_all_gathered(F&& f) {
    for (std::size_t u = 0; u < units_.size(); ++u) release(u);  // a unit still gathered in param_dtype
    exact_ = true;
    for (std::size_t u = 0; u < units_.size(); ++u) gather(u);
    f();
    for (std::size_t u = 0; u < units_.size(); ++u) release(u);
    exact_ = false;
  }

  // Copies the module parameters' current (gathered) values into this rank's shards.
  void shards_from_module_params() {
    at::NoGradGuard no_grad;
    for (Param& p : params_) {
      p.shard_padded.zero_();
      if (p.local_rows > 0)
        p.shard.copy_(p.module_param.narrow(0, static_cast<i64>(p.rank) * p.rows_per_rank, p.local_rows));
    }
  }

  // Without gradient sync (a micro-batch that is not the last of its optimizer step) the full
  // gradients stay on the module parameters, where autograd keeps accumulating into them, and
  // are reduce-scattered once, in the backward that syncs.
  void set_requires_gradient_sync(bool sync) {
    std::lock_guard lock(mutex_);
    sync_ = sync;
  }

  void on_grad_accumulated(std::size_t u) {
    std::lock_guard lock(mutex_);
    on_gradient_in_backward();
    Unit& unit = units_[u];
    if (!unit.awaiting_grads) return;
    if (--unit.pending_grads > 0) return;
    unit.awaiting_grads = false;
    if (sync_) reduce_scatter(u);
    release(u);
  }

  // Note [End of backward]
  // Units whose parameters did not all receive a gradient (an unused parameter) are reduced, with
  // zeros for the missing ones, when the last backward in flight ends: the autograd engine runs a
  // callback queued by the first gradient of each backward pass. The last backward is known by
  // counting forwards with autograd (a pipeline schedule runs several before their backwards) and
  // ended backwards; which unit's gradient comes last depends on the model part (a pipeline
  // stage without the embedding ends with its first block, not the root).
  void on_gradient_in_backward() {
    if (callback_queued_) return;
    callback_queued_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { end_of_backward(); });
  }

  void forward_with_grad() {
    std::lock_guard lock(mutex_);
    ++in_flight_;
  }

  void end_of_backward() {
    std::lock_guard lock(mutex_);
    callback_queued_ = false;
    if (in_flight_ > 0) --in_flight_;
    if (in_flight_ > 0) return;
    for (std::size_t k = 0; k < units_.size(); ++k)
      if (units_[k].awaiting_grads) {
        units_[k].awaiting_grads = false;
        if (sync_) reduce_scatter(k);
        release(k);
      }
    discard_prefetches();
  }

  // Prefetches the ended backward started and did not consume (Note [Prefetching]): waited for and
  // dropped, so the next forward gathers the shards the optimizer will have updated.
  void discard_prefetches() {
    for (Unit& unit : units_) {
      if (!unit.in_flight) continue;
      for (Bucket& b : unit.buckets) {
        if (b.pending) b.pending->wait();
        b.pending.reset();
        b.pending_buffer = at::Tensor();
        b.pending_send = at::Tensor();
      }
      unit.in_flight = false;
    }
  }

 private:
  // A model built on the meta device (Modalities' order: model_raw on meta -> fsdp2_wrapped ->
  // model_initialized) gets uninitialized storage on the run device, as model_initialized's
  // Note [Materializing meta tensors] does; model_initialized then resets and initializes the full
  // tensors through apply_to_full_parameters. Without it the weights stay garbage, as in PyTorch.
  void materialize_meta() {
    std::vector<at::Tensor> tensors;
    for (const auto& item : inner_->module().named_parameters(/*recurse=*/true)) tensors.push_back(item.value());
    for (const auto& item : inner_->module().named_buffers(/*recurse=*/true)) tensors.push_back(item.value());
    for (at::Tensor& t : tensors) {
      if (!t.defined() || !t.is_meta()) continue;
      const at::Tensor storage = at::empty(t.sizes(), t.options().device(run_device()));
      t.unsafeGetTensorImpl()->shallow_copy_from(storage.getIntrusivePtr());
    }
  }

  // A model on the CPU (loaded from a checkpoint onto the CPU, say) moves to the run device before
  // it is sharded, as FSDP2's fully_shard moves CPU parameters to its mesh's device; afterwards a
  // sharded model cannot move (Module::to below).
  void move_to_run_device() {
    const c10::Device device = run_device();
    if (device.is_cpu()) return;
    const auto params = inner_->module().parameters(/*recurse=*/true);
    if (std::any_of(params.begin(), params.end(), [](const at::Tensor& t) { return t.defined() && t.is_cpu(); }))
      inner_->to(device, std::nullopt);
  }

  void build_units() {
    const NamedTensors named = inner_->named_parameters();
    std::unordered_set<const void*> seen;
    // Unit of each parameter: the unit of the block whose FQN prefixes it, else the root.
    std::vector<std::vector<std::string>> groups;
    for (std::size_t b = 0; b < o_.block_fqns.size(); b += static_cast<std::size_t>(o_.blocks_per_unit)) {
      const std::size_t end = std::min(o_.block_fqns.size(), b + static_cast<std::size_t>(o_.blocks_per_unit));
      groups.emplace_back(o_.block_fqns.begin() + static_cast<std::ptrdiff_t>(b),
                          o_.block_fqns.begin() + static_cast<std::ptrdiff_t>(end));
    }
    units_.resize(groups.size() + 1);
    const std::unordered_set<std::string> experts(o_.expert_fqns.begin(), o_.expert_fqns.end());
    for (Unit& unit : units_) {
      unit.buckets.resize(2);
      unit.buckets[kDense].group = o_.shard_group;
      unit.buckets[kDense].world = world_;
      unit.buckets[kDense].rank = rank_;
      unit.buckets[kDense].grad_divide = world_;
      Bucket& e = unit.buckets[kExperts];
      e.group = o_.expert_shard_group;
      if (e.group) {
        e.world = e.group->getSize();
        e.rank = e.group->getRank();
      }
      e.grad_divide = static_cast<double>(e.world) * static_cast<double>(o_.expert_grad_divide);
    }
    Unit& root = units_.back();
    root.name = "root";
    root.root = true;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      units_[g].blocks = groups[g];
      units_[g].name = groups[g].size() == 1 ? groups[g][0] : groups[g].front() + ".." + groups[g].back();
    }
    std::unordered_map<std::string, std::size_t> unit_of_block;
    for (std::size_t g = 0; g < groups.size(); ++g)
      for (const std::string& b : groups[g]) unit_of_block[b] = g;

    for (const auto& [fqn, t] : named) {
      if (!seen.insert(t.unsafeGetTensorImpl()).second) continue;
      if (t.dim() == 0)
        throw Error(fmt::format("fsdp: parameter {} is a 0-dim tensor, which cannot be sharded on dim 0", fqn));
      std::size_t u = units_.size() - 1;
      for (const auto& [block, g] : unit_of_block)
        if (fqn.size() > block.size() && fqn.compare(0, block.size(), block) == 0 && fqn[block.size()] == '.') u = g;
      Param p;
      p.fqn = fqn;
      p.bucket = experts.contains(fqn) ? kExperts : kDense;
      Bucket& bucket = units_[u].buckets[p.bucket];
      p.world = bucket.world;
      p.rank = bucket.rank;
      p.module_param = t;
      p.full_shape = t.sizes().vec();
      p.rows = t.size(0);
      p.row_numel = t.numel() / std::max<i64>(p.rows, 1);
      p.rows_per_rank = (p.rows + p.world - 1) / p.world;
      p.local_rows = std::clamp<i64>(p.rows - static_cast<i64>(p.rank) * p.rows_per_rank, 0, p.rows_per_rank);
      p.offset = bucket.shard_numel;
      bucket.shard_numel += p.padded_numel();
      bucket.params.push_back(params_.size());
      units_[u].params.push_back(params_.size());
      params_.push_back(std::move(p));
    }
    for (std::size_t u = 0; u < units_.size(); ++u) {
      Unit& unit = units_[u];
      if (unit.params.empty()) continue;
      const at::Tensor& first = params_[unit.params.front()].module_param;
      unit.master = first.scalar_type();
      for (Bucket& b : unit.buckets)
        if (!b.params.empty()) b.flat_shard = at::zeros({b.shard_numel}, first.options().requires_grad(false));
      for (std::size_t i : unit.params) {
        Param& p = params_[i];
        const Bucket& b = unit.buckets[p.bucket];
        if (p.module_param.scalar_type() != unit.master)
          throw Error(fmt::format("fsdp: parameter {} is {}, but the other parameters of unit {} are {}", p.fqn,
                                  c10::toString(p.module_param.scalar_type()), unit.name, c10::toString(unit.master)));
        std::vector<i64> padded_shape = p.full_shape;
        padded_shape[0] = p.rows_per_rank;
        p.shard_padded = b.flat_shard.narrow(0, p.offset, p.padded_numel()).view(padded_shape);
        at::Tensor local = p.shard_padded.narrow(0, 0, p.local_rows);
        {
          at::NoGradGuard no_grad;
          if (p.local_rows > 0)
            local.copy_(p.module_param.detach().narrow(0, static_cast<i64>(p.rank) * p.rows_per_rank, p.local_rows));
        }
        p.shard = local.detach().requires_grad_(p.module_param.requires_grad());
        // The module parameter becomes a view of its full (padded) buffer, in the gather dtype.
        // Not gathered: the module parameter is an empty tensor, so anything that reads it
        // outside a forward (the inner model's own state_dict(), conformance checks) reads no bytes.
        p.padded_full_shape = p.full_shape;
        p.padded_full_shape[0] = p.rows_per_rank * p.world;
        buffers_in(p, gather_dtype(unit));
        at::NoGradGuard no_grad;
        p.module_param.set_data(p.empty);
        torch::autograd::impl::set_post_acc_grad_hooks(p.module_param, std::make_unique<GradAccumulated>(this, u));
      }
    }
  }

  void install_hooks() {
    // The root's hooks ("") gather it before the whole forward; each unit's first block gathers
    // it, its last block frees it after forward and gathers it again when its gradient arrives.
    std::vector<std::string> points = {""};
    for (std::size_t u = 0; u < units_.size(); ++u)
      for (const std::string& b : units_[u].blocks) {
        points.push_back(b);
        unit_of_point_[b] = u;
      }
    const std::size_t root = units_.size() - 1;
    hooks_.push_back(inner_->add_hook(
        [this, root](const ModuleHookCall& c) {
          if (c.fqn.empty()) {
            if (c.point == HookPoint::kPreForward) {
              if (at::GradMode::is_enabled()) forward_with_grad();
              begin_forward(root);
            }
            return;
          }
          const std::size_t u = unit_of_point_.at(std::string(c.fqn));
          const Unit& unit = units_[u];
          if (c.point == HookPoint::kPreForward && c.fqn == unit.blocks.front()) {
            begin_forward(u);
          } else if (c.point == HookPoint::kForward && c.fqn == unit.blocks.back()) {
            // Without autograd (evaluation) nothing comes back for these parameters.
            if (o_.reshard_after_forward || !at::GradMode::is_enabled()) {
              std::lock_guard lock(mutex_);
              release(u);
            }
          } else if (c.point == HookPoint::kBackward && c.fqn == unit.blocks.back()) {
            std::lock_guard lock(mutex_);
            gather(u);
            if (u > 0) prefetch(u - 1);  // backward runs the blocks in reverse
          }
        },
        points));
  }

  // Note [Mixed precision]
  // With a param_dtype (bf16, say) other than the master shards' dtype, FSDP2's way: a unit is
  // all-gathered in param_dtype (the shard is cast before the collective, halving its bytes), so
  // the module parameters are param_dtype tensors while gathered, the model computes in it, and
  // autograd accumulates param_dtype gradients into them; the reduce-scatter then runs in
  // reduce_dtype (the gradient is cast into its send buffer) and the optimizer updates fp32 master
  // shards. Gathers for reading or re-initializing full parameters (with_all_gathered) move the
  // master dtype, so nothing written back to the shards is rounded. A parameter's dtype changes
  // only between passes, never while autograd holds views of its buffer.
  c10::ScalarType gather_dtype(const Unit& unit) const {
    return exact_ || !o_.param_dtype ? unit.master : *o_.param_dtype;
  }

  // (Re)creates a parameter's full and empty buffers in `dtype`; the full one without storage.
  static void buffers_in(Param& p, c10::ScalarType dtype) {
    if (p.full.defined() && p.full.scalar_type() == dtype) return;
    const auto options = p.module_param.options().dtype(dtype).requires_grad(false);
    p.full = at::empty(p.padded_full_shape, options);
    free_storage(p.full);
    std::vector<i64> empty_shape = p.full_shape;
    empty_shape[0] = 0;
    p.empty = at::empty(empty_shape, options);
  }

  void begin_forward(std::size_t u) {
    std::lock_guard lock(mutex_);
    Unit& unit = units_[u];
    // Pipeline schedules run several forwards before their backwards: while an earlier forward's
    // gradients are still to come, the unit's gathered parameters are in that forward's graph and
    // no optimizer step has run, so they stay as they are.
    const bool in_flight = at::GradMode::is_enabled() && unit.awaiting_grads;
    // Otherwise always from the current shards: the optimizer may have changed them since the last
    // gather (a prefetch in flight was started in this forward, after the last step).
    if (!in_flight && !unit.in_flight) release(u);
    gather(u);
    // Forward order: the root first, then the block units in order.
    if (unit.root) prefetch(0);
    else if (u + 1 < units_.size() - 1) prefetch(u + 1);
    if (at::GradMode::is_enabled()) {
      // Every forward in flight adds its gradients: the unit is reduced once, after the last.
      if (!in_flight) unit.pending_grads = 0;
      for (std::size_t i : unit.params)
        if (params_[i].module_param.requires_grad()) ++unit.pending_grads;
      unit.awaiting_grads = unit.pending_grads > 0;
    }
  }

  // Note [Prefetching]
  // With prefetching on, gathering unit u also starts the all-gather of the unit that runs next
  // (u + 1 in forward, u - 1 in backward; the root first prefetches unit 0) as an asynchronous
  // collective, so its communication overlaps u's compute; the next gather then only waits for it
  // and copies out. Every rank starts the same collectives in the same order. A prefetch is only
  // ever consumed within the same forward or backward pass that started it, so it never carries
  // stale shards: a backward prefetch that its pass does not consume (a model whose graph branches,
  // like CoCa's image and text towers, runs the blocks' backwards in an order other than the
  // reverse unit order) is dropped when the backward ends (discard_prefetches), before the
  // optimizer step.
  void start_gather(std::size_t u) {
    Unit& unit = units_[u];
    if (unit.gathered || unit.in_flight || unit.params.empty()) return;
    at::NoGradGuard no_grad;
    const c10::ScalarType dtype = gather_dtype(unit);
    for (Bucket& b : unit.buckets) {
      if (b.params.empty()) continue;
      b.pending_send = b.flat_shard.scalar_type() == dtype ? b.flat_shard : b.flat_shard.to(dtype);
      b.pending_buffer = at::empty({b.shard_numel * b.world}, b.flat_shard.options().dtype(dtype));
      if (b.world > 1) b.pending = b.group->_allgather_base(b.pending_buffer, b.pending_send);
      else b.pending_buffer.copy_(b.pending_send);
      bytes_gathered_ += static_cast<double>(b.pending_buffer.nbytes());
    }
    unit.in_flight = true;
  }

  void prefetch(std::size_t u) {
    if (o_.prefetch && u < units_.size()) start_gather(u);
  }

  void gather(std::size_t u) {
    Unit& unit = units_[u];
    if (unit.gathered || unit.params.empty()) {
      unit.gathered = true;
      return;
    }
    start_gather(u);
    at::NoGradGuard no_grad;
    for (Bucket& b : unit.buckets) {
      if (b.params.empty()) continue;
      if (b.pending) b.pending->wait();
      const at::Tensor gathered = b.pending_buffer;
      b.pending.reset();
      b.pending_buffer = at::Tensor();
      b.pending_send = at::Tensor();
      // A prefetch is consumed in the pass that started it (Note [Prefetching]), so it has this dtype.
      TORCH_CHECK(gathered.scalar_type() == gather_dtype(unit), "fsdp: unit ", unit.name, " was prefetched in ",
                  gathered.scalar_type(), " but is needed in ", gather_dtype(unit));
      const at::Tensor by_rank = gathered.view({b.world, b.shard_numel});
      for (std::size_t i : b.params) {
        Param& p = params_[i];
        buffers_in(p, gathered.scalar_type());
        allocate_storage(p.full);
        p.full.view({p.world, p.padded_numel()}).copy_(by_rank.narrow(1, p.offset, p.padded_numel()));
        // set_data keeps the parameter's identity and version counter; views of it that autograd
        // saved in forward share `full`'s storage and see these bytes.
        p.module_param.set_data(p.full.narrow(0, 0, p.rows));
      }
    }
    unit.in_flight = false;
    unit.gathered = true;
  }

  void release(std::size_t u) {
    Unit& unit = units_[u];
    if (!unit.gathered) return;
    at::NoGradGuard no_grad;
    for (std::size_t i : unit.params) {
      params_[i].module_param.set_data(params_[i].empty);
      free_storage(params_[i].full);
    }
    unit.gathered = false;
  }

  void reduce_scatter(std::size_t u) {
    for (Bucket& b : units_[u].buckets)
      if (!b.params.empty()) reduce_scatter(b);
  }

  void reduce_scatter(Bucket& b) {
    at::NoGradGuard no_grad;
    const c10::ScalarType reduce = o_.reduce_dtype.value_or(b.flat_shard.scalar_type());
    at::Tensor send = at::zeros({b.world, b.shard_numel}, b.flat_shard.options().dtype(reduce));
    for (std::size_t i : b.params) {
      Param& p = params_[i];
      const at::Tensor& g = p.module_param.grad();
      if (!g.defined()) continue;
      // Rows [r * rows_per_rank, ...) of the (zero-padded) full gradient go to rank r.
      at::Tensor padded = at::zeros({p.rows_per_rank * p.world, p.row_numel}, send.options());
      padded.narrow(0, 0, p.rows).copy_(g.reshape({p.rows, p.row_numel}));
      send.narrow(1, p.offset, p.padded_numel()).copy_(padded.view({p.world, p.padded_numel()}));
      p.module_param.mutable_grad().reset();
    }
    at::Tensor mine = at::empty({b.shard_numel}, send.options());
    at::Tensor flat = send.view({-1});
    bytes_reduced_ += static_cast<double>(flat.nbytes());
    if (b.world > 1) b.group->_reduce_scatter_base(mine, flat)->wait();
    else mine.copy_(flat);
    mine.div_(b.grad_divide);
    if (o_.replicate_group && o_.replicate_group->getSize() > 1) {
      std::vector<at::Tensor> t = {mine};
      o_.replicate_group->allreduce(t)->wait();
      mine.div_(static_cast<double>(o_.replicate_group->getSize()));
    }
    const at::Tensor master =
        mine.scalar_type() == b.flat_shard.scalar_type() ? mine : mine.to(b.flat_shard.scalar_type());
    for (std::size_t i : b.params) {
      Param& p = params_[i];
      if (!p.shard.requires_grad()) continue;
      std::vector<i64> padded_shape = p.full_shape;
      padded_shape[0] = p.rows_per_rank;
      const at::Tensor g = master.narrow(0, p.offset, p.padded_numel()).view(padded_shape).narrow(0, 0, p.local_rows);
      at::Tensor& grad = p.shard.mutable_grad();
      if (grad.defined()) grad.add_(g);
      else grad = g.clone();
    }
  }

  std::shared_ptr<Module> inner_;
  ShardingOptions o_;
  int world_ = 1, rank_ = 0;
  std::vector<Param> params_;
  std::vector<Unit> units_;
  std::unordered_map<std::string, std::size_t> unit_of_point_;
  std::vector<std::shared_ptr<RemovableHandle>> hooks_;
  std::recursive_mutex mutex_;  // backward hooks run on autograd's threads
  bool sync_ = true;
  int in_flight_ = 0;             // forwards with autograd whose backward has not ended (Note [End of backward])
  bool callback_queued_ = false;  // the end-of-backward callback of the running backward is queued
  bool exact_ = false;            // gather in the master dtype (with_all_gathered; Note [Mixed precision])
  double bytes_gathered_ = 0, bytes_reduced_ = 0;  // since construction; see traffic()

 public:
  /// Bytes this rank's all-gathers produced and its reduce-scatters consumed (the collectives'
  /// full buffers) since construction, and the parameter bytes of one full (padded) model in the
  /// gather dtype.
  struct Traffic {
    double gathered = 0, reduced = 0, model = 0, root = 0;
  };
  Traffic traffic() const {
    Traffic t{bytes_gathered_, bytes_reduced_, 0, 0};
    for (const Unit& unit : units_)
      for (const Bucket& bucket : unit.buckets) {
        if (!bucket.flat_shard.defined()) continue;
        const double b = static_cast<double>(bucket.shard_numel * bucket.world) *
                         static_cast<double>(c10::elementSize(gather_dtype(unit)));
        t.model += b;
        if (unit.root) t.root += b;
      }
    return t;
  }
};

void GradAccumulated::operator()(const torch::autograd::Variable&) { engine->on_grad_accumulated(unit); }

// --- the Module ---------------------------------------------------------------------------

class FullyShardedModule final : public Module {
 public:
  FullyShardedModule(std::shared_ptr<Module> inner, ShardingOptions o)
      : engine_(std::make_unique<Engine>(std::move(inner), std::move(o))) {}

  // MODALITIES_FSDP_TRAFFIC=1: the first rank of the shard group reports the collective traffic of
  // the whole run when the model is destroyed (scripts/bench_distributed.sh reads it).
  ~FullyShardedModule() override {
    if (std::getenv("MODALITIES_FSDP_TRAFFIC") == nullptr || engine_->rank() != 0) return;
    const Engine::Traffic t = engine_->traffic();
    std::fprintf(stderr,
                 "fsdp traffic: all-gathered %.0f bytes, reduce-scattered %.0f bytes; model %.0f bytes (root unit "
                 "%.0f) over %d shard ranks\n",
                 t.gathered, t.reduced, t.model, t.root, engine_->world());
  }

  TensorMap forward(const TensorMap& inputs) override { return engine_->inner().forward(inputs); }
  torch::nn::Module& module() override { return engine_->inner().module(); }
  const torch::nn::Module& module() const override { return engine_->inner().module(); }

  NamedTensors named_parameters() const override {
    NamedTensors out;
    for (const Param& p : engine_->params()) out.emplace_back(p.fqn, p.shard);
    return out;
  }

  // Parameters as this rank's shards (with shard_placements()), buffers as the inner model has them.
  StateDict state_dict() const override {
    StateDict out;
    std::unordered_map<const void*, const Param*> by_impl;
    for (const Param& p : engine_->params()) by_impl[p.module_param.unsafeGetTensorImpl()] = &p;
    for (const auto& item : engine_->inner().module().named_parameters(/*recurse=*/true)) {
      const auto it = by_impl.find(item.value().unsafeGetTensorImpl());
      if (it != by_impl.end()) out[item.key()] = it->second->shard.detach();
    }
    for (const auto& item : engine_->inner().module().named_buffers(/*recurse=*/true)) out[item.key()] = item.value();
    return out;
  }

  // Accepts this rank's shards (the shapes state_dict() gives) or full tensors (this rank's rows
  // are taken). Buffers go to the inner model.
  void load_state_dict(const StateDict& state, bool strict) override {
    at::NoGradGuard no_grad;
    std::unordered_map<const void*, const Param*> by_impl;
    for (const Param& p : engine_->params()) by_impl[p.module_param.unsafeGetTensorImpl()] = &p;
    std::unordered_set<std::string> used;
    for (const auto& item : engine_->inner().module().named_parameters(/*recurse=*/true)) {
      const auto it = by_impl.find(item.value().unsafeGetTensorImpl());
      if (it == by_impl.end()) continue;
      const Param& p = *it->second;
      const auto s = state.find(item.key());
      if (s == state.end()) {
        if (strict) throw Error(fmt::format("fsdp: load_state_dict: missing key {}", item.key()));
        continue;
      }
      used.insert(item.key());
      const at::Tensor& v = s->second;
      if (v.sizes() == p.shard.sizes()) {
        p.shard.copy_(v);
      } else if (v.sizes().vec() == p.full_shape) {
        if (p.local_rows > 0)
          p.shard.copy_(v.narrow(0, static_cast<std::int64_t>(p.rank) * p.rows_per_rank, p.local_rows));
      } else {
        throw Error(
            fmt::format("fsdp: load_state_dict: {} has shape {}, expected the full shape {} or this rank's "
                        "shard {}",
                        item.key(), v.sizes().vec(), p.full_shape, p.shard.sizes().vec()));
      }
    }
    StateDict buffers;
    for (const auto& item : engine_->inner().module().named_buffers(/*recurse=*/true))
      if (auto s = state.find(item.key()); s != state.end()) {
        item.value().copy_(s->second);
        used.insert(item.key());
      }
    if (strict)
      for (const auto& [k, v] : state)
        if (!used.contains(k)) throw Error(fmt::format("fsdp: load_state_dict: unexpected key {}", k));
  }

  // Every state_dict() name of a sharded parameter, aliases included (a tied lm_head.weight is the
  // same shard as wte.weight and must be placed like it, or a checkpoint would take it as whole).
  //
  // Over a model that is itself split (model/gpt2_tp: its parameters are blocks of the full
  // tensors, placed by its own shard_placements), a shard is a block of that block: the offsets
  // add up and the global shape is the inner one's.
  std::map<std::string, ShardPlacement> shard_placements() const override {
    std::map<std::string, ShardPlacement> inner = engine_->inner().shard_placements();
    // One shard: every rank holds whole (inner) tensors (NO_SHARD, one process).
    if (engine_->unsharded()) return inner;
    std::unordered_map<const void*, const Param*> by_impl;
    for (const Param& p : engine_->params()) by_impl[p.module_param.unsafeGetTensorImpl()] = &p;
    std::map<std::string, ShardPlacement> out;
    for (const auto& item : engine_->inner().module().named_parameters(/*recurse=*/true)) {
      const auto it = by_impl.find(item.value().unsafeGetTensorImpl());
      if (it == by_impl.end()) continue;
      const Param& p = *it->second;
      ShardPlacement s;
      if (const auto in = inner.find(item.key()); in != inner.end()) {
        s = in->second;
      } else {
        s.global_shape = p.full_shape;
        s.offsets.assign(p.full_shape.size(), 0);
      }
      s.offsets[0] += std::min<std::int64_t>(static_cast<std::int64_t>(p.rank) * p.rows_per_rank, p.rows);
      s.replicas *= engine_->replicas();
      out[item.key()] = std::move(s);
    }
    return out;
  }

  void train(bool on) override { engine_->inner().train(on); }
  bool is_training() const override { return engine_->inner().is_training(); }

  void to(const c10::Device& device, std::optional<c10::ScalarType> dtype) override {
    const c10::Device mine = engine_->params().empty() ? device : engine_->params().front().shard.device();
    if (device != mine || dtype)
      throw Error(
          fmt::format("fsdp: a sharded model cannot be moved or cast after wrapping (it is on {}; asked for "
                      "{}{}); build the model on the run device before model/fsdp2_wrapped",
                      mine.str(), device.str(), dtype ? std::string(", ") + c10::toString(*dtype) : ""));
  }

  std::string sample_key() const override { return engine_->inner().sample_key(); }
  std::string prediction_key() const override { return engine_->inner().prediction_key(); }
  std::map<std::string, std::vector<std::string>> weight_decay_groups() const override {
    return engine_->inner().weight_decay_groups();
  }
  std::vector<std::string> block_fqns() const override { return engine_->inner().block_fqns(); }
  std::vector<std::string> submodules_of_class(std::string_view class_name) const override {
    return engine_->inner().submodules_of_class(class_name);
  }

  // Every rank re-initializes the full model the same way (same seed, same RNG use as one
  // process), then keeps its rows.
  void reset_parameters() override {
    apply_to_full_parameters([](Module& full) { full.reset_parameters(); });
  }

  void apply_to_full_parameters(const std::function<void(Module&)>& fn) override {
    engine_->with_all_gathered([&] {
      engine_->inner().apply_to_full_parameters(fn);  // a split inner model (gpt2_tp) gathers its part too
      engine_->shards_from_module_params();
    });
  }

  std::shared_ptr<RemovableHandle> add_hook(ModuleHook hook, std::span<const std::string> fqns) override {
    return engine_->inner().add_hook(std::move(hook), fqns);
  }
  std::shared_ptr<RemovableHandle> add_block_runner(BlockRunner runner, std::span<const std::string> fqns) override {
    return engine_->inner().add_block_runner(std::move(runner), fqns);
  }

  bool synchronizes_gradients() const override { return true; }
  void set_requires_gradient_sync(bool sync) override { engine_->set_requires_gradient_sync(sync); }
  std::optional<tp::VocabShard> vocab_shard() const override { return engine_->inner().vocab_shard(); }
  std::optional<cp::SequenceShard> sequence_shard() const override { return engine_->inner().sequence_shard(); }
  std::vector<std::string> expert_parallel_parameters() const override {
    return engine_->inner().expert_parallel_parameters();
  }
  std::vector<ModelMetric> take_metrics() override { return engine_->inner().take_metrics(); }
  std::map<std::string, double> parameter_activity() const override { return engine_->inner().parameter_activity(); }

 private:
  std::unique_ptr<Engine> engine_;
};

}  // namespace

std::shared_ptr<Module> fully_shard(std::shared_ptr<Module> inner, ShardingOptions options) {
  if (!inner) throw Error("fsdp: no model to wrap");
  return std::make_shared<FullyShardedModule>(std::move(inner), std::move(options));
}

std::shared_ptr<Module> shard_over_mesh(std::shared_ptr<Module> inner, const DeviceMesh& mesh,
                                        const Fsdp2Options& options) {
  if (!mesh.has_dim(MeshDim::dp_shard))
    throw ConfigError("device_mesh", fmt::format("needs a dp_shard dim; the mesh has {}", join_mesh_dims(mesh.dims())));
  // tp and pp dims are fine: the model was split for tensor parallelism, or is this rank's
  // pipeline stage, and each rank shards its own part over dp_shard. Context-parallel ranks hold
  // the same parameters and compute gradients of different tokens: the shards span dp_shard x cp
  // (ParallelDims::shard_group), whose reduce-scatter averages the gradients over both.
  ShardingOptions o;
  if (mesh.size() > 1) {
    o.shard_group = mesh.has_dim(MeshDim::cp)
                        ? mesh.sub_mesh({MeshDim::dp_shard, MeshDim::cp})->flattened_process_group()
                        : mesh.process_group(MeshDim::dp_shard);
    if (mesh.has_dim(MeshDim::dp_replicate)) o.replicate_group = mesh.process_group(MeshDim::dp_replicate);
  }
  // Expert parallelism (Note [Expert parallelism]): the experts this rank holds are sharded over the
  // ranks holding the same ones.
  o.expert_fqns = inner->expert_parallel_parameters();
  if (!o.expert_fqns.empty()) {
    if (!mesh.has_dim(MeshDim::ep))
      throw ConfigError("device_mesh",
                        fmt::format("has no ep dim, but the model's experts were split over ranks ({} and more)",
                                    o.expert_fqns.front()));
    o.expert_shard_group = mesh.expert_shard_process_group();  // null when it is one rank
    o.expert_grad_divide = mesh.size(MeshDim::ep);
  }
  o.reshard_after_forward = options.reshard_after_forward;
  o.blocks_per_unit = options.layers_per_fsdp_unit;
  o.prefetch = options.prefetch;
  o.param_dtype = mixed_precision_dtype(options.mixed_precision_settings.param_dtype);
  if (*o.param_dtype == at::kFloat) o.param_dtype.reset();
  o.reduce_dtype = mixed_precision_dtype(options.mixed_precision_settings.reduce_dtype);
  for (const std::string& name : options.block_names)
    for (const std::string& fqn : inner->submodules_of_class(name))
      if (std::find(o.block_fqns.begin(), o.block_fqns.end(), fqn) == o.block_fqns.end()) o.block_fqns.push_back(fqn);
  return fully_shard(std::move(inner), std::move(o));
}

}  // namespace modalities::plugins::fsdp
