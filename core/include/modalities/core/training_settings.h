// The training pipeline's Settings schema and consistency checks (docs/training.md).
// Settings ignore unknown keys (as in Modalities); each validator raises an
// error when its `enforce_*` flag is true and a warning otherwise. Unlike
// Modalities, a run with no steps left (target steps = seen steps) is
// reported instead of dividing by zero.
#pragma once

#include <modalities/sdk/error.h>
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/schema.h>

#include <fmt/core.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace modalities::core {

struct BuiltGraph;
using i64 = std::int64_t;

struct CudaEnvSettings {
  i64 local_rank = 0, world_size = 1, global_rank = 0;
  static void describe(Schema<CudaEnvSettings>& s) {
    s.ignore_unknown_keys();
    s.field("local_rank", &CudaEnvSettings::local_rank, "Rank on this node (${cuda_env:LOCAL_RANK}).")
        .required()
        .non_negative();
    s.field("world_size", &CudaEnvSettings::world_size, "Number of ranks (${cuda_env:WORLD_SIZE}).")
        .required()
        .at_least(1);
    s.field("global_rank", &CudaEnvSettings::global_rank, "Global rank (${cuda_env:RANK}).").required().non_negative();
  }
};

struct IntervalSettings {
  i64 training_log_interval_in_steps = 1, checkpointing_interval_in_steps = 1, evaluation_interval_in_steps = 1;
  static void describe(Schema<IntervalSettings>& s) {
    using C = IntervalSettings;
    s.ignore_unknown_keys();
    s.field("training_log_interval_in_steps", &C::training_log_interval_in_steps, "Steps between log lines.")
        .required()
        .at_least(1);
    s.field("checkpointing_interval_in_steps", &C::checkpointing_interval_in_steps, "Steps between checkpoints.")
        .required()
        .at_least(1);
    s.field("evaluation_interval_in_steps", &C::evaluation_interval_in_steps, "Steps between evaluations.")
        .required()
        .at_least(1);
  }
};

struct ConsistencyEnforcement {
  bool enforce_tokens_per_step_consistency = true, enforce_last_step_logged = true, enforce_last_step_evaluated = true,
       enforce_last_step_checkpointed = true, enforce_enough_tokens_in_dataset = true;
  static void describe(Schema<ConsistencyEnforcement>& s) {
    using C = ConsistencyEnforcement;
    s.ignore_unknown_keys();
    s.field("enforce_tokens_per_step_consistency", &C::enforce_tokens_per_step_consistency,
            "Error (else warning) if the token budget does not match the step profile.");
    s.field("enforce_last_step_logged", &C::enforce_last_step_logged, "Error if the last step is not logged.");
    s.field("enforce_last_step_evaluated", &C::enforce_last_step_evaluated, "Error if the last step is not evaluated.");
    s.field("enforce_last_step_checkpointed", &C::enforce_last_step_checkpointed,
            "Error if the last step is not checkpointed.");
    s.field("enforce_enough_tokens_in_dataset", &C::enforce_enough_tokens_in_dataset,
            "Error if the training dataset has fewer tokens than the target.");
  }
};

struct StepProfile {
  i64 gradient_accumulation_steps = 1, local_train_micro_batch_size = 1, sequence_length = 1, dp_degree = 1;
  static void describe(Schema<StepProfile>& s) {
    using C = StepProfile;
    s.ignore_unknown_keys();
    s.field("gradient_accumulation_steps", &C::gradient_accumulation_steps, "Micro batches per optimizer step.")
        .required()
        .at_least(1);
    s.field("local_train_micro_batch_size", &C::local_train_micro_batch_size, "Samples per micro batch on one rank.")
        .required()
        .at_least(1);
    s.field("sequence_length", &C::sequence_length, "Tokens per sample.").required().at_least(1);
    s.field("dp_degree", &C::dp_degree, "Data-parallel degree.").required().at_least(1);
  }
  /// Tokens of one optimizer step over all ranks (modalities::tokens_per_step).
  i64 tokens_per_step() const {
    return modalities::tokens_per_step(local_train_micro_batch_size, sequence_length, gradient_accumulation_steps,
                                       dp_degree);
  }
};

