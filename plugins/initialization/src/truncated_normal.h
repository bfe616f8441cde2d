// Truncated normal fill, PyTorch's algorithm (torch.nn.init.trunc_normal_) as
// Modalities' Llama-3-like initializer uses it: drawn on a float32 temporary and
// copied into the tensor, so bf16/fp16 parameters get the same distribution.
// Header-only so the plugin test can check the distribution with tight bounds.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>

namespace modalities::plugins::initialization {

/// Fills `t` in place with N(mean, std²) truncated to [a, b] (absolute bounds):
/// inverse-CDF sampling from U(2Φ(α)−1, 2Φ(β)−1), then clamped to [a, b]
/// against rounding. Uses the default generator of t's device. No autograd.
inline void trunc_normal_(const at::Tensor& t, double mean, double std, double a, double b) {
  auto norm_cdf = [](double x) { return (1.0 + std::erf(x / std::sqrt(2.0))) / 2.0; };
  const double l = norm_cdf((a - mean) / std);
  const double u = norm_cdf((b - mean) / std);
  at::NoGradGuard no_grad;
  // Like Python's tensor.float(): the tensor itself when it already is float32.
  at::Tensor tmp = t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
  tmp.uniform_(2 * l - 1, 2 * u - 1);
  tmp.erfinv_();
  tmp.mul_(std * std::sqrt(2.0));
  tmp.add_(mean);
  tmp.clamp_(a, b);
  if (!tmp.is_same(t)) t.copy_(tmp);
}

}  // namespace modalities::plugins::initialization
