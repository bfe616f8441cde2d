// The MoE feed-forward (moe.h): routing, sorted dispatch, the stacked experts and the combine.
#include "moe.h"

#include <modalities/sdk/collectives.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/log.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace modalities::plugins::moe {

void MoeConfig::describe(Schema<MoeConfig>& s) {
  s.field("num_experts", &MoeConfig::num_experts, "Routed experts E per MoE block.").required().at_least(1);
  s.field("top_k", &MoeConfig::top_k, "Experts each token is sent to (k <= num_experts).").required().at_least(1);
  s.field("moe_ffn_hidden", &MoeConfig::moe_ffn_hidden,
          "Hidden size F of one routed expert (a SwiGLU: w2(silu(w1 x) * w3 x)); used as is, no 2/3 rounding.")
      .required()
      .at_least(1);
  s.field("score_function", &MoeConfig::score_function,
          "Router scores from the router logits: softmax over the experts (Mixtral, Qwen-MoE) or an "
          "element-wise sigmoid (DeepSeek-V3, Modalities' Nemotron default). The top_k experts by score are "
          "chosen. Required: the families differ.")
      .required()
      .one_of({"softmax", "sigmoid"});
  s.field("norm_topk_prob", &MoeConfig::norm_topk_prob,
          "Divide the chosen experts' scores by their sum (Mixtral, Qwen3-MoE, DeepSeek-V3: true; Qwen2-MoE: "
          "false).");
  s.field("route_scale", &MoeConfig::route_scale,
          "Routed scaling factor multiplying the combine weights (DeepSeek-V3's routed_scaling_factor).")
      .greater_than(0.0);
  s.field("num_shared_experts", &MoeConfig::num_shared_experts,
          "Shared experts applied to every token (DeepSeek-V3, Qwen2-MoE), computed as one SwiGLU of hidden "
          "num_shared_experts * shared_expert_ffn_hidden_per_expert; 0: none (Modalities' key).")
      .at_least(0);
  s.field("shared_expert_ffn_hidden_per_expert", &MoeConfig::shared_expert_ffn_hidden_per_expert,
          "Hidden size of one shared expert; null: moe_ffn_hidden (Modalities' key). Qwen2-MoE: "
          "num_shared_experts = 1 and its shared_expert_intermediate_size.")
      .at_least(1);
  s.field("shared_expert_gate", &MoeConfig::shared_expert_gate,
          "Scale the shared experts' output per token by sigmoid(shared_expert_gate(x)), a [1, d] linear "
          "(Qwen2-MoE).");
  s.field("first_k_dense_replace", &MoeConfig::first_k_dense_replace,
          "The first k blocks keep model/gpt2's dense MLP (DeepSeek-V3's first_k_dense_replace).")
      .at_least(0);
  s.field("decoder_sparse_step", &MoeConfig::decoder_sparse_step,
          "Of the remaining blocks, block i (0-based) is MoE when (i + 1) % decoder_sparse_step == 0 "
          "(Qwen-MoE's decoder_sparse_step; 1: every block).")
      .at_least(1);
  s.field("mlp_only_layers", &MoeConfig::mlp_only_layers,
          "Blocks (0-based) that keep the dense MLP whatever the two rules above say (Qwen-MoE's mlp_only_layers).");
  s.field("experts_backend", &MoeConfig::experts_backend,
          "How the experts compute over the sorted tokens: grouped_mm (LibTorch's at::_grouped_mm, one call "
          "per projection; Modalities' default), looped (one mm per expert that has tokens) or auto (ours: "
          "grouped_mm on CUDA in bfloat16, looped elsewhere). The choice is logged once.")
      .one_of({"auto", "grouped_mm", "looped"});
  s.field("aux_loss_coef", &MoeConfig::aux_loss_coef,
          "Coefficient of the load-balancing loss of every MoE block, E * sum_e f_e * P_e (Switch/GShard: f_e the "
          "share of the routing slots expert e got, P_e its mean router probability); 0: none. Modalities' "
          "moe_aux_loss_coef. The blocks' sum is the model output aux_loss_key (plugins/moe/README.md).")
      .non_negative();
  s.field("aux_loss_scope", &MoeConfig::aux_loss_scope,
          "What f_e and P_e average over: the micro-batch's tokens (micro_batch: Switch, GShard, Modalities' "
          "qwen MoE) or each sequence, the terms then averaged over the sequences (sequence: DeepSeek-V3's "
          "sequence-wise balance loss).")
      .one_of({"micro_batch", "sequence"});
  s.field("z_loss_coef", &MoeConfig::z_loss_coef,
          "Coefficient of the router z-loss of every MoE block, the mean over tokens of logsumexp(router "
          "logits)^2 (ST-MoE); 0: none. Modalities' moe_z_loss_coef.")
      .non_negative();
  s.field("aux_loss_key", &MoeConfig::aux_loss_key,
          "Model output that holds the sum over the MoE blocks of their auxiliary losses (a 0-dim tensor, "
          "present when a coefficient is positive); loss/moe_aux_loss reads it.")
      .non_empty();
  s.field("n_group", &MoeConfig::n_group,
          "Group-limited routing (DeepSeek-V3's n_group): the experts in n_group groups of num_experts / n_group; "
          "each token first keeps the topk_group groups whose two best (biased) scores add up highest, then picks "
          "its top_k experts among theirs. 1: no groups.")
      .at_least(1);
  s.field("topk_group", &MoeConfig::topk_group,
          "Groups kept per token in group-limited routing (DeepSeek-V3's topk_group); null: n_group (all).")
      .at_least(1);
  s.field("use_expert_bias", &MoeConfig::use_expert_bias,
          "Auxiliary-loss-free load balancing (DeepSeek-V3; Modalities' use_expert_bias): a per-expert bias "
          "router.expert_bias added to the scores for the choice of experts only, which optimizer/"
          "moe_load_balanced moves after every step towards the mean load (up for experts below it, down above).");
  s.field("capacity_factor", &MoeConfig::capacity_factor,
          "Expert capacity: each expert takes at most max(ceil(capacity_factor * N * top_k / num_experts), "
          "min_capacity) of the N * top_k routing slots of a forward, the first in token order; the rest are "
          "dropped (overflow_policy). null: dropless (the default).")
      .greater_than(0.0);
  s.field("min_capacity", &MoeConfig::min_capacity,
          "Lower bound of the expert capacity in slots (Modalities' moe_min_capacity).")
      .at_least(0);
  s.field("overflow_policy", &MoeConfig::overflow_policy,
          "What a dropped slot gives: drop (nothing: the block's residual connection carries the token; Switch "
          "Transformer) or residual (a token whose every slot was dropped gets its input as the block's output, "
          "Modalities' moe_overflow_policy = residual).")
      .one_of({"drop", "residual"});
  s.field("log_tokens_per_expert", &MoeConfig::log_tokens_per_expert,
          "Also log, per MoE block, the routing slots each expert was chosen for since the last training-log step, "
          "summed over the data-parallel ranks (metrics \"moe tokens of expert e (block L)\"; E numbers per block).");
  s.rule([](const MoeConfig& c, ParseContext& ctx) {
    if (c.num_experts % c.n_group != 0)
      ctx.fail("n_group", fmt::format("is {}, which does not divide num_experts = {} into equal groups", c.n_group,
                                      c.num_experts));
    else if (c.groups_per_token() > c.n_group)
      ctx.fail("topk_group", fmt::format("is {}, more than the n_group = {} groups", *c.topk_group, c.n_group));
    else if (c.top_k > c.groups_per_token() * (c.num_experts / c.n_group))
      ctx.fail("top_k", fmt::format("is {}, more than the {} experts of the topk_group = {} groups a token may use",
                                    c.top_k, c.groups_per_token() * (c.num_experts / c.n_group), c.groups_per_token()));
    if (c.top_k > c.num_experts)
      ctx.fail("top_k", fmt::format("is {}, more than num_experts = {}; each token picks top_k of the experts", c.top_k,
                                    c.num_experts));
    if (c.shared_expert_gate && c.shared_hidden() == 0)
      ctx.fail("shared_expert_gate", "is true, but there is no shared expert (num_shared_experts = 0)");
    if (c.shared_expert_ffn_hidden_per_expert && c.num_shared_experts == 0)
      ctx.fail("shared_expert_ffn_hidden_per_expert", "is set, but num_shared_experts = 0 (no shared expert to size)");
    for (std::size_t i = 0; i < c.mlp_only_layers.size(); ++i)
      if (c.mlp_only_layers[i] < 0)
        ctx.fail(fmt::format("mlp_only_layers[{}]", i),
                 fmt::format("is {}; block indices start at 0", c.mlp_only_layers[i]));
  });
}

