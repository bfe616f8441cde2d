// The three `layer_norm` variants (README.md), each a Module over one tensor:
// forward({"input": x}) -> {"output": y}, normalising over the last dimension.
//   layer_norm        standard LayerNorm (optional affine weight and bias)
//   rms_norm          Modalities' RMSLayerNorm: x / sqrt(mean(x^2) + epsilon) in fp32,
//                     cast back to x's dtype, then * weight (+ bias). Deprecated in
//                     Modalities; kept for config compatibility.
//   pytorch_rms_norm  standard RMSNorm (weight only)
// Parameter names follow PyTorch ("weight", "bias") so state dicts interchange.
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/plugin.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <optional>
#include <vector>

namespace modalities::plugins::layer_norm {
namespace {

// Shape legend: x: [..., n] -> y: [..., n]
class NormModule final : public Module {
 public:
  enum class Kind { kLayerNorm, kRmsLayerNorm, kTorchRmsNorm };

  NormModule(Kind kind, std::int64_t n, double eps, bool weight, bool bias) : kind_(kind), n_(n), eps_(eps) {
    impl_ = std::make_shared<torch::nn::Module>(name(kind));
    if (weight) weight_ = impl_->register_parameter("weight", at::ones({n}));
    if (bias) bias_ = impl_->register_parameter("bias", at::zeros({n}));
  }

  at::Tensor apply(const at::Tensor& x) const {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == n_, "layer norm over ", n_, " features got input of shape ", x.sizes());
    switch (kind_) {
      case Kind::kLayerNorm:
        return at::layer_norm(x, {n_}, weight_, bias_, eps_);
      case Kind::kTorchRmsNorm:
        return at::rms_norm(x, {n_}, weight_, eps_);
      case Kind::kRmsLayerNorm: {
        const at::Tensor xf = x.to(at::kFloat);
        at::Tensor y = (xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps_)).to(x.scalar_type());
        if (weight_.defined()) y = y * weight_;
        if (bias_.defined()) y = y + bias_;
        return y;
      }
    }
    return {};
  }

  TensorMap forward(const TensorMap& inputs) override {
    auto it = inputs.find("input");
    TORCH_CHECK(it != inputs.end(), "layer norm expects its tensor under the key 'input'");
    return {{"output", apply(it->second)}};
  }
  torch::nn::Module& module() override { return *impl_; }
  const torch::nn::Module& module() const override { return *impl_; }
  std::string sample_key() const override { return "input"; }
  std::string prediction_key() const override { return "output"; }

 private:
  static const char* name(Kind k) {
    switch (k) {
      case Kind::kLayerNorm: return "LayerNorm";
      case Kind::kRmsLayerNorm: return "RMSLayerNorm";
      case Kind::kTorchRmsNorm: return "RMSNorm";
    }
    return "Norm";
  }
  Kind kind_;
  std::int64_t n_;
  double eps_;
  std::shared_ptr<torch::nn::Module> impl_;
  at::Tensor weight_, bias_;
};

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

}  // namespace

void register_components(Registrar& r) {
  r.add<Module, LayerNormConfig>("layer_norm", "layer_norm", "Standard LayerNorm over the last dimension.",
                                 [](const LayerNormConfig& c) {
                                   return std::make_shared<NormModule>(NormModule::Kind::kLayerNorm, c.normalized_shape,
                                                                       c.eps, c.elementwise_affine,
                                                                       c.elementwise_affine && c.bias);
                                 });
  r.add<Module, RmsLayerNormConfig>(
      "layer_norm", "rms_norm",
      "Modalities' RMSLayerNorm: RMS normalisation in fp32, then weight (and bias). Deprecated: prefer pytorch_rms_norm.",
      [](const RmsLayerNormConfig& c, BuildContext& ctx) {
        ctx.warn("layer_norm/rms_norm is deprecated (as in Modalities); prefer layer_norm/pytorch_rms_norm");
        return std::make_shared<NormModule>(NormModule::Kind::kRmsLayerNorm, c.ndim, c.epsilon, true, c.bias);
      });
  r.add<Module, TorchRmsNormConfig>("layer_norm", "pytorch_rms_norm", "Standard RMSNorm (weight only).",
                                    [](const TorchRmsNormConfig& c) {
                                      return std::make_shared<NormModule>(NormModule::Kind::kTorchRmsNorm,
                                                                          c.normalized_shape, c.eps, true, false);
                                    });
}

}  // namespace modalities::plugins::layer_norm

MODALITIES_PLUGIN(layer_norm, MODALITIES_PLUGIN_VERSION, modalities::plugins::layer_norm::register_components)
