// Note [Verb prelude] in prelude.h.
#include "prelude.h"

#include <modalities/sdk/run_context.h>

#include <cstdlib>
#include <map>
#include <string>
#include <utility>

namespace modalities::cli {
namespace {

void choose_device(const core::ConfigNode& root) {
  if (const char* env = std::getenv("MODALITIES_DEVICE")) {
    set_run_device(parse_run_device(env, "MODALITIES_DEVICE"));
    return;
  }
  const core::ConfigNode* settings = root.find("settings");
  const core::ConfigNode* device = settings && settings->is_table() ? settings->find("device") : nullptr;
  if (device != nullptr && device->is_string())
    set_run_device(parse_run_device(device->as_string(), "settings.device"));
  else set_run_device(parse_run_device("auto", "settings.device"));
}

void record_plugin_versions(const core::Registry& registry) {
  std::map<std::string, std::string> versions;
  for (const auto& p : registry.plugins()) versions[p->name] = p->version;
  set_loaded_plugin_versions(std::move(versions));
}

}  // namespace

dist::LaunchEnv export_launcher_env() {
  const dist::LaunchEnv e = dist::launch_env();
  setenv("RANK", std::to_string(e.rank).c_str(), 0);
  setenv("WORLD_SIZE", std::to_string(e.world_size).c_str(), 0);
  setenv("LOCAL_RANK", std::to_string(e.local_rank).c_str(), 0);
  setenv("LOCAL_WORLD_SIZE", std::to_string(e.local_world_size).c_str(), 0);
  return e;
}

std::optional<int> VerbPrelude::start(const core::PluginOptions& plugins) {
  try {
    launch_ = export_launcher_env();
  } catch (const std::exception& e) {
    print_error(e.what());
    return kFailed;
  }
  if (!load_plugins_or_report(host_, plugins)) return kPluginError;
  record_plugin_versions(registry_);
  return std::nullopt;
}

core::ConfigNode VerbPrelude::read(const std::string& file) { return core::load_toml_file(file); }

void VerbPrelude::resolve(core::ConfigNode& root, const std::string& file,
                          const std::map<std::string, std::string>& env_values,
                          const std::vector<ResolverSpec>& extra_resolvers) const {
  core::ModalitiesEnv env = core::env_for_config(file);
  for (const auto& [key, value] : env_values) env.values[key] = value;
  core::ResolverTable resolvers = core::resolvers_for(registry_, env);
  for (const ResolverSpec& r : extra_resolvers) resolvers.add(r);
  core::resolve_interpolations(root, resolvers);
  choose_device(root);
}

core::ConfigNode VerbPrelude::config(const std::string& file, const std::map<std::string, std::string>& env_values,
                                     const std::vector<ResolverSpec>& extra_resolvers) const {
  core::ConfigNode root = read(file);
  resolve(root, file, env_values, extra_resolvers);
  return root;
}

}  // namespace modalities::cli
