// profiling: every variant built from the example config (a tiny GPT-2 with its loss and AdamW
// from the bundled plugins) and run the way `modalities profile` runs them. The Chrome trace is
// parsed and must contain the model's operators; the summary table must list them.
#include <modalities/sdk/interfaces/dataset_batch_generator.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/steppable_component.h>
#include <modalities/sdk/interfaces/steppable_profiler.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/scratch_dir.h>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <simdjson.h>
#include <unistd.h>

#include <filesystem>
#include <set>

namespace modalities::plugins::profiling {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const fs::path kExample = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml";

using TempDir = modalities::testing::ScratchDir;

std::unique_ptr<testing::Harness> harness(const fs::path& out) {
  auto h = std::make_unique<testing::Harness>(MODALITIES_TEST_PLUGIN);
  for (const char* p : {MODALITIES_TEST_GPT2_PLUGIN, MODALITIES_TEST_LOSSES_PLUGIN, MODALITIES_TEST_OPTIMIZERS_PLUGIN,
                        MODALITIES_TEST_LAYER_NORM_PLUGIN})
    h->load_plugin(p);
  h->set_config_text(testing::read_file(kExample), kExample.string());
  h->set("kernel_profiler.config.output_folder_path", out.string());
  return h;
}

// What `modalities profile` does.
void run_profiling(SteppableComponent& component, SteppableProfiler& profiler) {
  profiler.enter();
  for (std::int64_t i = 0; i < profiler.size(); ++i) {
    component.step();
    profiler.step();
  }
  profiler.exit();
}

TEST(ProfilingTest, KernelTracingWritesAChromeTraceAndATableOfTheActiveSteps) {
  TempDir dir;
  auto h = harness(dir.path());
  auto component = h->get<SteppableComponent>("steppable_component");
  auto profiler = h->get<SteppableProfiler>("profiler");
  ASSERT_NE(component, nullptr) << h->build_error();
  ASSERT_NE(profiler, nullptr) << h->build_error();
  EXPECT_EQ(profiler->size(), 4);  // 1 wait + 1 warmup + 2 active; no_profiler's -1 does not count
  auto model = h->get<Module>("model");
  const at::Tensor before = model->named_parameters().front().second.detach().clone();
  run_profiling(*component, *profiler);
  EXPECT_FALSE(at::equal(before, model->named_parameters().front().second.detach()))
      << "forward_pass with loss_fn and optimizer updates the weights";

  const fs::path trace = dir.path() / "profiler_trace_ranks_1_rank_0.json";
  const fs::path summary = dir.path() / "profiler_summary_ranks_1_rank_0.txt";
  ASSERT_TRUE(fs::exists(trace));
  ASSERT_TRUE(fs::exists(summary));
  simdjson::dom::parser parser;
  simdjson::dom::element root;
  ASSERT_EQ(parser.load(trace.string()).get(root), simdjson::SUCCESS) << "the trace is JSON";
  simdjson::dom::array events;
  ASSERT_EQ(root["traceEvents"].get_array().get(events), simdjson::SUCCESS) << "Chrome trace format";
  std::set<std::string> names;
  std::size_t with_shapes = 0;
  for (simdjson::dom::element e : events) {
    std::string_view name;
    if (e["name"].get_string().get(name) == simdjson::SUCCESS) names.emplace(name);
    simdjson::dom::element dims;
    if (e["args"]["Input Dims"].get(dims) == simdjson::SUCCESS) ++with_shapes;
  }
  for (const char* op : {"aten::embedding", "aten::layer_norm", "aten::cross_entropy_loss", "aten::mm"})
    EXPECT_TRUE(names.contains(op)) << op << " missing from the trace";
  EXPECT_TRUE(std::any_of(names.begin(), names.end(), [](const std::string& n) {
    return n.find("Backward") != n.npos;
  })) << "the backward pass is recorded";
  EXPECT_GT(with_shapes, 0u) << "record_shapes = true";
  const std::string table = testing::read_file(summary);
  EXPECT_THAT(table, HasSubstr("2 recorded step(s)"));
  EXPECT_THAT(table, HasSubstr("aten::mm"));
  EXPECT_THAT(table, HasSubstr("Operators and runtime calls (CPU)"));
}

// A training run with fewer steps left than the schedule: the active steps recorded so far are
// written, with a warning (as torch.profiler does when it stops early).
TEST(ProfilingTest, LeavingEarlyKeepsTheRecordedActiveSteps) {
  TempDir dir;
  auto h = harness(dir.path());
  auto component = h->get<SteppableComponent>("steppable_component");
  auto profiler = h->get<SteppableProfiler>("kernel_profiler");
  ASSERT_NE(profiler, nullptr) << h->build_error();
  profiler->enter();
  for (int i = 0; i < 3; ++i) {  // wait, warmup, one active step of two
    component->step();
    profiler->step();
  }
  ::testing::internal::CaptureStderr();
  profiler->exit();
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("left after 3 of 4 steps; the trace holds the 1 active"));
  EXPECT_TRUE(fs::exists(dir.path() / "profiler_trace_ranks_1_rank_0.json"));
  EXPECT_THAT(testing::read_file(dir.path() / "profiler_summary_ranks_1_rank_0.txt"), HasSubstr("1 recorded step(s)"));
  // Before the first active step nothing was recorded.
  TempDir dir2;
  auto h2 = harness(dir2.path());
  auto p2 = h2->get<SteppableProfiler>("kernel_profiler");
  p2->enter();
  h2->get<SteppableComponent>("steppable_component")->step();
  p2->step();
  ::testing::internal::CaptureStderr();
  p2->exit();
  EXPECT_THAT(::testing::internal::GetCapturedStderr(), HasSubstr("no trace was written"));
  EXPECT_TRUE(fs::is_empty(dir2.path()));
}

