// Fused autograd ops: see fused_ops.h. Every backward below names the autograd node
// (derivatives.yaml entry) whose formula it repeats, so that a reader can check the
// gradients op for op against what the composite would have recorded.
#include "fused_ops.h"

#include <modalities/sdk/selective_checkpoint.h>

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace modalities::plugins::gpt2 {

namespace sac = selective_checkpoint;

// Note [Selective checkpointing of the fused ops]
// Under model/activation_checkpointed with selective_op_activation_checkpointing and the key
// "ops.aten.mm.default", the projection ops (fused_linear: 1 matmul, fused_qkv: 3, fused_swiglu:
// 2) stand for PyTorch's aten.mm calls. A projection with a bias is aten.addmm in PyTorch (linear
// folds the bias into addmm), which Modalities' policy neither keeps nor counts, so only the
// bias-free projections count. Each op asks an OpSlot (modalities/sdk/selective_checkpoint.h),
// which keeps its outputs from the block's first forward when Modalities' policy would keep one
// of its counted matmuls (the odd-numbered ones), and hands them back in the recomputation, which
// then skips these projections; the backward node is recorded on the kept tensors as usual (it saves
// the inputs and weights, not the outputs, plus SwiGLU's intermediates, which are kept with it).
// Nothing here draws random numbers, so skipping them leaves the dropout masks unchanged.
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// Backward runs below the autograd layer (no graph is recorded), so a graph for a second
// derivative would silently be missing: refuse it instead.
void refuse_double_backward(const std::string& node) {
  TORCH_CHECK(!c10::GradMode::is_enabled(), node,
              ": double backward (create_graph=True) is not supported by the fused GPT-2 ops");
}

template <class N>
std::shared_ptr<N> make_node() {
  return std::shared_ptr<N>(new N(), torch::autograd::deleteNode);
}

// Rows per task of at::parallel_for: ATen's grain of 32768 elements (each element is
// independent, so the split changes no value).
std::int64_t row_grain(std::int64_t row_elements) {
  return std::max<std::int64_t>(1, 32768 / std::max<std::int64_t>(1, row_elements));
}

// A row-major matrix: the layout for which the backward formulas below are ATen's (for x,
// mm_mat1_backward takes grad.mm(w); for w, mm_mat2_backward takes grad.t().mm(x) only when
// w.t() is column-major, i.e. w row-major).
bool row_major(const at::Tensor& t) { return t.dim() == 2 && t.stride(1) == 1 && t.stride(0) == t.size(1); }

// Linear forward below autograd (see fused_linear for the layouts it is used with).
at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return b.defined() ? at::addmm(b, x, w.t()) : at::mm(x, w.t());
}

// Gradients of y = x w^T (+ b) for row-major x (see LinearBackward); undefined where not asked.
struct LinearGrads {
  at::Tensor x, w, b;
};
LinearGrads linear_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& w, bool need_x, bool need_w,
                            bool need_b) {
  LinearGrads out;
  if (need_x) out.x = g.mm(w);
  if (need_w) out.w = g.t().mm(x);
  if (need_b) out.b = at::sum_to(g, at::IntArrayRef{g.size(1)});
  return out;
}

// CPU element loops of the heads split/merge with RoPE and GQA. Per element they perform the
// ATen ops' arithmetic in ATen's order: each binary op in the op-math type (float for
// bf16/half, as ATen's kernels compute them) and rounded to the tensor's type after every op;
// negation and copies are exact. Layout changes (view/transpose/contiguous, expand/reshape,
// transpose/reshape) become the loops' index arithmetic. Why hand-written: a projection's
// heads cost ~20 ATen ops forward and ~12 backward, whose host time dwarfs the arithmetic on
// small models.
template <class T>
using OpMath = at::opmath_type<T>;

template <class T>
T mul_round(T a, T b) {
  return static_cast<T>(static_cast<OpMath<T>>(a) * static_cast<OpMath<T>>(b));
}
template <class T>
T add_round(T a, T b) {
  return static_cast<T>(static_cast<OpMath<T>>(a) + static_cast<OpMath<T>>(b));
}

