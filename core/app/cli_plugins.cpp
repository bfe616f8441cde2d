// `modalities plugins list | describe | smoke`.
#include "cli.h"

#include <modalities/core/conformance.h>
#include <modalities/core/graph.h>

#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <iostream>

namespace modalities::cli {

namespace {

std::string plugin_label(const core::RegisteredVariant& v) {
  if (!v.plugin || v.plugin->file.empty()) return "(built in)";
  return fmt::format("{} {}", v.plugin->file.filename().string(), v.plugin->version);
}

int list(const std::vector<std::string>& args) {
  core::PluginOptions popts;
  po::options_description desc("Options");
  desc.add_options()("help,h", "this help")("paths", po::bool_switch(), "show the full path of each plugin file");
  desc.add(plugin_options(popts));
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, {}, vm, "usage: modalities plugins list [options]\n\nLists every loaded variant.", status))
    return status;
  core::Registry registry;
  core::PluginHost host(registry);
  if (!load_plugins_or_report(host, popts)) return kPluginError;
  const bool paths = vm["paths"].as<bool>();
  std::size_t width = 0;
  for (const auto* v : registry.all()) width = std::max(width, v->spec.id().size());
  std::string current;
  for (const auto* v : registry.all()) {
    if (v->spec.component_key != current) {
      current = v->spec.component_key;
      fmt::print("{}{}\n", current == registry.all().front()->spec.component_key ? "" : "\n", current);
    }
    fmt::print("  {:<{}}  -> {:<10} {}\n", v->spec.id(), width, v->spec.produces,
               paths && v->plugin ? v->plugin->file.string() + " " + v->plugin->version : plugin_label(*v));
  }
  if (!registry.plugin_resolvers().empty()) {
    fmt::print("\nresolvers from plugins\n");
    for (const auto& r : registry.plugin_resolvers()) fmt::print("  ${{{}:...}}  {}\n", r.name, r.help);
  }
  fmt::print("\n{} variants of {} components from {} plugins\n", registry.all().size(),
             registry.component_keys().size(), registry.plugins().size());
  return kOk;
}

void print_fields(const std::vector<FieldInfo>& fields, int indent) {
  for (const auto& f : fields) {
    std::string line = fmt::format("{:{}}{}: {}", "", indent, f.name, f.type);
    if (f.required) line += "  (required)";
    else line += fmt::format("  = {}", f.default_repr);
    if (!f.constraints.empty()) line += fmt::format("  [{}]", fmt::join(f.constraints, "; "));
    if (!f.aliases.empty()) line += fmt::format("  (deprecated alias: {})", fmt::join(f.aliases, ", "));
    fmt::print("{}\n{:{}}    {}\n", line, "", indent, f.help);
    if (!f.children.empty()) print_fields(f.children, indent + 4);
  }
}

int describe(const std::vector<std::string>& args) {
  core::PluginOptions popts;
  po::options_description desc("Options");
  desc.add_options()("help,h", "this help")("id", po::value<std::string>()->required(),
                                            "<component_key>/<variant_key>, e.g. layer_norm/rms_norm");
  desc.add(plugin_options(popts));
  po::positional_options_description pos;
  pos.add("id", 1);
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, pos, vm,
             "usage: modalities plugins describe <component_key>/<variant_key>\n\nPrints a variant's config schema.",
             status))
    return status;
  core::Registry registry;
  core::PluginHost host(registry);
  if (!load_plugins_or_report(host, popts)) return kPluginError;
  const std::string id = vm["id"].as<std::string>();
  const auto slash = id.find('/');
  if (slash == std::string::npos) {
    print_error(fmt::format("'{}' is not of the form <component_key>/<variant_key>", id));
    return kUsage;
  }
  const std::string ck = id.substr(0, slash), vk = id.substr(slash + 1);
  const core::RegisteredVariant* v = registry.find(ck, vk);
  if (v == nullptr) {
    std::vector<std::string> ids;
    for (const auto* x : registry.all()) ids.push_back(x->spec.id());
    const std::string near = closest_match(id, ids);
    print_error(fmt::format("no loaded plugin registers {}{}", id,
                            near.empty() ? "" : fmt::format(" (did you mean {}?)", near)));
    return kFailed;
  }
  fmt::print("{}\n  {}\n\n  produces: {}\n  plugin:   {}\n\nconfig keys:\n", v->spec.id(), v->spec.summary,
             v->spec.produces,
             v->plugin && !v->plugin->file.empty()
                 ? fmt::format("{} {} ({})", v->plugin->name, v->plugin->version, v->plugin->file.string())
                 : std::string("built in"));
  if (v->spec.fields.empty()) fmt::print("  (none: write `config = {{}}`)\n");
  print_fields(v->spec.fields, 2);
  return kOk;
}

