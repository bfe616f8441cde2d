// Which blocks activation checkpointing runs through checkpointed() (Modalities'
// ActivationCheckpointedModelConfig: ac_variant, layers_fqn, ac_fun_params), for
// model/activation_checkpointed and model/parallelized.
#include "activation_checkpointing.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/registrar.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <set>
#include <string>
#include <vector>

namespace modalities::plugins::model_wrappers {
namespace {

// Note [save_ops_keys]
// Modalities' keys name the PyTorch kernels whose outputs its selective checkpointing keeps. Here:
//   ops.aten.mm.default       -> the model's projection ops (gpt2: fused_linear, fused_qkv,
//                                fused_swiglu), under Modalities' every-second-mm policy
//                                (modalities/sdk/selective_checkpoint.h);
//   ops.aten.max.default      -> nothing: no op of a block computes a max (Modalities keeps it
//                                for float8 scaling, which neither side uses);
//   the two attention keys    -> refused: the attention is ATen's scaled_dot_product_attention,
//                                whose backward node needs its own saved statistics, so keeping
//                                its output would not spare its recomputation;
//   ops._c10d_functional.reduce_scatter_tensor.default -> refused: the tensor-parallel
//                                collectives are recomputed.
std::set<selective_checkpoint::Op> save_ops(const std::optional<std::vector<std::string>>& keys) {
  if (!keys || keys->empty())
    throw ConfigError("ac_fun_params.save_ops_keys",
                      "selective_op_activation_checkpointing needs save_ops_keys, e.g. [\"ops.aten.mm.default\"] "
                      "(Modalities refuses an empty list too)");
  std::set<selective_checkpoint::Op> save;
  for (std::size_t i = 0; i < keys->size(); ++i) {
    const std::string& key = (*keys)[i];
    const std::string where = fmt::format("ac_fun_params.save_ops_keys[{}]", i);
    if (key == "ops.aten.mm.default") {
      save.insert(selective_checkpoint::Op::kMatmul);
    } else if (key == "ops.aten.max.default") {
      // nothing computes it (Note [save_ops_keys])
    } else if (key == "ops.aten._scaled_dot_product_efficient_attention.default" ||
               key == "ops.aten._scaled_dot_product_flash_attention.default") {
      throw ConfigError(where, fmt::format("'{}' is not supported: the attention runs ATen's "
                                           "scaled_dot_product_attention, whose backward needs statistics of its own "
                                           "forward, so keeping its output would not spare its recomputation; remove "
                                           "the key (the attention is recomputed)",
                                           key));
    } else if (key == "ops._c10d_functional.reduce_scatter_tensor.default") {
      throw ConfigError(where,
                        "'ops._c10d_functional.reduce_scatter_tensor.default' is not supported: the "
                        "tensor-parallel collectives are recomputed; remove the key");
    } else {
      throw ConfigError(where, fmt::format("unknown key '{}': Modalities' keys are ops.aten.mm.default, "
                                           "ops.aten._scaled_dot_product_efficient_attention.default, "
                                           "ops.aten._scaled_dot_product_flash_attention.default, "
                                           "ops._c10d_functional.reduce_scatter_tensor.default and "
                                           "ops.aten.max.default",
                                           key));
    }
  }
  return save;
}

// The blocks of `model` under `container` ("transformer.h" -> "transformer.h.0", ...), in order.
std::vector<std::string> blocks_under(const Module& model, const std::string& container) {
  std::vector<std::string> out;
  for (const std::string& b : model.block_fqns())
    if (b.size() > container.size() && b.compare(0, container.size(), container) == 0 && b[container.size()] == '.' &&
        b.find('.', container.size() + 1) == std::string::npos)
      out.push_back(b);
  return out;
}

}  // namespace

void apply_activation_checkpointing(Module& model, const AcOptions& c, BuildContext& ctx) {
  const std::vector<std::string> blocks = blocks_under(model, c.layers_fqn);
  if (blocks.empty()) {
    const std::vector<std::string> all = model.block_fqns();
    throw ConfigError("layers_fqn",
                      fmt::format("'{}' holds none of the model's blocks ({})", c.layers_fqn,
                                  all.empty() ? std::string("it reports none")
                                              : fmt::format("\"{}\" ... \"{}\"", all.front(), all.back())));
  }
  const AcFunParams& p = c.ac_fun_params;
  std::vector<std::string> chosen;
  if (c.ac_variant == kFullActivationCheckpointing) {
    if (p.ac_freq || p.save_ops_keys)
      throw ConfigError("ac_fun_params", "full_activation_checkpointing takes no parameters (ac_fun_params = {})");
    chosen = blocks;
  } else if (c.ac_variant == kSelectiveLayerActivationCheckpointing) {
    if (!p.ac_freq)
      throw ConfigError("ac_fun_params.ac_freq", "selective_layer_activation_checkpointing needs ac_freq");
    if (p.save_ops_keys)
      throw ConfigError("ac_fun_params.save_ops_keys", "not a parameter of selective_layer_activation_checkpointing");
    // Modalities counts blocks with a process-wide counter that is never reset; per model here
    // (the same blocks for the first model a process wraps; README.md).
    for (std::size_t i = 0; i < blocks.size(); ++i)
      if ((static_cast<std::int64_t>(i) + 1) % *p.ac_freq == 0) chosen.push_back(blocks[i]);
    if (chosen.empty())
      ctx.warn(fmt::format("ac_freq {} is larger than the {} blocks under '{}': no block is checkpointed", *p.ac_freq,
                           blocks.size(), c.layers_fqn));
  } else {
    if (p.ac_freq)
      throw ConfigError("ac_fun_params.ac_freq", "not a parameter of selective_op_activation_checkpointing");
    const std::set<selective_checkpoint::Op> save = save_ops(p.save_ops_keys);
    // Every block, keeping the chosen ops' outputs (Modalities applies it to all layers).
    model.add_block_runner([save](const at::Tensor& input,
                                  const BlockFunction& run) { return selectively_checkpointed(input, run, save); },
                           blocks);
    return;
  }
  if (!chosen.empty()) model.add_block_runner(checkpointed, chosen);
}

}  // namespace modalities::plugins::model_wrappers
