// debugging: the hooks on the bundled GPT-2, built from the example config. A NaN planted in one
// block's weights is named with the block and the forward call; the print hook prints every
// block; debugging/settings removes the hooks and restores determinism at its end; the enriched
// model writes Modalities' tensor-statistics lines.
#include <modalities/sdk/interfaces/debugging.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/scratch_dir.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <simdjson.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace modalities::plugins::debugging {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const fs::path kExample = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml";

using TempDir = modalities::testing::ScratchDir;

std::unique_ptr<testing::Harness> harness(const fs::path& out) {
  auto h = std::make_unique<testing::Harness>(MODALITIES_TEST_PLUGIN);
  h->load_plugin(MODALITIES_TEST_GPT2_PLUGIN);
  h->load_plugin(MODALITIES_TEST_LAYER_NORM_PLUGIN);
  h->set_config_text(testing::read_file(kExample), kExample.string());
  h->set("model.config.logging_dir_path", (out / "stats").string());
  return h;
}

TensorMap batch() { return {{"input_ids", at::randint(0, 256, {2, 32}, at::kLong)}}; }

void plant_nan(Module& model, const std::string& name) {
  at::NoGradGuard no_grad;
  for (auto& [n, p] : model.named_parameters())
    if (n == name) p.view(-1)[0].fill_(std::nan(""));
}

TEST(DebuggingTest, NanHookNamesTheBlockAndTheForwardCall) {
  TempDir dir;
  auto h = harness(dir.path());
  ASSERT_NE(h->get<Debugging>("debugging"), nullptr) << h->build_error();
  auto model = h->get<Module>("model");
  ASSERT_NE(model, nullptr);
  ::testing::internal::CaptureStdout();
  model->forward(batch());  // forward call 1: clean
  plant_nan(*model, "transformer.h.1.mlp.c_fc.weight");
  try {
    model->forward(batch());
    FAIL() << "expected the NaN to stop the run";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("NaN in output 0 of 'transformer.h.1' (GPT2Block), forward call 2"));
  }
  const std::string printed = ::testing::internal::GetCapturedStdout();
  EXPECT_THAT(printed, HasSubstr("Module: GPT2Block 'transformer.h.0' input: [64x128 Float] output: [64x128 Float]"));
  EXPECT_THAT(printed, HasSubstr("Module: GPT2LLM '' input: [2x32 Long]"));
}

TEST(DebuggingTest, NanHookWarnsWithoutRaiseAndChecksGradients) {
  TempDir dir;
  auto h = harness(dir.path());
  h->set("nan_hook.config.raise_exception", false);
  auto model = h->get<Module>("model");
  ASSERT_NE(h->get<Debugging>("debugging"), nullptr) << h->build_error();
  plant_nan(*model, "transformer.h.0.attention_norm.weight");
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  auto out = model->forward(batch());
  out.at("logits").sum().backward();
  ::testing::internal::GetCapturedStdout();
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(
      warnings,
      HasSubstr(
          "warning: model_debugging_hook/nan_hook: NaN in output 0 of 'transformer.h.0' (GPT2Block), forward call 1"));
  EXPECT_THAT(warnings, HasSubstr("in the gradient of output"));
}

TEST(DebuggingTest, SettingsRemoveTheHooksAndRestoreDeterminismAtTheEnd) {
  TempDir dir;
  const bool before = at::globalContext().deterministicAlgorithms();
  std::shared_ptr<Module> model;
  {
    auto h = harness(dir.path());
    auto settings = h->get<Debugging>("debugging");
    ASSERT_NE(settings, nullptr) << h->build_error();
    EXPECT_TRUE(at::globalContext().deterministicAlgorithms());
    EXPECT_STREQ(std::getenv("CUBLAS_WORKSPACE_CONFIG"), ":4096:8");
    model = h->get<Module>("model");
    ::testing::internal::CaptureStdout();
    model->forward(batch());
    EXPECT_FALSE(::testing::internal::GetCapturedStdout().empty());
  }  // the harness, and with it debugging/settings, is gone
  EXPECT_EQ(at::globalContext().deterministicAlgorithms(), before);
  plant_nan(*model, "transformer.h.1.mlp.c_fc.weight");
  ::testing::internal::CaptureStdout();
  EXPECT_NO_THROW(model->forward(batch())) << "the nan hook was removed";
  EXPECT_EQ(::testing::internal::GetCapturedStdout(), "") << "the print hook was removed";
}

TEST(DebuggingTest, EnrichedModelWritesModalitiesTensorStatistics) {
  TempDir dir;
  auto h = harness(dir.path());
  h->erase("debugging.config.forward_hooks");
  h->set("model.config.log_interval_steps", std::int64_t{2});
  auto model = h->get<Module>("model");
  ASSERT_NE(model, nullptr) << h->build_error();
  for (int i = 0; i < 3; ++i) model->forward(batch()).at("logits").sum().backward();
  const fs::path file = dir.path() / "stats" / "tensor_stats_rank_0.jsonl";
  ASSERT_TRUE(fs::exists(file));
  std::ifstream in(file);
  std::map<std::string, int> hook_types;
  std::set<std::string> tags;
  std::set<std::int64_t> counters;
  simdjson::dom::parser parser;
  for (std::string line; std::getline(in, line);) {
    simdjson::dom::element e = parser.parse(line).value();
    ++hook_types[std::string(e["hook_type"].get_string().value())];
    tags.emplace(e["tensor_tag"].get_string().value());
    counters.insert(e["counter"].get_int64().value());
    EXPECT_EQ(e["nan_count"].get_int64().value(), 0);
    EXPECT_EQ(std::string(e["dtype"].get_string().value()).rfind("torch.", 0), 0u);
  }
  // Calls 0 and 2 of every hook are logged (interval 2), call 1 is not.
  EXPECT_EQ(counters, (std::set<std::int64_t>{0, 2}));
  for (const char* type : {"forward_input", "forward_weights", "forward_output", "backward_output"})
    EXPECT_GT(hook_types[type], 0) << type;
  for (const char* tag : {"transformer.h.0", "transformer.h.1", "GPT2LLM", "transformer.h.0.attn.q_attn.weight",
                          "transformer.wte.weight"})
    EXPECT_TRUE(tags.contains(tag)) << tag;
}

TEST(DebuggingTest, BadReferencesAreClearErrors) {
  TempDir dir;
  auto h = harness(dir.path());
  h->set("debugging.config.forward_hooks", Value(Value::List{Value("not a reference")}));
  EXPECT_THAT(h->build_error(), HasSubstr("debugging.config.forward_hooks"));
}

}  // namespace
}  // namespace modalities::plugins::debugging
