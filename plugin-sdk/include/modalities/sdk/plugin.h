// The plugin entry point. Each plugin .so declares itself with
//
//   MODALITIES_PLUGIN(optimizer_adamw, MODALITIES_PLUGIN_VERSION, modalities::plugins::adamw::register_components)
// (MODALITIES_PLUGIN_VERSION: the VERSION given to modalities_add_plugin in CMake, its one source.)
//
// which emits two symbols:
//   * `modalities_plugin_<name>_descriptor`: plain constant data in the ELF
//     section ".modalities_plugin" (SDK ABI version, SDK and LibTorch versions,
//     C++ ABI flag, compiler, CUDA on/off). The host reads it from the file
//     *before* dlopen, so a mismatching plugin is refused before any of its
//     code — static initialisers included — runs.
//   * `modalities_plugin_<name>_register`: a C function that calls the
//     register function with the host's Registrar. Nothing escapes it: every
//     exception becomes an error status with its message.
// Registration is an ordinary function call, never static-initialiser work.
#pragma once

#include <modalities/sdk/build_info.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/export.h>
#include <modalities/sdk/registrar.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>

extern "C" {

/// Layout of the descriptor. Fixed-size fields only: the host parses it out
/// of the ELF file without loading the library. Changing it bumps
/// MODALITIES_PLUGIN_ABI_VERSION and kModalitiesDescriptorLayout.
struct modalities_plugin_descriptor {
  char magic[16];             // "MODALITIES_PLUG" + NUL
  std::uint32_t layout;       // layout version of this struct (1)
  std::uint32_t abi_version;  // MODALITIES_PLUGIN_ABI_VERSION the plugin was built with
  char name[64];              // plugin name; also names the register symbol
  char version[32];           // plugin's own version
  char sdk_version[32];       // MODALITIES_SDK_VERSION
  char torch_version[32];     // LibTorch version of the SDK build
  char compiler[32];          // "gcc 12": compiler family and major version
  std::uint32_t cxx11_abi;    // _GLIBCXX_USE_CXX11_ABI
  std::uint32_t with_cuda;    // SDK built with CUDA
};

/// Signature of `modalities_plugin_<name>_register`. Returns 0 on success;
/// otherwise writes a NUL-terminated message into `error` (at most `error_size` bytes).
typedef int (*modalities_plugin_register_fn)(void* registrar, char* error, std::size_t error_size);
}

#define MODALITIES_PLUGIN_SECTION ".modalities_plugin"
#define MODALITIES_PLUGIN_MAGIC "MODALITIES_PLUG"
#define MODALITIES_DESCRIPTOR_LAYOUT 1u

#define MODALITIES_STRINGIFY_IMPL(x) #x
#define MODALITIES_STRINGIFY(x) MODALITIES_STRINGIFY_IMPL(x)

#if defined(__clang__)
#define MODALITIES_COMPILER_ID "clang " MODALITIES_STRINGIFY(__clang_major__)
#elif defined(__GNUC__)
#define MODALITIES_COMPILER_ID "gcc " MODALITIES_STRINGIFY(__GNUC__)
#else
#define MODALITIES_COMPILER_ID "unknown"
#endif

#if defined(_GLIBCXX_USE_CXX11_ABI)
#define MODALITIES_CXX11_ABI _GLIBCXX_USE_CXX11_ABI
#else
#define MODALITIES_CXX11_ABI 0
#endif

namespace modalities::detail {

/// Text of the plugin's configs/example.toml, embedded by
/// modalities_add_plugin(... EXAMPLE_CONFIG ...); null when the plugin ships none.
/// Weak: the generated example TU provides the strong definition, and a
/// plugin without an example links against this null default.
__attribute__((weak)) const char* plugin_example_config = nullptr;

inline int invoke_register(void (*fn)(Registrar&), void* registrar, char* error, std::size_t error_size) noexcept {
  auto report = [&](const char* what) {
    if (error != nullptr && error_size > 0) {
      std::strncpy(error, what, error_size - 1);
      error[error_size - 1] = '\0';
    }
  };
  try {
    auto& r = *static_cast<Registrar*>(registrar);
    if (plugin_example_config != nullptr) r.set_example_config(plugin_example_config);
    fn(r);
    return 0;
  } catch (const std::exception& e) {
    report(e.what());
  } catch (...) {
    report("unknown exception (not derived from std::exception)");
  }
  return 1;
}

}  // namespace modalities::detail

#define MODALITIES_PLUGIN(name, version, register_fn)                                                        \
  MODALITIES_PLUGIN_EXPORT __attribute__((used, section(MODALITIES_PLUGIN_SECTION)))                         \
  const modalities_plugin_descriptor modalities_plugin_##name##_descriptor = {MODALITIES_PLUGIN_MAGIC,       \
                                                                              MODALITIES_DESCRIPTOR_LAYOUT,  \
                                                                              MODALITIES_PLUGIN_ABI_VERSION, \
                                                                              #name,                         \
                                                                              version,                       \
                                                                              MODALITIES_SDK_VERSION,        \
                                                                              MODALITIES_SDK_TORCH_VERSION,  \
                                                                              MODALITIES_COMPILER_ID,        \
                                                                              MODALITIES_CXX11_ABI,          \
                                                                              MODALITIES_SDK_WITH_CUDA};     \
  MODALITIES_PLUGIN_EXPORT int modalities_plugin_##name##_register(void* registrar, char* error,             \
                                                                   std::size_t error_size) noexcept {        \
    return ::modalities::detail::invoke_register(register_fn, registrar, error, error_size);                 \
  }
