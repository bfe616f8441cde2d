// The `modalities` command line as a user meets it: the host binary runs as a
// subprocess with the bundled plugins (layer_norm, number_conversion), and
// each test checks the exit status (0 ok, 1 failed, 2 usage) and what the
// messages say: usage text, schemas, did-you-mean hints, and config errors
// pointing at file:line:col and the dotted config path.
#include "run_command.h"
#include "scratch_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace modalities::cli {
namespace {

using modalities::testing::CommandResult;
using modalities::testing::run_command;
using modalities::testing::ScratchDir;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::StartsWith;

const std::string kHost = MODALITIES_TEST_HOST_BINARY;

CommandResult modalities(std::vector<std::string> args) {
  args.insert(args.begin(), kHost);
  return run_command(args);
}

// The first line of `text` that starts with `prefix` (after indentation); empty when none does.
std::string line_starting_with(const std::string& text, const std::string& prefix) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const auto start = line.find_first_not_of(' ');
    if (start != std::string::npos && line.compare(start, prefix.size(), prefix) == 0) return line;
  }
  return {};
}

// --- top level ----------------------------------------------------------------------------------

TEST(CliTest, HelpListsEveryCommandAndExitsZero) {
  const CommandResult r = modalities({"--help"});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, StartsWith("usage: modalities <command>")) << r;
  for (const char* command : {"plugins list", "plugins describe", "plugins smoke", "config validate", "config resolve",
                              "config graph", "config build"})
    EXPECT_THAT(r.out, HasSubstr(command)) << r;
  EXPECT_EQ(r.err, "") << r;
}

TEST(CliTest, NoArgumentsPrintsUsageAndExitsWithUsageError) {
  const CommandResult r = modalities({});
  EXPECT_EQ(r.exit_code, 2) << r;
  EXPECT_THAT(r.out, StartsWith("usage: modalities <command>")) << r;
}

TEST(CliTest, UnknownCommandIsNamedAndExitsWithUsageError) {
  const CommandResult r = modalities({"frobnicate"});
  EXPECT_EQ(r.exit_code, 2) << r;
  EXPECT_THAT(r.err, StartsWith("error: unknown command 'frobnicate'")) << r;
  EXPECT_THAT(r.err, HasSubstr("usage: modalities <command>")) << r;
  EXPECT_EQ(r.out, "") << r;
}

TEST(CliTest, VersionShowsTheHostFingerprint) {
  const CommandResult r = modalities({"--version"});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, AllOf(StartsWith("modalities "), HasSubstr("SDK ABI "), HasSubstr("torch "))) << r;
}

// An empty entry in the RPATH of the host, its libraries or a plugin (CMake pads the build RPATH of
// installed targets with ':') makes the loader look for every library they need in the current
// directory first: a file there named like one of them stops the host from starting, or is loaded
// in its place. The names are those of the libraries the host and the bundled plugins need on
// Debian 12 besides their own and LibTorch's; `plugins list` loads every bundled plugin.
TEST(CliTest, RunsFromADirectoryHoldingLibrariesOfTheSameNames) {
  ScratchDir dir;
  for (const char* name :
       {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "libabsl_hash.so.20220623",
        "libabsl_raw_hash_set.so.20220623", "libabsl_strings.so.20220623", "libboost_program_options.so.1.74.0",
        "libcrypto.so.3", "libpcre2-8.so.0", "libsentencepiece.so.0", "libsimdjson.so.14", "libtcmalloc_minimal.so.4",
        "libtomlplusplus.so.3", "libutf8proc.so.2", "libyaml-cpp.so.0.7"})
    dir.write(name, "not a library\n");
  const CommandResult r = run_command({"/bin/sh", "-c",
                                       "cd " + testing::shell_quote(dir.path().string()) + " && exec " +
                                           testing::shell_quote(kHost) + " plugins list"});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(line_starting_with(r.out, "layer_norm/rms_norm"), HasSubstr("libmodalities_layer_norm.so")) << r;
}

// --- plugins --------------------------------------------------------------------------------------

TEST(CliPluginsTest, PluginsWithoutSubcommandExitsWithUsageError) {
  const CommandResult r = modalities({"plugins"});
  EXPECT_EQ(r.exit_code, 2) << r;
  EXPECT_THAT(r.out, HasSubstr("usage: modalities plugins <list|describe|smoke>")) << r;
}

TEST(CliPluginsTest, ListShowsTheBundledPluginsWithoutWarnings) {
  const CommandResult r = modalities({"plugins", "list"});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_EQ(r.err, "") << r;
  EXPECT_THAT(line_starting_with(r.out, "layer_norm/rms_norm"), HasSubstr("libmodalities_layer_norm.so 0.1.0")) << r;
  EXPECT_THAT(line_starting_with(r.out, "number_conversion/num_samples_from_num_tokens"),
              HasSubstr("libmodalities_number_conversion.so 0.1.0"))
      << r;
}

TEST(CliPluginsTest, DescribeRmsNormShowsItsKeysTypesAndDefaults) {
  const CommandResult r = modalities({"plugins", "describe", "layer_norm/rms_norm"});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, StartsWith("layer_norm/rms_norm\n")) << r;
  EXPECT_THAT(r.out, HasSubstr("libmodalities_layer_norm.so")) << r;
  const std::string ndim = line_starting_with(r.out, "ndim:");
  EXPECT_THAT(ndim, AllOf(HasSubstr("int"), HasSubstr("(required)"), HasSubstr(">= 1"))) << r;
  const std::string epsilon = line_starting_with(r.out, "epsilon:");
  EXPECT_THAT(epsilon, AllOf(HasSubstr("float"), HasSubstr("= 1e-06"), HasSubstr("> 0"))) << r;
  EXPECT_THAT(line_starting_with(r.out, "bias:"), HasSubstr("= true")) << r;
}

TEST(CliPluginsTest, DescribeMisspelledVariantSuggestsTheClosestId) {
  const CommandResult r = modalities({"plugins", "describe", "layer_norm/rms_nrm"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, AllOf(HasSubstr("no loaded plugin registers layer_norm/rms_nrm"),
                           HasSubstr("did you mean layer_norm/rms_norm")))
      << r;
  EXPECT_EQ(r.out, "") << r;
}

TEST(CliPluginsTest, DescribeWithoutSlashIsAUsageError) {
  const CommandResult r = modalities({"plugins", "describe", "rms_norm"});
  EXPECT_EQ(r.exit_code, 2) << r;
  EXPECT_THAT(r.err, HasSubstr("'rms_norm' is not of the form <component_key>/<variant_key>")) << r;
}

TEST(CliPluginsTest, SmokeOfLayerNormPluginPasses) {
  const CommandResult r = modalities({"plugins", "smoke", MODALITIES_TEST_LAYER_NORM_PLUGIN});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, AllOf(HasSubstr("plugin layer_norm 0.1.0"), HasSubstr("smoke test passed: 3 variant(s)"))) << r;
}