bool MoeConfig::is_moe_layer(std::int64_t layer) const {
  if (layer < first_k_dense_replace || (layer + 1) % decoder_sparse_step != 0) return false;
  return std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) == mlp_only_layers.end();
}

std::optional<std::int64_t> MoeConfig::capacity(std::int64_t tokens) const {
  if (!capacity_factor) return std::nullopt;
  const double slots = *capacity_factor * static_cast<double>(tokens * top_k) / static_cast<double>(num_experts);
  return std::max(static_cast<std::int64_t>(std::ceil(slots)), min_capacity);
}

std::int64_t MoeConfig::shared_hidden() const {
  if (num_shared_experts == 0) return 0;
  return num_shared_experts * shared_expert_ffn_hidden_per_expert.value_or(moe_ffn_hidden);
}

// --- the experts -----------------------------------------------------------------------------

GroupedExpertsImpl::GroupedExpertsImpl(std::int64_t experts, std::int64_t d, std::int64_t hidden,
                                       const at::TensorOptions& o)
    : gpt2::Leaf("GroupedExperts") {
  register_parameter("w1", at::empty({experts, hidden, d}, o));
  register_parameter("w2", at::empty({experts, d, hidden}, o));
  register_parameter("w3", at::empty({experts, hidden, d}, o));
  sync();
}

