// The moe plugin (README.md): model/gpt2_moe, model/gpt2's decoder with Mixture-of-Experts
// feed-forward blocks (moe.h) in the layers its moe_config selects, and optimizer/moe_load_balanced,
// which moves the blocks' selection biases after every step. Built against the SDK and gpt2's
// engine (make_gpt2 with a FeedForwardFactory, plugins/gpt2/src/layers.h); nothing in core knows it.
#include "config.h"  // plugins/gpt2
#include "model.h"   // plugins/gpt2: make_gpt2
#include "moe.h"

#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/optimizer.h>
#include <modalities/sdk/model_parts.h>
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/run_context.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

namespace modalities::plugins::moe {
namespace {

// model/gpt2's config (every key, the same checks) plus moe_config.
struct Gpt2MoeConfig : gpt2::GPT2Config {
  MoeConfig moe_config;
  static void describe(Schema<Gpt2MoeConfig>& s) {
    GPT2Config::describe_fields(s);
    s.field("moe_config", &Gpt2MoeConfig::moe_config,
            "The MoE blocks: experts, routing, shared experts and which layers are MoE (plugins/moe/README.md).")
        .required();
    s.rule([](const Gpt2MoeConfig& c, ParseContext& ctx) {
      const MoeConfig& m = c.moe_config;
      for (std::size_t i = 0; i < m.mlp_only_layers.size(); ++i)
        if (m.mlp_only_layers[i] >= c.n_layer)
          ctx.fail(fmt::format("moe_config.mlp_only_layers[{}]", i),
                   fmt::format("is {}, not a block of the model (n_layer = {}: blocks 0 to {})", m.mlp_only_layers[i],
                               c.n_layer, c.n_layer - 1));
      bool any = false;
      for (std::int64_t i = 0; i < c.n_layer; ++i) any = any || m.is_moe_layer(i);
      if (!any)
        ctx.fail("moe_config",
                 fmt::format("selects no MoE block of the {} blocks (first_k_dense_replace = {}, decoder_sparse_step = "
                             "{}, mlp_only_layers); use model/gpt2 for a dense model",
                             c.n_layer, m.first_k_dense_replace, m.decoder_sparse_step));
    });
  }
};

// optimizer/moe_load_balanced: another optimizer, and after each of its steps the auxiliary-loss-free
// bias update of every MoE block that balances load (moe.cpp, Note [Load balancing bias]).
struct LoadBalancedConfig {
  Ref<Optimizer> optimizer;
  double expert_bias_update_rate = 1e-3;
  ModelParts model;
  std::optional<Ref<DeviceMesh>> device_mesh;
  static void describe(Schema<LoadBalancedConfig>& s) {
    s.field("optimizer", &LoadBalancedConfig::optimizer,
            "The optimizer that updates the parameters (e.g. optimizer/adam_w over the same model).")
        .required();
    s.field("expert_bias_update_rate", &LoadBalancedConfig::expert_bias_update_rate,
            "How far every expert bias moves after a step (DeepSeek-V3's gamma; Modalities' key).")
        .greater_than(0.0);
    s.field("model", &LoadBalancedConfig::model,
            "The model (or this rank's pipeline stages) whose MoE blocks with moe_config.use_expert_bias get their "
            "router.expert_bias moved after every step (Modalities' key).")
        .required();
    s.field("device_mesh", &LoadBalancedConfig::device_mesh,
            "The run's layout: the tokens per expert are summed over its data-parallel dims (dp_shard, "
            "dp_replicate). null: over all ranks, every one data parallel.");
  }
};

class LoadBalancedOptimizer final : public Optimizer {
 public:
  LoadBalancedOptimizer(std::shared_ptr<Optimizer> inner, std::vector<std::shared_ptr<Module>> parts, double rate,
                        ParallelDims dims)
      : inner_(std::move(inner)), parts_(std::move(parts)), rate_(rate), dims_(std::move(dims)) {
    for (const auto& part : parts_)
      for (const auto& m : part->module().modules(/*include_self=*/true))
        if (auto* block = dynamic_cast<MoeFeedForwardImpl*>(m.get()); block != nullptr && block->balances_load())
          blocks_.push_back(block);
    if (blocks_.empty())
      throw ConfigError("model",
                        "has no MoE block with moe_config.use_expert_bias = true (model/gpt2_moe); there is no bias "
                        "to move: use the optimizer alone");
  }

