// Samplers against the exact index vectors in README.md (verified
// there against LibTorch / Modalities) and Modalities' own multi-dim sampler
// test; datasets and device meshes of a given size are registered in-process.
// One negative test per validator asserts that the message names the config path.
#include <modalities/sdk/interfaces/dataset.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/interfaces/sampler.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <filesystem>
#include <numeric>

namespace modalities::plugins::samplers {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

const std::filesystem::path kExample =
    std::filesystem::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml";

// dataset/test_range: `size` samples {"i": [index]}.
struct RangeConfig {
  std::int64_t size = 0;
  static void describe(Schema<RangeConfig>& s) { s.field("size", &RangeConfig::size, "length").required(); }
};
class RangeDataset final : public Dataset {
 public:
  explicit RangeDataset(std::int64_t n) : n_(n) {}
  std::int64_t size() const override { return n_; }
  Sample get(std::int64_t i) const override { return {{"i", at::full({1}, i, at::kLong)}}; }

 private:
  std::int64_t n_;
};

// device_mesh/test_fixed: named dims with sizes, and this rank's coordinates.
struct MeshConfig {
  std::vector<std::string> dims;
  std::vector<std::int64_t> sizes;
  std::vector<std::int64_t> coordinates;
  static void describe(Schema<MeshConfig>& s) {
    s.field("dims", &MeshConfig::dims, "dim names").required();
    s.field("sizes", &MeshConfig::sizes, "dim sizes").required();
    s.field("coordinates", &MeshConfig::coordinates, "this rank's coordinates").required();
  }
};
class FixedMesh final : public DeviceMesh {
 public:
  explicit FixedMesh(MeshConfig c) : c_(std::move(c)) {
    for (const std::string& name : c_.dims) dims_.push_back(parse_mesh_dim(name).value());
  }
  std::vector<MeshDim> dims() const override { return dims_; }
  bool has_dim(MeshDim dim) const override { return find(dim) >= 0; }
  std::int64_t size() const override {
    return std::accumulate(c_.sizes.begin(), c_.sizes.end(), std::int64_t{1}, std::multiplies<>());
  }
  std::int64_t size(MeshDim dim) const override { return c_.sizes.at(at_dim(dim)); }
  std::int64_t coordinate(MeshDim dim) const override { return c_.coordinates.at(at_dim(dim)); }
  std::int64_t rank() const override { return 0; }
  std::string device_type() const override { return "cpu"; }
  std::shared_ptr<const DeviceMesh> sub_mesh(const std::vector<MeshDim>&) const override {
    throw Error("not needed in this test");
  }
  c10::intrusive_ptr<c10d::ProcessGroup> process_group(MeshDim) const override { return {}; }
  c10::intrusive_ptr<c10d::ProcessGroup> flattened_process_group() const override { return {}; }
  bool loss_parallel() const override { return false; }

 private:
  std::int64_t find(MeshDim dim) const {
    for (std::size_t i = 0; i < dims_.size(); ++i)
      if (dims_[i] == dim) return static_cast<std::int64_t>(i);
    return -1;
  }
  std::size_t at_dim(MeshDim dim) const {
    const std::int64_t i = find(dim);
    if (i < 0) throw Error(fmt::format("no dim '{}'", mesh_dim_name(dim)));
    return static_cast<std::size_t>(i);
  }
  MeshConfig c_;
  std::vector<MeshDim> dims_;
};

void register_fakes(testing::Harness& h) {
  auto problem = h.registry().register_plugin({"sampler_test_fakes", "0.0.0", {}, {}, {}}, [](Registrar& r) {
    r.add<Dataset, RangeConfig>("test_range", "0..size-1",
                                [](const RangeConfig& c) { return std::make_shared<RangeDataset>(c.size); });
    r.add<DeviceMesh, MeshConfig>("test_fixed", "fixed coordinates",
                                  [](const MeshConfig& c) { return std::make_shared<FixedMesh>(c); });
  });
  ASSERT_FALSE(problem.has_value()) << *problem;
}

std::vector<std::int64_t> all(const Sampler& s) {
  std::vector<std::int64_t> out;
  for (std::int64_t p = 0; p < s.size(); ++p) out.push_back(s.index_at(p));
  return out;
}

class SamplersTest : public ::testing::Test {
 protected:
  void SetUp() override { register_fakes(h); }

