// JSONL handling shared by the data tools and the datasets (docs/data.md,
// "Raw index (.idx)"): Modalities' line splitting, JSON validation with exactly the
// acceptance rules of Python's json.loads, and the jq subset used to pick the
// text out of a line.
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/formats/packed_data.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace modalities::formats {

/// Lines of a JSONL buffer as (offset, length) without the '\n', by the rule
/// of docs/data.md: a trailing '\n' ends the last line, an empty buffer is one
/// empty line, '\r' stays inside the line.
MODALITIES_SDK_API std::vector<IndexEntry> split_lines(std::string_view text);

/// Default raw index path of a JSONL file: <parent>/<stem>.idx, as in Modalities.
MODALITIES_SDK_API std::filesystem::path default_index_path(const std::filesystem::path& src);

/// `s` as a JSON string literal, quotes included: '"' and '\\' escaped, control
/// characters as \n, \r, \t, \b, \f or \u00XX; other bytes (UTF-8) as they are.
MODALITIES_SDK_API std::string json_quote(std::string_view s);

/// The jq programs the tools accept: a path of object keys and array indices,
/// `.text`, `.a.b`, `.["key with spaces"]`, `."key"`, `.messages[0].content`.
/// Anything else is refused when parsed (Modalities embeds full jq, but every
/// shipped config uses a plain key path).
class MODALITIES_SDK_API JqPath {
 public:
  /// Throws modalities::Error quoting `program` and saying what is supported.
  static JqPath parse(std::string_view program);
  const std::string& program() const { return program_; }

  struct Step {
    std::string key;                    // object key, or
    std::optional<std::int64_t> index;  // array index (negative counts from the end)
  };
  const std::vector<Step>& steps() const { return steps_; }

 private:
  std::string program_;
  std::vector<Step> steps_;
};

/// Parses JSON lines; one instance per thread (it owns simdjson buffers).
/// Since: SDK 0.1.
class MODALITIES_SDK_API JsonLineParser {
 public:
  JsonLineParser();
  ~JsonLineParser();
  JsonLineParser(const JsonLineParser&) = delete;
  JsonLineParser& operator=(const JsonLineParser&) = delete;

  /// Whether Python's json.loads would accept `line` (bytes). On rejection,
  /// `why` (if given) receives a one-line reason.
  bool valid(std::string_view line, std::string* why = nullptr);

  /// The string that `path` selects in `line`, as jq's first output would be.
  /// Throws modalities::Error (without file/line context; callers add it) when
  /// the line is not JSON, the path selects nothing / null, or a non-string.
  /// The view stays valid until the next call.
  std::string_view extract_string(std::string_view line, const JqPath& path);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace modalities::formats
