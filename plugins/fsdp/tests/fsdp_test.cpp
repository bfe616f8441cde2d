// model/fsdp2_wrapped against the same GPT-2 unwrapped in one process. Every rank builds the
// sharded model and an unwrapped reference from the same seed, runs the reference on the whole
// global batch and the sharded model on its own slice, and compares: the mean of the ranks' losses
// with the reference loss, and each rank's gradient shard with the rows of the reference gradient
// it owns; then one SGD step on both and the same comparison again (the next gather must see the
// updated shards). Tolerances: 1e-6 relative + 1e-7 absolute on fp32 values that are sums over the
// same terms in a different order.
//
// The multi-rank cases run this binary again as N ranks (`modalities launch --exec`), each running
// one FsdpWorker case (registered only in those processes, tests/cli/worker_case.h) with its layout
// in MODALITIES_TEST_LAYOUT.
#include "run_command.h"
#include "worker_case.h"

#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/gradient_clipper.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/optimizer.h>
#include <modalities/sdk/module_hooks.h>
#include <modalities/sdk/registrar.h>
#include <modalities/sdk/schema.h>
#include <modalities/testing/harness.h>
#include <torch/torch.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace modalities::plugins::fsdp {
namespace {

using modalities::testing::CommandResult;
using modalities::testing::Harness;
using modalities::testing::run_command;
using ::testing::HasSubstr;

// --- a second model: model/fsdp2_wrapped shards it knowing only the SDK --------------------------

// A small residual MLP stack, registered in-process as model/test_toy_stack: embedding, `blocks`
// ToyBlocks (x + W2 tanh(W1 x)), head. It reports its blocks and calls module hooks through
// modalities/sdk/module_hooks.h, as any third-party model plugin would.
struct ToyConfig {
  std::int64_t vocab = 128, width = 32, blocks = 3, seed = 5;
  static void describe(Schema<ToyConfig>& s) {
    s.field("vocab", &ToyConfig::vocab, "vocabulary").positive();
    s.field("width", &ToyConfig::width, "width").positive();
    s.field("blocks", &ToyConfig::blocks, "blocks").positive();
    s.field("seed", &ToyConfig::seed, "seed of the initial weights");
  }
};

class ToyBlockImpl final : public torch::nn::Module {
 public:
  explicit ToyBlockImpl(std::int64_t w)
      : torch::nn::Module("ToyBlock"),
        up(register_module("up", torch::nn::Linear(w, 2 * w))),
        down(register_module("down", torch::nn::Linear(2 * w, w))) {}
  at::Tensor forward(const at::Tensor& x) { return x + down(at::tanh(up(x))); }
  torch::nn::Linear up, down;
};

class ToyModel final : public Module {
 public:
  explicit ToyModel(const ToyConfig& c) : root_(std::make_shared<torch::nn::Module>("ToyStack")) {
    torch::manual_seed(static_cast<std::uint64_t>(c.seed));
    emb_ = root_->register_module("emb", torch::nn::Embedding(c.vocab, c.width));
    auto list = root_->register_module("blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c.blocks; ++i) {
      blocks_.push_back(std::make_shared<ToyBlockImpl>(c.width));
      list->push_back(blocks_.back());
      fqns_.push_back("blocks." + std::to_string(i));
    }
    head_ = root_->register_module("head", torch::nn::Linear(c.width, c.vocab));
  }
  TensorMap forward(const TensorMap& inputs) override {
    hooks_.call(HookPoint::kPreForward, "", "ToyStack", {}, {});  // a wrapper gathers the root here
    at::Tensor h = emb_(inputs.at("input_ids"));
    for (std::size_t i = 0; i < blocks_.size(); ++i)
      h = hooks_.around(fqns_[i], "ToyBlock", h,
                        [block = blocks_[i]](const at::Tensor& x) { return block->forward(x); });
    return {{"logits", head_(h)}};
  }
  torch::nn::Module& module() override { return *root_; }
  const torch::nn::Module& module() const override { return *root_; }
  std::vector<std::string> block_fqns() const override { return fqns_; }
  std::vector<std::string> submodules_of_class(std::string_view name) const override {
    return name == "ToyBlock" ? fqns_ : std::vector<std::string>{};
  }
  std::shared_ptr<RemovableHandle> add_hook(ModuleHook hook, std::span<const std::string> fqns) override {
    return hooks_.add(std::move(hook), fqns, fqns_, "test_toy_stack");
  }
  std::string sample_key() const override { return "input_ids"; }
  std::string prediction_key() const override { return "logits"; }

