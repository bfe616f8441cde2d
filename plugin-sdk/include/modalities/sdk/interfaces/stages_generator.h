// The stages-generator interface: splits a model into pipeline stages, as
// lists of module FQNs per stage, balancing an estimated compute weight.
// Used by `pipeline/staged`. Maps Modalities' StagesGenerator
// (`stages_generator/gpt2_stages_generator`).
#pragma once

#include <modalities/sdk/export.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace modalities {

/// Decides which modules belong to which pipeline stage.
///
/// Built once per run; stages() is a pure function of its arguments and the
/// generator's config, called at build time by the pipeline builder.
///
/// \code
///   auto stages = gen->stages(/*num_layers_per_stage=*/2, /*pp_degree=*/2);
///   // {{"transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0"},
///   //  {"transformer.h.1", "transformer.lm_head_norm", "transformer.lm_head"}}
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr).
/// Errors: a stage count not divisible by pp_degree, or a split point heavier
/// than a stage, throws modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API StagesGenerator {
 public:
  static constexpr std::string_view kInterface = "StagesGenerator";
  static constexpr std::string_view kComponentKey = "stages_generator";

  StagesGenerator() = default;
  StagesGenerator(const StagesGenerator&) = delete;
  StagesGenerator& operator=(const StagesGenerator&) = delete;
  virtual ~StagesGenerator();  // defined in the SDK library: one vtable, one typeinfo

  /// Module FQNs of every stage, stage 0 first (all stages, not only this rank's).
  virtual std::vector<std::vector<std::string>> stages(std::int64_t num_layers_per_stage,
                                                       std::int64_t pp_degree) const = 0;
};

}  // namespace modalities
