// Checkpointing through the registry: a tiny model, a momentum-SGD optimizer
// and a decay scheduler (test doubles registered in-process) are wired into
// app_state/raw and checkpoint_saving/default from TOML, trained a few steps,
// saved, and restored with app_state/dcp into a freshly built graph. Also:
// strategy sequences, deletion on disk, naming, last_checkpoint_info.json,
// atomicity under a failing write, corrupted/truncated files, shape mismatch,
// and checkpoint_loading/torch for inference.
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/safetensors.h>
#include <modalities/sdk/interfaces/app_state.h>
#include <modalities/sdk/interfaces/checkpoint_loading.h>
#include <modalities/sdk/interfaces/checkpoint_saving.h>
#include <modalities/sdk/interfaces/checkpoint_saving_execution.h>
#include <modalities/sdk/interfaces/checkpoint_saving_strategy.h>
#include <modalities/sdk/interfaces/lr_scheduler.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/optimizer.h>
#include <modalities/sdk/run_context.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/scratch_dir.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>

namespace modalities {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

// --- test doubles ----------------------------------------------------------------------

struct TinyConfig {
  std::int64_t width = 4;
  std::int64_t seed = 0;
  bool extra = false;
  static void describe(Schema<TinyConfig>& s) {
    s.field("width", &TinyConfig::width, "Features.").positive();
    s.field("seed", &TinyConfig::seed, "Init seed.");
    s.field("extra", &TinyConfig::extra, "Adds a parameter 'extra'.");
  }
};

// y = layer(x) * scale. `poison` adds a tensor that fails half-way through a write.
class TinyModel final : public Module {
 public:
  explicit TinyModel(const TinyConfig& c) : impl_(std::make_shared<torch::nn::Module>("Tiny")) {
    torch::manual_seed(c.seed);
    layer_ = impl_->register_module("layer", torch::nn::Linear(c.width, c.width));
    impl_->register_buffer("scale", torch::full({1}, 2.0));
    if (c.extra) impl_->register_parameter("extra", torch::zeros({1}));
  }
  TensorMap forward(const TensorMap& in) override {
    return {{"out", layer_(in.at("x")) * impl_->named_buffers()["scale"]}};
  }
  torch::nn::Module& module() override { return *impl_; }
  const torch::nn::Module& module() const override { return *impl_; }
  StateDict state_dict() const override {
    StateDict sd = Module::state_dict();
    // A meta tensor passes the writer's checks but cannot be copied to the CPU: the write fails mid-file.
    if (poison) sd["zz_poison"] = torch::empty({1024}, torch::TensorOptions().device(torch::kMeta));
    return sd;
  }
  bool poison = false;

 private:
  std::shared_ptr<torch::nn::Module> impl_;
  torch::nn::Linear layer_{nullptr};
};

struct SgdConfig {
  Ref<Module> model;
  double lr = 0.1;
  static void describe(Schema<SgdConfig>& s) {
    s.field("model", &SgdConfig::model, "Model.").required();
    s.field("lr", &SgdConfig::lr, "Learning rate.");
  }
};

// Momentum SGD with Modalities' flat state-dict keys (Note [Optimizer state dict keys]).
class TinySgd final : public Optimizer {
 public:
  explicit TinySgd(const SgdConfig& c) : params_(c.model->named_parameters()), lr_(c.lr) {}
  void step() override {
    torch::NoGradGuard g;
    for (auto& [name, p] : params_) {
      if (!p.grad().defined()) continue;
      auto& buf = momentum_[name];
      buf = buf.defined() ? buf * 0.9 + p.grad() : p.grad().clone();
      p.sub_(buf * lr_);
      steps_[name] += 1;
    }
  }
  void zero_grad(bool = true) override {
    for (auto& [name, p] : params_) p.mutable_grad() = at::Tensor();
  }
  std::size_t num_param_groups() const override { return 1; }
  std::vector<double> learning_rates() const override { return {lr_}; }
  void set_learning_rate(std::size_t, double lr) override { lr_ = lr; }
  std::optional<double> group_option(std::size_t, std::string_view n) const override {
    return n == "lr" ? std::optional<double>(lr_) : std::nullopt;
  }
  void set_group_option(std::size_t, std::string_view n, double v) override {
    if (n == "lr") lr_ = v;
  }
  StateDict state_dict() const override {
    StateDict sd;
    for (const auto& [name, p] : params_) {
      if (auto it = momentum_.find(name); it != momentum_.end()) {
        sd["state." + name + ".momentum_buffer"] = it->second;
        sd["state." + name + ".step"] = torch::tensor(static_cast<float>(steps_.at(name)));
      }
      sd["param_groups." + name + ".lr"] = torch::tensor(lr_, torch::kFloat64);
    }
    return sd;
  }
  void load_state_dict(const StateDict& state) override {
    for (const auto& [key, v] : state) {
      bool known = false;
      for (const auto& [name, p] : params_) {
        if (key == "state." + name + ".momentum_buffer") momentum_[name] = v.clone(), known = true;
        if (key == "state." + name + ".step") steps_[name] = static_cast<std::int64_t>(v.item<float>()), known = true;
        if (key == "param_groups." + name + ".lr") lr_ = v.item<double>(), known = true;
      }
      MODALITIES_CHECK(known, "TinySgd: unknown optimizer key '{}'", key);
    }
  }

