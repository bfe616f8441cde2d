// The `scheduler` variants against torch.optim.lr_scheduler (tests/data/scheduler_reference.inc,
// made by scripts/reference/optim_reference.py): learning rates (and OneCycle's beta1) after
// construction and after every step must be bit-identical, for fresh runs, for the FSDP1-style
// resume with last_epoch = k - 1, and after a state-dict resume mid-way (DCP style: fresh
// scheduler, then optimizer and scheduler state loaded). A fake two-group optimizer stands in
// for Adam so that the groups can start at different rates; the example config runs the
// variants over real AdamW optimizers. Then one test per validator.
#include <modalities/sdk/interfaces/lr_scheduler.h>
#include <modalities/sdk/interfaces/optimizer.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace modalities::plugins::schedulers {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

struct RefSchedulerCase {
  std::string name, variant, config;
  std::vector<double> group_lrs;
  int resume_at;                                             // k > 0: the FSDP1-style resume below is tested
  std::vector<std::vector<double>> lrs;                      // [0]: after construction, [k]: after step k
  std::vector<std::vector<double>> beta1s;                   // same for betas.0
  std::vector<std::map<std::string, double>> resume_groups;  // optimizer group options after k steps
  std::vector<std::vector<double>> resumed_lrs;              // built with last_epoch = k - 1, then stepped
};
#include "data/scheduler_reference.inc"

const fs::path kExample = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml";

// optimizer/fake_groups: one group per entry of `lrs`, each with betas (0.9, 0.999) unless
// `betas = false`; `options` adds (or overrides) group options per group.
struct FakeConfig {
  std::vector<double> lrs;
  bool betas = true;
  std::vector<std::map<std::string, double>> options;
  static void describe(Schema<FakeConfig>& s) {
    s.field("lrs", &FakeConfig::lrs, "one lr per group").required();
    s.field("betas", &FakeConfig::betas, "groups have betas.0 and betas.1");
    s.field("options", &FakeConfig::options, "extra options per group");
  }
};

class FakeOptimizer final : public Optimizer {
 public:
  explicit FakeOptimizer(const FakeConfig& c) {
    for (std::size_t g = 0; g < c.lrs.size(); ++g) {
      std::map<std::string, double, std::less<>> opts{{"lr", c.lrs[g]}};
      if (c.betas) opts.insert({{"betas.0", 0.9}, {"betas.1", 0.999}});
      if (g < c.options.size())
        for (const auto& [k, v] : c.options[g]) opts.insert_or_assign(k, v);
      groups_.push_back(std::move(opts));
    }
  }
  void step() override {}
  void zero_grad(bool) override {}
  std::size_t num_param_groups() const override { return groups_.size(); }
  std::vector<double> learning_rates() const override {
    std::vector<double> out;
    for (const auto& g : groups_) out.push_back(g.at("lr"));
    return out;
  }
  void set_learning_rate(std::size_t g, double lr) override { groups_.at(g).at("lr") = lr; }
  std::optional<double> group_option(std::size_t g, std::string_view name) const override {
    auto it = groups_.at(g).find(name);
    return it == groups_.at(g).end() ? std::nullopt : std::optional<double>(it->second);
  }
  void set_group_option(std::size_t g, std::string_view name, double v) override {
    groups_.at(g).insert_or_assign(std::string(name), v);
  }
  StateDict state_dict() const override {
    StateDict out;
    for (std::size_t g = 0; g < groups_.size(); ++g)
      for (const auto& [k, v] : groups_[g])
        out.emplace(fmt::format("param_groups.p{}.{}", g, k), at::scalar_tensor(v, at::kDouble));
    return out;
  }
  void load_state_dict(const StateDict& state) override {
    for (const auto& [key, value] : state) {
      const std::size_t g = std::stoul(key.substr(14));  // "param_groups.p<g>.<name>"
      set_group_option(g, key.substr(key.find('.', 14) + 1), value.item<double>());
    }
  }

 private:
  std::vector<std::map<std::string, double, std::less<>>> groups_;
};

void register_fake_optimizer(testing::Harness& h) {
  auto problem = h.registry().register_plugin({"scheduler_test_fakes", "0.0.0", {}, {}, {}}, [](Registrar& r) {
    r.add<Optimizer, FakeConfig>("fake_groups", "test optimizer",
                                 [](const FakeConfig& c) { return std::make_shared<FakeOptimizer>(c); });
  });
  ASSERT_FALSE(problem.has_value()) << *problem;
}

