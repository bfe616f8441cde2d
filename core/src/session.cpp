// Plugin loading and config loading shared by the commands.
#include <modalities/core/session.h>

namespace modalities::core {

namespace fs = std::filesystem;

std::vector<PluginProblem> load_plugins(PluginHost& host, const PluginOptions& options) {
  std::vector<PluginProblem> problems;
  std::vector<fs::path> paths = PluginHost::search_path(options.extra_paths);
  if (!options.bundled) {
    const fs::path bundled = PluginHost::bundled_plugin_dir();
    std::erase(paths, bundled);
  }
  for (const auto& p : paths) {
    auto found = host.load_path(p);
    problems.insert(problems.end(), found.begin(), found.end());
  }
  return problems;
}

ModalitiesEnv env_for_config(const fs::path& config_file) {
  ModalitiesEnv env;
  std::error_code ec;
  const fs::path absolute = fs::absolute(config_file, ec);
  env.values["config_file_path"] = (ec ? config_file : absolute).string();
  env.values["config_folder_path"] = (ec ? config_file : absolute).parent_path().string();
  return env;
}

ResolverTable resolvers_for(const Registry& registry, const ModalitiesEnv& env) {
  ResolverTable table = builtin_resolvers(env);
  for (const auto& r : registry.plugin_resolvers()) table.add(r);
  return table;
}

ConfigNode load_resolved(const fs::path& file, const Registry& registry, const ModalitiesEnv& env) {
  ConfigNode root = load_toml_file(file);
  resolve_interpolations(root, resolvers_for(registry, env));
  return root;
}

}  // namespace modalities::core