// x [B*T, H*hd] -> out [B, H*repeat, T, hd]; cos/sin [T, hd], per sample [B, T, hd]
// (`per_sample`: RoPE positions restarting at each document), or null.
template <class T>
void heads_forward_rows(const T* x, const T* cos, const T* sin, T* out, std::int64_t B, std::int64_t T_, std::int64_t H,
                        std::int64_t hd, std::int64_t repeat, bool per_sample) {
  const std::int64_t half = hd / 2;
  at::parallel_for(0, B * H, row_grain(T_ * hd * repeat), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t bh = begin; bh < end; ++bh)
      for (std::int64_t t = 0, b = bh / H, h = bh % H; t < T_; ++t) {
        const T* src = x + ((b * T_ + t) * H + h) * hd;
        T* dst = out + ((b * H * repeat + h * repeat) * T_ + t) * hd;
        if (cos != nullptr) {
          const std::int64_t row = (per_sample ? b * T_ : 0) + t;
          const T* c = cos + row * hd;
          const T* s = sin + row * hd;
          for (std::int64_t j = 0; j < hd; ++j) {
            const T rh = j < half ? static_cast<T>(-src[j + half]) : src[j - half];
            dst[j] = add_round(mul_round(src[j], c[j]), mul_round(rh, s[j]));
          }
        } else {
          for (std::int64_t j = 0; j < hd; ++j) dst[j] = src[j];
        }
        for (std::int64_t k = 1; k < repeat; ++k)
          for (std::int64_t j = 0; j < hd; ++j) dst[k * T_ * hd + j] = dst[j];
      }
  });
}

// g [B, H, T, hd] (after the GQA sum) -> out [B*T, H*hd]: RoPE's backward and the transpose.
template <class T>
void heads_backward_rows(const T* g, const T* cos, const T* sin, T* out, std::int64_t B, std::int64_t T_,
                         std::int64_t H, std::int64_t hd, bool per_sample) {
  const std::int64_t half = hd / 2;
  at::parallel_for(0, B * H, row_grain(T_ * hd), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t bh = begin; bh < end; ++bh)
      for (std::int64_t t = 0, b = bh / H, h = bh % H; t < T_; ++t) {
        const T* src = g + ((b * H + h) * T_ + t) * hd;
        T* dst = out + ((b * T_ + t) * H + h) * hd;
        if (cos != nullptr) {
          const std::int64_t row = (per_sample ? b * T_ : 0) + t;
          const T* c = cos + row * hd;
          const T* s = sin + row * hd;
          for (std::int64_t j = 0; j < hd; ++j) {
            // cat(gr[..., h:], -gr[..., :h]) with gr = g * sin, added to g * cos.
            const T rot = j < hd - half ? mul_round(src[j + half], s[j + half])
                                        : static_cast<T>(-mul_round(src[j - (hd - half)], s[j - (hd - half)]));
            dst[j] = add_round(mul_round(src[j], c[j]), rot);
          }
        } else {
          for (std::int64_t j = 0; j < hd; ++j) dst[j] = src[j];
        }
      }
  });
}

// Whether the tables hold a row per sample and token ([B, 1, T, hd]) rather than per token.
bool per_sample_tables(const at::Tensor& cos, std::int64_t B, std::int64_t T, std::int64_t hd) {
  return cos.defined() && B > 1 && cos.numel() == B * T * hd;
}

bool heads_cpu_eligible(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, std::int64_t B,
                        std::int64_t T, std::int64_t hd) {
  const at::ScalarType st = x.scalar_type();
  if (!x.is_cpu() || !x.is_contiguous() ||
      !(st == at::kFloat || st == at::kDouble || st == at::kBFloat16 || st == at::kHalf))
    return false;
  if (!cos.defined()) return true;
  const std::int64_t n = per_sample_tables(cos, B, T, hd) ? B * T * hd : T * hd;
  return hd % 2 == 0 && cos.is_cpu() && sin.is_cpu() && cos.scalar_type() == st && sin.scalar_type() == st &&
         cos.is_contiguous() && sin.is_contiguous() && cos.numel() == n && sin.numel() == n;
}

template <class F>
void dispatch_float_types(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    case at::kDouble: f(double{}); break;
    default: f(float{}); break;
  }
}

// Heads as ATen ops (see fused_ops.h, HeadsSpec): below autograd in heads_forward, recorded
// by autograd in fused_qkv's fallback.
at::Tensor heads_composite(const at::Tensor& x, std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t hd,
                           const at::Tensor& cos, const at::Tensor& sin, std::int64_t repeat) {
  at::Tensor y = x.view({B, T, H, hd}).transpose(1, 2).contiguous();
  if (y.is_alias_of(x)) y = y.clone();  // contiguous() returned a view: the output must be new
  if (cos.defined()) {
    const auto halves = y.chunk(2, -1);
    y = y * cos + at::cat({halves[1].neg(), halves[0]}, -1) * sin;
  }
  if (repeat > 1) y = y.unsqueeze(2).expand({B, H, repeat, T, hd}).reshape({B, H * repeat, T, hd});
  return y;
}

