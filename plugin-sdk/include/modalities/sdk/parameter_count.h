// The number of trainable parameters of a model, as the training report and the MFU calculators
// count it (one definition for both).
#pragma once

#include <modalities/sdk/export.h>

#include <cstdint>
#include <vector>

namespace modalities {

class DeviceMesh;
class Module;

/// Elements of the parameters that require a gradient, over all `parts`, each tensor once (a tied
/// matrix is one parameter), at its global size: a sharded parameter counts its whole tensor
/// (Module::shard_placements), so every rank and every world size gives the same number.
/// Since: SDK 0.1 (ABI 4).
MODALITIES_SDK_API std::int64_t count_trainable_parameters(const std::vector<const Module*>& parts);

/// The same for a pipeline rank: with a `mesh` whose `pp` dim is > 1, `parts` are this rank's
/// stages and the whole model's count is their sum over the pp group (a collective on that group:
/// every rank calls it at the same point). Otherwise count_trainable_parameters(parts).
/// Since: SDK 0.1 (ABI 5).
MODALITIES_SDK_API std::int64_t count_trainable_parameters(const std::vector<const Module*>& parts,
                                                           const DeviceMesh* mesh);

/// The parameters one token computes with: count_trainable_parameters with each tensor weighted
/// by its share in Module::parameter_activity (a MoE block's routed experts: top_k / num_experts;
/// shared experts, the router and the dense layers whole), rounded; summed over the pp group
/// like count_trainable_parameters (a collective there). What MFU counts. Since: SDK 0.1 (ABI 7).
MODALITIES_SDK_API std::int64_t count_active_parameters(const std::vector<const Module*>& parts,
                                                        const DeviceMesh* mesh);

}  // namespace modalities
