// The checkpoint-saving-strategy interface: decides, at a checkpointing
// opportunity, whether to save and which earlier checkpoints to delete (e.g.
// keep the k most recent). Maps Modalities' CheckpointSavingStrategyIF
// (`checkpoint_saving_strategy/*`).
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <string_view>

namespace modalities {

/// Turns training progress into a CheckpointingInstruction.
///
/// Built once per run. CheckpointSaving calls checkpoint_instruction() on the
/// gym thread at each checkpointing opportunity, on every rank, so every rank
/// must decide the same way. Stateful: it may remember what it told to save
/// (only checkpoints of the current run, never those of a previous one).
///
/// \code
///   CheckpointingInstruction ins = strategy->checkpoint_instruction(progress, nullptr, false);
///   execution->run_checkpoint_instruction(ins, progress, *app_state);
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); arguments are
/// borrowed for the call.
/// Errors: throw modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API CheckpointSavingStrategy {
 public:
  static constexpr std::string_view kInterface = "CheckpointSavingStrategy";
  static constexpr std::string_view kComponentKey = "checkpoint_saving_strategy";

  CheckpointSavingStrategy() = default;
  CheckpointSavingStrategy(const CheckpointSavingStrategy&) = delete;
  CheckpointSavingStrategy& operator=(const CheckpointSavingStrategy&) = delete;
  virtual ~CheckpointSavingStrategy();  // defined in the SDK library: one vtable, one typeinfo

  /// What to do now. `evaluation_result` may be nullptr (it always is today);
  /// `early_stopping_criterion_fulfilled` is false today.
  virtual CheckpointingInstruction checkpoint_instruction(const TrainingProgress& progress,
                                                          const EvaluationResultBatch* evaluation_result,
                                                          bool early_stopping_criterion_fulfilled) = 0;
};

}  // namespace modalities
