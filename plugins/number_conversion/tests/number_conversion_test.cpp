// number_conversion: every variant built through the registry by id (from the
// plugin's example config and small inline configs), the values in README.md,
// and one negative test per validator with the config path in the message.
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/shared_fixtures.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

namespace modalities::plugins::number_conversion {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

const fs::path kExample = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml";
const fs::path kSample = fs::path(MODALITIES_TEST_SOURCE_ROOT) / "data" / "sample";

// A device mesh with fixed dimensions, registered in-process for parallel_degree.
class FixedMesh final : public DeviceMesh {
 public:
  std::vector<MeshDim> dims() const override { return {MeshDim::dp_replicate, MeshDim::dp_shard, MeshDim::tp}; }
  bool has_dim(MeshDim d) const override {
    return d == MeshDim::dp_replicate || d == MeshDim::dp_shard || d == MeshDim::tp;
  }
  std::int64_t size() const override { return 24; }
  std::int64_t size(MeshDim d) const override {
    return d == MeshDim::dp_replicate ? 2 : d == MeshDim::dp_shard ? 3 : 4;
  }
  std::int64_t coordinate(MeshDim) const override { return 0; }
  std::int64_t rank() const override { return 0; }
  std::string device_type() const override { return "cpu"; }
  std::shared_ptr<const DeviceMesh> sub_mesh(const std::vector<MeshDim>&) const override { return nullptr; }
  c10::intrusive_ptr<c10d::ProcessGroup> process_group(MeshDim) const override { return {}; }
  c10::intrusive_ptr<c10d::ProcessGroup> flattened_process_group() const override { return {}; }
  bool loss_parallel() const override { return false; }
};

struct EmptyConfig {
  static void describe(Schema<EmptyConfig>&) {}
};

std::int64_t build_one(const std::string& variant, const std::string& config_inline) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text("[x]\ncomponent_key = \"number_conversion\"\nvariant_key = \"" + variant +
                    "\"\nconfig = " + config_inline + "\n");
  return h.value("x").as_int();
}

std::string error_of(const std::string& variant, const std::string& config_inline) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text("[x]\ncomponent_key = \"number_conversion\"\nvariant_key = \"" + variant +
                    "\"\nconfig = " + config_inline + "\n");
  return h.build_error();
}

TEST(NumberConversionTest, BuildsEveryNodeOfTheExampleConfig) {
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  EXPECT_EQ(h.value("num_target_tokens").as_int(), 100 * 2 * 4 * 256 * 2);
  EXPECT_EQ(h.value("num_target_steps").as_int(), 409600 / 256 / 2 / 4 / 2);
  EXPECT_EQ(h.value("num_target_samples").as_int(), 1600);
  EXPECT_EQ(h.value("num_steps_from_samples").as_int(), 1600 / 2 / 4 / 2);
  EXPECT_EQ(h.value("local_batches_from_samples").as_int(), 200);
  EXPECT_EQ(h.value("local_batches_from_tokens").as_int(), 200);
  EXPECT_EQ(h.value("last_step").as_int(), 49);
  EXPECT_EQ(h.value("num_seen_steps").as_int(), 50);
  EXPECT_EQ(h.value("global_num_seen_tokens").as_int(), 204800);
  EXPECT_EQ(h.value("num_target_steps_from_checkpoint").as_int(), 100);
  EXPECT_EQ(h.value("global_num_target_tokens").as_int(), 409600);
}

TEST(NumberConversionTest, FloorDivisionMatchesPython) {
  EXPECT_EQ(build_one("num_samples_from_num_tokens", "{ num_tokens = 1000, sequence_length = 256 }"), 3);
  EXPECT_EQ(
      build_one("local_num_batches_from_num_tokens",
                "{ num_ranks = 3, global_num_tokens = 10000, sequence_length = 100, local_micro_batch_size = 7 }"),
      (10000 / 100) / 3 / 7);
  EXPECT_EQ(build_one("num_steps_from_num_tokens",
                      "{ dp_degree = 2, local_micro_batch_size = 3, global_num_tokens = 99999, sequence_length = 7, "
                      "gradient_accumulation_steps = 5 }"),
            (99999 / 7) / 2 / 3 / 5);
}

