// The three `layer_norm` variants (README.md), each a Module over one tensor:
// forward({"input": x}) -> {"output": y}, normalising over the last dimension.
// Config schemas and formulas are the SDK's (modalities/sdk/norms.h), shared with
// model/gpt2. rms_norm (Modalities' RMSLayerNorm) is deprecated in Modalities and
// kept for config compatibility. Parameter names follow PyTorch ("weight", "bias")
// so state dicts interchange.
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/norms.h>
#include <modalities/sdk/plugin.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <memory>

namespace modalities::plugins::layer_norm {
namespace {

using norms::LayerNormConfig;
using norms::RmsLayerNormConfig;
using norms::TorchRmsNormConfig;

// Shape legend: x: [..., n] -> y: [..., n]
class NormModule final : public Module {
 public:
  NormModule(norms::Kind kind, std::int64_t n, double eps, bool weight, bool bias) : kind_(kind), n_(n), eps_(eps) {
    impl_ = std::make_shared<torch::nn::Module>(norms::module_name(kind));
    if (weight) weight_ = impl_->register_parameter("weight", at::ones({n}));
    if (bias) bias_ = impl_->register_parameter("bias", at::zeros({n}));
  }

  TensorMap forward(const TensorMap& inputs) override {
    auto it = inputs.find("input");
    TORCH_CHECK(it != inputs.end(), "layer norm expects its tensor under the key 'input'");
    return {{"output", norms::apply(kind_, it->second, n_, weight_, bias_, eps_)}};
  }
  torch::nn::Module& module() override { return *impl_; }
  const torch::nn::Module& module() const override { return *impl_; }
  std::string sample_key() const override { return "input"; }
  std::string prediction_key() const override { return "output"; }

 private:
  norms::Kind kind_;
  std::int64_t n_;
  double eps_;
  std::shared_ptr<torch::nn::Module> impl_;
  at::Tensor weight_, bias_;
};

}  // namespace

void register_components(Registrar& r) {
  r.add<Module, LayerNormConfig>(
      "layer_norm", "layer_norm", "Standard LayerNorm over the last dimension.", [](const LayerNormConfig& c) {
        return std::make_shared<NormModule>(norms::Kind::kLayerNorm, c.normalized_shape, c.eps, c.elementwise_affine,
                                            c.elementwise_affine && c.bias);
      });
  r.add<Module, RmsLayerNormConfig>(
      "layer_norm", "rms_norm",
      "Modalities' RMSLayerNorm: RMS normalisation in fp32, then weight (and bias). Deprecated: prefer "
      "pytorch_rms_norm.",
      [](const RmsLayerNormConfig& c, BuildContext& ctx) {
        ctx.warn("layer_norm/rms_norm is deprecated (as in Modalities); prefer layer_norm/pytorch_rms_norm");
        return std::make_shared<NormModule>(norms::Kind::kRmsLayerNorm, c.ndim, c.epsilon, true, c.bias);
      });
  r.add<Module, TorchRmsNormConfig>(
      "layer_norm", "pytorch_rms_norm", "Standard RMSNorm (weight only).", [](const TorchRmsNormConfig& c) {
        return std::make_shared<NormModule>(norms::Kind::kTorchRmsNorm, c.normalized_shape, c.eps, true, false);
      });
}

}  // namespace modalities::plugins::layer_norm

MODALITIES_PLUGIN(layer_norm, MODALITIES_PLUGIN_VERSION, modalities::plugins::layer_norm::register_components)
