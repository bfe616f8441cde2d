// The building blocks of model/gpt2 that other architectures reuse: the compute-dtype cast, the
// Leaf modules that own tensors (Linear), the SwiGLU MLP and the feed-forward seam of a block.
//
// The seam: every GPT2Block holds its MLP as a FeedForward. model/gpt2 builds the dense MLPs of
// Modalities (TransformerMLP, SwiGLU); another plugin (plugins/moe) passes a FeedForwardFactory to
// make_gpt2 (model.h) and gets the same decoder, state dicts, meta device, hooks, activation
// checkpointing, pipeline split and FSDP with its own feed-forward in the layers it chooses.
//
// Shapes: activations are [B*T, d] matrices, one row per token (see GPT2LLMImpl::forward).
#pragma once

#include "fused_ops.h"

#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/tensor_parallel.h>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/nn/init.h>
#include <torch/nn/module.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace modalities::plugins::gpt2 {

// Mixed precision: parameters keep their storage dtype; every use casts to `Dt`
// when set (FSDP2's param_dtype, README.md). See Module::set_param_dtype.
using Dt = std::optional<c10::ScalarType>;

inline at::Tensor cast(const at::Tensor& t, Dt dt) {
  if (!dt || !t.defined() || t.scalar_type() == *dt) return t;
  return t.to(*dt);
}

using Remap = std::function<at::Tensor(const at::Tensor&)>;

// Tensor parallelism (Module::apply_tensor_parallel, `model/gpt2_tp`, README.md): the SDK's plan
// (modalities/sdk/tensor_parallel.h) says how this rank's part of the model talks to the others.
using TpPlan = tp::Plan;

// Note [Replacing registered tensors]
// libtorch's Module::to() moves tensors with set_data(), which cannot turn a meta
// tensor into a real one (their TensorImpls are not shallow-copy compatible), and
// libtorch has no to_empty(). Materializing a meta model and clone() therefore swap
// the registered tensors themselves: parameters through the protected `parameters_`
// dict, a buffer through the slot that register_buffer returned (stable while the
// module registers no further buffer). Every module with parameters or buffers is a Leaf.
class Leaf : public torch::nn::Module {
 public:
  explicit Leaf(std::string name) : torch::nn::Module(std::move(name)) {}
  /// Constructor-time values again (README.md), on whatever device the tensors live.
  virtual void reset() = 0;
  /// Replaces every own parameter and buffer by f(old).
  virtual void remap(const Remap& f) {
    for (auto& item : parameters_) item.value() = f(item.value());
    sync();
  }

 protected:
  /// Refreshes the typed member handles from the registered tensors.
  virtual void sync() {}
  at::Tensor registered(const std::string& name) const {
    const at::Tensor* t = parameters_.find(name);
    return t != nullptr ? *t : at::Tensor();
  }
};

// torch.nn.Linear: weight [out, in], optional bias [out].
class LinearImpl final : public Leaf {
 public:
  LinearImpl(std::int64_t in, std::int64_t out, bool bias, const at::TensorOptions& o) : Leaf("Linear"), in_(in) {
    register_parameter("weight", at::empty({out, in}, o));
    if (bias) register_parameter("bias", at::empty({out}, o));
    sync();
  }
  void reset() override {
    // torch.nn.Linear.reset_parameters: Kaiming-uniform (a = sqrt(5)) = U(+-1/sqrt(fan_in)) for both.
    torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
    if (bias.defined()) {
      const double bound = in_ > 0 ? 1.0 / std::sqrt(static_cast<double>(in_)) : 0.0;
      bias.uniform_(-bound, bound);
    }
  }
  // x: [..., in] -> [..., out]; fused for the model's 2-d activations (at::linear otherwise).
  at::Tensor operator()(const at::Tensor& x, Dt dt) const { return fused_linear(x, cast(weight, dt), cast(bias, dt)); }

  at::Tensor weight, bias;

 private:
  void sync() override {
    weight = registered("weight");
    bias = registered("bias");
  }
  std::int64_t in_;
};

/// A row-parallel linear (its weight split on the input dim): the local product, summed over the
/// ranks by TpPlan::leave, then the bias, once (modules.cpp).
at::Tensor row_parallel(const LinearImpl& l, const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt,
                        const TpPlan& tp);

