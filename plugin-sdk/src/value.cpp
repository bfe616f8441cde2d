// Value: type names and short renderings for error messages and `config build`.
#include <modalities/sdk/schema.h>
#include <modalities/sdk/value.h>

#include <fmt/core.h>

namespace modalities {

const Value* Value::find(std::string_view key) const {
  if (!is_table()) return nullptr;
  for (const auto& [k, v] : as_table())
    if (k == key) return &v;
  return nullptr;
}

std::string_view Value::kind_name(Kind kind) {
  switch (kind) {
    case Kind::kNull: return "null";
    case Kind::kBool: return "boolean";
    case Kind::kInt: return "integer";
    case Kind::kFloat: return "float";
    case Kind::kString: return "string";
    case Kind::kList: return "list";
    case Kind::kTable: return "table";
    case Kind::kObject: return "component";
    case Kind::kPending: return "component";
  }
  return "?";
}

std::string Value::type_name() const {
  if (is_object()) return fmt::format("{} ({})", as_object().interface, as_object().origin);
  if (is_pending()) return fmt::format("{} ({})", as_pending().produces, as_pending().origin);
  return std::string(kind_name(kind()));
}

std::string Value::repr() const {
  switch (kind()) {
    case Kind::kNull: return "null";
    case Kind::kBool: return as_bool() ? "true" : "false";
    case Kind::kInt: return fmt::format("{}", as_int());
    case Kind::kFloat: return format_float(as_float());
    case Kind::kString: return toml_quote(as_string());
    case Kind::kList: {
      std::string s = "[";
      for (std::size_t i = 0; i < as_list().size(); ++i) s += (i ? ", " : "") + as_list()[i].repr();
      return s + "]";
    }
    case Kind::kTable: {
      if (as_table().empty()) return "{}";
      std::string s = "{ ";
      for (std::size_t i = 0; i < as_table().size(); ++i)
        s += (i ? ", " : "") + as_table()[i].first + " = " + as_table()[i].second.repr();
      return s + " }";
    }
    case Kind::kObject: return fmt::format("<{} from {}>", as_object().interface, as_object().origin);
    case Kind::kPending: return fmt::format("<{} from {}>", as_pending().produces, as_pending().origin);
  }
  return "?";
}

}  // namespace modalities
