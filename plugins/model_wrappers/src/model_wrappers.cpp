// Model wrappers that return the same model (README.md). Activation checkpointing:
// `model/activation_checkpointed` (Modalities' ActivationCheckpointedModelConfig: full or
// selective-layer checkpointing of the blocks under `layers_fqn`) and
// `model/activation_checkpointed_fsdp1` (Modalities' FSDP1 variant: the submodules of the listed
// classes). And `model/compiled` (Note [model/compiled]). The first two return the model, its chosen blocks now run
// through checkpointed() (activation_checkpointing.h) by way of Module::add_block_runner, so they compose with
// any wrapper that forwards the runner (fsdp2_wrapped, fsdp1_wrapped) and any model that runs its
// blocks through ModuleHooks::around.
#include "activation_checkpointing.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/removable_handle.h>
#include <modalities/sdk/plugin.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace modalities::plugins::model_wrappers {
namespace {

constexpr const char* kFull = "full_activation_checkpointing";
constexpr const char* kSelectiveLayer = "selective_layer_activation_checkpointing";
constexpr const char* kSelectiveOp = "selective_op_activation_checkpointing";

struct AcFunParams {
  std::optional<std::int64_t> ac_freq;
  std::optional<std::vector<std::string>> save_ops_keys;
  static void describe(Schema<AcFunParams>& s) {
    s.field("ac_freq", &AcFunParams::ac_freq,
            "selective_layer: checkpoint every ac_freq-th block (blocks ac_freq-1, 2*ac_freq-1, ...).")
        .at_least(1);
    s.field("save_ops_keys", &AcFunParams::save_ops_keys,
            "selective_op: Modalities' keys of the ops whose outputs are kept (README.md: \"ops.aten.mm.default\" "
            "and \"ops.aten.max.default\" are taken; the attention and reduce-scatter keys are refused).");
  }
};

struct ActivationCheckpointedConfig {
  std::string ac_variant;
  std::string layers_fqn;
  Ref<Module> model;
  AcFunParams ac_fun_params;
  static void describe(Schema<ActivationCheckpointedConfig>& s) {
    using C = ActivationCheckpointedConfig;
    s.field("ac_variant", &C::ac_variant, "Which blocks are checkpointed.")
        .required()
        .one_of({kFull, kSelectiveLayer, kSelectiveOp});
    s.field("layers_fqn", &C::layers_fqn, "FQN of the blocks' container, e.g. \"transformer.h\".").required();
    s.field("model", &C::model, "The model (before sharding: apply activation checkpointing, then FSDP).")
        .required();
    s.field("ac_fun_params", &C::ac_fun_params,
            "{} for full; { ac_freq = k } for selective_layer; { save_ops_keys = [...] } for selective_op.");
  }
};

struct ActivationCheckpointedFsdp1Config {
  Ref<Module> model;
  std::vector<std::string> activation_checkpointing_modules;
  static void describe(Schema<ActivationCheckpointedFsdp1Config>& s) {
    using C = ActivationCheckpointedFsdp1Config;
    s.field("model", &C::model, "The FSDP1-wrapped model.").required();
    s.field("activation_checkpointing_modules", &C::activation_checkpointing_modules,
            "Class names whose submodules are checkpointed, e.g. [\"GPT2Block\"]; empty: nothing.");
  }
};

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
      throw ConfigError(where, "'ops._c10d_functional.reduce_scatter_tensor.default' is not supported: the "
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

std::shared_ptr<Module> activation_checkpointed(const ActivationCheckpointedConfig& c, BuildContext& ctx) {
  const std::shared_ptr<Module> model = c.model.shared();
  const std::vector<std::string> blocks = blocks_under(*model, c.layers_fqn);
  if (blocks.empty()) {
    const std::vector<std::string> all = model->block_fqns();
    throw ConfigError("layers_fqn",
                      fmt::format("'{}' holds none of the model's blocks ({})", c.layers_fqn,
                                  all.empty() ? std::string("it reports none")
                                              : fmt::format("\"{}\" ... \"{}\"", all.front(), all.back())));
  }
  const AcFunParams& p = c.ac_fun_params;
  std::vector<std::string> chosen;
  if (c.ac_variant == kFull) {
    if (p.ac_freq || p.save_ops_keys)
      throw ConfigError("ac_fun_params", "full_activation_checkpointing takes no parameters (ac_fun_params = {})");
    chosen = blocks;
  } else if (c.ac_variant == kSelectiveLayer) {
    if (!p.ac_freq) throw ConfigError("ac_fun_params.ac_freq", "selective_layer_activation_checkpointing needs ac_freq");
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
    model->add_block_runner(
        [save](const at::Tensor& input, const BlockFunction& run) { return selectively_checkpointed(input, run, save); },
        blocks);
    return model;
  }
  if (!chosen.empty()) model->add_block_runner(checkpointed, chosen);
  return model;
}

std::shared_ptr<Module> activation_checkpointed_fsdp1(const ActivationCheckpointedFsdp1Config& c, BuildContext& ctx) {
  const std::shared_ptr<Module> model = c.model.shared();
  std::vector<std::string> chosen;
  for (const std::string& cls : c.activation_checkpointing_modules) {
    const std::vector<std::string> found = model->submodules_of_class(cls);
    if (found.empty())
      ctx.warn(fmt::format("activation_checkpointing_modules: the model has no submodule of class '{}' (as in "
                           "Modalities, nothing is checkpointed for it)",
                           cls));
    chosen.insert(chosen.end(), found.begin(), found.end());
  }
  if (!chosen.empty()) model->add_block_runner(checkpointed, chosen);
  return model;
}

struct CompiledConfig {
  Ref<Module> model;
  std::vector<std::string> block_names;
  bool fullgraph = true;
  bool debug = false;
  static void describe(Schema<CompiledConfig>& s) {
    using C = CompiledConfig;
    s.field("model", &C::model, "The model.").required();
    s.field("block_names", &C::block_names,
            "Classes of the blocks Modalities compiles one by one; each must name submodules of the model.")
        .required();
    s.field("fullgraph", &C::fullgraph, "torch.compile's fullgraph (accepted, no effect here).");
    s.field("debug", &C::debug, "Compiler tracing (accepted, no effect here).");
  }
};

// Note [model/compiled]
// LibTorch has no torch.compile (no Dynamo, no Inductor). Modalities configs use model/compiled
// around their model, so it must build: it checks its fields as Modalities does (every block name
// must name submodules) and returns the model unchanged, saying so once. What the compiler would
// fuse, the bundled gpt2 does with its fused autograd ops (plugins/gpt2/README.md) compiled or not.
std::shared_ptr<Module> compiled(const CompiledConfig& c, BuildContext& ctx) {
  const std::shared_ptr<Module> model = c.model.shared();
  for (std::size_t i = 0; i < c.block_names.size(); ++i)
    if (model->submodules_of_class(c.block_names[i]).empty())
      throw ConfigError(fmt::format("block_names[{}]", i),
                        fmt::format("the model has no submodule of class '{}'", c.block_names[i]));
  ctx.warn("LibTorch has no torch.compile: model/compiled runs the model eager, as built (gpt2 uses its fused "
           "ops either way)");
  return model;
}

}  // namespace

void register_components(Registrar& r) {
  r.add<Module, ActivationCheckpointedConfig>(
      "activation_checkpointed",
      "Activation checkpointing of the model's blocks (full or every k-th); recomputed in backward with the same "
      "random state. Returns the same model; apply before fsdp2_wrapped.",
      activation_checkpointed);
  r.add<Module, ActivationCheckpointedFsdp1Config>(
      "activation_checkpointed_fsdp1",
      "Activation checkpointing of the submodules of the listed classes of an FSDP1-wrapped model. Returns the same "
      "model.",
      activation_checkpointed_fsdp1);
  r.add<Module, CompiledConfig>("compiled",
                                "Modalities' torch.compile wrapper. LibTorch has no compiler: returns the model "
                                "unchanged, with a notice (README.md).",
                                compiled);
}

}  // namespace modalities::plugins::model_wrappers

MODALITIES_PLUGIN(model_wrappers, MODALITIES_PLUGIN_VERSION,
                  modalities::plugins::model_wrappers::register_components)
