// The app-state interface: bundles what a checkpoint saves and restores (the
// model parts, the optimizer, the optional LR scheduler) behind one flat state
// dict, and remembers whether it was already loaded. Maps Modalities' AppState
// (`app_state/raw`, `app_state/dcp`).
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <memory>
#include <string_view>
#include <vector>

namespace modalities {

class LRScheduler;  // modalities/sdk/interfaces/lr_scheduler.h
class Module;       // modalities/sdk/interfaces/module.h
class Optimizer;    // modalities/sdk/interfaces/optimizer.h

/// The trainable state of a run, as one unit.
///
/// Built once per run after model, optimizer and scheduler. Checkpoint
/// executions call state_dict() and checkpoint loaders load_state_dict(), on
/// the gym/building thread, on every rank at the same time (sharded state may
/// need collectives). The gym reads model_parts() to switch train/eval mode.
///
/// state_dict() keys: "model.<fqn>" (union over model parts; FQNs must be
/// unique across parts), "optimizer.<key>" (Note [Optimizer state dict
/// keys]) and, when a scheduler exists, "lr_scheduler.<key>". A checkpoint
/// writer may nest this under "app." on disk, as Modalities' DCP checkpoints do.
///
/// \code
///   StateDict sd = app_state->state_dict();
///   write_checkpoint(folder, sd);
///   ...
///   app_state->load_state_dict(read_checkpoint(folder));  // once only
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); it holds
/// shared_ptrs to its parts, optimizer and scheduler.
/// Errors: throw modalities::Error (e.g. a second load); never exit().
/// Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API AppState {
 public:
  static constexpr std::string_view kInterface = "AppState";
  static constexpr std::string_view kComponentKey = "app_state";

  AppState() = default;
  AppState(const AppState&) = delete;
  AppState& operator=(const AppState&) = delete;
  virtual ~AppState();  // defined in the SDK library: one vtable, one typeinfo

  /// The model parts (one unless pipeline parallelism gives several local stages).
  virtual std::vector<std::shared_ptr<Module>> model_parts() const = 0;

  virtual std::shared_ptr<Optimizer> optimizer() const = 0;

  /// The scheduler, or nullptr when the run has none.
  virtual std::shared_ptr<LRScheduler> lr_scheduler() const = 0;

  /// Everything to checkpoint; see the class comment for the keys.
  virtual StateDict state_dict() const = 0;

  /// Restores model parts (non-strict per part, so each part takes its own
  /// keys), optimizer and scheduler. Throws modalities::Error when called a
  /// second time.
  virtual void load_state_dict(const StateDict& state) = 0;

  /// Whether load_state_dict() has run.
  virtual bool is_loaded() const = 0;
};

}  // namespace modalities
