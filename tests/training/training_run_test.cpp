// End-to-end training through the `modalities` binary, on the shipped
// quickstart config shrunk to a few seconds (1 layer, sequence 32, 8 steps):
//  * exact resume: steps 5-8 of a warm start from the step-4 checkpoint have
//    bit-identical losses and gradient norms, and the final model and
//    optimizer state are bit-identical to the uninterrupted run (CPU, fp32);
//  * faults: NaN loss stops with the step named and no checkpoint after it;
//    a checkpoint from a different model shape and a corrupted checkpoint are
//    refused with clear messages.
#include "run_command.h"
#include "scratch_dir.h"

#include <modalities/sdk/formats/safetensors.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace modalities::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kHost = MODALITIES_TEST_HOST_BINARY;
const fs::path kRoot = MODALITIES_TEST_SOURCE_ROOT;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void replace_line(std::string& text, const std::string& from, const std::string& to) {
  const auto pos = text.find(from);
  ASSERT_NE(pos, std::string::npos) << "the quickstart config no longer contains: " << from;
  text.replace(pos, from.size(), to);
}

/// configs/<folder>/<name> (the quickstart's or one derived from it) shrunk to a seconds-long run.
std::string tiny_config(const std::string& name, const std::map<std::string, std::string>& extra = {},
                        const std::string& folder = "quickstart") {
  std::string t = read_file(kRoot / "configs" / folder / name);
  // Any run length (the quickstart's 80 steps, the MoE config's 40) becomes 8 steps.
  const std::string steps = std::regex_replace(t, std::regex("num_target_steps = [0-9]+"), "num_target_steps = 8");
  EXPECT_NE(steps, t) << "configs/" << folder << "/" << name << " no longer sets num_target_steps";
  t = steps;
  const std::vector<std::pair<std::string, std::string>> edits = {
      {"n_layer = 2", "n_layer = 1"},
      {"sequence_length = 128", "sequence_length = 32"},
      {"training_log_interval_in_steps = 5", "training_log_interval_in_steps = 1"},
      {"checkpointing_interval_in_steps = 20", "checkpointing_interval_in_steps = 4"},
      {"evaluation_interval_in_steps = 20", "evaluation_interval_in_steps = 4"},
      {"config = { k = 2 }", "config = { k = -1 }"},
      {"warmup_steps = 10", "warmup_steps = 2"},
      {"variant_key = \"rich\"", "variant_key = \"dummy\""},
      {"train_dataset_path = \"${modalities_env:config_folder_path}/../../data/sample/train.pbin\"",
       "train_dataset_path = \"" + (kRoot / "data/sample/train.pbin").string() + "\""},
  };
  for (const auto& [from, to] : edits) replace_line(t, from, to);
  // The dummy progress subscriber takes an empty config.
  const auto begin = t.find("[progress_subscriber.config]");
  const auto end = t.find("[evaluation_subscriber]");
  if (begin != std::string::npos && end != std::string::npos) t.replace(begin, end - begin, "");
  replace_line(t, "variant_key = \"dummy\"\n", "variant_key = \"dummy\"\nconfig = {}\n");
  for (const auto& [from, to] : extra) replace_line(t, from, to);
  return t;
}

/// An evaluation data loader over the small bundled lorem-ipsum file, followed by the
/// `[evaluation_subscriber]` header it is inserted before.
std::string val_tables() {
  std::string t = R"TOML([val_dataset]
component_key = "dataset"
variant_key = "packed_mem_map_dataset_continuous"
config = { raw_data_path = "@VAL@", sequence_length = "${settings.step_profile.sequence_length}", sample_key = "${settings.referencing_keys.sample_key}" }

[val_dataloader]
component_key = "data_loader"
variant_key = "default"

[val_dataloader.config]
num_workers = 1
pin_memory = false
dataloader_tag = "val"
dataset = { instance_key = "val_dataset", pass_type = "BY_REFERENCE" }
collate_fn = { instance_key = "collate_fn", pass_type = "BY_REFERENCE" }

[val_dataloader.config.batch_sampler]
component_key = "batch_sampler"
variant_key = "default"

[val_dataloader.config.batch_sampler.config]
batch_size = 4
drop_last = true

[val_dataloader.config.batch_sampler.config.sampler]
component_key = "sampler"
variant_key = "resumable_distributed_sampler"

[val_dataloader.config.batch_sampler.config.sampler.config]
dataset = { instance_key = "val_dataset", pass_type = "BY_REFERENCE" }
rank = 0
num_replicas = 1
shuffle = false
drop_last = true

[evaluation_subscriber]
)TOML";
  replace_line(t, "@VAL@", (kRoot / "data/sample/eval.pbin").string());
  return t;
}

