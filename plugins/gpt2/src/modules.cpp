// The layers of model/gpt2 and its root GPT2LLMImpl (modules.h).
#include "modules.h"

#include "fused_ops.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/log.h>
#include <modalities/sdk/norms.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/dropout.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace modalities::plugins::gpt2 {

class EmbeddingImpl final : public Leaf {
 public:
  EmbeddingImpl(std::int64_t num, std::int64_t dim, const at::TensorOptions& o) : Leaf("Embedding") {
    register_parameter("weight", at::empty({num, dim}, o));
    sync();
  }
  void reset() override { weight.normal_(0.0, 1.0); }
  /// Weight tying: this embedding uses `shared` (lm_head's weight) from now on.
  void tie(const at::Tensor& shared) {
    parameters_["weight"] = shared;
    sync();
  }
  // ids: [B, T] -> [B, T, dim]
  at::Tensor operator()(const at::Tensor& ids, Dt dt) const { return at::embedding(cast(weight, dt), ids); }

  at::Tensor weight;

 private:
  void sync() override { weight = registered("weight"); }
};

class NormImpl final : public Leaf {
 public:
  NormImpl(const NormWrapperConfig& c, const at::TensorOptions& o)
      : Leaf(norms::module_name(c.kind)), kind_(c.kind), n_(c.size), eps_(c.eps) {
    if (c.weight) register_parameter("weight", at::empty({n_}, o));
    if (c.bias) register_parameter("bias", at::empty({n_}, o));
    sync();
  }
  void reset() override {
    if (weight.defined()) weight.fill_(1.0);
    if (bias.defined()) bias.zero_();
  }
  // x: [..., n] -> [..., n], Modalities' norm formulas (README.md), in the compute dtype dt.
  at::Tensor operator()(const at::Tensor& x, Dt dt) const {
    const at::Tensor w = partial ? partial->shared(weight) : weight;
    // CPU fast path of RMSNorm, bit-identical to at::rms_norm (fused_ops.h).
    if (kind_ == norms::Kind::kTorchRmsNorm && x.dim() >= 1 && x.size(-1) == n_)
      return fused_rms_norm(x, cast(w, dt), eps_);
    return norms::apply(kind_, x, n_, cast(w, dt), cast(partial ? partial->shared(bias) : bias, dt), eps_);
  }

  at::Tensor weight, bias;
  const TpPlan* partial = nullptr;  // tensor parallel: applied to part of the data (TpPlan::shared)

 private:
  void sync() override {
    weight = registered("weight");
    bias = registered("bias");
  }
  norms::Kind kind_;
  std::int64_t n_;
  double eps_;
};

class IdentityTransformImpl final : public torch::nn::Module {
 public:
  IdentityTransformImpl() : torch::nn::Module("IdentityTransform") {}
};

class IdentityImpl final : public torch::nn::Module {  // wpe with poe_type NOPE (nn.Identity)
 public:
  IdentityImpl() : torch::nn::Module("Identity") {}
};

// RoPE, half-split (NeoX) convention; precision as in README.md, "Numerics".
class RotaryTransformImpl final : public Leaf {
 public:
  RotaryTransformImpl(std::int64_t head_dim, std::int64_t base_freq, std::optional<RopeScalingConfig> scaling,
                      const at::TensorOptions& o)
      : Leaf("RotaryTransform"), hd_(head_dim), base_(base_freq), scaling_(std::move(scaling)) {
    inv_freq_slot_ = &register_buffer("inv_freq", at::empty({hd_ / 2}, o));
  }
  void reset() override {
    // inv_freq[j] = 1 / base^(float32(2j) / hd), in float32 as torch computes it; written in place.
    const at::Tensor& buf = *inv_freq_slot_;
    const at::Tensor exps =
        at::arange(0, hd_, 2, at::TensorOptions().dtype(at::kLong).device(buf.device())).to(at::kFloat) / hd_;
    at::Tensor inv = at::reciprocal(at::pow(at::Scalar(base_), exps));
    if (scaling_) inv = scaled(inv, *scaling_);
    buf.copy_(inv);
    cache_ = {};
  }
  // Frequency scaling with the float32 ops of transformers' rope initialisers
  // (_compute_linear_scaling_rope_parameters, _compute_llama3_parameters), so imported models get
  // the very inv_freq their Hugging Face counterpart computes.
  static at::Tensor scaled(const at::Tensor& inv, const RopeScalingConfig& s) {
    if (s.rope_type == "linear") return inv / s.factor;
    const double old_len = static_cast<double>(s.original_max_position_embeddings);
    const double low_wavelen = old_len / s.low_freq_factor, high_wavelen = old_len / s.high_freq_factor;
    const at::Tensor wavelen = 2 * M_PI / inv;
    const at::Tensor llama = at::where(wavelen > low_wavelen, inv / s.factor, inv);
    const at::Tensor smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    const at::Tensor smoothed = (1 - smooth) * llama / s.factor + smooth * llama;
    const at::Tensor medium = (wavelen < high_wavelen).logical_not() * (wavelen > low_wavelen).logical_not();
    return at::where(medium, smoothed, llama);
  }
  void remap(const Remap& f) override {
    *inv_freq_slot_ = f(*inv_freq_slot_);
    cache_ = {};
  }
  // q: [B, Hq, T, hd], k: [B, Hkv, T, hd] -> rotated q, k (v is unchanged); at `positions` [B or
  // 1, T] when defined (each token's position in its document, or in the whole sequence under
  // context parallelism), all below `length` (0: T).
  std::pair<at::Tensor, at::Tensor> operator()(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& positions = {}, std::int64_t length = 0) {
    const auto [cos, sin] = positions.defined() ? tables_at(positions, k.device(), k.scalar_type(), length)
                                                : tables(k.size(-2), k.device(), k.scalar_type());
    return {apply(q, cos, sin), apply(k, cos, sin)};
  }
  // The rows of tables() at `positions` [P, T] (each below `length`; 0: T): cos/sin [P, 1, T, hd].
  std::pair<at::Tensor, at::Tensor> tables_at(const at::Tensor& positions, const c10::Device& device,
                                              c10::ScalarType dtype, std::int64_t length = 0) {
    const std::int64_t P = positions.size(0), T = positions.size(1), n = length > 0 ? length : T;
    const auto& [cos, sin] = tables(n, device, dtype);
    const at::Tensor rows = positions.reshape({-1});
    return {cos.view({n, hd_}).index_select(0, rows).view({P, 1, T, hd_}),
            sin.view({n, hd_}).index_select(0, rows).view({P, 1, T, hd_})};
  }
  const at::Tensor& inv_freq() const { return *inv_freq_slot_; }
  std::int64_t head_dim() const { return hd_; }