void GroupedExpertsImpl::sync() {
  w1 = registered("w1");
  w2 = registered("w2");
  w3 = registered("w3");
}

void GroupedExpertsImpl::reset() {
  // nn.Linear(in, out).reset_parameters per expert: U(+-1/sqrt(in)), in = d for w1/w3, F for w2.
  for (at::Tensor* w : {&w1, &w2, &w3}) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(w->size(2)));
    w->uniform_(-bound, bound);
  }
}

void GroupedExpertsImpl::keep(std::int64_t first, std::int64_t count) {
  at::NoGradGuard no_grad;
  for (auto& item : parameters_)
    item.value() = item.value().narrow(0, first, count).clone().set_requires_grad(item.value().requires_grad());
  sync();
}

namespace {

bool use_grouped_mm(const std::string& backend, const at::Tensor& x) {
  if (backend == "grouped_mm") return true;
  if (backend == "looped") return false;
  return x.is_cuda() && x.scalar_type() == at::kBFloat16;
}

void log_backend_once(bool grouped, const at::Tensor& x) {
  static std::atomic<bool> logged{false};
  if (logged.exchange(true)) return;
  log::info(fmt::format("moe: experts computed with {} ({}, {})",
                        grouped ? "at::_grouped_mm (one grouped matmul per projection)" : "a loop over the experts",
                        x.device().str(), c10::toString(x.scalar_type())));
}

}  // namespace

at::Tensor GroupedExpertsImpl::forward(const at::Tensor& x, const at::Tensor& counts, Dt dt, bool grouped_mm) const {
  // No rows (under expert parallelism a rank may get none): an empty result that stays in the
  // graph, so that the collectives around it run their backward on this rank too.
  if (x.size(0) == 0) return x.clone();
  const at::Tensor a = gpt2::cast(w1, dt), b = gpt2::cast(w3, dt), c = gpt2::cast(w2, dt);
  if (grouped_mm) {
    // Row blocks of x by expert: offs[e] = the end of expert e's rows (int32, as _grouped_mm wants).
    const at::Tensor offs = counts.cumsum(0).to(at::kInt);
    const at::Tensor h =
        at::silu(at::_grouped_mm(x, a.transpose(-2, -1), offs)) * at::_grouped_mm(x, b.transpose(-2, -1), offs);
    return at::_grouped_mm(h, c.transpose(-2, -1), offs);
  }
  // One mm per expert that has tokens: the row counts are needed on the host. The experts' weights
  // by unbind and their rows by split, whose backwards stack and concatenate the gradients once
  // (w[e] and x.narrow would each fill a zero gradient of the whole tensor per expert and then add
  // them up: 45 % of the step on the bench's sizes).
  const at::Tensor host = counts.to(at::kCPU);
  const std::vector<std::int64_t> n(host.data_ptr<std::int64_t>(), host.data_ptr<std::int64_t>() + host.numel());
  const std::vector<at::Tensor> as = a.unbind(0), bs = b.unbind(0), cs = c.unbind(0);
  const std::vector<at::Tensor> xs = x.split_with_sizes(n, 0);
  std::vector<at::Tensor> parts;
  for (std::size_t e = 0; e < n.size(); ++e) {
    if (n[e] == 0) continue;
    const at::Tensor h = at::silu(at::mm(xs[e], as[e].t())) * at::mm(xs[e], bs[e].t());
    parts.push_back(at::mm(h, cs[e].t()));
  }
  return parts.size() == 1 ? parts.front() : at::cat(parts, 0);
}

