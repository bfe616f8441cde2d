// The engine of model/model_initialized and of model/parallelized's `initialization`: a model
// built on the meta device gets storage on the run device, every parameter is reset, then the
// initializer runs, on whole tensors even when the model is sharded.
#pragma once

#include <string_view>

namespace modalities {
class BuildContext;
class Module;
class ModelInitializer;
}  // namespace modalities

namespace modalities::plugins::initialization {

/// Materializes `model` if it is on the meta device (all of it or none: a mix is an Error naming
/// `origin`), calls its reset_parameters() (a model without one keeps its constructor values,
/// with a warning through `ctx`, unless it was on meta), then `initializer`.
void materialize_and_initialize(Module& model, const ModelInitializer& initializer, std::string_view origin,
                                BuildContext& ctx);

}  // namespace modalities::plugins::initialization