TEST(NumberConversionTest, NumStepsFromNumSamplesAcceptsTheNumRanksAlias) {
  // Modalities' schema calls it num_ranks; the function (and configs) say dp_degree.
  EXPECT_EQ(
      build_one(
          "num_steps_from_num_samples",
          "{ num_ranks = 2, local_micro_batch_size = 4, global_num_samples = 100, gradient_accumulation_steps = 3 }"),
      100 / 2 / 4 / 3);
  EXPECT_THAT(error_of("num_steps_from_num_samples",
                       "{ num_ranks = 2, dp_degree = 2, local_micro_batch_size = 4, global_num_samples = 100, "
                       "gradient_accumulation_steps = 3 }"),
              HasSubstr("both given"));
}

TEST(NumberConversionTest, NumTokensFromPackedDatasetMatchesTheFile) {
  // data/sample/train.pbin holds 233 300 tokens: S = 256 -> (233 300 - 1) div 256 = 911 samples.
  const std::string path = (kSample / "train.pbin").string();
  EXPECT_EQ(build_one("num_tokens_from_packed_mem_map_dataset_continuous",
                      "{ dataset_path = \"" + path +
                          "\", sequence_length = 256, dp_degree = 1, local_micro_batch_size = 1, "
                          "gradient_accumulation_steps = 1 }"),
            911 * 256);
  // 911 samples // (2 * 4 * 3) = 37 steps -> 37 * 24 * 256 tokens.
  EXPECT_EQ(build_one("num_tokens_from_packed_mem_map_dataset_continuous",
                      "{ dataset_path = \"" + path +
                          "\", sequence_length = 256, dp_degree = 2, local_micro_batch_size = 4, "
                          "gradient_accumulation_steps = 3 }"),
            37 * 24 * 256);
  // Without reuse_last_target: 233 300 div 256 = 911 samples as well.
  EXPECT_EQ(build_one("num_tokens_from_packed_mem_map_dataset_continuous",
                      "{ dataset_path = \"" + path +
                          "\", sequence_length = 256, dp_degree = 1, local_micro_batch_size = 1, "
                          "gradient_accumulation_steps = 1, reuse_last_target = false }"),
            911 * 256);
  // S = 50 shows the difference: (233 300 - 1) div 50 = 4 665 with reuse, 233 300 div 50 = 4 666 without.
  EXPECT_EQ(build_one("num_tokens_from_packed_mem_map_dataset_continuous",
                      "{ dataset_path = \"" + path +
                          "\", sequence_length = 50, dp_degree = 1, local_micro_batch_size = 1, "
                          "gradient_accumulation_steps = 1, reuse_last_target = false }"),
            4666 * 50);
  EXPECT_EQ(build_one("num_tokens_from_packed_mem_map_dataset_continuous",
                      "{ dataset_path = \"" + path +
                          "\", sequence_length = 50, dp_degree = 1, local_micro_batch_size = 1, "
                          "gradient_accumulation_steps = 1 }"),
            4665 * 50);
}

TEST(NumberConversionTest, NumTokensFromPackedDatasetRejectsMissingAndTooSmallFiles) {
  EXPECT_THAT(
      error_of("num_tokens_from_packed_mem_map_dataset_continuous",
               "{ dataset_path = \"/no/such.pbin\", sequence_length = 8, dp_degree = 1, local_micro_batch_size = 1, "
               "gradient_accumulation_steps = 1 }"),
      HasSubstr("x.config.dataset_path: file '/no/such.pbin' does not exist"));
  const std::string tiny = (testing::tiny_example_dir() / "tiny.pbin").string();  // 6 tokens
  EXPECT_THAT(error_of("num_tokens_from_packed_mem_map_dataset_continuous",
                       "{ dataset_path = \"" + tiny +
                           "\", sequence_length = 8, dp_degree = 1, local_micro_batch_size = 1, "
                           "gradient_accumulation_steps = 1 }"),
              HasSubstr("fewer than one block"));
}

TEST(NumberConversionTest, NumStepsFromRawIndexCountsDocuments) {
  const std::string idx = (kSample / "train.idx").string();  // 500 documents
  EXPECT_EQ(build_one("num_steps_from_raw_dataset_index",
                      "{ raw_index_path = \"" + idx +
                          "\", num_ranks = 2, local_micro_batch_size = 4, gradient_accumulation_steps = 3 }"),
            500 / 2 / 4 / 3);
  const std::string pbin = (kSample / "eval.pbin").string();
  EXPECT_THAT(error_of("num_steps_from_raw_dataset_index",
                       "{ raw_index_path = \"" + pbin +
                           "\", num_ranks = 2, local_micro_batch_size = 4, gradient_accumulation_steps = 3 }"),
              AllOf(HasSubstr("eval.pbin"), HasSubstr("corrupt or unsupported index pickle")));
}

