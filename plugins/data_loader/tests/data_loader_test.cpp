// data_loader/default over the real input pipeline (datasets, samplers and
// collators plugins; data/sample/train.pbin): identical batches for 0, 1 and 4
// worker threads, resuming at batch k equals the tail of a full pass, worker
// errors surface from next() naming the batch, prefetching is bounded by
// num_workers * prefetch_factor. A probe dataset is registered in-process.
#include <modalities/sdk/interfaces/batch.h>
#include <modalities/sdk/interfaces/data_loader.h>
#include <modalities/sdk/interfaces/dataset.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <thread>

namespace modalities::plugins::data_loader {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

const fs::path kExample = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml";

class InSourceRoot : public ::testing::Environment {
 public:
  void SetUp() override { fs::current_path(MODALITIES_TEST_SOURCE_ROOT); }
};
const auto* const kEnv = ::testing::AddGlobalTestEnvironment(new InSourceRoot);

// dataset/test_probe: sample i = {"input_ids": [i, i+1, i+2]}; counts get() calls,
// optionally sleeps, and throws for index fail_at.
std::atomic<std::int64_t> g_gets{0};
struct ProbeConfig {
  std::int64_t size = 0;
  std::int64_t fail_at = -1;
  std::int64_t delay_ms = 0;
  static void describe(Schema<ProbeConfig>& s) {
    s.field("size", &ProbeConfig::size, "length").required();
    s.field("fail_at", &ProbeConfig::fail_at, "index that throws");
    s.field("delay_ms", &ProbeConfig::delay_ms, "sleep per get");
  }
};
class ProbeDataset final : public Dataset {
 public:
  explicit ProbeDataset(ProbeConfig c) : c_(c) {}
  std::int64_t size() const override { return c_.size; }
  Sample get(std::int64_t i) const override {
    ++g_gets;
    if (c_.delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(c_.delay_ms));
    if (i == c_.fail_at) throw Error(fmt::format("probe dataset: sample {} is corrupt", i));
    return {{"input_ids", at::arange(i, i + 3, at::kLong)}};
  }

 private:
  ProbeConfig c_;
};

std::vector<DatasetBatch> drain(DataLoader& l, std::int64_t first = 0) {
  std::vector<DatasetBatch> out;
  l.begin(first);
  while (auto b = l.next()) out.push_back(std::move(*b));
  return out;
}

bool same(const DatasetBatch& a, const DatasetBatch& b) {
  if (a.samples.size() != b.samples.size() || a.targets.size() != b.targets.size()) return false;
  for (const auto& [k, t] : a.samples)
    if (!b.samples.count(k) || !t.equal(b.samples.at(k))) return false;
  for (const auto& [k, t] : a.targets)
    if (!b.targets.count(k) || !t.equal(b.targets.at(k))) return false;
  return true;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

class DataLoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    h.load_plugin(MODALITIES_TEST_DATASETS_PLUGIN);
    h.load_plugin(MODALITIES_TEST_SAMPLERS_PLUGIN);
    h.load_plugin(MODALITIES_TEST_COLLATORS_PLUGIN);
    auto problem = h.registry().register_plugin({"loader_test_fakes", "0.0.0", {}, {}, {}}, [](Registrar& r) {
      r.add<Dataset, ProbeConfig>("test_probe", "probe",
                                  [](const ProbeConfig& c) { return std::make_shared<ProbeDataset>(c); });
    });
    ASSERT_FALSE(problem.has_value()) << *problem;
  }

  std::shared_ptr<DataLoader> loader(std::int64_t workers) {
    h.set("train_dataloader.config.num_workers", Value(workers));
    return h.get<DataLoader>("train_dataloader");
  }

  // A loader over test_probe(size) in sequential order with batches of `batch_size`.
  void configure_probe(std::int64_t size, std::int64_t batch_size, std::int64_t workers, const std::string& extra = "",
                       const std::string& probe_extra = "") {
    h.set_config_text(fmt::format(R"(
[probe]
component_key = "dataset"
variant_key = "test_probe"
config = {{ size = {}{} }}

[loader]
component_key = "data_loader"
variant_key = "default"

[loader.config]
dataloader_tag = "probe"
dataset = {{ instance_key = "probe", pass_type = "BY_REFERENCE" }}
num_workers = {}
pin_memory = false
{}

[loader.config.batch_sampler]
component_key = "batch_sampler"
variant_key = "default"

[loader.config.batch_sampler.config]
batch_size = {}
sampler = {{ component_key = "sampler", variant_key = "sequential_sampler", config = {{ data_source = {{ instance_key = "probe", pass_type = "BY_REFERENCE" }} }} }}
)",
                                  size, probe_extra, workers, extra, batch_size));
  }

  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
};

