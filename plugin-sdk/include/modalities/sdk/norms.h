// The normalisation layers of Modalities' `layer_norm` component, shared by every
// plugin that builds them: the standalone `layer_norm/*` variants and the norms
// inside `model/gpt2` (its `{norm_type, config}` tables take the same keys). One
// copy of the config schemas and of the formulas, so the two cannot drift.
//   layer_norm        standard LayerNorm (optional affine weight and bias), eps 1e-6
//   rms_norm          Modalities' RMSLayerNorm: x / sqrt(mean(x^2) + epsilon) in fp32,
//                     cast back to x's dtype, then * weight (+ bias); epsilon 1e-6
//   pytorch_rms_norm  standard RMSNorm (weight only), eps 1e-5
// The defaults are those of Modalities' config classes. (model/gpt2 resolves one
// more case, a layer_norm table with neither elementwise_affine nor bias: see its
// README, "layer_norm eps default".)
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/schema.h>

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace modalities::norms {

enum class Kind { kLayerNorm, kRmsLayerNorm, kTorchRmsNorm };

/// Keys of `layer_norm/layer_norm` (Modalities' LayerNormConfig).
struct LayerNormConfig {
  std::int64_t normalized_shape = 0;
  double eps = 1e-6;
  bool elementwise_affine = true;
  bool bias = true;
  static void describe(Schema<LayerNormConfig>& s) {
    s.field("normalized_shape", &LayerNormConfig::normalized_shape, "Size of the normalised (last) dimension.")
        .required()
        .at_least(1);
    s.field("eps", &LayerNormConfig::eps, "Added to the variance for numerical stability.").positive();
    s.field("elementwise_affine", &LayerNormConfig::elementwise_affine, "Learn a per-feature weight (and bias).");
    s.field("bias", &LayerNormConfig::bias, "Learn a per-feature bias (only with elementwise_affine).");
  }
};

/// Keys of `layer_norm/rms_norm` (Modalities' RMSLayerNormConfig).
struct RmsLayerNormConfig {
  std::int64_t ndim = 0;
  double epsilon = 1e-6;
  bool bias = true;
  static void describe(Schema<RmsLayerNormConfig>& s) {
    s.field("ndim", &RmsLayerNormConfig::ndim, "Size of the normalised (last) dimension.").required().at_least(1);
    s.field("epsilon", &RmsLayerNormConfig::epsilon, "Added to the mean square for numerical stability.").positive();
    s.field("bias", &RmsLayerNormConfig::bias, "Learn a per-feature bias.");
  }
};

/// Keys of `layer_norm/pytorch_rms_norm` (Modalities' PytorchRMSLayerNormConfig).
struct TorchRmsNormConfig {
  std::int64_t normalized_shape = 0;
  double eps = 1e-5;
  static void describe(Schema<TorchRmsNormConfig>& s) {
    s.field("normalized_shape", &TorchRmsNormConfig::normalized_shape, "Size of the normalised (last) dimension.")
        .required()
        .at_least(1);
    s.field("eps", &TorchRmsNormConfig::eps, "Added to the mean square for numerical stability.").positive();
  }
};

/// Modalities' class name of a norm ("LayerNorm", "RMSLayerNorm", "RMSNorm"), the
/// name of its module in state dicts and model prints.
MODALITIES_SDK_API const char* module_name(Kind kind);

/// The norm of `x` over its last dimension (size n). `weight` and `bias` may be
/// undefined (no affine part); they are used as given, so a caller computing in
/// another dtype casts them first. Shape: [..., n] -> [..., n].
MODALITIES_SDK_API at::Tensor apply(Kind kind, const at::Tensor& x, std::int64_t n, const at::Tensor& weight,
                                    const at::Tensor& bias, double eps);

}  // namespace modalities::norms
