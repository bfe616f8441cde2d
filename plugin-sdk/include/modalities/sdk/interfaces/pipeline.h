// The pipeline interfaces: a pipeline-parallel model as this rank sees it
// (its stages and model parts) and the schedule that runs forward and backward
// over pipeline micro-batches. LibTorch has no pipelining runtime, so both are
// the SDK's own. Map Modalities' Pipeline and the PyTorch schedule objects
// (`pipeline/staged`, `pipeline/scheduled`, `pipeline/builder`, `pipeline/selector`).
#pragma once

#include <modalities/sdk/export.h>

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string_view>
#include <vector>

namespace modalities {

class Module;         // modalities/sdk/interfaces/module.h
class PipelineStage;  // modalities/sdk/interfaces/pipeline_stage.h

/// Runs one training or evaluation step of a pipeline over its micro-batches.
///
/// Built by `pipeline/scheduled` and attached to a Pipeline. The gym calls
/// step() (training) or eval() once per local micro-batch, on its thread, on
/// every pipeline rank at the same time (point-to-point communication between
/// stages). Modalities types schedules as Pipeline in configs
/// (`pipeline/builder.pp_schedule`); here they have their own interface.
///
/// \code
///   std::optional<at::Tensor> in, target;
///   if (pipeline->has_first_stage()) in = batch.samples.at(sample_key).contiguous();
///   if (pipeline->has_last_stage()) target = batch.targets.at(loss->target_key());
///   std::vector<at::Tensor> losses = pipeline->schedule()->step(in, target);
/// \endcode
///
/// Ownership: held by std::shared_ptr (the Pipeline and the config graph); it
/// holds shared_ptrs to its stages and loss.
/// Errors: throw modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API PipelineSchedule {
 public:
  static constexpr std::string_view kInterface = "PipelineSchedule";
  static constexpr std::string_view kComponentKey = "pipeline";

  PipelineSchedule() = default;
  PipelineSchedule(const PipelineSchedule&) = delete;
  PipelineSchedule& operator=(const PipelineSchedule&) = delete;
  virtual ~PipelineSchedule();  // defined in the SDK library: one vtable, one typeinfo

  /// Forward and backward of all pipeline micro-batches of one local batch.
  /// `input` is required on ranks holding the first stage, `target` on ranks
  /// holding the last; elsewhere pass std::nullopt. Returns one 0-dim loss per
  /// pipeline micro-batch on last-stage ranks, nothing elsewhere. Gradients
  /// are accumulated (scaled by 1 / number of micro-batches).
  virtual std::vector<at::Tensor> step(const std::optional<at::Tensor>& input,
                                       const std::optional<at::Tensor>& target) = 0;

  /// Same without backward (call under no-grad), for evaluation.
  virtual std::vector<at::Tensor> eval(const std::optional<at::Tensor>& input,
                                       const std::optional<at::Tensor>& target) = 0;

  /// Scales the gradients of following step()s (the gym's 1 / gradient accumulation steps, so a
  /// step's gradient is that of the mean loss over all its micro-batches). Default 1.
  virtual void set_loss_scale(double scale) = 0;

  /// Tensors every stage's forward receives next to its input in the following step()s and
  /// eval()s, under their keys, each split into the pipeline micro-batches along dim 0 like the
  /// input: what the model's every part needs of the sample besides the first stage's input (the
  /// collator's document ids, for attention inside documents). The gym passes the batch's
  /// samples other than the model's sample_key on every pipeline rank. Default: throws
  /// modalities::Error for a non-empty map (the schedule cannot pass them on). Since: SDK 0.1
  /// (ABI 9).
  virtual void set_stage_inputs(TensorMap inputs);
};

/// A pipeline-parallel model: this rank's stages and parts, and its schedule.
///
/// Built by `pipeline/staged` (no schedule yet), completed by
/// `pipeline/scheduled` (set_schedule on the same object) or assembled by
/// `pipeline/builder` from stages and parts that were wrapped meanwhile. The
/// gym reads it on its thread; accessors are const and thread-safe.
///
/// \code
///   for (const auto& part : pipeline->model_parts()) part->train(true);
///   auto losses = pipeline->schedule()->step(in, target);
///   if (pipeline->has_last_stage()) loss = at::stack(losses).mean();
/// \endcode
///
/// Ownership: held by std::shared_ptr; it holds shared_ptrs to its stages,
/// parts and schedule.
/// Errors: throw modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API Pipeline {
 public:
  static constexpr std::string_view kInterface = "Pipeline";
  static constexpr std::string_view kComponentKey = "pipeline";

  Pipeline() = default;
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;
  virtual ~Pipeline();  // defined in the SDK library: one vtable, one typeinfo

  /// This rank's stages, in increasing stage index.
  virtual std::vector<std::shared_ptr<PipelineStage>> stages() const = 0;

  /// The modules of those stages, same order.
  virtual std::vector<std::shared_ptr<Module>> model_parts() const = 0;

  /// The attached schedule, or nullptr before `pipeline/scheduled` ran.
  virtual std::shared_ptr<PipelineSchedule> schedule() const = 0;

  /// Attaches (or replaces) the schedule. Build-time only.
  virtual void set_schedule(std::shared_ptr<PipelineSchedule> schedule) = 0;

  /// Whether this rank holds stage 0 / the last stage.
  virtual bool has_first_stage() const = 0;
  virtual bool has_last_stage() const = 0;
};

}  // namespace modalities
