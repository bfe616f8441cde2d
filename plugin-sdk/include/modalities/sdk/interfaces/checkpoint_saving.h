// The checkpoint-saving interface: the single entry point the gym calls when a
// checkpoint may be due; it combines a strategy (whether/what to delete) with
// an execution (the on-disk format). Maps Modalities' CheckpointSaving
// (`checkpoint_saving/default`).
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <string_view>

namespace modalities {

class AppState;  // modalities/sdk/interfaces/app_state.h

/// Saves (and prunes) checkpoints when asked by the gym.
///
/// Built once per run. The gym calls save_checkpoint() on its thread, on every
/// rank at the same time, whenever num_seen_steps_total is a positive multiple
/// of the checkpointing interval (including right after a warm start).
///
/// \code
///   if (s > 0 && s % checkpointing_interval == 0)
///     checkpoint_saving->save_checkpoint(progress, nullptr, *app_state, false);
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); it holds
/// shared_ptrs to its strategy and execution; arguments are borrowed.
/// Errors: throw modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API CheckpointSaving {
 public:
  static constexpr std::string_view kInterface = "CheckpointSaving";
  static constexpr std::string_view kComponentKey = "checkpoint_saving";

  CheckpointSaving() = default;
  CheckpointSaving(const CheckpointSaving&) = delete;
  CheckpointSaving& operator=(const CheckpointSaving&) = delete;
  virtual ~CheckpointSaving();  // defined in the SDK library: one vtable, one typeinfo

  /// Asks the strategy for an instruction and lets the execution carry it
  /// out. `evaluation_result` may be nullptr (it always is today).
  virtual void save_checkpoint(const TrainingProgress& progress, const EvaluationResultBatch* evaluation_result,
                               AppState& app_state, bool early_stopping_criterion_fulfilled) = 0;
};

}  // namespace modalities
