// Internal interface between the `modalities` entry point and its verbs.
#pragma once

#include <modalities/core/interpolation.h>
#include <modalities/core/registry.h>
#include <modalities/core/session.h>

#include <boost/program_options.hpp>

#include <string>
#include <vector>

namespace modalities::cli {

namespace po = boost::program_options;

/// Exit statuses shared by every verb.
enum ExitCode : int {
  kOk = 0,
  kFailed = 1,       // invalid config, failed build, failed smoke test
  kUsage = 2,        // bad command line
  kPluginError = 3,  // plugin problems with --strict-plugins
};

/// Options every verb that loads plugins accepts.
po::options_description plugin_options(core::PluginOptions& out);

/// Loads plugins; prints one warning per problem. Returns false if loading
/// must stop (strict mode and a problem was found).
bool load_plugins_or_report(core::PluginHost& host, const core::PluginOptions& options);

/// Parses `args` against `desc` (+ positionals). Prints usage and returns
/// false on errors or --help; `status` then holds the exit code.
bool parse(const std::vector<std::string>& args, const po::options_description& desc,
           const po::positional_options_description& positional, po::variables_map& vm, const std::string& usage,
           int& status);

void print_error(const std::string& message);
void print_warning(const std::string& message);

int run_plugins(const std::vector<std::string>& args);
int run_config(const std::vector<std::string>& args);
int run_data(const std::vector<std::string>& args);
/// `modalities run` (warmstart = false) and `modalities warmstart` (cli_run.cpp).
int run_training(const std::vector<std::string>& args, bool warmstart);
/// `modalities launch` (cli_launch.cpp): one process per rank with torchrun's environment.
int run_launch(const std::vector<std::string>& args);
/// `modalities dist check` (cli_dist.cpp): collectives checked on known values, and timed.
int run_dist(const std::vector<std::string>& args);
/// Every collective of the world group on exactly known values (cli_dist.cpp); throws
/// modalities::Error naming the collective and the first wrong element. `run --test_comm`.
void check_collective_values();
/// For the `config` verbs: RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE as given, or those of
/// one process where unset (no rendezvous variables are needed to validate).
void export_single_process_env();
/// Adds `warmstart`'s ${warmstart_env:checkpoint_paths} resolver reading `info_file`.
void add_warmstart_resolver(core::ResolverTable& resolvers, const std::string& info_file);
/// `run`'s default experiment id for a config file.
std::string run_default_experiment_id(const std::string& config_file_path);
/// `modalities profile [distributed]` (cli_run.cpp): a steppable component under a profiler.
int run_profile(const std::vector<std::string>& args);
/// `modalities convert_pytorch_to_hf_checkpoint` (cli_convert.cpp).
int run_convert_to_hf(const std::vector<std::string>& args);
/// `modalities data prepare_instruction_tuning_data` (cli_instruction.cpp).
int run_prepare_instruction_tuning_data(const std::vector<std::string>& args);
/// `modalities config import` (cli_import.cpp): Modalities YAML -> TOML.
int run_config_import(const std::vector<std::string>& args);
/// `modalities benchmark` (cli_benchmark.cpp): sweep configs, remaining runs, results table.
int run_benchmark(const std::vector<std::string>& args);
/// `modalities generate_text` (cli_run.cpp).
int run_generate_text(const std::vector<std::string>& args);

/// The `modalities data` verbs that rewrite packed or JSONL files (merge,
/// shuffles, chunks; cli_data_tools.cpp). Returns -1 if `verb` is not one of them.
int run_data_tools(const std::string& verb, const std::vector<std::string>& args);
/// One line per verb of run_data_tools for `modalities data --help`.
extern const char* const kDataToolsHelp;

}  // namespace modalities::cli
