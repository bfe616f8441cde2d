// optimizer/adam and optimizer/adam_w: a tiny model with GPT-2 parameter names and weight-decay
// groups, 5 steps with fixed gradients (some parameters without a gradient at some steps) and a
// new learning rate per step (inputs from tests/data/adam_reference.inc). Two references:
//  - in-process, same library and machine: torch.optim's algorithm written out on ATen ops here
//    (single-tensor and foreach paths) and LibTorch's fused kernels called directly (fused path).
//    Parameters after every step and the final state must be bit-identical.
//  - PyTorch's torch.optim.Adam/AdamW run from Python (scripts/reference/optim_reference.py, torch
//    2.11.0, on another machine): equal within kMaxUlps, see ulp_close.
// Then state-dict round trips, zero_grad and config errors.
#include <modalities/core/graph.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/optimizer.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <regex>
#include <string>
#include <vector>

namespace modalities::plugins::optimizers {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

struct RefParam {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<float> values;
};
struct RefState {
  double step;
  std::vector<float> exp_avg, exp_avg_sq;
};
struct RefOptCase {
  std::string name, variant;
  double weight_decay;
  std::vector<std::string> excluded;
  bool fused;
  std::vector<std::vector<std::vector<float>>> after;  // [step][param] -> values
  std::vector<RefState> state;                         // [param]
};
#include "data/adam_reference.inc"

const fs::path kExample = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml";

at::Tensor to_tensor(const std::vector<float>& values, const std::vector<std::int64_t>& shape) {
  return at::tensor(at::ArrayRef<float>(values), at::kFloat).reshape(shape);
}

// model/tiny_gpt: the reference model's parameters, with GPT-2's weight-decay groups unless
// `groups` overrides them; `frozen` parameters do not require gradients; `empty` ones have no rows
// (what an FSDP rank holds of a tensor of fewer rows than ranks).
struct TinyGptConfig {
  std::map<std::string, std::vector<std::string>> groups = {
      {"linear", {".attn", ".mlp", ".lm_head.weight"}},
      {"embedding", {".wte", ".wpe"}},
      {"layernorm", {".attention_norm", ".ffn_norm", ".lm_head_norm"}}};
  std::vector<std::string> frozen;
  std::vector<std::string> empty;
  static void describe(Schema<TinyGptConfig>& s) {
    s.field("groups", &TinyGptConfig::groups, "weight-decay groups");
    s.field("frozen", &TinyGptConfig::frozen, "parameters without requires_grad");
    s.field("empty", &TinyGptConfig::empty, "parameters of zero rows");
  }
};

class TinyGpt final : public Module {
 public:
  explicit TinyGpt(const TinyGptConfig& c) : groups_(c.groups) {
    root_ = std::make_shared<torch::nn::Module>("TinyGpt");
    for (const RefParam& p : kParams) {
      const bool frozen = std::find(c.frozen.begin(), c.frozen.end(), p.name) != c.frozen.end();
      const bool empty = std::find(c.empty.begin(), c.empty.end(), p.name) != c.empty.end();
      const auto dot = p.name.rfind('.');
      at::Tensor t = to_tensor(p.values, p.shape);
      submodule(p.name.substr(0, dot))
          ->register_parameter(p.name.substr(dot + 1), empty ? t.narrow(0, 0, 0).clone() : t, !frozen);
    }
  }
  TensorMap forward(const TensorMap&) override { throw Error("tiny_gpt has no forward"); }
  torch::nn::Module& module() override { return *root_; }
  const torch::nn::Module& module() const override { return *root_; }
  std::map<std::string, std::vector<std::string>> weight_decay_groups() const override { return groups_; }