 private:
  NamedTensors params_;
  double lr_;
  std::map<std::string, at::Tensor> momentum_;
  std::map<std::string, std::int64_t> steps_;
};

struct DecayConfig {
  Ref<Optimizer> optimizer;
  double gamma = 0.5;
  static void describe(Schema<DecayConfig>& s) {
    s.field("optimizer", &DecayConfig::optimizer, "Optimizer.").required();
    s.field("gamma", &DecayConfig::gamma, "Decay.");
  }
};

class TinyDecay final : public LRScheduler {
 public:
  explicit TinyDecay(const DecayConfig& c)
      : opt_(c.optimizer.shared()), gamma_(c.gamma), base_(opt_->learning_rates()[0]) {}
  void step() override {
    ++epoch_;
    opt_->set_learning_rate(0, base_ * std::pow(gamma_, static_cast<double>(epoch_)));
  }
  std::vector<double> last_lrs() const override { return opt_->learning_rates(); }
  StateDict state_dict() const override {
    return {{"last_epoch", torch::tensor(epoch_, torch::kInt64)},
            {"base_lrs", torch::tensor({base_}, torch::kFloat64)}};
  }
  void load_state_dict(const StateDict& s) override {
    epoch_ = s.at("last_epoch").item<std::int64_t>();
    base_ = s.at("base_lrs")[0].item<double>();
  }

 private:
  std::shared_ptr<Optimizer> opt_;
  double gamma_, base_;
  std::int64_t epoch_ = 0;
};

// --- helpers --------------------------------------------------------------------------

using ScratchDir = modalities::testing::ScratchDir;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

TrainingProgress progress_at(std::int64_t steps) { return {steps, steps * 32, 10, 320, 0, 0}; }

std::unique_ptr<testing::Harness> harness() {
  auto h = std::make_unique<testing::Harness>(MODALITIES_TEST_PLUGIN);
  auto problem = h->registry().register_plugin({"checkpointing_test_doubles", "0.0.0", {}, {}, {}}, [](Registrar& r) {
    r.add<Module, TinyConfig>("test_tiny", "tiny", [](const TinyConfig& c) { return std::make_shared<TinyModel>(c); });
    r.add<Optimizer, SgdConfig>("test_sgd", "sgd", [](const SgdConfig& c) { return std::make_shared<TinySgd>(c); });
    r.add<LRScheduler, DecayConfig>("test_decay", "decay",
                                    [](const DecayConfig& c) { return std::make_shared<TinyDecay>(c); });
  });
  EXPECT_FALSE(problem.has_value()) << *problem;
  return h;
}

struct GraphOptions {
  std::int64_t width = 4;
  std::int64_t seed = 0;
  bool extra = false;
  std::string strategy = R"(variant_key = "save_k_most_recent_checkpoints_strategy"
config = { k = -1 })";
  std::string execution = "dcp";
  std::int64_t global_rank = 0;
  std::string load_from;  // non-empty: app_state is app_state/dcp over this folder
};

// model + optimizer + scheduler -> app_state (raw, or dcp when loading) + checkpoint_saving.
std::string graph(const fs::path& checkpoint_path, const GraphOptions& o = {}) {
  std::string app_state = R"(
[app_state]
component_key = "app_state"
variant_key = "raw"
config = { model = { instance_key = "model", pass_type = "BY_REFERENCE" }, optimizer = { instance_key = "optimizer", pass_type = "BY_REFERENCE" }, lr_scheduler = { instance_key = "scheduler", pass_type = "BY_REFERENCE" } }
)";
  if (!o.load_from.empty()) {
    app_state = fmt::format(R"(
[app_state]
component_key = "app_state"
variant_key = "dcp"

[app_state.config]
checkpoint_dir_path = "{}"

[app_state.config.raw_app_state]
component_key = "app_state"
variant_key = "raw"
config = {{ model = {{ instance_key = "model", pass_type = "BY_REFERENCE" }}, optimizer = {{ instance_key = "optimizer", pass_type = "BY_REFERENCE" }}, lr_scheduler = {{ instance_key = "scheduler", pass_type = "BY_REFERENCE" }} }}
)",
                            o.load_from);
  }
  return fmt::format(R"(
[model]
component_key = "model"
variant_key = "test_tiny"
config = {{ width = {}, seed = {}, extra = {} }}

[optimizer]
component_key = "optimizer"
variant_key = "test_sgd"
config = {{ model = {{ instance_key = "model", pass_type = "BY_REFERENCE" }}, lr = 0.1 }}

[scheduler]
component_key = "scheduler"
variant_key = "test_decay"
config = {{ optimizer = {{ instance_key = "optimizer", pass_type = "BY_REFERENCE" }}, gamma = 0.5 }}
{}
[checkpoint_saving]
component_key = "checkpoint_saving"
variant_key = "default"

[checkpoint_saving.config.checkpoint_saving_strategy]
component_key = "checkpoint_saving_strategy"
{}

[checkpoint_saving.config.checkpoint_saving_execution]
component_key = "checkpoint_saving_execution"
variant_key = "{}"
config = {{ checkpoint_path = "{}", global_rank = {}, experiment_id = "exp" }}
)",
                     o.width, o.seed, o.extra ? "true" : "false", app_state, o.strategy, o.execution,
                     checkpoint_path.string(), o.global_rank);
}

void train(AppState& app, int steps) {
  for (int i = 0; i < steps; ++i) {
    auto model = app.model_parts()[0];
    const auto width = model->state_dict().at("layer.weight").size(0);
    model->forward({{"x", torch::randn({3, width})}}).at("out").sum().backward();
    app.optimizer()->step();
    app.lr_scheduler()->step();
    app.optimizer()->zero_grad();
  }
}

