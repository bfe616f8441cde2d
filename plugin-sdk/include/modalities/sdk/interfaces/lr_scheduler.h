// The learning-rate scheduler interface: advances an optimizer's learning
// rates once per optimizer step and reports the rates it set. Maps
// torch.optim.lr_scheduler.LRScheduler as Modalities uses it (the `scheduler`
// variants), including the list form for pipeline parallelism.
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <string_view>
#include <vector>

namespace modalities {

/// Sets the optimizer's learning rates as a function of the step count.
///
/// Built once per run after the `optimizer` it references; construction
/// applies the rate for the initial step (as PyTorch does). The gym calls
/// step() from its one thread right after Optimizer::step(), and last_lrs()
/// at training-log steps ("lr mean"). With pipeline parallelism one
/// implementation may drive one scheduler per local optimizer (Modalities'
/// SchedulerList); last_lrs() then concatenates.
///
/// \code
///   optimizer->step();
///   scheduler->step();
///   double lr_mean = mean(scheduler->last_lrs());  // rate of the *next* step
/// \endcode
///
/// state_dict() is flat, with PyTorch's attribute names as keys and 0-dim or
/// 1-D tensors as values: "last_epoch" (int64, the important one on resume),
/// "_step_count" (int64), "base_lrs" and "_last_lr" (float64 [groups]), plus
/// variant-specific entries (e.g. "total_steps" for OneCycle). Composite
/// schedulers prefix their children's keys ("schedulers.0.last_epoch").
///
/// Ownership: the host owns the instance (std::shared_ptr); it holds a
/// shared_ptr to its optimizer.
/// Errors: throw modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API LRScheduler {
 public:
  static constexpr std::string_view kInterface = "LRScheduler";
  static constexpr std::string_view kComponentKey = "scheduler";

  LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;
  virtual ~LRScheduler();  // defined in the SDK library: one vtable, one typeinfo

  /// Advances by one step and writes the new rates into the optimizer.
  virtual void step() = 0;

  /// The rates set by the last step() (or by construction), one per
  /// optimizer group. PyTorch's get_last_lr().
  virtual std::vector<double> last_lrs() const = 0;

  /// Scheduler state; see the class comment for the keys.
  virtual StateDict state_dict() const = 0;

  /// Restores a state from state_dict() of the same variant. Does not touch
  /// the optimizer; its rates come back with the optimizer's own state.
  virtual void load_state_dict(const StateDict& state) = 0;
};

}  // namespace modalities
