// Selective activation checkpointing: the pass active on this thread and Modalities' policy
// (selective_checkpoint.h).
#include <modalities/sdk/error.h>
#include <modalities/sdk/selective_checkpoint.h>

#include <fmt/format.h>

#include <utility>

namespace modalities::selective_checkpoint {
namespace {
thread_local Pass* current = nullptr;
}  // namespace

Pass::Pass(std::set<Op> save, std::shared_ptr<Kept> kept, bool recompute)
    : save_(std::move(save)), kept_(std::move(kept)), recompute_(recompute), outer_(current) {
  current = this;
}

Pass::~Pass() { current = outer_; }

bool Pass::decide(Op op, int matmuls) {
  if (!save_.contains(op)) {
    if (op == Op::kMatmul) matmuls_ += matmuls;
    return false;
  }
  if (op != Op::kMatmul) return true;
  // Modalities' policy keeps the odd-numbered aten.mm calls of a pass (1st, 3rd, ...).
  bool any_odd = false;
  for (int k = 0; k < matmuls; ++k) any_odd = any_odd || (++matmuls_ % 2 == 1);
  return any_odd;
}

OpSlot::OpSlot(Op op, int matmuls) : pass_(current) {
  if (pass_ == nullptr) return;
  kept_ = pass_->decide(op, matmuls);
  reuse_ = kept_ && pass_->recompute();
}

std::vector<at::Tensor> OpSlot::take() {
  if (!reuse_ || pass_->kept().empty())
    throw Error("selective activation checkpointing: the recomputation of a block asks for an op output the first "
                "forward did not keep (the block ran different ops the second time)");
  std::vector<at::Tensor> out = std::move(pass_->kept().front());
  pass_->kept().pop_front();
  return out;
}

void OpSlot::keep(std::vector<at::Tensor> outputs) {
  if (pass_ == nullptr || !kept_ || pass_->recompute()) return;
  pass_->kept().push_back(std::move(outputs));
}

}  // namespace modalities::selective_checkpoint