  void step() override {
    inner_->step();
    // One tensor for every block's load: one all-reduce per data-parallel dim.
    std::vector<at::Tensor> loads;
    for (MoeFeedForwardImpl* b : blocks_) loads.push_back(b->take_expert_load());
    std::vector<at::Tensor> all = {at::cat(loads)};
    for (const MeshDim dim : {MeshDim::dp_shard, MeshDim::dp_replicate})
      if (const auto g = dims_.group(dim)) g->allreduce(all)->wait();
    std::int64_t offset = 0;
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      const std::int64_t n = loads[i].numel();
      blocks_[i]->update_expert_bias(all[0].narrow(0, offset, n), rate_);
      offset += n;
    }
  }
  void zero_grad(bool set_to_none = true) override { inner_->zero_grad(set_to_none); }
  std::size_t num_param_groups() const override { return inner_->num_param_groups(); }
  std::vector<double> learning_rates() const override { return inner_->learning_rates(); }
  void set_learning_rate(std::size_t group, double lr) override { inner_->set_learning_rate(group, lr); }
  std::optional<double> group_option(std::size_t group, std::string_view name) const override {
    return inner_->group_option(group, name);
  }
  void set_group_option(std::size_t group, std::string_view name, double value) override {
    inner_->set_group_option(group, name, value);
  }
  StateDict state_dict() const override { return inner_->state_dict(); }
  void load_state_dict(const StateDict& state) override { inner_->load_state_dict(state); }

 private:
  std::shared_ptr<Optimizer> inner_;
  std::vector<std::shared_ptr<Module>> parts_;  // keeps the blocks alive
  double rate_;
  ParallelDims dims_;
  std::vector<MoeFeedForwardImpl*> blocks_;
};

// The Hugging Face side of model/gpt2_moe (plugins/gpt2/src/huggingface.h, MoeSpec): the MoE
// families' feed-forward as a moe_config, and back for the export.
MoeConfig moe_config_from_spec(const gpt2::hf::MoeSpec& m) {
  MoeConfig c;
  c.num_experts = m.num_experts;
  c.top_k = m.top_k;
  c.moe_ffn_hidden = m.expert_hidden;
  c.score_function = "softmax";
  c.norm_topk_prob = m.norm_topk_prob;
  if (m.shared_hidden > 0) {
    c.num_shared_experts = 1;
    c.shared_expert_ffn_hidden_per_expert = m.shared_hidden;
    c.shared_expert_gate = m.shared_gate;
  }
  c.decoder_sparse_step = m.decoder_sparse_step;
  c.mlp_only_layers = m.mlp_only_layers;
  c.aux_loss_coef = m.aux_loss_coef;
  return c;
}

gpt2::HfFeedForward describe_for_huggingface(const MoeConfig& c, std::int64_t n_layer) {
  return [c, n_layer](gpt2::hf::DecoderSpec& spec) {
    std::vector<std::string> why;
    if (c.score_function != "softmax")
      why.push_back(fmt::format("score_function '{}' (they use softmax)", c.score_function));
    if (c.route_scale != 1.0) why.push_back(fmt::format("route_scale {} (they use 1)", c.route_scale));
    if (c.n_group > 1) why.push_back("group-limited routing (n_group > 1)");
    if (c.use_expert_bias) why.push_back("use_expert_bias (the auxiliary-loss-free selection bias)");
    if (c.capacity_factor) why.push_back("capacity_factor (they are dropless)");
    if (!why.empty())
      throw Error(
          fmt::format("model/gpt2_moe: moe_config has no counterpart in the transformers MoE families "
                      "(Mixtral, Qwen2-MoE, Qwen3-MoE): {}",
                      fmt::join(why, "; ")));
    gpt2::hf::MoeSpec m;
    m.num_experts = c.num_experts;
    m.top_k = c.top_k;
    m.expert_hidden = c.moe_ffn_hidden;
    m.norm_topk_prob = c.norm_topk_prob;
    m.shared_hidden = c.shared_hidden();
    m.shared_gate = c.shared_expert_gate;
    m.decoder_sparse_step = c.decoder_sparse_step;
    // first_k_dense_replace and mlp_only_layers as the one list transformers has.
    for (std::int64_t layer = 0; layer < n_layer; ++layer)
      if ((layer + 1) % c.decoder_sparse_step == 0 && !c.is_moe_layer(layer)) m.mlp_only_layers.push_back(layer);
    m.aux_loss_coef = c.aux_loss_coef;
    spec.moe = m;
  };
}

// model/gpt2_moe: model/gpt2's decoder `g` with the MoE blocks of `m`, on `device`.
std::shared_ptr<Module> make_gpt2_moe(const gpt2::GPT2Config& g, const MoeConfig& m, const c10::Device& device) {
  return gpt2::make_gpt2(g, device, moe_feed_forward(m, g.n_embd), m.aux_loss_key,
                         describe_for_huggingface(m, g.n_layer));
}

}  // namespace

