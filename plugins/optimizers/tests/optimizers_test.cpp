// optimizer/adam and optimizer/adam_w against torch.optim (tests/data/adam_reference.inc, made by
// scripts/reference/optim_reference.py): a tiny model with GPT-2 parameter names and weight-decay
// groups, 5 steps with fixed gradients (some parameters without a gradient at some steps) and a
// new learning rate per step. Parameters after every step and the final state must be
// bit-identical on the single-tensor and foreach paths; the fused path is compared with PyTorch's
// fused kernels, also bit for bit. Then state-dict round trips, zero_grad and config errors.
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
#include <cstdlib>
#include <filesystem>
#include <map>
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
// `groups` overrides them; `frozen` parameters do not require gradients.
struct TinyGptConfig {
  std::map<std::string, std::vector<std::string>> groups = {
      {"linear", {".attn", ".mlp", ".lm_head.weight"}},
      {"embedding", {".wte", ".wpe"}},
      {"layernorm", {".attention_norm", ".ffn_norm", ".lm_head_norm"}}};
  std::vector<std::string> frozen;
  static void describe(Schema<TinyGptConfig>& s) {
    s.field("groups", &TinyGptConfig::groups, "weight-decay groups");
    s.field("frozen", &TinyGptConfig::frozen, "parameters without requires_grad");
  }
};

class TinyGpt final : public Module {
 public:
  explicit TinyGpt(const TinyGptConfig& c) : groups_(c.groups) {
    root_ = std::make_shared<torch::nn::Module>("TinyGpt");
    for (const RefParam& p : kParams) {
      const bool frozen = std::find(c.frozen.begin(), c.frozen.end(), p.name) != c.frozen.end();
      const auto dot = p.name.rfind('.');
      submodule(p.name.substr(0, dot))
          ->register_parameter(p.name.substr(dot + 1), to_tensor(p.values, p.shape), !frozen);
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

class OptimizerTest : public ::testing::Test {
 protected:
  void SetUp() override { register_tiny_gpt(h); }
  testing::Harness h{MODALITIES_TEST_PLUGIN};
};

// Runs the reference case's steps [first, last) on `opt` over `model`.
void run_steps(const RefOptCase& c, Module& model, Optimizer& opt, std::size_t first, std::size_t last) {
  for (std::size_t k = first; k < last; ++k) {
    for (std::size_t g = 0; g < opt.num_param_groups(); ++g) opt.set_learning_rate(g, kStepLrs[k]);
    set_grads(model, k);
    opt.step();
    auto params = params_by_name(model);
    for (std::size_t i = 0; i < kParams.size(); ++i)
      ASSERT_TRUE(same_bits(params.at(kParams[i].name), to_tensor(c.after[k][i], kParams[i].shape),
                            fmt::format("{} step {} {}", c.name, k, kParams[i].name)));
  }
}

void expect_final_state(const RefOptCase& c, const Optimizer& opt) {
  const StateDict sd = opt.state_dict();
  for (std::size_t i = 0; i < kParams.size(); ++i) {
    const std::string prefix = "state." + kParams[i].name + ".";
    const at::Tensor step = sd.at(prefix + "step");
    EXPECT_EQ(step.scalar_type(), at::kFloat);
    EXPECT_EQ(step.dim(), 0);
    EXPECT_EQ(step.item<double>(), c.state[i].step) << c.name << " " << kParams[i].name;
    EXPECT_TRUE(same_bits(sd.at(prefix + "exp_avg"), to_tensor(c.state[i].exp_avg, kParams[i].shape),
                          c.name + " exp_avg " + kParams[i].name));
    EXPECT_TRUE(same_bits(sd.at(prefix + "exp_avg_sq"), to_tensor(c.state[i].exp_avg_sq, kParams[i].shape),
                          c.name + " exp_avg_sq " + kParams[i].name));
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

// Every reference case on every path that must reproduce it bit for bit.
TEST_F(OptimizerTest, MatchesTorchOptimBitForBit) {
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
      run_steps(c, *model, *opt, 0, kStepLrs.size());
      expect_final_state(c, *opt);
    }
  }
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
  run_steps(c, *model, *opt, 0, 2);
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
  run_steps(c, *model2, *opt2, 2, kStepLrs.size());
  expect_final_state(c, *opt2);
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

// ~13M parameters shaped like the tutorial GPT-2 (model.md §8): time one step of each path.
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