 private:
  std::shared_ptr<torch::nn::Module> root_;
  torch::nn::Embedding emb_{nullptr};
  torch::nn::Linear head_{nullptr};
  std::vector<std::shared_ptr<ToyBlockImpl>> blocks_;
  std::vector<std::string> fqns_;
  ModuleHooks hooks_;
};

void register_toy(Harness& h) {
  auto problem = h.registry().register_plugin({"fsdp_test_toy_model", "0.0.0", {}, {}, {}}, [](Registrar& r) {
    r.add<Module, ToyConfig>("test_toy_stack", "a residual MLP stack (fsdp tests)",
                             [](const ToyConfig& c) { return std::make_shared<ToyModel>(c); });
  });
  ASSERT_FALSE(problem.has_value()) << *problem;
}

constexpr const char* kToyConfig = R"(
[device_mesh]
component_key = "device_mesh"
variant_key = "default"
config = { device_type = "cpu", data_parallel_shard_degree = -1, world_size = WORLD }

[model_raw]
component_key = "model"
variant_key = "test_toy_stack"
config = { vocab = 128, width = 32, blocks = 3, seed = 5 }

[reference]
component_key = "model"
variant_key = "test_toy_stack"
config = { vocab = 128, width = 32, blocks = 3, seed = 5 }

[model]
component_key = "model"
variant_key = "fsdp2_wrapped"

[model.config]
model = { instance_key = "model_raw", pass_type = "BY_REFERENCE" }
block_names = ["ToyBlock"]
mixed_precision_settings = { param_dtype = "FP_32", reduce_dtype = "FP_32" }
reshard_after_forward = true
device_mesh = { instance_key = "device_mesh", pass_type = "BY_REFERENCE" }
)";

std::string read_example() {
  std::ifstream in(std::filesystem::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Layout {
  int world = 1;
  int replicate = 1;
  bool reshard_after_forward = true;
  int layers_per_unit = 1;
  bool toy = false;  // the second model (test_toy_stack) instead of GPT-2
  bool prefetch = true;
  std::string fsdp1;  // an FSDP1 sharding_strategy: model/fsdp1_wrapped instead of fsdp2_wrapped
};

// model/fsdp1_wrapped with `strategy` in place of the example's fsdp2_wrapped [model] table.
constexpr const char* kFsdp1Model = R"([model]
component_key = "model"
variant_key = "fsdp1_wrapped"

[model.config]
model = {{ instance_key = "model_raw", pass_type = "BY_REFERENCE" }}
sync_module_states = true
mixed_precision_settings = "FP_32"
sharding_strategy = "{}"
block_names = ["GPT2Block"]
)";

// The example config for `l`, plus an unwrapped `reference` GPT-2 with the same seed.
std::string config_for(const Layout& l) {
  if (l.toy) {
    std::string toy = kToyConfig;
    toy.replace(toy.find("WORLD"), 5, std::to_string(l.world));
    return toy;
  }
  std::string text = read_example();
  const auto replace = [&](const std::string& from, const std::string& to) {
    const auto at = text.find(from);
    if (at == std::string::npos) throw std::runtime_error("example.toml has no '" + from + "'");
    text.replace(at, from.size(), to);
  };
  replace("data_parallel_shard_degree = -1, world_size = 1",
          fmt::format("data_parallel_replicate_degree = {}, data_parallel_shard_degree = -1, world_size = {}",
                      l.replicate, l.world));
  replace("reshard_after_forward = true", fmt::format("reshard_after_forward = {}", l.reshard_after_forward));
  replace("layers_per_fsdp_unit = 1",
          fmt::format("layers_per_fsdp_unit = {}\nprefetch = {}", l.layers_per_unit, l.prefetch));
  // The reference: the same model_raw table under another key (same seed: same initial weights).
  const auto begin = text.find("[model_raw]");
  const auto end = text.find("[model]\n");
  std::string reference = text.substr(begin, end - begin);
  for (std::size_t at; (at = reference.find("model_raw")) != std::string::npos;) reference.replace(at, 9, "reference");
  if (!l.fsdp1.empty()) text = text.substr(0, end) + fmt::format(kFsdp1Model, l.fsdp1);
  return text + "\n" + reference;
}

at::Tensor loss_of(Module& m, const at::Tensor& ids) {
  const at::Tensor logits = m.forward({{"input_ids", ids}}).at("logits");
  const std::int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.narrow(1, 0, ids.size(1) - 1).reshape({-1, V}),
                                ids.narrow(1, 1, ids.size(1) - 1).reshape({-1}));
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got - want).abs().max().item<double>();
  const double tol = 1e-6 * want.abs().max().item<double>() + 1e-7;
  EXPECT_LE(err, tol) << what << ": max |difference| " << err;
}

