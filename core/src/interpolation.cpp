// Eager, whole-document interpolation with memoisation and cycle detection.
// Resolved nodes are replaced in place; the set `final_` remembers which
// string nodes are already final, since a resolved string may legitimately
// contain a literal "${" (from the escape "\${").
#include <modalities/core/interpolation.h>
#include <modalities/sdk/schema.h>

#include <fmt/format.h>

#include <algorithm>
#include <set>

namespace modalities::core {

bool has_interpolation(std::string_view s) { return s.find("${") != std::string_view::npos; }

namespace {

struct Part {
  bool interpolation = false;
  std::string text;  // literal text, or the expression inside ${...}
};

// Splits "a${x}b\${c" into parts; throws Error on an unterminated or empty ${.
std::vector<Part> split_parts(std::string_view s) {
  std::vector<Part> parts;
  std::string literal;
  for (std::size_t i = 0; i < s.size();) {
    if (s[i] == '\\' && s.substr(i, 3) == "\\${") {
      literal += "${";
      i += 3;
    } else if (s.substr(i, 2) == "${") {
      std::size_t depth = 1, j = i + 2;
      for (; j < s.size() && depth > 0; ++j) {
        if (s[j] == '{') ++depth;
        else if (s[j] == '}') --depth;
      }
      if (depth != 0) throw Error(fmt::format("unterminated '${{' in \"{}\"", s));
      const std::string expr(s.substr(i + 2, j - i - 3));
      if (expr.empty()) throw Error("empty interpolation '${}'");
      if (!literal.empty()) parts.push_back({false, std::move(literal)});
      literal.clear();
      parts.push_back({true, expr});
      i = j;
    } else {
      literal += s[i++];
    }
  }
  if (!literal.empty() || parts.empty()) parts.push_back({false, std::move(literal)});
  return parts;
}

class Interpolator {
 public:
  Interpolator(ConfigNode& root, const ResolverTable& resolvers) : root_(root), resolvers_(resolvers) {}

  void run() {
    ensure_subtree_resolved(ConfigPath());
    if (!diagnostics_.empty()) throw ConfigFileError(std::move(diagnostics_));
  }

 private:
  ConfigNode& node_at(const ConfigPath& p) { return *const_cast<ConfigNode*>(lookup(root_, p)); }

  bool needs_resolution(const ConfigPath& p, const ConfigNode& n) const {
    return n.is_string() && has_interpolation(n.as_string()) && !final_.contains(p.str());
  }

  void mark_final(const ConfigPath& p) {
    const ConfigNode* n = lookup(root_, p);
    if (n == nullptr) return;
    if (n->is_string()) final_.insert(p.str());
    else if (n->is_table())
      for (const auto& [k, v] : n->as_table()) mark_final(p.child(k));
    else if (n->is_array())
      for (std::size_t i = 0; i < n->as_array().size(); ++i) mark_final(p.index(i));
  }

  void resolve_at(const ConfigPath& p) {
    const std::string key = p.str();
    if (auto it = std::find(stack_.begin(), stack_.end(), key); it != stack_.end()) {
      std::string chain;
      for (; it != stack_.end(); ++it) chain += *it + " -> ";
      throw CycleError{chain + key};
    }
    stack_.push_back(key);
    ConfigNode& n = node_at(p);
    const SourceLocation where = n.where();
    const std::string text = n.as_string();
    try {
      ConfigNode result = evaluate(text, where);
      node_at(p) = std::move(result);
      mark_final(p);
    } catch (const CycleError& c) {
      // Every node on the cycle becomes null so that it is reported once.
      stack_.pop_back();
      node_at(p) = ConfigNode({}, where);
      mark_final(p);
      if (!stack_.empty()) throw;
      report(where, key, "interpolation cycle: " + c.chain);
      return;
    } catch (const std::exception& e) {
      report(where, key, e.what(), hint_);
      hint_.clear();
      node_at(p) = ConfigNode({}, where);
      mark_final(p);
    }
    if (!stack_.empty() && stack_.back() == key) stack_.pop_back();
  }

  ConfigNode evaluate(const std::string& text, const SourceLocation& where) {
    const std::vector<Part> parts = split_parts(text);
    if (parts.size() == 1 && parts[0].interpolation) {
      ConfigNode v = resolve_expression(parts[0].text, where);
      v.set_where(where);
      return v;
    }
    std::string out;
    for (const auto& part : parts) {
      if (!part.interpolation) {
        out += part.text;
        continue;
      }
      const ConfigNode v = resolve_expression(part.text, where);
      out += std::visit(
          [&](const auto& d) -> std::string {
            using T = std::decay_t<decltype(d)>;
            if constexpr (std::is_same_v<T, std::string>) return d;
            else if constexpr (std::is_same_v<T, bool>) return d ? "true" : "false";
            else if constexpr (std::is_same_v<T, std::int64_t>) return fmt::format("{}", d);
            else if constexpr (std::is_same_v<T, double>) return format_float(d);
            else
              throw Error(fmt::format("'${{{}}}' is {} and cannot be embedded in a string; use it as the whole value",
                                      part.text, v.type_name()));
          },
          v.data());
    }
    return ConfigNode(std::move(out), where);
  }

