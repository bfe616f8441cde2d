// The checkpoint-loading interfaces: restoring training state written by a
// checkpoint execution. CheckpointLoading reads single files (a model state
// dict, an optimizer state dict; FSDP1-style or plain), DistributedCheckpointLoading
// reads a checkpoint folder into a whole AppState. Map Modalities'
// FSDP1CheckpointLoadingIF and DistributedCheckpointLoadingIF (`checkpoint_loading/*`).
#pragma once

#include <modalities/sdk/export.h>

#include <filesystem>
#include <memory>
#include <string_view>

namespace modalities {

class AppState;   // modalities/sdk/interfaces/app_state.h
class Module;     // modalities/sdk/interfaces/module.h
class Optimizer;  // modalities/sdk/interfaces/optimizer.h

/// Loads a model file, and an optimizer file, written for one model.
///
/// Built once per run; used at build time by `model/fsdp1_checkpointed` and
/// `optimizer/fsdp1_checkpointed`, on the building thread, on every rank at
/// the same time (a loader may read on rank 0 and broadcast or scatter).
///
/// \code
///   std::shared_ptr<Module> m = loading->load_model_checkpoint(model, info.model_checkpoint_path);
///   loading->load_optimizer_checkpoint(*optimizer, *m, info.optimizer_checkpoint_path);
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr). The returned
/// Module may be `model` itself or a new wrapper around it; callers must use
/// the returned one.
/// Errors: missing/corrupt files, key or shape mismatches and unsupported
/// operations (the `torch` variant has no optimizer loading) throw
/// modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API CheckpointLoading {
 public:
  static constexpr std::string_view kInterface = "CheckpointLoading";
  static constexpr std::string_view kComponentKey = "checkpoint_loading";

  CheckpointLoading() = default;
  CheckpointLoading(const CheckpointLoading&) = delete;
  CheckpointLoading& operator=(const CheckpointLoading&) = delete;
  virtual ~CheckpointLoading();  // defined in the SDK library: one vtable, one typeinfo

  /// Loads the model state dict in `file` into `model` and returns the model
  /// to use from now on (possibly wrapped, e.g. sharded after loading).
  virtual std::shared_ptr<Module> load_model_checkpoint(std::shared_ptr<Module> model,
                                                        const std::filesystem::path& file) = 0;

  /// Loads the optimizer state in `file` into `optimizer`, in place. `model`
  /// is the (wrapped) model the optimizer was built on, for FQN mapping.
  virtual void load_optimizer_checkpoint(Optimizer& optimizer, Module& model, const std::filesystem::path& file) = 0;
};

/// Loads a checkpoint folder (every rank reads its shards) into an AppState.
///
/// Built once per run; `app_state/dcp` creates or receives one and calls
/// load_checkpoint() at build time, on every rank at the same time.
///
/// \code
///   loading->load_checkpoint(*app_state, info.checkpoint_folder_path);
///   assert(app_state->is_loaded());
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); the app state is
/// borrowed for the call.
/// Errors: throw modalities::Error (missing folder, format version, an app
/// state that was already loaded); never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API DistributedCheckpointLoading {
 public:
  static constexpr std::string_view kInterface = "DistributedCheckpointLoading";
  static constexpr std::string_view kComponentKey = "checkpoint_loading";

  DistributedCheckpointLoading() = default;
  DistributedCheckpointLoading(const DistributedCheckpointLoading&) = delete;
  DistributedCheckpointLoading& operator=(const DistributedCheckpointLoading&) = delete;
  virtual ~DistributedCheckpointLoading();  // defined in the SDK library: one vtable, one typeinfo

  /// Restores model parts, optimizer and scheduler of `app_state` from
  /// `checkpoint_dir`, in place (via AppState::load_state_dict).
  virtual void load_checkpoint(AppState& app_state, const std::filesystem::path& checkpoint_dir) = 0;
};

}  // namespace modalities