// One comparison round; returns nothing, asserts on the way.
void compare_step(Module& sharded, Module& reference, const at::Tensor& global_ids, int rank, int dp, int round,
                  bool reshard, int dp_shard_size, const std::string& block_prefix) {
  const std::int64_t rows = global_ids.size(0) / dp;
  const at::Tensor mine = global_ids.narrow(0, rank * rows, rows);

  at::Tensor loss = loss_of(sharded, mine);
  // After forward, with reshard_after_forward, the blocks' gathered bytes are freed (the root's
  // stay until its backward); in backward they are gathered again.
  for (const auto& item : sharded.module().named_parameters(/*recurse=*/true)) {
    const bool block = item.key().starts_with(block_prefix);
    EXPECT_EQ(item.value().storage().nbytes() == 0, block && reshard) << "round " << round << ": " << item.key();
  }
  loss.backward();
  at::Tensor ref_loss = loss_of(reference, global_ids);
  ref_loss.backward();

  at::Tensor mean_loss = loss.detach().clone().reshape({1});
  if (dist::initialized()) {
    std::vector<at::Tensor> t = {mean_loss};
    dist::world()->allreduce(t)->wait();
    mean_loss.div_(dist::world_size());
  }
  expect_close(mean_loss.reshape({}), ref_loss.detach(), fmt::format("round {}: loss", round));

  const auto placements = sharded.shard_placements();
  std::map<std::string, at::Tensor> ref_grads;
  for (const auto& [name, p] : reference.named_parameters()) ref_grads[name] = p.grad();
  for (const auto& [name, shard] : sharded.named_parameters()) {
    ASSERT_TRUE(ref_grads.count(name)) << name;
    // One shard (one process): no placements, every tensor is whole.
    const std::int64_t offset = placements.empty() ? 0 : placements.at(name).offsets[0];
    ASSERT_TRUE(shard.grad().defined()) << name;
    expect_close(shard.grad(), ref_grads[name].narrow(0, offset, shard.size(0)),
                 fmt::format("round {}: gradient of {}", round, name));
  }
  // The whole gradient's norm from the shards (sum of squares over ranks) equals the reference's.
  double local = 0, reference_sq = 0;
  for (const auto& [name, shard] : sharded.named_parameters())
    local += shard.grad().to(at::kDouble).square().sum().item<double>();
  for (const auto& [name, g] : ref_grads) reference_sq += g.to(at::kDouble).square().sum().item<double>();
  at::Tensor total = at::full({1}, local, at::kDouble);
  if (dist::initialized()) {
    std::vector<at::Tensor> t = {total};
    // HSDP: every replica holds the whole gradient once.
    dist::world()->allreduce(t)->wait();
  }
  const double replicas =
      dist::initialized() ? static_cast<double>(dist::world_size()) / static_cast<double>(dp_shard_size) : 1.0;
  EXPECT_NEAR(std::sqrt(total.item<double>() / replicas), std::sqrt(reference_sq), 1e-6 * std::sqrt(reference_sq))
      << "round " << round << ": gradient norm";
  // SGD on both, then clear the gradients.
  at::NoGradGuard no_grad;
  for (const auto& [name, p] : sharded.named_parameters()) {
    p.sub_(p.grad(), 0.5);
    p.mutable_grad().reset();
  }
  for (const auto& [name, p] : reference.named_parameters()) {
    p.sub_(p.grad(), 0.5);
    p.mutable_grad().reset();
  }
}