std::string floats_toml(const std::vector<double>& xs) {
  std::string s = "[";
  for (std::size_t i = 0; i < xs.size(); ++i) s += (i ? ", " : "") + format_float(xs[i]);
  return s + "]";
}

std::string options_toml(const std::vector<std::map<std::string, double>>& groups) {
  std::string s = "[";
  for (std::size_t g = 0; g < groups.size(); ++g) {
    s += g ? ", {" : "{";
    bool first = true;
    for (const auto& [k, v] : groups[g]) {
      s += fmt::format("{} \"{}\" = {}", first ? "" : ",", k, format_float(v));
      first = false;
    }
    s += " }";
  }
  return s + "]";
}

// Fake optimizer `optimizer` and scheduler `scheduler`; `extra` is appended to scheduler.config.
std::string config_text(const RefSchedulerCase& c, const std::string& optimizer_extra = "",
                        const std::string& extra = "") {
  return fmt::format(R"(
[optimizer]
component_key = "optimizer"
variant_key = "fake_groups"

[optimizer.config]
lrs = {}
{}

[scheduler]
component_key = "scheduler"
variant_key = "{}"

[scheduler.config]
optimizer = {{ instance_key = "optimizer", pass_type = "BY_REFERENCE" }}
{}
{}
)",
                     floats_toml(c.group_lrs), optimizer_extra, c.variant, c.config, extra);
}

std::vector<double> beta1s(const Optimizer& opt) {
  std::vector<double> out;
  for (std::size_t g = 0; g < opt.num_param_groups(); ++g) out.push_back(opt.group_option(g, "betas.0").value_or(NAN));
  return out;
}

std::string show(const std::vector<double>& xs) {
  std::string s;
  for (double x : xs) s += fmt::format("{} ({:a}) ", x, x);
  return s;
}

// Steps `sched` and checks last_lrs, the optimizer's rates and beta1 against rows [first, end).
void expect_sequence(LRScheduler& sched, const Optimizer& opt, const std::vector<std::vector<double>>& lrs,
                     const std::vector<std::vector<double>>* betas, std::size_t first, const std::string& what) {
  for (std::size_t k = first; k < lrs.size(); ++k) {
    if (k > first) sched.step();
    ASSERT_EQ(sched.last_lrs(), lrs[k]) << what << " at step " << k << ": got " << show(sched.last_lrs()) << "expected "
                                        << show(lrs[k]);
    ASSERT_EQ(opt.learning_rates(), lrs[k]) << what << " at step " << k;
    if (betas != nullptr) {
      ASSERT_EQ(beta1s(opt), (*betas)[k]) << what << " beta1 at step " << k;
    }
  }
}

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override { register_fake_optimizer(h); }
  testing::Harness h{MODALITIES_TEST_PLUGIN};
};

TEST_F(SchedulerTest, FreshRunsMatchTorchBitForBit) {
  for (const RefSchedulerCase& c : kSchedulerCases) {
    SCOPED_TRACE(c.name);
    h.set_config_text(config_text(c));
    auto sched = h.get<LRScheduler>("scheduler");
    ASSERT_NE(sched, nullptr) << h.build_error();
    expect_sequence(*sched, *h.get<Optimizer>("optimizer"), c.lrs, &c.beta1s, 0, c.name);
  }
}

// Modalities' warmup-cosine factory: W=2, total=6, initial 0.1, final 0.2, max 1.0 gives
// lr(0) < lr(1) < lr(2) = 1.0 > lr(3) > ... > lr(6) = 0.2.
TEST_F(SchedulerTest, WarmupCosineSpecExample) {
  const RefSchedulerCase& c = kSchedulerCases[10];
  ASSERT_EQ(c.name, "warmup_cosine_spec_example");
  h.set_config_text(config_text(c));
  auto sched = h.get<LRScheduler>("scheduler");
  std::vector<double> lr{sched->last_lrs()[0]};
  for (int i = 0; i < 6; ++i) {
    sched->step();
    lr.push_back(sched->last_lrs()[0]);
  }
  EXPECT_EQ(lr[0], 0.1);
  EXPECT_LT(lr[0], lr[1]);
  EXPECT_LT(lr[1], lr[2]);
  EXPECT_EQ(lr[2], 1.0);
  for (int e = 3; e <= 6; ++e) EXPECT_LT(lr[e], lr[e - 1]) << e;
  EXPECT_EQ(lr[6], 0.2);
}

