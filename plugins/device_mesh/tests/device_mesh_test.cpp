// device_mesh/default: Modalities' degree validation and inference in one process, and the
// coordinates and process groups of real meshes with 4 Gloo ranks. The multi-rank cases run this
// binary again as 4 ranks (`modalities launch --exec`), each running one MeshWorker case, which
// exists only in those processes (tests/cli/worker_case.h).
#include "run_command.h"
#include "worker_case.h"

#include <modalities/sdk/distributed.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/tensor_parallel.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace modalities::plugins::device_mesh {
namespace {

using modalities::testing::CommandResult;
using modalities::testing::Harness;
using modalities::testing::run_command;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string mesh_config(const std::string& fields) {
  return "[device_mesh]\ncomponent_key = \"device_mesh\"\nvariant_key = \"default\"\nconfig = { device_type = "
         "\"cpu\", " +
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
  EXPECT_THAT(mesh->dims(), ElementsAre(MeshDim::dp_shard));
  EXPECT_EQ(mesh->size(), 1);
  EXPECT_EQ(mesh->size(MeshDim::dp_shard), 1);
  EXPECT_EQ(mesh->coordinate(MeshDim::dp_shard), 0);
  EXPECT_EQ(mesh->rank(), 0);
  EXPECT_EQ(mesh->device_type(), "cpu");
  EXPECT_FALSE(mesh->has_dim(MeshDim::tp));
  EXPECT_THAT([&] { (void)mesh->process_group(MeshDim::dp_shard); },
              ::testing::ThrowsMessage<Error>(HasSubstr("single-process")));
  EXPECT_THAT([&] { (void)mesh->size(MeshDim::tp); }, ::testing::ThrowsMessage<Error>(HasSubstr("no dim 'tp'")));
}

// The mesh-dim codec is Modalities' spelling, both ways.
TEST(ParallelDimsTest, MeshDimNamesRoundTrip) {
  for (const MeshDim d : kMeshDims) EXPECT_EQ(parse_mesh_dim(mesh_dim_name(d)), d);
  EXPECT_THAT(mesh_dim_names(), ElementsAre("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"));
  EXPECT_EQ(parse_mesh_dim("dp"), std::nullopt);
  EXPECT_EQ(parse_mesh_dim("TP"), std::nullopt);
  EXPECT_EQ(join_mesh_dims({MeshDim::dp_shard, MeshDim::tp}), "dp_shard, tp");
  EXPECT_EQ(join_mesh_dims({}), "(none)");
}

// Without a mesh every rank is data parallel; in one process everything has degree 1.
TEST(ParallelDimsTest, WithoutAMeshEveryRankIsDataParallel) {
  const ParallelDims one;
  EXPECT_EQ(one.world_size(), 1);
  EXPECT_EQ(one.dp_size(), 1);
  EXPECT_EQ(one.dp_rank(), 0);
  EXPECT_TRUE(one.counts_data());
  EXPECT_THAT(one.dims(), ElementsAre(MeshDim::dp_shard));
  EXPECT_EQ(one.group(MeshDim::dp_shard), nullptr);
  EXPECT_FALSE(one.loss_parallel());
  const ParallelDims eight(8);
  EXPECT_EQ(eight.dp_size(), 8);
  EXPECT_EQ(eight.degree(MeshDim::dp_shard), 8);
  EXPECT_EQ(eight.degree(MeshDim::tp), 1);
  EXPECT_EQ(eight.tokens_per_step(4, 256, 2), 4 * 256 * 2 * 8);
  EXPECT_EQ(ParallelDims::of(nullptr, 3).dp_size(), 3);
  EXPECT_THROW(ParallelDims(0), Error);
  EXPECT_THROW(ParallelDims(std::shared_ptr<const DeviceMesh>()), Error);
  // A one-process mesh is the same layout.
  Harness h(MODALITIES_TEST_PLUGIN);
  h.set_config_text(mesh_config("data_parallel_shard_degree = -1, world_size = 1"));
  const ParallelDims dims(h.get<DeviceMesh>("device_mesh"));
  EXPECT_EQ(dims.dp_size(), 1);
  EXPECT_EQ(dims.describe(), "dp_shard 1");
  EXPECT_THAT([&] { (void)tp::Plan::from(dims, {}); },
              ::testing::ThrowsMessage<Error>(HasSubstr("needs a device mesh with a tp dim")));
}

// tokens_per_step is the one place the product is formed: factors below 1 and overflow are errors.
TEST(ParallelDimsTest, TokensPerStepRefusesWhatItCannotCount) {
  EXPECT_EQ(tokens_per_step(2, 1024, 4, 8), 2 * 1024 * 4 * 8);
  EXPECT_THAT([] { (void)tokens_per_step(2, 0, 4, 8); },
              ::testing::ThrowsMessage<Error>(HasSubstr("sequence_length must be at least 1, got 0")));
  EXPECT_THAT([] { (void)tokens_per_step(std::int64_t{1} << 40, std::int64_t{1} << 30, 1, 1); },
              ::testing::ThrowsMessage<Error>(HasSubstr("overflows 64 bits")));
}

TEST(DeviceMeshTest, DegreesFollowModalitiesValidation) {
  EXPECT_THAT(build_error("data_parallel_shard_degree = -1, data_parallel_replicate_degree = -1, world_size = 1"),
              HasSubstr("at most one of the two data-parallel degrees may be -1"));
  EXPECT_THAT(
      build_error("data_parallel_shard_degree = 2, world_size = 1"),
      HasSubstr("the degrees multiply to 2 (pp 1 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 1), but world_size is 1"));
  EXPECT_THAT(build_error("data_parallel_shard_degree = -1, tensor_parallel_degree = 3, world_size = 4"),
              HasSubstr("world_size 4 is not divisible by the product 3"));
  EXPECT_THAT(build_error("data_parallel_shard_degree = 0, world_size = 1"),
              HasSubstr("device_mesh.config.data_parallel_shard_degree"));
  EXPECT_THAT(build_error("data_parallel_shard_degree = 1, enable_loss_parallel = true, world_size = 1"),
              HasSubstr("needs tensor_parallel_degree > 1"));
  EXPECT_THAT(build_error("world_size = 1"), HasSubstr("data_parallel_shard_degree"));
  Harness h(MODALITIES_TEST_PLUGIN);
  h.set_config_text(
      "[device_mesh]\ncomponent_key = \"device_mesh\"\nvariant_key = \"default\"\n"
      "config = { device_type = \"tpu\", data_parallel_shard_degree = 1, world_size = 1 }\n");
  EXPECT_THAT(h.build_error(), HasSubstr("device_mesh.config.device_type"));
}

// expert_parallel_degree is carved out of dp_shard x cp: it must divide them, and adds no factor.
TEST(DeviceMeshTest, AnExpertParallelDegreeMustDivideTheShardRanks) {
  const std::string error = build_error("data_parallel_shard_degree = -1, expert_parallel_degree = 2, world_size = 1");
  EXPECT_THAT(error, HasSubstr("device_mesh.config.expert_parallel_degree"));
  EXPECT_THAT(error, HasSubstr("is 2, which does not divide the data_parallel_shard_degree 1 x context_parallel_degree "
                               "1 = 1"));
  EXPECT_THAT(build_error("data_parallel_shard_degree = -1, expert_parallel_degree = 0, world_size = 1"),
              HasSubstr("device_mesh.config.expert_parallel_degree"));
  // Degree 1 is no ep dim.
  Harness h(MODALITIES_TEST_PLUGIN);
  h.set_config_text(mesh_config("data_parallel_shard_degree = -1, expert_parallel_degree = 1, world_size = 1"));
  const auto mesh = h.get<DeviceMesh>("device_mesh");
  ASSERT_NE(mesh, nullptr) << h.build_error();
  EXPECT_FALSE(mesh->has_dim(MeshDim::ep));
  EXPECT_EQ(mesh->expert_shard_process_group(), nullptr);
  EXPECT_THAT([&] { (void)mesh->size(MeshDim::ep); }, ::testing::ThrowsMessage<Error>(HasSubstr("no dim 'ep'")));
  const ParallelDims dims(mesh);
  EXPECT_EQ(dims.degree(MeshDim::ep), 1);
  EXPECT_EQ(dims.expert_shard_degree(), 1);
  EXPECT_EQ(dims.expert_shard_group(), nullptr);
}

TEST(DeviceMeshTest, AWorldSizeThatIsNotTheRunsIsRefusedWithAHint) {
  const std::string error = build_error("data_parallel_shard_degree = -1, world_size = 4");
  EXPECT_THAT(error, HasSubstr("device_mesh.config.world_size"));
  EXPECT_THAT(error, HasSubstr("is 4, but this run has 1 process(es)"));
  EXPECT_THAT(error, HasSubstr("modalities launch"));
}

// --- 4 ranks ----------------------------------------------------------------------------------

void launch_workers(int ranks, const std::string& worker) {
  testing::expect_workers_pass(
      testing::run_workers(MODALITIES_TEST_HOST_BINARY, ranks, "MeshWorker." + worker, {}, 120), ranks);
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
  EXPECT_THAT(mesh->dims(), ElementsAre(MeshDim::dp_replicate, MeshDim::dp_shard));
  EXPECT_EQ(mesh->size(MeshDim::dp_replicate), 2);
  EXPECT_EQ(mesh->size(MeshDim::dp_shard), 2);
  EXPECT_EQ(mesh->coordinate(MeshDim::dp_replicate), r / 2);
  EXPECT_EQ(mesh->coordinate(MeshDim::dp_shard), r % 2);
  EXPECT_EQ(mesh->rank(), r);
  // Each group holds exactly the ranks that differ only along its dims: sums of global ranks.
  EXPECT_EQ(allreduce_sum(mesh->process_group(MeshDim::dp_shard), r), 2 * (r / 2) * 2 + 1);  // {2a, 2a+1}
  EXPECT_EQ(allreduce_sum(mesh->process_group(MeshDim::dp_replicate), r), 2 * (r % 2) + 2);  // {s, s+2}
  EXPECT_EQ(allreduce_sum(mesh->flattened_process_group(), r), 0 + 1 + 2 + 3);
  const auto dp = mesh->sub_mesh({MeshDim::dp_replicate, MeshDim::dp_shard});
  EXPECT_EQ(dp->size(), 4);
  EXPECT_EQ(allreduce_sum(dp->flattened_process_group(), 1), 4);
  const auto shard = mesh->sub_mesh({MeshDim::dp_shard});
  EXPECT_EQ(shard->rank(), r % 2);
  EXPECT_EQ(shard->size(), 2);
  EXPECT_EQ(allreduce_sum(shard->flattened_process_group(), 1), 2);
  EXPECT_THAT(
      [&] {
        (void)mesh->sub_mesh({MeshDim::dp_shard, MeshDim::dp_replicate});
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("in mesh order")));
  // The typed view: both dims shard data; every rank counts its own batch.
  const ParallelDims dims(mesh);
  EXPECT_EQ(dims.dp_size(), 4);
  EXPECT_EQ(dims.dp_rank(), r);
  EXPECT_TRUE(dims.counts_data());
  EXPECT_FALSE(dims.enabled(MeshDim::tp));
  EXPECT_EQ(dims.group(MeshDim::tp), nullptr);
  EXPECT_EQ(allreduce_sum(dims.group(MeshDim::dp_shard), r), 2 * (r / 2) * 2 + 1);
  EXPECT_EQ(dims.tokens_per_step(2, 16, 3), 2 * 16 * 3 * 4);
  EXPECT_EQ(dims.describe(), "dp_replicate 2 x dp_shard 2");
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
  EXPECT_THAT(mesh->dims(), ElementsAre(MeshDim::pp, MeshDim::dp_shard, MeshDim::tp));
  EXPECT_EQ(mesh->size(MeshDim::dp_shard), 1);
  EXPECT_EQ(mesh->coordinate(MeshDim::pp), r / 2);
  EXPECT_EQ(mesh->coordinate(MeshDim::tp), r % 2);
  EXPECT_EQ(allreduce_sum(mesh->process_group(MeshDim::tp), r), 2 * (r / 2) * 2 + 1);
  EXPECT_EQ(allreduce_sum(mesh->process_group(MeshDim::pp), r), 2 * (r % 2) + 2);
  EXPECT_EQ(allreduce_sum(mesh->process_group(MeshDim::dp_shard), r), r);  // a group of one
  // pp and tp are not adjacent: their per-dim groups exist, a flattened one does not.
  EXPECT_THAT(
      [&] {
        (void)mesh->sub_mesh({MeshDim::pp, MeshDim::tp})->flattened_process_group();
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("adjacent mesh dims only")));
  EXPECT_EQ(allreduce_sum(mesh->sub_mesh({MeshDim::dp_shard, MeshDim::tp})->flattened_process_group(), 1), 2);
  // The typed view: no dim shards data (dp_shard has degree 1), so one data-parallel rank, counted
  // by rank 0 alone; the degree-1 dim has no group to talk to.
  const ParallelDims dims(mesh);
  EXPECT_EQ(dims.dp_size(), 1);
  EXPECT_EQ(dims.dp_rank(), 0);
  EXPECT_EQ(dims.counts_data(), r == 0);
  EXPECT_EQ(dims.degree(MeshDim::cp), 1);
  EXPECT_EQ(dims.coordinate(MeshDim::cp), 0);
  EXPECT_EQ(dims.group(MeshDim::dp_shard), nullptr);
  EXPECT_EQ(allreduce_sum(dims.group(MeshDim::tp), r), 2 * (r / 2) * 2 + 1);
  const tp::Plan plan = tp::Plan::from(dims, tp::Options{false});
  EXPECT_EQ(plan.rank, r % 2);
  EXPECT_EQ(plan.size, 2);
  EXPECT_FALSE(plan.sequence_parallel);
  EXPECT_EQ(dims.describe(), "pp 2 x dp_shard 1 x tp 2");
}

// 4 ranks as dp_shard 4 with an ep dim of 2 carved out of it: ep groups {0, 1}, {2, 3} (consecutive
// shard coordinates) and the ranks holding the same experts {0, 2}, {1, 3}; the world is still 4
// data-parallel ranks, each counting its own batch.
MODALITIES_WORKER_CASE(MeshWorker, ExpertParallelOverTheShardRanks) {
  const WorkerRuntime runtime;
  Harness h(MODALITIES_TEST_PLUGIN);
  h.set_config_text(mesh_config("data_parallel_shard_degree = -1, expert_parallel_degree = 2, world_size = 4"));
  const auto mesh = h.get<DeviceMesh>("device_mesh");
  ASSERT_NE(mesh, nullptr) << h.build_error();
  const int r = dist::rank();
  EXPECT_THAT(mesh->dims(), ElementsAre(MeshDim::dp_shard));
  EXPECT_EQ(mesh->size(), 4);
  EXPECT_TRUE(mesh->has_dim(MeshDim::ep));
  EXPECT_EQ(mesh->size(MeshDim::ep), 2);
  EXPECT_EQ(mesh->coordinate(MeshDim::ep), r % 2);
  EXPECT_EQ(allreduce_sum(mesh->process_group(MeshDim::ep), r), 2 * (r / 2) * 2 + 1);  // {2a, 2a+1}
  EXPECT_EQ(allreduce_sum(mesh->expert_shard_process_group(), r), 2 * (r % 2) + 2);    // {e, e+2}
  EXPECT_EQ(allreduce_sum(mesh->process_group(MeshDim::dp_shard), r), 0 + 1 + 2 + 3);
  const ParallelDims dims(mesh);
  EXPECT_EQ(dims.world_size(), 4);
  EXPECT_EQ(dims.dp_size(), 4);
  EXPECT_EQ(dims.dp_rank(), r);
  EXPECT_TRUE(dims.counts_data());
  EXPECT_EQ(dims.degree(MeshDim::ep), 2);
  EXPECT_EQ(dims.coordinate(MeshDim::ep), r % 2);
  EXPECT_EQ(dims.expert_shard_degree(), 2);
  EXPECT_EQ(allreduce_sum(dims.expert_shard_group(), 1), 2);
  EXPECT_EQ(dims.describe(), "dp_shard 4 (ep 2)");
}

// A second architecture in tensor parallelism, without a variant of its own: a two-layer MLP of
// a few lines implements Module::apply_tensor_parallel (Megatron's column- then row-parallel pair
// on the SDK's tp::Plan) and takes part through model/gpt2_tp exactly as model/gpt2 does. Its
// outputs and gradients on 2 tp ranks are those of one process.
class TinyMlp : public Module {
 public:
  TinyMlp() {
    at::manual_seed(7);
    up_ = net_.register_parameter("up", at::randn({8, 4}));
    down_ = net_.register_parameter("down", at::randn({4, 8}));
  }
  TensorMap forward(const TensorMap& inputs) override {
    const at::Tensor& x = inputs.at("x");  // [N, 4], whole on every rank
    if (!plan_) return {{"y", at::matmul(at::tanh(at::matmul(x, up_.t())), down_.t())}};
    const std::int64_t n = x.size(0);
    const tp::Plan& p = *plan_;
    const at::Tensor mine = p.sequence_parallel ? tp::split_to_tensor_parallel(x, 0, p.group) : x;
    const at::Tensor y = p.leave(at::matmul(at::tanh(at::matmul(p.enter(mine, 1, n), up_.t())), down_.t()), 1, n);
    return {{"y", p.sequence_parallel ? tp::gather_from_tensor_parallel(y, 0, p.group) : y}};
  }
  torch::nn::Module& module() override { return net_; }
  const torch::nn::Module& module() const override { return net_; }
  void apply_tensor_parallel(const ParallelDims& dims, const tp::Options& options) override {
    plan_ = tp::Plan::from(dims, options);
    const at::NoGradGuard no_grad;
    up_.set_data(up_.chunk(plan_->size, 0)[plan_->rank].clone());      // column parallel: rows
    down_.set_data(down_.chunk(plan_->size, 1)[plan_->rank].clone());  // row parallel: columns
  }