// Heads forward below autograd: the CPU loops where eligible, else the ATen ops.
at::Tensor heads_forward(const at::Tensor& x, std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t hd,
                         const at::Tensor& cos, const at::Tensor& sin, std::int64_t repeat) {
  if (heads_cpu_eligible(x, cos, sin, B, T, hd)) {
    at::Tensor out = at::empty({B, H * repeat, T, hd}, x.options());
    dispatch_float_types(x.scalar_type(), [&](auto tag) {
      using S = decltype(tag);
      heads_forward_rows<S>(x.const_data_ptr<S>(), cos.defined() ? cos.const_data_ptr<S>() : nullptr,
                            cos.defined() ? sin.const_data_ptr<S>() : nullptr, out.mutable_data_ptr<S>(), B, T, H, hd,
                            repeat, per_sample_tables(cos, B, T, hd));
    });
    return out;
  }
  return heads_composite(x, B, T, H, hd, cos, sin, repeat);
}

// Heads backward: g [B, H*repeat, T, hd] -> gradient of the [B*T, H*hd] projection. Node by node:
//   UnsafeViewBackward0, CloneBackward0, ExpandBackward0, UnsqueezeBackward0 (GQA):
//       g = sum_to(g.reshape(B, H, r, T, hd), (B, H, 1, T, hd)).squeeze(2)
//   AddBackward0, MulBackward0 (x * cos)          -> g * cos
//   MulBackward0 (rh * sin), CatBackward0, NegBackward0, SplitBackward0 (chunk)
//       gr = g * sin -> cat(gr[..., h:], -gr[..., :h])
//   (the clone's buffer adds the two, a two-term sum: order-free)
//   CloneBackward0, TransposeBackward0, ViewBackward0 -> g.transpose(1, 2).reshape(B*T, H*hd)
at::Tensor heads_backward(at::Tensor g, std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t hd,
                          const at::Tensor& cos, const at::Tensor& sin, std::int64_t repeat) {
  if (repeat > 1) g = at::sum_to(g.reshape({B, H, repeat, T, hd}), at::IntArrayRef{B, H, 1, T, hd}).squeeze(2);
  if (g.is_contiguous() && heads_cpu_eligible(g, cos, sin, B, T, hd)) {
    at::Tensor out = at::empty({B * T, H * hd}, g.options());
    dispatch_float_types(g.scalar_type(), [&](auto tag) {
      using S = decltype(tag);
      heads_backward_rows<S>(g.const_data_ptr<S>(), cos.defined() ? cos.const_data_ptr<S>() : nullptr,
                             cos.defined() ? sin.const_data_ptr<S>() : nullptr, out.mutable_data_ptr<S>(), B, T, H, hd,
                             per_sample_tables(cos, B, T, hd));
    });
    return out;
  }
  if (cos.defined()) {
    const at::Tensor direct = g * cos;
    const at::Tensor gr = g * sin;
    const std::int64_t h = hd / 2;
    g = direct + at::cat({gr.narrow(-1, h, hd - h), gr.narrow(-1, 0, h).neg()}, -1);
  }
  return g.transpose(1, 2).reshape({B * T, H * hd});
}

// ---------------------------------------------------------------------------------------
// Linear: y = x w^T (+ b) for a row-major 2-d x.
// Composite: mm(x, w.t()) [MmBackward0 + TBackward0] or addmm(b, x, w.t()) [AddmmBackward0
// + TBackward0]. With x row-major and w.t() column-major, mm_mat1_backward is grad.mm(w) and
// mm_mat2_backward is grad.t().mm(x).t(), which TBackward0 transposes back: grad.t().mm(x).
// The bias gradient is the engine's sum_to of grad to b's shape.
class LinearBackward final : public Node {
 public:
  variable_list apply(variable_list&& grads) override {
    refuse_double_backward(name());
    variable_list out(3);
    const at::Tensor& g = grads[0];
    if (!g.defined()) return out;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    LinearGrads d = linear_backward(g, x_.unpack(), w_.unpack(), task_should_compute_output(0),
                                    task_should_compute_output(1), has_bias_ && task_should_compute_output(2));
    out[0] = std::move(d.x);
    out[1] = std::move(d.w);
    out[2] = std::move(d.b);
    return out;
  }
  std::string name() const override { return "modalities::plugins::gpt2::LinearBackward"; }
  void release_variables() override {
    x_.reset_data();
    w_.reset_data();
  }

  SavedVariable x_, w_;
  bool has_bias_ = false;
};

// CPU element loops of RMSNorm (float32 math, x contiguous, one row per normalised vector).
// Each loop performs per element exactly the float operations of the ATen ops it replaces, in
// their order and with their roundings: products, true divisions, 1 / sqrt (ATen's rsqrt,
// vectorised or not), x * x for pow(x, 2) and (r * r) * r for pow(r, 3). No reassociation and
// no FMA contraction (the file is compiled with -ffp-contract=off). The reductions (the mean,
// the two gradient sums) remain ATen calls: their summation order is ATen's own.
// Why hand-written: on small models each of the ~20 ATen ops of the composite costs more
// host time (dispatch, TensorIterator set-up, allocation) than its arithmetic.
bool rms_cpu_eligible(const at::Tensor& xf, const at::Tensor& w) {
  if (!xf.is_cpu() || xf.scalar_type() != at::kFloat || !xf.is_contiguous() || xf.numel() == 0) return false;
  if (!w.defined()) return true;
  const at::ScalarType wt = w.scalar_type();
  return w.is_cpu() && w.is_contiguous() && (wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf);
}