  // A resumable sampler over test_range(n) with the given extra config keys.
  std::shared_ptr<Sampler> resumable(std::int64_t n, std::int64_t rank, std::int64_t replicas, const std::string& extra,
                                     const std::string& variant = "resumable_distributed_sampler") {
    configure(n, rank, replicas, extra, variant);
    return h.get<Sampler>("s");
  }
  void configure(std::int64_t n, std::int64_t rank, std::int64_t replicas, const std::string& extra,
                 const std::string& variant = "resumable_distributed_sampler") {
    h.set_config_text(fmt::format(R"(
[ds]
component_key = "dataset"
variant_key = "test_range"
config = {{ size = {} }}

[s]
component_key = "sampler"
variant_key = "{}"
config = {{ dataset = {{ instance_key = "ds", pass_type = "BY_REFERENCE" }}, rank = {}, num_replicas = {}{} }}
)",
                                  n, variant, rank, replicas, extra.empty() ? "" : ", " + extra));
  }

  testing::Harness h{MODALITIES_TEST_PLUGIN};
};

TEST_F(SamplersTest, ResumableSamplerMatchesTheSpecVectorsWithSkip) {
  // n = 25, R = 3, seed 42, K = 4, drop_last.
  const std::string extra = "shuffle = true, seed = 42, skip_num_global_samples = 4";
  EXPECT_THAT(all(*resumable(25, 0, 3, extra)), ElementsAre(22, 6, 23, 19, 9, 11, 13));
  EXPECT_THAT(all(*resumable(25, 1, 3, extra)), ElementsAre(20, 8, 10, 16, 24, 15, 14));
  EXPECT_THAT(all(*resumable(25, 2, 3, extra)), ElementsAre(21, 18, 3, 1, 5, 7, 4));
}

TEST_F(SamplersTest, ResumableSamplerPadsFromTheWholePermutationWithoutDropLast) {
  // n = 10, R = 3, seed 0, drop_last false: randperm = 4 1 7 5 3 9 0 8 6 2, padded with 4 1.
  const std::string extra = "shuffle = true, seed = 0, drop_last = false";
  EXPECT_THAT(all(*resumable(10, 0, 3, extra)), ElementsAre(4, 5, 0, 2));
  EXPECT_THAT(all(*resumable(10, 1, 3, extra)), ElementsAre(1, 3, 8, 4));
  EXPECT_THAT(all(*resumable(10, 2, 3, extra)), ElementsAre(7, 9, 6, 1));
  // Padding comes from the start of the whole permutation, skipped items included:
  // K = 3 leaves 5 3 9 0 8 6 2 (G = 7) -> E = 9, padded with full[0:2] = 4 1.
  EXPECT_THAT(all(*resumable(10, 0, 3, extra + ", skip_num_global_samples = 3")), ElementsAre(5, 0, 2));
  EXPECT_THAT(all(*resumable(10, 1, 3, extra + ", skip_num_global_samples = 3")), ElementsAre(3, 8, 4));
  EXPECT_THAT(all(*resumable(10, 2, 3, extra + ", skip_num_global_samples = 3")), ElementsAre(9, 6, 1));
  // More padding than the dataset: the permutation repeats.
  EXPECT_THAT(all(*resumable(2, 4, 5, "drop_last = false")), ElementsAre(0));
  EXPECT_THAT(all(*resumable(2, 3, 5, "drop_last = false")), ElementsAre(1));
}

