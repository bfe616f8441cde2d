// `modalities run`, `modalities warmstart` and `modalities generate_text`
// (docs/training.md): load plugins and the config, create the
// experiment folder, build the component graph, hand it to the gym.
#include "cli.h"
#include "prelude.h"

#include <modalities/core/data/pbin_tools.h>
#include <modalities/core/graph.h>
#include <modalities/core/gym.h>
#include <modalities/sdk/atomic_file.h>
#include <modalities/sdk/distributed.h>
#include <modalities/sdk/formats/jsonl.h>
#include <modalities/sdk/interfaces/app_state.h>
#include <modalities/sdk/interfaces/message_subscriber.h>
#include <modalities/sdk/interfaces/steppable_component.h>
#include <modalities/sdk/interfaces/steppable_profiler.h>
#include <modalities/sdk/interfaces/text_inference_component.h>
#include <modalities/sdk/run_context.h>

#include <ATen/Context.h>
#include <fmt/chrono.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <simdjson.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <sstream>

namespace modalities::cli {
namespace {

namespace fs = std::filesystem;

std::atomic<int> g_stop_signal{0};
std::atomic<std::int64_t> g_first_signal_ns{0};

std::int64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);  // async-signal-safe
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

extern "C" void on_stop_signal(int signal) {
  if (g_stop_signal.exchange(signal) == 0) {
    g_first_signal_ns = monotonic_ns();
    return;
  }
  // A second signal more than a second later: give up immediately (nothing
  // half-written survives: writes are atomic). Within a second it is the same
  // request delivered twice, e.g. by `timeout` or a launcher that signals both
  // the process and its process group.
  if (monotonic_ns() - g_first_signal_ns.load() > 1'000'000'000) {
    std::signal(signal, SIG_DFL);
    std::raise(signal);
  }
}

/// Restores the previous handlers when the run ends.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    g_first_signal_ns = 0;
    old_int_ = std::signal(SIGINT, on_stop_signal);
    old_term_ = std::signal(SIGTERM, on_stop_signal);
  }
  ~StopSignals() {
    std::signal(SIGINT, old_int_);
    std::signal(SIGTERM, old_term_);
  }

 private:
  void (*old_int_)(int) = SIG_DFL;
  void (*old_term_)(int) = SIG_DFL;
};

/// "rank N: " in front of messages of a multi-process run, nothing for one process.
std::string rank_prefix(const dist::LaunchEnv& e) {
  return e.distributed() ? fmt::format("rank {}: ", e.rank) : std::string();
}

/// "<YYYY-MM-DD__HH-MM-SS>_<first 16 hex of SHA-256 of the config path>", as in Modalities.
std::string default_experiment_id(const std::string& config_file_path) {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  return fmt::format("{:%Y-%m-%d__%H-%M-%S}_{}", tm, core::data::sha256_hex(config_file_path).substr(0, 16));
}

Value json_to_value(simdjson::dom::element e) {
  using T = simdjson::dom::element_type;
  switch (e.type()) {
    case T::OBJECT: {
      Value::Table table;
      for (auto [k, v] : e.get_object()) table.emplace_back(std::string(k), json_to_value(v));
      return Value(std::move(table));
    }
    case T::ARRAY: {
      Value::List list;
      for (auto v : e.get_array()) list.push_back(json_to_value(v));
      return Value(std::move(list));
    }
    case T::STRING: return Value(std::string(e.get_string().value()));
    case T::INT64: return Value(e.get_int64().value());
    case T::UINT64: return Value(static_cast<std::int64_t>(e.get_uint64().value()));
    case T::DOUBLE: return Value(e.get_double().value());
    case T::BOOL: return Value(e.get_bool().value());
    case T::NULL_VALUE: return Value();
  }
  return Value();
}

