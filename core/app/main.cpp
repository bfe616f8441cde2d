// `modalities`: the host binary. Verbs mirror the Python Modalities CLI
// (docs/configs.md); each verb lives in its own cli_*.cpp.
#include "cli.h"

#include <modalities/core/registry.h>
#include <modalities/sdk/build_info.h>

#include <fmt/core.h>

#include <iostream>

namespace {

constexpr const char* kUsage = R"(usage: modalities <command> [<args>]

Modalities C++: LLM pre-training and research on LibTorch, configured by TOML
component graphs and extended by plugins.

Commands:
  run                           train a model described by a config (`modalities run --help`)
  warmstart                     continue a run from its last checkpoint
  generate_text                 generate text from a trained checkpoint
  convert_pytorch_to_hf_checkpoint
                                a checkpoint as a Hugging Face transformers folder (Llama, Mistral, Qwen2,
                                GPT-2; `modalities convert_pytorch_to_hf_checkpoint --help`)
  profile [distributed]         run a steppable component under a profiler (Chrome trace, operator table,
                                CUDA memory snapshot; `modalities profile --help`)
  benchmark <command>           sweeps: prepare_sweep_configs, list_remaining_runs, summarize
                                (`modalities benchmark --help`)
  plugins list                  list every loaded variant with its plugin file
  plugins describe <ck>/<vk>    config schema of one variant (types, defaults, help)
  plugins smoke <file.so>       load one plugin, build its example config, run conformance checks
  config validate <file.toml>   check a config against the loaded plugins without building it
  config resolve <file.toml>    print the fully interpolated config as TOML
  config graph <file.toml>      print the component graph in Graphviz DOT
  config build <file.toml>      build the component graph and print what each top-level key produced
  launch -- <command>           run a command as N ranks on this node with torchrun's environment
                                (`modalities launch --help`)
  dist check                    check and time the collectives of a multi-process run (under a launcher)
  data <command>                prepare training data: create_raw_index, pack_encoded_data, merge_packed_data,
                                shuffles, chunks, inspect_packed_data (`modalities data --help`)

Options:
  -h, --help       this help; `modalities <command> --help` for a command's options
  --version        version and build fingerprint

Plugins are loaded from the bundled directory (<prefix>/lib/modalities/plugins),
then from MODALITIES_PLUGIN_PATH (colon-separated), then from --plugin-path.
)";

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
    std::cout << kUsage;
    return args.empty() ? modalities::cli::kUsage : modalities::cli::kOk;
  }
  if (args[0] == "--version" || args[0] == "version") {
    fmt::print("modalities {} ({})\n", MODALITIES_SDK_VERSION, modalities::core::host_fingerprint());
    return modalities::cli::kOk;
  }
  const std::string verb = args[0];
  args.erase(args.begin());
  try {
    if (verb == "plugins") return modalities::cli::run_plugins(args);
    if (verb == "config") return modalities::cli::run_config(args);
    if (verb == "data") return modalities::cli::run_data(args);
    if (verb == "run") return modalities::cli::run_training(args, /*warmstart=*/false);
    if (verb == "warmstart") return modalities::cli::run_training(args, /*warmstart=*/true);
    if (verb == "launch") return modalities::cli::run_launch(args);
    if (verb == "dist") return modalities::cli::run_dist(args);
    if (verb == "generate_text") return modalities::cli::run_generate_text(args);
    if (verb == "profile") return modalities::cli::run_profile(args);
    if (verb == "benchmark") return modalities::cli::run_benchmark(args);
    if (verb == "convert_pytorch_to_hf_checkpoint") return modalities::cli::run_convert_to_hf(args);
  } catch (const std::exception& e) {
    modalities::cli::print_error(e.what());
    return modalities::cli::kFailed;
  }
  modalities::cli::print_error(fmt::format("unknown command '{}'\n\n{}", verb, kUsage));
  return modalities::cli::kUsage;
}