 private:
  std::shared_ptr<torch::nn::Module> submodule(const std::string& path) {
    if (path.empty()) return root_;
    if (auto it = subs_.find(path); it != subs_.end()) return it->second;
    const auto dot = path.rfind('.');
    const std::string parent = dot == std::string::npos ? "" : path.substr(0, dot);
    const std::string leaf = dot == std::string::npos ? path : path.substr(dot + 1);
    auto m = std::make_shared<torch::nn::Module>(leaf);
    submodule(parent)->register_module(leaf, m);
    return subs_[path] = m;
  }
  std::map<std::string, std::vector<std::string>> groups_;
  std::shared_ptr<torch::nn::Module> root_;
  std::map<std::string, std::shared_ptr<torch::nn::Module>> subs_;
};

void register_tiny_gpt(testing::Harness& h) {
  auto problem = h.registry().register_plugin({"optimizer_test_fakes", "0.0.0", {}, {}, {}}, [](Registrar& r) {
    r.add<Module, TinyGptConfig>("tiny_gpt", "test model",
                                 [](const TinyGptConfig& c) { return std::make_shared<TinyGpt>(c); });
  });
  ASSERT_FALSE(problem.has_value()) << *problem;
}

std::string list_toml(const std::vector<std::string>& xs) {
  std::string s = "[";
  for (std::size_t i = 0; i < xs.size(); ++i) s += (i ? ", \"" : "\"") + xs[i] + "\"";
  return s + "]";
}

// A config with model `model` (tiny_gpt) and optimizer `optimizer`; `extra` goes into optimizer.config.
std::string config_text(const std::string& variant, double weight_decay, const std::vector<std::string>& excluded,
                        const std::string& extra = "", const std::string& model_extra = "") {
  return fmt::format(R"(
[model]
component_key = "model"
variant_key = "tiny_gpt"
config = {{ {} }}

[optimizer]
component_key = "optimizer"
variant_key = "{}"

[optimizer.config]
wrapped_model = {{ instance_key = "model", pass_type = "BY_REFERENCE" }}
lr = 1e-3
betas = [{}, {}]
eps = {}
weight_decay = {}
weight_decay_groups_excluded = {}
{}
)",
                     model_extra, variant, format_float(kBeta1), format_float(kBeta2), format_float(kEps),
                     format_float(weight_decay), list_toml(excluded), extra);
}

std::map<std::string, at::Tensor> params_by_name(const Module& m) {
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : m.named_parameters()) out.emplace(name, t);
  return out;
}

void set_grads(const Module& m, std::size_t step) {
  auto params = params_by_name(m);
  for (std::size_t i = 0; i < kParams.size(); ++i) {
    const auto& g = kGrads[step][i];
    params.at(kParams[i].name).mutable_grad() = g.empty() ? at::Tensor() : to_tensor(g, kParams[i].shape);
  }
}

// Exact comparison; on failure says how far off and where.
::testing::AssertionResult same_bits(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  if (actual.sizes() != expected.sizes())
    return ::testing::AssertionFailure() << what << ": shape " << actual.sizes() << " vs " << expected.sizes();
  if (at::equal(actual, expected)) return ::testing::AssertionSuccess();
  const at::Tensor diff = (actual.to(at::kDouble) - expected.to(at::kDouble)).abs();
  const at::Tensor rel = diff / expected.to(at::kDouble).abs().clamp_min(1e-30);
  return ::testing::AssertionFailure() << what << ": max abs diff " << diff.max().item<double>() << ", max rel diff "
                                       << rel.max().item<double>() << ", "
                                       << at::ne(actual, expected).sum().item<int64_t>() << " element(s) differ";
}

// Comparison with values computed by another build of PyTorch on another machine. ATen's CPU
// kernels pick their vector width at run time (AVX2, AVX-512) and the scalar tail loops, FMA
// contraction in lerp/addcmul and the vectorised sqrt/div round differently by up to 1 ulp per
// op; a step has 6 rounded ops per element and there are 5 steps, so the bound is 8 ulps of the
// element, or 8 ulps of the tensor's largest magnitude for elements that passed through
// cancellation (e.g. an exp_avg that crosses zero). The largest distance seen is recorded in
// `worst_ulps` (0 on the machine that made the reference).
constexpr std::int64_t kMaxUlps = 8;
std::int64_t ordered_bits(float x) {
  std::int32_t i;
  std::memcpy(&i, &x, sizeof i);
  return i < 0 ? std::int64_t{INT32_MIN} - i : std::int64_t{i};  // monotone in x; +0 and -0 map to 0
}
::testing::AssertionResult ulp_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what,
                                     std::int64_t& worst_ulps) {
  if (actual.sizes() != expected.sizes())
    return ::testing::AssertionFailure() << what << ": shape " << actual.sizes() << " vs " << expected.sizes();
  const at::Tensor a = actual.contiguous().to(at::kFloat), e = expected.contiguous().to(at::kFloat);
  const float* pa = a.data_ptr<float>();
  const float* pe = e.data_ptr<float>();
  float scale = 0;
  for (std::int64_t i = 0; i < e.numel(); ++i) scale = std::max(scale, std::abs(pe[i]));
  const double floor = kMaxUlps * (std::nextafter(scale, INFINITY) - scale);
  for (std::int64_t i = 0; i < e.numel(); ++i) {
    const std::int64_t ulps = std::abs(ordered_bits(pa[i]) - ordered_bits(pe[i]));
    worst_ulps = std::max(worst_ulps, ulps);
    if (ulps > kMaxUlps && std::abs(static_cast<double>(pa[i]) - pe[i]) > floor)
      return ::testing::AssertionFailure()
             << what << ": element " << i << " is " << fmt::format("{:a}", pa[i]) << ", expected "
             << fmt::format("{:a}", pe[i]) << " (" << ulps << " ulps apart; allowed " << kMaxUlps << ")";
  }
  return ::testing::AssertionSuccess();
}