void run_layout(const Layout& l) {
  Harness h(MODALITIES_TEST_PLUGIN);
  h.load_plugin(MODALITIES_TEST_GPT2_PLUGIN);
  h.load_plugin(MODALITIES_TEST_MESH_PLUGIN);
  register_toy(h);
  h.set_config_text(config_for(l));
  const auto sharded = h.get<Module>("model");
  ASSERT_NE(sharded, nullptr) << h.build_error();
  const auto reference = h.get<Module>("reference");
  ASSERT_NE(reference, nullptr) << h.build_error();
  const int rank = dist::rank();
  const int dp = dist::world_size();
  // Every rank draws the same global batch; rank r trains on rows [r*b, (r+1)*b).
  at::manual_seed(7);
  const at::Tensor ids = at::randint(0, 128, {2 * dp, 16}, at::kLong);
  for (int round = 0; round < 3; ++round) {
    compare_step(*sharded, *reference, ids, rank, dp, round, l.reshard_after_forward, l.world / l.replicate,
                 l.toy ? "blocks." : "transformer.h.");
    if (::testing::Test::HasFailure()) return;
  }
  // The shards tile the full parameter: their rows over all ranks add up to its first dim.
  for (const auto& [name, shard] : sharded->named_parameters()) {
    at::Tensor rows = at::full({1}, static_cast<double>(shard.size(0)), at::kDouble);
    if (dist::initialized()) {
      std::vector<at::Tensor> t = {rows};
      // HSDP: each replicate group holds every row once; the whole world holds it `replicate` times.
      dist::world()->allreduce(t)->wait();
    }
    const auto placements = sharded->shard_placements();
    const std::int64_t global_rows = placements.empty() ? shard.size(0) : placements.at(name).global_shape[0];
    EXPECT_EQ(rows.item<double>(), static_cast<double>(global_rows * l.replicate)) << name;
  }
}

TEST(FsdpTest, OneProcessEqualsTheUnwrappedModel) { run_layout(Layout{}); }

TEST(FsdpTest, OneProcessWithTwoBlocksPerUnitAndNoReshard) {
  Layout l;
  l.layers_per_unit = 2;
  l.reshard_after_forward = false;
  run_layout(l);
}

TEST(FsdpTest, TheModelCannotBeMovedAfterWrapping) {
  Harness h(MODALITIES_TEST_PLUGIN);
  h.load_plugin(MODALITIES_TEST_GPT2_PLUGIN);
  h.load_plugin(MODALITIES_TEST_MESH_PLUGIN);
  h.set_config_text(config_for(Layout{}));
  const auto sharded = h.get<Module>("model");
  ASSERT_NE(sharded, nullptr) << h.build_error();
  EXPECT_THAT([&] { sharded->to(c10::Device(c10::kCPU), at::kHalf); },
              ::testing::ThrowsMessage<Error>(HasSubstr("cannot be moved or cast after wrapping")));
  sharded->to(c10::Device(c10::kCPU), std::nullopt);  // where it is: fine
}

// --- several ranks ------------------------------------------------------------------------------

// The process group of a worker case's ranks, for the case's duration.
struct WorkerRuntime {
  WorkerRuntime() {
    dist::RuntimeOptions o;
    o.backend = "gloo";
    o.timeout = std::chrono::seconds(60);
    dist::init(dist::launch_env(), o);
  }
  ~WorkerRuntime() { dist::shutdown(); }
};

void launch(int ranks, int replicate, int layers_per_unit, bool toy = false, bool prefetch = true,
            const std::string& fsdp1 = "", const std::string& worker_case = "FsdpWorker.MatchesOneProcess") {
  testing::expect_workers_pass(
      testing::run_workers(
          MODALITIES_TEST_HOST_BINARY, ranks, worker_case,
          {{"MODALITIES_TEST_LAYOUT", fmt::format("{} {} {} {} {}", replicate, layers_per_unit, toy ? 1 : 0,
                                                  prefetch ? 1 : 0, fsdp1.empty() ? "-" : fsdp1)}}),
      ranks);
}

