// The torch::nn::Module tree of model/gpt2 (Modalities' GPT2LLM): names, registration order and
// forward as in Modalities, op for op (README.md, "Numerics"). Only the root is declared here; the
// layers (Linear, Embedding, norms, RoPE, attention, MLPs, blocks) live in modules.cpp.
//
// Shape legend: B batch, T sequence length, d = n_embd, V = vocab_size,
// Hq / Hkv query / key-value heads, hd = d / Hq head dim, r = Hq / Hkv.
#pragma once

#include "config.h"

#include <modalities/sdk/module_hooks.h>
#include <modalities/sdk/tensor_parallel.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/moduledict.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace modalities::plugins::gpt2 {

// Mixed precision: parameters keep their storage dtype; every use casts to `Dt`
// when set (FSDP2's param_dtype, README.md). See Module::set_param_dtype.
using Dt = std::optional<c10::ScalarType>;

inline at::Tensor cast(const at::Tensor& t, Dt dt) {
  if (!dt || !t.defined() || t.scalar_type() == *dt) return t;
  return t.to(*dt);
}

using Remap = std::function<at::Tensor(const at::Tensor&)>;

// Tensor parallelism (Module::apply_tensor_parallel, `model/gpt2_tp`, README.md): the SDK's plan
// (modalities/sdk/tensor_parallel.h) says how this rank's part of the model talks to the others.
using TpPlan = tp::Plan;

class EmbeddingImpl;
class LinearImpl;
class NormImpl;

class GPT2LLMImpl final : public torch::nn::Module {
 public:
  GPT2LLMImpl(const GPT2Config& c, const at::TensorOptions& o);
  // ids: [B, T] token ids -> logits [B, T, V]. A pipeline part without wte takes
  // hidden states [B, T, d] instead; parts without lm_head return hidden states.
  //
  // Inside, activations are [B*T, d] matrices (one row per token): every Linear is then a
  // plain mm, without the flatten/unflatten views (and their backward nodes) that a
  // [B, T, d] input costs per projection. Same kernels on the same memory, so the results
  // are bit-identical to the 3-d layout; it saves ~10 ops per projection per step.
  at::Tensor forward(const at::Tensor& input, Dt dt);
  // Pipeline stage: drops every module of `transformer` (and every block) that is neither named
  // nor an ancestor of a named one. The forward skips what is missing.
  void retain(const std::vector<std::string>& fqns);
  // Tensor parallel: every module learns the plan; the weights were split by GPT2::parallelize.
  void parallelize(std::shared_ptr<const TpPlan> plan);
  const TpPlan* tp_plan() const { return tp_.get(); }
  // The root's forward with its hooks around it (kPreForward, kForward, kBackward of "").
  at::Tensor hooked_forward(const at::Tensor& input, Dt dt);
  ModuleHooks& hooks() { return hooks_; }
  std::vector<std::string> block_keys() const;
  bool tied() const;
  /// The dtype parameters are stored in (the embedding's; float32 for a part without it).
  c10::ScalarType storage_dtype() const;
  bool has_lm_head() const { return lm_head_ != nullptr; }
  /// reset() of every Leaf under `m` (including m), pre-order = Modalities' post-order
  /// over modules with reset_parameters (only leaves own tensors).
  static void reset_leaves(torch::nn::Module& m);
  /// remap() of every Leaf; tensors shared between leaves (weight tying) stay shared.
  void remap_leaves(const Remap& f);

 private:
  // The embedding of token ids with this rank's rows [rank * V/tp, ...) of the table: ids outside
  // the slice look up row 0 and are zeroed, and the sum over the ranks (TpPlan::leave) is the
  // whole embedding, exactly (x + 0 = x).
  at::Tensor vocab_parallel_embedding(const at::Tensor& ids, std::int64_t B, std::int64_t T, Dt dt) const;

  bool absolute_;
  std::int64_t sequence_length_;
  double dropout_;
  std::shared_ptr<EmbeddingImpl> wte_, wpe_;
  std::shared_ptr<NormImpl> lm_head_norm_;
  std::shared_ptr<LinearImpl> lm_head_;
  torch::nn::ModuleDict h_{nullptr};
  torch::nn::ModuleDict transformer_{nullptr};
  ModuleHooks hooks_;
  std::shared_ptr<const TpPlan> tp_;  // model/gpt2_tp
};

}  // namespace modalities::plugins::gpt2
