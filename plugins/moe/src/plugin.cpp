// The moe plugin (README.md): model/gpt2_moe, model/gpt2's decoder with Mixture-of-Experts
// feed-forward blocks (moe.h) in the layers its moe_config selects. Built against the SDK and
// gpt2's engine (make_gpt2 with a FeedForwardFactory, plugins/gpt2/src/layers.h); nothing in core
// knows it.
#include "config.h"  // plugins/gpt2
#include "model.h"   // plugins/gpt2: make_gpt2
#include "moe.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/run_context.h>

#include <fmt/format.h>

#include <cstdint>
#include <memory>

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

}  // namespace

void register_components(Registrar& r) {
  r.add<Module, Gpt2MoeConfig>(
      "gpt2_moe",
      "model/gpt2's decoder with Mixture-of-Experts blocks: top-k routing (softmax or sigmoid scores, normalized or "
      "not, scaled), stacked SwiGLU experts over tokens sorted by expert, optional (gated) shared experts, first k "
      "dense / every n-th / listed dense layers (Mixtral, Qwen2/3-MoE, DeepSeek-V3 style).",
      [](const Gpt2MoeConfig& c) {
        return gpt2::make_gpt2(c, c.use_meta_device.value_or(false) ? c10::Device(c10::kMeta) : run_device(),
                               moe_feed_forward(c.moe_config, c.n_embd), c.moe_config.aux_loss_key);
      });
}

}  // namespace modalities::plugins::moe

MODALITIES_PLUGIN(moe, MODALITIES_PLUGIN_VERSION, modalities::plugins::moe::register_components)