  // cos/sin [1, 1, T, hd] in `dtype`, cached per (T, device, dtype, inv_freq version) like
  // Modalities' per-module cache. No host synchronisation: only metadata is compared.
  std::pair<at::Tensor, at::Tensor> tables(std::int64_t T, const c10::Device& device, c10::ScalarType dtype) {
    const at::Tensor& inv = *inv_freq_slot_;
    if (cache_.cos.defined() && cache_.T == T && cache_.device == device && cache_.dtype == dtype &&
        cache_.inv == inv.unsafeGetTensorImpl() && cache_.version == inv._version())
      return {cache_.cos, cache_.sin};
    at::NoGradGuard no_grad;
    const at::Tensor t = at::arange(T, at::TensorOptions().dtype(at::kFloat).device(device));
    // The frequencies are rounded to the activation dtype first (bf16 runs), the product is float32.
    const at::Tensor f = inv.to(device).to(dtype).to(at::kFloat);
    const at::Tensor freqs = t.unsqueeze(1) * f.unsqueeze(0);  // [T, hd/2]
    const at::Tensor emb = at::cat({freqs, freqs}, -1);        // [T, hd]
    cache_.cos = emb.cos().unsqueeze(0).unsqueeze(0).to(dtype);
    cache_.sin = emb.sin().unsqueeze(0).unsqueeze(0).to(dtype);
    cache_.T = T;
    cache_.device = device;
    cache_.dtype = dtype;
    cache_.inv = inv.unsafeGetTensorImpl();
    cache_.version = inv._version();
    return {cache_.cos, cache_.sin};
  }

 private:
  static at::Tensor rotate_half(const at::Tensor& x) {
    const auto halves = x.chunk(2, -1);
    return at::cat({-halves[1], halves[0]}, -1);
  }
  static at::Tensor apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    return x * cos + rotate_half(x) * sin;
  }
  std::int64_t hd_;
  std::int64_t base_;
  std::optional<RopeScalingConfig> scaling_;
  at::Tensor* inv_freq_slot_ = nullptr;  // see Note [Replacing registered tensors]
  struct Cache {
    std::int64_t T = -1;
    c10::Device device = c10::kCPU;
    c10::ScalarType dtype = at::kFloat;
    const void* inv = nullptr;
    std::uint32_t version = 0;
    at::Tensor cos, sin;
  } cache_;
};

// Causal masks, shared by all layers and cached per (T, device, dtype): the additive mask of the
// manual path (0 where position i may attend to j, -inf elsewhere) and, with a sliding window, the
// boolean mask handed to SDPA. Allowed: j <= i, and i - window < j with a window (transformers'
// sliding_window_causal_mask_function).
class CausalMaskCache {
 public:
  explicit CausalMaskCache(std::optional<std::int64_t> window = std::nullopt) : window_(window) {}
  const at::Tensor& get(std::int64_t T, const at::TensorOptions& o) {
    if (mask_.defined() && mask_.size(0) == T && mask_.device() == o.device() &&
        mask_.scalar_type() == o.dtype().toScalarType())
      return mask_;
    mask_ = at::zeros({T, T}, o).masked_fill_(allowed(T, o.device()).logical_not(),
                                              -std::numeric_limits<double>::infinity());
    return mask_;
  }
  // Boolean [T, T] (true: attend) when a sliding window cuts into length T; undefined otherwise
  // (plain causal attention, SDPA's is_causal).
  at::Tensor sliding(std::int64_t T, const c10::Device& device) {
    if (!window_ || *window_ >= T) return {};
    if (!bool_.defined() || bool_.size(0) != T || bool_.device() != device) bool_ = allowed(T, device);
    return bool_;
  }

 private:
  at::Tensor allowed(std::int64_t T, const c10::Device& device) const {
    at::Tensor keep = at::ones({T, T}, at::TensorOptions().dtype(at::kBool).device(device)).tril();
    if (window_) keep = keep.logical_and(at::ones_like(keep).triu(-(*window_ - 1)));
    return keep;
  }
  std::optional<std::int64_t> window_;
  at::Tensor mask_, bool_;
};

enum class AttentionImpl { kManual, kPytorchFlash };

// [B, Hkv, S, hd] -> [B, Hkv * r, S, hd]: kv head j serves query heads j r .. j r + r - 1.
at::Tensor repeat_kv_heads(const at::Tensor& t, std::int64_t r) {
  if (r == 1) return t;
  const std::int64_t B = t.size(0), H = t.size(1), S = t.size(2), hd = t.size(3);
  return t.unsqueeze(2).expand({B, H, r, S, hd}).reshape({B, H * r, S, hd});
}

// Causal attention of the last L of S tokens on the CPU (Note [Context-parallel attention]): q
// [B, Hq, L, hd] are tokens S - L .. S - 1, k, v [B, Hkv, S, hd] every token up to them. Two
// flash-attention calls, the L x L diagonal block causally and the S - L earlier keys whole,
// merged by their log-sum-exps; backward runs each block's flash backward with the merged output
// and log-sum-exp, which gives each block's exact share of the gradient (ring attention's
// identity: P = exp(s - lse) and D = rowsum(dO * O) are those of the whole row). Saves q, the
// un-expanded k and v, the output and the log-sum-exp: no mask, no scores.
class PrefixCausalFlash final : public torch::autograd::Function<PrefixCausalFlash> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v) {
    const std::int64_t L = q.size(2), S = k.size(2), P = S - L, r = q.size(1) / k.size(1);
    const at::Tensor K = repeat_kv_heads(k, r), V = repeat_kv_heads(v, r);
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, K.narrow(2, P, L), V.narrow(2, P, L), 0.0,
                                                                      /*is_causal=*/true);
    if (P > 0) {
      const auto [o_prefix, l_prefix] =
          at::_scaled_dot_product_flash_attention_for_cpu(q, K.narrow(2, 0, P), V.narrow(2, 0, P), 0.0, false);
      const at::Tensor merged = at::logaddexp(lse, l_prefix);  // [B, Hq, L]
      const c10::ScalarType acc = lse.scalar_type();
      out = (out.to(acc) * (lse - merged).exp().unsqueeze(-1) +
             o_prefix.to(acc) * (l_prefix - merged).exp().unsqueeze(-1))
                .to(q.scalar_type());
      lse = merged;
    }
    ctx->save_for_backward({q, k, v, out, lse});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2], &out = s[3], &lse = s[4];
    const std::int64_t L = q.size(2), S = k.size(2), P = S - L, r = q.size(1) / k.size(1);
    const at::Tensor K = repeat_kv_heads(k, r), V = repeat_kv_heads(v, r);
    const at::Tensor g = grads[0].contiguous();
    auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, K.narrow(2, P, L), V.narrow(2, P, L), out, lse, 0.0, /*is_causal=*/true);
    if (P > 0) {
      const auto [dq_prefix, dk_prefix, dv_prefix] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          g, q, K.narrow(2, 0, P), V.narrow(2, 0, P), out, lse, 0.0, false);
      dq = dq + dq_prefix;
      dk = at::cat({dk_prefix, dk}, 2);
      dv = at::cat({dv_prefix, dv}, 2);
    }
    if (r > 1) {  // each kv head's gradient: the sum over the query heads it served
      dk = dk.view({k.size(0), k.size(1), r, S, k.size(3)}).sum(2);
      dv = dv.view({v.size(0), v.size(1), r, S, v.size(3)}).sum(2);
    }
    return {dq, dk, dv};
  }
};

at::Tensor prefix_causal_flash(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return PrefixCausalFlash::apply(q, k, v);
}

// A row-parallel linear (its weight split on the input dim): the local product, summed over the
// ranks by TpPlan::leave, then the bias, once (a replicated parameter: under sequence parallelism
// each rank adds it to its chunk, so its gradient is summed over the ranks).
at::Tensor row_parallel(const LinearImpl& l, const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt,
                        const TpPlan& tp) {
  at::Tensor y = tp.leave(fused_linear(x, cast(l.weight, dt), at::Tensor()), B, T);
  if (l.bias.defined()) y = y + cast(tp.sequence_parallel ? tp.shared(l.bias) : l.bias, dt);
  return y;
}