template <class W>
void rms_scale_rows(const float* x, const float* r, const W* w, float* u, float* y, std::int64_t M, std::int64_t N) {
  at::parallel_for(0, M, row_grain(N), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const float ri = r[i];
      const std::int64_t o = i * N;
      for (std::int64_t j = 0; j < N; ++j) {
        const float uj = x[o + j] * ri;
        u[o + j] = uj;
        if (y != nullptr) y[o + j] = uj * static_cast<float>(w[j]);
      }
    }
  });
}

// Forward: r = rsqrt(mean(xf * xf) + eps), u = xf * r, y = u * w (w optional).
void rms_cpu_forward(const at::Tensor& xf, const at::Tensor& w, double eps, at::Tensor& r, at::Tensor& u,
                     at::Tensor& y) {
  const std::int64_t N = xf.size(-1), M = xf.numel() / N;
  const float* x = xf.const_data_ptr<float>();
  at::Tensor p = at::empty_like(xf);
  float* pp = p.mutable_data_ptr<float>();
  for (std::int64_t k = 0; k < M * N; ++k) pp[k] = x[k] * x[k];
  at::Tensor m = p.mean({xf.dim() - 1}, /*keepdim=*/true);
  r = at::empty_like(m);
  const float* mp = m.const_data_ptr<float>();
  float* rp = r.mutable_data_ptr<float>();
  const float e = static_cast<float>(eps);
  for (std::int64_t i = 0; i < M; ++i) rp[i] = 1.0f / std::sqrt(mp[i] + e);
  u = at::empty_like(xf);
  y = w.defined() ? at::empty_like(xf) : u;
  float* up = u.mutable_data_ptr<float>();
  float* yp = w.defined() ? y.mutable_data_ptr<float>() : nullptr;
  switch (w.defined() ? w.scalar_type() : at::kFloat) {
    case at::kBFloat16: rms_scale_rows(x, rp, w.const_data_ptr<c10::BFloat16>(), up, yp, M, N); break;
    case at::kHalf: rms_scale_rows(x, rp, w.const_data_ptr<c10::Half>(), up, yp, M, N); break;
    default: rms_scale_rows(x, rp, w.defined() ? w.const_data_ptr<float>() : nullptr, up, yp, M, N); break;
  }
}

template <class W>
void rms_backward_rows(const float* g, const float* x, const float* u, const float* r, const W* w, float* t1, float* a,
                       float* t2, std::int64_t M, std::int64_t N) {
  at::parallel_for(0, M, row_grain(N), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const float ri = r[i];
      const std::int64_t o = i * N;
      for (std::int64_t j = 0; j < N; ++j) {
        const float gj = g[o + j];
        const float gu = w != nullptr ? gj * static_cast<float>(w[j]) : gj;
        if (t1 != nullptr) t1[o + j] = gj * u[o + j];
        a[o + j] = gu * ri;
        t2[o + j] = gu * x[o + j];
      }
    }
  });
}