void expect_same_state(const StateDict& a, const StateDict& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, v] : a) {
    ASSERT_TRUE(b.count(k)) << k;
    EXPECT_TRUE(torch::equal(v, b.at(k)))
        << k << ": max diff " << (v.to(torch::kDouble) - b.at(k).to(torch::kDouble)).abs().max().item<double>();
  }
}

const std::string kFolder3 = "eid_exp-seen_steps_3-seen_tokens_96-target_steps_10-target_tokens_320";

// --- tests ------------------------------------------------------------------------------

TEST(CheckpointingTest, BuildsFromExampleConfig) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.load_plugin(MODALITIES_TEST_LAYER_NORM_PLUGIN);
  h.load_plugin(MODALITIES_TEST_OPTIMIZERS_PLUGIN);
  h.set_config_text(testing::read_file(fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs/example.toml"));
  EXPECT_EQ(h.build_error(), "");
  EXPECT_NE(h.get<AppState>("app_state"), nullptr);
  EXPECT_NE(h.get<CheckpointSaving>("checkpoint_saving"), nullptr);
  EXPECT_NE(h.get<CheckpointLoading>("inference_loading"), nullptr);
  EXPECT_NE(h.get<DistributedCheckpointLoading>("dcp_loading"), nullptr);
}

TEST(CheckpointingTest, RoundTripRestoresModelOptimizerSchedulerAndRng) {
  ScratchDir dir;
  auto a = harness();
  a->set_config_text(graph(dir.path()));
  auto app = a->get<AppState>("app_state");
  ASSERT_NE(app, nullptr) << a->build_error();
  train(*app, 3);
  set_loaded_plugin_versions({{"checkpointing", "0.1.0"}, {"gpt2", "0.2.0"}});  // the host sets these
  a->get<CheckpointSaving>("checkpoint_saving")->save_checkpoint(progress_at(3), nullptr, *app, false);
  const torch::Tensor next_random = torch::rand({8});  // drawn right after saving

  const fs::path folder = dir.path() / kFolder3;
  EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{kFolder3, "last_checkpoint_info.json"}));
  EXPECT_EQ(entries(folder), (std::vector<std::string>{"app_state.safetensors", "manifest.json"}));
  EXPECT_EQ(slurp(dir.path() / "last_checkpoint_info.json"),
            fmt::format("{{\"checkpoint_folder_path\": \"{}\"}}\n", fs::absolute(folder).string()));

  // The file is plain safetensors with AppState::state_dict() keys plus rng.cpu.
  const StateDict on_disk = formats::read_safetensors(folder / "app_state.safetensors");
  StateDict expected = app->state_dict();
  EXPECT_TRUE(on_disk.count("rng.cpu"));
  EXPECT_EQ(on_disk.at("rng.cpu").scalar_type(), torch::kUInt8);
  for (const auto& k :
       {"model.layer.weight", "model.layer.bias", "model.scale", "optimizer.state.layer.weight.momentum_buffer",
        "optimizer.param_groups.layer.weight.lr", "lr_scheduler.last_epoch"})
    EXPECT_TRUE(on_disk.count(k)) << k;
  const std::string manifest = slurp(folder / "manifest.json");
  EXPECT_THAT(manifest, AllOf(HasSubstr(R"("format": "modalities_checkpoint")"), HasSubstr(R"("format_version": 1)"),
                              HasSubstr(R"("experiment_id": "exp")"), HasSubstr(R"("num_seen_steps_total": 3)"),
                              HasSubstr(R"("plugin": "checkpointing", "plugin_version": "0.1.0")"),
                              HasSubstr(R"("gpt2": "0.2.0")"), HasSubstr(R"("sha256")")));

  // A fresh graph (other init seed) restored through app_state/dcp equals the saved state.
  torch::rand({100});  // move the RNG on; loading must restore it
  auto b = harness();
  GraphOptions o;
  o.seed = 7;
  o.load_from = folder.string();
  b->set_config_text(graph(dir.path(), o));
  auto restored = b->get<AppState>("app_state");
  ASSERT_NE(restored, nullptr) << b->build_error();
  EXPECT_TRUE(restored->is_loaded());
  expect_same_state(restored->state_dict(), expected);
  EXPECT_DOUBLE_EQ(restored->optimizer()->learning_rates()[0], 0.1 * 0.125);
  EXPECT_TRUE(torch::equal(torch::rand({8}), next_random));

  // Both continue identically.
  torch::manual_seed(11);
  train(*app, 2);
  torch::manual_seed(11);
  train(*restored, 2);
  expect_same_state(restored->state_dict(), app->state_dict());
}

TEST(CheckpointingTest, Fsdp1ExecutionWritesTheSameFolderAndModelOptimizerPaths) {
  ScratchDir dir;
  auto h = harness();
  GraphOptions o;
  o.execution = "fsdp1";
  h->set_config_text(graph(dir.path(), o));
  auto app = h->get<AppState>("app_state");
  ASSERT_NE(app, nullptr) << h->build_error();
  h->get<CheckpointSaving>("checkpoint_saving")->save_checkpoint(progress_at(3), nullptr, *app, false);
  const std::string folder = fs::absolute(dir.path() / kFolder3).string();
  EXPECT_EQ(
      slurp(dir.path() / "last_checkpoint_info.json"),
      fmt::format("{{\"checkpoint_folder_path\": \"{0}\", \"model_checkpoint_path\": \"{0}/app_state.safetensors\", "
                  "\"optimizer_checkpoint_path\": \"{0}/app_state.safetensors\"}}\n",
                  folder));
  EXPECT_THAT(slurp(fs::path(folder) / "manifest.json"),
              HasSubstr(R"("variant": "checkpoint_saving_execution/fsdp1")"));
}