// Parameters after every step and the final optimizer state of one reference case.
struct Trajectory {
  std::vector<std::vector<at::Tensor>> after;   // [step][param]
  std::vector<double> steps;                    // [param]
  std::vector<at::Tensor> exp_avg, exp_avg_sq;  // [param]
};

Trajectory python_trajectory(const RefOptCase& c) {
  Trajectory t;
  for (const auto& step : c.after) {
    t.after.emplace_back();
    for (std::size_t i = 0; i < kParams.size(); ++i) t.after.back().push_back(to_tensor(step[i], kParams[i].shape));
  }
  for (std::size_t i = 0; i < kParams.size(); ++i) {
    t.steps.push_back(c.state[i].step);
    t.exp_avg.push_back(to_tensor(c.state[i].exp_avg, kParams[i].shape));
    t.exp_avg_sq.push_back(to_tensor(c.state[i].exp_avg_sq, kParams[i].shape));
  }
  return t;
}

// The weight decay of a parameter: the case's, unless one of the excluded groups' patterns
// (TinyGptConfig's default groups, searched as regexes like Modalities does) matches its name.
double weight_decay_of(const RefOptCase& c, const std::string& name) {
  static const TinyGptConfig kConfig;  // a named object: the range below must not refer into a temporary
  for (const std::string& group : c.excluded)
    for (const std::string& pattern : kConfig.groups.at(group))
      if (std::regex_search(name, std::regex(pattern))) return 0.0;
  return c.weight_decay;
}

// The in-process reference: torch.optim.adam._single_tensor_adam (PyTorch 2.11, amsgrad, maximize
// and capturable off) written out on ATen ops independently of the plugin, or for fused cases
// LibTorch's own fused kernel (torch.optim.adam._fused_adam) called directly.
Trajectory libtorch_trajectory(const RefOptCase& c) {
  const bool decoupled = c.variant == "adam_w";
  std::vector<at::Tensor> params, exp_avgs, exp_avg_sqs, steps;
  for (const RefParam& p : kParams) {
    params.push_back(to_tensor(p.values, p.shape));
    exp_avgs.push_back(at::zeros(p.shape));
    exp_avg_sqs.push_back(at::zeros(p.shape));
    steps.push_back(at::zeros({}));
  }
  Trajectory t;
  for (std::size_t k = 0; k < kStepLrs.size(); ++k) {
    const double lr = kStepLrs[k];
    for (std::size_t i = 0; i < kParams.size(); ++i) {
      if (kGrads[k][i].empty()) continue;
      at::Tensor grad = to_tensor(kGrads[k][i], kParams[i].shape);
      const double wd = weight_decay_of(c, kParams[i].name);
      if (c.fused) {
        steps[i].add_(1);
        if (decoupled)
          at::_fused_adamw_({params[i]}, {grad}, {exp_avgs[i]}, {exp_avg_sqs[i]}, {}, {steps[i]}, lr, kBeta1, kBeta2,
                            wd, kEps, false, false);
        else
          at::_fused_adam_({params[i]}, {grad}, {exp_avgs[i]}, {exp_avg_sqs[i]}, {}, {steps[i]}, lr, kBeta1, kBeta2, wd,
                           kEps, false, false);
        continue;
      }
      steps[i] += 1;
      if (wd != 0) {
        if (decoupled) params[i].mul_(1 - lr * wd);
        else grad = grad.add(params[i], wd);
      }
      exp_avgs[i].lerp_(grad, 1 - kBeta1);
      exp_avg_sqs[i].mul_(kBeta2).addcmul_(grad, grad, 1 - kBeta2);
      const double step = steps[i].item<double>();
      const double bias_correction1 = 1 - std::pow(kBeta1, step);
      const double bias_correction2 = 1 - std::pow(kBeta2, step);
      const at::Tensor denom = (exp_avg_sqs[i].sqrt() / std::sqrt(bias_correction2)).add_(kEps);
      params[i].addcdiv_(exp_avgs[i], denom, -(lr / bias_correction1));
    }
    t.after.emplace_back();
    for (const at::Tensor& p : params) t.after.back().push_back(p.clone());
  }
  for (std::size_t i = 0; i < kParams.size(); ++i) {
    t.steps.push_back(steps[i].item<double>());
    t.exp_avg.push_back(exp_avgs[i]);
    t.exp_avg_sq.push_back(exp_avg_sqs[i]);
  }
  return t;
}

class OptimizerTest : public ::testing::Test {
 protected:
  void SetUp() override { register_tiny_gpt(h); }
  testing::Harness h{MODALITIES_TEST_PLUGIN};
};