const std::pair<std::string, std::string> kWithEval = {
    "eval_dataloaders = []",
    "eval_dataloaders = [{ instance_key = \"val_dataloader\", pass_type = \"BY_REFERENCE\" }]"};

CommandResult modalities(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {kHost};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_command(argv, {{"MODALITIES_PROGRESS", "0"}, {"OMP_NUM_THREADS", "1"}});
}

/// One JSON line of evaluation_results.jsonl, flattened to "key" -> raw number text.
std::vector<std::map<std::string, std::string>> read_results(const fs::path& file) {
  std::vector<std::map<std::string, std::string>> out;
  std::istringstream in(read_file(file));
  const std::regex item("\"([^\"]+)\": (-?[0-9.eE+-]+|NaN|Infinity|-Infinity|\"[^\"]*\")");
  for (std::string line; std::getline(in, line);) {
    std::map<std::string, std::string> m;
    for (auto it = std::sregex_iterator(line.begin(), line.end(), item); it != std::sregex_iterator(); ++it)
      m[(*it)[1]] = (*it)[2];
    out.push_back(std::move(m));
  }
  return out;
}

std::vector<std::map<std::string, std::string>> train_results(const fs::path& file) {
  std::vector<std::map<std::string, std::string>> out;
  for (auto& r : read_results(file))
    if (r["dataloader_tag"] == "\"train\"") out.push_back(r);
  return out;
}

fs::path checkpoint_folder(const fs::path& checkpoints, int step) {
  for (const auto& e : fs::directory_iterator(checkpoints))
    if (e.is_directory() &&
        e.path().filename().string().find("-seen_steps_" + std::to_string(step) + "-") != std::string::npos)
      return e.path();
  return {};
}

class TrainingRunTest : public ::testing::Test {
 protected:
  // Trains tiny_config(name, extra, folder) as experiment `id` under dir_/experiments (the run must
  // succeed) and returns its training results.
  std::vector<std::map<std::string, std::string>> train(const std::string& id, const std::string& name,
                                                        const std::map<std::string, std::string>& extra,
                                                        const std::string& folder = "quickstart") {
    const fs::path experiments = dir_.path() / "experiments";
    const fs::path cfg = dir_.write(id + ".toml", tiny_config(name, extra, folder));
    const CommandResult r = modalities({"run", "--config_file_path", cfg.string(), "--experiments_root_path",
                                        experiments.string(), "--experiment_id", id});
    EXPECT_EQ(r.exit_code, 0) << r;
    return train_results(experiments / id / "evaluation_results.jsonl");
  }
  ScratchDir dir_;
};

TEST_F(TrainingRunTest, WarmStartFromStepFourReproducesStepsFiveToEightBitForBit) {
  const fs::path train = dir_.write("train.toml", tiny_config("train.toml"));
  const fs::path warm = dir_.write("warmstart.toml", tiny_config("warmstart.toml"));
  const fs::path experiments = dir_.path() / "experiments";

  const CommandResult full = modalities({"run", "--config_file_path", train.string(), "--experiments_root_path",
                                         experiments.string(), "--experiment_id", "full"});
  ASSERT_EQ(full.exit_code, 0) << full;
  EXPECT_THAT(full.out, HasSubstr("Training Report"));
  EXPECT_THAT(full.out, HasSubstr("Training finished after 8 steps"));
  const auto full_results = train_results(experiments / "full/evaluation_results.jsonl");
  ASSERT_EQ(full_results.size(), 8u);
  EXPECT_TRUE(fs::exists(experiments / "full/train.toml"));
  EXPECT_TRUE(fs::exists(experiments / "full/train.resolved.toml"));

  // The loss falls over the eight steps.
  EXPECT_LT(std::stod(full_results[7].at("train loss avg")), std::stod(full_results[0].at("train loss avg")));

  const fs::path step4 = checkpoint_folder(experiments / "full/checkpoints", 4);
  ASSERT_FALSE(step4.empty()) << "no step-4 checkpoint in " << (experiments / "full/checkpoints");
  const fs::path info = dir_.write("info.json", "{\"checkpoint_folder_path\": \"" + step4.string() + "\"}");

  const CommandResult resumed =
      modalities({"warmstart", "--config_file_path", warm.string(), "--experiments_root_path", experiments.string(),
                  "--experiment_id", "resumed", "--last_checkpoint_info_file_path", info.string()});
  ASSERT_EQ(resumed.exit_code, 0) << resumed;
  EXPECT_THAT(resumed.out, HasSubstr("Training finished after 8 steps (4 in this run)"));
  const auto resumed_results = train_results(experiments / "resumed/evaluation_results.jsonl");
  ASSERT_EQ(resumed_results.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    const auto& a = full_results[4 + i];
    const auto& b = resumed_results[i];
    EXPECT_EQ(a.at("num_train_steps_done"), b.at("num_train_steps_done"));
    for (const char* key : {"train loss avg", "train loss last", "grad norm last", "consumed tokens", "lr mean"})
      EXPECT_EQ(a.at(key), b.at(key)) << key << " at step " << a.at("num_train_steps_done");
  }

  // Final state: model, optimizer and scheduler tensors bit-identical.
  const fs::path end_full = checkpoint_folder(experiments / "full/checkpoints", 8);
  const fs::path end_resumed = checkpoint_folder(experiments / "resumed/checkpoints", 8);
  ASSERT_FALSE(end_full.empty());
  ASSERT_FALSE(end_resumed.empty());
  const StateDict a = formats::read_safetensors(end_full / "app_state.safetensors");
  const StateDict b = formats::read_safetensors(end_resumed / "app_state.safetensors");
  ASSERT_EQ(a.size(), b.size());
  std::size_t compared = 0;
  for (const auto& [key, tensor] : a) {
    ASSERT_TRUE(b.contains(key)) << key;
    EXPECT_TRUE(at::equal(tensor, b.at(key))) << key << " differs after the warm start";
    ++compared;
  }
  EXPECT_GT(compared, 10u);
}

