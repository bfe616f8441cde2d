// The checkpoint-saving-execution interface: writes the app state in one
// checkpoint format and deletes old checkpoints of that format. It names
// checkpoints by training progress (eid_<id>-seen_steps_<n>-...). Maps
// Modalities' CheckpointSavingExecutionABC (`checkpoint_saving_execution/*`).
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <string_view>

namespace modalities {

class AppState;  // modalities/sdk/interfaces/app_state.h

/// Carries out a CheckpointingInstruction for one on-disk format.
///
/// Built once per run. CheckpointSaving calls run_checkpoint_instruction() on
/// the gym thread, on every rank at the same time (saving may gather sharded
/// state and ends with a barrier). Implementations provide save() and
/// delete_checkpoint(); the SDK's run_checkpoint_instruction() saves first,
/// then deletes each listed checkpoint, like Modalities' base class.
///
/// \code
///   void save(AppState& app, const TrainingProgress& p) override {
///     write_format(folder_for(p), app.state_dict());  // then last_checkpoint_info.json
///   }
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); the app state is
/// borrowed for the call.
/// Errors: I/O failures and deleting a checkpoint that does not exist throw
/// modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API CheckpointSavingExecution {
 public:
  static constexpr std::string_view kInterface = "CheckpointSavingExecution";
  static constexpr std::string_view kComponentKey = "checkpoint_saving_execution";

  CheckpointSavingExecution() = default;
  CheckpointSavingExecution(const CheckpointSavingExecution&) = delete;
  CheckpointSavingExecution& operator=(const CheckpointSavingExecution&) = delete;
  virtual ~CheckpointSavingExecution();  // defined in the SDK library: one vtable, one typeinfo

  /// Saves if instruction.save_current, then deletes every listed checkpoint.
  /// Default in the SDK library; override only to change that order.
  virtual void run_checkpoint_instruction(const CheckpointingInstruction& instruction, const TrainingProgress& progress,
                                          AppState& app_state);

  /// Writes the checkpoint named after `progress`.
  virtual void save(AppState& app_state, const TrainingProgress& progress) = 0;

  /// Removes the checkpoint named after `progress` (Modalities' delete()).
  virtual void delete_checkpoint(const TrainingProgress& progress) = 0;
};

}  // namespace modalities
