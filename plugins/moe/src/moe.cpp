// The MoE feed-forward (moe.h): routing, sorted dispatch, the stacked experts and the combine.
#include "moe.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/log.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
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
  s.rule([](const MoeConfig& c, ParseContext& ctx) {
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
  const at::Tensor a = gpt2::cast(w1, dt), b = gpt2::cast(w3, dt), c = gpt2::cast(w2, dt);
  if (grouped_mm) {
    // Row blocks of x by expert: offs[e] = the end of expert e's rows (int32, as _grouped_mm wants).
    const at::Tensor offs = counts.cumsum(0).to(at::kInt);
    const at::Tensor h =
        at::silu(at::_grouped_mm(x, a.transpose(-2, -1), offs)) * at::_grouped_mm(x, b.transpose(-2, -1), offs);
    return at::_grouped_mm(h, c.transpose(-2, -1), offs);
  }
  // One mm per expert that has tokens: the row counts are needed on the host.
  const at::Tensor host = counts.to(at::kCPU);
  const std::int64_t* n = host.data_ptr<std::int64_t>();
  std::vector<at::Tensor> parts;
  std::int64_t offset = 0;
  for (std::int64_t e = 0; e < host.numel(); ++e) {
    if (n[e] == 0) continue;
    const at::Tensor xe = x.narrow(0, offset, n[e]);
    const at::Tensor h = at::silu(at::mm(xe, a[e].t())) * at::mm(xe, b[e].t());
    parts.push_back(at::mm(h, c[e].t()));
    offset += n[e];
  }
  if (parts.empty()) return at::zeros_like(x);
  return parts.size() == 1 ? parts.front() : at::cat(parts, 0);
}

// --- the MoE block -----------------------------------------------------------------------------

MoeFeedForwardImpl::MoeFeedForwardImpl(const MoeConfig& c, std::int64_t d, const at::TensorOptions& o)
    : gpt2::FeedForward("MoeFeedForward"), c_(c) {
  auto router = register_module("router", std::make_shared<torch::nn::Module>("Router"));
  gate = router->register_module("gate", std::make_shared<gpt2::LinearImpl>(d, c.num_experts, /*bias=*/false, o));
  experts = register_module("experts", std::make_shared<GroupedExpertsImpl>(c.num_experts, d, c.moe_ffn_hidden, o));
  if (const std::int64_t h = c.shared_hidden(); h > 0) {
    shared_experts = register_module("shared_experts", std::make_shared<gpt2::SwiGLUImpl>(d, h, /*bias=*/false, o));
    if (c.shared_expert_gate)
      shared_expert_gate = register_module("shared_expert_gate", std::make_shared<gpt2::LinearImpl>(d, 1, false, o));
  }
}

void MoeFeedForwardImpl::check_tensor_parallel() const {
  throw Error(
      "model/gpt2_moe: tensor parallelism of MoE blocks is not implemented (plugins/moe/README.md, \"Status\"); "
      "train the MoE model without a tp dim (tensor_parallel_degree = 1)");
}

Routing MoeFeedForwardImpl::route(const at::Tensor& x, Dt dt) const {
  Routing r;
  // Scores in float32 whatever the compute dtype (transformers' softmax(..., dtype=torch.float)).
  r.router_logits = (*gate)(x, dt).to(at::kFloat);  // [N, E]
  r.scores = c_.score_function == "sigmoid" ? at::sigmoid(r.router_logits) : at::softmax(r.router_logits, /*dim=*/-1);
  auto [weights, chosen] = at::topk(r.scores, c_.top_k, /*dim=*/-1);  // [N, k], largest first
  if (c_.norm_topk_prob) weights = weights / weights.sum(-1, /*keepdim=*/true);
  if (c_.route_scale != 1.0) weights = weights * c_.route_scale;
  r.experts = chosen;
  r.weights = weights;
  {
    at::NoGradGuard no_grad;
    r.tokens_per_expert = at::bincount(chosen.reshape(-1), /*weights=*/{}, c_.num_experts);
  }
  return r;
}

at::Tensor MoeFeedForwardImpl::forward(const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt) {
  const at::Tensor h = gpt2::cast(x, dt);
  Routing r = route(h, dt);
  const std::int64_t k = c_.top_k;
  // Dispatch: the N*k (token, expert) pairs sorted by expert, stably, so every expert sees its
  // tokens in sequence order; then each expert's rows are one contiguous block.
  const at::Tensor flat = r.experts.reshape(-1);                // [N*k]
  const at::Tensor order = at::argsort(flat, /*stable=*/true);  // [N*k]
  const at::Tensor token = at::floor_divide(order, k);          // [N*k]
  const at::Tensor routed = h.index_select(0, token);           // [N*k, d]
  const bool grouped = use_grouped_mm(c_.experts_backend, h);
  log_backend_once(grouped, h);
  at::Tensor y = experts->forward(routed, r.tokens_per_expert, dt, grouped);
  // Combine: each pair's output times its weight (in the compute dtype, as transformers casts the
  // routing weights), summed per token in increasing expert order.
  y = y * r.weights.reshape(-1).index_select(0, order).to(y.scalar_type()).unsqueeze(1);
  at::Tensor out = at::zeros({h.size(0), h.size(1)}, y.options()).index_add(0, token, y);
  if (shared_experts) {
    at::Tensor s = shared_experts->forward(h, B, T, dt);
    if (shared_expert_gate) s = at::sigmoid((*shared_expert_gate)(h, dt)) * s;
    out = out + s;
  }
  if (c_.has_aux_loss()) {
    // Under activation checkpointing the block's first forward runs without autograd and its
    // recomputation comes after the loss: the auxiliary loss would train nothing.
    if (is_training() && !at::GradMode::is_enabled())
      throw Error(
          "model/gpt2_moe: a MoE block with an auxiliary loss (moe_config.aux_loss_coef or z_loss_coef > 0) ran a "
          "training forward without autograd, as activation checkpointing runs it; its loss would have no gradient. "
          "Checkpoint other blocks, or set both coefficients to 0 (plugins/moe/README.md, \"Status\")");
    aux_loss_ = aux_loss(r, B, T);
  }
  // Kept for metrics and tests, without the graph (which the next step must not keep alive).
  r.router_logits = r.router_logits.detach();
  r.scores = r.scores.detach();
  r.weights = r.weights.detach();
  last_ = std::move(r);
  return out;
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