// configs/moe/train_cpu.toml: model/gpt2_moe trained on loss/weighted_sum of the cross-entropy and
// loss/moe_aux_loss. The first step's loss (same seeded weights, same batch) exceeds that of the
// same run with the auxiliary term weighted 0 by the block's load-balancing and z-loss terms:
// about 0.01 (perfect balance) plus 0.001 * logsumexp^2 (about 2 for 4 experts near uniform).
TEST_F(TrainingRunTest, MoeConfigTrainsOnTheAuxiliaryLossesAndMovesTheExpertBias) {
  const auto run = [&](const std::string& id, const std::map<std::string, std::string>& extra) {
    return train(id, "train_cpu.toml", extra, "moe");
  };
  const auto with = run("moe", {{"use_expert_bias = true", "use_expert_bias = true\nlog_tokens_per_expert = true"}});
  const auto without = run("moe_plain", {{"weights = [1.0, 1.0]", "weights = [1.0, 0.0]"}});
  ASSERT_EQ(with.size(), 8u);
  ASSERT_EQ(without.size(), 8u);
  for (const auto& r : with) EXPECT_TRUE(std::isfinite(std::stod(r.at("train loss last"))));
  const double aux = std::stod(with[0].at("train loss last")) - std::stod(without[0].at("train loss last"));
  EXPECT_GT(aux, 0.005) << "the auxiliary losses are part of the trained loss";
  EXPECT_LT(aux, 0.05);
  EXPECT_LT(std::stod(with[7].at("train loss avg")), std::stod(with[0].at("train loss avg")));
  // Every step logs the (one) block's routing and auxiliary loss (Module::take_metrics); at step 1
  // it is what the auxiliary term added to the trained loss.
  double aux_logged = 0;
  for (const auto& r : with)
    for (const std::string block : {"block 0"}) {
      const double hi = std::stod(r.at("moe load max over mean (" + block + ")"));
      const double lo = std::stod(r.at("moe load min over mean (" + block + ")"));
      EXPECT_GE(hi, 1.0);
      EXPECT_LE(hi, 4.0);  // 4 experts: one that takes every slot
      EXPECT_GE(lo, 0.0);
      EXPECT_LE(lo, 1.0);
      // log_tokens_per_expert: the 4 experts' slots, N * top_k of every step, whose largest and
      // smallest over their mean are the two numbers above.
      std::vector<double> counts;
      for (int e = 0; e < 4; ++e)
        counts.push_back(std::stod(r.at(fmt::format("moe tokens of expert {} ({})", e, block))));
      EXPECT_FALSE(r.contains(fmt::format("moe tokens of expert 4 ({})", block)));
      const double slots = std::accumulate(counts.begin(), counts.end(), 0.0);
      EXPECT_EQ(slots, std::stod(with[0].at("moe tokens of expert 0 (block 0)")) +
                           std::stod(with[0].at("moe tokens of expert 1 (block 0)")) +
                           std::stod(with[0].at("moe tokens of expert 2 (block 0)")) +
                           std::stod(with[0].at("moe tokens of expert 3 (block 0)")));
      EXPECT_EQ(std::fmod(slots, 2.0), 0.0);  // top_k = 2
      EXPECT_NEAR(hi, *std::max_element(counts.begin(), counts.end()) / (slots / 4), 1e-4);
      EXPECT_NEAR(lo, *std::min_element(counts.begin(), counts.end()) / (slots / 4), 1e-4);
      const double block_aux = std::stod(r.at("moe aux loss (" + block + ")"));
      EXPECT_GT(block_aux, 0.0);
      if (&r == &with[0]) aux_logged += block_aux;
    }
  EXPECT_NEAR(aux_logged, aux, 1e-4);
  EXPECT_FALSE(with[0].contains("moe dropped slots (block 0)"));  // dropless: nothing to report
  // Activation checkpointing of the blocks (model/activation_checkpointed): the MoE block's
  // auxiliary loss passes through the recomputation, and the run is the same, bit for bit.
  const auto checkpointed =
      run("moe_ac", {{"[app_state.config]\nmodel = { instance_key = \"model_raw\", pass_type = \"BY_REFERENCE\" }",
                      "[app_state.config]\nmodel = { component_key = \"model\", variant_key = "
                      "\"activation_checkpointed\", config = { model = { instance_key = \"model_raw\", pass_type = "
                      "\"BY_REFERENCE\" }, layers_fqn = \"transformer.h\", ac_variant = "
                      "\"full_activation_checkpointing\", ac_fun_params = {} } }"}});
  ASSERT_EQ(checkpointed.size(), 8u);
  for (std::size_t i = 0; i < 8; ++i)
    for (const char* key : {"train loss avg", "grad norm last", "moe aux loss (block 0)"})
      EXPECT_EQ(checkpointed[i].at(key), with[i].at(key)) << key << " at step " << i + 1;
  // The auxiliary-loss-free bias (optimizer/moe_load_balanced) starts at zero and moves after each
  // step: a large rate changes no first step and the choices of the later ones.
  const auto moved = run("moe_bias", {{"expert_bias_update_rate = 1e-3", "expert_bias_update_rate = 1.0"}});
  ASSERT_EQ(moved.size(), 8u);
  EXPECT_EQ(moved[0].at("train loss last"), with[0].at("train loss last"));
  EXPECT_NE(moved[3].at("train loss last"), with[3].at("train loss last"));
}

