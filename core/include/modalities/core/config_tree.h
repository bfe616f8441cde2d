// The config document as the engine sees it: a tree of TOML values whose
// tables keep document order (recovered from source positions, since TOML++
// iterates alphabetically) and whose every node remembers where it came from.
// Loading, interpolation and the graph builder all work on this tree.
#pragma once

#include <modalities/sdk/error.h>
#include <modalities/sdk/value.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace modalities::core {

struct SourceLocation {
  std::shared_ptr<const std::string> file;  // shared by every node of a document
  std::uint32_t line = 0;                   // 1-based; 0 = unknown
  std::uint32_t column = 0;
  std::string str() const;  // "file:line:col" (or just "file")
};

class ConfigNode {
 public:
  using Array = std::vector<ConfigNode>;
  using Entry = std::pair<std::string, ConfigNode>;
  using Table = std::vector<Entry>;
  using Data = std::variant<std::monostate, bool, std::int64_t, double, std::string, Array, Table>;

  ConfigNode() = default;
  ConfigNode(Data data, SourceLocation where) : data_(std::move(data)), where_(std::move(where)) {}

  const Data& data() const { return data_; }
  Data& data() { return data_; }
  const SourceLocation& where() const { return where_; }
  void set_where(SourceLocation w) { where_ = std::move(w); }

  bool is_null() const { return std::holds_alternative<std::monostate>(data_); }
  bool is_string() const { return std::holds_alternative<std::string>(data_); }
  bool is_table() const { return std::holds_alternative<Table>(data_); }
  bool is_array() const { return std::holds_alternative<Array>(data_); }
  const std::string& as_string() const { return std::get<std::string>(data_); }
  const Table& as_table() const { return std::get<Table>(data_); }
  Table& as_table() { return std::get<Table>(data_); }
  const Array& as_array() const { return std::get<Array>(data_); }
  Array& as_array() { return std::get<Array>(data_); }

  const ConfigNode* find(std::string_view key) const;
  ConfigNode* find(std::string_view key);
  bool has(std::string_view key) const { return find(key) != nullptr; }

  /// Converts to the SDK's Value (plain data only).
  Value to_value() const;
  /// Builds a node from plain data (resolver results); objects are rejected.
  static ConfigNode from_value(const Value& v, const SourceLocation& where);
  std::string type_name() const;

 private:
  Data data_;
  SourceLocation where_;
};

/// A path into the document, e.g. train_dataloader.config.datasets[1].
class ConfigPath {
 public:
  using Segment = std::variant<std::string, std::size_t>;
  ConfigPath() = default;
  /// Parses "a.b[1].c" (also "a.b.1.c": a numeric key indexes an array when
  /// the path is looked up). Throws modalities::Error when malformed.
  static ConfigPath parse(std::string_view dotted);
  ConfigPath child(std::string key) const;
  ConfigPath index(std::size_t i) const;
  /// This path followed by `tail`.
  ConfigPath operator/(const ConfigPath& tail) const;
  const std::vector<Segment>& segments() const { return segments_; }
  bool empty() const { return segments_.empty(); }
  std::size_t size() const { return segments_.size(); }
  std::string str() const;  // dotted with [i]
  bool operator==(const ConfigPath&) const = default;

 private:
  std::vector<Segment> segments_;
};

/// A problem in a config file, with everything a user needs to fix it.
struct Diagnostic {
  SourceLocation where;
  std::string path;  // dotted config path ("optimizer.config.lr"); may be empty
  std::string message;
  std::string hint;     // "did you mean 'lr'?"
  std::string context;  // "(optimizer/adam_w from libmodalities_optimizer_adamw.so 0.1.0)"
  bool warning = false;
  std::string str() const;
};

/// Thrown by the config engine with every diagnostic it found.
class ConfigFileError : public ConfigError {
 public:
  explicit ConfigFileError(std::vector<Diagnostic> diagnostics);
  const std::vector<Diagnostic>& diagnostics() const { return diagnostics_; }

 private:
  std::vector<Diagnostic> diagnostics_;
};

/// Limits of what the loader accepts (deeper documents are refused, not recursed into).
inline constexpr std::size_t kMaxNestingDepth = 64;

/// Parses a TOML file into a ConfigNode tree in document order.
/// Throws ConfigFileError (syntax errors, invalid UTF-8, dates/times, too deep).
ConfigNode load_toml_file(const std::filesystem::path& file);
/// Same for TOML text; `name` is used as the file name in messages.
ConfigNode load_toml_string(std::string_view text, std::string name);

/// Navigates `path` from `root`; nullptr if absent.
const ConfigNode* lookup(const ConfigNode& root, const ConfigPath& path);

/// Renders a tree as TOML in document order (used for `config resolve` and the
/// `<name>.toml.resolved` dump). Nulls are written as "${null:}" so the output
/// loads back to the same tree. A literal "${" in a string is written as "\\${" so that it stays
/// literal; with `escape_interpolations = false` (an unresolved tree written back as a config)
/// interpolations stay interpolations.
std::string to_toml(const ConfigNode& root, bool escape_interpolations = true);

}  // namespace modalities::core
