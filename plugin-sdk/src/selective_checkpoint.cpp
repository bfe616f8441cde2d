// Selective activation checkpointing: the pass active on this thread and Modalities' policy
// (selective_checkpoint.h).
#include <modalities/sdk/error.h>
#include <modalities/sdk/selective_checkpoint.h>

#include <fmt/format.h>

#include <string>
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
  bool keep = false;
  if (!save_.contains(op)) {
    if (op == Op::kMatmul) matmuls_ += matmuls;
  } else if (op != Op::kMatmul) {
    keep = true;
  } else {
    // Modalities' policy keeps the odd-numbered aten.mm calls of a pass (1st, 3rd, ...).
    for (int k = 0; k < matmuls; ++k) keep = (++matmuls_ % 2 == 1) || keep;
  }
  if (keep) ++kept_calls_;
  return keep;
}

OpSlot::OpSlot(Op op, int matmuls) : pass_(current), op_(op) {
  if (pass_ == nullptr) return;
  kept_ = pass_->decide(op, matmuls);
  call_ = pass_->kept_calls();
  reuse_ = kept_ && pass_->recompute();
}

std::vector<at::Tensor> OpSlot::take(std::size_t count) {
  Kept& kept = pass_->kept();
  const auto mismatch = [&](const std::string& what) {
    return Error(
        fmt::format("selective activation checkpointing: the recomputation of a block asks for kept op "
                    "output {} ({}), which the first forward did not keep the same way: {}",
                    call_, count, what));
  };
  if (!reuse_) throw mismatch("this op is not reused");
  if (kept.next >= kept.entries.size()) throw mismatch("the first forward kept fewer ops");
  const Kept::Entry& e = kept.entries[kept.next];
  if (e.op != op_ || e.call != call_ || e.outputs.size() != count)
    throw mismatch(fmt::format("it kept op call {} with {} outputs there", e.call, e.outputs.size()));
  ++kept.next;
  // New tensors on the kept storage, without autograd history: the op records its backward node on
  // these, and the kept ones stay plain for a later recomputation (a second backward, retain_graph).
  std::vector<at::Tensor> out;
  out.reserve(e.outputs.size());
  for (const at::Tensor& t : e.outputs) out.push_back(t.variable_data());
  return out;
}

void OpSlot::keep(std::vector<at::Tensor> outputs) {
  if (pass_ == nullptr || !kept_ || pass_->recompute()) return;
  pass_->kept().entries.push_back({op_, call_, std::move(outputs)});
}

}  // namespace modalities::selective_checkpoint
