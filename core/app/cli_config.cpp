// `modalities config validate | resolve | graph | build`.
#include "cli.h"

#include <modalities/core/graph.h>

#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iostream>

namespace modalities::cli {

namespace {

struct ConfigArgs {
  std::string file;
  std::string pipeline;
  std::string experiments_root_path;
  std::string experiment_id;
};

po::options_description config_options(ConfigArgs& a) {
  po::options_description d("Config options");
  d.add_options()("help,h", "this help")
      ("config_file_path", po::value(&a.file)->required(), "the TOML config (also accepted as the first positional argument)")
      ("pipeline", po::value(&a.pipeline),
       "check against a command's pipeline profile: training, packing, text_generation, profiling "
       "(default: every top-level key)")
      ("experiments_root_path", po::value(&a.experiments_root_path),
       "makes ${modalities_env:experiments_root_path} available, as `run` does")
      ("experiment_id", po::value(&a.experiment_id), "makes ${modalities_env:experiment_id} available, as `run` does");
  return d;
}

core::ModalitiesEnv env_of(const ConfigArgs& a) {
  core::ModalitiesEnv env = core::env_for_config(a.file);
  if (!a.experiments_root_path.empty()) env.values["experiments_root_path"] = a.experiments_root_path;
  if (!a.experiment_id.empty()) env.values["experiment_id"] = a.experiment_id;
  return env;
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
      "usage: modalities config <validate|resolve|graph|build> <file.toml> [options]\n\n"
      "  validate   check the config against the loaded plugins without building anything\n"
      "  resolve    print the fully interpolated config as TOML\n"
      "  graph      print the component graph in Graphviz DOT (`| dot -Tsvg > graph.svg`)\n"
      "  build      build the component graph and print what each top-level key produced\n";
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::cout << usage;
    return args.empty() ? kUsage : kOk;
  }
  const std::string verb = args[0];
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
    const core::ConfigNode root = core::load_resolved(a.file, registry, env_of(a));
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
  }
}

}  // namespace modalities::cli