// Document masking end to end: collate_fn/document_masking_collator_wrapper over the quickstart's
// collator hands model/gpt2 the document ids of the packed samples (EOD id 0 in the bundled
// tokenizer). The run trains, and differs from the unmasked one on the same weights and batches.
TEST_F(TrainingRunTest, DocumentMaskedTrainingRunsThroughTheCollatorIntoTheModel) {
  const auto run = [&](const std::string& id, const std::map<std::string, std::string>& extra) {
    return train(id, "train.toml", extra);
  };
  // Samples of 128 tokens (the bundled documents average ~470): most steps cross a boundary.
  const auto plain = run("plain", {{"sequence_length = 32", "sequence_length = 128"}});
  const auto masked =
      run("masked",
          {{"sequence_length = 32", "sequence_length = 128"},
           {"[collate_fn]\ncomponent_key = \"collate_fn\"\nvariant_key = \"gpt_2_llm_collator\"\n\n[collate_fn.config]",
            "[collate_fn]\ncomponent_key = \"collate_fn\"\nvariant_key = \"document_masking_collator_wrapper\"\n\n"
            "[collate_fn.config]\nsample_key = \"${settings.referencing_keys.sample_key}\"\neod_token_id = 0\n"
            "wrapped_collate_fn = { instance_key = \"packing_collate_fn\", pass_type = \"BY_REFERENCE\" }\n\n"
            "[packing_collate_fn]\ncomponent_key = \"collate_fn\"\nvariant_key = \"gpt_2_llm_collator\"\n\n"
            "[packing_collate_fn.config]"},
           {"[model_raw.config]\n",
            "[model_raw.config]\ndocument_ids_key = \"document_ids\"\n"
            "document_positions = \"restart\"\n"}});
  ASSERT_EQ(plain.size(), 8u);
  ASSERT_EQ(masked.size(), 8u);
  for (const auto& r : masked) EXPECT_TRUE(std::isfinite(std::stod(r.at("train loss avg"))));
  EXPECT_NE(masked[7].at("train loss avg"), plain[7].at("train loss avg"));
}