/// The `warmstart_env` resolver: `${warmstart_env:checkpoint_paths}` is the
/// JSON object of last_checkpoint_info.json (docs/training.md, "Warm start").
ResolverSpec warmstart_resolver(const fs::path& info_file) {
  return {"warmstart_env",
          "Warm start facts (modalities warmstart only): checkpoint_paths = the object in "
          "--last_checkpoint_info_file_path.",
          [info_file](std::string_view name) -> Value {
            if (name != "checkpoint_paths")
              throw Error(fmt::format("unknown warmstart_env variable '{}' (available: checkpoint_paths)", name));
            simdjson::dom::parser parser;
            simdjson::dom::element doc;
            if (auto error = parser.load(info_file.string()).get(doc))
              throw Error(
                  fmt::format("{}: not a readable JSON file ({})", info_file.string(), simdjson::error_message(error)));
            if (!doc.is_object())
              throw Error(fmt::format("{}: expected a JSON object like {{\"checkpoint_folder_path\": \"...\"}}",
                                      info_file.string()));
            // Every entry is a path (checkpoint_folder_path, model_checkpoint_path, ...): a bad value is
            // reported here, against this file, not later against the config line that reads it.
            for (auto [key, value] : doc.get_object())
              if (!value.is_string() || value.get_string().value().empty())
                throw Error(fmt::format("{}: \"{}\" is {}, expected a non-empty checkpoint path string",
                                        info_file.string(), std::string_view(key), simdjson::minify(value)));
            return json_to_value(doc);
          }};
}

/// Note [Rank fingerprint]
/// Every rank must run the same program on the same config: a rank with another build, another
/// plugin or an edited config would silently train something else (or deadlock in a collective
/// the others never issue). Before building anything the ranks exchange the SHA-256 of the host
/// binary, of every loaded plugin file (with its name and version) and of the config file; a
/// difference from rank 0 is an error on every rank naming the ranks and what differs.
std::string file_sha256(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return core::data::sha256_hex(bytes.str());
}

void check_rank_fingerprints(const core::Registry& registry, const std::string& config_file_path) {
  std::map<std::string, std::string> parts;
  parts["host binary"] = file_sha256("/proc/self/exe");
  parts["config file"] = file_sha256(config_file_path);
  for (const auto& p : registry.plugins())
    parts["plugin " + p->name] =
        p->version + " " + (p->file.empty() ? std::string("in-process") : file_sha256(p->file));
  std::string mine;
  for (const auto& [k, v] : parts) mine += k + "\t" + v + "\n";
  const std::vector<std::string> all = dist::all_gather_strings("fingerprint", mine);
  const auto parse = [](const std::string& text) {
    std::map<std::string, std::string> out;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);)
      if (const auto tab = line.find('\t'); tab != std::string::npos) out[line.substr(0, tab)] = line.substr(tab + 1);
    return out;
  };
  const std::map<std::string, std::string> zero = parse(all[0]);
  std::vector<std::string> problems;
  for (std::size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    const std::map<std::string, std::string> theirs = parse(all[r]);
    std::vector<std::string> differ;
    for (const auto& [k, v] : zero)
      if (!theirs.contains(k)) differ.push_back(k + " (missing on rank " + std::to_string(r) + ")");
      else if (theirs.at(k) != v) differ.push_back(k);
    for (const auto& [k, v] : theirs)
      if (!zero.contains(k)) differ.push_back(k + " (only on rank " + std::to_string(r) + ")");
    problems.push_back(fmt::format("rank {}: {}", r, fmt::join(differ, ", ")));
  }
  if (!problems.empty())
    throw Error(
        fmt::format("the ranks do not run the same program and config as rank 0 ({}); every rank needs the "
                    "same build, plugins and config file",
                    fmt::join(problems, "; ")));
}

/// Note [Resuming a run config]
/// `run --resume_from_checkpoint_info F` turns the training config into its warm-start form when F
/// exists: the plugin that registered the run resume (RunResumeSpec; the bundled checkpointing
/// plugin) returns the nodes that replace settings.training_progress and app_state. The edits
/// happen before interpolation, so everything that reads ${settings.training_progress.*} (the
/// sampler's skip) sees the resumed values. Returns the checkpoint folder, or nothing when F does
/// not exist (a fresh start).
std::optional<std::string> resume_config_from(const core::Registry& registry, core::ConfigNode& root,
                                              const fs::path& info_file) {
  std::error_code ec;
  if (!fs::exists(info_file, ec)) return std::nullopt;
  const RunResumeSpec* resume = registry.run_resume();
  if (resume == nullptr)
    throw Error(
        fmt::format("--resume_from_checkpoint_info {}: no loaded plugin says how a run continues from a "
                    "checkpoint (the bundled checkpointing plugin does; `modalities plugins list`)",
                    info_file.string()));
  core::ConfigNode* settings = root.find("settings");
  core::ConfigNode* progress = settings && settings->is_table() ? settings->find("training_progress") : nullptr;
  core::ConfigNode* app_state = root.find("app_state");
  if (progress == nullptr || !progress->is_table())
    throw Error(fmt::format("--resume_from_checkpoint_info: {} has no settings.training_progress table to resume",
                            root.where().str()));
  if (app_state == nullptr)
    throw Error(fmt::format("--resume_from_checkpoint_info: {} has no app_state to resume", root.where().str()));
  ResumedRun r;
  try {
    r = resume->resume(info_file.string(), app_state->to_value());
  } catch (const std::exception& e) {
    throw Error(fmt::format("--resume_from_checkpoint_info ({}): {}", registry.run_resume_owner(), e.what()));
  }
  *progress = core::ConfigNode::from_value(r.training_progress, progress->where());
  *app_state = core::ConfigNode::from_value(r.app_state, app_state->where());
  return r.checkpoint_folder;
}

