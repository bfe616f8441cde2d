#include <modalities/sdk/error.h>
#include <modalities/sdk/run_context.h>

#include <ATen/Context.h>
#include <fmt/core.h>

#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>

namespace modalities {
namespace {

struct RunContext {
  std::mutex mutex;
  std::optional<c10::Device> device;
  std::map<std::string, std::string> plugins;
};

RunContext& context() {
  static RunContext c;
  return c;
}

c10::Device auto_device() {
  if (!at::hasCUDA()) return c10::Device(c10::kCPU);
  const char* local_rank = std::getenv("LOCAL_RANK");
  const int index = local_rank ? std::atoi(local_rank) : 0;
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

}  // namespace

c10::Device parse_run_device(std::string_view text, std::string_view what) {
  if (text.empty() || text == "auto") return auto_device();
  std::optional<c10::Device> device;
  try {
    device = c10::Device(std::string(text));
  } catch (const std::exception&) {
  }
  if (!device || (!device->is_cpu() && !device->is_cuda()))
    throw Error(fmt::format("{}: expected \"auto\", \"cpu\", \"cuda\" or \"cuda:N\", got \"{}\"", what, text));
  if (device->is_cuda()) {
    if (!at::hasCUDA())
      throw Error(fmt::format("{}: \"{}\" asks for CUDA, but this build or machine has no CUDA device", what, text));
    if (!device->has_index()) {
      const char* local_rank = std::getenv("LOCAL_RANK");
      device->set_index(static_cast<c10::DeviceIndex>(local_rank ? std::atoi(local_rank) : 0));
    }
  }
  return *device;
}

c10::Device run_device() {
  auto& c = context();
  std::lock_guard lock(c.mutex);
  if (!c.device) {
    const char* env = std::getenv("MODALITIES_DEVICE");
    c.device = parse_run_device(env ? env : "auto", "MODALITIES_DEVICE");
  }
  return *c.device;
}

void set_run_device(const c10::Device& device) {
  if (device.is_cuda() && !at::hasCUDA())
    throw Error(fmt::format("device {} requested, but this build or machine has no CUDA device", device.str()));
  auto& c = context();
  std::lock_guard lock(c.mutex);
  c.device = device;
}

const std::map<std::string, std::string>& loaded_plugin_versions() { return context().plugins; }

void set_loaded_plugin_versions(std::map<std::string, std::string> versions) {
  auto& c = context();
  std::lock_guard lock(c.mutex);
  c.plugins = std::move(versions);
}

}  // namespace modalities