class CausalSelfAttentionImpl final : public torch::nn::Module {
 public:
  CausalSelfAttentionImpl(const GPT2Config& c, std::shared_ptr<CausalMaskCache> mask, const at::TensorOptions& o)
      : torch::nn::Module("CausalSelfAttention"),
        hq_(c.n_head_q),
        hkv_(c.n_head_kv),
        hd_(c.head_dim()),
        dropout_(c.dropout),
        impl_(c.attention_implementation == "manual" ? AttentionImpl::kManual : AttentionImpl::kPytorchFlash),
        mask_(std::move(mask)) {
    const std::int64_t width = c.attention_width(), kv = c.n_head_kv * c.head_dim();
    q_attn = register_module("q_attn", std::make_shared<LinearImpl>(c.n_embd, width, c.qkv_bias_on(), o));
    k_attn = register_module("k_attn", std::make_shared<LinearImpl>(c.n_embd, kv, c.qkv_bias_on(), o));
    v_attn = register_module("v_attn", std::make_shared<LinearImpl>(c.n_embd, kv, c.qkv_bias_on(), o));
    c_proj = register_module("c_proj", std::make_shared<LinearImpl>(width, c.n_embd, c.attn_proj_bias_on(), o));
    register_module("resid_dropout", torch::nn::Dropout(c.dropout));
    // A plain module named like nn.ModuleList, entries "0", "1", ...; typed view in `rope_`.
    auto list = register_module("qkv_transforms", std::make_shared<torch::nn::Module>("ModuleList"));
    for (std::size_t j = 0; j < c.attention_config.qkv_transforms.size(); ++j) {
      const QkvTransformConfig& t = c.attention_config.qkv_transforms[j];
      if (t.rotary) {
        auto rope = std::make_shared<RotaryTransformImpl>(t.rope.n_embd / t.rope.n_head, t.rope.base_freq,
                                                          t.rope.rope_scaling, o);
        list->register_module(std::to_string(j), rope);
        rope_.push_back(rope);
      } else {
        list->register_module(std::to_string(j), std::make_shared<IdentityTransformImpl>());
      }
    }
    norm_before_ = c.attention_config.qk_norm_before_transforms();
    if (c.attention_config.qk_norm_config) {
      q_norm = register_module("q_norm", std::make_shared<NormImpl>(*c.attention_config.qk_norm_config, o));
      k_norm = register_module("k_norm", std::make_shared<NormImpl>(*c.attention_config.qk_norm_config, o));
    }
  }