TEST_F(SchedulerTest, ResumeWithLastEpochMatchesTorch) {
  int tested = 0;
  for (const RefSchedulerCase& c : kSchedulerCases) {
    if (c.resume_at <= 0) continue;
    SCOPED_TRACE(c.name);
    h.set_config_text(
        config_text(c, "options = " + options_toml(c.resume_groups), fmt::format("last_epoch = {}", c.resume_at - 1)));
    auto sched = h.get<LRScheduler>("scheduler");
    ASSERT_NE(sched, nullptr) << h.build_error();
    expect_sequence(*sched, *h.get<Optimizer>("optimizer"), c.resumed_lrs, nullptr, 0, c.name + " resumed");
    ++tested;
  }
  EXPECT_EQ(tested, 5);
}

// DCP-style resume: a fresh scheduler over a fresh optimizer, both overwritten from state dicts
// taken mid-way, continue exactly like the uninterrupted run.
TEST_F(SchedulerTest, StateDictResumeContinuesTheSchedule) {
  for (const RefSchedulerCase& c : kSchedulerCases) {
    SCOPED_TRACE(c.name);
    const std::size_t k = std::min<std::size_t>(7, c.lrs.size() - 2);
    h.set_config_text(config_text(c));
    auto sched = h.get<LRScheduler>("scheduler");
    auto opt = h.get<Optimizer>("optimizer");
    for (std::size_t i = 0; i < k; ++i) sched->step();
    const StateDict sched_state = sched->state_dict(), opt_state = opt->state_dict();
    EXPECT_EQ(sched_state.contains("last_epoch"), true);

    testing::Harness h2{MODALITIES_TEST_PLUGIN};
    register_fake_optimizer(h2);
    h2.set_config_text(config_text(c));
    auto sched2 = h2.get<LRScheduler>("scheduler");
    auto opt2 = h2.get<Optimizer>("optimizer");
    opt2->load_state_dict(opt_state);
    sched2->load_state_dict(sched_state);
    EXPECT_EQ(sched2->state_dict().size(), sched_state.size());
    expect_sequence(*sched2, *opt2, c.lrs, &c.beta1s, k, c.name + " after load_state_dict");
  }
}

TEST_F(SchedulerTest, StateDictHasPyTorchsAttributes) {
  const RefSchedulerCase& cosine = kSchedulerCases[6];
  ASSERT_EQ(cosine.name, "cosine");
  h.set_config_text(config_text(cosine));
  auto sched = h.get<LRScheduler>("scheduler");
  sched->step();
  const StateDict s = sched->state_dict();
  EXPECT_EQ(s.at("last_epoch").item<std::int64_t>(), 1);
  EXPECT_EQ(s.at("last_epoch").scalar_type(), at::kLong);
  EXPECT_EQ(s.at("_step_count").item<std::int64_t>(), 2);
  EXPECT_EQ(s.at("T_max").item<std::int64_t>(), 10);
  EXPECT_EQ(s.at("base_lrs").scalar_type(), at::kDouble);
  EXPECT_EQ(s.at("base_lrs").size(0), 2);
  EXPECT_EQ(s.at("_last_lr")[1].item<double>(), cosine.lrs[1][1]);

  const RefSchedulerCase& warmup = kSchedulerCases[10];
  ASSERT_EQ(warmup.name, "warmup_cosine_spec_example");
  h.set_config_text(config_text(warmup));
  const StateDict w = h.get<LRScheduler>("scheduler")->state_dict();
  EXPECT_EQ(w.at("last_epoch").item<std::int64_t>(), 0);
  EXPECT_EQ(w.at("_milestones")[0].item<std::int64_t>(), 2);
  EXPECT_EQ(w.at("schedulers.0.last_epoch").item<std::int64_t>(), 0);
  EXPECT_EQ(w.at("schedulers.1.last_epoch").item<std::int64_t>(), -1);
  EXPECT_EQ(w.at("schedulers.1.T_max").item<std::int64_t>(), 4);

  // A state dict of another variant is rejected.
  h.set_config_text(config_text(kSchedulerCases[1]));  // step_lr
  EXPECT_THROW(h.get<LRScheduler>("scheduler")->load_state_dict(s), Error);
}