 private:
  torch::nn::Module net_{"TinyMlp"};
  at::Tensor up_, down_;
  std::optional<tp::Plan> plan_;
};

// The same network without the capability (Module's default refuses).
class PlainMlp final : public Module {
 public:
  TensorMap forward(const TensorMap& inputs) override { return inputs; }
  torch::nn::Module& module() override { return net_; }
  const torch::nn::Module& module() const override { return net_; }

 private:
  torch::nn::Module net_{"PlainMlp"};
};

struct NoConfig {
  static void describe(Schema<NoConfig>&) {}
};

// A harness with the gpt2 plugin (model/gpt2_tp) and the two test models.
void add_test_models(Harness& h) {
  h.load_plugin(MODALITIES_TEST_GPT2_PLUGIN);
  const auto problem = h.registry().register_plugin({"tp_test_models", "0.0.0", {}, {}, {}}, [](Registrar& reg) {
    reg.add<Module, NoConfig>("tiny_mlp_test", "a two-layer MLP with tensor parallelism",
                              [](const NoConfig&) { return std::make_shared<TinyMlp>(); });
    reg.add<Module, NoConfig>("plain_mlp_test", "a module without tensor parallelism",
                              [](const NoConfig&) { return std::make_shared<PlainMlp>(); });
  });
  ASSERT_FALSE(problem.has_value()) << *problem;
}

// [raw] of `variant` and [split], model/gpt2_tp of it over [device_mesh].
std::string split_config(const std::string& variant, bool sequence_parallel) {
  return "[raw]\ncomponent_key = \"model\"\nvariant_key = \"" + variant +
         "\"\nconfig = {}\n[split]\ncomponent_key = \"model\"\nvariant_key = \"gpt2_tp\"\n[split.config]\n"
         "model = { instance_key = \"raw\", pass_type = \"BY_REFERENCE\" }\n"
         "device_mesh = { instance_key = \"device_mesh\", pass_type = \"BY_REFERENCE\" }\n"
         "sequence_parallel = " +
         std::string(sequence_parallel ? "true" : "false") + "\n";
}

const std::string kTp2Mesh = "tensor_parallel_degree = 2, data_parallel_shard_degree = 1, world_size = 2";

MODALITIES_WORKER_CASE(MeshWorker, AModelThatImplementsTheCapabilityIsSplitByGpt2Tp) {
  const WorkerRuntime runtime;
  const int r = dist::rank();
  const auto close = [](const at::Tensor& got, const at::Tensor& want) {
    return (got - want).abs().max().item<double>() <= 1e-5 * (1.0 + want.abs().max().item<double>());
  };
  for (const bool sequence_parallel : {false, true}) {
    const std::string what = sequence_parallel ? "sequence parallel" : "tensor parallel";
    Harness h(MODALITIES_TEST_PLUGIN);
    add_test_models(h);
    h.set_config_text(mesh_config(kTp2Mesh) + split_config("tiny_mlp_test", sequence_parallel));
    const auto split = h.get<Module>("split");
    ASSERT_NE(split, nullptr) << h.build_error();
    TinyMlp whole;  // the same initial weights, unsplit
    at::manual_seed(8);
    const at::Tensor x0 = at::randn({6, 4}), c = at::randn({6, 4});
    const at::Tensor x = x0.clone().requires_grad_(true), x_whole = x0.clone().requires_grad_(true);
    const at::Tensor y = split->forward({{"x", x}}).at("y");
    const at::Tensor y_whole = whole.forward({{"x", x_whole}}).at("y");
    (y * c).sum().backward();
    (y_whole * c).sum().backward();
    EXPECT_TRUE(close(y, y_whole)) << what << ": output";
    EXPECT_TRUE(close(x.grad(), x_whole.grad())) << what << ": input gradient";
    const NamedTensors local = split->named_parameters(), full = whole.named_parameters();
    ASSERT_EQ(local.size(), 2u);
    EXPECT_TRUE(close(local[0].second.grad(), full[0].second.grad().chunk(2, 0)[r])) << what << ": up gradient";
    EXPECT_TRUE(close(local[1].second.grad(), full[1].second.grad().chunk(2, 1)[r])) << what << ": down gradient";
  }
  // A model without the capability is refused by name, on the config path of its reference.
  Harness h(MODALITIES_TEST_PLUGIN);
  add_test_models(h);
  h.set_config_text(mesh_config(kTp2Mesh) + split_config("plain_mlp_test", true));
  EXPECT_THAT(h.build_error(), AllOf(HasSubstr("split.config.model"), HasSubstr("PlainMlp"),
                                     HasSubstr("does not support tensor parallelism")));
}

TEST(DeviceMeshTest, TwoGlooRanksSplitAnotherArchitectureThroughItsCapability) {
  launch_workers(2, "AModelThatImplementsTheCapabilityIsSplitByGpt2Tp");
}

// model/gpt2_cp (context parallelism) over [raw].
std::string cp_config(const std::string& variant) {
  return "[raw]\ncomponent_key = \"model\"\nvariant_key = \"" + variant +
         "\"\nconfig = {}\n[split]\ncomponent_key = \"model\"\nvariant_key = \"gpt2_cp\"\n[split.config]\n"
         "model = { instance_key = \"raw\", pass_type = \"BY_REFERENCE\" }\n"
         "device_mesh = { instance_key = \"device_mesh\", pass_type = \"BY_REFERENCE\" }\n";
}

// A model without context-parallel support is refused by name, on the config path of its reference.
MODALITIES_WORKER_CASE(MeshWorker, Gpt2CpRefusesAModelWithoutTheCapability) {
  const WorkerRuntime runtime;
  Harness h(MODALITIES_TEST_PLUGIN);
  add_test_models(h);
  h.set_config_text(mesh_config("context_parallel_degree = 2, data_parallel_shard_degree = 1, world_size = 2") +
                    cp_config("plain_mlp_test"));
  EXPECT_THAT(h.build_error(), AllOf(HasSubstr("split.config.model"), HasSubstr("PlainMlp"),
                                     HasSubstr("does not support context parallelism")));
}

TEST(DeviceMeshTest, Gpt2CpRefusesAModelWithoutContextParallelSupport) {
  launch_workers(2, "Gpt2CpRefusesAModelWithoutTheCapability");
}

TEST(DeviceMeshTest, Gpt2CpRefusesAMeshWithoutACpDim) {
  Harness h(MODALITIES_TEST_PLUGIN);
  add_test_models(h);
  h.set_config_text(mesh_config("data_parallel_shard_degree = -1, world_size = 1") + cp_config("plain_mlp_test"));
  EXPECT_THAT(h.build_error(), HasSubstr("split.config.device_mesh: has no cp dim (dims: dp_shard)"));
}

// gpt2_tp on a mesh without a tp dim says so, naming the config path.
TEST(DeviceMeshTest, Gpt2TpRefusesAMeshWithoutATpDim) {
  Harness h(MODALITIES_TEST_PLUGIN);
  add_test_models(h);
  h.set_config_text(mesh_config("data_parallel_shard_degree = -1, world_size = 1") +
                    split_config("tiny_mlp_test", false));
  EXPECT_THAT(h.build_error(), HasSubstr("split.config.device_mesh: has no tp dim (dims: dp_shard)"));
}

TEST(DeviceMeshTest, FourGlooRanksAsTwoReplicasOfTwoShards) { launch_workers(4, "TwoReplicasOfTwoShards"); }
TEST(DeviceMeshTest, FourGlooRanksWithAnExpertParallelDimOfTwo) {
  launch_workers(4, "ExpertParallelOverTheShardRanks");
}
TEST(DeviceMeshTest, FourGlooRanksAsTwoPipelineStagesOfTwoTensorRanks) {
  launch_workers(4, "PipelineAndTensorDimsWithAnInferredShardDegree");
}

}  // namespace
}  // namespace modalities::plugins::device_mesh
