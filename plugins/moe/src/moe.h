// The Mixture-of-Experts feed-forward of model/gpt2_moe (README.md): a router, routed SwiGLU experts
// stored stacked and computed over the tokens sorted by expert, and optional shared experts.
//
// Shapes: N tokens (= B*T rows), d model width, E routed experts, k experts per token (top_k),
// F hidden size of one expert (moe_ffn_hidden).
#pragma once

#include "layers.h"  // plugins/gpt2: FeedForward, LinearImpl, SwiGLUImpl

#include <modalities/sdk/schema.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace modalities::plugins::moe {

using gpt2::Dt;

struct MoeConfig {
  std::int64_t num_experts = 0;
  std::int64_t top_k = 0;
  std::int64_t moe_ffn_hidden = 0;
  std::string score_function;
  bool norm_topk_prob = true;
  double route_scale = 1.0;
  std::int64_t num_shared_experts = 0;
  std::optional<std::int64_t> shared_expert_ffn_hidden_per_expert;
  bool shared_expert_gate = false;
  std::int64_t first_k_dense_replace = 0;
  std::int64_t decoder_sparse_step = 1;
  std::vector<std::int64_t> mlp_only_layers;
  std::string experts_backend = "auto";
  double aux_loss_coef = 0.0;
  std::string aux_loss_scope = "micro_batch";
  double z_loss_coef = 0.0;
  std::string aux_loss_key = "moe_aux_loss";

  /// Whether the blocks compute an auxiliary loss (a coefficient is positive).
  bool has_aux_loss() const { return aux_loss_coef > 0 || z_loss_coef > 0; }

  /// Whether block `layer` (0-based) of the decoder is a MoE block.
  bool is_moe_layer(std::int64_t layer) const;
  /// Hidden size of the shared-expert MLP (0: none).
  std::int64_t shared_hidden() const;

  static void describe(Schema<MoeConfig>& s);
};

/// The routed experts: w1 (gate) and w3 (up) [E, F, d], w2 (down) [E, d, F]; expert e is
/// w2[e] (silu(w1[e] x) * (w3[e] x)), the per-expert nn.Linear weights of Mixtral stacked.
class GroupedExpertsImpl final : public gpt2::Leaf {
 public:
  GroupedExpertsImpl(std::int64_t experts, std::int64_t d, std::int64_t hidden, const at::TensorOptions& o);
  /// Each expert as torch.nn.Linear initializes its weights: U(+-1/sqrt(fan_in)).
  void reset() override;
  /// x: [M, d], rows sorted by expert, `counts[e]` rows for expert e -> [M, d].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& counts, Dt dt, bool grouped_mm) const;

  at::Tensor w1, w2, w3;

 private:
  void sync() override;
};

/// What the routing of one forward decided (for metrics, losses and tests).
struct Routing {
  at::Tensor router_logits;      // [N, E], float32
  at::Tensor scores;             // [N, E], float32: softmax or sigmoid of the logits
  at::Tensor experts;            // [N, k] int64, the chosen experts of every token
  at::Tensor weights;            // [N, k] float32, their combine weights
  at::Tensor tokens_per_expert;  // [E] int64
};

class MoeFeedForwardImpl final : public gpt2::FeedForward {
 public:
  MoeFeedForwardImpl(const MoeConfig& c, std::int64_t d, const at::TensorOptions& o);
  at::Tensor forward(const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt) override;
  void check_tensor_parallel() const override;
  /// Chooses the experts of every token of x [N, d].
  Routing route(const at::Tensor& x, Dt dt) const;
  const Routing& last_routing() const { return last_; }
  /// The auxiliary loss of `r` over B sequences of T tokens: aux_loss_coef times the load-balancing
  /// term plus z_loss_coef times the router z-loss (moe.cpp, Note [MoE auxiliary losses]).
  at::Tensor aux_loss(const Routing& r, std::int64_t B, std::int64_t T) const;
  bool has_aux_loss() const override { return c_.has_aux_loss(); }
  at::Tensor take_aux_loss() override { return std::exchange(aux_loss_, at::Tensor()); }

  std::shared_ptr<gpt2::LinearImpl> gate;  // router.gate: [E, d], no bias
  std::shared_ptr<GroupedExpertsImpl> experts;
  std::shared_ptr<gpt2::SwiGLUImpl> shared_experts;      // optional
  std::shared_ptr<gpt2::LinearImpl> shared_expert_gate;  // optional: [1, d]

 private:
  MoeConfig c_;
  Routing last_;
  at::Tensor aux_loss_;
};

/// The feed-forward factory of model/gpt2_moe: MoE blocks where c.is_moe_layer, model/gpt2's MLP elsewhere.
gpt2::FeedForwardFactory moe_feed_forward(const MoeConfig& c, std::int64_t d);

}  // namespace modalities::plugins::moe
