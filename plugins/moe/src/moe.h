// The Mixture-of-Experts feed-forward of model/gpt2_moe (README.md): a router, routed SwiGLU experts
// stored stacked and computed over the tokens sorted by expert, and optional shared experts.
//
// Shapes: N tokens (= B*T rows), d model width, E routed experts, k experts per token (top_k),
// F hidden size of one expert (moe_ffn_hidden).
#pragma once

#include "layers.h"  // plugins/gpt2: FeedForward, LinearImpl, SwiGLUImpl

#include <modalities/sdk/schema.h>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

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
  std::int64_t n_group = 1;
  std::optional<std::int64_t> topk_group;
  bool use_expert_bias = false;
  std::optional<double> capacity_factor;
  std::int64_t min_capacity = 4;
  std::string overflow_policy = "drop";
  bool log_tokens_per_expert = false;

  /// Whether the blocks compute an auxiliary loss (a coefficient is positive).
  bool has_aux_loss() const { return aux_loss_coef > 0 || z_loss_coef > 0; }

  /// Whether block `layer` (0-based) of the decoder is a MoE block.
  bool is_moe_layer(std::int64_t layer) const;
  /// Hidden size of the shared-expert MLP (0: none).
  std::int64_t shared_hidden() const;
  /// Groups kept per token in group-limited routing (topk_group, default n_group: all).
  std::int64_t groups_per_token() const { return topk_group.value_or(n_group); }
  /// Slots each expert takes from N tokens: max(ceil(capacity_factor N k / E), min_capacity);
  /// nullopt when dropless (no capacity_factor).
  std::optional<std::int64_t> capacity(std::int64_t tokens) const;

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
  /// Keeps experts [first, first + count) of the stack (expert parallelism); on any device.
  void keep(std::int64_t first, std::int64_t count);
  /// Experts in the stack (all E, or this rank's under expert parallelism).
  std::int64_t size() const { return w1.size(0); }

  at::Tensor w1, w2, w3;

 private:
  void sync() override;
};

/// What the routing of one forward decided (for metrics, losses and tests).
struct Routing {
  at::Tensor router_logits;       // [N, E], float32
  at::Tensor scores;              // [N, E], float32: softmax or sigmoid of the logits
  at::Tensor experts;             // [N, k] int64, the chosen experts of every token
  at::Tensor weights;             // [N, k] float32, their combine weights
  at::Tensor tokens_per_expert;   // [E] int64, chosen slots (before the capacity drops any)
  at::Tensor dropped_per_expert;  // [E] int64, slots dropped by the capacity (zeros when dropless)
};

/// The router of a MoE block: the gate, and under auxiliary-loss-free load balancing
/// (use_expert_bias) the per-expert selection bias `expert_bias` [E] (float32, zero at
/// construction and reset; a persistent buffer, so checkpoints hold it).
class RouterImpl final : public gpt2::Leaf {
 public:
  RouterImpl(std::int64_t d, std::int64_t experts, bool bias, const at::TensorOptions& o);
  void reset() override;
  void remap(const gpt2::Remap& f) override;
  /// The selection bias; undefined without load balancing.
  at::Tensor expert_bias() const { return bias_slot_ != nullptr ? *bias_slot_ : at::Tensor(); }

  std::shared_ptr<gpt2::LinearImpl> gate;  // [E, d], no bias

 private:
  at::Tensor* bias_slot_ = nullptr;
};

/// Expert parallelism of a block (plugins/gpt2/src/layers.h): the ep group, this rank, its size.
using gpt2::ExpertParallel;

/// The stacked expert weights, the parameters expert parallelism splits (names in the block).
inline const std::vector<std::string> kExpertWeights = {"experts.w1", "experts.w2", "experts.w3"};

