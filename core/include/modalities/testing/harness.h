// Test harness: loads one plugin (.so) and a TOML config, then builds
// components through the registry by top-level key, exactly as the host
// does. Tests edit the resolved config with set() to probe validators.
//
//   modalities::testing::Harness h{MODALITIES_TEST_PLUGIN, "configs/example.toml"};
//   EXPECT_EQ(h.value("num_target_steps").as_int(), 100);
//   h.set("num_target_steps.config.dp_degree", 0);
//   EXPECT_THAT(h.build_error(), HasSubstr("num_target_steps.config.dp_degree"));
#pragma once

#include <modalities/core/graph.h>
#include <modalities/core/registry.h>
#include <modalities/core/session.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace modalities::testing {

class Harness {
 public:
  /// Loads `plugin_file` (fails the test on any problem) and, if given, the config.
  explicit Harness(const std::filesystem::path& plugin_file, const std::filesystem::path& config_file = {});

  /// Loads another plugin needed by the config.
  void load_plugin(const std::filesystem::path& plugin_file);
  /// Replaces the config with TOML text (interpolated like a file named `name`).
  void set_config_text(const std::string& toml, const std::string& name = "test.toml");
  /// Sets a value at a dotted path of the resolved config ("a.config.b[1]"); creates missing table keys.
  void set(const std::string& dotted_path, Value value);
  /// Removes the key at a dotted path.
  void erase(const std::string& dotted_path);

  /// Builds every top-level key (memoized until the next edit) and returns one.
  Value value(const std::string& key);
  template <class I>
  std::shared_ptr<I> get(const std::string& key) {
    const Value v = value(key);
    if (!v.is_object() || v.as_object().interface != I::kInterface) return nullptr;
    return std::static_pointer_cast<I>(v.as_object().ptr);
  }
  /// Validation + build errors as text ("" if the config builds).
  std::string build_error();
  /// Validation diagnostics without building.
  std::vector<core::Diagnostic> validate();

  core::Registry& registry() { return registry_; }
  const core::ConfigNode& config() const { return root_; }

 private:
  core::Registry registry_;
  core::PluginHost host_{registry_};
  core::ConfigNode root_;
  std::optional<core::BuiltGraph> built_;
};

/// Reads a file into a string (test data helpers).
std::string read_file(const std::filesystem::path& file);

}  // namespace modalities::testing