/// Expert parallelism (Module::apply_expert_parallel): the E routed experts of a feed-forward
/// partitioned over the `size` ranks of `group`, rank r holding experts [r E / size, (r + 1) E /
/// size). Special members out of line (modules.cpp): the header needs no complete c10d::ProcessGroup.
struct ExpertParallel {
  ExpertParallel(c10::intrusive_ptr<c10d::ProcessGroup> group, std::int64_t rank, std::int64_t size);
  ExpertParallel(const ExpertParallel&);
  ExpertParallel& operator=(const ExpertParallel&);
  ~ExpertParallel();

  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::int64_t rank = 0;
  std::int64_t size = 1;
};

/// What a GPT2Block calls between ffn_norm and the residual add. x: [B*T, d] -> [B*T, d] (under
/// sequence parallelism the block has gathered x whole before the call).
class FeedForward : public torch::nn::Module {
 public:
  using torch::nn::Module::Module;
  virtual at::Tensor forward(const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt) = 0;
  /// Throws modalities::Error naming why this feed-forward cannot take part in tensor parallelism
  /// with `plan`; called for every block before any weight is split.
  virtual void check_tensor_parallel(const TpPlan& plan) const;
  /// Tensor parallel: this rank's part of the hidden units (the weights were split by the model).
  virtual void parallelize(const TpPlan& plan);
  /// Whether it computes whole on every tp rank under tensor parallelism (its parameters
  /// replicated, its output the block's whole output): then the block hands it the normed input
  /// without entering the tp region, whose backward would add up the tp ranks' equal input
  /// gradients; under sequence parallelism the block gathers the whole sequence for it and keeps
  /// this rank's chunk of its output. The MoE blocks (plugins/moe) are; model/gpt2's MLPs split
  /// their hidden units.
  virtual bool replicated_under_tensor_parallel() const { return false; }
  /// Expert parallelism: keeps this rank's share of the feed-forward's experts, whose forward
  /// then talks to the other ranks of ep.group, and returns the names (relative to this module)
  /// of the parameters split on dim 0. A dense MLP has no experts: the default returns none and
  /// changes nothing.
  virtual std::vector<std::string> parallelize_experts(const ExpertParallel& ep);
  /// Module::take_metrics: appends what this feed-forward measured in its training forwards since
  /// the last call, naming it after `block` ("block 1"), then forgets it. Default: nothing.
  virtual void take_metrics(const std::string& block, std::vector<ModelMetric>& out);
  /// Module::parameter_activity: the share of each of its parameters (names relative to this
  /// module) one token computes with, for those it does not use whole. Default: none.
  virtual std::map<std::string, double> parameter_activity() const { return {}; }
  /// Whether forward() leaves an auxiliary loss for take_aux_loss() (MoE load balancing).
  virtual bool has_aux_loss() const { return false; }
  /// The auxiliary loss of the last forward (0-dim, with its graph), then forgotten; undefined if none.
  virtual at::Tensor take_aux_loss() { return {}; }
};

/// Makes the feed-forward of block `layer` (0-based), or returns null for model/gpt2's own dense
/// MLP. Called in the order the blocks are created, with the options of the model's tensors.
using FeedForwardFactory =
    std::function<std::shared_ptr<FeedForward>(std::int64_t layer, const at::TensorOptions& options)>;

// SwiGLU(x) = W_2(silu(W x) * (V x)) with hidden size h (Modalities' SwiGLU: names W, V, W_2).
class SwiGLUImpl final : public FeedForward {
 public:
  SwiGLUImpl(std::int64_t d, std::int64_t h, bool bias, const at::TensorOptions& o);
  // x: [B*T, d] -> [B*T, h] -> [B*T, d]; no dropout (as in Modalities). Under TP h is this
  // rank's part of the hidden units and W_2 is row-parallel.
  at::Tensor forward(const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt) override;
  void check_tensor_parallel(const TpPlan&) const override {}
  void parallelize(const TpPlan& plan) override { tp = &plan; }

  std::shared_ptr<LinearImpl> W, V, W_2;
  const TpPlan* tp = nullptr;
};

}  // namespace modalities::plugins::gpt2