TEST(CliPluginsTest, SmokeOfASharedLibraryThatIsNotAPluginFails) {
  const std::string sdk = MODALITIES_TEST_SDK_LIBRARY;
  const CommandResult r = modalities({"plugins", "smoke", sdk});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, AllOf(HasSubstr("plugin " + sdk + ": "), HasSubstr("not a Modalities plugin"))) << r;
  EXPECT_THAT(r.out, Not(HasSubstr("smoke test passed"))) << r;
}

TEST(CliPluginsTest, SmokeOfAMissingFileFails) {
  ScratchDir dir;
  const std::string missing = (dir.path() / "libmodalities_missing.so").string();
  const CommandResult r = modalities({"plugins", "smoke", missing});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, AllOf(HasSubstr(missing), HasSubstr("does not exist"))) << r;
}

// --- config validate -------------------------------------------------------------------------

class CliConfigValidateTest : public ::testing::Test {
 protected:
  std::string write(const std::string& name, const std::string& toml) { return dir.write(name, toml).string(); }
  ScratchDir dir;
};

TEST_F(CliConfigValidateTest, ValidConfigUsingBothBundledPluginsExitsZero) {
  const std::string file = write("valid.toml", R"([norm]
component_key = "layer_norm"
variant_key = "rms_norm"
config = { ndim = 8 }

[num_samples]
component_key = "number_conversion"
variant_key = "num_samples_from_num_tokens"
config = { num_tokens = 1024, sequence_length = 128 }
)");
  const CommandResult r = modalities({"config", "validate", file});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_EQ(r.out, file + ": valid\n") << r;
}

TEST_F(CliConfigValidateTest, UnknownVariantPointsAtTheKeyAndSuggestsTheClosest) {
  const std::string file = write("unknown_variant.toml", R"([x]
component_key = "layer_norm"
variant_key = "rms_nrm"
config = { ndim = 8 }
)");
  const CommandResult r = modalities({"config", "validate", file});
  EXPECT_EQ(r.exit_code, 1) << r;
  // line 3, column 15: where the value "rms_nrm" starts.
  EXPECT_THAT(r.err, HasSubstr(file + ":3:15: x.variant_key: unknown variant 'rms_nrm'")) << r;
  EXPECT_THAT(r.err, HasSubstr("did you mean 'rms_norm'?")) << r;
  EXPECT_THAT(r.err, HasSubstr("error: " + file + ": 1 error(s)")) << r;
}

TEST_F(CliConfigValidateTest, FloatForAnIntegerKeyPointsAtTheKeyAndNamesBothTypes) {
  const std::string file = write("type_error.toml", R"([x]
component_key = "layer_norm"
variant_key = "layer_norm"

[x.config]
normalized_shape = 1.5
)");
  const CommandResult r = modalities({"config", "validate", file});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr(file + ":6:20: x.config.normalized_shape: expected an integer, got float 1.5")) << r;
  EXPECT_THAT(r.err, HasSubstr("layer_norm/layer_norm from libmodalities_layer_norm.so 0.1.0")) << r;
}

TEST_F(CliConfigValidateTest, MissingRequiredKeyIsReportedWithItsPath) {
  const std::string file = write("missing_key.toml", R"([x]
component_key = "layer_norm"
variant_key = "rms_norm"
config = { epsilon = 1e-5 }
)");
  const CommandResult r = modalities({"config", "validate", file});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr(file + ":4:10: x.config.ndim: missing required key")) << r;
}

TEST_F(CliConfigValidateTest, UnknownOptionIsAUsageError) {
  const std::string file = write("valid.toml", "");
  const CommandResult r = modalities({"config", "validate", file, "--no-such-flag"});
  EXPECT_EQ(r.exit_code, 2) << r;
  EXPECT_THAT(r.err, AllOf(HasSubstr("--no-such-flag"), HasSubstr("usage: modalities config validate"))) << r;
  EXPECT_THAT(r.out, IsEmpty()) << r;
}

TEST_F(CliConfigValidateTest, MissingConfigFileIsNamed) {
  const std::string file = (dir.path() / "nope.toml").string();
  const CommandResult r = modalities({"config", "validate", file});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr(file + ": config file does not exist")) << r;
}

TEST_F(CliConfigValidateTest, WithoutAFileIsAUsageError) {
  const CommandResult r = modalities({"config", "validate"});
  EXPECT_EQ(r.exit_code, 2) << r;
  EXPECT_THAT(r.err, HasSubstr("config_file_path")) << r;
}

// --- config resolve | graph | build ------------------------------------------------------------

constexpr const char* kInterpolated = R"([settings]
seq = 128
root = "/exp"

[num_samples]
component_key = "number_conversion"
variant_key = "num_samples_from_num_tokens"
config = { num_tokens = 1024, sequence_length = "${settings.seq}" }

[norm]
component_key = "layer_norm"
variant_key = "pytorch_rms_norm"
config = { normalized_shape = "${num_samples.config.sequence_length}" }

[paths]
out = "${settings.root}/run_${settings.seq}"
literal = "\\${kept}"
)";

TEST_F(CliConfigValidateTest, ResolvePrintsInterpolatedTomlThatLoadsBackTheSame) {
  const std::string file = write("interp.toml", kInterpolated);
  const CommandResult r = modalities({"config", "resolve", file});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr("[num_samples.config]\nnum_tokens = 1024\nsequence_length = 128\n")) << r;
  EXPECT_THAT(r.out, HasSubstr("[norm.config]\nnormalized_shape = 128\n")) << r;
  EXPECT_THAT(r.out, HasSubstr("out = \"/exp/run_128\"")) << r;
  const std::string again = write("again.toml", r.out);
  const CommandResult r2 = modalities({"config", "resolve", again});
  EXPECT_EQ(r2.exit_code, 0) << r2;
  EXPECT_EQ(r2.out, r.out);
}