// Backward (see RmsNormBackward for the node-by-node formulas). gf, xf: float32 contiguous.
// Returns (a, b) and, with a weight, gw = sum_to(gf * u, w) when asked.
void rms_cpu_backward(const at::Tensor& gf, const at::Tensor& xf, const at::Tensor& w, const at::Tensor& u,
                      const at::Tensor& r, bool need_w, at::Tensor& a, at::Tensor& b, at::Tensor& gw) {
  const std::int64_t N = xf.size(-1), M = xf.numel() / N;
  const float* g = gf.const_data_ptr<float>();
  const float* x = xf.const_data_ptr<float>();
  const float* rp = r.const_data_ptr<float>();
  at::Tensor t1 = need_w ? at::empty_like(xf) : at::Tensor();
  at::Tensor t2 = at::empty_like(xf);
  a = at::empty_like(xf);
  float* t1p = need_w ? t1.mutable_data_ptr<float>() : nullptr;
  const float* up = need_w ? u.const_data_ptr<float>() : nullptr;
  switch (w.defined() ? w.scalar_type() : at::kFloat) {
    case at::kBFloat16:
      rms_backward_rows(g, x, up, rp, w.const_data_ptr<c10::BFloat16>(), t1p, a.mutable_data_ptr<float>(),
                        t2.mutable_data_ptr<float>(), M, N);
      break;
    case at::kHalf:
      rms_backward_rows(g, x, up, rp, w.const_data_ptr<c10::Half>(), t1p, a.mutable_data_ptr<float>(),
                        t2.mutable_data_ptr<float>(), M, N);
      break;
    default:
      rms_backward_rows(g, x, up, rp, w.defined() ? w.const_data_ptr<float>() : nullptr, t1p,
                        a.mutable_data_ptr<float>(), t2.mutable_data_ptr<float>(), M, N);
      break;
  }
  if (need_w) gw = at::sum_to(t1, w.sizes());
  const at::Tensor gr = at::sum_to(t2, r.sizes());  // [..., 1]
  const float* grp = gr.const_data_ptr<float>();
  const float n = static_cast<float>(N);
  b = at::empty_like(xf);
  float* bp = b.mutable_data_ptr<float>();
  at::parallel_for(0, M, row_grain(N), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const float ri = rp[i];
      const float gm = (grp[i] * -0.5f) * ((ri * ri) * ri);
      const float gp = gm / n;
      const std::int64_t o = i * N;
      for (std::int64_t j = 0; j < N; ++j) bp[o + j] = gp * (x[o + j] * 2.0f);
    }
  });
}

// ---------------------------------------------------------------------------------------
// RMSNorm over the last dimension, torch's composite (aten rms_norm on CPU):
//   xf = x.to(opmath); r = rsqrt(pow(xf, 2).mean(-1, keepdim).add_(eps));
//   y = (xf.mul(r)[.mul(w)]).contiguous().type_as(x)
// Backward, node by node in the engine's order (reverse creation):
//   ToCopyBackward0 (type_as)  gf = g.to(opmath)
//   MulBackward0 (u.mul(w))    gu = gf * w;           gw = sum_to(gf * u, w)
//   MulBackward0 (xf.mul(r))   a  = gu * r;           gr = sum_to(gu * xf, r)
//   RsqrtBackward0             gm = -0.5 * gr * r.pow(3)
//   AddBackward1 (add_ eps)    identity
//   MeanBackward1              gp = gm.expand(xf) / N
//   PowBackward0 (exponent 2)  b  = gp * (2.0 * xf.pow(1.0))
// xf receives a, then b. Without an upcast xf is x itself, and the engine adds a and b to
// x's gradient one after the other (after what x's later uses contributed), so x is listed
// twice: edges (x, x, w). With an upcast, ToCopyBackward0 adds a + b and casts: edges (x, w).
class RmsNormBackward final : public Node {
 public:
  variable_list apply(variable_list&& grads) override {
    refuse_double_backward(name());
    variable_list out(num_outputs());
    const at::Tensor& g = grads[0];
    if (!g.defined()) return out;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor x = x_.unpack();
    const at::Tensor xf = upcast_ ? x.to(opmath_) : x;
    const at::Tensor r = r_.unpack();
    const at::Tensor gf = upcast_ ? g.to(opmath_) : g;
    const std::size_t wi = num_outputs() - 1;
    const bool need_x =
        upcast_ ? task_should_compute_output(0) : (task_should_compute_output(0) || task_should_compute_output(1));
    const at::Tensor w = has_weight_ ? w_.unpack() : at::Tensor();
    if (need_x && rms_cpu_eligible(xf, w) && gf.is_cpu() && gf.scalar_type() == at::kFloat && gf.is_contiguous() &&
        gf.sizes() == xf.sizes()) {
      at::Tensor a, b, gw;
      const bool need_w = has_weight_ && task_should_compute_output(wi);
      rms_cpu_backward(gf, xf, w, has_weight_ ? u_.unpack() : at::Tensor(), r, need_w, a, b, gw);
      if (need_w) out[wi] = std::move(gw);
      if (upcast_) {
        out[0] = (a + b).to(x.scalar_type());
      } else {
        out[0] = std::move(a);
        out[1] = std::move(b);
      }
      return out;
    }
    at::Tensor gu = gf;
    if (has_weight_) {
      if (task_should_compute_output(wi)) out[wi] = at::sum_to(gf * u_.unpack(), w.sizes());
      gu = gf * w;
    }
    if (!need_x) return out;
    at::Tensor a = gu * r;
    const at::Tensor gr = at::sum_to(gu * xf, r.sizes());
    const at::Tensor gm = gr.mul(-0.5) * r.pow(3);
    const at::Tensor gp = gm.expand(xf.sizes()).div(at::Scalar(xf.size(-1)));
    at::Tensor b = gp * xf.pow(1.0).mul(2.0);
    if (upcast_) {
      out[0] = (a + b).to(x.scalar_type());
    } else {
      out[0] = std::move(a);
      out[1] = std::move(b);
    }
    return out;
  }
  std::string name() const override { return "modalities::plugins::gpt2::RmsNormBackward"; }
  void release_variables() override {
    x_.reset_data();
    w_.reset_data();
    r_.reset_data();
    u_.reset_data();
  }