TEST_F(DataLoaderTest, DeliversTheSpecOrder) {
  auto l = h.get<DataLoader>("train_dataloader");
  ASSERT_NE(l, nullptr);
  EXPECT_EQ(l->tag(), "train");
  EXPECT_EQ(l->size(), 113);  // data/sample/train.pbin: rank 0 of 2 reads 455 of 911 samples; 455 div 4
  l->begin(0);
  const auto b = l->next();
  ASSERT_TRUE(b.has_value());
  const at::Tensor& x = b->samples.at("input_ids");
  EXPECT_EQ(x.sizes(), (std::vector<std::int64_t>{4, 256}));
  EXPECT_EQ(b->targets.at("target_ids").sizes(), (std::vector<std::int64_t>{4, 256}));
  // Rank 0's first sample is torch.randperm(911, generator=manual_seed(42))[0] = 119 (PyTorch 2.11),
  // whose tokens 119 * 256 ... of train.pbin start 65, 452, 300, 324 (read with Python's struct).
  EXPECT_TRUE(x[0].slice(0, 0, 3).equal(at::tensor({65, 452, 300}, at::kLong)));
  EXPECT_EQ(b->targets.at("target_ids")[0][0].item<std::int64_t>(), 452);
  EXPECT_EQ(b->size(), 4);
}

TEST_F(DataLoaderTest, OutputIsIdenticalForAnyNumberOfWorkers) {
  const auto reference = drain(*loader(0));
  ASSERT_EQ(reference.size(), 113u);
  for (std::int64_t workers : {1, 4}) {
    const auto batches = drain(*loader(workers));
    ASSERT_EQ(batches.size(), reference.size()) << workers << " workers";
    for (std::size_t i = 0; i < batches.size(); ++i) ASSERT_TRUE(same(batches[i], reference[i])) << "batch " << i;
  }
}

TEST_F(DataLoaderTest, ResumingAtBatchKEqualsTheTailOfAFullPass) {
  const auto reference = drain(*loader(0));
  for (std::int64_t workers : {0, 3}) {
    auto l = loader(workers);
    for (std::int64_t k : {1, 100, 112, 113}) {
      const auto tail = drain(*l, k);
      ASSERT_EQ(tail.size(), reference.size() - k) << "k " << k;
      for (std::size_t i = 0; i < tail.size(); ++i) ASSERT_TRUE(same(tail[i], reference[k + i])) << "k " << k;
    }
    // Restarting mid-pass discards what was prefetched for the old pass.
    l->begin(0);
    l->next();
    l->next();
    l->begin(50);
    ASSERT_TRUE(same(*l->next(), reference[50]));
    EXPECT_FALSE(drain(*l, 113).size());
    EXPECT_FALSE(l->next().has_value());  // stays exhausted
  }
}

TEST_F(DataLoaderTest, RejectsBadBeginAndNextWithoutBegin) {
  auto l = loader(2);
  EXPECT_THAT(error_of([&] { l->next(); }), HasSubstr("data_loader 'train': next() called before begin()"));
  EXPECT_THAT(error_of([&] { l->begin(114); }), HasSubstr("cannot begin at batch 114 of 113"));
  EXPECT_THAT(error_of([&] { l->begin(-1); }), HasSubstr("cannot begin at batch -1"));
}

TEST_F(DataLoaderTest, WorkerErrorsAreRethrownFromNextNamingTheBatch) {
  for (std::int64_t workers : {0, 1, 3}) {
    configure_probe(20, 2, workers, "", ", fail_at = 5");
    auto l = h.get<DataLoader>("loader");
    l->begin(0);
    EXPECT_TRUE(l->next().has_value());
    EXPECT_TRUE(l->next().has_value());
    EXPECT_THAT(error_of([&] { l->next(); }),
                AllOf(HasSubstr("data_loader 'probe': batch 2 failed"), HasSubstr("sample 5 is corrupt")))
        << workers << " workers";
    // The pass goes on with the following batches.
    const auto b = l->next();
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(b->samples.at("input_ids")[0][0].item<std::int64_t>(), 6);
  }
}