// --- the router --------------------------------------------------------------------------------

RouterImpl::RouterImpl(std::int64_t d, std::int64_t experts, bool bias, const at::TensorOptions& o)
    : gpt2::Leaf("Router") {
  gate = register_module("gate", std::make_shared<gpt2::LinearImpl>(d, experts, /*bias=*/false, o));
  if (bias) bias_slot_ = &register_buffer("expert_bias", at::zeros({experts}, o.dtype(at::kFloat)));
}

void RouterImpl::reset() {
  if (bias_slot_ != nullptr) bias_slot_->zero_();
}

void RouterImpl::remap(const gpt2::Remap& f) {
  if (bias_slot_ != nullptr) *bias_slot_ = f(*bias_slot_);
}

// --- the MoE block -----------------------------------------------------------------------------

MoeFeedForwardImpl::MoeFeedForwardImpl(const MoeConfig& c, std::int64_t d, const at::TensorOptions& o)
    : gpt2::FeedForward("MoeFeedForward"), c_(c) {
  router = register_module("router", std::make_shared<RouterImpl>(d, c.num_experts, c.use_expert_bias, o));
  gate = router->gate;
  experts = register_module("experts", std::make_shared<GroupedExpertsImpl>(c.num_experts, d, c.moe_ffn_hidden, o));
  if (const std::int64_t h = c.shared_hidden(); h > 0) {
    shared_experts = register_module("shared_experts", std::make_shared<gpt2::SwiGLUImpl>(d, h, /*bias=*/false, o));
    if (c.shared_expert_gate)
      shared_expert_gate = register_module("shared_expert_gate", std::make_shared<gpt2::LinearImpl>(d, 1, false, o));
  }
}

// Whole on every tp rank: nothing to split. The tp ranks route the same tokens, which the summed
// per-expert counts must count once (Note [MoE metrics]).
void MoeFeedForwardImpl::parallelize(const gpt2::TpPlan& plan) { tp_replicas_ = plan.size; }

Routing MoeFeedForwardImpl::route(const at::Tensor& x, Dt dt) const {
  Routing r;
  // Scores in float32 when the compute dtype is narrower (transformers' softmax(..., dtype=torch.float));
  // float64 stays float64 (param_dtype = FP_64).
  r.router_logits = (*gate)(x, dt);  // [N, E]
  r.router_logits = r.router_logits.to(at::promote_types(r.router_logits.scalar_type(), at::kFloat));
  r.scores = c_.score_function == "sigmoid" ? at::sigmoid(r.router_logits) : at::softmax(r.router_logits, /*dim=*/-1);
  at::Tensor weights, chosen;
  if (!balances_load() && c_.n_group == 1) {
    std::tie(weights, chosen) = at::topk(r.scores, c_.top_k, /*dim=*/-1);  // [N, k], largest first
  } else {
    // Note [Load balancing bias]: the bias and the groups decide which experts, the unbiased
    // scores how much of each (DeepSeek-V3, eq. 16).
    at::Tensor choice;
    {
      at::NoGradGuard no_grad;
      choice = r.scores.detach();
      if (balances_load()) choice = choice + router->expert_bias().to(choice.scalar_type());
      if (c_.n_group > 1) {
        // Each group scored by the sum of its two best scores; the topk_group best groups stay
        // open, the others' experts cannot be chosen (-inf: transformers' DeepseekV3 fills 0,
        // which a negative biased score would lose to).
        const std::int64_t N = choice.size(0), G = c_.n_group, per = c_.num_experts / G;
        const at::Tensor grouped = choice.view({N, G, per});
        const at::Tensor group_scores = std::get<0>(grouped.topk(std::min<std::int64_t>(2, per), -1)).sum(-1);
        const at::Tensor open_groups = std::get<1>(group_scores.topk(c_.groups_per_token(), -1));  // [N, topk_group]
        const at::Tensor open = at::zeros({N, G}, choice.options().dtype(at::kBool)).scatter_(1, open_groups, true);
        choice = grouped.masked_fill(open.logical_not().unsqueeze(-1), -std::numeric_limits<float>::infinity())
                     .view({N, c_.num_experts});
      }
      chosen = std::get<1>(at::topk(choice, c_.top_k, /*dim=*/-1));
    }
    weights = r.scores.gather(1, chosen);
  }
  if (c_.norm_topk_prob) weights = weights / weights.sum(-1, /*keepdim=*/true);
  if (c_.route_scale != 1.0) weights = weights * c_.route_scale;
  r.experts = chosen;
  r.weights = weights;
  {
    at::NoGradGuard no_grad;
    r.tokens_per_expert = at::bincount(chosen.reshape(-1), /*weights=*/{}, c_.num_experts);
    r.dropped_per_expert = at::zeros_like(r.tokens_per_expert);
  }
  return r;
}