  SavedVariable x_, w_, r_, u_;  // input, weight, rsqrt(mean + eps), xf * r
  bool upcast_ = false, has_weight_ = false;
  c10::ScalarType opmath_ = at::kFloat;
};

// ---------------------------------------------------------------------------------------
// q, k, v = heads(linear(x, w_p, b_p)) for p in (q, k, v); see heads_backward for the heads
// part. x is the attention norm's output, used by the three projections only; the engine
// runs the v chain first, then k, then q (reverse creation order), so x's gradient is
// (gx_v + gx_k) + gx_q: x is listed three times, edges (x, x, x, wq, bq, wk, bk, wv, bv),
// receiving the v, k and q contributions in that order.
class QkvBackward final : public Node {
 public:
  variable_list apply(variable_list&& grads) override {
    refuse_double_backward(name());
    variable_list out(9);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor x = x_.unpack();
    for (int p = 2; p >= 0; --p) {  // v, k, q
      const at::Tensor& g = grads[static_cast<std::size_t>(p)];
      if (!g.defined()) continue;
      const std::size_t xi = static_cast<std::size_t>(2 - p), wi = 3 + 2 * static_cast<std::size_t>(p);
      const bool need_x = task_should_compute_output(xi), need_w = task_should_compute_output(wi),
                 need_b = has_bias_[p] && task_should_compute_output(wi + 1);
      if (!need_x && !need_w && !need_b) continue;
      const Proj& pr = proj_[p];
      const at::Tensor g2 = heads_backward(g, B_, T_, pr.heads, hd_, pr.cos.unpack(), pr.sin.unpack(), pr.repeat);
      LinearGrads d = linear_backward(g2, x, pr.w.unpack(), need_x, need_w, need_b);
      out[xi] = std::move(d.x);
      out[wi] = std::move(d.w);
      out[wi + 1] = std::move(d.b);
    }
    return out;
  }
  std::string name() const override { return "modalities::plugins::gpt2::QkvBackward"; }
  void release_variables() override {
    x_.reset_data();
    for (Proj& p : proj_) {
      p.w.reset_data();
      p.cos.reset_data();
      p.sin.reset_data();
    }
  }

  struct Proj {
    SavedVariable w, cos, sin;
    std::int64_t heads = 0, repeat = 1;
  };
  SavedVariable x_;
  Proj proj_[3];  // q, k, v
  bool has_bias_[3] = {false, false, false};
  std::int64_t B_ = 0, T_ = 0, hd_ = 0;
};

// ---------------------------------------------------------------------------------------
// h = silu(a) * b, a = linear(x, w, bw), b = linear(x, v, bv). Node by node:
//   MulBackward0 (s * b)  gs = g * b;  gb = g * s
//   SiluBackward0         ga = silu_backward(gs, a)
//   the two linears       (x, w, bw) from ga, (x, v, bv) from gb
// x (the ffn norm's output) gets two contributions, a two-term sum: order-free.
// Edges (x, x, w, bw, v, bv).
class SwigluBackward final : public Node {
 public:
  variable_list apply(variable_list&& grads) override {
    refuse_double_backward(name());
    variable_list out(6);
    const at::Tensor& g = grads[0];
    if (!g.defined()) return out;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor x = x_.unpack(), a = a_.unpack(), b = b_.unpack(), s = s_.unpack();
    const at::Tensor gs = g * b;
    const at::Tensor gb = g * s;
    const at::Tensor ga = at::silu_backward(gs, a);
    LinearGrads dw = linear_backward(ga, x, w_.unpack(), task_should_compute_output(0), task_should_compute_output(2),
                                     has_bias_ && task_should_compute_output(3));
    LinearGrads dv = linear_backward(gb, x, v_.unpack(), task_should_compute_output(1), task_should_compute_output(4),
                                     has_bias_ && task_should_compute_output(5));
    out[0] = std::move(dw.x);
    out[1] = std::move(dv.x);
    out[2] = std::move(dw.w);
    out[3] = std::move(dw.b);
    out[4] = std::move(dv.w);
    out[5] = std::move(dv.b);
    return out;
  }
  std::string name() const override { return "modalities::plugins::gpt2::SwigluBackward"; }
  void release_variables() override {
    x_.reset_data();
    w_.reset_data();
    v_.reset_data();
    a_.reset_data();
    b_.reset_data();
    s_.reset_data();
  }

  SavedVariable x_, w_, v_, a_, b_, s_;
  bool has_bias_ = false;
};

