// Loading TOML into the ConfigNode tree (document order, strict value kinds,
// bounded depth) and writing it back as TOML.
#include <modalities/core/config_tree.h>
#include <modalities/sdk/schema.h>

#include <fmt/format.h>
#include <toml++/toml.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace modalities::core {

std::string SourceLocation::str() const {
  const std::string name = file ? *file : std::string("<config>");
  if (line == 0) return name;
  return fmt::format("{}:{}:{}", name, line, column);
}

const ConfigNode* ConfigNode::find(std::string_view key) const {
  if (!is_table()) return nullptr;
  for (const auto& [k, v] : as_table())
    if (k == key) return &v;
  return nullptr;
}

ConfigNode* ConfigNode::find(std::string_view key) {
  if (!is_table()) return nullptr;
  for (auto& [k, v] : as_table())
    if (k == key) return &v;
  return nullptr;
}

Value ConfigNode::to_value() const {
  return std::visit(
      [](const auto& d) -> Value {
        using T = std::decay_t<decltype(d)>;
        if constexpr (std::is_same_v<T, std::monostate>) return Value();
        else if constexpr (std::is_same_v<T, Array>) {
          Value::List l;
          l.reserve(d.size());
          for (const auto& x : d) l.push_back(x.to_value());
          return Value(std::move(l));
        } else if constexpr (std::is_same_v<T, Table>) {
          Value::Table t;
          t.reserve(d.size());
          for (const auto& [k, x] : d) t.emplace_back(k, x.to_value());
          return Value(std::move(t));
        } else return Value(d);
      },
      data_);
}

ConfigNode ConfigNode::from_value(const Value& v, const SourceLocation& where) {
  switch (v.kind()) {
    case Value::Kind::kNull: return ConfigNode({}, where);
    case Value::Kind::kBool: return ConfigNode(v.as_bool(), where);
    case Value::Kind::kInt: return ConfigNode(v.as_int(), where);
    case Value::Kind::kFloat: return ConfigNode(v.as_float(), where);
    case Value::Kind::kString: return ConfigNode(v.as_string(), where);
    case Value::Kind::kList: {
      Array a;
      for (const auto& x : v.as_list()) a.push_back(from_value(x, where));
      return ConfigNode(std::move(a), where);
    }
    case Value::Kind::kTable: {
      Table t;
      for (const auto& [k, x] : v.as_table()) t.emplace_back(k, from_value(x, where));
      return ConfigNode(std::move(t), where);
    }
    default: throw Error("a resolver returned a component object; resolvers must return plain data");
  }
}

std::string ConfigNode::type_name() const {
  switch (data_.index()) {
    case 0: return "null";
    case 1: return "boolean";
    case 2: return "integer";
    case 3: return "float";
    case 4: return "string";
    case 5: return "array";
    case 6: return "table";
  }
  return "?";
}