at::Tensor MoeFeedForwardImpl::forward(const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt) {
  const at::Tensor h = gpt2::cast(x, dt);
  Routing r = route(h, dt);
  const std::int64_t k = c_.top_k;
  // Dispatch: the N*k (token, expert) pairs sorted by expert, stably, so every expert sees its
  // tokens in sequence order; then each expert's rows are one contiguous block.
  const at::Tensor flat = r.experts.reshape(-1);          // [N*k]
  at::Tensor order = at::argsort(flat, /*stable=*/true);  // [N*k]
  at::Tensor counts = r.tokens_per_expert;
  if (const auto capacity = c_.capacity(h.size(0))) {
    // Each expert keeps its first `capacity` slots in token order (the sort is stable).
    const at::Tensor expert = flat.index_select(0, order);
    const at::Tensor first = counts.cumsum(0) - counts;  // of each expert's block
    const at::Tensor keep = (at::arange(order.numel(), order.options()) - first.index_select(0, expert)) < *capacity;
    order = order.masked_select(keep);
    const at::Tensor kept = counts.clamp_max(*capacity);
    r.dropped_per_expert = counts - kept;
    counts = kept;
  }
  const at::Tensor token = at::floor_divide(order, k);  // [slots]
  const at::Tensor routed = h.index_select(0, token);   // [slots, d]
  const bool grouped = use_grouped_mm(c_.experts_backend, h);
  log_backend_once(grouped, h);
  at::Tensor y = ep_ && ep_->size > 1 ? experts_across_ranks(routed, counts, dt, grouped)
                                      : experts->forward(routed, counts, dt, grouped);
  // Combine: each pair's output times its weight (in the compute dtype, as transformers casts the
  // routing weights), summed per token in increasing expert order.
  y = y * r.weights.reshape(-1).index_select(0, order).to(y.scalar_type()).unsqueeze(1);
  at::Tensor out = at::zeros({h.size(0), h.size(1)}, y.options()).index_add(0, token, y);
  if (c_.capacity_factor && c_.overflow_policy == "residual") {
    // A token none of whose slots was kept passes through.
    const at::Tensor none = at::bincount(token, /*weights=*/{}, h.size(0)).eq(0).unsqueeze(1);
    out = at::where(none, h.to(out.scalar_type()), out);
  }
  if (shared_experts) {
    at::Tensor s = shared_experts->forward(h, B, T, dt);
    if (shared_expert_gate) s = at::sigmoid((*shared_expert_gate)(h, dt)) * s;
    out = out + s;
  }
  // Under activation checkpointing the first forward runs without autograd; model/gpt2 hands the
  // loss through the block runner, whose recomputation gives it its gradient (plugins/gpt2,
  // modules.cpp: Note [Auxiliary losses through a block runner]).
  if (c_.has_aux_loss()) aux_loss_ = aux_loss(r, B, T);
  if (is_training() && at::GradMode::is_enabled()) {
    // Counted once per micro-batch: an activation-checkpointed block's first forward runs
    // without autograd, its recomputation with. The selection bias's load (Note [Load balancing
    // bias]) and the metrics (Note [MoE metrics]) are taken at different steps.
    at::NoGradGuard no_grad;
    const auto add = [](at::Tensor& sum, const at::Tensor& t) { sum = sum.defined() ? sum + t : t.clone(); };
    if (balances_load()) add(expert_load_, r.tokens_per_expert);
    add(metric_load_, r.tokens_per_expert);
    add(metric_dropped_, r.dropped_per_expert);
    if (aux_loss_.defined()) add(metric_aux_, aux_loss_.detach().to(at::kDouble));
    ++metric_forwards_;
  }
  // Kept for metrics and tests, without the graph (which the next step must not keep alive).
  r.router_logits = r.router_logits.detach();
  r.scores = r.scores.detach();
  r.weights = r.weights.detach();
  last_ = std::move(r);
  return out;
}