// Merge: [B, H, T, hd] -> transpose(1, 2) -> contiguous (a clone) -> view(B*T, H*hd).
// Backward: ViewBackward0 g.reshape(B, T, H, hd), CloneBackward0, TransposeBackward0 .transpose(1, 2).
class MergeHeadsBackward final : public Node {
 public:
  variable_list apply(variable_list&& grads) override {
    refuse_double_backward(name());
    variable_list out(1);
    const at::Tensor& g = grads[0];
    if (!g.defined() || !task_should_compute_output(0)) return out;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out[0] = g.reshape({B_, T_, H_, hd_}).transpose(1, 2);
    return out;
  }
  std::string name() const override { return "modalities::plugins::gpt2::MergeHeadsBackward"; }

  std::int64_t B_ = 0, T_ = 0, H_ = 0, hd_ = 0;
};

}  // namespace

at::Tensor fused_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  sac::OpSlot slot(sac::Op::kMatmul, b.defined() ? 0 : 1);  // Note [Selective checkpointing of the fused ops]
  if (!row_major(x) || !row_major(w)) return at::linear(x, w, b);
  at::Tensor y;
  if (slot.reuse()) {
    y = slot.take(1)[0];
  } else {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    y = linear_forward(x, w, b);
    slot.keep({y});
  }
  if (torch::autograd::compute_requires_grad(x, w, b)) {
    auto node = make_node<LinearBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, w, b));
    node->x_ = SavedVariable(x, /*is_output=*/false);
    node->w_ = SavedVariable(w, /*is_output=*/false);
    node->has_bias_ = b.defined();
    torch::autograd::set_history(y, node);
  }
  return y;
}

at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const c10::ScalarType st = x.scalar_type();
  const bool reduced = st == at::kHalf || st == at::kBFloat16;
  // Only the CPU runs torch's composite: on CUDA at::rms_norm takes its fused kernel (one
  // kernel each way), which this op must neither replace nor re-round.
  if (!x.is_cpu() || !(reduced || st == at::kFloat || st == at::kDouble) || x.dim() < 1 || !x.is_contiguous() ||
      (w.defined() && (w.dim() != 1 || w.size(0) != x.size(-1))))
    return at::rms_norm(x, {x.size(-1)}, w.defined() ? std::optional(w) : std::nullopt, eps);
  const c10::ScalarType opmath = reduced ? at::kFloat : st;
  at::Tensor y, r, u;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // (to() and contiguous() that would return their input are skipped: same tensors, no dispatch)
    const at::Tensor xf = reduced ? x.to(opmath) : x;
    if (rms_cpu_eligible(xf, w)) {
      rms_cpu_forward(xf, w, eps, r, u, y);
    } else {
      r = at::rsqrt(at::pow(xf, 2).mean({x.dim() - 1}, /*keepdim=*/true).add_(eps));
      u = xf.mul(r);
      y = w.defined() ? u.mul(w) : u;
    }
    if (!y.is_contiguous()) y = y.contiguous();
    if (y.scalar_type() != st) y = y.to(st);  // type_as(input): the upcast, or a promoting weight
  }
  if (torch::autograd::compute_requires_grad(x, w)) {
    auto node = make_node<RmsNormBackward>();
    node->upcast_ = reduced;
    node->has_weight_ = w.defined();
    node->opmath_ = opmath;
    torch::autograd::edge_list edges =
        reduced ? torch::autograd::collect_next_edges(x) : torch::autograd::collect_next_edges(x, x);
    if (w.defined()) edges.push_back(torch::autograd::impl::gradient_edge(w));
    node->set_next_edges(std::move(edges));
    node->x_ = SavedVariable(x, false);
    node->r_ = SavedVariable(r, false);
    if (w.defined()) {
      node->w_ = SavedVariable(w, false);
      node->u_ = SavedVariable(u, false);
    }
    torch::autograd::set_history(y, node);
  }
  return y;
}

