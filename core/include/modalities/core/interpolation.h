// `${...}` interpolation over a whole config document (docs/configs.md):
//   "${a.b[0].c}"      whole-string: replaced by a copy of the target, type kept
//   "x/${a.b}/y"       embedded: each part rendered as text, result is a string
//   "${name:argument}" a registered resolver (cuda_env, modalities_env, node_env, null, ...)
//   "\${"              a literal "${"
// Resolution is eager over the whole document, before anything is built;
// cycles are reported with the chain of paths.
#pragma once

#include <modalities/core/config_tree.h>
#include <modalities/sdk/registrar.h>

#include <map>
#include <string>
#include <vector>

namespace modalities::core {

/// Values of the `modalities_env` resolver that the running command supplies
/// (config_file_path, config_folder_path, experiments_root_path, experiment_id).
struct ModalitiesEnv {
  std::map<std::string, std::string> values;
};

class ResolverTable {
 public:
  void add(ResolverSpec spec);  // replaces an existing resolver of the same name
  const ResolverSpec* find(std::string_view name) const;
  std::vector<std::string> names() const;
  const std::map<std::string, ResolverSpec, std::less<>>& all() const { return resolvers_; }

 private:
  std::map<std::string, ResolverSpec, std::less<>> resolvers_;
};

/// cuda_env, modalities_env, node_env and null, bound to `env`.
ResolverTable builtin_resolvers(const ModalitiesEnv& env);

/// Resolves every interpolation in `root` in place. Throws ConfigFileError
/// listing every problem (unknown path or resolver, cycles, resolver errors,
/// tables or null embedded in text).
void resolve_interpolations(ConfigNode& root, const ResolverTable& resolvers);

/// True if the string contains an interpolation or an escaped "\${".
bool has_interpolation(std::string_view s);

}  // namespace modalities::core
