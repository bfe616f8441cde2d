// Registry with transactional per-plugin registration, and a scoped override for tests.
#include <modalities/core/registry.h>

#include <fmt/format.h>

namespace modalities::core {

std::string RegisteredVariant::provenance() const {
  if (!plugin) return fmt::format("({} built in)", spec.id());
  if (plugin->file.empty()) return fmt::format("({} from {} {})", spec.id(), plugin->name, plugin->version);
  return fmt::format("({} from {} {})", spec.id(), plugin->file.filename().string(), plugin->version);
}

Registry::Registry() = default;

const RegisteredVariant* Registry::find(std::string_view ck, std::string_view vk) const {
  auto c = variants_.find(ck);
  if (c == variants_.end()) return nullptr;
  auto v = c->second.find(vk);
  return v == c->second.end() ? nullptr : &v->second;
}

bool Registry::has_component(std::string_view ck) const { return variants_.find(ck) != variants_.end(); }

std::vector<std::string> Registry::component_keys() const {
  std::vector<std::string> out;
  for (const auto& [k, v] : variants_) out.push_back(k);
  return out;
}

std::vector<std::string> Registry::variant_keys(std::string_view ck) const {
  std::vector<std::string> out;
  if (auto c = variants_.find(ck); c != variants_.end())
    for (const auto& [k, v] : c->second) out.push_back(k);
  return out;
}

std::vector<const RegisteredVariant*> Registry::all() const {
  std::vector<const RegisteredVariant*> out;
  for (const auto& [ck, m] : variants_)
    for (const auto& [vk, v] : m) out.push_back(&v);
  return out;
}

// Collects one plugin's registrations without touching the registry.
class StagingRegistrar final : public Registrar {
 public:
  void add_variant(VariantSpec spec) override {
    if (spec.component_key.empty() || spec.variant_key.empty())
      throw Error("a variant was registered with an empty component_key or variant_key");
    if (!spec.build || !spec.validate)
      throw Error(fmt::format("variant {} was registered without a factory", spec.id()));
    variants.push_back(std::move(spec));
  }
  void add_resolver(ResolverSpec spec) override {
    if (spec.name.empty() || !spec.resolve) throw Error("a resolver was registered without a name or function");
    resolvers.push_back(std::move(spec));
  }
  void set_example_config(std::string_view toml) override { example = std::string(toml); }
  void add_run_resume(RunResumeSpec spec) override {
    if (!spec.resume) throw Error("a run resume was registered without a function");
    if (resume) throw Error("a run resume is registered twice");
    resume = std::move(spec);
  }

  std::vector<VariantSpec> variants;
  std::optional<RunResumeSpec> resume;
  std::vector<ResolverSpec> resolvers;
  std::string example;
};

std::optional<std::string> Registry::register_plugin(PluginInfo info,
                                                     const std::function<void(Registrar&)>& register_fn) {
  StagingRegistrar staging;
  try {
    register_fn(staging);
  } catch (const std::exception& e) {
    return fmt::format("registration failed: {}", e.what());
  } catch (...) {
    return std::string("registration failed with an unknown exception");
  }
  const std::string who =
      info.file.empty() ? info.name : fmt::format("{} {}", info.file.filename().string(), info.version);
  // All-or-nothing: check every conflict before committing anything.
  std::map<std::string, bool> seen;
  for (const auto& spec : staging.variants) {
    if (seen[spec.id()]) return fmt::format("variant {} is registered twice by {}", spec.id(), who);
    seen[spec.id()] = true;
    if (const RegisteredVariant* existing = find(spec.component_key, spec.variant_key)) {
      const std::string owner =
          existing->plugin && !existing->plugin->file.empty()
              ? fmt::format("{} {}", existing->plugin->file.filename().string(), existing->plugin->version)
          : existing->plugin ? existing->plugin->name
                             : "the host";
      return fmt::format("variant {} registered twice: {} and {}", spec.id(), owner, who);
    }
  }
  std::map<std::string, bool> seen_resolvers;
  for (const auto& r : staging.resolvers) {
    if (seen_resolvers[r.name]) return fmt::format("resolver '{}' is registered twice by {}", r.name, who);
    seen_resolvers[r.name] = true;
    if (r.name == "cuda_env" || r.name == "modalities_env" || r.name == "node_env" || r.name == "null" ||
        r.name == "warmstart_env")
      return fmt::format("resolver '{}' is built into the host and cannot be replaced by {}", r.name, who);
    if (auto it = resolver_owner_.find(r.name); it != resolver_owner_.end())
      return fmt::format("resolver '{}' registered twice: {} and {}", r.name, it->second, who);
  }
  if (staging.resume && run_resume_)
    return fmt::format("a run resume is registered twice: {} and {}", run_resume_owner_, who);

  info.example_config = std::move(staging.example);
  for (const auto& spec : staging.variants) info.variants.push_back(spec.id());
  auto plugin = std::make_shared<const PluginInfo>(std::move(info));
  for (auto& spec : staging.variants) {
    std::string ck = spec.component_key, vk = spec.variant_key;
    variants_[ck].insert_or_assign(vk, RegisteredVariant{std::move(spec), plugin});
  }
  for (auto& r : staging.resolvers) {
    resolver_owner_[r.name] = who;
    resolvers_.push_back(std::move(r));
  }
  if (staging.resume) {
    run_resume_ = std::move(staging.resume);
    run_resume_owner_ = who;
  }
  plugins_.push_back(std::move(plugin));
  return std::nullopt;
}

Registry::Override::Override(Registry& r, VariantSpec spec) : r_(r), ck_(spec.component_key), vk_(spec.variant_key) {
  if (const RegisteredVariant* existing = r.find(ck_, vk_)) previous_ = *existing;
  auto plugin = std::make_shared<const PluginInfo>(PluginInfo{"test-override", "0", {}, {}, {spec.id()}});
  r.variants_[ck_].insert_or_assign(vk_, RegisteredVariant{std::move(spec), std::move(plugin)});
}

Registry::Override::~Override() {
  if (previous_) {
    r_.variants_[ck_].insert_or_assign(vk_, std::move(*previous_));
  } else {
    auto c = r_.variants_.find(ck_);
    c->second.erase(vk_);
    if (c->second.empty()) r_.variants_.erase(c);
  }
}

std::string PluginProblem::str() const { return fmt::format("{}: {}", file.string(), reason); }

}  // namespace modalities::core
