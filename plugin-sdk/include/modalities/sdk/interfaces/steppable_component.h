// The steppable-component interface: one unit of work (e.g. a forward, or a
// forward/backward/optimizer step on a synthetic batch) that the profiling
// command repeats under a profiler. Maps Modalities' SteppableComponentIF
// (`steppable_component/forward_pass`).
#pragma once

#include <modalities/sdk/export.h>

#include <string_view>

namespace modalities {

/// Something the profiling loop can advance by one step.
///
/// Built once per profiling run; step() is called from the profiling thread
/// once per profiler step, on every rank at the same time.
///
/// \code
///   profiler->enter();
///   for (std::int64_t i = 0; i < profiler->size(); ++i) {
///     component->step();
///     profiler->step();
///   }
///   profiler->exit();
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr).
/// Errors: throw modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API SteppableComponent {
 public:
  static constexpr std::string_view kInterface = "SteppableComponent";
  static constexpr std::string_view kComponentKey = "steppable_component";

  SteppableComponent() = default;
  SteppableComponent(const SteppableComponent&) = delete;
  SteppableComponent& operator=(const SteppableComponent&) = delete;
  virtual ~SteppableComponent();  // defined in the SDK library: one vtable, one typeinfo

  /// Performs one unit of work.
  virtual void step() = 0;
};

}  // namespace modalities
