// The training pipeline profile (docs/configs.md, docs/training.md): required top-level keys, the
// Settings schema (unknown keys ignored, strict ints) and the consistency
// validators with their enforce flags, checked before and after building.
#include "test_components.h"

#include <modalities/core/graph.h>
#include <modalities/core/interpolation.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace modalities::core {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const std::string kConfigFile = std::string(MODALITIES_TEST_SOURCE_ROOT) + "/configs/token_budget.toml";

std::string settings_toml(const std::string& overrides = "") {
  return R"(
[settings]
experiment_id = "exp"
config_file_path = ")" +
         kConfigFile + R"("
some_unknown_setting = "ignored like in Modalities"
referencing_keys = { sample_key = "input_ids", target_key = "target_ids", prediction_key = "logits" }
cuda_env = { local_rank = 0, world_size = 1, global_rank = 0 }
paths = { experiments_root_path = "/tmp/exp", extra_path = "/data" }
intervals = { training_log_interval_in_steps = 2, checkpointing_interval_in_steps = 4, evaluation_interval_in_steps = 4 }
step_profile = { gradient_accumulation_steps = 2, local_train_micro_batch_size = 4, sequence_length = 256, dp_degree = 1 }
training_target = { num_target_tokens = 16384, num_target_steps = 8 }
training_progress = { global_num_seen_tokens = 0, num_seen_steps = 0, num_seen_samples = 0, last_step = -1 }
)" + overrides;
}

std::vector<Diagnostic> validate_settings(const std::string& toml) {
  ConfigNode root = load_toml_string(toml, "train.toml");
  resolve_interpolations(root, builtin_resolvers({}));
  // Only `settings`: the other required keys need plugins that do not exist yet.
  PipelineProfile p = *find_pipeline("training");
  std::erase_if(p.entries, [](const PipelineEntry& e) { return e.key != "settings"; });
  const Registry registry;  // outlives the graph, which keeps a reference
  ComponentGraph g(registry, root, &p);
  return g.validate();
}

std::string all_text(const std::vector<Diagnostic>& ds, bool warnings) {
  std::string s;
  for (const auto& d : ds)
    if (d.warning == warnings) s += d.str() + "\n";
  return s;
}

TEST(TrainingSettingsTest, ConsistentSettingsPass) {
  const auto ds = validate_settings(settings_toml());
  EXPECT_EQ(all_text(ds, false), "");
  EXPECT_EQ(all_text(ds, true), "");
}

TEST(TrainingSettingsTest, TokensPerStepMustMatchTheStepProfile) {
  std::string toml = settings_toml();
  toml.replace(toml.find("num_target_tokens = 16384"), 25, "num_target_tokens = 16000");
  const std::string errors = all_text(validate_settings(toml), false);
  EXPECT_THAT(errors, HasSubstr("settings.training_target: tokens per step are inconsistent"));
  EXPECT_THAT(errors, HasSubstr("16000 / 8 = 2000"));
  EXPECT_THAT(errors, HasSubstr("= 2048"));
}

TEST(TrainingSettingsTest, EnforceFlagsTurnErrorsIntoWarnings) {
  std::string toml = settings_toml("consistency_enforcement = { enforce_last_step_logged = false }\n");
  toml.replace(toml.find("training_log_interval_in_steps = 2"), 34, "training_log_interval_in_steps = 3");
  const auto ds = validate_settings(toml);
  EXPECT_EQ(all_text(ds, false), "");
  EXPECT_THAT(all_text(ds, true), HasSubstr("settings.intervals.training_log_interval_in_steps: the last step is not "
                                            "logged: 8 steps left is not a multiple of 3 (not enforced)"));
}

TEST(TrainingSettingsTest, LastStepCheckpointedAndEvaluated) {
  std::string toml = settings_toml();
  toml.replace(toml.find("checkpointing_interval_in_steps = 4"), 35, "checkpointing_interval_in_steps = 5");
  EXPECT_THAT(all_text(validate_settings(toml), false),
              HasSubstr("the last step is not checkpointed: 8 steps left is not a multiple of 5"));
}

