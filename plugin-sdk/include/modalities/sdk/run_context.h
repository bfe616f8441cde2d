// Process-wide facts of the current run that components need but cannot get
// from their config: the device the run computes on and the plugins loaded
// (recorded in checkpoint manifests). The host sets them once before building
// a config; plugins only read them.
#pragma once

#include <modalities/sdk/export.h>

#include <c10/core/Device.h>

#include <map>
#include <string>
#include <string_view>

namespace modalities {

/// The device of this process's model and batches. Chosen by the host from
/// `settings.device` or MODALITIES_DEVICE ("cpu", "cuda", "cuda:1"); when
/// neither is given: cuda:<LOCAL_RANK> if CUDA is available, else cpu.
/// Components that allocate on the run device (e.g. `model/model_initialized`
/// materializing a meta-device model) use this.
MODALITIES_SDK_API c10::Device run_device();

/// Sets the run device (host only). Throws modalities::Error for a CUDA device
/// when CUDA is not available.
MODALITIES_SDK_API void set_run_device(const c10::Device& device);

/// Parses "cpu", "cuda", "cuda:N" or "auto" (the default rule above) and
/// checks availability. `what` names the source in errors ("settings.device").
MODALITIES_SDK_API c10::Device parse_run_device(std::string_view text, std::string_view what);

/// Loaded plugins, name -> version (set by the host after loading).
MODALITIES_SDK_API const std::map<std::string, std::string>& loaded_plugin_versions();
MODALITIES_SDK_API void set_loaded_plugin_versions(std::map<std::string, std::string> versions);

}  // namespace modalities
