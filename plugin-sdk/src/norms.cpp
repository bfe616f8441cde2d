#include <modalities/sdk/norms.h>

#include <ATen/ATen.h>

#include <optional>

namespace modalities::norms {

const char* module_name(Kind kind) {
  switch (kind) {
    case Kind::kLayerNorm: return "LayerNorm";
    case Kind::kRmsLayerNorm: return "RMSLayerNorm";
    case Kind::kTorchRmsNorm: return "RMSNorm";
  }
  return "Norm";
}

at::Tensor apply(Kind kind, const at::Tensor& x, std::int64_t n, const at::Tensor& weight, const at::Tensor& bias,
                 double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == n, "a ", module_name(kind), " over ", n, " features got input of shape ",
              x.sizes());
  switch (kind) {
    case Kind::kLayerNorm: return at::layer_norm(x, {n}, weight, bias, eps);
    case Kind::kTorchRmsNorm: return at::rms_norm(x, {n}, weight.defined() ? std::optional(weight) : std::nullopt, eps);
    case Kind::kRmsLayerNorm: {
      // Normalise in fp32, cast back, then scale (and shift) in x's dtype, as Modalities does.
      const at::Tensor xf = x.to(at::kFloat);
      at::Tensor y = (xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(x.scalar_type());
      if (weight.defined()) y = y * weight;
      if (bias.defined()) y = y + bias;
      return y;
    }
  }
  return {};
}

}  // namespace modalities::norms