TEST_F(CliConfigValidateTest, GraphPrintsDotWithOneNodePerComponent) {
  const std::string file = write("graph.toml", kInterpolated);
  const CommandResult r = modalities({"config", "graph", file});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, StartsWith("digraph modalities {")) << r;
  EXPECT_THAT(r.out, HasSubstr("number_conversion/num_samples_from_num_tokens")) << r;
  EXPECT_THAT(r.out, HasSubstr("layer_norm/pytorch_rms_norm")) << r;
}

TEST_F(CliConfigValidateTest, BuildPrintsWhatEachTopLevelKeyProducedAndLogsProgress) {
  const std::string file = write("build.toml", kInterpolated);
  const CommandResult r = modalities({"config", "build", file});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr("num_samples = 8\n")) << r;
  EXPECT_THAT(r.out, HasSubstr("norm = <Module from layer_norm/pytorch_rms_norm>")) << r;
  EXPECT_THAT(r.err, HasSubstr("Instantiated layer_norm/pytorch_rms_norm -> Module: norm")) << r;
}

TEST_F(CliConfigValidateTest, BundledTokenBudgetConfigBuildsTheSpecValues) {
  // The bundled corpus: 911 samples of data/sample/train.pbin // (4 * 2) = 113 steps.
  const std::string file = std::string(MODALITIES_TEST_SOURCE_ROOT) + "/configs/token_budget.toml";
  const CommandResult r = modalities({"config", "build", file});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr("num_target_tokens = 231424\n")) << r;
  EXPECT_THAT(r.out, HasSubstr("num_target_steps = 113\n")) << r;
  EXPECT_THAT(r.out, HasSubstr("document_steps = 62\n")) << r;
}

TEST_F(CliConfigValidateTest, TrainingPipelineNamesEveryMissingKey) {
  const std::string file = write("not_training.toml", kInterpolated);
  const CommandResult r = modalities({"config", "validate", file, "--pipeline", "training"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("missing top-level key 'model_raw' required by pipeline 'training'")) << r;
  const CommandResult bad = modalities({"config", "validate", file, "--pipeline", "trainng"});
  EXPECT_EQ(bad.exit_code, 2) << bad;
  EXPECT_THAT(bad.err, HasSubstr("unknown pipeline 'trainng'")) << bad;
}

// config validate / resolve give a config the environment `run` and `warmstart` give it: one process,
// an experiments root and id, and with --last_checkpoint_info_file_path the warm-start facts.
TEST(CliConfigRunEnvironmentTest, ShippedTrainingAndWarmStartConfigsValidateLikeRunSeesThem) {
  const std::string configs = std::string(MODALITIES_TEST_SOURCE_ROOT) + "/configs/quickstart/";
  CommandResult r = modalities({"config", "validate", configs + "train.toml", "--pipeline", "training"});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr("valid for pipeline 'training'")) << r;
  r = modalities({"config", "validate", configs + "warmstart.toml"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("give the last_checkpoint_info.json of the run to continue with "
                               "--last_checkpoint_info_file_path"))
      << r;
  ScratchDir dir;
  const std::string folder =
      (dir.path() / "eid_q-seen_steps_60-seen_tokens_30720-target_steps_80-target_tokens_40960").string();
  const auto info = dir.write("last_checkpoint_info.json", "{\"checkpoint_folder_path\": \"" + folder + "\"}");
  r = modalities({"config", "validate", configs + "warmstart.toml", "--last_checkpoint_info_file_path", info.string()});
  EXPECT_EQ(r.exit_code, 0) << r;
  r = modalities({"config", "resolve", configs + "warmstart.toml", "--last_checkpoint_info_file_path", info.string(),
                  "--experiments_root_path", dir.path().string(), "--experiment_id", "resumed"});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr(folder)) << r;
  EXPECT_THAT(r.out, HasSubstr((dir.path() / "resumed").string())) << r;
  r = modalities({"config", "validate", configs + "warmstart.toml", "--last_checkpoint_info_file_path",
                  (dir.path() / "missing.json").string()});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("missing.json: no such file")) << r;
}

// --- profile ------------------------------------------------------------------------------------

// The shipped profiling config as a user runs it: a Chrome trace that parses as a trace-event file
// and holds the model's operators, the per-operator table, and the config copy.
TEST(CliProfileTest, ProfilesTheShippedConfigIntoTheExperimentFolder) {
  ScratchDir dir;
  const CommandResult r =
      modalities({"profile", "distributed", "--config_file_path",
                  std::string(MODALITIES_TEST_SOURCE_ROOT) + "/configs/profiling/gpt2_train_step.toml",
                  "--experiment_root_path", dir.path().string(), "--experiment_id", "prof"});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr("Profiled 5 steps")) << r;
  EXPECT_THAT(r.err, Not(HasSubstr("ERROR"))) << r;  // Kineto's GPU probe stays quiet for CPU-only traces
  const auto folder = dir.path() / "prof";
  EXPECT_TRUE(std::filesystem::exists(folder / "gpt2_train_step.toml"));
  std::ifstream trace(folder / "profiler_trace_ranks_1_rank_0.json");
  ASSERT_TRUE(trace) << "no trace";
  std::stringstream text;
  text << trace.rdbuf();
  EXPECT_THAT(text.str(), HasSubstr("\"traceEvents\"")) << "Chrome trace-event format";
  EXPECT_THAT(text.str(), HasSubstr("\"name\": \"aten::mm\""));
  std::ifstream table(folder / "profiler_summary_ranks_1_rank_0.txt");
  std::stringstream rows;
  rows << table.rdbuf();
  EXPECT_THAT(rows.str(), HasSubstr("3 recorded step(s)"));
  EXPECT_THAT(rows.str(), HasSubstr("aten::addmm"));
}

// --- convert_pytorch_to_hf_checkpoint -------------------------------------------------------------

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A config as Modalities' verb takes it: a top-level checkpointed_model (here a tiny Llama loaded
// from a Hugging Face folder of the gpt2 plugin's fixtures) and the tokenizer whose files go along.
std::filesystem::path conversion_config(const ScratchDir& dir, const std::string& model_folder) {
  const std::string root = MODALITIES_TEST_SOURCE_ROOT;
  return dir.write(
      "convert.toml",
      R"(
[checkpointed_model]
component_key = "model"
variant_key = "huggingface_pretrained_model"
config = { model_type = "AutoModelForCausalLM", model_name = ")" +
          model_folder +
          R"(", prediction_key = "logits", huggingface_prediction_subscription_key = "logits", sample_key = "input_ids" }

[tokenizer]
component_key = "tokenizer"
variant_key = "pretrained_hf_tokenizer"
config = { pretrained_model_name_or_path = ")" +
          root + R"(/data/tokenizer/gpt2_style_8k" }
)");
}