// Collects the (component_key, variant_key) ids of every component node in a tree.
void collect_ids(const core::ConfigNode& n, std::vector<std::string>& out) {
  if (n.is_table()) {
    const auto* ck = n.find("component_key");
    const auto* vk = n.find("variant_key");
    if (ck != nullptr && vk != nullptr && ck->is_string() && vk->is_string())
      out.push_back(ck->as_string() + "/" + vk->as_string());
    for (const auto& [k, v] : n.as_table()) collect_ids(v, out);
  } else if (n.is_array()) {
    for (const auto& x : n.as_array()) collect_ids(x, out);
  }
}

int smoke(const std::vector<std::string>& args) {
  core::PluginOptions popts;
  po::options_description desc("Options");
  desc.add_options()("help,h", "this help")("file", po::value<std::string>()->required(), "plugin .so to test");
  desc.add(plugin_options(popts));
  po::positional_options_description pos;
  pos.add("file", 1);
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, pos, vm,
             "usage: modalities plugins smoke <file.so>\n\n"
             "Loads one plugin (other plugins load as usual, for the components its example\n"
             "needs), builds every top-level node of the example config it embeds, warns\n"
             "about registered variants the example does not use, and runs the conformance\n"
             "checks of each produced interface. Exit status 0 only if everything built and\n"
             "passed.",
             status))
    return status;
  const std::filesystem::path file = vm["file"].as<std::string>();
  core::Registry registry;
  core::PluginHost host(registry);
  // The plugin under test first, so that a bundled copy of it does not shadow it.
  if (auto problem = host.load_file(file)) {
    print_error(fmt::format("plugin {}: {}", problem->file.string(), problem->reason));
    return kFailed;
  }
  if (!load_plugins_or_report(host, popts)) return kPluginError;
  std::shared_ptr<const core::PluginInfo> plugin;
  for (const auto& p : registry.plugins())
    if (p->file == file) plugin = p;
  if (!plugin) {
    print_error("internal: plugin loaded but not recorded");
    return kFailed;
  }
  fmt::print("plugin {} {} ({}): {} variant(s)\n", plugin->name, plugin->version, file.string(),
             plugin->variants.size());
  if (plugin->example_config.empty()) {
    print_error("the plugin embeds no example config (modalities_add_plugin(... EXAMPLE_CONFIG configs/example.toml))");
    return kFailed;
  }
  int failures = 0;
  try {
    const std::string name = plugin->name + ":configs/example.toml";
    core::ConfigNode root = core::load_toml_string(plugin->example_config, name);
    core::resolve_interpolations(root, core::resolvers_for(registry, core::env_for_config(name)));
    std::vector<std::string> ids;
    collect_ids(root, ids);
    for (const auto& id : plugin->variants) {
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) {
        print_warning(fmt::format("variant {} is not used by the example config, so it was not smoke-tested", id));
      }
    }
    core::ComponentGraph graph(registry, root, nullptr);
    const core::BuiltGraph built = graph.build([](const std::string& line) { fmt::print("  {}\n", line); });
    for (const auto& [key, value] : built.top_level) {
      for (const auto& problem : core::check_conformance(value)) {
        print_error(fmt::format("{}: {}", key, problem));
        ++failures;
      }
    }
  } catch (const std::exception& e) {
    print_error(e.what());
    return kFailed;
  }
  if (failures > 0) {
    fmt::print("smoke test FAILED: {} problem(s)\n", failures);
    return kFailed;
  }
  fmt::print("smoke test passed: {} variant(s) built from the example config, conformance checks passed\n",
             plugin->variants.size());
  return kOk;
}

}  // namespace

int run_plugins(const std::vector<std::string>& args) {
  constexpr const char* usage =
      "usage: modalities plugins <list|describe|smoke> [<args>]\n\n"
      "  list                       every loaded variant with its plugin file\n"
      "  describe <ck>/<vk>         config schema of one variant\n"
      "  smoke <file.so>            test one plugin from its embedded example config\n";
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::cout << usage;
    return args.empty() ? kUsage : kOk;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (args[0] == "list") return list(rest);
  if (args[0] == "describe") return describe(rest);
  if (args[0] == "smoke") return smoke(rest);
  print_error(fmt::format("unknown plugins command '{}'\n\n{}", args[0], usage));
  return kUsage;
}

}  // namespace modalities::cli