// The layout a launched worker runs (MODALITIES_TEST_LAYOUT, written by launch).
Layout layout_of_this_launch() {
  Layout l;
  l.world = dist::world_size();
  std::istringstream(std::getenv("MODALITIES_TEST_LAYOUT")) >> l.replicate >> l.layers_per_unit >> l.toy >>
      l.prefetch >> l.fsdp1;
  if (l.fsdp1 == "-") l.fsdp1.clear();
  if (l.fsdp1 == "SHARD_GRAD_OP" || l.fsdp1 == "_HYBRID_SHARD_ZERO2") l.reshard_after_forward = false;
  return l;
}

MODALITIES_WORKER_CASE(FsdpWorker, MatchesOneProcess) {
  const WorkerRuntime runtime;
  run_layout(layout_of_this_launch());
}

// Memory per rank (the issue's bound): parameters + gradients + AdamW state of one rank, counted
// as the bytes of the live storages it holds after an optimizer step, are at most
// total / N x 1.05 + the largest unit's parameters, where total is the same for the whole model in
// one process. The model is dominated by its blocks (vocabulary 128, 8 layers), as large models
// are. Printed per rank.
std::string memory_config(int world) {
  Layout l;
  l.world = world;
  std::string text = config_for(l);
  const auto replace = [&](const std::string& from, const std::string& to) {
    const auto at = text.find(from);
    if (at == std::string::npos) throw std::runtime_error("no '" + from + "'");
    text.replace(at, from.size(), to);
  };
  replace("n_layer = 2", "n_layer = 8");
  return text + R"(
[optimizer]
component_key = "optimizer"
variant_key = "adam_w"

[optimizer.config]
wrapped_model = { instance_key = "model", pass_type = "BY_REFERENCE" }
lr = 1e-3
betas = [0.9, 0.95]
eps = 1e-8
weight_decay = 0.1
weight_decay_groups_excluded = []
)";
}

MODALITIES_WORKER_CASE(FsdpWorker, MemoryPerRank) {
  const WorkerRuntime runtime;
  const int world = dist::world_size();
  Harness h(MODALITIES_TEST_PLUGIN);
  h.load_plugin(MODALITIES_TEST_GPT2_PLUGIN);
  h.load_plugin(MODALITIES_TEST_MESH_PLUGIN);
  h.load_plugin(MODALITIES_TEST_OPTIMIZERS_PLUGIN);
  h.set_config_text(memory_config(world));
  const auto model = h.get<Module>("model");
  ASSERT_NE(model, nullptr) << h.build_error();
  const auto optimizer = h.get<Optimizer>("optimizer");
  ASSERT_NE(optimizer, nullptr) << h.build_error();
  at::manual_seed(3);
  const at::Tensor ids = at::randint(0, 128, {2, 32}, at::kLong);
  loss_of(*model, ids).backward();
  optimizer->step();

  std::set<const void*> seen;
  const auto bytes_of = [&](const at::Tensor& t) -> double {
    if (!t.defined() || t.storage().nbytes() == 0) return 0;
    if (!seen.insert(t.storage().unsafeGetStorageImpl()).second) return 0;
    return static_cast<double>(t.storage().nbytes());
  };
  double params = 0, grads = 0, state = 0, gathered = 0, total_params = 0;
  for (const auto& [name, p] : model->named_parameters()) params += bytes_of(p);  // the flat shard buffers
  for (const auto& [name, p] : model->named_parameters()) grads += bytes_of(p.grad());
  for (const auto& [name, t] : optimizer->state_dict())
    if (name.starts_with("state.")) state += bytes_of(t);
  for (const auto& item : model->module().named_parameters(/*recurse=*/true)) {
    gathered += bytes_of(item.value()) + bytes_of(item.value().grad());
  }
  // The whole model: its full parameter sizes (fp32) x (parameter + gradient + 2 Adam moments),
  // plus one step counter per parameter, as one process holds them.
  double largest_block = 0, block = 0;
  std::string current;
  const auto placements = model->shard_placements();
  for (const auto& [name, p] : model->named_parameters()) {
    std::int64_t n = 1;
    for (auto d : placements.empty() ? p.sizes().vec() : placements.at(name).global_shape) n *= d;
    total_params += static_cast<double>(n) * 4;
    // Units are the blocks (transformer.h.<i>.) and the root.
    const std::string unit = name.starts_with("transformer.h.") ? name.substr(0, name.find('.', 14)) : "root";
    if (unit != current) {
      largest_block = std::max(largest_block, block);
      block = 0;
      current = unit;
    }
    block += static_cast<double>(n) * 4;
  }
  largest_block = std::max(largest_block, block);
  const double steps = static_cast<double>(model->named_parameters().size()) * 4;
  const double total = total_params * 4 + steps;
  const double mine = params + grads + state + gathered;
  const double bound = total / world * 1.05 + largest_block;
  std::printf(
      "rank %d of %d: parameters %.0f B, gradients %.0f B, optimizer state %.0f B, still gathered %.0f B = "
      "%.0f B; whole model %.0f B, / %d = %.0f B; bound %.0f B (x1.05 + largest unit %.0f B)\n",
      dist::rank(), world, params, grads, state, gathered, mine, total, world, total / world, bound, largest_block);
  EXPECT_EQ(gathered, 0);  // after backward every unit is freed
  EXPECT_LE(mine, bound);
}