struct TrainingTarget {
  i64 num_target_tokens = 1, num_target_steps = 1;
  static void describe(Schema<TrainingTarget>& s) {
    s.ignore_unknown_keys();
    s.field("num_target_tokens", &TrainingTarget::num_target_tokens, "Tokens the whole run consumes.")
        .required()
        .at_least(1);
    s.field("num_target_steps", &TrainingTarget::num_target_steps, "Optimizer steps of the whole run.")
        .required()
        .at_least(1);
  }
};

struct TrainingProgressSettings {
  i64 global_num_seen_tokens = 0, num_seen_steps = 0, num_seen_samples = 0, last_step = -1;
  static void describe(Schema<TrainingProgressSettings>& s) {
    using C = TrainingProgressSettings;
    s.ignore_unknown_keys();
    s.field("global_num_seen_tokens", &C::global_num_seen_tokens, "Tokens consumed before this run.")
        .required()
        .non_negative();
    s.field("num_seen_steps", &C::num_seen_steps, "Steps done before this run.").required().non_negative();
    s.field("num_seen_samples", &C::num_seen_samples, "Samples consumed before this run.").required().non_negative();
    s.field("last_step", &C::last_step, "Last step done before this run (-1 for none).").required().at_least(-1);
  }
};

struct TrainingSettings {
  std::string experiment_id;
  std::filesystem::path config_file_path;
  std::map<std::string, std::string> referencing_keys;
  CudaEnvSettings cuda_env;
  std::map<std::string, std::filesystem::path> paths;
  IntervalSettings intervals;
  ConsistencyEnforcement consistency_enforcement;
  StepProfile step_profile;
  TrainingTarget training_target;
  TrainingProgressSettings training_progress;
  std::optional<std::map<std::string, std::filesystem::path>> warmstart_checkpoint_paths;
  std::string device = "auto";
  std::optional<double> process_group_timeout_s;

  static void describe(Schema<TrainingSettings>& s) {
    using C = TrainingSettings;
    s.ignore_unknown_keys();
    s.field("experiment_id", &C::experiment_id, "Run id (${modalities_env:experiment_id}).").required();
    s.field("config_file_path", &C::config_file_path, "This config (${modalities_env:config_file_path}).")
        .required()
        .existing_file();
    s.field("referencing_keys", &C::referencing_keys, "sample_key, target_key, prediction_key, for interpolation.")
        .required();
    s.field("cuda_env", &C::cuda_env, "Launcher environment.").required();
    s.field("paths", &C::paths, "experiments_root_path and any other named paths.").required();
    s.field("intervals", &C::intervals, "Logging, checkpointing and evaluation intervals.").required();
    s.field("consistency_enforcement", &C::consistency_enforcement, "Which consistency checks are errors.");
    s.field("step_profile", &C::step_profile, "Shape of one optimizer step.").required();
    s.field("training_target", &C::training_target, "Budget of the whole run.").required();
    s.field("training_progress", &C::training_progress, "Where the run starts (warm start).").required();
    s.field("warmstart_checkpoint_paths", &C::warmstart_checkpoint_paths,
            "{checkpoint_folder_path} or {model_checkpoint_path, optimizer_checkpoint_path} of the previous run.");
    s.field("device", &C::device,
            "Where the run computes: \"auto\" (cuda:<LOCAL_RANK> when CUDA is available, else cpu), \"cpu\", "
            "\"cuda\" or \"cuda:N\". MODALITIES_DEVICE overrides it. Not a Modalities field.");
    s.field("process_group_timeout_s", &C::process_group_timeout_s,
            "Several processes: rendezvous and collective timeout in seconds (default 600); a rank that waits "
            "longer fails with an error naming the collective. A literal number (read before the process group "
            "exists); --process_group_timeout_s overrides it. Not a Modalities field.")
        .positive();
    s.rule([](const C& c, ParseContext& ctx) {
      if (!c.paths.contains("experiments_root_path"))
        ctx.fail("paths", "missing required key 'experiments_root_path'",
                 "paths.experiments_root_path = \"${modalities_env:experiments_root_path}\"");
      if (c.warmstart_checkpoint_paths) {
        const auto& w = *c.warmstart_checkpoint_paths;
        const bool folder = w.contains("checkpoint_folder_path");
        const bool files = w.contains("model_checkpoint_path");
        for (const auto& [k, v] : w)
          if (k != "checkpoint_folder_path" && k != "model_checkpoint_path" && k != "optimizer_checkpoint_path")
            ctx.fail("warmstart_checkpoint_paths." + k, "unknown key",
                     "expected checkpoint_folder_path, or model_checkpoint_path (+ optimizer_checkpoint_path)");
        if (folder == files)
          ctx.fail("warmstart_checkpoint_paths",
                   "give either checkpoint_folder_path or model_checkpoint_path (+ optimizer_checkpoint_path)");
      }
      check_consistency(c, ctx);
    });
  }

