// The pipeline-stage interface: one stage of a pipeline-parallel model held by
// this rank, i.e. a model part plus its place in the stage sequence. Schedules
// are built from lists of them. LibTorch has no pipelining runtime, so this is
// the SDK's own. Maps torch.distributed.pipelining.PipelineStage as Modalities
// uses it (`pipeline/selector` with PP_STAGE, `pipeline/builder`).
#pragma once

#include <modalities/sdk/export.h>

#include <cstdint>
#include <memory>
#include <string_view>

namespace modalities {

class Module;  // modalities/sdk/interfaces/module.h

/// One local pipeline stage: its index, its neighbours' existence and its module.
///
/// Created at build time by a pipeline builder; queried by schedule
/// construction and the gym (first stage feeds inputs, last computes the
/// loss). All methods are const and thread-safe; running the stage is the
/// schedule's business.
///
/// \code
///   for (const auto& st : pipeline->stages())
///     if (st->is_last()) loss_owner = true;
/// \endcode
///
/// Ownership: held by std::shared_ptr (pipeline and schedule share it); it
/// holds a shared_ptr to its model part.
/// Errors: throw modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API PipelineStage {
 public:
  static constexpr std::string_view kInterface = "PipelineStage";
  static constexpr std::string_view kComponentKey = "pipeline";

  PipelineStage() = default;
  PipelineStage(const PipelineStage&) = delete;
  PipelineStage& operator=(const PipelineStage&) = delete;
  virtual ~PipelineStage();  // defined in the SDK library: one vtable, one typeinfo

  /// Whether this is stage 0 (receives the model inputs).
  virtual bool is_first() const = 0;

  /// Whether this is the last stage (produces the predictions and the loss).
  virtual bool is_last() const = 0;

  /// This stage's index in [0, num_stages()).
  virtual std::int64_t stage_index() const = 0;

  /// Number of stages over all pipeline ranks.
  virtual std::int64_t num_stages() const = 0;

  /// The model part this stage runs.
  virtual std::shared_ptr<Module> submodule() const = 0;
};

}  // namespace modalities