TEST(TrainingSettingsTest, NoStepsLeftIsAnErrorNotADivisionByZero) {
  std::string toml = settings_toml();
  toml.replace(toml.find("num_seen_steps = 0"), 18, "num_seen_steps = 8");
  EXPECT_THAT(all_text(validate_settings(toml), false), HasSubstr("no steps left to train"));
}

TEST(TrainingSettingsTest, SchemaIsStrictAboutTypesButIgnoresUnknownKeys) {
  std::string toml = settings_toml();
  toml.replace(toml.find("sequence_length = 256"), 21, "sequence_length = 256.0");
  const std::string errors = all_text(validate_settings(toml), false);
  EXPECT_THAT(errors, HasSubstr("settings.step_profile.sequence_length: expected an integer, got float"));
  EXPECT_THAT(errors, Not(HasSubstr("some_unknown_setting")));
  EXPECT_THAT(all_text(validate_settings(toml), true), Not(HasSubstr("some_unknown_setting")));
}

// Regression: a misspelt enforce_* flag switched its check off without a word.
TEST(TrainingSettingsTest, LikelyTyposOfKnownKeysWarnWithAHint) {
  const auto ds = validate_settings(
      settings_toml("consistency_enforcement = { enforce_last_step_checkpointd = false }\nintervalls = {}\n"));
  EXPECT_EQ(all_text(ds, false), "");
  const std::string warnings = all_text(ds, true);
  EXPECT_THAT(warnings, HasSubstr("settings.consistency_enforcement.enforce_last_step_checkpointd: unknown key, "
                                  "ignored; did you mean 'enforce_last_step_checkpointed'?"));
  EXPECT_THAT(warnings, HasSubstr("settings.intervalls: unknown key, ignored; did you mean 'intervals'?"));
}

TEST(TrainingSettingsTest, PathsNeedTheExperimentsRoot) {
  std::string toml = settings_toml();
  toml.replace(toml.find("experiments_root_path = \"/tmp/exp\", "), 35, "");
  EXPECT_THAT(all_text(validate_settings(toml), false),
              HasSubstr("settings.paths: missing required key 'experiments_root_path'"));
}

TEST(TrainingSettingsTest, MissingConfigFileAndMissingSectionsAreReported) {
  std::string toml = settings_toml();
  toml.replace(toml.find(kConfigFile), kConfigFile.size(), "/no/such/config.toml");
  toml.replace(toml.find("training_progress = "), 19, "training_progres = ");
  const std::string errors = all_text(validate_settings(toml), false);
  EXPECT_THAT(errors, HasSubstr("settings.config_file_path: file '/no/such/config.toml' does not exist"));
  EXPECT_THAT(errors, HasSubstr("settings.training_progress: missing required key"));
}

TEST(TrainingSettingsTest, WarmstartPathsHaveOneOfTwoShapes) {
  EXPECT_EQ(
      all_text(validate_settings(settings_toml("warmstart_checkpoint_paths = { checkpoint_folder_path = \"/c\" }\n")),
               false),
      "");
  EXPECT_THAT(
      all_text(
          validate_settings(settings_toml(
              "warmstart_checkpoint_paths = { checkpoint_folder_path = \"/c\", model_checkpoint_path = \"/m\" }\n")),
          false),
      HasSubstr("give either checkpoint_folder_path or model_checkpoint_path"));
}

TEST(TrainingSettingsTest, ProfileListsEveryRequiredTopLevelKey) {
  ConfigNode root = load_toml_string(settings_toml(), "train.toml");
  const Registry registry;
  ComponentGraph g(registry, root, find_pipeline("training"));
  const std::string errors = all_text(g.validate(), false);
  for (const char* key :
       {"app_state", "loss_fn", "train_dataset", "train_dataloader", "eval_dataloaders", "progress_subscriber",
        "evaluation_subscriber", "checkpoint_saving", "gradient_clipper", "model_raw"})
    EXPECT_THAT(errors, HasSubstr(fmt::format("missing top-level key '{}' required by pipeline 'training'", key)));
  EXPECT_THAT(errors, Not(HasSubstr("'profiler'")));  // optional
}

}  // namespace
}  // namespace modalities::core