// Note [Load balancing bias]: DeepSeek-V3's auxiliary-loss-free balancing (arXiv:2412.19437,
// section 2.1.2): a bias b_e is added to expert e's score for the choice of the top-k (and of the
// groups) only; after each training step b_e moves by gamma (expert_bias_update_rate), up when e got
// fewer tokens than the mean over the experts, down when more, unchanged when equal:
//   b_e += gamma * sign(mean(load) - load_e).
// The load is that of the whole step (every micro-batch, every data-parallel rank:
// optimizer/moe_load_balanced sums it). TorchTitan also subtracts the mean of the update, which
// moves every bias alike and so changes no choice.
// Note [MoE metrics]
// Every training forward with autograd (once per micro-batch, also under activation checkpointing)
// adds its chosen and dropped slots per expert and its auxiliary loss; take_metrics (the gym, at
// each training-log step) turns them into numbers and starts over. The load is this rank's
// routing, of its own tokens: max/mean is 1 when every expert got the same number of slots, E
// when one got all; the gym averages the ranks' values. (The selection bias's load, Note [Load
// balancing bias], is summed over the data-parallel ranks instead.)
void MoeFeedForwardImpl::take_metrics(const std::string& block, std::vector<ModelMetric>& out) {
  if (metric_forwards_ == 0) return;
  const at::Tensor load = std::exchange(metric_load_, at::Tensor()).to(at::kDouble).cpu();
  const at::Tensor dropped = std::exchange(metric_dropped_, at::Tensor()).to(at::kDouble).cpu();
  const at::Tensor aux = std::exchange(metric_aux_, at::Tensor());
  const auto forwards = static_cast<double>(std::exchange(metric_forwards_, 0));
  const double total = load.sum().item<double>();
  if (total > 0) {
    const double mean = total / static_cast<double>(load.numel());
    out.push_back({fmt::format("moe load max over mean ({})", block), load.max().item<double>() / mean});
    out.push_back({fmt::format("moe load min over mean ({})", block), load.min().item<double>() / mean});
    if (c_.capacity_factor)
      out.push_back({fmt::format("moe dropped slots ({})", block), dropped.sum().item<double>() / total});
  }
  if (aux.defined()) out.push_back({fmt::format("moe aux loss ({})", block), aux.item<double>() / forwards});
  if (c_.log_tokens_per_expert) {
    // Every rank counts all E experts (the routing comes before the dispatch). The tp ranks of a
    // tensor-parallel block route the same tokens: each reports its share, so the sum over the
    // world counts every data-parallel rank's tokens once (exact: the counts are integers, and
    // so are their shares' sums).
    const auto* counts = load.contiguous().data_ptr<double>();
    for (std::int64_t e = 0; e < load.numel(); ++e)
      out.push_back({fmt::format("moe tokens of expert {} ({})", e, block),
                     counts[e] / static_cast<double>(tp_replicas_), ModelMetric::Reduce::kSum});
  }
}

at::Tensor MoeFeedForwardImpl::take_expert_load() {
  at::Tensor load = std::exchange(expert_load_, at::Tensor());
  if (load.defined()) return load;
  return at::zeros({c_.num_experts}, gate->weight.options().dtype(at::kLong));
}

void MoeFeedForwardImpl::update_expert_bias(const at::Tensor& load, double rate) {
  if (!balances_load())
    throw Error("model/gpt2_moe: update_expert_bias on a block without an expert bias (use_expert_bias = false)");
  at::NoGradGuard no_grad;
  at::Tensor bias = router->expert_bias();
  const at::Tensor l = load.to(bias.device(), at::kFloat);
  bias.add_((l.mean() - l).sign().to(bias.scalar_type()), rate);
}

// --- expert parallelism ----------------------------------------------------------------------