TEST_F(SchedulerTest, InitialLrIsKeptInTheGroups) {
  h.set_config_text(config_text(kSchedulerCases[1]));  // step_lr over lrs 0.1, 0.05
  auto opt = h.get<Optimizer>("optimizer");
  h.get<LRScheduler>("scheduler");
  EXPECT_EQ(opt->group_option(0, "initial_lr"), 0.1);
  EXPECT_EQ(opt->group_option(1, "initial_lr"), 0.05);
  // An existing initial_lr wins (PyTorch's setdefault): base_lrs come from it.
  h.set_config_text(config_text(kSchedulerCases[1], R"(options = [{ initial_lr = 1.0 }, { initial_lr = 2.0 }])"));
  const StateDict s = h.get<LRScheduler>("scheduler")->state_dict();
  EXPECT_EQ(s.at("base_lrs")[0].item<double>(), 1.0);
  EXPECT_EQ(s.at("base_lrs")[1].item<double>(), 2.0);
}

TEST_F(SchedulerTest, OneCycleStopsAfterTotalSteps) {
  const RefSchedulerCase& c = kSchedulerCases[8];  // onecycle_three_phase_linear, total_steps 30
  ASSERT_EQ(c.name, "onecycle_three_phase_linear");
  h.set_config_text(config_text(c));
  auto sched = h.get<LRScheduler>("scheduler");
  for (int i = 0; i < 30; ++i) sched->step();  // step 30 == total_steps is allowed (the trainer's last)
  try {
    sched->step();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("tried to step 31 times"));
  }
}

TEST_F(SchedulerTest, OneCycleWithPctStartOneReachesMinLr) {
  // PyTorch divides by zero at step total_steps (the last phase has length 0); here the rate is min_lr.
  RefSchedulerCase c = kSchedulerCases[0];
  c.variant = "onecycle_lr";
  c.config =
      "max_lr = 1.0\ndiv_factor = 10.0\nfinal_div_factor = 2.0\npct_start = 1.0\nanneal_strategy = "
      "\"cos\"\ntotal_steps = 4";
  h.set_config_text(config_text(c));
  auto sched = h.get<LRScheduler>("scheduler");
  ASSERT_NE(sched, nullptr) << h.build_error();
  for (int i = 0; i < 3; ++i) sched->step();
  EXPECT_EQ(sched->last_lrs()[0], 1.0);
  sched->step();
  EXPECT_EQ(sched->last_lrs()[0], 0.05);
}

TEST_F(SchedulerTest, ConstantFactorZeroReturnsToTheBaseRate) {
  // PyTorch divides by zero at total_iters; here the closed form gives the base rate back.
  RefSchedulerCase c = kSchedulerCases[2];
  c.config = "factor = 0.0\ntotal_iters = 2";
  h.set_config_text(config_text(c));
  auto sched = h.get<LRScheduler>("scheduler");
  EXPECT_EQ(sched->last_lrs(), (std::vector<double>{0.0, 0.0}));
  sched->step();
  sched->step();
  EXPECT_EQ(sched->last_lrs(), c.group_lrs);
}

TEST_F(SchedulerTest, ExampleConfigRunsOverAdamW) {
  h.load_plugin(MODALITIES_TEST_OPTIMIZERS_PLUGIN);
  h.load_plugin(MODALITIES_TEST_LAYER_NORM_PLUGIN);
  h.set_config_text(testing::read_file(kExample), kExample.string());
  ASSERT_EQ(h.build_error(), "");
  for (const char* key : {"dummy_lr", "step_lr", "constant_lr", "linear_lr", "cosine_annealing_lr", "onecycle_lr",
                          "linear_warmup_cosine_annealing_lr"})
    EXPECT_NE(h.get<LRScheduler>(key), nullptr) << key;
  // The OneCycle example (reference case onecycle_spec_example): about 6e-5 at step 0,
  // 6e-4 at step 9.
  const RefSchedulerCase& spec = kSchedulerCases[7];
  ASSERT_EQ(spec.name, "onecycle_spec_example");
  auto onecycle = h.get<LRScheduler>("onecycle_lr");
  EXPECT_EQ(onecycle->last_lrs()[0], spec.lrs[0][0]);
  EXPECT_NEAR(onecycle->last_lrs()[0], 6e-5, 1e-18);
  for (int i = 0; i < 9; ++i) onecycle->step();
  EXPECT_EQ(onecycle->last_lrs()[0], spec.lrs[9][0]);
  EXPECT_EQ(onecycle->last_lrs()[0], 6e-4);
  EXPECT_NEAR(h.get<LRScheduler>("linear_warmup_cosine_annealing_lr")->last_lrs()[0], 6e-6, 1e-18);
}