TEST_F(TrainingRunTest, WarmStartIsExactWithDropoutAndEvaluation) {
  // Dropout draws from the global generator (attention dropout also in eval mode); the
  // checkpoint restores it and evaluation leaves it untouched, so resuming stays exact.
  const std::map<std::string, std::string> edits = {
      {"dropout = 0.0", "dropout = 0.1"}, kWithEval, {"[evaluation_subscriber]\n", val_tables()}};
  const fs::path train = dir_.write("train.toml", tiny_config("train.toml", edits));
  const fs::path warm = dir_.write("warmstart.toml", tiny_config("warmstart.toml", edits));
  const fs::path experiments = dir_.path() / "experiments";
  const CommandResult full = modalities({"run", "--config_file_path", train.string(), "--experiments_root_path",
                                         experiments.string(), "--experiment_id", "full"});
  ASSERT_EQ(full.exit_code, 0) << full;
  const fs::path step4 = checkpoint_folder(experiments / "full/checkpoints", 4);
  ASSERT_FALSE(step4.empty());
  const fs::path info = dir_.write("info.json", "{\"checkpoint_folder_path\": \"" + step4.string() + "\"}");
  const CommandResult resumed =
      modalities({"warmstart", "--config_file_path", warm.string(), "--experiments_root_path", experiments.string(),
                  "--experiment_id", "resumed", "--last_checkpoint_info_file_path", info.string()});
  ASSERT_EQ(resumed.exit_code, 0) << resumed;
  const auto a = train_results(experiments / "full/evaluation_results.jsonl");
  const auto b = train_results(experiments / "resumed/evaluation_results.jsonl");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 4u);
  for (int i = 0; i < 4; ++i)
    for (const char* key : {"train loss avg", "grad norm last"})
      EXPECT_EQ(a[4 + i].at(key), b[i].at(key)) << key << " at step " << a[4 + i].at("num_train_steps_done");
}

TEST_F(TrainingRunTest, Bf16MixedPrecisionTrainsWithBf16LossesAndFp32MasterWeights) {
  const fs::path train =
      dir_.write("train.toml",
                 tiny_config("train.toml",
                             {{"model = { instance_key = \"model_raw\", pass_type = \"BY_REFERENCE\" }",
                               "model = { instance_key = \"mp_model\", pass_type = \"BY_REFERENCE\" }"},
                              {"[model_raw]\n",
                               "[mp_model]\ncomponent_key = \"model\"\nvariant_key = \"mixed_precision\"\n"
                               "config = { model = { instance_key = \"model_raw\", pass_type = \"BY_REFERENCE\" }, "
                               "mixed_precision_settings = { param_dtype = \"BF_16\", reduce_dtype = \"BF_16\" } }\n\n"
                               "[model_raw]\n"}}));
  const fs::path experiments = dir_.path() / "experiments";
  const CommandResult r = modalities({"run", "--config_file_path", train.string(), "--experiments_root_path",
                                      experiments.string(), "--experiment_id", "bf16"});
  ASSERT_EQ(r.exit_code, 0) << r;
  const auto results = train_results(experiments / "bf16/evaluation_results.jsonl");
  ASSERT_EQ(results.size(), 8u);
  for (const auto& step : results) {
    // The loss of a micro-batch is a bf16 scalar (Modalities' FSDP2 mixed precision).
    const double last = std::stod(step.at("train loss last"));
    EXPECT_EQ(static_cast<double>(static_cast<float>(c10::BFloat16(static_cast<float>(last)))), last) << last;
  }
  EXPECT_LT(std::stod(results[7].at("train loss avg")), std::stod(results[0].at("train loss avg")));
  // Master weights stay fp32 in the checkpoint.
  const StateDict state =
      formats::read_safetensors(checkpoint_folder(experiments / "bf16/checkpoints", 8) / "app_state.safetensors");
  EXPECT_EQ(state.at("model.transformer.wte.weight").scalar_type(), at::kFloat);
}

// A component's build-time warning reaches the user without --verbose: model/compiled's notice
// that LibTorch has no compiler is printed once, and the run trains as without it.
TEST_F(TrainingRunTest, ComponentWarningsArePrintedWithoutVerbose) {
  const fs::path train = dir_.write(
      "train.toml",
      tiny_config("train.toml", {{"model = { instance_key = \"model_raw\", pass_type = \"BY_REFERENCE\" }",
                                  "model = { instance_key = \"compiled_model\", pass_type = \"BY_REFERENCE\" }"},
                                 {"[model_raw]\n",
                                  "[compiled_model]\ncomponent_key = \"model\"\nvariant_key = \"compiled\"\n"
                                  "config = { model = { instance_key = \"model_raw\", pass_type = \"BY_REFERENCE\" }, "
                                  "block_names = [\"GPT2Block\"] }\n\n"
                                  "[model_raw]\n"}}));
  const fs::path experiments = dir_.path() / "experiments";
  const CommandResult r = modalities({"run", "--config_file_path", train.string(), "--experiments_root_path",
                                      experiments.string(), "--experiment_id", "compiled"});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.err, HasSubstr("warning: compiled_model: LibTorch has no torch.compile")) << r;
  EXPECT_EQ(train_results(experiments / "compiled/evaluation_results.jsonl").size(), 8u);
}