struct RunArgs {
  std::string config_file_path;
  std::string experiments_root_path;
  std::string experiment_id;
  std::string error_log_folder;
  std::string last_checkpoint_info_file_path;
  std::string resume_from;
  bool test_comm = false;
  std::optional<double> process_group_timeout_s;  // the flag; else settings.process_group_timeout_s, else 600
  bool checkpoint_on_interrupt = false;
  bool verbose = false;
};

po::options_description run_options(RunArgs& a, bool warmstart) {
  po::options_description d(warmstart ? "Warm-start options" : "Run options");
  d.add_options()("help,h", "this help")("config_file_path", po::value(&a.config_file_path)->required(),
                                         "the training config (TOML)")(
      "experiments_root_path", po::value(&a.experiments_root_path)->required(),
      "folder that receives <experiment_id>/ (config copy, resolved config, results, checkpoints)");
  if (warmstart) {
    d.add_options()("last_checkpoint_info_file_path", po::value(&a.last_checkpoint_info_file_path)->required(),
                    "last_checkpoint_info.json of the run to continue; its object is "
                    "${warmstart_env:checkpoint_paths} in the config");
  }
  if (!warmstart) {
    d.add_options()("resume_from_checkpoint_info", po::value(&a.resume_from),
                    "when this last_checkpoint_info.json exists, continue from the checkpoint it names instead of "
                    "starting fresh (settings.training_progress and app_state are taken from the checkpoint, as a "
                    "warm-start config would); for `modalities launch --max-restarts`");
  }
  d.add_options()("experiment_id", po::value(&a.experiment_id),
                  "run id (default: <date>__<time>_<hash of the config path>)")(
      "error_log_folder", po::value(&a.error_log_folder),
      "on failure, also write the error as JSON to <folder>/error_logs_<host>_<local_rank>.log")(
      "checkpoint_on_interrupt", po::bool_switch(&a.checkpoint_on_interrupt),
      "on SIGINT/SIGTERM, finish the step and write a checkpoint before stopping")(
      "test_comm", po::bool_switch(&a.test_comm),
      "before training, check every collective on known values (as `modalities dist check`); a no-op in one process")(
      "process_group_timeout_s", po::value<double>()->notifier([&a](double v) { a.process_group_timeout_s = v; }),
      "several processes: rendezvous and collective timeout in seconds; a rank that waits longer fails with an "
      "error (default: the config's settings.process_group_timeout_s, else 600)")(
      "verbose,v", po::bool_switch(&a.verbose), "print every component as it is built");
  return d;
}

void write_error_log(const std::string& folder, const std::string& type, const std::string& message) {
  if (folder.empty()) return;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  const char* local_rank = std::getenv("LOCAL_RANK");
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  const std::string json = fmt::format(
      "{{\"environment\": {{\"rank\": {}, \"local_rank\": {}, \"world_size\": {}, \"hostname\": {}}}, "
      "\"error\": {{\"error\": {}, \"type\": {}, \"stacktrace\": \"\"}}}}\n",
      rank ? rank : "0", local_rank ? local_rank : "0", world ? world : "1", formats::json_quote(host),
      formats::json_quote(message), formats::json_quote(type));
  try {
    fs::create_directories(folder);
    write_file_atomically(fs::path(folder) / fmt::format("error_logs_{}_{}.log", host, local_rank ? local_rank : "0"),
                          json);
  } catch (const std::exception& e) {
    print_warning(fmt::format("could not write the error log into {}: {}", folder, e.what()));
  }
}