// How a run is compared with its reference: bit for bit, or within kMaxUlps (recording the
// largest distance seen).
struct Compare {
  std::int64_t* worst_ulps = nullptr;  // null: bit for bit
  ::testing::AssertionResult operator()(const at::Tensor& actual, const at::Tensor& expected,
                                        const std::string& what) const {
    return worst_ulps == nullptr ? same_bits(actual, expected, what) : ulp_close(actual, expected, what, *worst_ulps);
  }
};

// Runs the reference case's steps [first, last) on `opt` over `model`.
void run_steps(const RefOptCase& c, Module& model, Optimizer& opt, std::size_t first, std::size_t last,
               const Trajectory& expected, Compare compare = {}) {
  for (std::size_t k = first; k < last; ++k) {
    for (std::size_t g = 0; g < opt.num_param_groups(); ++g) opt.set_learning_rate(g, kStepLrs[k]);
    set_grads(model, k);
    opt.step();
    auto params = params_by_name(model);
    for (std::size_t i = 0; i < kParams.size(); ++i)
      ASSERT_TRUE(compare(params.at(kParams[i].name), expected.after[k][i],
                          fmt::format("{} step {} {}", c.name, k, kParams[i].name)));
  }
}

void expect_final_state(const RefOptCase& c, const Optimizer& opt, const Trajectory& expected, Compare compare = {}) {
  const StateDict sd = opt.state_dict();
  for (std::size_t i = 0; i < kParams.size(); ++i) {
    const std::string prefix = "state." + kParams[i].name + ".";
    const at::Tensor step = sd.at(prefix + "step");
    EXPECT_EQ(step.scalar_type(), at::kFloat);
    EXPECT_EQ(step.dim(), 0);
    EXPECT_EQ(step.item<double>(), expected.steps[i]) << c.name << " " << kParams[i].name;
    EXPECT_TRUE(compare(sd.at(prefix + "exp_avg"), expected.exp_avg[i], c.name + " exp_avg " + kParams[i].name));
    EXPECT_TRUE(
        compare(sd.at(prefix + "exp_avg_sq"), expected.exp_avg_sq[i], c.name + " exp_avg_sq " + kParams[i].name));
  }
}

TEST_F(OptimizerTest, BuildsFromExampleConfig) {
  testing::Harness example{MODALITIES_TEST_PLUGIN};
  example.load_plugin(MODALITIES_TEST_LAYER_NORM_PLUGIN);  // the example's model
  example.set_config_text(testing::read_file(kExample), kExample.string());
  ASSERT_EQ(example.build_error(), "");
  auto opt = example.get<Optimizer>("optimizer");
  ASSERT_NE(opt, nullptr);
  EXPECT_EQ(opt->num_param_groups(), 1u);
  EXPECT_EQ(opt->learning_rates(), std::vector<double>{6e-4});
  EXPECT_NE(example.get<Optimizer>("adam_optimizer"), nullptr);
}

// Runs every reference case on every path that must reproduce it (single-tensor, foreach and
// the default for unfused cases; fused for fused ones).
template <class Check>
void for_each_case_and_path(testing::Harness& h, Check check) {
  for (const RefOptCase& c : kOptCases) {
    const std::vector<std::string> impls = c.fused ? std::vector<std::string>{"fused = true"}
                                                   : std::vector<std::string>{"foreach = false", "foreach = true", ""};
    for (const std::string& impl : impls) {
      SCOPED_TRACE(c.name + " [" + impl + "]");
      h.set_config_text(config_text(c.variant, c.weight_decay, c.excluded, impl));
      auto model = h.get<Module>("model");
      auto opt = h.get<Optimizer>("optimizer");
      ASSERT_NE(opt, nullptr) << h.build_error();
      const bool grouped = c.weight_decay != 0 && !c.excluded.empty();
      ASSERT_EQ(opt->num_param_groups(), grouped ? 2u : 1u);
      check(c, *model, *opt);
    }
  }
}

// Same library, same machine: bit for bit.
TEST_F(OptimizerTest, MatchesTorchOptimAlgorithmInProcessBitForBit) {
  for_each_case_and_path(h, [](const RefOptCase& c, Module& model, Optimizer& opt) {
    const Trajectory expected = libtorch_trajectory(c);
    run_steps(c, model, opt, 0, kStepLrs.size(), expected);
    expect_final_state(c, opt, expected);
  });
}

// PyTorch's torch.optim from Python, computed elsewhere: within kMaxUlps.
TEST_F(OptimizerTest, MatchesPythonTorchOptimWithinUlps) {
  std::int64_t worst_ulps = 0;
  for_each_case_and_path(h, [&](const RefOptCase& c, Module& model, Optimizer& opt) {
    const Trajectory expected = python_trajectory(c);
    run_steps(c, model, opt, 0, kStepLrs.size(), expected, Compare{&worst_ulps});
    expect_final_state(c, opt, expected, Compare{&worst_ulps});
  });
  std::printf("[adam vs torch.optim] largest distance: %lld ulp(s) (allowed %lld)\n",
              static_cast<long long>(worst_ulps), static_cast<long long>(kMaxUlps));
}

