// device_mesh/default: Modalities' degree validation and inference in one process, and the
// coordinates and process groups of real meshes with 4 Gloo ranks. The multi-rank cases run this
// binary again as 4 ranks (`modalities launch --exec`), each running one MeshWorker case, which
// exists only in those processes (tests/cli/worker_case.h).
#include "run_command.h"
#include "worker_case.h"

#include <modalities/sdk/distributed.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

namespace modalities::plugins::device_mesh {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using modalities::testing::CommandResult;
using modalities::testing::Harness;
using modalities::testing::run_command;

std::string mesh_config(const std::string& fields) {
  return "[device_mesh]\ncomponent_key = \"device_mesh\"\nvariant_key = \"default\"\nconfig = { device_type = \"cpu\", " +
         fields + " }\n";
}

std::string build_error(const std::string& fields) {
  Harness h(MODALITIES_TEST_PLUGIN);
  h.set_config_text(mesh_config(fields));
  return h.build_error();
}

TEST(DeviceMeshTest, OneProcessHasDpShardOfSizeOneAndNoGroups) {
  Harness h(MODALITIES_TEST_PLUGIN);
  h.set_config_text(mesh_config("data_parallel_shard_degree = -1, world_size = 1"));
  const auto mesh = h.get<DeviceMesh>("device_mesh");
  ASSERT_NE(mesh, nullptr);
  EXPECT_THAT(mesh->dim_names(), ElementsAre("dp_shard"));
  EXPECT_EQ(mesh->size(), 1);
  EXPECT_EQ(mesh->size("dp_shard"), 1);
  EXPECT_EQ(mesh->coordinate("dp_shard"), 0);
  EXPECT_EQ(mesh->rank(), 0);
  EXPECT_EQ(mesh->device_type(), "cpu");
  EXPECT_FALSE(mesh->has_dim("tp"));
  EXPECT_THAT([&] { (void)mesh->process_group("dp_shard"); }, ::testing::ThrowsMessage<Error>(HasSubstr("single-process")));
  EXPECT_THAT([&] { (void)mesh->size("tp"); }, ::testing::ThrowsMessage<Error>(HasSubstr("no dim 'tp'")));
}

TEST(DeviceMeshTest, DegreesFollowModalitiesValidation) {
  EXPECT_THAT(build_error("data_parallel_shard_degree = -1, data_parallel_replicate_degree = -1, world_size = 1"),
              HasSubstr("at most one of the two data-parallel degrees may be -1"));
  EXPECT_THAT(build_error("data_parallel_shard_degree = 2, world_size = 1"),
              HasSubstr("the degrees multiply to 2 (pp 1 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 1), but world_size is 1"));
  EXPECT_THAT(build_error("data_parallel_shard_degree = -1, tensor_parallel_degree = 3, world_size = 4"),
              HasSubstr("world_size 4 is not divisible by the product 3"));
  EXPECT_THAT(build_error("data_parallel_shard_degree = 0, world_size = 1"),
              HasSubstr("device_mesh.config.data_parallel_shard_degree"));
  EXPECT_THAT(build_error("data_parallel_shard_degree = 1, enable_loss_parallel = true, world_size = 1"),
              HasSubstr("needs tensor_parallel_degree > 1"));
  EXPECT_THAT(build_error("world_size = 1"), HasSubstr("data_parallel_shard_degree"));
  Harness h(MODALITIES_TEST_PLUGIN);
  h.set_config_text("[device_mesh]\ncomponent_key = \"device_mesh\"\nvariant_key = \"default\"\n"
                    "config = { device_type = \"tpu\", data_parallel_shard_degree = 1, world_size = 1 }\n");
  EXPECT_THAT(h.build_error(), HasSubstr("device_mesh.config.device_type"));
}

TEST(DeviceMeshTest, AWorldSizeThatIsNotTheRunsIsRefusedWithAHint) {
  const std::string error = build_error("data_parallel_shard_degree = -1, world_size = 4");
  EXPECT_THAT(error, HasSubstr("device_mesh.config.world_size"));
  EXPECT_THAT(error, HasSubstr("is 4, but this run has 1 process(es)"));
  EXPECT_THAT(error, HasSubstr("modalities launch"));
}

// --- 4 ranks ----------------------------------------------------------------------------------

void launch_workers(int ranks, const std::string& worker) {
  testing::expect_workers_pass(testing::run_workers(MODALITIES_TEST_HOST_BINARY, ranks, "MeshWorker." + worker, {}, 120),
                               ranks);
}

double allreduce_sum(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, double value) {
  std::vector<at::Tensor> t = {at::full({1}, value, at::kDouble)};
  pg->allreduce(t)->wait();
  return t[0].item<double>();
}

// The process group of a worker case's ranks, for the case's duration.
struct WorkerRuntime {
  WorkerRuntime() {
    dist::RuntimeOptions o;
    o.backend = "gloo";
    o.timeout = std::chrono::seconds(30);
    dist::init(dist::launch_env(), o);
  }
  ~WorkerRuntime() { dist::shutdown(); }
};

MODALITIES_WORKER_CASE(MeshWorker, TwoReplicasOfTwoShards) {
  const WorkerRuntime runtime;
  Harness h(MODALITIES_TEST_PLUGIN);
  h.set_config_text(mesh_config("data_parallel_replicate_degree = 2, data_parallel_shard_degree = -1, world_size = 4"));
  const auto mesh = h.get<DeviceMesh>("device_mesh");
  ASSERT_NE(mesh, nullptr) << h.build_error();
  const int r = dist::rank();
  EXPECT_THAT(mesh->dim_names(), ElementsAre("dp_replicate", "dp_shard"));
  EXPECT_EQ(mesh->size("dp_replicate"), 2);
  EXPECT_EQ(mesh->size("dp_shard"), 2);
  EXPECT_EQ(mesh->coordinate("dp_replicate"), r / 2);
  EXPECT_EQ(mesh->coordinate("dp_shard"), r % 2);
  EXPECT_EQ(mesh->rank(), r);
  // Each group holds exactly the ranks that differ only along its dims: sums of global ranks.
  EXPECT_EQ(allreduce_sum(mesh->process_group("dp_shard"), r), 2 * (r / 2) * 2 + 1);  // {2a, 2a+1}
  EXPECT_EQ(allreduce_sum(mesh->process_group("dp_replicate"), r), 2 * (r % 2) + 2);   // {s, s+2}
  EXPECT_EQ(allreduce_sum(mesh->flattened_process_group(), r), 0 + 1 + 2 + 3);
  const auto dp = mesh->sub_mesh({"dp_replicate", "dp_shard"});
  EXPECT_EQ(dp->size(), 4);
  EXPECT_EQ(allreduce_sum(dp->flattened_process_group(), 1), 4);
  const auto shard = mesh->sub_mesh({"dp_shard"});
  EXPECT_EQ(shard->rank(), r % 2);
  EXPECT_EQ(shard->size(), 2);
  EXPECT_EQ(allreduce_sum(shard->flattened_process_group(), 1), 2);
  EXPECT_THAT([&] { (void)mesh->sub_mesh({"dp_shard", "dp_replicate"}); },
              ::testing::ThrowsMessage<Error>(HasSubstr("in mesh order")));
}

MODALITIES_WORKER_CASE(MeshWorker, PipelineAndTensorDimsWithAnInferredShardDegree) {
  const WorkerRuntime runtime;
  Harness h(MODALITIES_TEST_PLUGIN);
  h.set_config_text(mesh_config(
      "pipeline_parallel_degree = 2, tensor_parallel_degree = 2, data_parallel_shard_degree = -1, world_size = 4"));
  const auto mesh = h.get<DeviceMesh>("device_mesh");
  ASSERT_NE(mesh, nullptr) << h.build_error();
  const int r = dist::rank();
  // pp x dp_shard(1) x tp, row-major: rank = pp * 2 + tp.
  EXPECT_THAT(mesh->dim_names(), ElementsAre("pp", "dp_shard", "tp"));
  EXPECT_EQ(mesh->size("dp_shard"), 1);
  EXPECT_EQ(mesh->coordinate("pp"), r / 2);
  EXPECT_EQ(mesh->coordinate("tp"), r % 2);
  EXPECT_EQ(allreduce_sum(mesh->process_group("tp"), r), 2 * (r / 2) * 2 + 1);
  EXPECT_EQ(allreduce_sum(mesh->process_group("pp"), r), 2 * (r % 2) + 2);
  EXPECT_EQ(allreduce_sum(mesh->process_group("dp_shard"), r), r);  // a group of one
  // pp and tp are not adjacent: their per-dim groups exist, a flattened one does not.
  EXPECT_THAT([&] { (void)mesh->sub_mesh({"pp", "tp"})->flattened_process_group(); },
              ::testing::ThrowsMessage<Error>(HasSubstr("adjacent mesh dims only")));
  EXPECT_EQ(allreduce_sum(mesh->sub_mesh({"dp_shard", "tp"})->flattened_process_group(), 1), 2);
}

TEST(DeviceMeshTest, FourGlooRanksAsTwoReplicasOfTwoShards) { launch_workers(4, "TwoReplicasOfTwoShards"); }
TEST(DeviceMeshTest, FourGlooRanksAsTwoPipelineStagesOfTwoTensorRanks) {
  launch_workers(4, "PipelineAndTensorDimsWithAnInferredShardDegree");
}

}  // namespace
}  // namespace modalities::plugins::device_mesh
