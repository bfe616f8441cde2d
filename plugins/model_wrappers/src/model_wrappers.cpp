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

struct ActivationCheckpointedConfig {
  std::string ac_variant;
  std::string layers_fqn;
  Ref<Module> model;
  AcFunParams ac_fun_params;
  static void describe(Schema<ActivationCheckpointedConfig>& s) {
    using C = ActivationCheckpointedConfig;
    AcOptions::describe_fields(s);
    s.field("model", &C::model, "The model (before sharding: apply activation checkpointing, then FSDP).").required();
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

std::shared_ptr<Module> activation_checkpointed(const ActivationCheckpointedConfig& c, BuildContext& ctx) {
  apply_activation_checkpointing(*c.model, AcOptions::of(c), ctx);
  return c.model.shared();
}

std::shared_ptr<Module> activation_checkpointed_fsdp1(const ActivationCheckpointedFsdp1Config& c, BuildContext& ctx) {
  const std::shared_ptr<Module> model = c.model.shared();
  std::vector<std::string> chosen;
  for (const std::string& cls : c.activation_checkpointing_modules) {
    const std::vector<std::string> found = model->submodules_of_class(cls);
    if (found.empty())
      ctx.warn(
          fmt::format("activation_checkpointing_modules: the model has no submodule of class '{}' (as in "
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
  ctx.warn(
      "LibTorch has no torch.compile: model/compiled runs the model eager, as built (gpt2 uses its fused "
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

MODALITIES_PLUGIN(model_wrappers, MODALITIES_PLUGIN_VERSION, modalities::plugins::model_wrappers::register_components)