TEST(CheckpointingTest, FolderNameFollowsModalities) {
  ScratchDir dir;
  auto h = harness();
  h->set_config_text(graph(dir.path()));
  auto app = h->get<AppState>("app_state");
  TrainingProgress p{5, 160, 100, 3200, 7, 224};  // warm-started run: totals count both runs
  h->get<CheckpointSaving>("checkpoint_saving")->save_checkpoint(p, nullptr, *app, false);
  EXPECT_TRUE(
      fs::is_directory(dir.path() / "eid_exp-seen_steps_12-seen_tokens_384-target_steps_100-target_tokens_3200"));
}

TEST(CheckpointingTest, StrategyInstructionSequences) {
  auto h = harness();
  h->set_config_text(R"(
[keep_all]
component_key = "checkpoint_saving_strategy"
variant_key = "save_k_most_recent_checkpoints_strategy"
config = { k = -1 }
[keep_none]
component_key = "checkpoint_saving_strategy"
variant_key = "save_k_most_recent_checkpoints_strategy"
config = { k = 0 }
[keep_two]
component_key = "checkpoint_saving_strategy"
variant_key = "save_k_most_recent_checkpoints_strategy"
config = { k = 2 }
[every_three]
component_key = "checkpoint_saving_strategy"
variant_key = "save_every_k_steps_checkpointing_strategy"
config = { k = 3 }
)");
  auto all = h->get<CheckpointSavingStrategy>("keep_all");
  auto none = h->get<CheckpointSavingStrategy>("keep_none");
  auto two = h->get<CheckpointSavingStrategy>("keep_two");
  auto every = h->get<CheckpointSavingStrategy>("every_three");
  ASSERT_NE(every, nullptr) << h->build_error();
  for (std::int64_t s = 1; s <= 6; ++s) {
    const auto a = all->checkpoint_instruction(progress_at(s), nullptr, false);
    EXPECT_TRUE(a.save_current);
    EXPECT_TRUE(a.checkpoints_to_delete.empty());
    const auto n = none->checkpoint_instruction(progress_at(s), nullptr, false);
    EXPECT_FALSE(n.save_current);
    EXPECT_TRUE(n.checkpoints_to_delete.empty());
    const auto t = two->checkpoint_instruction(progress_at(s), nullptr, false);
    EXPECT_TRUE(t.save_current);
    if (s <= 2) {
      EXPECT_TRUE(t.checkpoints_to_delete.empty()) << s;
    } else {
      ASSERT_EQ(t.checkpoints_to_delete.size(), 1u) << s;
      EXPECT_EQ(t.checkpoints_to_delete[0], progress_at(s - 2)) << s;
    }
    const auto e = every->checkpoint_instruction(progress_at(s), nullptr, false);
    EXPECT_EQ(e.save_current, s % 3 == 0) << s;
    EXPECT_TRUE(e.checkpoints_to_delete.empty());
  }
  // A stop request (early stopping) saves with every-k too; k = 0 still saves nothing.
  EXPECT_TRUE(every->checkpoint_instruction(progress_at(7), nullptr, true).save_current);
  EXPECT_FALSE(none->checkpoint_instruction(progress_at(7), nullptr, true).save_current);
}

TEST(CheckpointingTest, UnfinishedFoldersOfKilledWritersAreRemovedAtStart) {
  ScratchDir dir;
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ASSERT_GT(dead, 0);
  ::waitpid(dead, nullptr, 0);  // reaped: the pid no longer runs
  const std::string stale = fmt::format(".{}.tmp-{}-0-abc", kFolder3, dead);
  const std::string live = fmt::format(".{}.tmp-{}-0-abc", kFolder3, ::getppid());
  fs::create_directories(dir.path() / stale / "partial");
  fs::create_directories(dir.path() / live);
  auto h = harness();
  h->set_config_text(R"(
[e]
component_key = "checkpoint_saving_execution"
variant_key = "dcp"
config = { checkpoint_path = ")" +
                     dir.path().string() + R"(", global_rank = 0, experiment_id = "exp" })");
  ::testing::internal::CaptureStderr();
  ASSERT_NE(h->get<CheckpointSavingExecution>("e"), nullptr) << h->build_error();
  EXPECT_THAT(::testing::internal::GetCapturedStderr(), HasSubstr(stale));
  EXPECT_FALSE(fs::exists(dir.path() / stale));
  EXPECT_TRUE(fs::exists(dir.path() / live));  // its writer still runs
}