void MoeFeedForwardImpl::apply_expert_parallel(const ExpertParallel& ep) {
  if (ep_) throw Error("model/gpt2_moe: expert parallelism applied twice to a MoE block");
  if (ep.size < 1 || ep.rank < 0 || ep.rank >= ep.size)
    throw Error(fmt::format("model/gpt2_moe: expert parallelism over {} ranks needs a rank in [0, {}), got {}", ep.size,
                            ep.size, ep.rank));
  if (c_.num_experts % ep.size != 0)
    throw ConfigError("moe_config.num_experts",
                      fmt::format("is {}, which is not divisible by the expert-parallel degree {} "
                                  "(device_mesh.config.expert_parallel_degree); every rank holds the same number of "
                                  "experts",
                                  c_.num_experts, ep.size));
  if (ep.size > 1 && (!ep.group || ep.group->getSize() != ep.size))
    throw Error(fmt::format("model/gpt2_moe: expert parallelism of degree {} needs a process group of {} ranks, got {}",
                            ep.size, ep.size, ep.group ? std::to_string(ep.group->getSize()) : "none"));
  const std::int64_t local = c_.num_experts / ep.size;
  experts->keep(ep.rank * local, local);
  ep_ = ep;
}

std::vector<std::string> MoeFeedForwardImpl::parallelize_experts(const ExpertParallel& ep) {
  apply_expert_parallel(ep);
  return kExpertWeights;
}

// Note [Expert parallelism]: the routed rows of this rank, sorted by (global) expert, go in one
// all-to-all to the ranks holding their experts, rank j getting the rows of experts
// [j L, (j + 1) L), L = E / G. A rank receives, from each rank i in turn, i's rows of its L
// experts, expert by expert; reordered expert-major (expert l's rows from rank 0, then from rank
// 1, ...) they are one contiguous block per local expert for the grouped matmul, and the
// results go back the same way, so every row comes home to where it left: the combine is the
// one-process combine, in the same order. The row counts travel first (an all-to-all of the E
// counts), and are brought to the host for the split sizes (a device sync, as in TorchTitan).
// The gradients retrace the path: each rank's expert weights get the gradient of every rank's
// tokens routed to them, the router and the rest that of this rank's tokens.
at::Tensor MoeFeedForwardImpl::experts_across_ranks(const at::Tensor& routed, const at::Tensor& counts, Dt dt,
                                                    bool grouped) const {
  const std::int64_t G = ep_->size, L = c_.num_experts / G;
  const at::Tensor incoming = dist::exchange_counts(counts, ep_->group);  // [G * L]: block i from rank i
  const at::Tensor out_host = counts.to(at::kCPU), in_host = incoming.to(at::kCPU);
  const std::int64_t* out_n = out_host.data_ptr<std::int64_t>();
  const std::int64_t* in_n = in_host.data_ptr<std::int64_t>();
  std::vector<std::int64_t> send(static_cast<std::size_t>(G), 0), recv(static_cast<std::size_t>(G), 0);
  for (std::int64_t j = 0; j < G; ++j)
    for (std::int64_t l = 0; l < L; ++l) {
      send[static_cast<std::size_t>(j)] += out_n[j * L + l];
      recv[static_cast<std::size_t>(j)] += in_n[j * L + l];
    }
  const at::Tensor arrived = dist::all_to_all_rows(routed, send, recv, ep_->group);  // source-major
  // Bytes sent to the other ranks: the dispatch's rows for their experts, the combine's results of
  // their tokens; in backward the combine's gradient retraces the dispatch, the dispatch's the
  // combine (hooks: they run when those gradients are sent).
  const std::int64_t me = ep_->rank;
  const auto off_rank = [me](const std::vector<std::int64_t>& rows) {
    std::int64_t n = 0;
    for (std::size_t j = 0; j < rows.size(); ++j) n += static_cast<std::int64_t>(j) == me ? 0 : rows[j];
    return n;
  };
  const std::int64_t sent_rows = off_rank(send), received_rows = off_rank(recv);
  const auto bytes = [](std::int64_t rows, const at::Tensor& t) { return rows * t.size(1) * t.element_size(); };
  *all_to_all_bytes_ += bytes(sent_rows, routed);
  if (arrived.requires_grad())
    arrived.register_hook([counter = all_to_all_bytes_, received_rows, bytes](const at::Tensor& g) {
      *counter += bytes(received_rows, g);
    });
  // Expert-major order of the arrived rows, and each local expert's count.
  std::vector<std::int64_t> start(static_cast<std::size_t>(G * L));  // of block (i, l), source-major
  std::int64_t offset = 0;
  for (std::int64_t b = 0; b < G * L; ++b) {
    start[static_cast<std::size_t>(b)] = offset;
    offset += in_n[b];
  }
  std::vector<std::int64_t> order, local_counts(static_cast<std::size_t>(L), 0);
  order.reserve(static_cast<std::size_t>(offset));
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t i = 0; i < G; ++i) {
      const std::int64_t b = i * L + l;
      for (std::int64_t n = 0; n < in_n[b]; ++n) order.push_back(start[static_cast<std::size_t>(b)] + n);
      local_counts[static_cast<std::size_t>(l)] += in_n[b];
    }
  const at::TensorOptions index = at::TensorOptions().dtype(at::kLong);
  const at::Tensor perm = at::tensor(order, index).to(routed.device());
  const at::Tensor rows = arrived.index_select(0, perm);
  const at::Tensor y = experts->forward(rows, at::tensor(local_counts, index).to(counts.device()), dt, grouped);
  // Back to the arrived order (the inverse permutation), then home.
  const at::Tensor back = at::empty_like(perm).scatter_(0, perm, at::arange(perm.numel(), perm.options()));
  const at::Tensor results = y.index_select(0, back);
  *all_to_all_bytes_ += bytes(received_rows, results);
  at::Tensor home = dist::all_to_all_rows(results, recv, send, ep_->group);
  if (home.requires_grad())
    home.register_hook(
        [counter = all_to_all_bytes_, sent_rows, bytes](const at::Tensor& g) { *counter += bytes(sent_rows, g); });
  return home;
}