  ConfigNode resolve_expression(const std::string& expr, const SourceLocation& where) {
    if (const auto colon = expr.find(':'); colon != std::string::npos) {
      const std::string name = expr.substr(0, colon);
      const std::string arg = expr.substr(colon + 1);
      const ResolverSpec* r = resolvers_.find(name);
      if (r == nullptr) {
        const auto names = resolvers_.names();
        const std::string near = closest_match(name, names);
        hint_ = near.empty() ? "known resolvers: " + quoted_list(names) : fmt::format("did you mean '{}'?", near);
        throw Error(fmt::format("unknown resolver '{}'", name));
      }
      Value v;
      try {
        v = r->resolve(arg);
      } catch (const std::exception& e) {
        throw Error(fmt::format("${{{}}}: {}", expr, e.what()));
      }
      return ConfigNode::from_value(v, where);
    }
    const ConfigPath target = ConfigPath::parse(expr);
    ConfigPath walked;
    for (const auto& seg : target.segments()) {
      ensure_resolved(walked);
      const ConfigNode* cur = lookup(root_, walked);
      const ConfigPath next = std::holds_alternative<std::string>(seg) ? walked.child(std::get<std::string>(seg))
                                                                       : walked.index(std::get<std::size_t>(seg));
      // Numeric dotted segments ("a.0") index arrays too.
      ConfigPath resolved_next = next;
      if (cur != nullptr && cur->is_array() && std::holds_alternative<std::string>(seg)) {
        const std::string& s = std::get<std::string>(seg);
        if (!s.empty() && std::all_of(s.begin(), s.end(), ::isdigit)) resolved_next = walked.index(std::stoul(s));
      }
      if (cur == nullptr || lookup(root_, resolved_next) == nullptr) {
        if (cur != nullptr && cur->is_table() && std::holds_alternative<std::string>(seg)) {
          std::vector<std::string> keys;
          for (const auto& [k, v] : cur->as_table()) keys.push_back(k);
          if (auto near = closest_match(std::get<std::string>(seg), keys); !near.empty())
            hint_ = fmt::format(
                "did you mean '{}'?",
                resolved_next.str().substr(0, resolved_next.str().size() - std::get<std::string>(seg).size()) + near);
        }
        throw Error(fmt::format("interpolation '${{{}}}': no value at '{}'", expr, resolved_next.str()));
      }
      walked = resolved_next;
    }
    ensure_resolved(walked);
    ensure_subtree_resolved(walked);
    return *lookup(root_, walked);  // deep copy: interpolation copies, references share
  }

  void ensure_resolved(const ConfigPath& p) {
    const ConfigNode* n = lookup(root_, p);
    if (n != nullptr && needs_resolution(p, *n)) resolve_at(p);
  }

  // Resolves every string under `p`, in document order.
  void ensure_subtree_resolved(const ConfigPath& p) {
    const ConfigNode* n = lookup(root_, p);
    if (n == nullptr) return;
    if (n->is_string()) {
      ensure_resolved(p);
    } else if (n->is_table()) {
      std::vector<std::string> keys;
      for (const auto& [k, v] : n->as_table()) keys.push_back(k);
      for (const auto& k : keys) ensure_subtree_resolved(p.child(k));
    } else if (n->is_array()) {
      const std::size_t size = n->as_array().size();
      for (std::size_t i = 0; i < size; ++i) ensure_subtree_resolved(p.index(i));
    }
  }

  void report(const SourceLocation& where, const std::string& path, std::string message, std::string hint = {}) {
    diagnostics_.push_back({where, path, std::move(message), std::move(hint), {}, false});
  }

  struct CycleError {
    std::string chain;
  };

  ConfigNode& root_;
  const ResolverTable& resolvers_;
  std::vector<std::string> stack_;
  std::set<std::string> final_;
  std::vector<Diagnostic> diagnostics_;
  std::string hint_;
};

}  // namespace

void resolve_interpolations(ConfigNode& root, const ResolverTable& resolvers) { Interpolator(root, resolvers).run(); }

}  // namespace modalities::core