  // x: [B*T, d] (rows = tokens, see GPT2LLMImpl::forward) -> [B*T, d]; inside documents with `docs`.
  // Under context parallelism T is this rank's tokens and `docs` says where they are.
  at::Tensor operator()(const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt, const Documents* docs) {
    const at::Tensor positions = docs != nullptr ? docs->positions : at::Tensor();
    const bool cp = docs != nullptr && docs->cp != nullptr;
    const std::int64_t table_length = cp ? docs->cp_length : 0;
    at::Tensor q, k, v;  // [B, Hq, T, hd] each once expanded
    const std::int64_t r = hq_ / hkv_;
    if (!norm_before_ && rope_.size() <= 1 && (rope_.empty() || rope_.front()->head_dim() == hd_)) {
      // Common case, fused (fused_ops.h): the three projections, the heads split, RoPE and
      // the GQA expansion as one autograd node. With qk-norm the norms come between RoPE and
      // the expansion, which then happens below.
      HeadsSpec sq, sk, sv;
      sq.heads = hq_;
      sk.heads = sv.heads = hkv_;
      if (!rope_.empty()) {
        std::tie(sq.cos, sq.sin) = positions.defined()
                                       ? rope_.front()->tables_at(positions, x.device(), x.scalar_type(), table_length)
                                       : rope_.front()->tables(T, x.device(), x.scalar_type());
        sk.cos = sq.cos;
        sk.sin = sq.sin;
      }
      sk.repeat = sv.repeat = q_norm || cp ? 1 : r;  // context parallel: gathered before the expansion
      Qkv h =
          fused_qkv(x, cast(q_attn->weight, dt), cast(q_attn->bias, dt), cast(k_attn->weight, dt),
                    cast(k_attn->bias, dt), cast(v_attn->weight, dt), cast(v_attn->bias, dt), B, T, hd_, sq, sk, sv);
      q = std::move(h.q);
      k = std::move(h.k);
      v = std::move(h.v);
    } else {
      q = (*q_attn)(x, dt).view({B, T, hq_, hd_}).transpose(1, 2).contiguous();  // [B, Hq, T, hd]
      k = (*k_attn)(x, dt).view({B, T, -1, hd_}).transpose(1, 2).contiguous();   // [B, Hkv, T, hd]
      v = (*v_attn)(x, dt).view({B, T, -1, hd_}).transpose(1, 2).contiguous();   // [B, Hkv, T, hd]
      if (norm_before_) {  // Qwen3: each head normalized, then rotated
        q = (*q_norm)(q, dt);
        k = (*k_norm)(k, dt);
      }
      for (const auto& rope : rope_) std::tie(q, k) = (*rope)(q, k, positions, table_length);
    }
    if (q_norm && !norm_before_) {
      q = (*q_norm)(q, dt);
      k = (*k_norm)(k, dt);
    }
    at::Tensor y;  // [B, Hq, T, hd]
    if (cp) {
      y = context_parallel_attention(q, k, v, *docs);
      return finish(y, B, T, dt);
    }
    // GQA: kv head j serves query heads j*r .. j*r+r-1 (repeat_interleave over dim 1).
    if (hq_ != hkv_ && k.size(1) != hq_) {
      k = k.unsqueeze(2).expand({B, hkv_, r, T, hd_}).reshape({B, hq_, T, hd_});
      v = v.unsqueeze(2).expand({B, hkv_, r, T, hd_}).reshape({B, hq_, T, hd_});
    }
    // [B, 1, T, T], or undefined when pytorch_flash goes document by document.
    const at::Tensor documents = docs != nullptr ? docs->mask : at::Tensor();
    if (impl_ == AttentionImpl::kManual) {
      at::Tensor s = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd_)));
      if (documents.defined()) s = s.masked_fill(documents.logical_not(), -std::numeric_limits<double>::infinity());
      else s = s + mask_->get(T, q.options());
      at::Tensor p = at::softmax(s, -1);
      if (dropout_ > 0) p = at::dropout(p, dropout_, /*train=*/true);  // in every mode, as in Modalities
      y = at::matmul(p, v);
    } else if (docs != nullptr && !docs->lengths.empty()) {
      y = docs->cu_seqlens.defined() ? attend_varlen(q, k, v, *docs) : attend_by_document(q, k, v, docs->lengths);
    } else if (documents.defined()) {
      y = at::scaled_dot_product_attention(q, k, v, documents, dropout_, /*is_causal=*/false);
    } else if (const at::Tensor window = mask_->sliding(T, q.device()); window.defined()) {
      y = at::scaled_dot_product_attention(q, k, v, window, dropout_, /*is_causal=*/false);
    } else {
      // Dropout in every mode too: Modalities passes dropout_p without consulting the mode.
      y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, dropout_, /*is_causal=*/true);
    }
    return finish(y, B, T, dt);
  }

  // The heads merged, the output projection and dropout: [B, Hq, T, hd] -> [B*T, d].
  at::Tensor finish(const at::Tensor& attended, std::int64_t B, std::int64_t T, Dt dt) {
    at::Tensor y = fused_merge_heads(attended);  // [B*T, d], heads side by side (this rank's heads under TP)
    y = tp_ ? row_parallel(*c_proj, y, B, T, dt, *tp_) : (*c_proj)(y, dt);
    if (is_training() && dropout_ > 0) y = at::dropout(y, dropout_, /*train=*/true);
    return y;
  }

  // Note [Context-parallel attention]
  // This rank's queries are its two chunks of L tokens, chunks c = rank and 2 cp - 1 - rank; the
  // keys and values of every rank are all-gathered (cp::SequenceShard::gather, whose backward
  // reduce-scatters their gradients back to their owners) before the GQA expansion, so with
  // grouped-query attention only Hkv / Hq of the query's bytes travel: Llama 3's all-gather
  // design, simpler than a ring and as fast where the K/V are small. Chunk c's queries attend to
  // the prefix [0, (c + 1) L) of the keys:
  //   - masks (several documents, a sliding window, manual attention): SDPA (or the manual
  //     softmax) over the prefix with the chunk's mask, built once per forward;
  //   - pytorch_flash on the CPU: the prefix before the chunk is seen whole and the chunk itself
  //     causally, two flash-attention calls merged by their log-sum-exps (PrefixCausalFlash,
  //     backward with the merged output and log-sum-exp, as ring attention does): no mask, no
  //     score matrix, no expanded K/V kept for backward;
  //   - elsewhere (CUDA): SDPA with the bottom-right causal mask of the chunk.
  at::Tensor context_parallel_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const Documents& docs) {
    const cp::SequenceShard& shard = *docs.cp;
    const std::int64_t L = q.size(2) / 2;
    const at::Tensor keys = shard.gather(k, 2), values = shard.gather(v, 2);  // [B, Hkv, T_whole, hd]
    const std::vector<at::Tensor> queries = q.split(L, 2);
    std::vector<at::Tensor> out;
    for (std::size_t part = 0; part < 2; ++part) {
      const std::int64_t c = part == 0 ? shard.first_chunk() : shard.second_chunk(), S = (c + 1) * L;
      const at::Tensor& qc = queries[part];
      const at::Tensor& mask = docs.cp_masks[part];
      const bool flash = impl_ == AttentionImpl::kPytorchFlash && !mask.defined() && dropout_ == 0 && qc.is_cpu();
      if (flash) {
        out.push_back(prefix_causal_flash(qc, keys.narrow(2, 0, S), values.narrow(2, 0, S)));
        continue;
      }
      at::Tensor kc = expand_heads(keys.narrow(2, 0, S)), vc = expand_heads(values.narrow(2, 0, S));
      at::Tensor allowed = mask;
      if (!allowed.defined()) {  // bottom-right causal: row i is token (c L + i)
        const at::TensorOptions o = q.options().dtype(at::kLong);
        allowed = at::arange(S, o).unsqueeze(0).le(at::arange(c * L, S, o).unsqueeze(1)).view({1, 1, L, S});
      }
      if (impl_ == AttentionImpl::kManual) {
        at::Tensor s = at::matmul(qc, kc.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd_)));
        at::Tensor p = at::softmax(s.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity()), -1);
        if (dropout_ > 0) p = at::dropout(p, dropout_, /*train=*/true);
        out.push_back(at::matmul(p, vc));
      } else {
        out.push_back(at::scaled_dot_product_attention(qc, kc, vc, allowed, dropout_, /*is_causal=*/false));
      }
    }
    return at::cat(out, 2);
  }

  at::Tensor expand_heads(const at::Tensor& t) const { return repeat_kv_heads(t, hq_ / t.size(1)); }

  // Causal SDPA on each document of each sample (Note [Document masking]): q, k, v [B, H, T, hd]
  // cut by unbind and split, whose backwards stack and concatenate the gradients once (a narrow
  // per document would fill a zero gradient of the whole tensor each time).
  at::Tensor attend_by_document(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::vector<std::vector<std::int64_t>>& lengths) const {
    const std::vector<at::Tensor> qs = q.unbind(0), ks = k.unbind(0), vs = v.unbind(0);
    std::vector<at::Tensor> samples;
    samples.reserve(qs.size());
    for (std::size_t b = 0; b < qs.size(); ++b) {
      const std::vector<std::int64_t>& n = lengths[b];
      const std::vector<at::Tensor> qd = qs[b].split_with_sizes(n, 1), kd = ks[b].split_with_sizes(n, 1),
                                    vd = vs[b].split_with_sizes(n, 1);
      std::vector<at::Tensor> out;
      out.reserve(n.size());
      for (std::size_t d = 0; d < n.size(); ++d)
        out.push_back(at::scaled_dot_product_attention(qd[d].unsqueeze(0), kd[d].unsqueeze(0), vd[d].unsqueeze(0),
                                                       /*attn_mask=*/{}, dropout_, /*is_causal=*/true)
                          .squeeze(0));
      samples.push_back(out.size() == 1 ? out.front() : at::cat(out, 1));
    }
    return at::stack(samples);
  }

  // CUDA: every document of the batch in one flash-attention varlen call (the kernel LibTorch
  // exposes as _flash_attention_forward, differentiable; cumulative lengths over the flattened
  // batch, causal inside each). float32 goes document by document; where the kernel cannot run (a
  // build or GPU without flash attention) too, said once. Out of memory is not that: it is
  // rethrown. Built; not run on a GPU yet.
  at::Tensor attend_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Documents& docs) const {
    static std::atomic<bool> unavailable{false};
    const bool half = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
    if (half && !unavailable.load()) {
      const std::int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = q.size(3);
      const auto packed = [&](const at::Tensor& t) { return t.transpose(1, 2).reshape({B * T, t.size(1), hd}); };
      try {
        const auto out = at::_flash_attention_forward(packed(q), packed(k), packed(v), docs.cu_seqlens, docs.cu_seqlens,
                                                      docs.max_length, docs.max_length, dropout_, /*is_causal=*/true,
                                                      /*return_debug_mask=*/false);
        return std::get<0>(out).view({B, T, H, hd}).transpose(1, 2);
      } catch (const c10::OutOfMemoryError&) {
        throw;
      } catch (const std::exception& e) {
        if (!unavailable.exchange(true))
          log::warning(
              fmt::format("document masking: the flash-attention varlen kernel cannot run here ({}); "
                          "attending document by document",
                          std::string(e.what()).substr(0, 200)));
      }
    }
    return attend_by_document(q, k, v, docs.lengths);
  }

  // Tensor parallel: this rank computes heads [rank * Hq / size, ...) (and the matching kv heads);
  // the projections' weights were split by GPT2::parallelize.
  void parallelize(const TpPlan& tp) {
    hq_ /= tp.size;
    hkv_ /= tp.size;
    tp_ = &tp;
    if (q_norm) q_norm->partial = k_norm->partial = &tp;  // per-head norms see this rank's heads only
  }

  std::shared_ptr<LinearImpl> q_attn, k_attn, v_attn, c_proj;
  std::shared_ptr<NormImpl> q_norm, k_norm;

 private:
  const TpPlan* tp_ = nullptr;
  std::int64_t hq_, hkv_, hd_;
  double dropout_;
  AttentionImpl impl_;
  std::shared_ptr<CausalMaskCache> mask_;
  std::vector<std::shared_ptr<RotaryTransformImpl>> rope_;
  bool norm_before_ = false;  // qk-norm before the transforms (attention_config.qk_norm_position)
};

