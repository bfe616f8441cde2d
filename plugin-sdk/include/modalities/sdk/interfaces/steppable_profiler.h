// The steppable-profiler interface: a profiler with an explicit active region
// (enter/exit) that advances once per micro-batch and says how many steps it
// wants (kernel traces, CUDA memory snapshots, or nothing). Maps Modalities'
// SteppableProfilerIF (`steppable_profiler/*`).
#pragma once

#include <modalities/sdk/export.h>

#include <cstdint>
#include <string_view>

namespace modalities {

/// A profiler driven by the training or profiling loop.
///
/// Built once per run. The loop calls, on its thread: enter() once before the
/// first micro-batch, step() after every micro-batch, exit() once after the
/// last (also when the loop ends early; not while an exception is unwinding).
/// Python's context manager becomes this explicit pair, because exit() may
/// write files and fail, which a destructor must not do.
///
/// \code
///   profiler->enter();
///   for (std::int64_t i = 0; i < num_micro_batches; ++i) {
///     train_one(i);
///     profiler->step();
///   }
///   profiler->exit();  // writes the trace / snapshot
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); composites hold
/// shared_ptrs to their children.
/// Errors: exit() before the configured steps are done throws
/// modalities::Error for variants that need them all; never exit() the
/// process.  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API SteppableProfiler {
 public:
  static constexpr std::string_view kInterface = "SteppableProfiler";
  static constexpr std::string_view kComponentKey = "steppable_profiler";

  SteppableProfiler() = default;
  SteppableProfiler(const SteppableProfiler&) = delete;
  SteppableProfiler& operator=(const SteppableProfiler&) = delete;
  virtual ~SteppableProfiler();  // defined in the SDK library: one vtable, one typeinfo

  /// Starts the profiled region.
  virtual void enter() = 0;

  /// Marks the end of one step (micro-batch).
  virtual void step() = 0;

  /// Ends the region and writes any output.
  virtual void exit() = 0;

  /// Number of steps it wants to see (wait + warmup + active), or -1 when it
  /// does not care (`no_profiler`). The profiling command runs this many steps.
  virtual std::int64_t size() const = 0;
};

}  // namespace modalities