TEST(NumberConversionTest, CheckpointPathsMustContainEachNumberExactlyOnce) {
  EXPECT_THAT(error_of("num_seen_steps_from_checkpoint_path", "{ checkpoint_path = \"/ckpt/no_numbers_here\" }"),
              HasSubstr("must contain 'seen_steps_<number>' exactly once, found it 0 time(s)"));
  EXPECT_THAT(error_of("last_step_from_checkpoint_path", "{ checkpoint_path = \"/a/seen_steps_5/b-seen_steps_6\" }"),
              HasSubstr("found it 2 time(s)"));
}

TEST(NumberConversionTest, TargetStepsRequireWholeStepsUnlikeModalities) {
  // 1000 seen tokens over 10 steps = 100 tokens per step; 1050 target tokens is not a whole number of steps.
  EXPECT_THAT(
      error_of("num_target_steps_from_checkpoint_path",
               "{ checkpoint_path = \"eid_x-seen_steps_10-seen_tokens_1000-target_steps_10-target_tokens_1050\" }"),
      HasSubstr("not a multiple of the tokens per step (100)"));
  EXPECT_EQ(
      build_one("num_target_steps_from_checkpoint_path",
                "{ checkpoint_path = \"eid_x-seen_steps_10-seen_tokens_1000-target_steps_20-target_tokens_2000\" }"),
      20);
}

TEST(NumberConversionTest, ValidatorsNameTheConfigPath) {
  EXPECT_THAT(error_of("num_samples_from_num_tokens", "{ num_tokens = 10, sequence_length = 0 }"),
              HasSubstr("x.config.sequence_length: must be > 0, got 0"));
  EXPECT_THAT(error_of("num_samples_from_num_tokens", "{ num_tokens = -1, sequence_length = 4 }"),
              HasSubstr("x.config.num_tokens: must be >= 0, got -1"));
  EXPECT_THAT(error_of("num_samples_from_num_tokens", "{ num_tokens = 10.0, sequence_length = 4 }"),
              HasSubstr("x.config.num_tokens: expected an integer, got float"));
  EXPECT_THAT(
      error_of("num_tokens_from_num_steps",
               "{ num_steps = 9223372036854775807, dp_degree = 2, local_micro_batch_size = 1, sequence_length = 1, "
               "gradient_accumulation_steps = 1 }"),
      HasSubstr("overflows"));
}

TEST(NumberConversionTest, ParallelDegreeMultipliesPresentDimensions) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  auto failure = h.registry().register_plugin(core::PluginInfo{"fixed_mesh", "1.0", {}, {}, {}}, [](Registrar& r) {
    r.add<DeviceMesh, EmptyConfig>("fixed", "Test mesh dp_replicate=2, dp_shard=3, tp=4.",
                                   [](const EmptyConfig&) { return std::make_shared<FixedMesh>(); });
  });
  ASSERT_FALSE(failure) << *failure;
  h.set_config_text(R"(
[mesh]
component_key = "device_mesh"
variant_key = "fixed"
config = {}
[dp]
component_key = "number_conversion"
variant_key = "parallel_degree"
config = { device_mesh = { instance_key = "mesh", pass_type = "BY_REFERENCE" }, parallelism_methods = ["dp_shard", "dp_replicate"] }
[with_absent]
component_key = "number_conversion"
variant_key = "parallel_degree"
config = { device_mesh = { instance_key = "mesh", pass_type = "BY_REFERENCE" }, parallelism_methods = ["tp", "pp", "cp"] }
)");
  EXPECT_EQ(h.value("dp").as_int(), 6);
  EXPECT_EQ(h.value("with_absent").as_int(), 4);
  h.set("dp.config.parallelism_methods", Value(Value::List{Value("dp_shardd")}));
  EXPECT_THAT(h.build_error(), HasSubstr("dp.config.parallelism_methods[0]: must be one of"));
  EXPECT_THAT(h.build_error(), HasSubstr("did you mean 'dp_shard'?"));
}

}  // namespace
}  // namespace modalities::plugins::number_conversion