ConfigPath ConfigPath::parse(std::string_view dotted) {
  ConfigPath p;
  std::string cur;
  auto malformed = [&] { return Error(fmt::format("malformed config path '{}'", dotted)); };
  for (std::size_t i = 0; i < dotted.size(); ++i) {
    const char c = dotted[i];
    if (c == '.') {
      if (!cur.empty()) p = p.child(std::move(cur));
      else if (i == 0 || dotted[i - 1] != ']') throw malformed();
      cur.clear();
    } else if (c == '[') {
      if (!cur.empty()) p = p.child(std::move(cur));
      cur.clear();
      const auto close = dotted.find(']', i);
      if (close == std::string_view::npos || close == i + 1) throw malformed();
      const std::string_view num = dotted.substr(i + 1, close - i - 1);
      if (!std::all_of(num.begin(), num.end(), [](char d) { return d >= '0' && d <= '9'; })) throw malformed();
      p = p.index(std::stoul(std::string(num)));
      i = close;
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) p = p.child(std::move(cur));
  else if (!dotted.empty() && dotted.back() == '.') throw malformed();
  if (p.empty()) throw malformed();
  return p;
}

ConfigPath ConfigPath::operator/(const ConfigPath& tail) const {
  ConfigPath p = *this;
  p.segments_.insert(p.segments_.end(), tail.segments_.begin(), tail.segments_.end());
  return p;
}

ConfigPath ConfigPath::child(std::string key) const {
  ConfigPath p = *this;
  p.segments_.emplace_back(std::move(key));
  return p;
}

ConfigPath ConfigPath::index(std::size_t i) const {
  ConfigPath p = *this;
  p.segments_.emplace_back(i);
  return p;
}

std::string ConfigPath::str() const {
  std::string s;
  for (const auto& seg : segments_) {
    if (const auto* k = std::get_if<std::string>(&seg)) {
      if (!s.empty()) s += '.';
      s += *k;
    } else {
      s += fmt::format("[{}]", std::get<std::size_t>(seg));
    }
  }
  return s;
}

std::string Diagnostic::str() const {
  std::string s = where.str() + ": ";
  if (warning) s += "warning: ";
  if (!path.empty()) s += path + ": ";
  s += message;
  if (!context.empty()) s += "\n  " + context;
  if (!hint.empty()) s += "\n  hint: " + hint;
  return s;
}

namespace {
std::string join_diagnostics(const std::vector<Diagnostic>& ds) {
  std::string s;
  for (const auto& d : ds) s += (s.empty() ? "" : "\n") + d.str();
  return s;
}
}  // namespace

ConfigFileError::ConfigFileError(std::vector<Diagnostic> diagnostics)
    : ConfigError("", join_diagnostics(diagnostics)), diagnostics_(std::move(diagnostics)) {}

namespace {

class Converter {
 public:
  explicit Converter(std::shared_ptr<const std::string> file) : file_(std::move(file)) {}

  ConfigNode convert(const toml::node& n, const ConfigPath& path, std::size_t depth) {
    const SourceLocation where = loc(n.source());
    if (depth > kMaxNestingDepth) {
      fail(where, path, fmt::format("nesting deeper than {} levels", kMaxNestingDepth));
      return ConfigNode({}, where);
    }
    switch (n.type()) {
      case toml::node_type::table: {
        const auto& t = *n.as_table();
        struct Item {
          std::uint32_t line, column;
          std::string key;
          const toml::node* node;
        };
        std::vector<Item> items;
        for (auto&& [k, v] : t) {
          // Order by the position of the key (document order), falling back to the value's.
          auto src = k.source().begin;
          if (src.line == 0) src = v.source().begin;
          items.push_back({src.line, src.column, std::string(k.str()), &v});
        }
        std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
          return a.line != b.line ? a.line < b.line : a.column < b.column;
        });
        ConfigNode::Table out;
        out.reserve(items.size());
        for (const auto& it : items) out.emplace_back(it.key, convert(*it.node, path.child(it.key), depth + 1));
        return ConfigNode(std::move(out), where);
      }
      case toml::node_type::array: {
        ConfigNode::Array out;
        std::size_t i = 0;
        for (const auto& v : *n.as_array()) out.push_back(convert(v, path.index(i++), depth + 1));
        return ConfigNode(std::move(out), where);
      }
      case toml::node_type::string: return ConfigNode(std::string(n.as_string()->get()), where);
      case toml::node_type::integer: return ConfigNode(n.as_integer()->get(), where);
      case toml::node_type::floating_point: return ConfigNode(n.as_floating_point()->get(), where);
      case toml::node_type::boolean: return ConfigNode(n.as_boolean()->get(), where);
      case toml::node_type::date:
      case toml::node_type::time:
      case toml::node_type::date_time:
        fail(where, path, "dates and times are not allowed in Modalities configs",
             "quote the value to make it a string");
        return ConfigNode({}, where);
      default: fail(where, path, "unsupported TOML value"); return ConfigNode({}, where);
    }
  }

  void fail(SourceLocation where, const ConfigPath& path, std::string message, std::string hint = {}) {
    diagnostics_.push_back({std::move(where), path.str(), std::move(message), std::move(hint), {}, false});
  }
  std::vector<Diagnostic>& diagnostics() { return diagnostics_; }

 private:
  SourceLocation loc(const toml::source_region& r) const {
    return SourceLocation{file_, static_cast<std::uint32_t>(r.begin.line), static_cast<std::uint32_t>(r.begin.column)};
  }
  std::shared_ptr<const std::string> file_;
  std::vector<Diagnostic> diagnostics_;
};

// TOML++ builds the tables of a dotted key or a table header recursively, one stack frame per
// part: a key of some 40,000 parts overflows the stack inside toml::parse. This lexical pre-scan
// (comments, strings and brackets only; values are not parsed) finds every key, in headers, at
// the start of a line and inside inline tables, and refuses one with more than kMaxNestingDepth
// parts before the parser sees the text: such a key nests deeper than the limit anyway.
class KeyDepthScan {
 public:
  KeyDepthScan(std::string_view text, std::shared_ptr<const std::string> file) : t_(text), file_(std::move(file)) {}