TEST_F(SamplersTest, ResumableSamplerMatchesLoremIpsumVectors) {
  // Modalities' lorem_ipsum_long.pbin, S = 256 -> 1 300 samples; R = 2, seed 42 (numpy permutation vectors).
  const std::string extra = "shuffle = true, seed = 42";
  auto r0 = all(*resumable(1300, 0, 2, extra));
  auto r1 = all(*resumable(1300, 1, 2, extra));
  ASSERT_EQ(r0.size(), 650u);
  EXPECT_THAT(std::vector<std::int64_t>(r0.begin(), r0.begin() + 6), ElementsAre(642, 836, 94, 512, 450, 218));
  EXPECT_THAT(std::vector<std::int64_t>(r1.begin(), r1.begin() + 6), ElementsAre(429, 628, 365, 558, 102, 1212));
  auto skipped = all(*resumable(1300, 0, 2, extra + ", skip_num_global_samples = 10"));
  ASSERT_EQ(skipped.size(), 645u);
  EXPECT_THAT(std::vector<std::int64_t>(skipped.begin(), skipped.begin() + 4), ElementsAre(218, 942, 861, 999));
  // Skipping K globally equals dropping K / R samples per rank when R divides K.
  EXPECT_TRUE(std::equal(skipped.begin(), skipped.end(), r0.begin() + 5));
  // Both ranks together cover the permutation once.
  std::vector<std::int64_t> both(r0);
  both.insert(both.end(), r1.begin(), r1.end());
  std::sort(both.begin(), both.end());
  for (std::int64_t i = 0; i < 1300; ++i) ASSERT_EQ(both[i], i);
}

TEST_F(SamplersTest, EpochShiftsTheSeedAndNoShuffleIsIdentity) {
  EXPECT_EQ(all(*resumable(1300, 0, 2, "shuffle = true, seed = 41, epoch = 1")),
            all(*resumable(1300, 0, 2, "shuffle = true, seed = 42")));
  EXPECT_THAT(all(*resumable(10, 1, 3, "")), ElementsAre(1, 4, 7));                        // drop_last: 9 of 10
  EXPECT_THAT(all(*resumable(10, 1, 3, "shuffle = \"${null:}\"")), ElementsAre(1, 4, 7));  // null = false
  EXPECT_THAT(all(*resumable(10, 0, 1, "shuffle = true, seed = 0")), ElementsAre(4, 1, 7, 5, 3, 9, 0, 8, 6, 2));
  EXPECT_THAT(all(*resumable(10, 0, 1, "shuffle = true, seed = 42")), ElementsAre(2, 6, 1, 8, 4, 5, 0, 9, 3, 7));
}

TEST_F(SamplersTest, DistributedSamplerEqualsResumableWithoutSkip) {
  for (std::int64_t rank : {0, 1, 2}) {
    EXPECT_EQ(all(*resumable(25, rank, 3, "shuffle = true, seed = 42", "distributed_sampler")),
              all(*resumable(25, rank, 3, "shuffle = true, seed = 42")));
    EXPECT_EQ(all(*resumable(10, rank, 3, "shuffle = true, seed = 0, drop_last = false", "distributed_sampler")),
              all(*resumable(10, rank, 3, "shuffle = true, seed = 0, drop_last = false")));
  }
  configure(25, 0, 3, "seed = 42", "distributed_sampler");
  EXPECT_THAT(h.build_error(), HasSubstr("s.config.shuffle: missing required key"));
}

