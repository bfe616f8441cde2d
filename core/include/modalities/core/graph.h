// The component graph of a resolved config: validation before anything is
// built, then construction by dependency injection in the order of docs/configs.md
// (children before parents, top-level nodes built once and shared through
// references, inline nodes private), and a DOT rendering.
#pragma once

#include <modalities/core/config_tree.h>
#include <modalities/core/registry.h>
#include <modalities/sdk/schema.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace modalities::core {

/// One top-level key a pipeline needs (docs/configs.md): its name, what it must
/// produce ("Module", "int", "table", "list<DataLoader>", or "" for anything).
struct BuiltGraph;

struct PipelineEntry {
  std::string key;
  std::string expects;
  bool required = true;
  std::string help;
  /// Optional schema check of the entry's value (e.g. the training Settings):
  /// run on placeholders before building and on the built value after.
  std::function<void(const Value&, ParseContext&)> check = {};
};

/// What a command builds from a config: an ordered list of top-level keys.
/// Top-level keys not listed are built only if something references them.
struct PipelineProfile {
  std::string name;
  std::string description;
  std::vector<PipelineEntry> entries;
  /// Cross-entry checks over the built set (e.g. enough tokens in train_dataset).
  /// Report with ctx.fail("<top-level key>.<path>", ...).
  std::function<void(const BuiltGraph&, ParseContext&)> check_built = {};
};

/// Profiles of the commands (training, packing, text_generation, profiling).
const std::vector<PipelineProfile>& builtin_pipelines();
const PipelineProfile* find_pipeline(std::string_view name);

struct BuiltGraph {
  /// Selected top-level keys in build-selection order, with what they built.
  std::vector<std::pair<std::string, Value>> top_level;
  const Value* get(std::string_view key) const;
};

class ComponentGraph {
 public:
  /// `profile` null: every top-level key is selected, in document order.
  ComponentGraph(const Registry& registry, const ConfigNode& resolved_root, const PipelineProfile* profile);
  // The graph keeps references to the registry and the tree: no temporaries.
  ComponentGraph(Registry&&, const ConfigNode&, const PipelineProfile*) = delete;
  ComponentGraph(const Registry&, ConfigNode&&, const PipelineProfile*) = delete;

  /// Checks the whole graph without building anything: node shapes, known
  /// variants, config keys and types (Pending placeholders stand for unbuilt
  /// components), reference targets and cycles, interfaces of typed fields,
  /// the pipeline's required keys. Returns errors and warnings.
  std::vector<Diagnostic> validate();

  /// Validates, then builds. `log` receives one line per built component
  /// ("Instantiated optimizer/adam_w -> Optimizer: optimizer"); `warn` every warning: the
  /// validation's, the factories' (BuildContext::warn) and the pipeline's checks on built values
  /// (without `warn` they go to `log`). Throws ConfigFileError on invalid configs and on factory
  /// failures.
  BuiltGraph build(const std::function<void(const std::string&)>& log,
                   const std::function<void(const std::string&)>& warn = {});

  /// Graphviz DOT: boxes for top-level nodes, ellipses for inline components,
  /// solid edges for nesting, dashed edges for references.
  std::string to_dot();

 private:
  enum class NodeKind { kComponent, kReference, kTable, kArray, kScalar, kInvalid };
  NodeKind classify(const ConfigNode& n, const ConfigPath& p);
  Value dry(const ConfigNode& n, const ConfigPath& p);
  Value dry_top(const std::string& key, const ConfigNode* referrer, const ConfigPath& referrer_path);
  Value build_node(const ConfigNode& n, const ConfigPath& p, const std::function<void(const std::string&)>& log);
  std::vector<std::string> selection();
  void error(const ConfigNode& at, const ConfigPath& p, std::string message, std::string hint = {},
             std::string context = {});
  SourceLocation locate(const ConfigPath& p) const;
  void map_field_errors(const std::vector<FieldError>& errs, const ConfigPath& config_path, const RegisteredVariant& v,
                        bool warning);
  void map_errors(const std::vector<FieldError>& errs, const ConfigPath& base, const std::string& context,
                  bool warning);
  void run_entry_checks(const std::string& key, const Value& v, bool dry_run);

  const Registry& registry_;
  const ConfigNode& root_;
  const PipelineProfile* profile_;
  std::vector<Diagnostic> diagnostics_;
  std::map<std::string, bool> reported_;          // path -> already classified with an error
  std::map<std::string, Value> dry_cache_;        // top-level key -> dry value
  std::vector<std::string> in_progress_;          // reference chain, for cycles
  std::map<std::string, Value> built_cache_;      // top-level key -> built value
  std::function<void(const std::string&)> warn_;  // build()'s warning sink
};

/// Expected-vs-actual check used by pipelines: does `v` satisfy `expects`?
bool satisfies(const Value& v, std::string_view expects);

}  // namespace modalities::core