TEST_F(TrainingRunTest, EvaluationRunsAtItsIntervalInEvalModeAndIsRecorded) {
  const std::string tables = val_tables();
  const fs::path train =
      dir_.write("train.toml", tiny_config("train.toml", {kWithEval, {"[evaluation_subscriber]\n", tables}}));
  const fs::path experiments = dir_.path() / "experiments";
  const CommandResult r = modalities({"run", "--config_file_path", train.string(), "--experiments_root_path",
                                      experiments.string(), "--experiment_id", "eval"});
  ASSERT_EQ(r.exit_code, 0) << r;
  std::vector<std::map<std::string, std::string>> evals;
  for (auto& rec : read_results(experiments / "eval/evaluation_results.jsonl"))
    if (rec["dataloader_tag"] == "\"val\"") evals.push_back(rec);
  ASSERT_EQ(evals.size(), 2u) << r;  // steps 4 and 8 (evaluation interval 4)
  EXPECT_EQ(evals[0].at("num_train_steps_done"), "4");
  EXPECT_EQ(evals[1].at("num_train_steps_done"), "8");
  for (const auto& e : evals) {
    EXPECT_TRUE(e.contains("CLMCrossEntropyLoss"));
    EXPECT_TRUE(e.contains("evaluation_num_samples_per_second"));
  }
  // The model learns: the validation loss at step 8 is below the one at step 4.
  EXPECT_LT(std::stod(evals[1].at("CLMCrossEntropyLoss")), std::stod(evals[0].at("CLMCrossEntropyLoss")));
  EXPECT_THAT(r.out, HasSubstr("| val | step: 4 | evaluation_num_samples_per_second: "));
  // Evaluation does not disturb training (train mode restored, no gradients kept): the training
  // losses equal those of a run without evaluation.
  const fs::path plain = dir_.write("plain.toml", tiny_config("train.toml"));
  const CommandResult p = modalities({"run", "--config_file_path", plain.string(), "--experiments_root_path",
                                      experiments.string(), "--experiment_id", "plain"});
  ASSERT_EQ(p.exit_code, 0) << p;
  const auto with_eval = train_results(experiments / "eval/evaluation_results.jsonl");
  const auto without = train_results(experiments / "plain/evaluation_results.jsonl");
  ASSERT_EQ(with_eval.size(), without.size());
  for (std::size_t i = 0; i < with_eval.size(); ++i)
    EXPECT_EQ(with_eval[i].at("train loss avg"), without[i].at("train loss avg")) << "step " << i + 1;
}

TEST_F(TrainingRunTest, NanLossStopsWithTheStepNamedAndNoLaterCheckpoint) {
  const fs::path train = dir_.write("train.toml", tiny_config("train.toml", {{"max_lr = 3e-3", "max_lr = 1e30"},
                                                                             {"\nlr = 3e-3", "\nlr = 1e30"},
                                                                             {"max_norm = 1.0", "max_norm = 1e30"}}));
  const fs::path experiments = dir_.path() / "experiments";
  const CommandResult r = modalities({"run", "--config_file_path", train.string(), "--experiments_root_path",
                                      experiments.string(), "--experiment_id", "nan"});
  EXPECT_EQ(r.exit_code, 1) << r;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m, std::regex("became NaN/inf at step ([0-9]+)"))) << r;
  const int bad_step = std::stoi(m[1]);
  const fs::path checkpoints = experiments / "nan/checkpoints";
  if (fs::exists(checkpoints))
    for (const auto& e : fs::directory_iterator(checkpoints)) {
      std::smatch s;
      const std::string name = e.path().filename().string();
      if (std::regex_search(name, s, std::regex("seen_steps_([0-9]+)-"))) {
        EXPECT_LT(std::stoi(s[1]), bad_step) << "checkpoint written at or after the NaN step: " << name;
      }
    }
}

TEST_F(TrainingRunTest, SigintFinishesTheStepCheckpointsAndExitsWith130) {
  const fs::path train = dir_.write(
      "train.toml",
      tiny_config("train.toml", {{"num_target_steps = 8", "num_target_steps = 1800"},  // 230 400 of the 233 280 tokens
                                 {"checkpointing_interval_in_steps = 4", "checkpointing_interval_in_steps = 900"}}));
  const fs::path experiments = dir_.path() / "experiments";
  // SIGINT after 6 s, well into training (the build takes about a second, a step a few ms).
  const CommandResult r = run_command(
      {"timeout", "--preserve-status", "-s", "INT", "6", kHost, "run", "--config_file_path", train.string(),
       "--experiments_root_path", experiments.string(), "--experiment_id", "sigint", "--checkpoint_on_interrupt"},
      {{"MODALITIES_PROGRESS", "0"}, {"OMP_NUM_THREADS", "1"}});
  EXPECT_EQ(r.exit_code, 130) << r;
  EXPECT_THAT(r.out, HasSubstr("Stopped on request after")) << r;
  EXPECT_THAT(r.out, HasSubstr("A checkpoint of the last step was written.")) << r;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("Stopped on request after ([0-9]+) steps"))) << r;
  EXPECT_FALSE(checkpoint_folder(experiments / "sigint/checkpoints", std::stoi(m[1])).empty()) << r;
}