/// Creates <root>/<id>/, copies the config and writes the resolved config next to it.
fs::path prepare_experiment_folder(const RunArgs& a, const core::ConfigNode& resolved) {
  const fs::path folder = fs::path(a.experiments_root_path) / a.experiment_id;
  fs::create_directories(folder);
  const fs::path config = fs::absolute(a.config_file_path);
  const fs::path copy = folder / config.filename();
  std::error_code ec;
  if (!fs::equivalent(config, copy, ec)) {
    std::ifstream in(config, std::ios::binary);
    std::ostringstream bytes;
    bytes << in.rdbuf();
    write_file_atomically(copy, bytes.str());
  }
  write_file_atomically(folder / (config.stem().string() + ".resolved.toml"), core::to_toml(resolved));
  return folder;
}

std::string human_seconds(double s) {
  if (s < 120) return fmt::format("{:.1f} s", s);
  if (s < 7200) return fmt::format("{:.1f} min", s / 60);
  return fmt::format("{:.2f} h", s / 3600);
}

// The process group's timeout: --process_group_timeout_s, else settings.process_group_timeout_s of
// the config (a literal number: the group exists before interpolation runs), else 600 s.
double process_group_timeout(const RunArgs& a, const core::ConfigNode& root) {
  double seconds = 600;
  std::string what = "--process_group_timeout_s";
  if (a.process_group_timeout_s) {
    seconds = *a.process_group_timeout_s;
  } else {
    const core::ConfigNode* settings = root.find("settings");
    const core::ConfigNode* node =
        settings && settings->is_table() ? settings->find("process_group_timeout_s") : nullptr;
    if (node == nullptr) return seconds;
    what = fmt::format("{}: settings.process_group_timeout_s", node->where().str());
    if (const auto* v = std::get_if<double>(&node->data())) seconds = *v;
    else if (const auto* i = std::get_if<std::int64_t>(&node->data())) seconds = static_cast<double>(*i);
    else
      throw Error(fmt::format("{}: expected a number of seconds (a literal: it is read before interpolation), got {}",
                              what, node->type_name()));
  }
  if (!(seconds > 0) || seconds > 1e7)
    throw Error(fmt::format("{} must be a positive number of seconds up to 1e7, got {}", what, seconds));
  return seconds;
}

