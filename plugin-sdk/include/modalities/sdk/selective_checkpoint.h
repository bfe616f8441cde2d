// Selective activation checkpointing (Modalities' selective_op_activation_checkpointing) for
// model authors: inside a selectively checkpointed block, the outputs of the ops a policy names
// are kept from the block's first forward and handed back, instead of being computed again, when
// the block is recomputed in backward; every other op is recomputed.
//
// PyTorch does this below autograd for every ATen kernel (torch.utils.checkpoint's
// create_selective_checkpoint_contexts). LibTorch has no such mode, so a model's own ops take
// part explicitly: an op that computes its outputs below autograd and then records its backward
// node (as gpt2's fused ops do) asks an OpSlot first.
//
// \code
//   selective_checkpoint::OpSlot slot(selective_checkpoint::Op::kMatmul, /*matmuls=*/1);
//   at::Tensor y;
//   if (slot.reuse()) {
//     y = slot.take(1)[0];                   // the recomputation: the value of the first forward
//   } else {
//     { at::AutoDispatchBelowADInplaceOrView g; y = at::mm(x, w.t()); }
//     slot.keep({y});                        // the first forward: kept if the policy saves it
//   }
//   ... record the backward node on y as always (it saves x and w, not y) ...
// \endcode
//
// Outside a selectively checkpointed block an OpSlot does nothing (reuse() is false, keep()
// keeps nothing). The kept tensors are exactly the values the recomputation would produce
// (the same op on the same inputs, with the random state replayed), so gradients do not change.
// An op that draws random numbers must not be kept (its draws would be skipped on reuse); the
// matmul ops below draw none.
#pragma once

#include <modalities/sdk/export.h>

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <vector>

namespace modalities::selective_checkpoint {

/// The kinds of op a policy can keep. kMatmul: a projection x W^T without a bias, or a fused op
/// holding several (it says how many); Modalities' key "ops.aten.mm.default" (with a bias PyTorch
/// computes aten.addmm, which that key does not name: such a projection counts 0 matmuls).
enum class Op : int { kMatmul = 0 };

/// The outputs kept by one block's first forward, in call order, each with the op and the number
/// of its call among the pass's kept ops (checked when the recomputation takes them); `next` is
/// where the current recomputation reads (every recomputation reads all of them, from the start:
/// a second backward with retain_graph recomputes again).
struct Kept {
  struct Entry {
    Op op;
    std::int64_t call;
    std::vector<at::Tensor> outputs;
  };
  std::vector<Entry> entries;
  std::size_t next = 0;
};

/// One pass through a selectively checkpointed block (the first forward, or the recomputation in
/// backward), active on this thread for its lifetime. Modalities' policy: an op is kept when its
/// kind is in `save` and, for matmuls, unless it is an even-numbered matmul of the pass (Modalities
/// keeps every second aten.mm); an op holding several matmuls counts each and is kept when any of
/// them would be.
class MODALITIES_SDK_API Pass {
 public:
  Pass(std::set<Op> save, std::shared_ptr<Kept> kept, bool recompute);
  ~Pass();
  Pass(const Pass&) = delete;
  Pass& operator=(const Pass&) = delete;

  /// Whether the current op (of `matmuls` matmuls) is kept; counts it.
  bool decide(Op op, int matmuls);
  /// Number of kept ops decided so far in this pass (identifies an entry of Kept).
  std::int64_t kept_calls() const { return kept_calls_; }
  bool recompute() const { return recompute_; }
  Kept& kept() { return *kept_; }

 private:
  std::set<Op> save_;
  std::shared_ptr<Kept> kept_;
  bool recompute_;
  std::int64_t matmuls_ = 0;
  std::int64_t kept_calls_ = 0;
  Pass* outer_;
};

/// One op call inside the model (see the example above).
class MODALITIES_SDK_API OpSlot {
 public:
  explicit OpSlot(Op op, int matmuls = 1);
  /// True in a recomputation when this op's outputs were kept: take() them instead of computing.
  bool reuse() const { return reuse_; }
  /// The `count` kept outputs (reuse() only); throws modalities::Error when the recomputation asks
  /// for other ops, or other outputs, than the first forward kept.
  std::vector<at::Tensor> take(std::size_t count);
  /// In a first forward: keeps `outputs` when the policy saves this op. Elsewhere: nothing.
  void keep(std::vector<at::Tensor> outputs);

 private:
  Pass* pass_ = nullptr;
  Op op_ = Op::kMatmul;
  std::int64_t call_ = -1;
  bool kept_ = false;
  bool reuse_ = false;
};

}  // namespace modalities::selective_checkpoint