class MoeFeedForwardImpl final : public gpt2::FeedForward {
 public:
  MoeFeedForwardImpl(const MoeConfig& c, std::int64_t d, const at::TensorOptions& o);
  at::Tensor forward(const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt) override;
  /// Tensor parallelism (README.md, "Expert parallelism with tensor and pipeline parallelism"): the
  /// block computes whole on every tp rank (router, experts, shared experts replicated over tp; the
  /// experts split over ep as without tp); under sequence parallelism model/gpt2's block gathers
  /// the sequence for it and keeps this rank's chunk of its output. Any plan is accepted.
  void check_tensor_parallel(const gpt2::TpPlan&) const override {}
  void parallelize(const gpt2::TpPlan& plan) override;
  bool replicated_under_tensor_parallel() const override { return true; }
  /// Chooses the experts of every token of x [N, d].
  Routing route(const at::Tensor& x, Dt dt) const;
  const Routing& last_routing() const { return last_; }
  /// The auxiliary loss of `r` over B sequences of T tokens: aux_loss_coef times the load-balancing
  /// term plus z_loss_coef times the router z-loss (moe.cpp, Note [MoE auxiliary losses]).
  at::Tensor aux_loss(const Routing& r, std::int64_t B, std::int64_t T) const;
  bool has_aux_loss() const override { return c_.has_aux_loss(); }
  /// Expert parallelism (moe.cpp, Note [Expert parallelism]): keeps this rank's experts, and
  /// forward() sends every token to the ranks of its experts and back. Every rank of the group
  /// runs forward and backward of this block alike. Throws modalities::Error when
  /// num_experts is not divisible by ep.size or it is applied twice. On any device (meta too).
  void apply_expert_parallel(const ExpertParallel& ep);
  const std::optional<ExpertParallel>& expert_parallel() const { return ep_; }
  /// The model's seam (Module::apply_expert_parallel): apply_expert_parallel(ep); kExpertWeights
  /// are split.
  std::vector<std::string> parallelize_experts(const ExpertParallel& ep) override;
  /// Bytes this rank sent to the other ep ranks in the all-to-alls of the forwards and backwards
  /// since the last call (the dispatch and the combine, and both again in backward; counted from
  /// the split sizes of each call and the rows' dtype), reset to zero.
  std::int64_t take_all_to_all_bytes() { return all_to_all_bytes_->exchange(0); }
  at::Tensor take_aux_loss() override { return std::exchange(aux_loss_, at::Tensor()); }
  /// The training forwards' routing since the last call (moe.cpp, Note [MoE metrics]): this rank's
  /// tokens per expert max/mean and min/mean, the fraction of slots the capacity dropped, the
  /// auxiliary loss, each averaged over the ranks when logged; with log_tokens_per_expert every
  /// expert's chosen slots, summed over the ranks.
  void take_metrics(const std::string& block, std::vector<ModelMetric>& out) override;
  /// A token computes with top_k of the num_experts routed experts (MFU's active parameters).
  std::map<std::string, double> parameter_activity() const override {
    std::map<std::string, double> out;
    for (const std::string& name : kExpertWeights)
      out.emplace(name, static_cast<double>(c_.top_k) / static_cast<double>(c_.num_experts));
    return out;
  }

  /// Auxiliary-loss-free load balancing (DeepSeek-V3): the tokens each expert was chosen by in the
  /// training forwards since the last call ([E] int64, zeros when none), reset to zero.
  at::Tensor take_expert_load();
  /// expert_bias += rate * sign(mean(load) - load), load [E] the tokens per expert of a step over
  /// all data-parallel ranks (moe.cpp, Note [Load balancing bias]).
  void update_expert_bias(const at::Tensor& load, double rate);
  bool balances_load() const { return c_.use_expert_bias; }

  std::shared_ptr<RouterImpl> router;
  std::shared_ptr<gpt2::LinearImpl> gate;  // router.gate: [E, d], no bias
  std::shared_ptr<GroupedExpertsImpl> experts;
  std::shared_ptr<gpt2::SwiGLUImpl> shared_experts;      // optional
  std::shared_ptr<gpt2::LinearImpl> shared_expert_gate;  // optional: [1, d]

 private:
  /// The experts over the sorted routed rows, across the expert-parallel ranks (ep_ of size > 1).
  at::Tensor experts_across_ranks(const at::Tensor& routed, const at::Tensor& counts, Dt dt, bool grouped) const;

  MoeConfig c_;
  std::optional<ExpertParallel> ep_;
  Routing last_;
  at::Tensor expert_load_;  // chosen slots per expert since take_expert_load
  at::Tensor aux_loss_;
  // Since take_metrics: the training forwards' chosen and dropped slots per expert and the sum of
  // their auxiliary losses (device tensors: no sync per forward).
  at::Tensor metric_load_, metric_dropped_, metric_aux_;
  std::int64_t metric_forwards_ = 0;
  // Shared with the backward hooks that count the backward's all-to-alls.
  std::shared_ptr<std::atomic<std::int64_t>> all_to_all_bytes_ = std::make_shared<std::atomic<std::int64_t>>(0);
  std::int64_t tp_replicas_ = 1;  // tp ranks that route the same tokens (tensor parallelism)
};

/// The feed-forward factory of model/gpt2_moe: MoE blocks where c.is_moe_layer, model/gpt2's MLP elsewhere.
gpt2::FeedForwardFactory moe_feed_forward(const MoeConfig& c, std::int64_t d);

}  // namespace modalities::plugins::moe