  void run() {
    std::vector<char> open;  // '[' / '{' inside a value
    bool expect_key = true;  // line start outside brackets, after '{' or ',' in an inline table
    while (i_ < t_.size()) {
      const char c = t_[i_];
      if (c == '\n') {
        newline();
        if (open.empty()) expect_key = true;
        continue;
      }
      if (c == ' ' || c == '\t' || c == '\r') {
        ++i_;
        continue;
      }
      if (c == '#') {
        while (i_ < t_.size() && t_[i_] != '\n') ++i_;
        continue;
      }
      if (expect_key) {
        expect_key = false;
        if (open.empty() && c == '[') {  // [table] or [[array of tables]]
          i_ += t_.substr(i_, 2) == "[[" ? 2 : 1;
          key();
          continue;
        }
        if (c == '"' || c == '\'' || bare(c)) {
          key();
          continue;
        }
      }
      if (c == '"' || c == '\'') {
        string();
      } else if (c == '[' || c == '{') {
        open.push_back(c);
        expect_key = c == '{';
        ++i_;
      } else if (c == ']' || c == '}') {
        if (!open.empty()) open.pop_back();
        ++i_;
      } else if (c == ',') {
        expect_key = !open.empty() && open.back() == '{';
        ++i_;
      } else {
        ++i_;
      }
    }
  }

 private:
  static bool bare(char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  }
  void newline() {
    ++line_;
    line_start_ = ++i_;
  }
  void blanks() {
    while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\t')) ++i_;
  }
  // A (possibly dotted) key starting at i_; throws when it has too many parts.
  void key() {
    const auto line = static_cast<std::uint32_t>(line_);
    const auto column = static_cast<std::uint32_t>(i_ - line_start_ + 1);
    std::size_t parts = 0;
    while (i_ < t_.size()) {
      blanks();
      if (i_ >= t_.size()) break;
      if (t_[i_] == '"' || t_[i_] == '\'') {
        string();
      } else if (bare(t_[i_])) {
        while (i_ < t_.size() && bare(t_[i_])) ++i_;
      } else {
        break;
      }
      ++parts;
      blanks();
      if (i_ >= t_.size() || t_[i_] != '.') break;
      ++i_;
    }
    if (parts > kMaxNestingDepth)
      throw ConfigFileError(
          {{SourceLocation{file_, line, column},
            "",
            fmt::format("nesting deeper than {} levels: this key has {} dotted parts", kMaxNestingDepth, parts),
            "a Modalities config nests a few levels deep; was this file generated by mistake?",
            {},
            false}});
  }
  // A basic or literal string, single- or multi-line, starting at its opening quote.
  void string() {
    const char q = t_[i_];
    std::size_t run = 0;
    while (i_ + run < t_.size() && t_[i_ + run] == q) ++run;
    if (run == 2) {  // empty string
      i_ += 2;
      return;
    }
    const bool multi = run >= 3;
    i_ += multi ? 3 : 1;
    while (i_ < t_.size()) {
      const char c = t_[i_];
      if (c == '\n') {
        if (!multi) return;  // unterminated: the parser reports it
        newline();
      } else if (c == '\\' && q == '"') {
        ++i_;
        if (i_ < t_.size() && t_[i_] == '\n') newline();
        else ++i_;
      } else if (c == q) {
        std::size_t n = 0;
        while (i_ + n < t_.size() && t_[i_ + n] == q) ++n;
        i_ += n;
        if (!multi || n >= 3) return;  // a closing """ may carry up to two quotes of content
      } else {
        ++i_;
      }
    }
  }

  std::string_view t_;
  std::shared_ptr<const std::string> file_;
  std::size_t i_ = 0, line_ = 1, line_start_ = 0;
};

// Depth: TOML++ refuses inline nesting beyond 256 levels itself (a syntax error), KeyDepthScan
// refuses keys of more parts than kMaxNestingDepth before parsing, and Converter refuses
// anything deeper than kMaxNestingDepth, headers included.
ConfigNode parse_text(std::string_view text, std::shared_ptr<const std::string> file) {
  KeyDepthScan(text, file).run();
  toml::table table;
  try {
    table = toml::parse(text, std::string_view(*file));
  } catch (const toml::parse_error& e) {
    const auto& b = e.source().begin;
    throw ConfigFileError(
        {{SourceLocation{file, static_cast<std::uint32_t>(b.line), static_cast<std::uint32_t>(b.column)},
          "",
          fmt::format("TOML syntax error: {}", e.description()),
          {},
          {},
          false}});
  }
  Converter conv(file);
  ConfigNode root = conv.convert(table, ConfigPath(), 0);
  root.set_where(SourceLocation{file, 0, 0});
  if (!conv.diagnostics().empty()) throw ConfigFileError(std::move(conv.diagnostics()));
  return root;
}

}  // namespace