TEST(CliConvertTest, WritesAShardedTransformersFolderWithTheTokenizer) {
  ScratchDir dir;
  const std::string src = std::string(MODALITIES_TEST_SOURCE_ROOT) + "/plugins/gpt2/tests/data/hf/import_llama";
  const auto config = conversion_config(dir, src);
  const auto out = dir.path() / "hf";
  const CommandResult r = modalities({"convert_pytorch_to_hf_checkpoint", "--config_file_path", config.string(),
                                      "--output_hf_checkpoint_dir", out.string(), "--prediction_key", "logits",
                                      "--max_shard_size", "40KB"});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr("Wrote LlamaForCausalLM"));
  const std::string cfg = read_text(out / "config.json");
  EXPECT_THAT(cfg, AllOf(HasSubstr("\"model_type\": \"llama\""), HasSubstr("\"num_key_value_heads\": 2"),
                         HasSubstr("\"bos_token_id\": 0"), HasSubstr("\"torch_dtype\": \"float32\"")));
  EXPECT_THAT(read_text(out / "model.safetensors.index.json"),
              AllOf(HasSubstr("\"total_size\": 86656"), HasSubstr("model-00001-of-0000")));
  for (const char* f : {"generation_config.json", "tokenizer.json", "tokenizer_config.json"})
    EXPECT_TRUE(std::filesystem::exists(out / f)) << f;
  // The export is itself a folder the importer reads, in bf16 when asked.
  ScratchDir dir2;
  const auto config2 = conversion_config(dir2, out.string());
  const CommandResult r2 = modalities({"convert_pytorch_to_hf_checkpoint", "--config_file_path", config2.string(),
                                       "--output_hf_checkpoint_dir", (dir2.path() / "bf16").string() + "/", "--dtype",
                                       "bfloat16"});  // a trailing slash names the same folder
  ASSERT_EQ(r2.exit_code, 0) << r2;
  EXPECT_THAT(read_text(dir2.path() / "bf16" / "config.json"), HasSubstr("\"torch_dtype\": \"bfloat16\""));
  EXPECT_EQ(std::filesystem::file_size(dir2.path() / "bf16" / "model.safetensors") < 86656 / 2 + 4096, true);
}

// The files that go along come from the tokenizer itself (Tokenizer::huggingface_folder), not from
// the config's variant name: a SentencePiece model has no Hugging Face folder, which is said, and
// --tokenizer_path still adds one.
TEST(CliConvertTest, TheTokenizerSaysWhichFilesGoAlong) {
  ScratchDir dir;
  const std::string root = MODALITIES_TEST_SOURCE_ROOT;
  std::string text = read_text(conversion_config(dir, root + "/plugins/gpt2/tests/data/hf/import_llama"));
  text.replace(text.find("[tokenizer]"), std::string::npos,
               "[tokenizer]\ncomponent_key = \"tokenizer\"\nvariant_key = \"pretrained_sp_tokenizer\"\n"
               "config = { tokenizer_model_file = \"" +
                   root + "/plugins/sp_tokenizer/tests/data/tiny_bpe.model\" }\n");
  const auto config = dir.write("convert_sp.toml", text);
  CommandResult r = modalities({"convert_pytorch_to_hf_checkpoint", "--config_file_path", config.string(),
                                "--output_hf_checkpoint_dir", (dir.path() / "sp").string()});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.err, HasSubstr("the config's tokenizer has no Hugging Face folder"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "sp" / "tokenizer.json"));
  r = modalities({"convert_pytorch_to_hf_checkpoint", "--config_file_path", config.string(),
                  "--output_hf_checkpoint_dir", (dir.path() / "sp2").string(), "--tokenizer_path",
                  root + "/data/tokenizer/gpt2_style_8k"});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "sp2" / "tokenizer.json"));
}

TEST(CliConvertTest, RefusesToOverwriteAndNamesWrongFlags) {
  ScratchDir dir;
  const std::string src = std::string(MODALITIES_TEST_SOURCE_ROOT) + "/plugins/gpt2/tests/data/hf/import_gpt2";
  const auto config = conversion_config(dir, src);
  std::filesystem::create_directories(dir.path() / "out");
  const auto keep = dir.write("out/keep.txt", "precious");
  CommandResult r = modalities({"convert_pytorch_to_hf_checkpoint", "--config_file_path", config.string(),
                                "--output_hf_checkpoint_dir", (dir.path() / "out").string()});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("exists and is not an empty directory"));
  EXPECT_EQ(read_text(keep), "precious");
  r = modalities({"convert_pytorch_to_hf_checkpoint", "--config_file_path", config.string(),
                  "--output_hf_checkpoint_dir", (dir.path() / "o2").string(), "--prediction_key", "hidden"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("--prediction_key hidden: the model's prediction_key is 'logits'"));
  r = modalities({"convert_pytorch_to_hf_checkpoint", "--config_file_path", config.string(),
                  "--output_hf_checkpoint_dir", (dir.path() / "o3").string(), "--max_shard_size", "5 apples"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("'5 apples' is not a size"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "o2"));
  // A model without a transformers form.
  const auto ln = dir.write("ln.toml", R"(
[model]
component_key = "layer_norm"
variant_key = "layer_norm"
config = { normalized_shape = 4 }
)");
  r = modalities({"convert_pytorch_to_hf_checkpoint", "--config_file_path", ln.string(), "--output_hf_checkpoint_dir",
                  (dir.path() / "o4").string()});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("not a model with a Hugging Face form"));
}

// --- benchmark ---------------------------------------------------------------------------------------