void register_components(Registrar& r) {
  r.add<Module, Gpt2MoeConfig>(
      "gpt2_moe",
      "model/gpt2's decoder with Mixture-of-Experts blocks: top-k routing (softmax or sigmoid scores, normalized or "
      "not, scaled), stacked SwiGLU experts over tokens sorted by expert, optional (gated) shared experts, first k "
      "dense / every n-th / listed dense layers (Mixtral, Qwen2/3-MoE, DeepSeek-V3 style).",
      [](const Gpt2MoeConfig& c) {
        return make_gpt2_moe(c, c.moe_config,
                             c.use_meta_device.value_or(false) ? c10::Device(c10::kMeta) : run_device());
      });
  r.add<Module, gpt2::HuggingFacePretrainedConfig>(
      gpt2::kHuggingFaceMoeVariant,
      "A Hugging Face Mixture-of-Experts folder (Mixtral, Qwen2-MoE, Qwen3-MoE; safetensors) loaded into "
      "model/gpt2_moe, the experts stacked. model/huggingface_pretrained_model hands these families to it; its keys "
      "are that variant's.",
      [](const gpt2::HuggingFacePretrainedConfig& c) {
        return gpt2::load_huggingface(
            c, gpt2::read_huggingface_config(c),
            [](const gpt2::GPT2Config& g, const gpt2::hf::MoeSpec& spec, const c10::Device& device) {
              return make_gpt2_moe(g, moe_config_from_spec(spec), device);
            });
      });
  r.add<Optimizer, LoadBalancedConfig>(
      "moe_load_balanced",
      "Another optimizer, plus DeepSeek-V3's auxiliary-loss-free load balancing after each step: every MoE block's "
      "selection bias moves by expert_bias_update_rate towards the mean load (tokens per expert summed over the "
      "step's micro-batches and data-parallel ranks).",
      [](const LoadBalancedConfig& c) {
        std::shared_ptr<const DeviceMesh> mesh = c.device_mesh ? c.device_mesh->shared() : nullptr;
        return std::make_shared<LoadBalancedOptimizer>(c.optimizer.shared(), c.model.shared(),
                                                       c.expert_bias_update_rate,
                                                       ParallelDims::of(std::move(mesh), dist::world_size()));
      });
}

}  // namespace modalities::plugins::moe

MODALITIES_PLUGIN(moe, MODALITIES_PLUGIN_VERSION, modalities::plugins::moe::register_components)
