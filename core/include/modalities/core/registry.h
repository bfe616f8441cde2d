// The registry of loaded variants and resolvers, and the plugin host that
// fills it from .so files. Registration is transactional per plugin: a plugin
// whose register function throws, or that registers a variant another plugin
// already owns, contributes nothing.
#pragma once

#include <modalities/core/interpolation.h>
#include <modalities/sdk/registrar.h>

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace modalities::core {

struct PluginInfo {
  std::string name;
  std::string version;
  std::filesystem::path file;         // empty for variants registered in-process (tests, core)
  std::string example_config;         // embedded configs/example.toml, may be empty
  std::vector<std::string> variants;  // "component/variant" ids it registered
};

struct RegisteredVariant {
  VariantSpec spec;
  std::shared_ptr<const PluginInfo> plugin;
  /// "(optimizer/adam_w from libmodalities_optimizer_adamw.so 0.1.0)"
  std::string provenance() const;
};

class Registry {
 public:
  Registry();

  const RegisteredVariant* find(std::string_view component_key, std::string_view variant_key) const;
  bool has_component(std::string_view component_key) const;
  std::vector<std::string> component_keys() const;
  std::vector<std::string> variant_keys(std::string_view component_key) const;
  std::vector<const RegisteredVariant*> all() const;
  const std::vector<std::shared_ptr<const PluginInfo>>& plugins() const { return plugins_; }

  /// Resolvers registered by plugins (built-ins are added per command).
  const std::vector<ResolverSpec>& plugin_resolvers() const { return resolvers_; }
  /// The registered RunResumeSpec (null when no loaded plugin registers one) and its plugin.
  const RunResumeSpec* run_resume() const { return run_resume_ ? &*run_resume_ : nullptr; }
  const std::string& run_resume_owner() const { return run_resume_owner_; }

  /// Runs `register_fn` against a staging registrar and commits its
  /// registrations only if it succeeds and nothing conflicts. Returns an
  /// error message instead of throwing.
  std::optional<std::string> register_plugin(PluginInfo info, const std::function<void(Registrar&)>& register_fn);

  /// Replaces (or adds) one variant for the lifetime of the returned guard; for tests.
  class Override {
   public:
    Override(Registry& r, VariantSpec spec);
    ~Override();
    Override(const Override&) = delete;
    Override& operator=(const Override&) = delete;

   private:
    Registry& r_;
    std::string ck_, vk_;
    std::optional<RegisteredVariant> previous_;
  };

 private:
  friend class StagingRegistrar;
  std::map<std::string, std::map<std::string, RegisteredVariant, std::less<>>, std::less<>> variants_;
  std::vector<std::shared_ptr<const PluginInfo>> plugins_;
  std::vector<ResolverSpec> resolvers_;
  std::map<std::string, std::string, std::less<>> resolver_owner_;
  std::optional<RunResumeSpec> run_resume_;
  std::string run_resume_owner_;
};

struct PluginProblem {
  std::filesystem::path file;
  std::string reason;
  std::string str() const;
};

/// Loads plugin .so files into a Registry and keeps them loaded for the
/// lifetime of the process. See Note [Plugin lifetime] in plugin_host.cpp.
class PluginHost {
 public:
  explicit PluginHost(Registry& registry) : registry_(registry) {}

  /// Loads every "*.so" in a directory (sorted by name), or one file.
  /// Problems are returned, never thrown; the other plugins still load.
  std::vector<PluginProblem> load_path(const std::filesystem::path& path);
  std::optional<PluginProblem> load_file(const std::filesystem::path& file);

  /// Bundled directory, then MODALITIES_PLUGIN_PATH (colon list), then `extra`.
  static std::vector<std::filesystem::path> search_path(const std::vector<std::filesystem::path>& extra);
  /// <dir of the running executable>/../lib/modalities/plugins
  static std::filesystem::path bundled_plugin_dir();

 private:
  Registry& registry_;
  std::vector<std::filesystem::path> loaded_;  // canonical paths, to skip duplicates
};

/// The fingerprint a plugin must match, as "SDK ABI 1, torch 2.11.0, gcc 12, cxx11abi=1, cuda=off".
std::string host_fingerprint();

}  // namespace modalities::core