TEST_F(SamplersTest, SamplerValidatorsNameTheConfigPath) {
  configure(25, 3, 3, "");
  EXPECT_THAT(h.build_error(), HasSubstr("s.config.rank: must be < num_replicas (3), got 3"));
  configure(25, -1, 3, "");
  EXPECT_THAT(h.build_error(), HasSubstr("s.config.rank: must be >= 0"));
  configure(25, 0, 0, "");
  EXPECT_THAT(h.build_error(), HasSubstr("s.config.num_replicas: must be > 0"));
  configure(25, 0, 3, "skip_num_global_samples = 26");
  EXPECT_THAT(h.build_error(),
              HasSubstr("s.config.skip_num_global_samples: cannot skip 26 samples of a dataset with 25"));
  configure(25, 0, 3, "skip_num_global_samples = -1");
  EXPECT_THAT(h.build_error(), HasSubstr("s.config.skip_num_global_samples: must be >= 0"));
  configure(25, 0, 3, "epoch = -2");
  EXPECT_THAT(h.build_error(), HasSubstr("s.config.epoch: must be >= 0"));
  configure(25, 0, 3, "shuffle = true, seed = \"${null:}\"");
  EXPECT_THAT(h.build_error(), HasSubstr("s.config.seed: must be an integer when shuffle is true"));
  configure(25, 0, 3, "rank_typo = 1");
  EXPECT_THAT(h.build_error(), HasSubstr("s.config.rank_typo: unknown key"));
  configure(25, 0, 3, "skip_num_global_samples = 1.0");
  EXPECT_THAT(h.build_error(), HasSubstr("s.config.skip_num_global_samples: expected an integer"));
  auto s = resumable(25, 0, 3, "");
  EXPECT_THROW(s->index_at(8), Error);
  EXPECT_THROW(s->index_at(-1), Error);
}

TEST_F(SamplersTest, EmptyAndFullySkippedDatasetsYieldNothing) {
  EXPECT_EQ(resumable(0, 0, 2, "shuffle = true, seed = 1")->size(), 0);
  EXPECT_EQ(resumable(25, 1, 2, "skip_num_global_samples = 25, drop_last = false")->size(), 0);
  EXPECT_EQ(resumable(1, 1, 2, "")->size(), 0);  // drop_last: 1 sample, 2 ranks
}

// --- multi-dim sampler ---------------------------------------------------------------

std::string mesh_config(std::int64_t tp_coord, std::int64_t dp_coord, const std::string& key,
                        const std::string& extra) {
  return fmt::format(R"(
[ds]
component_key = "dataset"
variant_key = "test_range"
config = {{ size = 32 }}

[mesh]
component_key = "device_mesh"
variant_key = "test_fixed"
config = {{ dims = ["dp_shard", "tp"], sizes = [2, 4], coordinates = [{}, {}] }}

[s]
component_key = "sampler"
variant_key = "resumable_distributed_multi_dim_sampler"
config = {{ dataset = {{ instance_key = "ds", pass_type = "BY_REFERENCE" }}, device_mesh = {{ instance_key = "mesh", pass_type = "BY_REFERENCE" }}, data_parallel_key = "{}"{} }}
)",
                     dp_coord, tp_coord, key, extra);
}

TEST_F(SamplersTest, MultiDimSamplerSplitsAlongTheDataParallelDimOnly) {
  // Modalities' test_resumable_distributed_multi_dim_sampler: 32 samples, dp_shard of size 2, tp of size 4.
  std::vector<std::int64_t> even(16), odd(16);
  for (int i = 0; i < 16; ++i) even[i] = 2 * i, odd[i] = 2 * i + 1;
  for (std::int64_t tp = 0; tp < 4; ++tp) {
    h.set_config_text(mesh_config(tp, 0, "dp_shard", ""));
    EXPECT_THAT(all(*h.get<Sampler>("s")), ElementsAreArray(even)) << "tp " << tp;
    h.set_config_text(mesh_config(tp, 1, "dp_shard", ""));
    EXPECT_THAT(all(*h.get<Sampler>("s")), ElementsAreArray(odd)) << "tp " << tp;
  }
  // With shuffle and skip it equals the plain resumable sampler at (rank, replicas) = (1, 2).
  h.set_config_text(mesh_config(3, 1, "dp_shard", ", shuffle = true, seed = 42, skip_num_global_samples = 4"));
  const auto multi = all(*h.get<Sampler>("s"));
  EXPECT_EQ(multi, all(*resumable(32, 1, 2, "shuffle = true, seed = 42, skip_num_global_samples = 4")));
}