// Continued under a new experiment id (the documented way), a run saves elsewhere: the unfinished
// folder the interrupted run left beside the checkpoint it loads is removed when loading.
TEST(CheckpointingTest, UnfinishedFoldersBesideTheLoadedCheckpointAreRemoved) {
  ScratchDir old_run, new_run;
  auto a = harness();
  a->set_config_text(graph(old_run.path()));
  auto app = a->get<AppState>("app_state");
  ASSERT_NE(app, nullptr) << a->build_error();
  train(*app, 3);
  a->get<CheckpointSaving>("checkpoint_saving")->save_checkpoint(progress_at(3), nullptr, *app, false);
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ASSERT_GT(dead, 0);
  ::waitpid(dead, nullptr, 0);
  const std::string stale = fmt::format(".eid_exp-seen_steps_6-seen_tokens_192.tmp-{}-0-abc", dead);
  fs::create_directories(old_run.path() / stale / "partial");
  auto b = harness();
  GraphOptions o;
  o.load_from = (old_run.path() / kFolder3).string();
  b->set_config_text(graph(new_run.path(), o));
  ::testing::internal::CaptureStderr();
  auto restored = b->get<AppState>("app_state");
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_NE(restored, nullptr) << b->build_error();
  EXPECT_THAT(err, HasSubstr(stale));
  EXPECT_FALSE(fs::exists(old_run.path() / stale));
  EXPECT_TRUE(fs::exists(old_run.path() / kFolder3));
}

TEST(CheckpointingTest, StrategyValidatesK) {
  auto h = harness();
  h->set_config_text(R"(
[s]
component_key = "checkpoint_saving_strategy"
variant_key = "save_k_most_recent_checkpoints_strategy"
config = { k = -2 }
[e]
component_key = "checkpoint_saving_strategy"
variant_key = "save_every_k_steps_checkpointing_strategy"
config = { k = 0 }
)");
  EXPECT_THAT(h->build_error(), AllOf(HasSubstr("s.config.k"), HasSubstr("e.config.k")));
}

TEST(CheckpointingTest, KMostRecentDeletesOldFoldersOnDisk) {
  ScratchDir dir;
  auto h = harness();
  GraphOptions o;
  o.strategy = "variant_key = \"save_k_most_recent_checkpoints_strategy\"\nconfig = { k = 2 }";
  h->set_config_text(graph(dir.path(), o));
  auto app = h->get<AppState>("app_state");
  auto saving = h->get<CheckpointSaving>("checkpoint_saving");
  for (std::int64_t s = 1; s <= 4; ++s) saving->save_checkpoint(progress_at(s), nullptr, *app, false);
  EXPECT_EQ(entries(dir.path()),
            (std::vector<std::string>{"eid_exp-seen_steps_3-seen_tokens_96-target_steps_10-target_tokens_320",
                                      "eid_exp-seen_steps_4-seen_tokens_128-target_steps_10-target_tokens_320",
                                      "last_checkpoint_info.json"}));
  EXPECT_THAT(slurp(dir.path() / "last_checkpoint_info.json"), HasSubstr("seen_steps_4-"));
}

TEST(CheckpointingTest, DeletingAMissingFolderWarnsAndDeletingAForeignFolderFails) {
  ScratchDir dir;
  auto h = harness();
  h->set_config_text(R"(
[e]
component_key = "checkpoint_saving_execution"
variant_key = "dcp"
config = { checkpoint_path = ")" +
                     dir.path().string() + R"(", global_rank = 0, experiment_id = "exp" })");
  auto e = h->get<CheckpointSavingExecution>("e");
  ASSERT_NE(e, nullptr) << h->build_error();
  // Already gone (removed by hand): a warning, the run goes on.
  ::testing::internal::CaptureStderr();
  EXPECT_NO_THROW(e->delete_checkpoint(progress_at(3)));
  EXPECT_THAT(::testing::internal::GetCapturedStderr(), AllOf(HasSubstr(kFolder3), HasSubstr("no longer exists")));
  fs::create_directories(dir.path() / kFolder3 / "precious");
  EXPECT_THAT(error_of([&] { e->delete_checkpoint(progress_at(3)); }), HasSubstr("refusing to delete"));
  EXPECT_TRUE(fs::exists(dir.path() / kFolder3 / "precious"));
}

TEST(CheckpointingTest, OnlyRankZeroWrites) {
  ScratchDir dir;
  auto h = harness();
  GraphOptions o;
  o.global_rank = 1;
  o.strategy = "variant_key = \"save_k_most_recent_checkpoints_strategy\"\nconfig = { k = 1 }";
  h->set_config_text(graph(dir.path() / "ckpt", o));
  auto app = h->get<AppState>("app_state");
  auto saving = h->get<CheckpointSaving>("checkpoint_saving");
  for (std::int64_t s = 1; s <= 3; ++s) saving->save_checkpoint(progress_at(s), nullptr, *app, false);  // deletes too
  EXPECT_FALSE(fs::exists(dir.path() / "ckpt"));
}

