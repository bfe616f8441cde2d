// The model-initializer interface: overwrites a model's parameters with a
// weight-initialization scheme (plain, scaled, Llama-3-like, ...), selected by
// parameter FQN. Used by `model/model_initialized`. Maps Modalities'
// ModelInitializationIF (`model_initialization/*`).
#pragma once

#include <modalities/sdk/export.h>

#include <string_view>

namespace modalities {

class Module;  // modalities/sdk/interfaces/module.h

/// Initializes the parameters of a Module in place.
///
/// Built once per run; called once per model part at build time, on the
/// building thread, after the part's storage exists on its final device and
/// Module::reset_parameters() has run. Must use the global torch RNG (seeded
/// by the run) so results are reproducible.
///
/// \code
///   model->reset_parameters();
///   initializer->initialize_in_place(*model);
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); the model is only
/// borrowed for the call.
/// Errors: throw modalities::Error (e.g. a rule matching no parameter, a
/// parameter matching two rules); never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API ModelInitializer {
 public:
  static constexpr std::string_view kInterface = "ModelInitializer";
  static constexpr std::string_view kComponentKey = "model_initialization";

  ModelInitializer() = default;
  ModelInitializer(const ModelInitializer&) = delete;
  ModelInitializer& operator=(const ModelInitializer&) = delete;
  virtual ~ModelInitializer();  // defined in the SDK library: one vtable, one typeinfo

  /// Overwrites the matching parameters of `model` (by canonical FQN from
  /// Module::named_parameters(); local shards under sharding), without
  /// recording autograd history.
  virtual void initialize_in_place(Module& model) const = 0;
};

}  // namespace modalities
