// The torch::nn::Module tree of model/gpt2 (Modalities' GPT2LLM): names, registration order and
// forward as in Modalities, op for op (README.md, "Numerics"). Only the root is declared here; the
// layers (Embedding, norms, RoPE, attention, MLPs, blocks) live in modules.cpp, the reusable ones
// (Linear, SwiGLU, the feed-forward seam) in layers.h.
//
// Shape legend: B batch, T sequence length, d = n_embd, V = vocab_size,
// Hq / Hkv query / key-value heads, hd = d / Hq head dim, r = Hq / Hkv.
#pragma once

#include "config.h"
#include "layers.h"

#include <modalities/sdk/context_parallel.h>
#include <modalities/sdk/module_hooks.h>
#include <modalities/sdk/tensor_parallel.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/moduledict.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace modalities::plugins::gpt2 {

class EmbeddingImpl;
class NormImpl;
class GPT2BlockImpl;

// Document masking (GPT2Config::document_ids_key; modules.cpp, Note [Document masking]): what every
// block's attention needs in one forward, built once from the document ids. Kept alive by the
// blocks' functions until their backward (activation checkpointing runs them again).
struct Documents {
  // [B, 1, T, T] bool: token i may attend to j (same document, causal, window); undefined when
  // `lengths` serve instead.
  at::Tensor mask;
  // [B, T] int64: each token's position in its document (restart); else undefined. Under context
  // parallelism [B or 1, T / cp]: the positions of this rank's tokens (in the whole sequence, or
  // in their documents with restart).
  at::Tensor positions;
  // Per sample, the lengths of its documents in order (they tile T) when the documents are
  // contiguous runs of ids and there is no sliding window: then pytorch_flash attends document by
  // document (causal SDPA on each) instead of over the masked T x T. Empty otherwise.
  std::vector<std::vector<std::int64_t>> lengths;
  // The same documents as cumulative lengths over the flattened batch (int32 [documents + 1], on
  // the ids' device) and the longest: the flash-attention varlen kernel's input on CUDA. Set with
  // `lengths` when the ids are on a CUDA device.
  at::Tensor cu_seqlens;
  std::int64_t max_length = 0;

  // Context parallelism (Note [Context-parallel attention]): the split of the sequence, its whole
  // length, and per local chunk (this rank's two) the keys each query row may see, bool [B or 1, 1,
  // L, (c + 1) L] for chunk c of length L; undefined masks: plain causal attention over the prefix.
  const cp::SequenceShard* cp = nullptr;
  std::int64_t cp_length = 0;
  std::array<at::Tensor, 2> cp_masks;
};