TEST(CheckpointingTest, AFailedWriteLeavesThePreviousCheckpointValid) {
  ScratchDir dir;
  auto h = harness();
  h->set_config_text(graph(dir.path()));
  auto app = h->get<AppState>("app_state");
  auto saving = h->get<CheckpointSaving>("checkpoint_saving");
  saving->save_checkpoint(progress_at(3), nullptr, *app, false);
  const std::string info = slurp(dir.path() / "last_checkpoint_info.json");
  const std::string file = slurp(dir.path() / kFolder3 / "app_state.safetensors");
  const auto before = entries(dir.path());

  std::static_pointer_cast<TinyModel>(app->model_parts()[0])->poison = true;
  // A new checkpoint fails half-way ...
  EXPECT_THAT(error_of([&] { saving->save_checkpoint(progress_at(4), nullptr, *app, false); }), HasSubstr("meta"));
  // ... and so does replacing the existing one.
  EXPECT_NE(error_of([&] { saving->save_checkpoint(progress_at(3), nullptr, *app, false); }), "");
  EXPECT_EQ(entries(dir.path()), before);  // no new folder, no temporary folder left behind
  EXPECT_EQ(slurp(dir.path() / "last_checkpoint_info.json"), info);
  EXPECT_EQ(slurp(dir.path() / kFolder3 / "app_state.safetensors"), file);

  // The previous checkpoint still loads.
  auto b = harness();
  GraphOptions o;
  o.load_from = (dir.path() / kFolder3).string();
  b->set_config_text(graph(dir.path(), o));
  EXPECT_EQ(b->build_error(), "");

  // Saving the same progress again replaces the folder in one step.
  std::static_pointer_cast<TinyModel>(app->model_parts()[0])->poison = false;
  train(*app, 1);
  saving->save_checkpoint(progress_at(3), nullptr, *app, false);
  EXPECT_EQ(entries(dir.path()), before);
  EXPECT_TRUE(
      torch::equal(formats::read_safetensors(dir.path() / kFolder3 / "app_state.safetensors").at("model.layer.weight"),
                   app->state_dict().at("model.layer.weight")));
}

class CorruptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto h = harness();
    h->set_config_text(graph(dir.path()));
    auto app = h->get<AppState>("app_state");
    train(*app, 1);
    h->get<CheckpointSaving>("checkpoint_saving")->save_checkpoint(progress_at(3), nullptr, *app, false);
  }
  std::string load_error(const GraphOptions& base = {}) {
    auto b = harness();
    GraphOptions o = base;
    o.load_from = folder().string();
    b->set_config_text(graph(dir.path() / "new", o));
    return b->build_error();
  }
  fs::path folder() const { return dir.path() / kFolder3; }
  fs::path file() const { return folder() / "app_state.safetensors"; }
  void rewrite(const fs::path& p, const std::string& bytes) {
    std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
  }
  ScratchDir dir;
};

TEST_F(CorruptionTest, IntactCheckpointLoads) { EXPECT_EQ(load_error(), ""); }

TEST_F(CorruptionTest, FlippedByteFailsItsChecksum) {
  std::string bytes = slurp(file());
  const auto header = formats::read_safetensors_header(file());
  const auto& e = header.tensors.at("model.layer.weight");
  bytes[header.data_offset + e.begin + 5] ^= 0x40;
  rewrite(file(), bytes);
  EXPECT_THAT(load_error(), AllOf(HasSubstr(kFolder3), HasSubstr("is corrupt"), HasSubstr("'model.layer.weight'"),
                                  HasSubstr("SHA-256")));
}

TEST_F(CorruptionTest, TruncatedFileIsReported) {
  const std::string bytes = slurp(file());
  rewrite(file(), bytes.substr(0, bytes.size() - 7));
  EXPECT_THAT(load_error(), AllOf(HasSubstr("app_state.safetensors"), HasSubstr("truncated file")));
  rewrite(file(), bytes.substr(0, 20));
  EXPECT_THAT(load_error(), AllOf(HasSubstr("app_state.safetensors"), HasSubstr("truncated")));
}

TEST_F(CorruptionTest, ManifestProblemsAreReported) {
  const std::string manifest = slurp(folder() / "manifest.json");
  std::string v2 = manifest;
  v2.replace(v2.find("\"format_version\": 1"), 19, "\"format_version\": 3");
  rewrite(folder() / "manifest.json", v2);
  EXPECT_THAT(load_error(),
              AllOf(HasSubstr("format version 3"), HasSubstr("reads versions 1 and 2"), HasSubstr("newer")));
  rewrite(folder() / "manifest.json", manifest.substr(0, manifest.size() / 2));
  EXPECT_THAT(load_error(), HasSubstr("manifest.json is not valid JSON"));
  fs::remove(folder() / "manifest.json");
  EXPECT_THAT(load_error(), HasSubstr("manifest.json is missing"));
  std::ofstream(folder() / "__0_0.distcp") << "x";
  EXPECT_THAT(load_error(), AllOf(HasSubstr("PyTorch Distributed Checkpoint"), HasSubstr("convert_checkpoint.py")));
  fs::remove_all(folder());
  EXPECT_THAT(load_error(), HasSubstr("does not exist"));
}

TEST_F(CorruptionTest, ShapeMismatchNamesTheFirstTensor) {
  GraphOptions o;
  o.width = 8;
  EXPECT_THAT(load_error(o), HasSubstr(fmt::format("checkpoint '{}' was written by a model of a different shape: "
                                                   "layer.bias is [4] in the checkpoint, [8] in this model",
                                                   folder().string())));
}

TEST_F(CorruptionTest, MissingAndUnknownModelKeysAreReported) {
  GraphOptions o;
  o.extra = true;
  EXPECT_THAT(load_error(o),
              AllOf(HasSubstr("written by a different model"), HasSubstr("'extra' are not in the checkpoint")));
}

TEST_F(CorruptionTest, AnAppStateLoadsOnlyOnce) {
  auto b = harness();
  GraphOptions o;
  o.load_from = folder().string();
  b->set_config_text(graph(dir.path() / "new", o) + R"(
[loading]
component_key = "checkpoint_loading"
variant_key = "dcp"
config = { global_rank = 0 }
)");
  auto app = b->get<AppState>("app_state");
  ASSERT_NE(app, nullptr) << b->build_error();
  EXPECT_THAT(error_of([&] { b->get<DistributedCheckpointLoading>("loading")->load_checkpoint(*app, folder()); }),
              HasSubstr("already loaded"));
}