std::vector<std::filesystem::path> files_named(const std::filesystem::path& root, const std::string& name) {
  std::vector<std::filesystem::path> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root))
    if (e.path().filename() == name) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> lines_of(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// Modalities' sweep semantics: nested tables expand recursively, a scalar is a one-element list,
// one folder per combination and world size; list_remaining_runs keeps the most recent folder per
// combination and counts result lines and skipped error types; summarize tabulates.
TEST(CliBenchmarkTest, SweepsListRemainingRunsAndSummarizes) {
  ScratchDir dir;
  const auto sweep = dir.write("s.toml", R"(
[sweep]
lr = [0.1, 0.2]
fixed = "x"
[sweep.model]
layers = [1, 2, 3]

[settings]
data = "${modalities_env:config_folder_path}/data.pbin"
lr = "${sweep.lr}"
)");
  const auto out = dir.path() / "sweeps";
  CommandResult r = modalities({"benchmark", "prepare_sweep_configs", "--sweep_config_path", sweep.string(),
                                "--output_dir", out.string(), "--world_sizes", "1,4"});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr("Prepared 6 combination(s) x 2 world size(s): 12 configs"));
  const auto configs = files_named(out, "s.toml");
  ASSERT_EQ(configs.size(), 12u);
  const std::string first = read_text(configs.front());
  EXPECT_THAT(first,
              AllOf(HasSubstr("[sweep]\n"), HasSubstr("fixed = \"x\""), HasSubstr("[sweep.model]\nlayers = "),
                    HasSubstr("lr = \"${sweep.lr}\""), HasSubstr("data = \"" + dir.path().string() + "/data.pbin\"")));
  EXPECT_THAT(first, Not(HasSubstr("[0.1, 0.2]")));
  // Runs: one done (3 result lines), one out of memory (skipped type), the rest not run.
  const auto run_dir = [&](std::size_t i) { return configs[i].parent_path(); };
  std::ofstream(run_dir(0) / "evaluation_results.jsonl")
      << R"({"dataloader_tag": "train", "num_train_steps_done": 5, "losses": {"train loss avg": 2.5}, "metrics": {}, "throughput_metrics": {"train samples/s": 12.5}})"
      << "\n{}\n{}\n";
  std::ofstream(run_dir(1) / "error_logs_host_0.log")
      << R"({"environment": {}, "error": {"error": "oom", "type": "OutOfMemoryError", "stacktrace": ""}})";
  const auto remaining = dir.path() / "remaining_runs.txt";
  r = modalities({"benchmark", "list_remaining_runs", "--exp_root", out.string(), "--file_list_path",
                  remaining.string(), "--expected_steps", "3", "--skip_exception_types", "OutOfMemoryError,Foo"});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_EQ(lines_of(remaining).size(), 10u) << r;
  r = modalities({"benchmark", "list_remaining_runs", "--exp_root", out.string(), "--file_list_path",
                  remaining.string(), "--expected_steps", "3", "--world_size", "4",
                  "--create_new_folders_if_partially_done"});
  ASSERT_EQ(r.exit_code, 0) << r;
  const auto four = lines_of(remaining);
  EXPECT_EQ(four.size(), configs[0].string().find("/4/") != std::string::npos ? 5u : 6u);
  {
    r = modalities({"benchmark", "summarize", "--exp_root", out.string(), "--csv", (dir.path() / "t.csv").string()});
    ASSERT_EQ(r.exit_code, 0) << r;
    EXPECT_THAT(r.out, AllOf(HasSubstr("sweep.lr"), HasSubstr("sweep.model.layers"),
                             HasSubstr("failed: OutOfMemoryError"), HasSubstr("12.5")));
    EXPECT_EQ(lines_of(dir.path() / "t.csv").size(), 13u);
  }
  // Errors: no [sweep], an empty list, bad world sizes.
  const auto bad = dir.write("bad.toml", "[sweep]\nlr = []\n");
  r = modalities(
      {"benchmark", "prepare_sweep_configs", "--sweep_config_path", bad.string(), "--output_dir", out.string()});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("sweep.lr"));
  r = modalities({"benchmark", "prepare_sweep_configs", "--sweep_config_path", sweep.string(), "--output_dir",
                  out.string(), "--world_sizes", "2,x"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("--world_sizes '2,x'"));
}

// --- config import ---------------------------------------------------------------------------------

// YAML scalars get OmegaConf's types (PyYAML's YAML 1.1 resolvers plus OmegaConf's float rule);
// quoted scalars stay strings; nulls become ${null:}; aliases expand; lists of mappings become
// arrays of tables.
TEST(CliImportTest, TypesScalarsAsOmegaConfDoes) {
  ScratchDir dir;
  const auto yaml = dir.write("c.yaml", R"(
a: yes
b: Off
c: 1e-5
d: 0x1F
e: 010
f: '12'
g: ~
h:
i: 1_000
j: .5
k: ${settings.x}
l: "${cuda_env:RANK}"
base: &base {x: 1, y: [1, 2.5, "s"]}
copy: *base
list_of_tables:
  - {name: a}
  - {name: b}
)");
  const CommandResult r = modalities({"config", "import", yaml.string()});
  ASSERT_EQ(r.exit_code, 0) << r;
  for (const char* line :
       {"a = true", "b = false", "c = 1e-05", "d = 31", "e = 8", "f = \"12\"", "g = \"${null:}\"", "h = \"${null:}\"",
        "i = 1000", "j = 0.5", "k = \"${settings.x}\"", "l = \"${cuda_env:RANK}\"",
        "[copy]\nx = 1\ny = [1, 2.5, \"s\"]", "[[list_of_tables]]\nname = \"a\"\n\n[[list_of_tables]]\nname = \"b\""})
    EXPECT_THAT(r.out, HasSubstr(line)) << line;
  const auto merge = dir.write("m.yaml", "a: &a {x: 1}\nb:\n  <<: *a\n  y: 2\n");
  const CommandResult m = modalities({"config", "import", merge.string()});
  EXPECT_EQ(m.exit_code, 1) << m;
  EXPECT_THAT(m.err, HasSubstr("m.yaml:3: YAML merge keys (<<) are not supported"));
  const auto broken = dir.write("b.yaml", "a: [1, 2\n");
  EXPECT_EQ(modalities({"config", "import", broken.string()}).exit_code, 1);
  const auto out = dir.write("exists.toml", "keep");
  const CommandResult o = modalities({"config", "import", yaml.string(), "-o", out.string()});
  EXPECT_EQ(o.exit_code, 1) << o;
  EXPECT_EQ(read_text(out), "keep");
}

