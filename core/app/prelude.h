// Note [Verb prelude]
// What every verb that builds components from a config does before its own work, in one order:
//   1. the launcher's environment (torchrun, `modalities launch`, SLURM, or one process) exported
//      as RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE, so ${cuda_env:...} reads the same
//      values under every launcher;
//   2. the plugins loaded (one warning per problem; --strict-plugins stops) and their versions
//      recorded for checkpoints;
//   3. the config read and its interpolations resolved (${modalities_env:...} from the config's
//      folder and the verb's own values, the built-in resolvers, the plugins' ones, the verb's
//      extra ones);
//   4. the run device chosen from MODALITIES_DEVICE or settings.device.
// `run` and `profile` create the process group between 3's read and its resolution (the timeout is
// in the config, and the experiment id must be rank 0's), so the steps are separate methods. Used
// by run, warmstart, profile, generate_text, convert_pytorch_to_hf_checkpoint and the data verbs
// that build components. The validators (`config validate|resolve|graph`, `plugins smoke`) need no
// launcher: they export one process's variables instead (export_single_process_env) and choose no
// device.
#pragma once

#include "cli.h"

#include <modalities/core/config_tree.h>
#include <modalities/core/registry.h>
#include <modalities/core/session.h>
#include <modalities/sdk/distributed.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace modalities::cli {

class VerbPrelude {
 public:
  VerbPrelude() = default;
  VerbPrelude(const VerbPrelude&) = delete;
  VerbPrelude& operator=(const VerbPrelude&) = delete;

  /// Steps 1 and 2. Returns the exit code the verb stops with (kFailed for a bad launcher
  /// environment, kPluginError under --strict-plugins), having said why, or nothing.
  std::optional<int> start(const core::PluginOptions& plugins);

  /// Step 3's read: the TOML file, not yet resolved.
  static core::ConfigNode read(const std::string& file);
  /// Step 3's resolution and step 4, for the config `root` read from `file`; `env_values` add to
  /// (or replace) ${modalities_env:...}'s config_file_path and config_folder_path.
  void resolve(core::ConfigNode& root, const std::string& file,
               const std::map<std::string, std::string>& env_values = {},
               const std::vector<ResolverSpec>& extra_resolvers = {}) const;
  /// read() then resolve().
  core::ConfigNode config(const std::string& file, const std::map<std::string, std::string>& env_values = {},
                          const std::vector<ResolverSpec>& extra_resolvers = {}) const;

  const dist::LaunchEnv& launch() const { return launch_; }
  core::Registry& registry() { return registry_; }
  const core::Registry& registry() const { return registry_; }

 private:
  core::Registry registry_;
  core::PluginHost host_{registry_};
  dist::LaunchEnv launch_;
};

/// Step 1 alone (for verbs that load no plugins): the launch environment, exported.
dist::LaunchEnv export_launcher_env();

}  // namespace modalities::cli