void FeedForward::check_tensor_parallel(const TpPlan&) const {
  throw Error(fmt::format("the feed-forward '{}' does not support tensor parallelism", name()));
}

void FeedForward::parallelize(const TpPlan& plan) { check_tensor_parallel(plan); }

ExpertParallel::ExpertParallel(c10::intrusive_ptr<c10d::ProcessGroup> g, std::int64_t r, std::int64_t n)
    : group(std::move(g)), rank(r), size(n) {}
ExpertParallel::ExpertParallel(const ExpertParallel&) = default;
ExpertParallel& ExpertParallel::operator=(const ExpertParallel&) = default;
ExpertParallel::~ExpertParallel() = default;

std::vector<std::string> FeedForward::parallelize_experts(const ExpertParallel&) { return {}; }

SwiGLUImpl::SwiGLUImpl(std::int64_t d, std::int64_t h, bool bias, const at::TensorOptions& o) : FeedForward("SwiGLU") {
  W = register_module("W", std::make_shared<LinearImpl>(d, h, bias, o));
  register_module("silu", torch::nn::SiLU());
  V = register_module("V", std::make_shared<LinearImpl>(d, h, bias, o));
  W_2 = register_module("W_2", std::make_shared<LinearImpl>(h, d, bias, o));
}

at::Tensor SwiGLUImpl::forward(const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt) {
  const at::Tensor g = fused_swiglu(x, cast(W->weight, dt), cast(W->bias, dt), cast(V->weight, dt), cast(V->bias, dt));
  return tp ? row_parallel(*W_2, g, B, T, dt, *tp) : (*W_2)(g, dt);
}

class TransformerMLPImpl final : public FeedForward {
 public:
  TransformerMLPImpl(const GPT2Config& c, const at::TensorOptions& o)
      : FeedForward("TransformerMLP"), dropout_(c.dropout), tanh_(c.activation_type == "gelu_tanh") {
    c_fc = register_module("c_fc", std::make_shared<LinearImpl>(c.n_embd, c.ffn_hidden, c.mlp_bias_on(), o));
    register_module("gelu", torch::nn::GELU(torch::nn::GELUOptions().approximate(tanh_ ? "tanh" : "none")));
    c_proj = register_module("c_proj", std::make_shared<LinearImpl>(c.ffn_hidden, c.n_embd, c.mlp_bias_on(), o));
    register_module("dropout", torch::nn::Dropout(c.dropout));
  }
  // x: [B*T, d] -> [B*T, ffn_hidden] -> [B*T, d]; exact (erf) GELU, or its tanh approximation
  // (gelu_tanh, GPT-2's gelu_new). Under TP c_fc is column-parallel, c_proj row-parallel.
  at::Tensor forward(const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt) override {
    const at::Tensor a = at::gelu((*c_fc)(x, dt), tanh_ ? "tanh" : "none");
    at::Tensor y = tp ? row_parallel(*c_proj, a, B, T, dt, *tp) : (*c_proj)(a, dt);
    if (is_training() && dropout_ > 0) y = at::dropout(y, dropout_, /*train=*/true);
    return y;
  }

  void check_tensor_parallel(const TpPlan&) const override {}
  void parallelize(const TpPlan& plan) override { tp = &plan; }

  std::shared_ptr<LinearImpl> c_fc, c_proj;
  const TpPlan* tp = nullptr;

 private:
  double dropout_;
  bool tanh_;
};

class GPT2BlockImpl final : public torch::nn::Module {
 public:
  GPT2BlockImpl(const GPT2Config& c, std::shared_ptr<CausalMaskCache> mask, std::shared_ptr<FeedForward> ffn,
                const at::TensorOptions& o)
      : torch::nn::Module("GPT2Block") {
    attention_norm = register_module("attention_norm", std::make_shared<NormImpl>(c.attention_norm_config, o));
    ffn_norm = register_module("ffn_norm", std::make_shared<NormImpl>(c.ffn_norm_config, o));
    attn = register_module("attn", std::make_shared<CausalSelfAttentionImpl>(c, std::move(mask), o));
    if (!ffn && c.activation_type == "swiglu")
      ffn = std::make_shared<SwiGLUImpl>(c.n_embd, swiglu_hidden(c.ffn_hidden, c.enforce_swiglu_hidden_dim_multiple_of),
                                         c.mlp_bias_on(), o);
    else if (!ffn) ffn = std::make_shared<TransformerMLPImpl>(c, o);
    mlp = register_module("mlp", std::move(ffn));
  }
  // Pre-norm residual block. x: [B*T, d] -> [B*T, d]; under sequence parallelism this rank's
  // sequence chunk [B*(T/tp), d], gathered whole into the attention and the MLP.
  at::Tensor operator()(at::Tensor x, std::int64_t B, std::int64_t T, Dt dt, const Documents* docs = nullptr) {
    const auto enter = [&](const at::Tensor& n) { return tp ? tp->enter(n, B, T) : n; };
    x = x + (*attn)(enter((*attention_norm)(x, dt)), B, T, dt, docs);
    const at::Tensor normed = (*ffn_norm)(x, dt);
    if (!mlp->replicated_under_tensor_parallel()) return x + mlp->forward(enter(normed), B, T, dt);
    if (!tp || !tp->sequence_parallel) return x + mlp->forward(normed, B, T, dt);
    // A feed-forward that computes whole on every tp rank (a MoE block) under sequence
    // parallelism: the whole sequence in (all-gather; backward: this rank's chunk, the ranks'
    // gradients being equal), this rank's chunk out (backward: all-gathered).
    const std::int64_t Tl = T / tp->size;
    const at::Tensor whole = tp::gather_from_tensor_parallel(normed.view({B, Tl, -1}), 1, tp->group);
    const at::Tensor y = mlp->forward(whole.reshape({B * T, -1}), B, T, dt);
    return x + tp::split_to_tensor_parallel(y.view({B, T, -1}), 1, tp->group).reshape({B * Tl, -1});
  }

  void parallelize(const TpPlan& plan) {
    tp = &plan;
    attn->parallelize(plan);
    mlp->parallelize(plan);
    if (plan.sequence_parallel) attention_norm->partial = ffn_norm->partial = &plan;
  }
  const TpPlan* tp = nullptr;

  std::shared_ptr<NormImpl> attention_norm, ffn_norm;
  std::shared_ptr<CausalSelfAttentionImpl> attn;
  std::shared_ptr<FeedForward> mlp;
};

namespace {

// Off the meta device a module is initialized as soon as it is created (Modalities' order of random numbers).
template <class M>
std::shared_ptr<M> init(std::shared_ptr<M> m, const at::TensorOptions& o) {
  if (!o.device().is_meta()) GPT2LLMImpl::reset_leaves(*m);
  return m;
}

}  // namespace

