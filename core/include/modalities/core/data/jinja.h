// Jinja2 chat templates, rendered as Modalities renders them (`data prepare_instruction_tuning_data`):
// jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, plus the
// `raise_exception` global and the `tojson` filter transformers' chat templates use.
//
// Hand-written because the output must be byte-identical to Python's jinja2 (whitespace control,
// Python's str()/repr() of values, json.dumps) and no C++ library implements Jinja2's semantics;
// tests/data/jinja_test.cpp compares against jinja2 3.1 on the constructs below.
//
// Supported: {{ }}, {% if/elif/else %}, {% for x in ... [if ...] %} with else and loop.*, tuple
// unpacking, {% set %} (also ns.attr with namespace()), comments, whitespace control (-, +),
// literals (str, int, float, bool, none, list, dict, tuple), + - * / // % ** ~, comparisons, in,
// not in, and/or/not, conditional expressions, is-tests, attribute/item access and slices, the
// common filters (trim, length, tojson, upper, lower, title, capitalize, join, first, last,
// default, list, string, int, float, replace, selectattr, rejectattr, map, items, reverse, sort,
// unique, round, abs, indent) and string/dict methods (strip, split, startswith, endswith, upper,
// lower, title, replace, items, keys, values, get). Anything else (macros, blocks, includes,
// call blocks, other filters, tests, functions or methods) is refused when the template is
// compiled, naming it; arguments a supported filter does not implement (tojson's, round's method)
// are refused when they are evaluated. upper/lower/title/capitalize change ASCII letters only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace modalities::core::data::jinja {

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion order, as Python dicts

/// A Python value as Jinja sees it.
struct Value {
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kNamespace };
  Kind kind = Kind::kUndefined;
  bool b = false;
  bool tuple = false;  // a kList written as a Python tuple: (1, 2)
  std::int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<List> list;  // kList (tuples are lists)
  std::shared_ptr<Dict> dict;  // kDict, kNamespace

  Value() = default;
  explicit Value(Kind k) : kind(k) {}

  static Value none() { return Value(Kind::kNone); }
  static Value boolean(bool v) {
    Value x(Kind::kBool);
    x.b = v;
    return x;
  }
  static Value integer(std::int64_t v) {
    Value x(Kind::kInt);
    x.i = v;
    return x;
  }
  static Value real(double v) {
    Value x(Kind::kFloat);
    x.f = v;
    return x;
  }
  static Value string(std::string v) {
    Value x(Kind::kString);
    x.s = std::move(v);
    return x;
  }
  static Value make_list(List v = {}) {
    Value x(Kind::kList);
    x.list = std::make_shared<List>(std::move(v));
    return x;
  }
  static Value make_dict(Dict v = {}) {
    Value x(Kind::kDict);
    x.dict = std::make_shared<Dict>(std::move(v));
    return x;
  }
  /// The entry `key` of a dict, or nullptr.
  const Value* find(std::string_view key) const;
  Value* find(std::string_view key);
  /// Sets `key` (in place when present, appended otherwise; Python dict assignment).
  void set(const std::string& key, Value v);
};

/// Python's json.dumps(v, ensure_ascii=False) with the default separators (", ", ": ").
std::string json_dumps(const Value& v);
/// Parses one JSON document into Values (object key order kept; a repeated key keeps its first
/// position and its last value, as json.loads). Throws modalities::Error.
Value json_loads(std::string_view text);

class Template {
 public:
  /// Compiles `source`; throws modalities::Error "template line N: ..." for syntax errors and for
  /// Jinja features this implementation refuses.
  explicit Template(std::string_view source);
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  /// Renders with `globals` as the context (e.g. {messages, chat_template_data}). Throws
  /// modalities::Error for runtime errors (undefined attribute of undefined, raise_exception, ...).
  std::string render(const Dict& globals) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace modalities::core::data::jinja