TEST(FsdpTest, MemoryPerRankIsAShareOfTheWhole) {
  const CommandResult r = testing::run_workers(MODALITIES_TEST_HOST_BINARY, 4, "FsdpWorker.MemoryPerRank");
  testing::expect_workers_pass(r, 4);
  std::printf("%s", r.out.c_str());
}

TEST(FsdpTest, TwoRanksMatchOneProcess) { launch(2, 1, 1); }
// The same engine on a model it knows only through the SDK (blocks, hooks, parameters).
TEST(FsdpTest, ASecondModelOnTwoRanksMatchesOneProcess) { launch(2, 1, 1, /*toy=*/true); }
// Prefetching off here (on everywhere else): both must give the same results.
TEST(FsdpTest, ThreeRanksWithPaddedShardsMatchOneProcess) { launch(3, 1, 2, false, /*prefetch=*/false); }
TEST(FsdpTest, FourRanksAsHsdpTwoByTwoMatchOneProcess) { launch(4, 2, 1); }
// FSDP1's ZeRO-2 strategies (parameters stay gathered from forward to backward) on the same engine;
// FULL_SHARD, NO_SHARD and HYBRID_SHARD over two nodes train in tests/distributed.
TEST(FsdpTest, Fsdp1ShardGradOpOnTwoRanksMatchesOneProcess) { launch(2, 1, 1, false, true, "SHARD_GRAD_OP"); }
TEST(FsdpTest, Fsdp1HybridShardZero2OnTwoRanksMatchesOneProcess) {
  launch(2, 1, 1, false, true, "_HYBRID_SHARD_ZERO2");
}

// --- gradient clippers over shards ----------------------------------------------------------------

// gradient_clipper/fsdp2 (max_norm 1e-3, so every norm type clips) and fsdp2_logging_only for each
// norm type, over the example's mesh and sharded model.
std::string clipper_tables() {
  std::string t;
  for (const char* norm : {"P1_NORM", "P2_NORM", "MAX_NORM"})
    t += fmt::format(R"(
[clip_{0}]
component_key = "gradient_clipper"
variant_key = "fsdp2"
config = {{ model_parts = {{ instance_key = "model", pass_type = "BY_REFERENCE" }}, norm_type = "{0}", max_norm = 1e-3, device_mesh = {{ instance_key = "device_mesh", pass_type = "BY_REFERENCE" }} }}

[log_{0}]
component_key = "gradient_clipper"
variant_key = "fsdp2_logging_only"
config = {{ model_parts = {{ instance_key = "model", pass_type = "BY_REFERENCE" }}, norm_type = "{0}", device_mesh = {{ instance_key = "device_mesh", pass_type = "BY_REFERENCE" }} }}
)",
                     norm);
  return t;
}