GPT2LLMImpl::GPT2LLMImpl(const GPT2Config& c, const at::TensorOptions& o, const FeedForwardFactory& ffn)
    : torch::nn::Module("GPT2LLM"),
      absolute_(c.poe_type == "ABSOLUTE"),
      window_(c.attention_config.sliding_window),
      manual_attention_(c.attention_implementation == "manual"),
      sequence_length_(c.sequence_length),
      dropout_(c.dropout) {
  auto mask = std::make_shared<CausalMaskCache>(c.attention_config.sliding_window);
  // Objects are created (and, off the meta device, initialized) in Modalities' construction
  // order so that a seeded build draws random numbers in the same sequence: wpe, wte,
  // blocks, lm_head; they are registered in the canonical FQN order below.
  std::shared_ptr<torch::nn::Module> wpe;
  if (absolute_) wpe = wpe_ = init(std::make_shared<EmbeddingImpl>(c.sequence_length, c.n_embd, o), o);
  else wpe = std::make_shared<IdentityImpl>();
  wte_ = init(std::make_shared<EmbeddingImpl>(c.vocab_size, c.n_embd, o), o);
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> blocks;
  for (std::int64_t i = 0; i < c.n_layer; ++i) {
    auto block = std::make_shared<GPT2BlockImpl>(c, mask, ffn ? ffn(i, o) : nullptr, o);
    if (!o.device().is_meta()) reset_leaves(*block);
    blocks.emplace_back(std::to_string(i), block);
  }
  lm_head_norm_ = init(std::make_shared<NormImpl>(c.lm_head_norm_config, o), o);
  lm_head_ = init(std::make_shared<LinearImpl>(c.n_embd, c.vocab_size, /*bias=*/false, o), o);
  if (c.use_weight_tying) wte_->tie(lm_head_->weight);

  h_ = torch::nn::ModuleDict(blocks);
  transformer_ = torch::nn::ModuleDict(std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{
      {"wte", wte_},
      {"wpe", wpe},
      {"drop", torch::nn::Dropout(c.dropout).ptr()},
      {"h", h_.ptr()},
      {"lm_head_norm", lm_head_norm_},
      {"lm_head", lm_head_}});
  register_module("transformer", transformer_);
}

at::Tensor GPT2LLMImpl::forward(const at::Tensor& input, Dt dt, std::shared_ptr<const Documents> docs) {
  TORCH_CHECK(input.dim() >= 2, "gpt2: expected input of shape [B, T], got ", input.sizes());
  // Context parallelism: a part with wte keeps this rank's tokens of the whole ids [B, T]; later
  // pipeline stages get the hidden states of its tokens. From here on T counts this rank's tokens.
  const at::Tensor tokens = cp_ && transformer_->contains("wte") ? cp_->shard(input, 1) : input;
  const std::int64_t B = tokens.size(0), T = tokens.size(1), whole = cp_ ? T * cp_->size : T;
  TORCH_CHECK(whole <= sequence_length_, "gpt2: cannot forward a sequence of length ", whole,
              ", the model's maximum input sequence length (sequence_length) is ", sequence_length_);
  TORCH_CHECK(!cp_ || (docs != nullptr && docs->cp == cp_.get()),
              "gpt2: a context-parallel forward needs the documents of context_parallel_documents");
  const TpPlan* tp = tp_.get();
  const bool sp = tp && tp->sequence_parallel;
  TORCH_CHECK(!sp || T % tp->size == 0, "gpt2_tp: sequence parallelism splits the sequence over the ", tp->size,
              " tensor-parallel ranks; an input of length ", T, " does not split evenly");
  at::Tensor h;
  if (transformer_->contains("wte") && tp) {
    h = vocab_parallel_embedding(tokens, B, T, dt);  // [B*T, d], or [B*(T/tp), d] with SP
    if (absolute_ && transformer_->contains("wpe")) {
      const std::int64_t Tl = sp ? T / tp->size : T;
      h = (h.view({B, Tl, -1}) + position_rows(B, sp ? tp->rank * Tl : 0, Tl, dt, docs.get(), sp)).view({B * Tl, -1});
    }
  } else if (transformer_->contains("wte")) {
    if (absolute_ && transformer_->contains("wpe"))
      h = ((*wte_)(tokens, dt) + position_rows(B, 0, T, dt, docs.get(), false)).view({B * T, -1});
    else h = (*wte_)(tokens.reshape({B * T}), dt);  // [B*T, d]
  } else {
    TORCH_CHECK(tokens.dim() == 3, "gpt2: a part without wte expects hidden states [B, T, d], got ", tokens.sizes());
    h = (tokens.is_floating_point() ? cast(tokens, dt) : tokens).reshape({B * T, tokens.size(2)});
    if (absolute_ && transformer_->contains("wpe"))
      h = (h.view({B, T, -1}) + position_rows(B, 0, T, dt, docs.get(), false)).view({B * T, -1});
    if (sp)  // replicated hidden states -> this rank's sequence chunk
      h = tp::split_to_tensor_parallel(h.view({B, T, -1}), 1, tp->group).reshape({B * (T / tp->size), -1});
  }
  if (is_training() && dropout_ > 0) h = at::dropout(h, dropout_, /*train=*/true);
  if (transformer_->contains("h")) {
    for (const auto& item : *h_) {
      auto& block = *item.value()->as<GPT2BlockImpl>();
      if (hooks_.empty()) {  // the common case: no fqn string, no std::function per block
        h = block(h, B, T, dt, docs.get());
        continue;
      }
      const std::string fqn = "transformer.h." + item.key();
      if (block.mlp->has_aux_loss() && hooks_.has_runner(fqn)) {
        h = run_block_with_aux_loss(fqn, block, h, B, T, dt, docs);
        continue;
      }
      // Only the model-owned block and values (and the documents, shared): a block runner
      // (activation checkpointing) may call it again in backward.
      h = hooks_.around(fqn, "GPT2Block", h,
                        [&block, B, T, dt, docs](const at::Tensor& x) { return block(x, B, T, dt, docs.get()); });
    }
  }
  if (transformer_->contains("lm_head_norm")) h = (*lm_head_norm_)(h, dt);
  if (transformer_->contains("lm_head") && tp) {
    // Column-parallel head: this rank's vocabulary slice [B*T, V/tp], gathered to [B*T, V]
    // unless the loss takes the slices (loss parallel).
    h = fused_linear(tp->enter(h, B, T), cast(lm_head_->weight, dt), at::Tensor());
    if (!tp->loss_parallel) h = tp::gather_from_tensor_parallel(h, 1, tp->group);
  } else if (transformer_->contains("lm_head")) {
    h = (*lm_head_)(h, dt);  // [B*T, V]
  } else if (sp) {           // a part without the head hands on whole, replicated hidden states
    h = tp::gather_from_tensor_parallel(h.view({B, T / tp->size, -1}), 1, tp->group).reshape({B * T, -1});
  }
  return h.view({B, T, -1});
}

void GPT2LLMImpl::retain(const std::vector<std::string>& fqns) {
  const auto kept = [&](const std::string& fqn) {
    return std::any_of(fqns.begin(), fqns.end(),
                       [&](const std::string& f) { return f == fqn || f.starts_with(fqn + "."); });
  };
  if (tied() && kept("transformer.wte") != kept("transformer.lm_head"))
    throw ConfigError("whole_model",
                      "model/gpt2 has use_weight_tying = true, and the pipeline puts transformer.wte and "
                      "transformer.lm_head (one shared weight) into different stages; set use_weight_tying = false "
                      "for pipeline parallelism");
  const auto drop = [](torch::nn::ModuleDict& dict, const std::string& key) {
    dict->pop(key);
    dict->unregister_module(key);
  };
  if (transformer_->contains("h"))
    for (const std::string& key : block_keys())
      if (!kept("transformer.h." + key)) drop(h_, key);
  for (const std::string key : {"wte", "wpe", "drop", "h", "lm_head_norm", "lm_head"}) {
    if (!transformer_->contains(key)) continue;
    const bool keep = key == "h" ? !block_keys().empty() : kept("transformer." + key);
    if (!keep) drop(transformer_, key);
  }
}