// Note [MoE auxiliary losses]: of one block, over its N = B*T tokens, E experts, k per token:
//   load balance  aux_loss_coef * E * sum_e f_e * P_e, f_e = (slots of expert e) / (N k), with no
//                 gradient, and P_e = the mean over the tokens of p_e, the router probabilities
//                 (softmax scores; sigmoid scores divided by their sum over the experts, as
//                 DeepSeek-V3 normalizes them). Perfect balance gives aux_loss_coef. With
//                 aux_loss_scope = sequence, f and P are taken per sequence (T tokens) and the B
//                 terms averaged.
//   router z      z_loss_coef * mean_n logsumexp_e(logits_ne)^2.
// transformers' load_balancing_loss_func differs in two ways: it concatenates the router logits of
// every layer and computes one term over them (ours: one per block, summed), and its f sums the k
// choices without dividing by k, so for one MoE block it is k times ours (moe_test.cpp checks this).
at::Tensor MoeFeedForwardImpl::aux_loss(const Routing& r, std::int64_t B, std::int64_t T) const {
  const std::int64_t E = c_.num_experts, k = c_.top_k;
  at::Tensor total = at::zeros({}, r.router_logits.options());
  if (c_.aux_loss_coef > 0) {
    const at::Tensor p = c_.score_function == "sigmoid" ? r.scores / r.scores.sum(-1, /*keepdim=*/true) : r.scores;
    const std::int64_t S = c_.aux_loss_scope == "sequence" ? B : 1;  // groups of N / S tokens
    const std::int64_t n = B * T / S;
    at::Tensor f;
    {
      at::NoGradGuard no_grad;
      // Slots per (group, expert): ones scattered at the chosen experts of each group's tokens.
      const at::Tensor chosen = r.experts.reshape({S, n * k});
      f = at::zeros({S, E}, p.options()).scatter_add_(1, chosen, at::ones(chosen.sizes(), p.options())) /
          static_cast<double>(n * k);
    }
    const at::Tensor P = p.reshape({S, n, E}).mean(1);  // [S, E]
    total = total + (f * P).sum(-1).mean() * (static_cast<double>(E) * c_.aux_loss_coef);
  }
  if (c_.z_loss_coef > 0) total = total + at::logsumexp(r.router_logits, -1).square().mean() * c_.z_loss_coef;
  return total;
}

gpt2::FeedForwardFactory moe_feed_forward(const MoeConfig& c, std::int64_t d) {
  return [c, d](std::int64_t layer, const at::TensorOptions& o) -> std::shared_ptr<gpt2::FeedForward> {
    if (!c.is_moe_layer(layer)) return nullptr;
    return std::make_shared<MoeFeedForwardImpl>(c, d, o);
  };
}

}  // namespace modalities::plugins::moe
