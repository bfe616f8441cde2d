// Validation and construction of the component graph (docs/configs.md).
//
// Node kinds are detected more strictly than in Modalities (docs/differences.md):
// a component node may only hold component_key, variant_key and config; a
// reference must be exactly {instance_key, pass_type = "BY_REFERENCE"}; and
// near misses are errors instead of silently becoming plain tables.
#include <modalities/core/graph.h>
#include <modalities/sdk/schema.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>

namespace modalities::core {

namespace {

class NodeBuildContext final : public BuildContext {
 public:
  NodeBuildContext(std::string path, const std::function<void(const std::string&)>& log, const Registry& registry,
                   const Value& config)
      : path_(std::move(path)), log_(log), registry_(registry), config_(config) {}
  std::string_view path() const override { return path_; }
  void warn(std::string message) override {
    if (log_) log_(fmt::format("warning: {}: {}", path_, message));
  }
  const Value& config() const override { return config_; }
  // A factory's nested build (registrar.h): the variant's own factory, with a context whose path
  // says on whose behalf it builds. Its errors reach the outer factory's caller, which reports
  // them at this node.
  Value build(std::string_view component_key, std::string_view variant_key, Value config) override {
    const RegisteredVariant* variant = registry_.find(component_key, variant_key);
    if (variant == nullptr)
      throw Error(fmt::format("{}/{} is not registered: no loaded plugin provides it", component_key, variant_key));
    NodeBuildContext inner(fmt::format("{} (as {})", path_, variant->spec.id()), log_, registry_, config);
    return variant->spec.build(config, inner);
  }