Qkv fused_qkv(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& bq, const at::Tensor& wk,
              const at::Tensor& bk, const at::Tensor& wv, const at::Tensor& bv, std::int64_t B, std::int64_t T,
              std::int64_t hd, const HeadsSpec& q, const HeadsSpec& k, const HeadsSpec& v) {
  sac::OpSlot slot(sac::Op::kMatmul, (bq.defined() ? 0 : 1) + (bk.defined() ? 0 : 1) + (bv.defined() ? 0 : 1));
  const HeadsSpec* specs[3] = {&q, &k, &v};
  const at::Tensor* ws[3] = {&wq, &wk, &wv};
  const at::Tensor* bs[3] = {&bq, &bk, &bv};
  TORCH_CHECK(x.dim() == 2 && x.size(0) == B * T, "fused_qkv: expected a [", B * T, ", d] input, got ", x.sizes());
  if (!row_major(x) || !row_major(wq) || !row_major(wk) || !row_major(wv)) {
    // Other layouts: the composite, op by op under autograd (same values, more nodes).
    Qkv out;
    at::Tensor* dst[3] = {&out.q, &out.k, &out.v};
    for (int p = 0; p < 3; ++p) {
      const HeadsSpec& sp = *specs[p];
      *dst[p] = heads_composite(at::linear(x, *ws[p], *bs[p]), B, T, sp.heads, hd, sp.cos, sp.sin, sp.repeat);
    }
    return out;
  }
  at::Tensor out[3];
  if (slot.reuse()) {
    std::vector<at::Tensor> kept = slot.take(3);
    for (int p = 0; p < 3; ++p) out[p] = std::move(kept[static_cast<std::size_t>(p)]);
  } else {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (int p = 0; p < 3; ++p) {
      const HeadsSpec& sp = *specs[p];
      TORCH_CHECK(sp.repeat >= 1 && ws[p]->dim() == 2 && ws[p]->size(0) == sp.heads * hd, "fused_qkv: projection ", p,
                  " weight ", ws[p]->sizes(), " does not give ", sp.heads, " heads of ", hd);
      out[p] = heads_forward(linear_forward(x, *ws[p], *bs[p]), B, T, sp.heads, hd, sp.cos, sp.sin, sp.repeat);
    }
    slot.keep({out[0], out[1], out[2]});
  }
  if (torch::autograd::compute_requires_grad(x, wq, bq, wk, bk, wv, bv)) {
    auto node = make_node<QkvBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, x, x, wq, bq, wk, bk, wv, bv));
    node->x_ = SavedVariable(x, false);
    for (int p = 0; p < 3; ++p) {
      auto& pr = node->proj_[p];
      pr.w = SavedVariable(*ws[p], false);
      if (specs[p]->cos.defined()) {
        pr.cos = SavedVariable(specs[p]->cos, false);
        pr.sin = SavedVariable(specs[p]->sin, false);
      }
      pr.heads = specs[p]->heads;
      pr.repeat = specs[p]->repeat;
      node->has_bias_[p] = bs[p]->defined();
    }
    node->B_ = B;
    node->T_ = T;
    node->hd_ = hd;
    torch::autograd::set_history(std::vector<at::Tensor>{out[0], out[1], out[2]}, node);
  }
  return {out[0], out[1], out[2]};
}

at::Tensor fused_swiglu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bw, const at::Tensor& v,
                        const at::Tensor& bv) {
  sac::OpSlot slot(sac::Op::kMatmul, (bw.defined() ? 0 : 1) + (bv.defined() ? 0 : 1));  // Note [Selective ...]
  if (!row_major(x) || !row_major(w) || !row_major(v)) return at::silu(at::linear(x, w, bw)) * at::linear(x, v, bv);
  at::Tensor a, b, s, h;
  if (slot.reuse()) {
    std::vector<at::Tensor> kept = slot.take(4);
    a = std::move(kept[0]), s = std::move(kept[1]), b = std::move(kept[2]), h = std::move(kept[3]);
  } else {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    a = linear_forward(x, w, bw);
    s = at::silu(a);
    b = linear_forward(x, v, bv);
    h = s * b;
    slot.keep({a, s, b, h});
  }
  if (torch::autograd::compute_requires_grad(x, w, bw, v, bv)) {
    auto node = make_node<SwigluBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, x, w, bw, v, bv));
    node->x_ = SavedVariable(x, false);
    node->w_ = SavedVariable(w, false);
    node->v_ = SavedVariable(v, false);
    node->a_ = SavedVariable(a, false);
    node->b_ = SavedVariable(b, false);
    node->s_ = SavedVariable(s, false);
    node->has_bias_ = bw.defined() || bv.defined();
    torch::autograd::set_history(h, node);
  }
  return h;
}

at::Tensor fused_merge_heads(const at::Tensor& y) {
  TORCH_CHECK(y.dim() == 4, "fused_merge_heads: expected [B, H, T, hd], got ", y.sizes());
  const std::int64_t B = y.size(0), H = y.size(1), T = y.size(2), hd = y.size(3);
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = y.transpose(1, 2).contiguous();
    if (out.is_alias_of(y)) out = out.clone();  // contiguous() returned a view: the output must be new
    out = out.view({B * T, H * hd});
  }
  if (torch::autograd::compute_requires_grad(y)) {
    auto node = make_node<MergeHeadsBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(y));
    node->B_ = B;
    node->T_ = T;
    node->H_ = H;
    node->hd_ = hd;
    torch::autograd::set_history(out, node);
  }
  return out;
}

}  // namespace modalities::plugins::gpt2