int train(RunArgs a, const core::PluginOptions& popts, bool warmstart) {
  VerbPrelude prelude;  // Note [Verb prelude]
  if (const auto stop = prelude.start(popts)) return *stop;
  const dist::LaunchEnv& launch = prelude.launch();
  const core::Registry& registry = prelude.registry();
  const std::string who = rank_prefix(launch);
  try {
    // Read once: the process-group timeout comes from it before the group exists; interpolation and
    // the warm-start form come after.
    core::ConfigNode root = VerbPrelude::read(a.config_file_path);
    if (launch.distributed()) {
      const double timeout_s = process_group_timeout(a, root);
      dist::RuntimeOptions ro;
      ro.timeout = std::chrono::milliseconds(static_cast<long>(timeout_s * 1000));
      dist::init(launch, ro);
      // Every rank must use rank 0's id: the default one comes from each rank's clock.
      a.experiment_id = dist::broadcast_from_rank0("experiment_id", a.experiment_id);
      check_rank_fingerprints(registry, a.config_file_path);  // Note [Rank fingerprint]
    }
    std::vector<ResolverSpec> extra;
    if (warmstart) {
      if (!fs::is_regular_file(a.last_checkpoint_info_file_path))
        throw Error(fmt::format("--last_checkpoint_info_file_path {}: no such file", a.last_checkpoint_info_file_path));
      extra.push_back(warmstart_resolver(a.last_checkpoint_info_file_path));
    }
    std::optional<std::string> resumed;
    if (!a.resume_from.empty()) resumed = resume_config_from(registry, root, a.resume_from);
    prelude.resolve(
        root, a.config_file_path,
        {{"experiments_root_path", fs::absolute(a.experiments_root_path).string()}, {"experiment_id", a.experiment_id}},
        extra);
    if (a.test_comm && launch.distributed()) check_collective_values();
    // Rank 0 writes the experiment folder; the others wait for it (same order of collectives everywhere).
    const fs::path folder = fs::path(a.experiments_root_path) / a.experiment_id;
    if (launch.rank == 0) {
      prepare_experiment_folder(a, root);
      std::cerr << fmt::format(
          "experiment {} in {} (device {}{})\n", a.experiment_id, folder.string(), run_device().str(),
          launch.distributed() ? fmt::format(", {} ranks, {}", launch.world_size, dist::backend_name()) : "");
      if (!a.resume_from.empty())
        std::cerr << (resumed ? fmt::format("resuming from checkpoint {}\n", *resumed)
                              : fmt::format("starting fresh: {} does not exist yet\n", a.resume_from));
    }
    dist::barrier();

    // Warnings (the config's and the components', e.g. model/compiled's notice) from rank 0;
    // the per-component build lines with --verbose.
    core::ComponentGraph graph(registry, root, core::find_pipeline("training"));
    const core::BuiltGraph built = graph.build(
        [&](const std::string& line) {
          if (a.verbose) std::cerr << line << "\n";
        },
        [&](const std::string& line) {
          if (launch.rank == 0) std::cerr << line << "\n";
        });
    core::GymComponents components = core::GymComponents::from(built);
    const auto& cuda_env = components.settings.cuda_env;
    if (cuda_env.world_size != launch.world_size || cuda_env.global_rank != launch.rank)
      throw Error(fmt::format(
          "settings.cuda_env says global_rank {} of world_size {}, but this process is rank {} of {} (from {}): set "
          "them to \"${{cuda_env:RANK}}\" and \"${{cuda_env:WORLD_SIZE}}\"",
          cuda_env.global_rank, cuda_env.world_size, launch.rank, launch.world_size, launch.source));
    const core::i64 num_parameters = core::count_trainable_parameters(components);
    components.evaluation_subscriber->consume_dict({{"No. parameters", DictValue(num_parameters)}});
    if (components.settings.cuda_env.global_rank == 0)
      std::cout << core::training_report(components, num_parameters) << std::flush;

    StopSignals signals;
    core::GymOptions options;
    options.device = run_device();
    options.stop_request = &g_stop_signal;
    options.checkpoint_on_stop = a.checkpoint_on_interrupt;
    options.data_ledger_path = folder / "data_ledger.jsonl";
    const core::GymSummary s = core::run_gym(components, options);
    const double tokens_per_s =
        s.seconds > 0 ? static_cast<double>(s.steps_done) *
                            static_cast<double>(components.settings.step_profile.tokens_per_step()) / s.seconds
                      : 0.0;
    if (launch.rank == 0)
      std::cout << fmt::format(
          "{} after {} steps ({} in this run) and {} tokens in {} ({:.0f} tokens/s){}. Results: {}\n",
          s.stopped_on_request ? "Stopped on request" : "Training finished", s.steps_total, s.steps_done,
          s.tokens_total, human_seconds(s.seconds), tokens_per_s,
          std::isnan(s.last_train_loss) ? std::string()
                                        : fmt::format(", last train loss avg {:.4f}", s.last_train_loss),
          folder.string());
    if (s.stopped_on_request && launch.rank == 0)
      std::cout << (s.checkpoint_written_on_stop ? "A checkpoint of the last step was written.\n"
                                                 : "No checkpoint was written for the last step "
                                                   "(use --checkpoint_on_interrupt).\n");
    return s.stopped_on_request ? 128 + g_stop_signal.load() : kOk;
  } catch (const core::ConfigFileError& e) {
    for (const auto& d : e.diagnostics()) std::cerr << d.str() << "\n";
    write_error_log(a.error_log_folder, "ConfigFileError", e.what());
    print_error(fmt::format("{}{}: invalid training config", who, a.config_file_path));
    return kFailed;
  } catch (const core::NonFiniteLossError& e) {
    write_error_log(a.error_log_folder, "NonFiniteLossError", e.what());
    print_error(who + e.what());
    return kFailed;
  } catch (const std::exception& e) {
    write_error_log(a.error_log_folder, "Error", e.what());
    print_error(who + e.what());
    return kFailed;
  }
}

}  // namespace

