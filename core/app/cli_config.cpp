// `modalities config validate | resolve | graph | build`.
#include "cli.h"

#include <modalities/core/graph.h>

#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <iostream>

namespace modalities::cli {

namespace {

struct ConfigArgs {
  std::string file;
  std::string pipeline;
  std::string experiments_root_path;
  std::string experiment_id;
  std::string last_checkpoint_info_file_path;
};

po::options_description config_options(ConfigArgs& a) {
  po::options_description d("Config options");
  d.add_options()("help,h", "this help")("config_file_path", po::value(&a.file)->required(),
                                         "the TOML config (also accepted as the first positional argument)")(
      "pipeline", po::value(&a.pipeline),
      "check against a command's pipeline profile: training, packing, text_generation, profiling "
      "(default: every top-level key)")(
      "experiments_root_path", po::value(&a.experiments_root_path)->default_value("experiments"),
      "${modalities_env:experiments_root_path}, as `run` takes it (made absolute; nothing is written)")(
      "experiment_id", po::value(&a.experiment_id),
      "${modalities_env:experiment_id} (default: run's <date>__<time>_<hash of the config path>)")(
      "last_checkpoint_info_file_path", po::value(&a.last_checkpoint_info_file_path),
      "a warm-start config: the last_checkpoint_info.json that ${warmstart_env:checkpoint_paths} reads, as "
      "`warmstart` takes it");
  return d;
}

// The environment `run` gives a config: launcher variables (one process by default), the
// experiments root and id, and with --last_checkpoint_info_file_path `warmstart`'s resolver.
core::ResolverTable resolvers_of(const ConfigArgs& a, const core::Registry& registry) {
  export_single_process_env();
  core::ModalitiesEnv env = core::env_for_config(a.file);
  env.values["experiments_root_path"] = std::filesystem::absolute(a.experiments_root_path).string();
  env.values["experiment_id"] = a.experiment_id.empty() ? run_default_experiment_id(a.file) : a.experiment_id;
  core::ResolverTable resolvers = core::resolvers_for(registry, env);
  if (!a.last_checkpoint_info_file_path.empty()) {
    add_warmstart_resolver(resolvers, a.last_checkpoint_info_file_path);
  } else {
    resolvers.add(
        {"warmstart_env", "Warm start facts: needs --last_checkpoint_info_file_path.", [](std::string_view) -> Value {
           throw Error(
               "this is a warm-start config: give the last_checkpoint_info.json of the run to "
               "continue with --last_checkpoint_info_file_path, as for `modalities warmstart`");
         }});
  }
  return resolvers;
}

void print_diagnostics(const std::vector<core::Diagnostic>& ds) {
  for (const auto& d : ds) std::cerr << d.str() << "\n";
}

std::size_t count_errors(const std::vector<core::Diagnostic>& ds) {
  std::size_t n = 0;
  for (const auto& d : ds) n += d.warning ? 0 : 1;
  return n;
}

}  // namespace

int run_config(const std::vector<std::string>& args) {
  constexpr const char* usage =
      "usage: modalities config <validate|resolve|graph|build|import> <file> [options]\n\n"
      "  validate   check the config against the loaded plugins without building anything\n"
      "  resolve    print the fully interpolated config as TOML\n"
      "  graph      print the component graph in Graphviz DOT (`| dot -Tsvg > graph.svg`)\n"
      "  build      build the component graph and print what each top-level key produced\n"
      "  import     convert a Modalities YAML config into TOML (`modalities config import --help`)\n";
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::cout << usage;
    return args.empty() ? kUsage : kOk;
  }
  const std::string verb = args[0];
  if (verb == "import") return run_config_import({args.begin() + 1, args.end()});
  if (verb != "validate" && verb != "resolve" && verb != "graph" && verb != "build") {
    print_error(fmt::format("unknown config command '{}'\n\n{}", verb, usage));
    return kUsage;
  }
  ConfigArgs a;
  core::PluginOptions popts;
  po::options_description desc = config_options(a);
  desc.add(plugin_options(popts));
  po::positional_options_description pos;
  pos.add("config_file_path", 1);
  po::variables_map vm;
  int status = kOk;
  if (!parse({args.begin() + 1, args.end()}, desc, pos, vm,
             fmt::format("usage: modalities config {} <file.toml> [options]", verb), status))
    return status;

  const core::PipelineProfile* profile = nullptr;
  if (!a.pipeline.empty()) {
    profile = core::find_pipeline(a.pipeline);
    if (profile == nullptr) {
      std::vector<std::string> names;
      for (const auto& p : core::builtin_pipelines()) names.push_back(p.name);
      print_error(fmt::format("unknown pipeline '{}' (known: {})", a.pipeline, fmt::join(names, ", ")));
      return kUsage;
    }
  }
  core::Registry registry;
  core::PluginHost host(registry);
  if (!load_plugins_or_report(host, popts)) return kPluginError;
  try {
    core::ConfigNode root = core::load_toml_file(a.file);
    core::resolve_interpolations(root, resolvers_of(a, registry));
    if (verb == "resolve") {
      std::cout << core::to_toml(root);
      return kOk;
    }
    core::ComponentGraph graph(registry, root, profile);
    if (verb == "graph") {
      std::cout << graph.to_dot();
      return kOk;
    }
    if (verb == "validate") {
      const auto ds = graph.validate();
      print_diagnostics(ds);
      const std::size_t errors = count_errors(ds);
      if (errors > 0) {
        print_error(fmt::format("{}: {} error(s)", a.file, errors));
        return kFailed;
      }
      fmt::print("{}: valid{}\n", a.file, profile ? fmt::format(" for pipeline '{}'", profile->name) : std::string());
      return kOk;
    }
    const core::BuiltGraph built = graph.build([](const std::string& line) { std::cerr << line << "\n"; });
    for (const auto& [key, value] : built.top_level) fmt::print("{} = {}\n", key, value.repr());
    return kOk;
  } catch (const core::ConfigFileError& e) {
    print_diagnostics(e.diagnostics());
    print_error(fmt::format("{}: {} error(s)", a.file, count_errors(e.diagnostics())));
    return kFailed;
  } catch (const std::exception& e) {
    print_error(e.what());
    return kFailed;
  }
}

}  // namespace modalities::cli
