// Fused autograd ops: see fused_ops.h. Every backward below names the autograd node
// (derivatives.yaml entry) whose formula it repeats, so that a reader can check the
// gradients op for op against what the composite would have recorded.
#include "fused_ops.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace modalities::plugins::gpt2 {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// Backward runs below the autograd layer (no graph is recorded), so a graph for a second
// derivative would silently be missing: refuse it instead.
void refuse_double_backward(const char* node) {
  TORCH_CHECK(!c10::GradMode::is_enabled(), node,
              ": double backward (create_graph=True) is not supported by the fused GPT-2 ops");
}

template <class N>
std::shared_ptr<N> make_node() {
  return std::shared_ptr<N>(new N(), torch::autograd::deleteNode);
}

// True when `t` shares storage with `base` (a view that contiguous() returned unchanged).
bool aliases(const at::Tensor& t, const at::Tensor& base) { return t.is_alias_of(base); }

// ---------------------------------------------------------------------------------------
// Linear: y = x w^T (+ b) for a row-major 2-d x.
// Composite: mm(x, w.t()) [MmBackward0 + TBackward0] or addmm(b, x, w.t()) [AddmmBackward0
// + TBackward0]. With x row-major and w.t() column-major, mm_mat1_backward is grad.mm(w) and
// mm_mat2_backward is grad.t().mm(x).t(), which TBackward0 transposes back: grad.t().mm(x).
// The bias gradient is the engine's sum_to of grad to b's shape.
class LinearBackward final : public Node {
 public:
  variable_list apply(variable_list&& grads) override {
    refuse_double_backward("modalities::plugins::gpt2::LinearBackward");
    variable_list out(3);
    const at::Tensor& g = grads[0];
    if (!g.defined()) return out;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    if (task_should_compute_output(0)) out[0] = g.mm(w_.unpack());
    if (task_should_compute_output(1)) out[1] = g.t().mm(x_.unpack());
    if (has_bias_ && task_should_compute_output(2)) out[2] = at::sum_to(g, at::IntArrayRef{g.size(1)});
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
    refuse_double_backward("modalities::plugins::gpt2::RmsNormBackward");
    variable_list out(num_outputs());
    const at::Tensor& g = grads[0];
    if (!g.defined()) return out;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor x = x_.unpack();
    const at::Tensor xf = upcast_ ? x.to(opmath_) : x;
    const at::Tensor r = r_.unpack();
    const at::Tensor gf = upcast_ ? g.to(opmath_) : g;
    at::Tensor gu = gf;
    if (has_weight_) {
      const at::Tensor w = w_.unpack();
      const std::size_t wi = num_outputs() - 1;
      if (task_should_compute_output(wi)) out[wi] = at::sum_to(gf * u_.unpack(), w.sizes());
      gu = gf * w;
    }
    const bool need_x = upcast_ ? task_should_compute_output(0)
                                : (task_should_compute_output(0) || task_should_compute_output(1));
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
// Heads: [B*T, H*hd] -> view [B, T, H, hd] -> transpose(1, 2) -> contiguous (a clone)
// [-> x * cos + cat(-x2, x1) * sin] [-> unsqueeze(2).expand(B, H, r, T, hd).reshape(B, H*r, T, hd)].
// Backward, node by node:
//   UnsafeViewBackward0, CloneBackward0, ExpandBackward0, UnsqueezeBackward0 (GQA):
//       g = sum_to(g.reshape(B, H, r, T, hd), (B, H, 1, T, hd)).squeeze(2)
//   AddBackward0, MulBackward0 (x * cos)          -> g * cos
//   MulBackward0 (rh * sin), CatBackward0, NegBackward0, SplitBackward0 (chunk)
//       gr = g * sin -> cat(gr[..., h:], -gr[..., :h])
//   (the clone's buffer adds the two, a two-term sum: order-free)
//   CloneBackward0, TransposeBackward0, ViewBackward0 -> g.transpose(1, 2).reshape(B*T, H*hd)
class SplitHeadsBackward final : public Node {
 public:
  variable_list apply(variable_list&& grads) override {
    refuse_double_backward("modalities::plugins::gpt2::SplitHeadsBackward");
    variable_list out(1);
    at::Tensor g = grads[0];
    if (!g.defined() || !task_should_compute_output(0)) return out;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    if (repeat_ > 1) g = at::sum_to(g.reshape({B_, H_, repeat_, T_, hd_}), at::IntArrayRef{B_, H_, 1, T_, hd_}).squeeze(2);
    if (rotary_) {
      const at::Tensor cos = cos_.unpack(), sin = sin_.unpack();
      const at::Tensor direct = g * cos;
      const at::Tensor gr = g * sin;
      const std::int64_t h = hd_ / 2;
      const at::Tensor chunks = at::cat({gr.narrow(-1, h, hd_ - h), gr.narrow(-1, 0, h).neg()}, -1);
      g = direct + chunks;
    }
    out[0] = g.transpose(1, 2).reshape({B_ * T_, H_ * hd_});
    return out;
  }
  std::string name() const override { return "modalities::plugins::gpt2::SplitHeadsBackward"; }
  void release_variables() override {
    cos_.reset_data();
    sin_.reset_data();
  }

  SavedVariable cos_, sin_;
  bool rotary_ = false;
  std::int64_t B_ = 0, T_ = 0, H_ = 0, hd_ = 0, repeat_ = 1;
};

// Merge: [B, H, T, hd] -> transpose(1, 2) -> contiguous (a clone) -> view(B*T, H*hd).
// Backward: ViewBackward0 g.reshape(B, T, H, hd), CloneBackward0, TransposeBackward0 .transpose(1, 2).
class MergeHeadsBackward final : public Node {
 public:
  variable_list apply(variable_list&& grads) override {
    refuse_double_backward("modalities::plugins::gpt2::MergeHeadsBackward");
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
  const bool row_major = x.dim() == 2 && x.stride(1) == 1 && x.stride(0) == x.size(1);
  if (!row_major || w.dim() != 2) return at::linear(x, w, b);
  at::Tensor y;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    y = b.defined() ? at::addmm(b, x, w.t()) : at::mm(x, w.t());
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
  if (!(reduced || st == at::kFloat || st == at::kDouble) || x.dim() < 1 || !x.is_contiguous() ||
      (w.defined() && (w.dim() != 1 || w.size(0) != x.size(-1))))
    return at::rms_norm(x, {x.size(-1)}, w.defined() ? std::optional(w) : std::nullopt, eps);
  const c10::ScalarType opmath = reduced ? at::kFloat : st;
  at::Tensor y, r, u;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor xf = x.to(opmath);
    r = at::rsqrt(at::pow(xf, 2).mean({x.dim() - 1}, /*keepdim=*/true).add_(eps));
    u = xf.mul(r);
    y = w.defined() ? u.mul(w) : u;
    y = y.contiguous().to(st);
    if (aliases(y, x)) y = y.clone();  // (w undefined, fp32: u is new anyway; kept for safety)
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

at::Tensor fused_split_heads(const at::Tensor& x, std::int64_t B, std::int64_t T, std::int64_t H,
                             std::int64_t hd, const at::Tensor& cos, const at::Tensor& sin, std::int64_t repeat) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == B * T && x.size(1) == H * hd, "fused_split_heads: expected [", B * T,
              ", ", H * hd, "], got ", x.sizes());
  TORCH_CHECK(repeat >= 1, "fused_split_heads: repeat must be >= 1, got ", repeat);
  const bool rotary = cos.defined();
  at::Tensor y;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    y = x.view({B, T, H, hd}).transpose(1, 2).contiguous();
    if (aliases(y, x)) y = y.clone();
    if (rotary) {
      const auto halves = y.chunk(2, -1);
      y = y * cos + at::cat({halves[1].neg(), halves[0]}, -1) * sin;
    }
    if (repeat > 1) y = y.unsqueeze(2).expand({B, H, repeat, T, hd}).reshape({B, H * repeat, T, hd});
  }
  if (torch::autograd::compute_requires_grad(x)) {
    auto node = make_node<SplitHeadsBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    node->rotary_ = rotary;
    if (rotary) {
      node->cos_ = SavedVariable(cos, false);
      node->sin_ = SavedVariable(sin, false);
    }
    node->B_ = B;
    node->T_ = T;
    node->H_ = H;
    node->hd_ = hd;
    node->repeat_ = repeat;
    torch::autograd::set_history(y, node);
  }
  return y;
}

at::Tensor fused_merge_heads(const at::Tensor& y) {
  TORCH_CHECK(y.dim() == 4, "fused_merge_heads: expected [B, H, T, hd], got ", y.sizes());
  const std::int64_t B = y.size(0), H = y.size(1), T = y.size(2), hd = y.size(3);
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = y.transpose(1, 2).contiguous();
    if (aliases(out, y)) out = out.clone();
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