TEST_F(OptimizerTest, WeightDecayGroupsFollowTheModelsRegexes) {
  h.set_config_text(config_text("adam_w", 0.1, {"embedding", "layernorm"}));
  auto opt = h.get<Optimizer>("optimizer");
  ASSERT_NE(opt, nullptr);
  ASSERT_EQ(opt->num_param_groups(), 2u);
  EXPECT_EQ(opt->group_option(0, "weight_decay"), 0.1);
  EXPECT_EQ(opt->group_option(1, "weight_decay"), 0.0);
  const StateDict sd = opt->state_dict();
  // Decayed: attention, MLP, lm_head; not decayed: embeddings and norms.
  for (const char* name :
       {"transformer.h.0.attn.q_attn.weight", "transformer.h.0.mlp.W.bias", "transformer.lm_head.weight"})
    EXPECT_EQ(sd.at(fmt::format("param_groups.{}.weight_decay", name)).item<double>(), 0.1) << name;
  for (const char* name : {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.attention_norm.bias",
                           "transformer.lm_head_norm.weight"})
    EXPECT_EQ(sd.at(fmt::format("param_groups.{}.weight_decay", name)).item<double>(), 0.0) << name;
}

TEST_F(OptimizerTest, OneGroupWhenWeightDecayIsZeroOrNothingIsExcluded) {
  for (auto [wd, excluded] :
       {std::pair{0.0, std::vector<std::string>{"embedding"}}, std::pair{0.1, std::vector<std::string>{}}}) {
    h.set_config_text(config_text("adam", wd, excluded));
    auto opt = h.get<Optimizer>("optimizer");
    ASSERT_NE(opt, nullptr);
    EXPECT_EQ(opt->num_param_groups(), 1u);
    EXPECT_EQ(opt->group_option(0, "weight_decay"), wd);
  }
}

TEST_F(OptimizerTest, FrozenParametersAreNotOptimized) {
  h.set_config_text(
      config_text("adam_w", 0.1, {"embedding", "layernorm"}, "", R"(frozen = ["transformer.wpe.weight"])"));
  auto opt = h.get<Optimizer>("optimizer");
  ASSERT_NE(opt, nullptr) << h.build_error();
  EXPECT_FALSE(opt->state_dict().contains("param_groups.transformer.wpe.weight.lr"));
  EXPECT_TRUE(opt->state_dict().contains("param_groups.transformer.wte.weight.lr"));
}

TEST_F(OptimizerTest, UnknownExcludedGroupWarns) {
  h.set_config_text(config_text("adam_w", 0.1, {"embedding", "layernorm", "rotary"}));
  core::ComponentGraph graph(h.registry(), h.config(), nullptr);
  std::vector<std::string> lines;
  graph.build([&](const std::string& line) { lines.push_back(line); });
  bool warned = false;
  for (const auto& line : lines)
    warned = warned || (line.find("warning") != std::string::npos && line.find("'rotary'") != std::string::npos);
  EXPECT_TRUE(warned) << fmt::format("{}", fmt::join(lines, "\n"));
}

TEST_F(OptimizerTest, EmptyGroupIsAnError) {
  h.set_config_text(config_text("adam_w", 0.1, {"embedding", "layernorm", "linear"}));
  EXPECT_THAT(h.build_error(), AllOf(HasSubstr("optimizer.config.weight_decay_groups_excluded"),
                                     HasSubstr("'with_weight_decay'"), HasSubstr("is empty")));
  h.set_config_text(config_text("adam_w", 0.1, {"nothing"}));
  EXPECT_THAT(h.build_error(), HasSubstr("'without_weight_decay'"));
}

TEST_F(OptimizerTest, ParametersMatchedTwiceOrNeverAreAnError) {
  // No group matches the MLP: its two tensors are missing from the split.
  h.set_config_text(config_text(
      "adam_w", 0.1, {"embedding"}, "",
      R"(groups = { linear = [".attn", ".lm_head.weight"], embedding = [".wte", ".wpe"], norms = ["_norm"] })"));
  EXPECT_THAT(h.build_error(),
              AllOf(HasSubstr("inconsistent number of parameters"), HasSubstr("found 108, should be 138"),
                    HasSubstr("'transformer.h.0.mlp.W.weight'")));
  // ".weight" matches nearly everything a second time.
  h.set_config_text(config_text(
      "adam_w", 0.1, {"embedding"}, "",
      R"(groups = { linear = [".attn", ".mlp", ".lm_head.weight"], embedding = [".wte", ".wpe"], other = ["_norm", "weight"] })"));
  EXPECT_THAT(h.build_error(), AllOf(HasSubstr("matched by several"), HasSubstr("'transformer.wte.weight'")));
}