int run_training(const std::vector<std::string>& args, bool warmstart) {
  RunArgs a;
  core::PluginOptions popts;
  po::options_description desc = run_options(a, warmstart);
  desc.add(plugin_options(popts));
  po::variables_map vm;
  int status = kOk;
  const std::string usage =
      warmstart ? "usage: modalities warmstart --config_file_path F --experiments_root_path R "
                  "--last_checkpoint_info_file_path J [options]\n\n"
                  "Continues a run from its last checkpoint: the config reads the checkpoint through\n"
                  "${warmstart_env:checkpoint_paths} (see configs/quickstart/warmstart.toml)."
                : "usage: modalities run --config_file_path F --experiments_root_path R [options]\n\n"
                  "Trains the model described by the config on CPU or one GPU (settings.device or\n"
                  "MODALITIES_DEVICE); under a launcher (modalities launch, torchrun, srun) on every\n"
                  "rank (process groups: NCCL on GPUs, Gloo on CPUs; MODALITIES_BACKEND=staged runs\n"
                  "several ranks on one GPU, for tests). Writes <R>/<experiment_id>/ with the config, its\n"
                  "resolved form, results and checkpoints. Ctrl-C finishes the current step and stops.";
  if (!parse(args, desc, {}, vm, usage, status)) return status;
  if (a.experiment_id.empty()) a.experiment_id = default_experiment_id(a.config_file_path);
  return train(a, popts, warmstart);
}

// `modalities profile [distributed]`: Modalities' ModalitiesProfilerStarter. Builds the profiling
// pipeline (steppable_component, profiler) and runs component.step(); profiler.step() size() times
// inside enter()/exit(). As in Modalities, ${modalities_env:experiments_root_path} is the
// experiment folder <root>/<experiment_id> here (not the root as in `run`), and the config is
// copied into it.
int run_profile(const std::vector<std::string>& raw_args) {
  std::vector<std::string> args = raw_args;
  if (!args.empty() && args[0] == "distributed") args.erase(args.begin());  // Modalities' spelling
  RunArgs a;
  core::PluginOptions popts;
  po::options_description desc("Profiling options");
  desc.add_options()("help,h", "this help")(
      "config_file_path", po::value(&a.config_file_path)->required(),
      "profiling config with top-level steppable_component and profiler (also the first positional argument)")(
      "experiment_root_path", po::value(&a.experiments_root_path)->default_value("experiments"),
      "root folder; traces go where the profiler's config says, the config copy to <root>/<experiment_id>")(
      "experiments_root_path", po::value(&a.experiments_root_path), "same as --experiment_root_path")(
      "experiment_id", po::value(&a.experiment_id),
      "experiment id (default: <date>__<time>_<hash of the config path>)");
  desc.add(plugin_options(popts));
  po::positional_options_description pos;
  pos.add("config_file_path", 1);
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, pos, vm,
             "usage: modalities profile [distributed] --config_file_path F [--experiment_root_path R]\n\n"
             "Runs the config's steppable_component (e.g. steppable_component/forward_pass) as many steps as its\n"
             "profiler wants (steppable_profiler/kernel_tracing writes a Chrome trace and a per-operator table,\n"
             "memory_tracing a CUDA memory snapshot). One process, or every rank under `modalities launch` /\n"
             "torchrun / srun.",
             status))
    return status;
  if (a.experiment_id.empty()) a.experiment_id = default_experiment_id(a.config_file_path);
  VerbPrelude prelude;  // Note [Verb prelude]
  if (const auto stop = prelude.start(popts)) return *stop;
  const dist::LaunchEnv& launch = prelude.launch();
  const core::Registry& registry = prelude.registry();
  const std::string who = rank_prefix(launch);
  try {
    core::ConfigNode root = VerbPrelude::read(a.config_file_path);
    if (launch.distributed()) {
      dist::RuntimeOptions ro;
      ro.timeout = std::chrono::milliseconds(static_cast<long>(process_group_timeout(a, root) * 1000));
      dist::init(launch, ro);
      a.experiment_id = dist::broadcast_from_rank0("experiment_id", a.experiment_id);
    }
    const fs::path folder = fs::absolute(fs::path(a.experiments_root_path) / a.experiment_id);
    prelude.resolve(root, a.config_file_path,
                    {{"experiments_root_path", folder.string()}, {"experiment_id", a.experiment_id}});
    if (launch.rank == 0) {
      prepare_experiment_folder(a, root);
      std::cerr << fmt::format("profiling {} in {} (device {}{})\n", a.experiment_id, folder.string(),
                               run_device().str(),
                               launch.distributed() ? fmt::format(", {} ranks", launch.world_size) : "");
    }
    dist::barrier();
    core::ComponentGraph graph(registry, root, core::find_pipeline("profiling"));
    const core::BuiltGraph built = graph.build([](const std::string&) {},
                                               [&](const std::string& line) {
                                                 if (launch.rank == 0) std::cerr << line << "\n";
                                               });
    auto get = [&](const char* key, std::string_view interface) {
      const Value* v = built.get(key);
      if (v == nullptr || !v->is_object() || v->as_object().interface != interface)
        throw Error(fmt::format("{} must produce a {}", key, interface));
      return v->as_object().ptr;
    };
    auto component =
        std::static_pointer_cast<SteppableComponent>(get("steppable_component", SteppableComponent::kInterface));
    auto profiler = std::static_pointer_cast<SteppableProfiler>(get("profiler", SteppableProfiler::kInterface));
    const std::int64_t steps = profiler->size();
    if (steps < 0)
      throw Error(
          "the profiler does not say how many steps to run (steppable_profiler/no_profiler has no length); "
          "use kernel_tracing or memory_tracing, alone or in a combined profiler");
    const auto start = std::chrono::steady_clock::now();
    profiler->enter();
    for (std::int64_t i = 0; i < steps; ++i) {
      component->step();
      profiler->step();
    }
    profiler->exit();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    dist::barrier();
    if (launch.rank == 0)
      std::cout << fmt::format(
          "Profiled {} steps in {} ({:.1f} ms per step, profiler overhead included). Config "
          "copy: {}\n",
          steps, human_seconds(seconds), steps ? 1e3 * seconds / static_cast<double>(steps) : 0.0, folder.string());
    return kOk;
  } catch (const core::ConfigFileError& e) {
    for (const auto& d : e.diagnostics()) std::cerr << d.str() << "\n";
    print_error(fmt::format("{}{}: invalid profiling config", who, a.config_file_path));
    return kFailed;
  } catch (const std::exception& e) {
    print_error(who + e.what());
    return kFailed;
  }
}