// Waits (up to 10 s, for loaded machines) until `count` get() calls happened, then
// a little longer to see that no more follow.
std::int64_t settled_gets(std::int64_t count) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (g_gets.load() < count && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  return g_gets.load();
}

TEST_F(DataLoaderTest, PrefetchIsBoundedByWorkersTimesPrefetchFactor) {
  configure_probe(100, 1, 2, "prefetch_factor = 3");
  auto l = h.get<DataLoader>("loader");
  g_gets = 0;
  l->begin(0);
  EXPECT_EQ(settled_gets(6), 6);  // 2 workers x 3 batches of 1 sample, nothing consumed yet
  l->next();
  EXPECT_EQ(settled_gets(7), 7);
}

TEST_F(DataLoaderTest, StopsSlowWorkersOnRestartAndDestruction) {
  configure_probe(1000, 1, 4, "", ", delay_ms = 20");
  auto l = h.get<DataLoader>("loader");
  l->begin(0);
  l->next();
  const auto start = std::chrono::steady_clock::now();
  l->begin(900);  // joins the old workers: each finishes at most one batch
  EXPECT_EQ(l->next()->samples.at("input_ids")[0][0].item<std::int64_t>(), 900);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

TEST_F(DataLoaderTest, WithoutCollateFnStacksEveryKey) {
  configure_probe(10, 4, 0, "collate_fn = \"${null:}\"");
  auto l = h.get<DataLoader>("loader");
  const auto batches = drain(*l);
  ASSERT_EQ(batches.size(), 2u);  // 10 div 4
  EXPECT_TRUE(batches[1]
                  .samples.at("input_ids")
                  .equal(at::stack({at::arange(4, 7, at::kLong), at::arange(5, 8, at::kLong),
                                    at::arange(6, 9, at::kLong), at::arange(7, 10, at::kLong)})));
  EXPECT_TRUE(batches[1].targets.empty());
}

TEST_F(DataLoaderTest, PinMemoryIsIgnoredWithoutCuda) {
  if (at::hasCUDA()) GTEST_SKIP() << "CUDA is available; pinning is exercised on GPU machines";
  h.set("train_dataloader.config.pin_memory", Value(true));
  auto l = h.get<DataLoader>("train_dataloader");
  l->begin(0);
  EXPECT_FALSE(l->next()->samples.at("input_ids").is_pinned());
}

TEST_F(DataLoaderTest, PinsBatchesWithCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs CUDA";
  h.set("train_dataloader.config.pin_memory", Value(true));
  auto l = h.get<DataLoader>("train_dataloader");
  l->begin(0);
  const auto b = l->next();
  EXPECT_TRUE(b->samples.at("input_ids").is_pinned());
  EXPECT_TRUE(b->targets.at("target_ids").is_pinned());
}

TEST_F(DataLoaderTest, ValidatorsNameTheConfigPath) {
  h.set("train_dataloader.config.num_workers", Value(-1));
  EXPECT_THAT(h.build_error(), HasSubstr("train_dataloader.config.num_workers: must be >= 0, got -1"));
  h.set("train_dataloader.config.num_workers", Value(2));
  h.set("train_dataloader.config.prefetch_factor", Value(0));
  EXPECT_THAT(h.build_error(), HasSubstr("train_dataloader.config.prefetch_factor: must be > 0, got 0"));
  h.erase("train_dataloader.config.prefetch_factor");
  h.erase("train_dataloader.config.pin_memory");
  EXPECT_THAT(h.build_error(), HasSubstr("train_dataloader.config.pin_memory: missing required key"));
  h.set("train_dataloader.config.pin_memory", Value(false));
  h.set("train_dataloader.config.dataloader_tag", Value(1));
  EXPECT_THAT(h.build_error(), HasSubstr("train_dataloader.config.dataloader_tag: expected a string"));
  h.set("train_dataloader.config.dataloader_tag", Value("train"));
  h.set("train_dataloader.config.batch_sampler",
        Value(Value::Table{{"instance_key", Value("train_dataset")}, {"pass_type", Value("BY_REFERENCE")}}));
  EXPECT_THAT(h.build_error(), HasSubstr("train_dataloader.config.batch_sampler: expected a BatchSampler"));
}

}  // namespace
}  // namespace modalities::plugins::data_loader