TEST_F(SchedulerTest, BadConfigsNameTheField) {
  struct Bad {
    std::size_t case_index;
    std::string key;  // set to `value` (TOML text) in scheduler.config
    std::string value;
    std::string expected;
  };
  const std::vector<Bad> bad = {
      {1, "step_size", "0", "scheduler.config.step_size"},
      {1, "gamma", "-0.5", "scheduler.config.gamma"},
      {1, "step_size", "2.5", "scheduler.config.step_size"},
      {1, "last_epoch", "-2", "scheduler.config.last_epoch"},
      {2, "factor", "1.5", "scheduler.config.factor"},
      {2, "total_iters", "0", "scheduler.config.total_iters"},
      {4, "start_factor", "0.0", "scheduler.config.start_factor"},
      {4, "end_factor", "1.5", "scheduler.config.end_factor"},
      {6, "t_max", "0", "scheduler.config.t_max"},
      {6, "eta_min", "-1.0", "scheduler.config.eta_min"},
      {6, "T_max", "10", "scheduler.config.T_max"},
      {8, "max_lr", "[0.01]", "scheduler.config.max_lr"},
      {8, "max_lr", "[0.01, 0.0]", "scheduler.config.max_lr[1]"},
      {8, "max_lr", "-1.0", "scheduler.config.max_lr"},
      {8, "pct_start", "0.0", "scheduler.config.pct_start"},
      {8, "pct_start", "0.033333333333333333", "scheduler.config.pct_start"},  // pct_start * 30 == 1
      {8, "anneal_strategy", "\"cosine\"", "scheduler.config.anneal_strategy"},
      {8, "div_factor", "0.0", "scheduler.config.div_factor"},
      {8, "base_momentum", "[0.8, 0.8, 0.8]", "scheduler.config.base_momentum"},
      {8, "max_momentum", "0.0", "scheduler.config.max_momentum"},
      {10, "total_steps", "2", "scheduler.config.total_steps"},
      {10, "initial_lr", "0.0", "scheduler.config.initial_lr"},
      {10, "max_lr", "0.5", "scheduler.config.max_lr"},
      {10, "warmup_steps", "0", "scheduler.config.warmup_steps"},
      {1, "last_epoch", "5", "scheduler.config.last_epoch"},  // resume without initial_lr in the groups
  };
  for (const Bad& b : bad) {
    RefSchedulerCase c = kSchedulerCases[b.case_index];
    std::string config;
    for (std::size_t pos = 0; pos < c.config.size();) {  // drop the line that sets b.key
      const std::size_t end = c.config.find('\n', pos);
      const std::string line = c.config.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
      if (!line.starts_with(b.key + " =")) config += line + "\n";
      pos = end == std::string::npos ? c.config.size() : end + 1;
    }
    c.config = config + b.key + " = " + b.value;
    h.set_config_text(config_text(c));
    EXPECT_THAT(h.build_error(), HasSubstr(b.expected)) << b.key << " = " << b.value;
  }
  // OneCycle needs total_steps or epochs and steps_per_epoch.
  RefSchedulerCase c = kSchedulerCases[8];
  c.config =
      "max_lr = 0.1\npct_start = 0.3\nanneal_strategy = \"cos\"\ndiv_factor = 25.0\nfinal_div_factor = 1e4\nepochs = 3";
  h.set_config_text(config_text(c));
  EXPECT_THAT(h.build_error(), HasSubstr("scheduler.config.total_steps"));
  // cycle_momentum needs betas (or momentum) in the optimizer.
  c = kSchedulerCases[8];
  h.set_config_text(config_text(c, "betas = false"));
  EXPECT_THAT(h.build_error(), HasSubstr("scheduler.config.cycle_momentum"));
}

}  // namespace
}  // namespace modalities::plugins::schedulers