TEST_F(OptimizerTest, StateDictRoundTripContinuesBitForBit) {
  const RefOptCase& c = kOptCases[1];  // adamw_groups
  ASSERT_EQ(c.name, "adamw_groups");
  h.set_config_text(config_text(c.variant, c.weight_decay, c.excluded));
  auto model = h.get<Module>("model");
  auto opt = h.get<Optimizer>("optimizer");
  const Trajectory expected = libtorch_trajectory(c);
  run_steps(c, *model, *opt, 0, 2, expected);
  opt->set_group_option(0, "initial_lr", 0.25);  // a scheduler's key must round-trip
  StateDict saved;
  for (const auto& [k, v] : opt->state_dict()) saved.emplace(k, v.clone());
  const StateDict model_saved = model->state_dict();

  testing::Harness h2{MODALITIES_TEST_PLUGIN};
  register_tiny_gpt(h2);
  h2.set_config_text(config_text(c.variant, c.weight_decay, c.excluded, "foreach = false"));
  auto model2 = h2.get<Module>("model");
  auto opt2 = h2.get<Optimizer>("optimizer");
  {
    at::NoGradGuard no_grad;
    model2->load_state_dict(model_saved, /*strict=*/true);
  }
  opt2->load_state_dict(saved);
  EXPECT_EQ(opt2->group_option(0, "initial_lr"), 0.25);
  EXPECT_EQ(opt2->group_option(1, "initial_lr"), std::nullopt);
  EXPECT_EQ(opt2->learning_rates(), opt->learning_rates());
  run_steps(c, *model2, *opt2, 2, kStepLrs.size(), expected);
  expect_final_state(c, *opt2, expected);
}

TEST_F(OptimizerTest, StateDictKeysFollowTheSdkNote) {
  h.set_config_text(config_text("adam_w", 0.1, {"embedding", "layernorm"}));
  auto model = h.get<Module>("model");
  auto opt = h.get<Optimizer>("optimizer");
  StateDict sd = opt->state_dict();
  EXPECT_EQ(sd.size(), kParams.size() * 5);  // no state before the first step
  const at::Tensor lr = sd.at("param_groups.transformer.h.0.mlp.W.bias.lr");
  EXPECT_EQ(lr.scalar_type(), at::kDouble);
  EXPECT_EQ(lr.dim(), 0);
  EXPECT_EQ(sd.at("param_groups.transformer.h.0.mlp.W.bias.betas.0").item<double>(), kBeta1);
  EXPECT_EQ(sd.at("param_groups.transformer.h.0.mlp.W.bias.betas.1").item<double>(), kBeta2);
  EXPECT_EQ(sd.at("param_groups.transformer.h.0.mlp.W.bias.eps").item<double>(), kEps);
  set_grads(*model, 0);  // wpe has no gradient at step 0
  opt->step();
  sd = opt->state_dict();
  EXPECT_EQ(sd.size(), kParams.size() * 5 + (kParams.size() - 1) * 3);
  EXPECT_TRUE(sd.contains("state.transformer.wte.weight.exp_avg_sq"));
  EXPECT_FALSE(sd.contains("state.transformer.wpe.weight.step"));
}

TEST_F(OptimizerTest, LoadStateDictRejectsForeignKeysAndMissingParameters) {
  h.set_config_text(config_text("adam_w", 0.1, {"embedding", "layernorm"}));
  auto opt = h.get<Optimizer>("optimizer");
  StateDict sd = opt->state_dict();
  StateDict extra = sd;
  extra.emplace("param_groups.transformer.h.1.mlp.W.weight.lr", at::scalar_tensor(1.0, at::kDouble));
  try {
    opt->load_state_dict(extra);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("transformer.h.1.mlp.W.weight"));
  }
  StateDict missing = sd;
  missing.erase("param_groups.transformer.wte.weight.lr");
  try {
    opt->load_state_dict(missing);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("param_groups.transformer.wte.weight.lr"));
  }
  StateDict bad_shape = sd;
  bad_shape.emplace("state.transformer.wte.weight.step", at::scalar_tensor(1.0, at::kFloat));
  bad_shape.emplace("state.transformer.wte.weight.exp_avg", at::zeros({3}));
  bad_shape.emplace("state.transformer.wte.weight.exp_avg_sq", at::zeros({8, 4}));
  try {
    opt->load_state_dict(bad_shape);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("state.transformer.wte.weight.exp_avg has shape [3]"));
  }
}

