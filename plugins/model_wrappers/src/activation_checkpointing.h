// Activation checkpointing: which blocks (apply_activation_checkpointing, Modalities'
// ActivationCheckpointedModelConfig, in checkpoint_policy.cpp) and how one block is recomputed
// (LibTorch has no torch.utils.checkpoint, so checkpointed() is the autograd node that does it:
// Note [Recomputing a block] in activation_checkpointing.cpp). The engine of
// model/activation_checkpointed and of model/parallelized's `activation_checkpointing` table.
#pragma once

#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/schema.h>
#include <modalities/sdk/selective_checkpoint.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace modalities {
class BuildContext;
}  // namespace modalities

namespace modalities::plugins::model_wrappers {

/// run(input) without keeping its activations: under grad mode the block runs without autograd
/// and its output gets a node that, in backward, runs the block again (with the random state of
/// the first run, so dropout draws the same masks) and back-propagates through it. Without grad
/// mode just run(input). Usable as a BlockRunner.
at::Tensor checkpointed(const at::Tensor& input, const BlockFunction& run);

/// checkpointed() that keeps the outputs of the ops `save` names from the first run and reuses
/// them in the recomputation (Modalities' selective_op_activation_checkpointing;
/// modalities/sdk/selective_checkpoint.h). Gradients are those of the unchecked block, bit for bit.
at::Tensor selectively_checkpointed(const at::Tensor& input, const BlockFunction& run,
                                    const std::set<selective_checkpoint::Op>& save);

inline constexpr const char* kFullActivationCheckpointing = "full_activation_checkpointing";
inline constexpr const char* kSelectiveLayerActivationCheckpointing = "selective_layer_activation_checkpointing";
inline constexpr const char* kSelectiveOpActivationCheckpointing = "selective_op_activation_checkpointing";

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

/// Modalities' ActivationCheckpointedModelConfig without its model: flat in
/// model/activation_checkpointed's config, the `activation_checkpointing` table of
/// model/parallelized.
struct AcOptions {
  std::string ac_variant;
  std::string layers_fqn;
  AcFunParams ac_fun_params;

  /// Declares the three fields in the schema of a config C that has them.
  template <class C>
  static void describe_fields(Schema<C>& s) {
    s.field("ac_variant", &C::ac_variant, "Which blocks are checkpointed.")
        .required()
        .one_of({kFullActivationCheckpointing, kSelectiveLayerActivationCheckpointing,
                 kSelectiveOpActivationCheckpointing});
    s.field("layers_fqn", &C::layers_fqn, "FQN of the blocks' container, e.g. \"transformer.h\".").required();
    s.field("ac_fun_params", &C::ac_fun_params,
            "{} for full; { ac_freq = k } for selective_layer; { save_ops_keys = [...] } for selective_op.");
  }
  static void describe(Schema<AcOptions>& s) { describe_fields(s); }

  template <class C>
  static AcOptions of(const C& c) {
    return {c.ac_variant, c.layers_fqn, c.ac_fun_params};
  }
};

/// Makes the chosen blocks of `model` run through checkpointed() (or selectively_checkpointed())
/// by way of Module::add_block_runner. Throws ConfigError naming `layers_fqn` or `ac_fun_params.*`;
/// warns through `ctx` when no block is chosen.
void apply_activation_checkpointing(Module& model, const AcOptions& options, BuildContext& ctx);

}  // namespace modalities::plugins::model_wrappers