TEST_F(SamplersTest, MultiDimSamplerValidatorsNameTheConfigPath) {
  h.set_config_text(mesh_config(0, 0, "dp_replicate", ""));
  EXPECT_THAT(
      h.build_error(),
      HasSubstr("s.config.data_parallel_key: the device mesh has no dimension 'dp_replicate' (it has: dp_shard, tp)"));
  h.set_config_text(mesh_config(0, 0, "dp", ""));
  EXPECT_THAT(h.build_error(), HasSubstr("s.config.data_parallel_key: must be one of 'pp', 'dp_replicate', 'dp_shard', "
                                         "'cp', 'tp', 'ep', got 'dp'"));
  h.set_config_text(mesh_config(0, 0, "dp_shard", ", skip_num_global_samples = 33"));
  EXPECT_THAT(h.build_error(), HasSubstr("s.config.skip_num_global_samples: cannot skip 33"));
  h.set_config_text(mesh_config(0, 0, "dp_shard", ""));
  h.set("s.config.device_mesh", Value(3));
  EXPECT_THAT(h.build_error(), HasSubstr("s.config.device_mesh: expected a DeviceMesh"));
}

// --- example config: sequential and batch samplers -------------------------------------

class ExampleTest : public ::testing::Test {
 protected:
  void SetUp() override { h.load_plugin(MODALITIES_TEST_DATASETS_PLUGIN); }
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
};

TEST_F(ExampleTest, BuildsAndGroupsIndicesIntoBatches) {
  auto train = h.get<Sampler>("train_sampler");
  ASSERT_NE(train, nullptr);
  EXPECT_EQ(train->size(), 645);
  auto batches = h.get<BatchSampler>("train_batch_sampler");
  ASSERT_NE(batches, nullptr);
  EXPECT_EQ(batches->size(), 161);  // 645 div 4, incomplete last batch dropped
  EXPECT_THAT(batches->batch_at(0), ElementsAre(218, 942, 861, 999));
  for (std::int64_t b : {0, 1, 160})
    for (std::int64_t i = 0; i < 4; ++i) EXPECT_EQ(batches->batch_at(b)[i], train->index_at(4 * b + i));
  EXPECT_THROW(batches->batch_at(161), Error);
  auto seq = h.get<Sampler>("eval_sampler");
  EXPECT_EQ(seq->size(), 1300);
  EXPECT_EQ(seq->index_at(1299), 1299);
  EXPECT_THAT(std::vector<std::int64_t>{h.get<Sampler>("distributed_sampler")->index_at(0)}, ElementsAre(429));

  h.set("train_batch_sampler.config.drop_last", Value(false));
  EXPECT_EQ(h.get<BatchSampler>("train_batch_sampler")->size(), 162);
  EXPECT_EQ(h.get<BatchSampler>("train_batch_sampler")->batch_at(161).size(), 1u);
}

TEST_F(ExampleTest, BatchSamplerValidatorsNameTheConfigPath) {
  h.set("train_batch_sampler.config.batch_size", Value(0));
  EXPECT_THAT(h.build_error(), HasSubstr("train_batch_sampler.config.batch_size: must be > 0, got 0"));
  h.set("train_batch_sampler.config.batch_size", Value(4));
  h.set("train_batch_sampler.config.sampler",
        Value(Value::Table{{"instance_key", Value("train_dataset")}, {"pass_type", Value("BY_REFERENCE")}}));
  EXPECT_THAT(h.build_error(), HasSubstr("train_batch_sampler.config.sampler: expected a Sampler"));
  h.set("train_batch_sampler.config.sampler",
        Value(Value::Table{{"instance_key", Value("train_sampler")}, {"pass_type", Value("BY_REFERENCE")}}));
  h.erase("eval_sampler.config.data_source");
  EXPECT_THAT(h.build_error(), HasSubstr("eval_sampler.config.data_source: missing required key"));
}

}  // namespace
}  // namespace modalities::plugins::samplers