// A checkpoint written at another layout holds the state of a parameter whose shard is empty on
// this rank (FSDP on more ranks than the tensor has rows): that rank does not optimize it, and
// loading skips its entries; a key of no parameter at all is still refused.
TEST_F(OptimizerTest, LoadStateDictSkipsTheStateOfEmptyShards) {
  h.set_config_text(config_text("adam_w", 0.1, {"embedding", "layernorm"}));
  auto model = h.get<Module>("model");
  auto opt = h.get<Optimizer>("optimizer");
  ASSERT_NE(opt, nullptr) << h.build_error();
  set_grads(*model, 0);
  opt->step();
  const StateDict full = opt->state_dict();
  ASSERT_TRUE(full.contains("state.transformer.wte.weight.exp_avg"));

  testing::Harness h2{MODALITIES_TEST_PLUGIN};
  register_tiny_gpt(h2);
  h2.set_config_text(
      config_text("adam_w", 0.1, {"embedding", "layernorm"}, "", R"(empty = ["transformer.wte.weight"])"));
  auto opt2 = h2.get<Optimizer>("optimizer");
  ASSERT_NE(opt2, nullptr) << h2.build_error();
  EXPECT_FALSE(opt2->state_dict().contains("param_groups.transformer.wte.weight.lr"));
  opt2->load_state_dict(full);
  EXPECT_TRUE(at::equal(opt2->state_dict().at("state.transformer.h.0.mlp.W.weight.exp_avg"),
                        full.at("state.transformer.h.0.mlp.W.weight.exp_avg")));
  EXPECT_FALSE(opt2->state_dict().contains("state.transformer.wte.weight.exp_avg"));
  StateDict extra = full;
  extra.emplace("param_groups.transformer.h.1.mlp.W.weight.lr", at::scalar_tensor(1.0, at::kDouble));
  EXPECT_THAT([&] { opt2->load_state_dict(extra); },
              ::testing::ThrowsMessage<Error>(HasSubstr("transformer.h.1.mlp.W.weight")));
}

TEST_F(OptimizerTest, ZeroGradSetsToNoneOrZeroes) {
  h.set_config_text(config_text("adam", 0.0, {}));
  auto model = h.get<Module>("model");
  auto opt = h.get<Optimizer>("optimizer");
  set_grads(*model, 2);
  opt->zero_grad(/*set_to_none=*/false);
  for (auto& [name, p] : model->named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_EQ(p.grad().abs().sum().item<double>(), 0.0) << name;
  }
  opt->zero_grad();
  for (auto& [name, p] : model->named_parameters()) EXPECT_FALSE(p.grad().defined()) << name;
}

TEST_F(OptimizerTest, GroupOptionsAndErrors) {
  h.set_config_text(config_text("adam_w", 0.1, {"embedding", "layernorm"}));
  auto opt = h.get<Optimizer>("optimizer");
  opt->set_group_option(1, "betas.0", 0.85);
  EXPECT_EQ(opt->group_option(1, "betas.0"), 0.85);
  EXPECT_EQ(opt->group_option(0, "betas.0"), kBeta1);
  EXPECT_EQ(opt->group_option(0, "momentum"), std::nullopt);
  opt->set_learning_rate(1, 0.5);
  EXPECT_EQ(opt->learning_rates(), (std::vector<double>{1e-3, 0.5}));
  EXPECT_THROW(opt->set_learning_rate(2, 0.5), Error);
  EXPECT_THROW(opt->group_option(7, "lr"), Error);
}

TEST_F(OptimizerTest, BadConfigsNameTheField) {
  const auto error_for = [&](const std::string& extra_or_override, const std::string& variant = "adam_w") {
    h.set_config_text(config_text(variant, 0.1, {}, extra_or_override));
    return h.build_error();
  };
  h.set_config_text(config_text("adam_w", 0.1, {}));
  h.set("optimizer.config.betas", Value(Value::List{Value(0.9), Value(1.0)}));
  EXPECT_THAT(h.build_error(), HasSubstr("optimizer.config.betas[1]"));
  h.set("optimizer.config.betas", Value(Value::List{Value(-0.1), Value(0.9)}));
  EXPECT_THAT(h.build_error(), HasSubstr("optimizer.config.betas[0]"));
  h.set("optimizer.config.betas", Value(Value::List{Value(0.9)}));
  EXPECT_THAT(h.build_error(), HasSubstr("optimizer.config.betas"));
  h.set_config_text(config_text("adam_w", 0.1, {}));
  h.set("optimizer.config.lr", Value(-1.0));
  EXPECT_THAT(h.build_error(), HasSubstr("optimizer.config.lr"));
  h.set_config_text(config_text("adam_w", 0.1, {}));
  h.set("optimizer.config.eps", Value(-1e-8));
  EXPECT_THAT(h.build_error(), HasSubstr("optimizer.config.eps"));
  h.set_config_text(config_text("adam", 0.1, {}));
  h.set("optimizer.config.weight_decay", Value(-0.1));
  EXPECT_THAT(h.build_error(), HasSubstr("optimizer.config.weight_decay"));
  h.set_config_text(config_text("adam", 0.1, {}));
  h.erase("optimizer.config.weight_decay_groups_excluded");
  EXPECT_THAT(h.build_error(), HasSubstr("optimizer.config.weight_decay_groups_excluded"));
  EXPECT_THAT(error_for("foreach = true\nfused = true"), HasSubstr("optimizer.config.fused"));
  EXPECT_THAT(error_for("amsgrad = true"), HasSubstr("optimizer.config.amsgrad"));
  h.set_config_text(config_text("adam", 0.1, {}));
  h.set("optimizer.config.wrapped_model", Value(Value::List{}));
  EXPECT_THAT(h.build_error(), HasSubstr("optimizer.config.wrapped_model"));
}