// What PyYAML (OmegaConf's loader) reads, imported the same: YAML 1.1 sexagesimal numbers, explicit
// tags, the smallest 64-bit integer, floats beyond double range, CR / NEL / LS line breaks. What it
// refuses (or what cannot be expanded) is refused naming the file and line, never a crash or a hang.
TEST(CliImportTest, ReadsWhatPyYamlReadsAndRefusesTheRestByLine) {
  ScratchDir dir;
  const auto yaml = dir.write("c.yaml",
                              "a: 1:30\nb: 1:30.5\nc: !!int \"42\"\nd: !!float 1\ne: !!bool yes\n"
                              "f: !!null ''\ng: !!str 12\nh: -9223372036854775808\ni: 1e999\n"
                              "j: " +
                                  std::string(300, '7') + ".5\n");
  const CommandResult r = modalities({"config", "import", yaml.string()});
  ASSERT_EQ(r.exit_code, 0) << r;
  for (const char* line : {"a = 90\n", "b = 90.5\n", "c = 42\n", "d = 1.0\n", "e = true\n", "f = \"${null:}\"\n",
                           "g = \"12\"\n", "h = -9223372036854775808\n", "i = inf\n", "j = 7.77"})
    EXPECT_THAT(r.out, HasSubstr(line)) << line;
  for (const auto& [name, text] : std::vector<std::pair<std::string, std::string>>{{"cr.yaml", "a: 1\rb: 2\r"},
                                                                                   {"nel.yaml",
                                                                                    "a: 1\xc2\x85"
                                                                                    "b: 2\n"},
                                                                                   {"ls.yaml",
                                                                                    "a: 1\xe2\x80\xa8"
                                                                                    "b: 2\n"}}) {
    const CommandResult lines = modalities({"config", "import", dir.write(name, text).string()});
    EXPECT_EQ(lines.exit_code, 0) << lines;
    EXPECT_THAT(lines.out, AllOf(HasSubstr("a = 1\n"), HasSubstr("b = 2\n"))) << name;
  }
  std::string laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n";
  for (char c = 'b'; c <= 'h'; ++c) {  // h: 10^8 values
    const std::string alias = std::string("*") + static_cast<char>(c - 1);
    laughs += std::string(1, c) + ": &" + c + " [" + alias;
    for (int k = 1; k < 10; ++k) laughs += ", " + alias;
    laughs += "]\n";
  }
  for (const auto& [name, text, message] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"two_docs.yaml", "a: 1\n---\nb: 2\n", "two_docs.yaml:3: a second YAML document"},
           {"recursive.yaml", "a: &a [*a]\n", "recursive.yaml:1:4: an alias refers to a node that contains it"},
           {"recursive_map.yaml", "a: &a {b: *a}\n",
            "recursive_map.yaml:1:4: an alias refers to a node that contains it"},
           {"long_int.yaml", "a: " + std::string(30000, '9') + "\n", "long_int.yaml:1:4: the integer 9999"},
           {"laughs.yaml", laughs, "the document expands to more than 100000 values"},
           {"not_utf8.yaml", "a: 1\nb: \xd8<\n", "not_utf8.yaml:2: not UTF-8 text"},
           {"stray_comma.yaml", ",\n", "stray_comma.yaml:1:1: expected a document, found a ','"},
           {"stray_comma2.yaml", "[1]\n,\n", "stray_comma2.yaml:"},
           {"control.yaml", std::string("a: 1\nb\x01", 7) + std::string(1, '\0') + ": 2\n",
            "control.yaml:2: the character U+0001 is not allowed in YAML"},
           {"del.yaml", "a: 1\n\nb\x7f: 2\n", "del.yaml:3: the character U+007F is not allowed in YAML"},
           {"bin.yaml", "a: 0b_\n", "bin.yaml:1:4: '0b_' cannot be read as an integer"},
           {"hex.yaml", "a: 0x_\n", "hex.yaml:1:4: '0x_' cannot be read as an integer"},
           {"tag.yaml", "a: !!int x\n", "tag.yaml:1:4: 'x' cannot be read as an integer"},
           {"unknown_tag.yaml", "a: !foo x\n", "unknown_tag.yaml:1:4: the YAML tag '!foo' is not supported"},
           {"deep.yaml", "a: " + std::string(300, '[') + std::string(300, ']') + "\n",
            "nested more than 256 levels"}}) {
    const CommandResult bad = modalities({"config", "import", dir.write(name, text).string()});
    EXPECT_EQ(bad.exit_code, 1) << bad;
    EXPECT_THAT(bad.err, HasSubstr(message)) << name;
  }
}