// Every rank: the sharded model's gradient of its rows and the unwrapped reference's gradient of
// the whole batch; each clipper's norm must be the norm (1, 2, inf) of the reference's whole
// gradient (within 1e-6 relative), the logging-only ones must leave the shards untouched, and the
// clipping ones must scale every shard by max_norm / (norm + 1e-6) as clip_grad_norm_ does.
MODALITIES_WORKER_CASE(FsdpWorker, ClippersMatchTheWholeGradient) {
  const WorkerRuntime runtime;
  const Layout l = layout_of_this_launch();
  Harness h(MODALITIES_TEST_PLUGIN);
  h.load_plugin(MODALITIES_TEST_GPT2_PLUGIN);
  h.load_plugin(MODALITIES_TEST_MESH_PLUGIN);
  h.load_plugin(MODALITIES_TEST_CLIPPERS_PLUGIN);
  h.set_config_text(config_for(l) + clipper_tables());
  const auto sharded = h.get<Module>("model");
  ASSERT_NE(sharded, nullptr) << h.build_error();
  const auto reference = h.get<Module>("reference");
  ASSERT_NE(reference, nullptr) << h.build_error();
  const int dp = dist::world_size();
  at::manual_seed(7);
  const at::Tensor ids = at::randint(0, 128, {2 * dp, 16}, at::kLong);
  loss_of(*sharded, ids.narrow(0, 2 * dist::rank(), 2)).backward();
  loss_of(*reference, ids).backward();

  std::vector<at::Tensor> whole;
  std::map<std::string, at::Tensor> ref_grads;
  for (const auto& [name, p] : reference->named_parameters()) {
    whole.push_back(p.grad().flatten().to(at::kDouble));
    ref_grads[name] = p.grad();
  }
  const at::Tensor all = at::cat(whole);
  const auto placements = sharded->shard_placements();
  std::map<std::string, at::Tensor> saved;
  for (const auto& [name, shard] : sharded->named_parameters()) saved[name] = shard.grad().clone();

  for (const auto& [norm, order] : std::vector<std::pair<std::string, double>>{
           {"P1_NORM", 1.0}, {"P2_NORM", 2.0}, {"MAX_NORM", std::numeric_limits<double>::infinity()}}) {
    const double want = at::linalg_vector_norm(all, order).item<double>();
    const auto logging = h.get<GradientClipper>("log_" + norm);
    ASSERT_NE(logging, nullptr) << h.build_error();
    EXPECT_NEAR(logging->clip_gradients().item<double>(), want, 1e-6 * want) << "fsdp2_logging_only " << norm;
    for (const auto& [name, shard] : sharded->named_parameters())
      EXPECT_TRUE(at::equal(shard.grad(), saved[name])) << "fsdp2_logging_only " << norm << " changed " << name;

    const auto clipping = h.get<GradientClipper>("clip_" + norm);
    ASSERT_NE(clipping, nullptr) << h.build_error();
    EXPECT_NEAR(clipping->clip_gradients().item<double>(), want, 1e-6 * want) << "fsdp2 " << norm;
    const double coefficient = 1e-3 / (want + 1e-6);
    ASSERT_LT(coefficient, 1.0) << norm << ": the test needs a norm above max_norm";
    for (const auto& [name, shard] : sharded->named_parameters()) {
      const std::int64_t offset = placements.empty() ? 0 : placements.at(name).offsets[0];
      expect_close(shard.grad(), ref_grads[name].narrow(0, offset, shard.size(0)) * coefficient,
                   fmt::format("fsdp2 {}: clipped gradient of {}", norm, name));
      at::NoGradGuard no_grad;
      shard.mutable_grad().copy_(saved[name]);
    }
  }
}

// On HSDP 2 x 2 (replicas hold the same shards: counted once) and on 3 ranks with padded shards.
TEST(FsdpTest, ClippersOverShardsGiveTheWholeGradientsNormOfEveryType) {
  launch(4, 2, 1, false, true, "", "FsdpWorker.ClippersMatchTheWholeGradient");
  launch(3, 1, 1, false, true, "", "FsdpWorker.ClippersMatchTheWholeGradient");
}

}  // namespace
}  // namespace modalities::plugins::fsdp