// The shipped GPU configs cannot run here, but they must stay valid as the plugins evolve (the
// 8-GPU distributed ones as rank 0 of 8; those without warnings).
TEST(ShippedConfigsTest, GpuConfigsValidateForTheTrainingPipeline) {
  const std::vector<std::pair<const char*, const char*>> configs = {
      {"configs/gpu/gpt2_124m.toml", "1"},
      {"configs/gpu/llama_1b.toml", "1"},
      {"configs/distributed/fsdp2_gpu_8.toml", "8"},
      {"configs/distributed/hsdp_gpu_8.toml", "8"},
      {"configs/distributed/fsdp2_cpu.toml", "4"},
      {"configs/distributed/fsdp1_cpu.toml", "2"},
      {"configs/distributed/tp_gpu_8.toml", "8"},
      {"configs/distributed/tp_cpu.toml", "4"},
      {"configs/distributed/pp_cpu.toml", "2"},
      {"configs/distributed/pp_fsdp2_cpu.toml", "4"},
      {"configs/distributed/pp_gpu_8.toml", "8"},
      // model/parallelized twins and the chained configs added with them
      {"configs/distributed/hsdp_cpu.toml", "4"},
      {"configs/distributed/ac_cpu.toml", "2"},
      {"configs/distributed/fsdp2_parallelized_cpu.toml", "4"},
      {"configs/distributed/hsdp_parallelized_cpu.toml", "4"},
      {"configs/distributed/ac_parallelized_cpu.toml", "2"},
      {"configs/distributed/tp_parallelized_cpu.toml", "4"},
      {"configs/distributed/pp_parallelized_cpu.toml", "2"},
      {"configs/distributed/pp_fsdp2_parallelized_cpu.toml", "4"},
      {"configs/distributed/fsdp2_parallelized_gpu_8.toml", "8"},
      {"configs/distributed/hsdp_parallelized_gpu_8.toml", "8"},
      {"configs/distributed/tp_parallelized_gpu_8.toml", "8"},
      {"configs/distributed/pp_parallelized_gpu_8.toml", "8"},
      // expert parallelism (plugins/moe)
      {"configs/moe/ep_cpu.toml", "4"},
      {"configs/moe/ep_gpu_8.toml", "8"},
      // context parallelism
      {"configs/distributed/cp_cpu.toml", "4"},
      {"configs/distributed/cp_long_context_gpu_8.toml", "8"},
      // model/coca (plugins/coca)
      {"configs/coca/train_cpu.toml", "2"}};
  for (const auto& [name, world] : configs) {
    const CommandResult r = run_command({kHost, "config", "validate", (kRoot / name).string(), "--pipeline", "training",
                                         "--experiments_root_path", "/tmp/unused", "--experiment_id", "x"},
                                        {{"RANK", "0"}, {"LOCAL_RANK", "0"}, {"WORLD_SIZE", world}});
    EXPECT_EQ(r.exit_code, 0) << r;
    EXPECT_THAT(r.out, HasSubstr("valid for pipeline 'training'")) << r;
    if (std::string(name).starts_with("configs/distributed/")) {
      EXPECT_THAT(r.err, Not(HasSubstr("warning"))) << r;
    }
  }
}

class WarmStartFaultTest : public TrainingRunTest {
 protected:
  void SetUp() override {
    const fs::path train = dir_.write("train.toml", tiny_config("train.toml"));
    experiments_ = dir_.path() / "experiments";
    const CommandResult r = modalities({"run", "--config_file_path", train.string(), "--experiments_root_path",
                                        experiments_.string(), "--experiment_id", "base"});
    ASSERT_EQ(r.exit_code, 0) << r;
    step4_ = checkpoint_folder(experiments_ / "base/checkpoints", 4);
    ASSERT_FALSE(step4_.empty());
    info_ = dir_.write("info.json", "{\"checkpoint_folder_path\": \"" + step4_.string() + "\"}");
  }
  CommandResult warm_start(const std::map<std::string, std::string>& edits) {
    const fs::path warm = dir_.write("warmstart.toml", tiny_config("warmstart.toml", edits));
    return modalities({"warmstart", "--config_file_path", warm.string(), "--experiments_root_path",
                       experiments_.string(), "--experiment_id", "warm", "--last_checkpoint_info_file_path",
                       info_.string()});
  }
  fs::path experiments_, step4_, info_;
};

