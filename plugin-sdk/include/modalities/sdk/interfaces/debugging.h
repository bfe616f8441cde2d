// The debugging interface: a lifetime object for debug settings of a run. It
// holds the debug hooks attached to the model and, if asked, switches on
// deterministic algorithms; destroying it undoes both. Maps Modalities'
// Debugging (`debugging/settings`, placed under `settings.debugging`).
#pragma once

#include <modalities/sdk/export.h>

#include <string_view>

namespace modalities {

/// Debug state that exists exactly as long as the instance.
///
/// Built with the other components (its constructor applies the settings,
/// e.g. deterministic cuDNN/cuBLAS); nothing is called on it afterwards. The
/// host destroys it at the end of the run, on the building thread, after the
/// last forward/backward.
///
/// \code
///   {
///     std::shared_ptr<Debugging> debugging = settings.debugging;  // built: hooks on, determinism on
///     gym.run();
///   }  // last reference gone: hooks removed, previous determinism settings restored
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); it holds the
/// RemovableHandles it was given and removes them in its destructor.
/// Errors: the constructor throws modalities::Error; the destructor must not
/// throw. Never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API Debugging {
 public:
  static constexpr std::string_view kInterface = "Debugging";
  static constexpr std::string_view kComponentKey = "debugging";

  Debugging() = default;
  Debugging(const Debugging&) = delete;
  Debugging& operator=(const Debugging&) = delete;
  /// Implementations remove their hooks and restore the settings they changed.
  virtual ~Debugging();  // defined in the SDK library: one vtable, one typeinfo
};

}  // namespace modalities