// Modalities' own example configs (its config_files/ and tutorials/, from ../shared/fixtures/
// modalities-configs; the test skips where ../shared is absent), imported and validated the way
// each is used: from the folder Modalities runs it in, with Modalities' lorem-ipsum data standing
// in for the data files they name, warm-start configs with a last_checkpoint_info.json, sweep files
// through `benchmark prepare_sweep_configs`. Every one validates except those Modalities itself
// rejects or that name components its tutorials register from Python (docs/configs.md lists them).
TEST(CliImportTest, ModalitiesOwnConfigsImportAndValidate) {
  namespace fs = std::filesystem;
  const fs::path src = fs::path(MODALITIES_TEST_SHARED_DIR) / "fixtures" / "modalities-configs";
  const fs::path lorem = fs::path(MODALITIES_TEST_SHARED_DIR) / "fixtures" / "modalities" / "data";
  if (!fs::exists(src) || !fs::exists(lorem))
    GTEST_SKIP() << "skipped: needs " << src.string() << " and " << lorem.string()
                 << " (Modalities' files from ../shared/fixtures, present in CI, absent here)";
  ScratchDir dir;
  const fs::path root = dir.path() / "modalities";
  fs::copy(src, root, fs::copy_options::recursive);
  const auto link = [&](const fs::path& at, const std::string& file) {
    fs::create_directories(at.parent_path());
    fs::create_symlink(lorem / file, at);
  };
  for (const char* ext : {".pbin", ".idx", ".jsonl"})
    link(root / "data" / (std::string("lorem_ipsum_long") + ext), std::string("lorem_ipsum_long") + ext);
  link(root / "tutorials/getting_started/data/mem_map/redpajama_v2_samples_512_train.pbin", "lorem_ipsum_long.pbin");
  link(root /
           "tutorials/instruction_tuning/prepared_data/smol-smoltalk_train_first_10K_2caf768/"
           "smol-smoltalk_train_first_10K_train.2caf768.pbin",
       "lorem_ipsum_long.pbin");
  link(root / "tutorials/modalities_in_15_mins/data/preprocessed/fineweb_edu_num_docs_483606.pbin",
       "lorem_ipsum_long.pbin");
  const std::string ck = (root / "ck").string();
  fs::create_directories(root / "ck" / "eid_prev-seen_steps_10-seen_tokens_5120-target_steps_20-target_tokens_10240");
  std::ofstream(root / "ck" / "info.json")
      << "{\"model_checkpoint_path\": \"" << ck
      << "/eid_prev-model-seen_steps_10-seen_tokens_5120-target_steps_20-target_tokens_10240.bin\", "
         "\"optimizer_checkpoint_path\": \""
      << ck << "/eid_prev-optimizer-seen_steps_10-seen_tokens_5120-target_steps_20-target_tokens_10240.bin\", "
      << "\"checkpoint_folder_path\": \"" << ck
      << "/eid_prev-seen_steps_10-seen_tokens_5120-target_steps_20-target_tokens_10240\"}";

  const std::map<std::string, std::string> rejected = {
      // Modalities rejects these too: stale keys or variant names (its component configs forbid unknown keys).
      {"config_files/data_preparation/packed_cc_en_2048.yaml", "tokenizer.config.padding: unknown key"},
      {"config_files/training/config_lorem_ipsum_long_fsdp2_warmstart.yaml",
       "gradient_clipper.config.device_mesh: missing required key"},
      {"tutorials/getting_started/configs/example_text_generation_config.yaml",
       "model.config.attention_norm: unknown key"},
      {"tutorials/modalities_in_15_mins/configs/pretraining_config.yaml", "unknown variant 'fsdp_wrapped'"},
      {"tutorials/getting_started/configs/example_conversion_config_template.yaml",
       "reference to missing top-level key 'model'"},
      // Components registered from Python by the tutorial itself, or missing here (docs/catalogue.md).
      {"tutorials/einsum_transformer/einsum_transformer_config.yaml", "unknown variant 'einsum_transformer'"},
      {"tutorials/library_usage/config_lorem_ipsum.yaml", "unknown variant 'custom_gpt_2_llm_collator'"},
      {"tutorials/profiling/configs/single_process_rms_norm_profiling.yaml", "unknown variant 'steppable_norm'"},
  };
  const std::set<std::string> warmstart = {"config_files/training/config_lorem_ipsum_long_fsdp1_warmstart.yaml",
                                           "config_files/training/config_lorem_ipsum_long_fsdp2_warmstart.yaml",
                                           "tutorials/warmstart/configs/warmstart_config.yaml"};
  std::vector<fs::path> yamls;
  for (const auto& e : fs::recursive_directory_iterator(root))
    if (e.path().extension() == ".yaml") yamls.push_back(e.path());
  std::sort(yamls.begin(), yamls.end());
  ASSERT_EQ(yamls.size(), 30u);
  int valid = 0;
  for (const fs::path& yaml : yamls) {
    const std::string rel = fs::relative(yaml, root).string();
    SCOPED_TRACE(rel);
    const fs::path toml = fs::path(yaml).replace_extension(".toml");
    const CommandResult imp = modalities({"config", "import", yaml.string(), "-o", toml.string()});
    ASSERT_EQ(imp.exit_code, 0) << imp;
    // Modalities runs config_files/ from its repository root and each tutorial from its folder.
    const fs::path cwd = rel.starts_with("tutorials/")
                             ? root / fs::path(rel).begin()->string() / std::next(fs::path(rel).begin())->string()
                             : root;
    std::vector<fs::path> configs = {toml};
    if (rel.find("scaling_up/configs/sweep") != std::string::npos) {
      const fs::path out = dir.path() / ("sweep_" + toml.stem().string());
      const CommandResult p = modalities({"benchmark", "prepare_sweep_configs", "--sweep_config_path", toml.string(),
                                          "--output_dir", out.string(), "--world_sizes", "8"});
      ASSERT_EQ(p.exit_code, 0) << p;
      configs = files_named(out, toml.filename().string());
      EXPECT_GE(configs.size(), 2u);
    }
    for (const fs::path& config : configs) {
      std::string cmd = "cd " + modalities::testing::shell_quote(cwd.string()) + " && exec " +
                        modalities::testing::shell_quote(kHost) + " config validate " +
                        modalities::testing::shell_quote(config.string());
      if (warmstart.count(rel))
        cmd += " --last_checkpoint_info_file_path " + modalities::testing::shell_quote(ck + "/info.json");
      const CommandResult v = run_command({"sh", "-c", cmd});
      if (const auto it = rejected.find(rel); it != rejected.end()) {
        EXPECT_EQ(v.exit_code, 1) << v;
        EXPECT_THAT(v.err, HasSubstr(it->second)) << v;
      } else {
        EXPECT_EQ(v.exit_code, 0) << v;
        valid += v.exit_code == 0;
      }
    }
  }
  EXPECT_EQ(valid, 22 - 2 + 2 + 8);  // 22 configs, of which two sweep files give 2 and 8 configs
}