TEST_F(WarmStartFaultTest, CheckpointOfADifferentModelShapeIsRefusedByName) {
  const CommandResult r = warm_start({{"n_embd = 128", "n_embd = 256"}});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("transformer.")) << r;
  EXPECT_THAT(r.err, HasSubstr("256")) << r;
}

TEST_F(WarmStartFaultTest, CorruptedCheckpointIsRefused) {
  const fs::path file = step4_ / "app_state.safetensors";
  std::string bytes = read_file(file);
  ASSERT_GT(bytes.size(), 4096u);
  for (std::size_t i = bytes.size() - 2048; i < bytes.size() - 1024; ++i) bytes[i] = static_cast<char>(bytes[i] ^ 0x5a);
  std::ofstream(file, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  const CommandResult r = warm_start({});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr(step4_.filename().string())) << r;
}

// Regression: renaming the step-4 folder to "…seen_steps_2…" made warmstart train on from step 2
// with the step-4 state (the schedule shifted, exit 0). The folder name, the manifest and the
// optimizer/scheduler state are now checked against each other.
class WarmStartProgressTest : public WarmStartFaultTest {
 protected:
  // Renames the step-4 checkpoint to claim `steps` steps (tokens scaled alike) and points the
  // warm-start info at it.
  fs::path rename_to(int steps) {
    const std::string name = step4_.filename().string();
    std::smatch m;
    EXPECT_TRUE(std::regex_match(name, m, std::regex(R"((.*-seen_steps_)4(-seen_tokens_)(\d+)(-.*))")));
    tokens4_ = std::stoll(m[3].str());
    const fs::path renamed = step4_.parent_path() / (m[1].str() + std::to_string(steps) + m[2].str() +
                                                     std::to_string(tokens4_ / 4 * steps) + m[4].str());
    fs::rename(step4_, renamed);
    info_ = dir_.write("info.json", "{\"checkpoint_folder_path\": \"" + renamed.string() + "\"}");
    return renamed;
  }
  void edit_manifest(const fs::path& folder, const std::string& from, const std::string& to) {
    std::string text = read_file(folder / "manifest.json");
    const auto at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    std::ofstream(folder / "manifest.json", std::ios::trunc) << text;
  }
  long long tokens4_ = 0;
};

TEST_F(WarmStartProgressTest, RenamedCheckpointFolderIsRefusedNamingBothValues) {
  rename_to(2);
  const CommandResult r = warm_start({});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("its folder name says seen_steps_2, but manifest.json records num_seen_steps_total = 4"))
      << r;
}

TEST_F(WarmStartProgressTest, ManifestAgreeingWithAWrongNameIsRefusedByTheOptimizerState) {
  const fs::path renamed = rename_to(2);
  edit_manifest(renamed, "\"num_seen_steps_total\": 4", "\"num_seen_steps_total\": 2");
  edit_manifest(renamed, fmt::format("\"num_seen_tokens_total\": {}", tokens4_),
                fmt::format("\"num_seen_tokens_total\": {}", tokens4_ / 2));
  // Step 2 is off the checkpointing interval; that check would refuse first, so it is off here.
  const CommandResult r =
      warm_start({{"enforce_last_step_checkpointed = true", "enforce_last_step_checkpointed = false"}});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("settings.training_progress.num_seen_steps = 2")) << r;
  EXPECT_THAT(r.err, HasSubstr("the optimizer's state.")) << r;
  EXPECT_THAT(r.err, HasSubstr(".step = 4")) << r;
}

TEST_F(WarmStartProgressTest, ManifestWithAStringForANumberIsRefused) {
  edit_manifest(step4_, "\"num_seen_steps_total\": 4", "\"num_seen_steps_total\": \"4\"");
  const CommandResult r = warm_start({});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("'training_progress.num_seen_steps_total' is \"4\", expected a non-negative integer"))
      << r;
}

TEST_F(WarmStartProgressTest, BadValueInTheInfoFileIsReportedAgainstThatFile) {
  info_ = dir_.write("info.json", "{\"checkpoint_folder_path\": 5}");
  const CommandResult r = warm_start({});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("info.json: \"checkpoint_folder_path\" is 5, expected a non-empty checkpoint path"))
      << r;
}

TEST_F(TrainingRunTest, MissingDatasetIsNamed) {
  const fs::path train =
      dir_.write("train.toml", tiny_config("train.toml", {{(kRoot / "data/sample/train.pbin").string(),
                                                           (dir_.path() / "nowhere.pbin").string()}}));
  const CommandResult r = modalities({"run", "--config_file_path", train.string(), "--experiments_root_path",
                                      (dir_.path() / "experiments").string(), "--experiment_id", "missing"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("nowhere.pbin")) << r;
}

}  // namespace
}  // namespace modalities::testing