TEST(ProfilingTest, UntrackedRanksRunANoOpProfilerOfTheSameLength) {
  TempDir dir;
  auto h = harness(dir.path());
  h->set("kernel_profiler.config.tracked_ranks", Value(Value::List{}));
  auto profiler = h->get<SteppableProfiler>("kernel_profiler");
  ASSERT_NE(profiler, nullptr) << h->build_error();
  EXPECT_EQ(profiler->size(), 4);
  run_profiling(*h->get<SteppableComponent>("steppable_component"), *profiler);
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(ProfilingTest, RandomBatchesHaveTheShapeTypeAndRange) {
  TempDir dir;
  auto h = harness(dir.path());
  auto gen = h->get<DatasetBatchGenerator>("batch_generator");
  ASSERT_NE(gen, nullptr) << h->build_error();
  const DatasetBatch b = gen->dataset_batch();
  EXPECT_EQ(b.samples.at("input_ids").sizes(), (std::vector<std::int64_t>{2, 32}));
  EXPECT_EQ(b.targets.at("target_ids").scalar_type(), at::kLong);
  EXPECT_GE(b.samples.at("input_ids").min().item<std::int64_t>(), 0);
  EXPECT_LT(b.samples.at("input_ids").max().item<std::int64_t>(), 256);
  for (const char* type : {"float32", "bfloat16"}) {
    auto h2 = harness(dir.path());
    h2->set("batch_generator.config.data_type", type);
    h2->set("batch_generator.config.min_val", std::int64_t{-3});
    h2->set("batch_generator.config.max_val", std::int64_t{5});
    const DatasetBatch f = h2->get<DatasetBatchGenerator>("batch_generator")->dataset_batch();
    const at::Tensor x = f.samples.at("input_ids");
    EXPECT_EQ(x.scalar_type(), std::string(type) == "float32" ? at::kFloat : at::kBFloat16);
    EXPECT_GE(x.min().item<double>(), -3.0);
    EXPECT_LE(x.max().item<double>(), 5.0);
  }
}

TEST(ProfilingTest, BadSettingsAreClearErrors) {
  TempDir dir;
  {
    auto h = harness(dir.path());
    h->set("batch_generator.config.max_val", std::int64_t{0});
    EXPECT_THAT(h->build_error(), HasSubstr("batch_generator.config.max_val"));
  }
  {
    auto h = harness(dir.path());
    h->set("batch_generator.config.dims.batch_size", std::int64_t{0});
    EXPECT_THAT(h->build_error(), HasSubstr("batch_generator.config.dims.batch_size"));
  }
  {
    auto h = harness(dir.path());
    h->erase("steppable_component.config.loss_fn");
    EXPECT_THAT(h->build_error(), HasSubstr("set loss_fn as well"));
  }
  {
    auto h = harness(dir.path());
    h->set("kernel_profiler.config.profiler_activities", Value(Value::List{Value("GPU")}));
    EXPECT_THAT(h->build_error(), HasSubstr("unknown activity 'GPU'"));
  }
#if !defined(MODALITIES_WITH_CUDA)
  {
    auto h = harness(dir.path());
    h->set_config_text(
        "[m]\ncomponent_key = \"steppable_profiler\"\nvariant_key = \"memory_tracing\"\nconfig = { num_wait_steps = 0, "
        "num_warmup_steps = 0, num_active_steps = 1, memory_snapshot_folder_path = \"x\", tracked_ranks = [0] }\n");
    EXPECT_THAT(h->build_error(), HasSubstr("this build has no CUDA"));
  }
#endif
}

}  // namespace
}  // namespace modalities::plugins::profiling