// Modalities' CoCa example (config_example_coca.yaml: model/coca, model_initialized of type coca,
// fsdp1_wrapped in FP_16, dummy image and text samples, fsdp1 checkpoints), imported, with tiny
// sizes overridden (and the experiments root its settings.paths lacks), trains 2 steps on one
// process and writes its checkpoint. The loss starts near ln 512 (the dummy ids are below 512).
TEST(CliImportTest, ModalitiesCocaExampleTrainsTwoStepsAtTinySizes) {
  namespace fs = std::filesystem;
  const fs::path yaml = fs::path(MODALITIES_TEST_SHARED_DIR) / "fixtures" / "modalities-configs" / "config_files" /
                        "training" / "config_example_coca.yaml";
  if (!fs::exists(yaml))
    GTEST_SKIP() << "skipped: needs " << yaml.string() << " (Modalities' file from ../shared/fixtures)";
  ScratchDir dir;
  const fs::path imported = dir.path() / "coca.toml";
  const CommandResult imp = modalities({"config", "import", yaml.string(), "-o", imported.string()});
  ASSERT_EQ(imp.exit_code, 0) << imp;
  std::string text = read_text(imported);
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"sample_shape = [3, 224, 224]", "sample_shape = [3, 32, 32]"},
           {"sample_shape = [1024]", "sample_shape = [17]"},
           {"img_size = 224", "img_size = 32"},
           {"n_layer = 12", "n_layer = 1"},
           {"n_head = 12", "n_head = 2"},
           {"n_embd = 768", "n_embd = 64"},
           {"block_size = 1024", "block_size = 16"},
           {"vocab_size = 50304", "vocab_size = 512"},
           {"n_layer_text = 12", "n_layer_text = 1"},
           {"n_layer_multimodal_text = 12", "n_layer_multimodal_text = 1"},
           {"ffn_hidden = 2048", "ffn_hidden = 128"},
           {"n_vision_queries = 256", "n_vision_queries = 4"},
           {"train_num_samples = 64", "train_num_samples = 2"},
           {"val_num_samples = 32", "val_num_samples = 2"},
           {"[settings.paths]\ncheckpoint_saving_path = \"data/checkpoints\"",
            "[settings.paths]\nexperiments_root_path = \"${modalities_env:experiments_root_path}\"\n"
            "checkpoint_saving_path = \"${modalities_env:experiments_root_path}/checkpoints\""}}) {
    for (std::size_t at = 0; (at = text.find(from, at)) != std::string::npos; at += to.size())
      text.replace(at, from.size(), to);
  }
  const fs::path tiny = dir.write("coca_tiny.toml", text);
  const fs::path experiments = dir.path() / "experiments";
  // From the scratch folder: the config's offline W&B subscriber writes wandb_storage/ where it runs.
  const CommandResult r =
      run_command({"sh", "-c",
                   "cd " + modalities::testing::shell_quote(dir.path().string()) + " && exec " +
                       modalities::testing::shell_quote(kHost) + " run --config_file_path " +
                       modalities::testing::shell_quote(tiny.string()) + " --experiments_root_path " +
                       modalities::testing::shell_quote(experiments.string()) + " --experiment_id coca"});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr("Training finished after 2 steps")) << r;
  EXPECT_TRUE(fs::exists(dir.path() / "wandb_storage")) << r;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("train loss avg: ([0-9.]+)"))) << r;
  EXPECT_NEAR(std::stod(m[1]), std::log(512.0), 0.5) << r;
  EXPECT_TRUE(fs::exists(experiments / "checkpoints" /
                         "eid_coca-seen_steps_2-seen_tokens_512-target_steps_2-target_tokens_512"))
      << r;
}

// --- data prepare_instruction_tuning_data ---------------------------------------------------------

std::string replace_all_in(std::string s, const std::string& from, const std::string& to) {
  for (std::size_t at = 0; (at = s.find(from, at)) != std::string::npos; at += to.size())
    s.replace(at, from.size(), to);
  return s;
}

// The bundled example (configs/instruction_tuning) gives exactly the files Modalities' own
// prepare_instruction_tuning_data writes for it (tests/data/instruction_tuning/expected, made by
// scripts/reference/make_instruction_tuning_reference.py with modalities 0.5.0): per split the
// JSONL with the rendered chats, its .idx and its .pbin.
TEST(CliInstructionTuningTest, BundledExampleMatchesModalitiesByteForByte) {
  namespace fs = std::filesystem;
  ScratchDir dir;
  const std::string root = MODALITIES_TEST_SOURCE_ROOT;
  const std::string here = "${modalities_env:config_folder_path}/../..";
  std::string config = read_text(fs::path(root) / "configs/instruction_tuning/apply_chat_template.toml");
  config = replace_all_in(config, here + "/out/instruction_tuning", dir.path().string() + "/out");
  config = replace_all_in(config, here, root);
  config = replace_all_in(config, "${modalities_env:config_folder_path}/packed_chat_dataset.toml",
                          (dir.path() / "pack.toml").string());
  dir.write(
      "pack.toml",
      replace_all_in(read_text(fs::path(root) / "configs/instruction_tuning/packed_chat_dataset.toml"), here, root));
  const auto cfg = dir.write("apply.toml", config);
  const CommandResult r = modalities({"data", "prepare_instruction_tuning_data", "--config_file_path", cfg.string()});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr("Chat template applied to 48 entries: train 40 val 2 test 6"));
  std::vector<fs::path> folders;
  for (const auto& e : fs::directory_iterator(dir.path() / "out")) folders.push_back(e.path());
  ASSERT_EQ(folders.size(), 1u);
  const std::string folder = folders[0].filename().string();  // chats_<hash>
  ASSERT_TRUE(folder.starts_with("chats_")) << folder;
  const std::string hash = folder.substr(6);
  const fs::path expected = fs::path(root) / "tests/data/instruction_tuning/expected";
  for (const char* split : {"train", "val", "test"})
    for (const char* ext : {".jsonl", ".idx", ".pbin"}) {
      const fs::path ours = folders[0] / (std::string("chats_") + split + "." + hash + ext);
      EXPECT_EQ(read_text(ours), read_text(expected / (std::string(split) + ext))) << ours;
    }
  EXPECT_TRUE(fs::exists(folders[0] / ("instruction_chat_template_config." + hash + ".toml")));
  EXPECT_TRUE(fs::exists(folders[0] / ("pbin_config_train." + hash + ".toml")));
  // Errors name the line and the missing role.
  const auto bad_src = dir.write("bad.jsonl",
                                 "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n"
                                 "{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}\n");
  const auto bad =
      dir.write("bad.toml", replace_all_in(config, root + "/data/instruction_tuning/chats.jsonl", bad_src.string()));
  const CommandResult b = modalities({"data", "prepare_instruction_tuning_data", "--config_file_path", bad.string()});
  EXPECT_EQ(b.exit_code, 1) << b;
  EXPECT_THAT(b.err, HasSubstr("bad.jsonl:2: role 'robot' is not in instruction_data_transformation.role_mapping"));
}

TEST(CliProfileTest, AProfilerWithoutALengthIsAClearError) {
  ScratchDir dir;
  const auto config = dir.write("p.toml", R"(
[steppable_component]
component_key = "steppable_component"
variant_key = "forward_pass"
config = { model = { instance_key = "m", pass_type = "BY_REFERENCE" }, dataset_batch_generator = { instance_key = "g", pass_type = "BY_REFERENCE" } }

[m]
component_key = "layer_norm"
variant_key = "layer_norm"
config = { normalized_shape = 4 }

[g]
component_key = "dataset_batch_generator"
variant_key = "random"
config = { dims = { b = 2, d = 4 }, data_type = "float32", min_val = 0, max_val = 1 }

[profiler]
component_key = "steppable_profiler"
variant_key = "no_profiler"
config = {}
)");
  const CommandResult r = modalities({"profile", config.string(), "--experiment_root_path", dir.path().string()});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("no_profiler has no length")) << r;
}

}  // namespace
}  // namespace modalities::cli