void GPT2LLMImpl::parallelize(std::shared_ptr<const TpPlan> plan) {
  tp_ = std::move(plan);
  if (transformer_->contains("h"))
    for (const auto& item : *h_) item.value()->as<GPT2BlockImpl>()->parallelize(*tp_);
  if (tp_->sequence_parallel && lm_head_norm_) lm_head_norm_->partial = tp_.get();
}

template <class F>
void GPT2LLMImpl::for_each_feed_forward(F&& f) const {
  if (transformer_->contains("h"))
    for (const auto& item : *h_) f(*item.value()->as<GPT2BlockImpl>()->mlp);
}

void FeedForward::take_metrics(const std::string&, std::vector<ModelMetric>&) {}

std::map<std::string, double> GPT2LLMImpl::parameter_activity() const {
  std::map<std::string, double> out;
  if (transformer_->contains("h"))
    for (const auto& item : *h_)
      for (const auto& [name, share] : item.value()->as<GPT2BlockImpl>()->mlp->parameter_activity())
        out.emplace("transformer.h." + item.key() + ".mlp." + name, share);
  return out;
}

std::vector<ModelMetric> GPT2LLMImpl::take_metrics() {
  std::vector<ModelMetric> out;
  if (transformer_->contains("h"))
    for (const auto& item : *h_) item.value()->as<GPT2BlockImpl>()->mlp->take_metrics("block " + item.key(), out);
  return out;
}

std::vector<std::string> GPT2LLMImpl::parallelize_experts(const ExpertParallel& ep) {
  std::vector<std::string> out;
  if (transformer_->contains("h"))
    for (const auto& item : *h_)
      for (const std::string& name : item.value()->as<GPT2BlockImpl>()->mlp->parallelize_experts(ep))
        out.push_back("transformer.h." + item.key() + ".mlp." + name);
  return out;
}

void GPT2LLMImpl::check_tensor_parallel(const TpPlan& plan) const {
  for_each_feed_forward([&](const FeedForward& ffn) { ffn.check_tensor_parallel(plan); });
}

bool GPT2LLMImpl::has_aux_losses() const {
  bool any = false;
  for_each_feed_forward([&](const FeedForward& ffn) { any = any || ffn.has_aux_loss(); });
  return any;
}

at::Tensor GPT2LLMImpl::take_aux_losses() {
  at::Tensor total;
  const auto add = [&](const at::Tensor& a) { total = total.defined() ? total + a : a; };
  for_each_feed_forward([&](FeedForward& ffn) {
    if (at::Tensor a = ffn.take_aux_loss(); a.defined()) add(a);
  });
  for (const at::Tensor& a : std::exchange(runner_aux_, {})) add(a);
  return total;
}

// Note [Auxiliary losses through a block runner]
// A block runner sees one tensor in and one out, and activation checkpointing runs the block
// without autograd and again in backward: an auxiliary loss the first run left in the
// feed-forward would have no gradient. So a block whose feed-forward has one gives the runner its
// output with the loss as one more row, [N + 1, d]: the loss at [N, 0], zeros beside it, all in
// float32 or wider (a bfloat16 output converts there and back exactly). The gradients of both
// parts reach the runner's node together, and the recomputation's loss gets its share, the
// gradient the loss function gave it. Only blocks with a runner pay for this; their kForward
// hooks see the packed output.
at::Tensor GPT2LLMImpl::run_block_with_aux_loss(const std::string& fqn, GPT2BlockImpl& block, const at::Tensor& h,
                                                std::int64_t B, std::int64_t T, Dt dt,
                                                const std::shared_ptr<const Documents>& docs) {
  auto out_dtype = std::make_shared<c10::ScalarType>(h.scalar_type());
  const at::Tensor packed =
      hooks_.around(fqn, "GPT2Block", h, [&block, B, T, dt, out_dtype, fqn, docs](const at::Tensor& x) {
        const at::Tensor y = block(x, B, T, dt, docs.get());
        const at::Tensor aux = block.mlp->take_aux_loss();
        TORCH_CHECK(aux.defined(), "gpt2: block ", fqn, " has an auxiliary loss but its forward left none");
        *out_dtype = y.scalar_type();
        const c10::ScalarType wide =
            at::promote_types(at::promote_types(y.scalar_type(), aux.scalar_type()), at::kFloat);
        const at::Tensor row = at::constant_pad_nd(aux.reshape({1, 1}).to(wide), {0, y.size(1) - 1});
        return at::cat({y.to(wide), row}, 0);
      });
  const std::int64_t N = packed.size(0) - 1;
  runner_aux_.push_back(packed.select(0, N).select(0, 0));
  return packed.narrow(0, 0, N).to(*out_dtype);
}

// Note [Document masking]
// A packed sample holds several documents (the collator's document ids: equal ids, one
// document). With them, token i attends to token j only when both are in the same document, j
// <= i (and within the sliding window): a block-diagonal causal mask [B, 1, T, T], built once per
// forward and shared by every block, handed to SDPA as a boolean mask (the manual path fills
// -inf outside it); pytorch_flash without a sliding window attends document by document instead
// (causal SDPA on each: sum of the documents' squared lengths, not T^2, of work; every document a
// run of equal ids), on CUDA in bf16/fp16 all documents in one flash-attention varlen call. With document_positions = restart, each token's position is its index in
// its document (its index minus that of its document's first token): RoPE rotates by it and
// ABSOLUTE positions look it up. A batch whose every sample is one document takes the plain
// causal path, bit for bit as without document ids (one host sync per forward to find out).
std::shared_ptr<const Documents> GPT2LLMImpl::documents(const at::Tensor& ids, bool restart_positions) const {
  at::NoGradGuard no_grad;
  const std::int64_t T = ids.size(1);
  const at::Tensor starts = ids.narrow(1, 1, T - 1) != ids.narrow(1, 0, T - 1);  // [B, T-1]: a new document at t+1
  if (!starts.any().item<bool>()) return nullptr;
  auto docs = std::make_shared<Documents>();
  if (!window_ && !manual_attention_) {
    // The documents' lengths, if every document is one run of equal ids (the collator's are).
    const at::Tensor host = ids.to(at::kCPU, at::kLong).contiguous();
    const std::int64_t* id = host.const_data_ptr<std::int64_t>();
    bool runs = true;
    for (std::int64_t b = 0; b < ids.size(0) && runs; ++b, id += T) {
      std::vector<std::int64_t>& n = docs->lengths.emplace_back();
      std::vector<std::int64_t> seen;
      for (std::int64_t t = 0; t < T; ++t) {
        if (t > 0 && id[t] == id[t - 1]) {
          ++n.back();
          continue;
        }
        if (std::find(seen.begin(), seen.end(), id[t]) != seen.end()) runs = false;  // a document resumes
        seen.push_back(id[t]);
        n.push_back(1);
      }
    }
    if (!runs) docs->lengths.clear();
    if (runs && ids.is_cuda()) {
      std::vector<std::int32_t> cumulative = {0};
      for (const std::vector<std::int64_t>& n : docs->lengths)
        for (const std::int64_t len : n) {
          cumulative.push_back(cumulative.back() + static_cast<std::int32_t>(len));
          docs->max_length = std::max(docs->max_length, len);
        }
      docs->cu_seqlens = at::tensor(cumulative, at::TensorOptions().dtype(at::kInt)).to(ids.device());
    }
  }
  if (docs->lengths.empty()) {  // the mask: manual attention, a sliding window, documents not in runs
    at::Tensor allowed = at::ones({T, T}, ids.options().dtype(at::kBool)).tril();
    if (window_) allowed = allowed.logical_and(at::ones_like(allowed).triu(-(*window_ - 1)));
    docs->mask = (ids.unsqueeze(2) == ids.unsqueeze(1)).logical_and(allowed).unsqueeze(1);  // [B, 1, T, T]
  }
  if (restart_positions) {
    const at::Tensor t = at::arange(T, ids.options().dtype(at::kLong)).expand({ids.size(0), T});
    const at::Tensor first_flag = at::cat({at::ones({ids.size(0), 1}, starts.options()), starts}, 1);  // [B, T]
    const at::Tensor first = std::get<0>(at::where(first_flag, t, at::zeros_like(t)).cummax(1));
    docs->positions = t - first;
  }
  return docs;
}