void export_single_process_env() {
  // Validation needs no rendezvous: only the variables a config reads, one process where unset.
  for (const auto& [name, value] : {std::pair{"RANK", "0"}, std::pair{"WORLD_SIZE", "1"}, std::pair{"LOCAL_RANK", "0"},
                                    std::pair{"LOCAL_WORLD_SIZE", "1"}})
    setenv(name, value, 0);
}

void add_warmstart_resolver(core::ResolverTable& resolvers, const std::string& info_file) {
  if (!fs::is_regular_file(info_file))
    throw Error(fmt::format("--last_checkpoint_info_file_path {}: no such file", info_file));
  resolvers.add(warmstart_resolver(info_file));
}

std::string run_default_experiment_id(const std::string& config_file_path) {
  return default_experiment_id(config_file_path);
}

int run_generate_text(const std::vector<std::string>& args) {
  std::string config_file_path;
  core::PluginOptions popts;
  po::options_description desc("Text generation options");
  desc.add_options()("help,h", "this help")("config_file_path", po::value(&config_file_path)->required(),
                                            "text generation config with a top-level text_inference_component");
  desc.add(plugin_options(popts));
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, {}, vm,
             "usage: modalities generate_text --config_file_path F\n\n"
             "Generates text from a trained checkpoint. Prompts for each {placeholder} of the\n"
             "prompt template on stdin (pipe the answers in for non-interactive use).",
             status))
    return status;
  VerbPrelude prelude;  // Note [Verb prelude]
  if (const auto stop = prelude.start(popts)) return *stop;
  try {
    const core::ConfigNode root = prelude.config(config_file_path);
    core::ComponentGraph graph(prelude.registry(), root, core::find_pipeline("text_generation"));
    const core::BuiltGraph built =
        graph.build([](const std::string&) {}, [](const std::string& line) { std::cerr << line << "\n"; });
    const Value* v = built.get("text_inference_component");
    if (v == nullptr || !v->is_object() || v->as_object().interface != TextInferenceComponent::kInterface)
      throw Error("text_inference_component must produce a TextInferenceComponent");
    std::static_pointer_cast<TextInferenceComponent>(v->as_object().ptr)->run(std::cin, std::cout);
    return kOk;
  } catch (const core::ConfigFileError& e) {
    for (const auto& d : e.diagnostics()) std::cerr << d.str() << "\n";
    print_error(fmt::format("{}: invalid text generation config", config_file_path));
    return kFailed;
  } catch (const std::exception& e) {
    print_error(e.what());
    return kFailed;
  }
}

}  // namespace modalities::cli
