// Fused autograd ops of the GPT-2 model: one autograd node where the eager composite
// records several.
//
// Why: on small models a training step is bound by per-op host work (dispatch, autograd
// node creation and the engine's per-node bookkeeping), not by kernels. Each op here runs
// the very same ATen calls as the composite it replaces, below the autograd layer, and one
// hand-written node computes the gradients with the same formulas, in the same order, as
// the nodes autograd would have recorded. Values and gradients are therefore bit-identical
// to the composite (tests/fused_ops_test.cpp compares both); only the bookkeeping shrinks.
//
// Where the composite's gradient for an input is the sum of several contributions that the
// engine accumulates one by one (a fan-out inside the op), the node lists that input once
// per contribution, in the engine's order, so the accumulation order and rounding stay the
// same. No double backward (create_graph) through these nodes: it is refused clearly.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace modalities::plugins::gpt2 {

/// at::linear(x, w, b) for a row-major 2-d x [N, in] and a row-major w: mm / addmm, one
/// node instead of t + mm (+ the bias reduction). Other layouts: at::linear.
at::Tensor fused_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

/// at::rms_norm(x, {x.size(-1)}, w, eps) on the CPU (torch's composite: upcast, pow, mean,
/// add_, rsqrt, mul, mul, type_as), one node instead of six or more; w may be undefined.
/// Elsewhere at::rms_norm itself (on CUDA that is ATen's fused kernel).
at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

/// Heads of one projection: [B*T, H*hd] -> view [B, T, H, hd] -> transpose(1, 2) ->
/// contiguous, then rotary embedding when cos/sin are defined (x * cos + rotate_half(x) * sin,
/// cos/sin broadcastable to [1, 1, T, hd]), then, when repeat > 1, grouped-query expansion to
/// H * repeat heads (head j serves heads j*repeat .. j*repeat+repeat-1).
struct HeadsSpec {
  std::int64_t heads = 0;
  at::Tensor cos, sin;  // both or neither
  std::int64_t repeat = 1;
};

struct Qkv {
  at::Tensor q, k, v;  // [B, H, T, hd] each
};

/// The attention front of a block: q, k, v projections of the shared input x [B*T, d]
/// (fused_linear each), each split into heads per its HeadsSpec. One node instead of
/// up to 6 + 3 * 13.
Qkv fused_qkv(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& bq, const at::Tensor& wk,
              const at::Tensor& bk, const at::Tensor& wv, const at::Tensor& bv, std::int64_t B, std::int64_t T,
              std::int64_t hd, const HeadsSpec& q, const HeadsSpec& k, const HeadsSpec& v);

/// SwiGLU's gated product: silu(x W^T + bW) * (x V^T + bV) for x [B*T, d]. One node instead
/// of four (two linears, silu, mul).
at::Tensor fused_swiglu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bw, const at::Tensor& v,
                        const at::Tensor& bv);

/// [B, H, T, hd] -> [B*T, H*hd]: y.transpose(1, 2).contiguous().view({B*T, -1}), one node.
at::Tensor fused_merge_heads(const at::Tensor& y);

}  // namespace modalities::plugins::gpt2
