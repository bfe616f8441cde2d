// Shared steps of every config-consuming command: load plugins from the
// search path, load a TOML file, resolve its interpolations with the
// command's resolvers. Used by the CLI and by tests (modalities::testing).
#pragma once

#include <modalities/core/config_tree.h>
#include <modalities/core/graph.h>
#include <modalities/core/interpolation.h>
#include <modalities/core/registry.h>

#include <filesystem>
#include <string>
#include <vector>

namespace modalities::core {

struct PluginOptions {
  std::vector<std::filesystem::path> extra_paths;  // --plugin-path
  bool strict = false;                             // --strict-plugins: any problem is fatal
  bool bundled = true;                             // search the bundled plugin directory
};

/// Loads plugins into `registry`; returns the problems found (not thrown).
std::vector<PluginProblem> load_plugins(PluginHost& host, const PluginOptions& options);

/// modalities_env for a config file: config_file_path and config_folder_path.
ModalitiesEnv env_for_config(const std::filesystem::path& config_file);

/// Built-in resolvers bound to `env`, plus every resolver registered by plugins.
ResolverTable resolvers_for(const Registry& registry, const ModalitiesEnv& env);

/// Loads and fully interpolates a config file. Throws ConfigFileError.
ConfigNode load_resolved(const std::filesystem::path& file, const Registry& registry, const ModalitiesEnv& env);

}  // namespace modalities::core
