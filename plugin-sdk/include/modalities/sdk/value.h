// The dynamically typed value the config engine hands to component schemas:
// TOML scalars, lists and ordered tables, built component instances
// (`Object`) and, while validating a graph before anything is built,
// placeholders for components that are not built yet (`Pending`).
// Factories never see Values: their Schema turns them into typed structs.
#pragma once

#include <modalities/sdk/export.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace modalities {

class Value;

/// A built component instance. `ptr` points at an object of the interface
/// class named by `interface` (e.g. "Optimizer"): it was converted to the
/// interface pointer before it was erased, so it can be cast back with
/// std::static_pointer_cast<Interface>. See Note [Object identity] in schema.h.
struct Object {
  std::string interface;
  std::shared_ptr<void> ptr;
  std::string origin;  // registry id that built it, e.g. "optimizer/adam_w"
};

/// Stands for a component node during dry validation: what it will produce
/// (an interface name such as "Module", or a value kind such as "int").
struct Pending {
  std::string produces;
  std::string origin;
};

class MODALITIES_SDK_API Value {
 public:
  using List = std::vector<Value>;
  using Entry = std::pair<std::string, Value>;
  using Table = std::vector<Entry>;  // document order, keys unique
  enum class Kind { kNull, kBool, kInt, kFloat, kString, kList, kTable, kObject, kPending };

  Value() = default;
  Value(std::nullptr_t) {}
  Value(bool b) : v_(b) {}
  Value(std::int64_t i) : v_(i) {}
  Value(int i) : v_(static_cast<std::int64_t>(i)) {}
  Value(double d) : v_(d) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(List l) : v_(std::move(l)) {}
  Value(Table t) : v_(std::move(t)) {}
  Value(Object o) : v_(std::move(o)) {}
  Value(Pending p) : v_(std::move(p)) {}

  Kind kind() const { return static_cast<Kind>(v_.index()); }
  bool is_null() const { return kind() == Kind::kNull; }
  bool is_bool() const { return kind() == Kind::kBool; }
  bool is_int() const { return kind() == Kind::kInt; }
  bool is_float() const { return kind() == Kind::kFloat; }
  bool is_string() const { return kind() == Kind::kString; }
  bool is_list() const { return kind() == Kind::kList; }
  bool is_table() const { return kind() == Kind::kTable; }
  bool is_object() const { return kind() == Kind::kObject; }
  bool is_pending() const { return kind() == Kind::kPending; }

  bool as_bool() const { return std::get<bool>(v_); }
  std::int64_t as_int() const { return std::get<std::int64_t>(v_); }
  double as_float() const { return std::get<double>(v_); }
  const std::string& as_string() const { return std::get<std::string>(v_); }
  const List& as_list() const { return std::get<List>(v_); }
  List& as_list() { return std::get<List>(v_); }
  const Table& as_table() const { return std::get<Table>(v_); }
  Table& as_table() { return std::get<Table>(v_); }
  const Object& as_object() const { return std::get<Object>(v_); }
  const Pending& as_pending() const { return std::get<Pending>(v_); }

  /// Table lookup; nullptr when absent or when this is not a table.
  const Value* find(std::string_view key) const;

  /// What a user would call this value's type in an error message:
  /// "integer", "table", "Optimizer (optimizer/adam_w)", ...
  std::string type_name() const;
  /// A short TOML-like rendering, for messages and `config build` output.
  std::string repr() const;

  static std::string_view kind_name(Kind kind);

 private:
  std::variant<std::monostate, bool, std::int64_t, double, std::string, List, Table, Object, Pending> v_;
};

}  // namespace modalities