void GPT2LLMImpl::set_context_parallel(std::shared_ptr<const cp::SequenceShard> shard) { cp_ = std::move(shard); }

// Note [Context-parallel documents]
// Under context parallelism every block's attention needs the positions of this rank's tokens (in
// the whole sequence, or in their documents with document_positions = restart) and, when not
// every key before a query may be seen (several documents, a sliding window) or the attention is
// manual, which keys each of its two chunks' rows may see: token t of the chunk at c L sees key j
// when j <= c L + t, j is in its document and within the window. Built once per forward from the
// whole sequence's document ids, which every cp rank has.
std::shared_ptr<const Documents> GPT2LLMImpl::context_parallel_documents(const at::Tensor& ids, std::int64_t length,
                                                                         bool restart_positions,
                                                                         const c10::Device& device) const {
  at::NoGradGuard no_grad;
  TORCH_CHECK(cp_ != nullptr, "gpt2: context_parallel_documents needs context parallelism");
  cp_->check_length(length, "the sequence length");
  auto docs = std::make_shared<Documents>();
  docs->cp = cp_.get();
  docs->cp_length = length;
  const at::TensorOptions o = at::TensorOptions().dtype(at::kLong).device(device);
  const bool several =
      ids.defined() && length > 1 && (ids.narrow(1, 1, length - 1) != ids.narrow(1, 0, length - 1)).any().item<bool>();
  if (several && restart_positions) {
    const at::Tensor starts = ids.narrow(1, 1, length - 1) != ids.narrow(1, 0, length - 1);
    const at::Tensor t = at::arange(length, o).expand({ids.size(0), length});
    const at::Tensor first_flag = at::cat({at::ones({ids.size(0), 1}, starts.options()), starts}, 1);
    const at::Tensor first = std::get<0>(at::where(first_flag, t, at::zeros_like(t)).cummax(1));
    docs->positions = cp_->shard(t - first, 1).contiguous();  // [B, T / cp]
  } else {
    docs->positions = cp_->positions(length, o).unsqueeze(0);  // [1, T / cp]
  }
  const bool window = window_ && *window_ < length;
  if (several || window || manual_attention_) {
    const std::int64_t L = cp_->chunk_length(length);
    for (std::size_t part = 0; part < 2; ++part) {
      const std::int64_t c = part == 0 ? cp_->first_chunk() : cp_->second_chunk(), S = (c + 1) * L;
      const at::Tensor rows = at::arange(c * L, S, o).unsqueeze(1), keys = at::arange(S, o).unsqueeze(0);
      at::Tensor allowed = keys.le(rows);  // [L, S]
      if (window) allowed = allowed.logical_and(keys.gt(rows - *window_));
      allowed = allowed.unsqueeze(0);  // [1, L, S]
      if (several) {
        const at::Tensor doc = ids.to(device);
        allowed = allowed.logical_and(doc.narrow(1, c * L, L).unsqueeze(2) == doc.narrow(1, 0, S).unsqueeze(1));
      }
      docs->cp_masks[part] = allowed.unsqueeze(1);  // [B or 1, 1, L, S]
    }
  }
  return docs;
}

at::Tensor GPT2LLMImpl::position_rows(std::int64_t B, std::int64_t first, std::int64_t count, Dt dt,
                                      const Documents* docs, bool chunk) const {
  // A sequence-parallel chunk: each tp rank adds its rows, so the table's gradient is summed.
  const at::Tensor w = cast(chunk ? tp_->shared(wpe_->weight) : wpe_->weight, dt);
  if (docs == nullptr || !docs->positions.defined()) return w.narrow(0, first, count).unsqueeze(0);
  const at::Tensor rows = docs->positions.narrow(1, first, count).reshape({-1});
  return w.index_select(0, rows).view({docs->positions.size(0), count, -1});  // [B or 1, count, d]
}

at::Tensor GPT2LLMImpl::hooked_forward(const at::Tensor& input, Dt dt, std::shared_ptr<const Documents> docs) {
  if (hooks_.empty()) return forward(input, dt, std::move(docs));
  const at::Tensor in[] = {input};
  hooks_.call(HookPoint::kPreForward, "", "GPT2LLM", in, {});
  at::Tensor out = forward(input, dt, std::move(docs));
  const at::Tensor outs[] = {out};
  hooks_.call(HookPoint::kForward, "", "GPT2LLM", in, outs);
  if (hooks_.wants("")) hooks_.on_backward(out, "", "GPT2LLM");
  return out;
}

std::vector<std::string> GPT2LLMImpl::block_keys() const {
  std::vector<std::string> keys;
  if (transformer_->contains("h"))
    for (const auto& item : *h_) keys.push_back(item.key());
  return keys;
}

bool GPT2LLMImpl::tied() const {
  return wte_ && lm_head_ && wte_->weight.defined() &&
         wte_->weight.unsafeGetTensorImpl() == lm_head_->weight.unsafeGetTensorImpl();
}

void GPT2LLMImpl::reset_leaves(torch::nn::Module& m) {
  at::NoGradGuard no_grad;
  if (auto* leaf = dynamic_cast<Leaf*>(&m)) leaf->reset();
  for (const auto& child : m.modules(/*include_self=*/false))
    if (auto* leaf = dynamic_cast<Leaf*>(child.get())) leaf->reset();
}

void GPT2LLMImpl::remap_leaves(const Remap& f) {
  std::unordered_map<const void*, at::Tensor> done;
  const Remap once = [&](const at::Tensor& t) {
    if (!t.defined()) return t;
    auto [it, fresh] = done.try_emplace(t.unsafeGetTensorImpl());
    if (fresh) it->second = f(t);
    return it->second;
  };
  for (const auto& child : modules(/*include_self=*/false))
    if (auto* leaf = dynamic_cast<Leaf*>(child.get())) leaf->remap(once);
}

at::Tensor GPT2LLMImpl::vocab_parallel_embedding(const at::Tensor& ids, std::int64_t B, std::int64_t T, Dt dt) const {
  const at::Tensor w = cast(wte_->weight, dt);
  const std::int64_t rows = w.size(0);
  const at::Tensor local = ids.reshape({B * T}) - tp_->rank * rows;
  const at::Tensor outside = local.lt(0).logical_or(local.ge(rows));
  const at::Tensor e = at::embedding(w, local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(1), 0.0);
  return tp_->leave(e, B, T);
}

c10::ScalarType GPT2LLMImpl::storage_dtype() const { return wte_ ? wte_->weight.scalar_type() : at::kFloat; }

}  // namespace modalities::plugins::gpt2