  // Modalities' four settings validators, in Modalities' order.
  static void check_consistency(const TrainingSettings& c, ParseContext& ctx) {
    const auto& e = c.consistency_enforcement;
    auto report = [&](bool enforce, std::string path, std::string message) {
      if (enforce) ctx.fail(std::move(path), std::move(message));
      else ctx.warn(std::move(path), std::move(message) + " (not enforced)");
    };
    const i64 steps_left = c.training_target.num_target_steps - c.training_progress.num_seen_steps;
    const i64 tokens_left = c.training_target.num_target_tokens - c.training_progress.global_num_seen_tokens;
    const auto& p = c.step_profile;
    i64 per_step = 0;
    try {
      per_step = p.tokens_per_step();
    } catch (const Error& error) {
      ctx.fail("step_profile", error.what());
      return;
    }
    if (steps_left <= 0) {
      ctx.fail("training_target.num_target_steps",
               fmt::format("no steps left to train: num_target_steps ({}) <= training_progress.num_seen_steps ({})",
                           c.training_target.num_target_steps, c.training_progress.num_seen_steps));
      return;
    }
    if (static_cast<double>(tokens_left) / static_cast<double>(steps_left) != static_cast<double>(per_step))
      report(e.enforce_tokens_per_step_consistency, "training_target",
             fmt::format("tokens per step are inconsistent: (num_target_tokens - global_num_seen_tokens) / "
                         "(num_target_steps - num_seen_steps) = {} / {} = {}, but local_train_micro_batch_size * "
                         "sequence_length * gradient_accumulation_steps * dp_degree = {}",
                         tokens_left, steps_left, static_cast<double>(tokens_left) / static_cast<double>(steps_left),
                         per_step));
    const std::pair<const char*, i64> intervals[] = {
        {"training_log_interval_in_steps", c.intervals.training_log_interval_in_steps},
        {"evaluation_interval_in_steps", c.intervals.evaluation_interval_in_steps},
        {"checkpointing_interval_in_steps", c.intervals.checkpointing_interval_in_steps}};
    const bool enforce[] = {e.enforce_last_step_logged, e.enforce_last_step_evaluated,
                            e.enforce_last_step_checkpointed};
    const char* what[] = {"logged", "evaluated", "checkpointed"};
    for (int i = 0; i < 3; ++i)
      if (steps_left % intervals[i].second != 0)
        report(enforce[i], fmt::format("intervals.{}", intervals[i].first),
               fmt::format("the last step is not {}: {} steps left is not a multiple of {}{}", what[i], steps_left,
                           intervals[i].second,
                           c.training_progress.num_seen_steps > 0 &&
                                   c.training_progress.num_seen_steps % intervals[i].second != 0
                               ? fmt::format(" (this warm start begins at step {}, off the interval, e.g. from a "
                                             "checkpoint written on a stop request; set consistency_enforcement."
                                             "enforce_last_step_{} = false to continue anyway)",
                                             c.training_progress.num_seen_steps, what[i])
                               : std::string()));
  }
};

/// Parses `settings` against the training Settings schema and runs validators
/// 1-4 (tokens per step, last step logged/evaluated/checkpointed).
void check_training_settings(const Value& settings, ParseContext& ctx);

/// The parsed settings of a built training config. Throws modalities::Error
/// listing every problem.
TrainingSettings parse_training_settings(const Value& settings);

/// Validator 5 over the built set: train_dataset holds enough tokens.
void check_training_set(const BuiltGraph& built, ParseContext& ctx);

/// The schema, for documentation and `--help`.
std::vector<FieldInfo> training_settings_fields();

}  // namespace modalities::core