TEST_F(OptimizerTest, ListOfModelPartsIsOneOptimizer) {
  const std::string ref = R"(wrapped_model = { instance_key = "model", pass_type = "BY_REFERENCE" })";
  const std::string second_model = R"(
[model2]
component_key = "model"
variant_key = "tiny_gpt"
config = {}
)";
  std::string text = config_text("adam_w", 0.1, {"embedding", "layernorm"}) + second_model;
  // Two parts with the same parameter names: state is keyed by name, so this is an error.
  std::string two = text;
  two.replace(
      two.find(ref), ref.size(),
      R"(wrapped_model = [{ instance_key = "model", pass_type = "BY_REFERENCE" }, { instance_key = "model2", pass_type = "BY_REFERENCE" }])");
  h.set_config_text(two);
  EXPECT_THAT(h.build_error(),
              AllOf(HasSubstr("optimizer.config.wrapped_model"), HasSubstr("occurs in two model parts")));
  std::string one = text;
  one.replace(one.find(ref), ref.size(), R"(wrapped_model = [{ instance_key = "model", pass_type = "BY_REFERENCE" }])");
  h.set_config_text(one);
  auto opt = h.get<Optimizer>("optimizer");
  ASSERT_NE(opt, nullptr) << h.build_error();
  EXPECT_EQ(opt->num_param_groups(), 2u);
}

// ~13M parameters shaped like the tutorial GPT-2 (plugins/gpt2/README.md): time one step of each path.
TEST_F(OptimizerTest, StepTimeOfTheTutorialModelSize) {
  if (std::getenv("MODALITIES_OPTIMIZER_BENCH") == nullptr) GTEST_SKIP() << "set MODALITIES_OPTIMIZER_BENCH=1";
  struct Big final : Module {
    Big() {
      root = std::make_shared<torch::nn::Module>("Big");
      std::vector<std::vector<std::int64_t>> shapes = {{50304, 128}};
      for (int l = 0; l < 2; ++l)
        for (auto s : std::vector<std::vector<std::int64_t>>{{128},
                                                             {128},
                                                             {128},
                                                             {128},
                                                             {128, 128},
                                                             {64, 128},
                                                             {64, 128},
                                                             {128, 128},
                                                             {256, 128},
                                                             {256, 128},
                                                             {128, 256}})
          shapes.push_back(s);
      shapes.insert(shapes.end(), {{128}, {128}, {50304, 128}});
      for (std::size_t i = 0; i < shapes.size(); ++i) {
        at::Tensor p = root->register_parameter("p" + std::to_string(i), at::randn(shapes[i]));
        p.mutable_grad() = at::randn(shapes[i]);
      }
    }
    TensorMap forward(const TensorMap&) override { return {}; }
    torch::nn::Module& module() override { return *root; }
    const torch::nn::Module& module() const override { return *root; }
    std::shared_ptr<torch::nn::Module> root;
  };
  auto problem = h.registry().register_plugin({"bench_model", "0.0.0", {}, {}, {}}, [](Registrar& r) {
    r.add<Module, TinyGptConfig>("big", "bench model", [](const TinyGptConfig&) { return std::make_shared<Big>(); });
  });
  ASSERT_FALSE(problem.has_value());
  for (const std::string impl : {"foreach = false", "foreach = true", "fused = true"}) {
    std::string text = config_text("adam_w", 0.1, {}, impl);
    text.replace(text.find("tiny_gpt"), 8, "big");
    h.set_config_text(text);
    auto opt = h.get<Optimizer>("optimizer");
    for (int i = 0; i < 3; ++i) opt->step();
    std::vector<double> ms;  // the machine may be shared: report the minimum and the median
    for (int i = 0; i < 20; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      opt->step();
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    std::printf("adam_w step, 13,174,016 parameters, %s, %d threads: min %.1f ms, median %.1f ms\n", impl.c_str(),
                at::get_num_threads(), ms.front(), ms[ms.size() / 2]);
  }
}

}  // namespace
}  // namespace modalities::plugins::optimizers