ConfigNode load_toml_file(const std::filesystem::path& file) {
  auto name = std::make_shared<const std::string>(file.string());
  std::error_code ec;
  if (!std::filesystem::exists(file, ec))
    throw ConfigFileError({{SourceLocation{name, 0, 0}, "", "config file does not exist", {}, {}, false}});
  if (std::filesystem::is_directory(file, ec))
    throw ConfigFileError({{SourceLocation{name, 0, 0}, "", "is a directory, expected a TOML file", {}, {}, false}});
  std::ifstream in(file, std::ios::binary);
  if (!in)
    throw ConfigFileError({{SourceLocation{name, 0, 0}, "", "cannot open config file for reading", {}, {}, false}});
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_text(ss.str(), name);
}

ConfigNode load_toml_string(std::string_view text, std::string name) {
  return parse_text(text, std::make_shared<const std::string>(std::move(name)));
}

const ConfigNode* lookup(const ConfigNode& root, const ConfigPath& path) {
  const ConfigNode* cur = &root;
  for (const auto& seg : path.segments()) {
    if (const auto* k = std::get_if<std::string>(&seg)) {
      cur = cur->find(*k);
    } else {
      const std::size_t i = std::get<std::size_t>(seg);
      if (!cur->is_array() || i >= cur->as_array().size()) return nullptr;
      cur = &cur->as_array()[i];
    }
    if (cur == nullptr) return nullptr;
  }
  return cur;
}

// --- TOML writer -----------------------------------------------------------------

namespace {

bool is_bare_key(std::string_view k) {
  if (k.empty()) return false;
  for (char c : k)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  return true;
}

std::string key_str(std::string_view k) { return is_bare_key(k) ? std::string(k) : toml_quote(k); }

std::string inline_value(const ConfigNode& n, bool esc) {
  return std::visit(
      [esc](const auto& d) -> std::string {
        using T = std::decay_t<decltype(d)>;
        if constexpr (std::is_same_v<T, std::monostate>) return "\"${null:}\"";
        else if constexpr (std::is_same_v<T, bool>) return d ? "true" : "false";
        else if constexpr (std::is_same_v<T, std::int64_t>) return fmt::format("{}", d);
        else if constexpr (std::is_same_v<T, double>) return format_float(d);
        else if constexpr (std::is_same_v<T, std::string>) return toml_quote(d, /*escape_interpolation=*/esc);
        else if constexpr (std::is_same_v<T, ConfigNode::Array>) {
          std::string s = "[";
          for (std::size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + inline_value(d[i], esc);
          return s + "]";
        } else {
          if (d.empty()) return "{}";
          std::string s = "{ ";
          for (std::size_t i = 0; i < d.size(); ++i)
            s += (i ? ", " : "") + key_str(d[i].first) + " = " + inline_value(d[i].second, esc);
          return s + " }";
        }
      },
      n.data());
}

bool is_array_of_tables(const ConfigNode& n) {
  if (!n.is_array() || n.as_array().empty()) return false;
  for (const auto& x : n.as_array())
    if (!x.is_table()) return false;
  return true;
}

void write_table(std::string& out, const std::string& header, const ConfigNode::Table& t, bool is_array_elem,
                 bool esc) {
  if (!header.empty()) out += fmt::format("\n{}{}{}\n", is_array_elem ? "[[" : "[", header, is_array_elem ? "]]" : "]");
  for (const auto& [k, v] : t)
    if (!v.is_table() && !is_array_of_tables(v)) out += fmt::format("{} = {}\n", key_str(k), inline_value(v, esc));
  for (const auto& [k, v] : t) {
    const std::string sub = header.empty() ? key_str(k) : header + "." + key_str(k);
    if (v.is_table()) write_table(out, sub, v.as_table(), false, esc);
    else if (is_array_of_tables(v))
      for (const auto& e : v.as_array()) write_table(out, sub, e.as_table(), true, esc);
  }
}

}  // namespace

std::string to_toml(const ConfigNode& root, bool escape_interpolations) {
  std::string out;
  if (root.is_table()) write_table(out, "", root.as_table(), false, escape_interpolations);
  if (!out.empty() && out.front() == '\n') out.erase(0, 1);
  return out;
}

}  // namespace modalities::core