 private:
  std::string path_;
  const std::function<void(const std::string&)>& log_;
  const Registry& registry_;
  const Value& config_;
};

std::string_view pass_type_hint() {
  return "write { instance_key = \"<top-level key>\", pass_type = \"BY_REFERENCE\" }";
}

}  // namespace

const Value* BuiltGraph::get(std::string_view key) const {
  for (const auto& [k, v] : top_level)
    if (k == key) return &v;
  return nullptr;
}

bool satisfies(const Value& v, std::string_view expects) {
  if (expects.empty()) return true;
  if (v.is_pending() && v.as_pending().produces.empty()) return true;  // already reported
  if (expects.starts_with("list<") && expects.ends_with(">")) {
    if (!v.is_list()) return false;
    const std::string_view inner = expects.substr(5, expects.size() - 6);
    return std::all_of(v.as_list().begin(), v.as_list().end(), [&](const Value& x) { return satisfies(x, inner); });
  }
  if (expects == "table") return v.is_table();
  if (expects == "int") return v.is_int() || (v.is_pending() && v.as_pending().produces == "int");
  if (v.is_object()) return v.as_object().interface == expects;
  if (v.is_pending()) return v.as_pending().produces == expects;
  return false;
}

ComponentGraph::ComponentGraph(const Registry& registry, const ConfigNode& resolved_root,
                               const PipelineProfile* profile)
    : registry_(registry), root_(resolved_root), profile_(profile) {}

void ComponentGraph::error(const ConfigNode& at, const ConfigPath& p, std::string message, std::string hint,
                           std::string context) {
  diagnostics_.push_back({at.where(), p.str(), std::move(message), std::move(hint), std::move(context), false});
}

SourceLocation ComponentGraph::locate(const ConfigPath& p) const {
  // The node itself, or its nearest existing ancestor (e.g. the table missing a key).
  std::vector<ConfigPath::Segment> segs = p.segments();
  while (true) {
    ConfigPath q;
    for (const auto& s : segs)
      q = std::holds_alternative<std::string>(s) ? q.child(std::get<std::string>(s))
                                                 : q.index(std::get<std::size_t>(s));
    if (const ConfigNode* n = lookup(root_, q); n != nullptr && (n->where().line != 0 || segs.empty()))
      return n->where();
    if (segs.empty()) return root_.where();
    segs.pop_back();
  }
}

ComponentGraph::NodeKind ComponentGraph::classify(const ConfigNode& n, const ConfigPath& p) {
  if (n.is_array()) return NodeKind::kArray;
  if (!n.is_table()) return NodeKind::kScalar;
  const bool report = !reported_[p.str()];
  auto fail = [&](std::string msg, std::string hint = {}) {
    if (report) error(n, p, std::move(msg), std::move(hint));
    reported_[p.str()] = true;
    return NodeKind::kInvalid;
  };
  if (n.has("component_key")) {
    for (const auto& [k, v] : n.as_table())
      if (k != "component_key" && k != "variant_key" && k != "config")
        return fail(
            fmt::format("unexpected key '{}' in a component node (allowed: component_key, variant_key, config)", k),
            "move it into the node's config table");
    const ConfigNode* ck = n.find("component_key");
    const ConfigNode* vk = n.find("variant_key");
    const ConfigNode* cfg = n.find("config");
    if (!ck->is_string()) return fail(fmt::format("component_key must be a string, got {}", ck->type_name()));
    if (vk == nullptr) return fail("component node has no variant_key");
    if (!vk->is_string()) return fail(fmt::format("variant_key must be a string, got {}", vk->type_name()));
    if (cfg == nullptr) return fail("component node has no config table", "write `config = {}` for an empty config");
    if (!cfg->is_table()) return fail(fmt::format("config must be a table, got {}", cfg->type_name()));
    return NodeKind::kComponent;
  }
  if (n.has("instance_key") || n.has("pass_type")) {
    const ConfigNode* ik = n.find("instance_key");
    const ConfigNode* pt = n.find("pass_type");
    if (ik == nullptr) return fail("reference has pass_type but no instance_key", std::string(pass_type_hint()));
    for (const auto& [k, v] : n.as_table())
      if (k != "instance_key" && k != "pass_type")
        return fail(
            fmt::format("unexpected key '{}' in a reference (a reference has exactly instance_key and pass_type)", k),
            std::string(pass_type_hint()));
    if (pt == nullptr) return fail("reference has no pass_type", std::string(pass_type_hint()));
    if (!ik->is_string()) return fail(fmt::format("instance_key must be a string, got {}", ik->type_name()));
    if (!pt->is_string()) return fail(fmt::format("pass_type must be a string, got {}", pt->type_name()));
    const std::string& t = pt->as_string();
    if (t == "BY_VALUE" || t == "by_value")
      return fail("pass_type BY_VALUE is not supported (Modalities silently treats it as BY_REFERENCE)",
                  "use BY_REFERENCE to share the instance, or ${path} interpolation to build a copy");
    if (t != "BY_REFERENCE" && t != "by_reference")
      return fail(fmt::format("unknown pass_type '{}'", t), "use \"BY_REFERENCE\"");
    return NodeKind::kReference;
  }
  if (n.has("variant_key"))
    return fail("table has variant_key but no component_key", "add component_key, or rename the key");
  return NodeKind::kTable;
}

void ComponentGraph::map_field_errors(const std::vector<FieldError>& errs, const ConfigPath& config_path,
                                      const RegisteredVariant& v, bool warning) {
  map_errors(errs, config_path, v.provenance(), warning);
}

void ComponentGraph::map_errors(const std::vector<FieldError>& errs, const ConfigPath& base, const std::string& context,
                                bool warning) {
  for (const auto& e : errs) {
    const ConfigPath full = e.path.empty() ? base : base / ConfigPath::parse(e.path);
    diagnostics_.push_back({locate(full), full.str(), e.message, e.hint, context, warning});
  }
}

void ComponentGraph::run_entry_checks(const std::string& key, const Value& v, bool dry_run) {
  if (profile_ == nullptr) return;
  for (const auto& e : profile_->entries) {
    if (e.key != key || !e.check) continue;
    std::vector<FieldError> errors, warnings;
    ParseContext ctx(dry_run, &errors, &warnings);
    e.check(v, ctx);
    const std::string context = fmt::format("(pipeline '{}')", profile_->name);
    map_errors(errors, ConfigPath().child(key), context, false);
    map_errors(warnings, ConfigPath().child(key), context, true);
  }
}

Value ComponentGraph::dry(const ConfigNode& n, const ConfigPath& p) {
  switch (classify(n, p)) {
    case NodeKind::kInvalid: return Pending{"", p.str()};
    case NodeKind::kScalar: return n.to_value();
    case NodeKind::kArray: {
      Value::List l;
      for (std::size_t i = 0; i < n.as_array().size(); ++i) l.push_back(dry(n.as_array()[i], p.index(i)));
      return l;
    }
    case NodeKind::kTable: {
      Value::Table t;
      for (const auto& [k, v] : n.as_table()) t.emplace_back(k, dry(v, p.child(k)));
      return t;
    }
    case NodeKind::kReference: return dry_top(n.find("instance_key")->as_string(), &n, p);
    case NodeKind::kComponent: break;
  }
  const std::string& ck = n.find("component_key")->as_string();
  const std::string& vk = n.find("variant_key")->as_string();
  const ConfigPath cfg_path = p.child("config");
  const ConfigNode& cfg = *n.find("config");
  // Children first, so nested nodes are checked even when this one is unknown.
  Value::Table config;
  for (const auto& [k, v] : cfg.as_table()) config.emplace_back(k, dry(v, cfg_path.child(k)));

  const RegisteredVariant* variant = registry_.find(ck, vk);
  if (variant == nullptr) {
    if (!registry_.has_component(ck)) {
      const auto keys = registry_.component_keys();
      const std::string near = closest_match(ck, keys);
      error(*n.find("component_key"), p.child("component_key"), fmt::format("unknown component_key '{}'", ck),
            near.empty() ? "no loaded plugin provides it; `modalities plugins list` shows what is loaded"
                         : fmt::format("did you mean '{}'?", near));
    } else {
      const auto variants = registry_.variant_keys(ck);
      const std::string near = closest_match(vk, variants);
      error(*n.find("variant_key"), p.child("variant_key"),
            fmt::format("unknown variant '{}' of component '{}'", vk, ck),
            near.empty()
                ? fmt::format("{} variants loaded: {}", ck, fmt::join(variants, ", "))
                : fmt::format("did you mean '{}'? ({} variants loaded: {})", near, ck, fmt::join(variants, ", ")));
    }
    return Pending{"", ck + "/" + vk};
  }
  std::vector<FieldError> errors, warnings;
  ParseContext ctx(/*dry_run=*/true, &errors, &warnings);
  variant->spec.validate(Value(std::move(config)), ctx);
  map_field_errors(errors, cfg_path, *variant, false);
  map_field_errors(warnings, cfg_path, *variant, true);
  return Pending{variant->spec.produces, variant->spec.id()};
}

// `referrer` is the reference node that led here, or null for the top-level pass
// (which only visits existing keys and starts with nothing in progress).
Value ComponentGraph::dry_top(const std::string& key, const ConfigNode* referrer, const ConfigPath& referrer_path) {
  if (auto it = dry_cache_.find(key); it != dry_cache_.end()) return it->second;
  const ConfigNode* target = root_.find(key);
  if (target == nullptr) {
    std::vector<std::string> keys;
    for (const auto& [k, v] : root_.as_table()) keys.push_back(k);
    const std::string near = closest_match(key, keys);
    error(*referrer->find("instance_key"), referrer_path.child("instance_key"),
          fmt::format("reference to missing top-level key '{}'", key),
          near.empty() ? "references can only name top-level keys" : fmt::format("did you mean '{}'?", near));
    return Pending{"", key};
  }
  if (auto it = std::find(in_progress_.begin(), in_progress_.end(), key); it != in_progress_.end()) {
    std::string chain;
    for (; it != in_progress_.end(); ++it) chain += *it + " -> ";
    error(*referrer, referrer_path, fmt::format("reference cycle: {}{}", chain, key));
    return Pending{"", key};
  }
  in_progress_.push_back(key);
  Value v = dry(*target, ConfigPath().child(key));
  in_progress_.pop_back();
  dry_cache_[key] = v;
  return v;
}

std::vector<std::string> ComponentGraph::selection() {
  std::vector<std::string> keys;
  if (profile_ == nullptr) {
    for (const auto& [k, v] : root_.as_table()) keys.push_back(k);
    return keys;
  }
  for (const auto& e : profile_->entries)
    if (root_.has(e.key)) keys.push_back(e.key);
  return keys;
}

std::vector<Diagnostic> ComponentGraph::validate() {
  diagnostics_.clear();
  if (profile_ != nullptr) {
    for (const auto& e : profile_->entries) {
      if (e.required && !root_.has(e.key)) {
        std::vector<std::string> keys;
        for (const auto& [k, v] : root_.as_table()) keys.push_back(k);
        const std::string near = closest_match(e.key, keys);
        diagnostics_.push_back({root_.where(),
                                e.key,
                                fmt::format("missing top-level key '{}' required by pipeline '{}' ({}: {})", e.key,
                                            profile_->name, e.expects.empty() ? "any" : e.expects, e.help),
                                near.empty() ? "" : fmt::format("did you mean '{}'?", near),
                                {},
                                false});
      }
    }
  }
  for (const auto& key : selection()) {
    const ConfigNode& node = *root_.find(key);
    const Value v = dry_top(key, nullptr, ConfigPath());
    run_entry_checks(key, v, /*dry_run=*/true);
    if (profile_ != nullptr) {
      for (const auto& e : profile_->entries)
        if (e.key == key && !satisfies(v, e.expects))
          diagnostics_.push_back(
              {node.where(),
               key,
               fmt::format("pipeline '{}' needs {} here, got {}", profile_->name, e.expects, v.type_name()),
               {},
               {},
               false});
    }
  }
  return diagnostics_;
}

Value ComponentGraph::build_node(const ConfigNode& n, const ConfigPath& p,
                                 const std::function<void(const std::string&)>& log) {
  if (p.size() == 1)
    if (auto it = built_cache_.find(std::get<std::string>(p.segments()[0])); it != built_cache_.end())
      return it->second;
  switch (classify(n, p)) {
    case NodeKind::kInvalid: throw ConfigFileError(diagnostics_);  // unreachable after validate()
    case NodeKind::kScalar: return n.to_value();
    case NodeKind::kArray: {
      Value::List l;
      for (std::size_t i = 0; i < n.as_array().size(); ++i) l.push_back(build_node(n.as_array()[i], p.index(i), log));
      return l;
    }
    case NodeKind::kTable: {
      Value::Table t;
      for (const auto& [k, v] : n.as_table()) t.emplace_back(k, build_node(v, p.child(k), log));
      return t;
    }
    case NodeKind::kReference: {
      const std::string& key = n.find("instance_key")->as_string();
      if (auto it = built_cache_.find(key); it != built_cache_.end()) return it->second;
      Value v = build_node(*root_.find(key), ConfigPath().child(key), log);
      built_cache_[key] = v;
      return v;
    }
    case NodeKind::kComponent: break;
  }
  const RegisteredVariant& variant =
      *registry_.find(n.find("component_key")->as_string(), n.find("variant_key")->as_string());
  const ConfigPath cfg_path = p.child("config");
  Value::Table config;
  for (const auto& [k, v] : n.find("config")->as_table()) config.emplace_back(k, build_node(v, cfg_path.child(k), log));
  const Value config_value(std::move(config));
  NodeBuildContext ctx(p.str(), warn_, registry_, config_value);
  Value result;
  try {
    result = variant.spec.build(config_value, ctx);
  } catch (const ConfigError& e) {
    map_field_errors(e.errors(), cfg_path, variant, false);
    throw ConfigFileError(diagnostics_);
  } catch (const std::exception& e) {
    diagnostics_.push_back({n.where(),
                            p.str(),
                            fmt::format("building {} failed: {}", variant.spec.id(), e.what()),
                            {},
                            variant.provenance(),
                            false});
    throw ConfigFileError(diagnostics_);
  }
  if (log) {
    std::string path;
    for (const auto& seg : p.segments())
      path += (path.empty() ? "" : " -> ") + (std::holds_alternative<std::string>(seg)
                                                  ? std::get<std::string>(seg)
                                                  : std::to_string(std::get<std::size_t>(seg)));
    log(fmt::format("Instantiated {} -> {}: {}", variant.spec.id(),
                    result.is_object() ? result.as_object().interface : result.repr(), path));
  }
  if (p.size() == 1) built_cache_[std::get<std::string>(p.segments()[0])] = result;
  return result;
}

BuiltGraph ComponentGraph::build(const std::function<void(const std::string&)>& log,
                                 const std::function<void(const std::string&)>& warn) {
  warn_ = warn ? warn : log;
  std::vector<Diagnostic> found = validate();
  std::vector<Diagnostic> errors;
  for (auto& d : found) {
    if (d.warning) {
      if (warn_) warn_(d.str());
    } else {
      errors.push_back(d);
    }
  }
  if (!errors.empty()) throw ConfigFileError(std::move(errors));
  diagnostics_.clear();
  BuiltGraph out;
  for (const auto& key : selection())
    out.top_level.emplace_back(key, build_node(*root_.find(key), ConfigPath().child(key), log));
  // The pipeline's checks again, now on built values (placeholders skipped them before).
  for (const auto& [key, value] : out.top_level) run_entry_checks(key, value, /*dry_run=*/false);
  if (profile_ != nullptr && profile_->check_built) {
    std::vector<FieldError> errors, warnings;
    ParseContext ctx(false, &errors, &warnings);
    profile_->check_built(out, ctx);
    const std::string context = fmt::format("(pipeline '{}')", profile_->name);
    map_errors(errors, ConfigPath(), context, false);
    map_errors(warnings, ConfigPath(), context, true);
  }
  std::vector<Diagnostic> build_errors;
  for (auto& d : diagnostics_) {
    if (!d.warning) build_errors.push_back(d);
    else if (warn_) warn_(d.str());
  }
  if (!build_errors.empty()) throw ConfigFileError(std::move(build_errors));
  return out;
}

std::string ComponentGraph::to_dot() {
  std::string out = "digraph modalities {\n  rankdir=LR;\n  node [fontname=\"Helvetica\"];\n";
  std::set<std::string> declared;
  auto quote = [](const std::string& s) {
    std::string q = "\"";
    for (char c : s) q += (c == '"') ? std::string("\\\"") : std::string(1, c);
    return q + "\"";
  };
  std::function<void(const ConfigNode&, const ConfigPath&, const std::string&)> walk =
      [&](const ConfigNode& n, const ConfigPath& p, const std::string& owner) {
        const NodeKind kind = classify(n, p);
        if (kind == NodeKind::kReference) {
          const auto& last = p.segments().back();
          const std::string label = std::holds_alternative<std::string>(last)
                                        ? std::get<std::string>(last)
                                        : fmt::format("[{}]", std::get<std::size_t>(last));
          out += fmt::format("  {} -> {} [style=dashed, label={}];\n", quote(owner),
                             quote(n.find("instance_key")->as_string()), quote(label));
          return;
        }
        std::string next_owner = owner;
        if (kind == NodeKind::kComponent) {
          const std::string id = n.find("component_key")->as_string() + "/" + n.find("variant_key")->as_string();
          const std::string name = p.str();
          if (declared.insert(name).second || p.size() == 1)
            out += fmt::format("  {} [shape={}, label={}];\n", quote(name), p.size() == 1 ? "box" : "ellipse",
                               quote(name + "\\n" + id));
          if (!owner.empty() && owner != name) out += fmt::format("  {} -> {};\n", quote(owner), quote(name));
          next_owner = name;
        }
        if (n.is_table()) {
          for (const auto& [k, v] : n.as_table())
            walk(v, p.child(k), next_owner.empty() ? p.child(k).str() : next_owner);
        } else if (n.is_array()) {
          for (std::size_t i = 0; i < n.as_array().size(); ++i)
            walk(n.as_array()[i], p.index(i), next_owner.empty() ? p.str() : next_owner);
        }
      };
  for (const auto& [k, v] : root_.as_table()) {
    if (declared.insert(k).second) out += fmt::format("  {} [shape=box, label={}];\n", quote(k), quote(k));
    walk(v, ConfigPath().child(k), k);
  }
  return out + "}\n";
}

}  // namespace modalities::core