class GPT2LLMImpl final : public torch::nn::Module {
 public:
  // `ffn` makes the feed-forward of the blocks it chooses (layers.h); the others get model/gpt2's MLP.
  GPT2LLMImpl(const GPT2Config& c, const at::TensorOptions& o, const FeedForwardFactory& ffn = {});
  // ids: [B, T] token ids -> logits [B, T, V]. A pipeline part without wte takes
  // hidden states [B, T, d] instead; parts without lm_head return hidden states.
  //
  // Inside, activations are [B*T, d] matrices (one row per token): every Linear is then a
  // plain mm, without the flatten/unflatten views (and their backward nodes) that a
  // [B, T, d] input costs per projection. Same kernels on the same memory, so the results
  // are bit-identical to the 3-d layout; it saves ~10 ops per projection per step.
  // With `docs`, attention stays inside documents (and positions restart, if it has them).
  at::Tensor forward(const at::Tensor& input, Dt dt, std::shared_ptr<const Documents> docs = nullptr);
  // The Documents of document ids [B, T] (equal ids: one document); null when every sample is one
  // document (plain causal attention, bit for bit). One host sync.
  std::shared_ptr<const Documents> documents(const at::Tensor& ids, bool restart_positions) const;
  // Context parallelism (Module::apply_context_parallel): this rank computes its tokens of every
  // sequence (a part with wte takes whole ids and keeps its tokens); `docs` must then come from
  // context_parallel_documents.
  void set_context_parallel(std::shared_ptr<const cp::SequenceShard> shard);
  const cp::SequenceShard* context_parallel() const { return cp_.get(); }
  // The Documents of a context-parallel forward over sequences of `length` tokens on `device`:
  // this rank's positions and, with several documents (ids [B, length], may be undefined), a
  // sliding window or manual attention, the masks of its two chunks. One host sync with ids.
  std::shared_ptr<const Documents> context_parallel_documents(const at::Tensor& ids, std::int64_t length,
                                                              bool restart_positions, const c10::Device& device) const;
  // Pipeline stage: drops every module of `transformer` (and every block) that is neither named
  // nor an ancestor of a named one. The forward skips what is missing.
  void retain(const std::vector<std::string>& fqns);
  // Tensor parallel: every module learns the plan; the weights were split by GPT2::parallelize.
  void parallelize(std::shared_ptr<const TpPlan> plan);
  // Throws modalities::Error when a block's feed-forward cannot take part in `plan`
  // (FeedForward::check_tensor_parallel).
  void check_tensor_parallel(const TpPlan& plan) const;
  const TpPlan* tp_plan() const { return tp_.get(); }
  // Expert parallelism: every block's feed-forward keeps its share of the experts
  // (FeedForward::parallelize_experts); the FQNs of the parameters split.
  std::vector<std::string> parallelize_experts(const ExpertParallel& ep);
  // Module::parameter_activity: every block's feed-forward's, by FQN.
  std::map<std::string, double> parameter_activity() const;
  // Module::take_metrics: every block's feed-forward's (FeedForward::take_metrics).
  std::vector<ModelMetric> take_metrics();
  // Whether a block's feed-forward leaves an auxiliary loss (FeedForward::has_aux_loss).
  bool has_aux_losses() const;
  // The sum of the blocks' auxiliary losses of the last forward (FeedForward::take_aux_loss, or
  // through a block runner: Note [Auxiliary losses through a block runner]), undefined when no
  // block left one.
  at::Tensor take_aux_losses();
  // The root's forward with its hooks around it (kPreForward, kForward, kBackward of "").
  at::Tensor hooked_forward(const at::Tensor& input, Dt dt, std::shared_ptr<const Documents> docs = nullptr);
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
  // f(FeedForward&) for the feed-forward of every block this part holds (modules.cpp).
  template <class F>
  void for_each_feed_forward(F&& f) const;
  // The embedding of token ids with this rank's rows [rank * V/tp, ...) of the table: ids outside
  // the slice look up row 0 and are zeroed, and the sum over the ranks (TpPlan::leave) is the
  // whole embedding, exactly (x + 0 = x).
  at::Tensor vocab_parallel_embedding(const at::Tensor& ids, std::int64_t B, std::int64_t T, Dt dt) const;
  // Block `fqn` through its runner with its feed-forward's auxiliary loss handed out alongside
  // (Note [Auxiliary losses through a block runner]); the loss goes to runner_aux_.
  at::Tensor run_block_with_aux_loss(const std::string& fqn, GPT2BlockImpl& block, const at::Tensor& h, std::int64_t B,
                                     std::int64_t T, Dt dt, const std::shared_ptr<const Documents>& docs);
  // The position table rows of ABSOLUTE positions, [1, count, d] (rows [first, first + count)) or,
  // with restarting document positions, [B, count, d] (each token's position in its document);
  // `chunk`: this rank's sequence-parallel chunk (the table shared over the tp ranks).
  at::Tensor position_rows(std::int64_t B, std::int64_t first, std::int64_t count, Dt dt, const Documents* docs,
                           bool chunk) const;

  bool absolute_;
  std::optional<std::int64_t> window_;  // attention_config.sliding_window
  bool manual_attention_;               // attention_implementation = manual
  std::int64_t sequence_length_;
  double dropout_;
  std::shared_ptr<EmbeddingImpl> wte_, wpe_;
  std::shared_ptr<NormImpl> lm_head_norm_;
  std::shared_ptr<LinearImpl> lm_head_;
  torch::nn::ModuleDict h_{nullptr};
  torch::nn::ModuleDict transformer_{nullptr};
  ModuleHooks hooks_;
  std::vector<at::Tensor> runner_aux_;           // auxiliary losses of blocks run by a runner, last forward
  std::shared_ptr<const TpPlan> tp_;             // model/gpt2_tp
  std::shared_ptr<const cp::SequenceShard> cp_;  // context parallelism
};

}  // namespace modalities::plugins::gpt2
