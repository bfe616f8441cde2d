// The handle returned when something is attached to another component, most
// often a hook added with Module::add_hook. `model_debugging_hook/*` variants
// produce lists of them, and `debugging/settings` keeps them alive for the run
// and removes them at its end. Maps Modalities' torch.utils.hooks.RemovableHandle.
#pragma once

#include <modalities/sdk/export.h>

#include <string_view>

namespace modalities {

/// Detaches one previously attached hook (or other registration) on request.
///
/// remove() is called by the owner of the handle, typically Debugging's
/// destructor at the end of a run, on the thread that built the components,
/// never while a forward or backward pass is running.
///
/// \code
///   std::shared_ptr<RemovableHandle> h = model->add_hook(print_shapes, {});
///   model->forward(inputs);  // hook fires
///   h->remove();             // and no longer does
/// \endcode
///
/// Ownership: held by std::shared_ptr. A handle refers to its target weakly:
/// remove() after the target is gone is a no-op, and dropping the last
/// reference to a handle does *not* remove the hook (as in PyTorch), so hooks
/// can be fire-and-forget.
/// Errors: remove() is idempotent and must not throw.  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API RemovableHandle {
 public:
  static constexpr std::string_view kInterface = "RemovableHandle";
  static constexpr std::string_view kComponentKey = "model_debugging_hook";

  RemovableHandle() = default;
  RemovableHandle(const RemovableHandle&) = delete;
  RemovableHandle& operator=(const RemovableHandle&) = delete;
  virtual ~RemovableHandle();  // defined in the SDK library: one vtable, one typeinfo

  /// Detaches the hook. Second and later calls do nothing.
  virtual void remove() noexcept = 0;
};

}  // namespace modalities