TEST_F(CorruptionTest, DcpCheckpointLoadingRestoresAnAppState) {
  auto b = harness();
  b->set_config_text(graph(dir.path() / "new") + R"(
[loading]
component_key = "checkpoint_loading"
variant_key = "dcp"
config = { global_rank = 0 }
)");
  auto app = b->get<AppState>("app_state");
  ASSERT_NE(app, nullptr) << b->build_error();
  EXPECT_FALSE(app->is_loaded());
  b->get<DistributedCheckpointLoading>("loading")->load_checkpoint(*app, folder());
  EXPECT_TRUE(app->is_loaded());
  StateDict expected = formats::read_safetensors(file());
  for (auto it = expected.begin(); it != expected.end();)
    it = it->first.starts_with("rng.") ? expected.erase(it) : std::next(it);
  expect_same_state(app->state_dict(), expected);
}

TEST_F(CorruptionTest, Fsdp1LoadingLoadsInPlaceAndChecksBlocksAndPrecision) {
  auto b = harness();
  b->set_config_text(R"(
[model]
component_key = "model"
variant_key = "test_tiny"
config = { width = 4, seed = 9 }
[fp32]
component_key = "checkpoint_loading"
variant_key = "fsdp1"
config = { global_rank = 0, block_names = ["Linear"], mixed_precision_settings = "FP_32", sharding_strategy = "FULL_SHARD" }
[unknown_block]
component_key = "checkpoint_loading"
variant_key = "fsdp1"
config = { global_rank = 0, block_names = ["GPT2Block"], mixed_precision_settings = "FP_32", sharding_strategy = "NO_SHARD" }
[bf16]
component_key = "checkpoint_loading"
variant_key = "fsdp1"
config = { global_rank = 0, block_names = ["Linear"], mixed_precision_settings = "BF_16", sharding_strategy = "FULL_SHARD" }
)");
  auto model = b->get<Module>("model");
  ASSERT_NE(model, nullptr) << b->build_error();
  const StateDict saved = formats::read_safetensors(file());
  auto loaded = b->get<CheckpointLoading>("fp32")->load_model_checkpoint(model, folder());
  EXPECT_EQ(loaded, model);  // in place
  EXPECT_TRUE(torch::equal(model->state_dict().at("layer.weight"), saved.at("model.layer.weight")));
  EXPECT_THAT(error_of([&] { b->get<CheckpointLoading>("unknown_block")->load_model_checkpoint(model, folder()); }),
              AllOf(HasSubstr("block_names"), HasSubstr("GPT2Block")));
  // A bf16 preset needs a model with mixed-precision support (the test model has none).
  EXPECT_THAT(error_of([&] { b->get<CheckpointLoading>("bf16")->load_model_checkpoint(model, folder()); }),
              HasSubstr("mixed precision"));
  b->set("fp32.config.sharding_strategy", Value(std::string("SHARDED")));
  EXPECT_THAT(b->build_error(), HasSubstr("sharding_strategy"));
}

TEST_F(CorruptionTest, TorchLoadingReadsTheModelForInference) {
  auto b = harness();
  b->set_config_text(R"(
[model]
component_key = "model"
variant_key = "test_tiny"
config = { width = 4, seed = 9 }
[bf16]
component_key = "checkpoint_loading"
variant_key = "torch"
config = { device = "cpu", precision = "BF16" }
[as_stored]
component_key = "checkpoint_loading"
variant_key = "torch"
config = { device = "cpu" }
)");
  auto model = b->get<Module>("model");
  ASSERT_NE(model, nullptr) << b->build_error();
  const StateDict saved = formats::read_safetensors(file());
  auto loaded = b->get<CheckpointLoading>("as_stored")->load_model_checkpoint(model, folder());
  EXPECT_TRUE(torch::equal(loaded->state_dict().at("layer.weight"), saved.at("model.layer.weight")));
  EXPECT_EQ(loaded->state_dict().at("layer.weight").scalar_type(), torch::kFloat32);

  loaded = b->get<CheckpointLoading>("bf16")->load_model_checkpoint(model, file());  // the file works too
  EXPECT_EQ(loaded->state_dict().at("layer.weight").scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(
      torch::equal(loaded->state_dict().at("layer.weight"), saved.at("model.layer.weight").to(torch::kBFloat16)));

  // A plain (flat) safetensors file, e.g. exported from Hugging Face.
  const fs::path flat = dir.path() / "flat.safetensors";
  formats::write_safetensors(
      flat,
      {{"layer.weight", torch::ones({4, 4})}, {"layer.bias", torch::zeros({4})}, {"scale", torch::full({1}, 3.0)}});
  loaded = b->get<CheckpointLoading>("as_stored")->load_model_checkpoint(model, flat);
  EXPECT_TRUE(torch::equal(loaded->state_dict().at("layer.weight"), torch::ones({4, 4})));

  std::ofstream(dir.path() / "model.bin") << "pickle";
  EXPECT_THAT(
      error_of([&] { b->get<CheckpointLoading>("as_stored")->load_model_checkpoint(model, dir.path() / "model.bin"); }),
      AllOf(HasSubstr("PyTorch pickle"), HasSubstr("convert_checkpoint.py")));

  // The optimizer part of the same checkpoint.
  b->set_config_text(R"(
[model]
component_key = "model"
variant_key = "test_tiny"
config = { width = 4 }
[optimizer]
component_key = "optimizer"
variant_key = "test_sgd"
config = { model = { instance_key = "model", pass_type = "BY_REFERENCE" }, lr = 1.0 }
[loading]
component_key = "checkpoint_loading"
variant_key = "torch"
config = { device = 0 }
)");
  if (!torch::cuda::is_available()) {
    EXPECT_THAT(b->build_error(), HasSubstr("no CUDA device"));
    b->set("loading.config.device", Value(std::string("cpu")));
  }
  auto opt = b->get<Optimizer>("optimizer");
  ASSERT_NE(opt, nullptr) << b->build_error();
  b->get<CheckpointLoading>("loading")->load_optimizer_checkpoint(*opt, *b->get<Module>("model"), folder());
  EXPECT_DOUBLE_EQ(opt->learning_rates()[0], 0.05);

  // The same through optimizer/fsdp1_checkpointed (Modalities' FSDP1 warm-start component).
  b->set_config_text(R"(
[model]
component_key = "model"
variant_key = "test_tiny"
config = { width = 4 }
[optimizer]
component_key = "optimizer"
variant_key = "test_sgd"
config = { model = { instance_key = "model", pass_type = "BY_REFERENCE" }, lr = 1.0 }
[loading]
component_key = "checkpoint_loading"
variant_key = "torch"
config = { device = "cpu" }
[restored]
component_key = "optimizer"
variant_key = "fsdp1_checkpointed"
[restored.config]
checkpoint_loading = { instance_key = "loading", pass_type = "BY_REFERENCE" }
checkpoint_path = ")" +
                     folder().string() + R"("
wrapped_model = { instance_key = "model", pass_type = "BY_REFERENCE" }
optimizer = { instance_key = "optimizer", pass_type = "BY_REFERENCE" }
)");
  auto restored = b->get<Optimizer>("restored");
  ASSERT_NE(restored, nullptr) << b->build_error();
  EXPECT_EQ(restored, b->get<Optimizer>("optimizer"));  // restored in place and returned
  EXPECT_DOUBLE_EQ(restored->learning_rates()[0], 0.05);
}

// Python Modalities -> scripts/convert_checkpoint.py -> this plugin, with the real model and
// optimizer plugins: the restored AdamW takes the same third step as PyTorch did
// (fixture and expected values from scripts/reference/make_checkpoint_fixture.py).
TEST(CheckpointingTest, RestoresAConvertedPyTorchCheckpointIntoAdamW) {
  const fs::path data = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "tests/data";
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.load_plugin(MODALITIES_TEST_LAYER_NORM_PLUGIN);
  h.load_plugin(MODALITIES_TEST_OPTIMIZERS_PLUGIN);
  h.set_config_text(
      fmt::format(R"(
[model]
component_key = "layer_norm"
variant_key = "layer_norm"
config = {{ normalized_shape = 8, eps = 1e-5 }}

[optimizer]
component_key = "optimizer"
variant_key = "adam_w"
config = {{ wrapped_model = {{ instance_key = "model", pass_type = "BY_REFERENCE" }}, lr = 0.5, betas = [0.9, 0.95], eps = 1e-8, weight_decay = 0.1, weight_decay_groups_excluded = [] }}

[app_state]
component_key = "app_state"
variant_key = "dcp"

[app_state.config]
checkpoint_dir_path = "{}"
raw_app_state = {{ component_key = "app_state", variant_key = "raw", config = {{ model = {{ instance_key = "model", pass_type = "BY_REFERENCE" }}, optimizer = {{ instance_key = "optimizer", pass_type = "BY_REFERENCE" }} }} }}
)",
                  (data / "eid_pyref-seen_steps_2-seen_tokens_64-target_steps_10-target_tokens_320").string()));
  auto app = h.get<AppState>("app_state");
  ASSERT_NE(app, nullptr) << h.build_error();
  const StateDict expected = formats::read_safetensors(data / "after_step_3.safetensors");
  EXPECT_DOUBLE_EQ(app->optimizer()->learning_rates()[0],
                   expected.at("lr").item<double>());  // restored from the checkpoint
  auto model = app->model_parts()[0];
  const torch::Tensor x = torch::linspace(-1.0, 1.0, 24).reshape({3, 8});
  app->optimizer()->zero_grad();
  (model->forward({{"input", x}}).at("output") * torch::arange(1.0, 9.0) * 3.0).sum().backward();
  app->optimizer()->step();
  for (const char* name : {"weight", "bias"}) {
    const torch::Tensor got = model->state_dict().at(name), want = expected.at(name);
    EXPECT_TRUE(torch::allclose(got, want, /*rtol=*/0, /*atol=*/1e-6))
        << name << ": max diff " << (got - want).abs().max().item<double>();
  }
}

TEST(CheckpointingTest, TorchLoadingValidatesItsConfig) {
  auto h = harness();
  h->set_config_text(R"(
[a]
component_key = "checkpoint_loading"
variant_key = "torch"
config = { device = "tpu", precision = "FP8" }
[b]
component_key = "checkpoint_loading"
variant_key = "torch"
config = { device = -1 }
)");
  EXPECT_THAT(h->build_error(),
              AllOf(HasSubstr("a.config.device"), HasSubstr("a.config.precision"), HasSubstr("b.config.device")));
}

}  // namespace
}  // namespace modalities
