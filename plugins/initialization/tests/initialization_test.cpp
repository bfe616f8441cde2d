// initialization: composed and Llama-3-like initializers and model/model_initialized,
// built through the registry from TOML. The model is a stand-in defined here
// (model/tiny_gpt2: GPT-2 parameter names and shapes, no forward), registered
// in-process, so the tests do not depend on the gpt2 plugin.
//
// Distribution checks use a fixed seed and groups of 65k..800k elements; the
// tolerance is 6 standard errors (mean: 6·σ/√n, std: 6·σ/√(2n)), which a
// wrong std (e.g. 0.02 vs 0.02/√6, or Kaiming-uniform's 1/√(3·fan_in)) misses
// by far.
#include "../src/truncated_normal.h"

#include <modalities/sdk/interfaces/model_initializer.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/run_context.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <cmath>
#include <regex>
#include <string>
#include <vector>

namespace modalities::plugins::initialization {
namespace {

using ::testing::HasSubstr;

// --- the stand-in model ----------------------------------------------------------

struct TinyGpt2Config {
  std::int64_t n_layer = 3;
  std::int64_t n_embd = 256;
  std::int64_t vocab_size = 1024;
  std::int64_t ffn_hidden = 512;
  std::int64_t sequence_length = 64;
  std::string activation = "swiglu";
  bool bias = false;
  bool norm_bias = true;
  bool use_weight_tying = false;
  bool absolute_positions = false;
  bool use_meta_device = false;
  bool mixed_meta = false;     // wte materialized, everything else on meta
  bool supports_reset = true;  // false: reset_parameters() is the SDK default (throws)
  std::string block_infix;     // inserted after "transformer.h.<i>." (a wrapper leaking its name)

  static void describe(Schema<TinyGpt2Config>& s) {
    s.field("n_layer", &TinyGpt2Config::n_layer, "");
    s.field("n_embd", &TinyGpt2Config::n_embd, "");
    s.field("vocab_size", &TinyGpt2Config::vocab_size, "");
    s.field("ffn_hidden", &TinyGpt2Config::ffn_hidden, "");
    s.field("sequence_length", &TinyGpt2Config::sequence_length, "");
    s.field("activation", &TinyGpt2Config::activation, "").one_of({"swiglu", "gelu"});
    s.field("bias", &TinyGpt2Config::bias, "");
    s.field("norm_bias", &TinyGpt2Config::norm_bias, "");
    s.field("use_weight_tying", &TinyGpt2Config::use_weight_tying, "");
    s.field("absolute_positions", &TinyGpt2Config::absolute_positions, "");
    s.field("use_meta_device", &TinyGpt2Config::use_meta_device, "");
    s.field("mixed_meta", &TinyGpt2Config::mixed_meta, "");
    s.field("supports_reset", &TinyGpt2Config::supports_reset, "");
    s.field("block_infix", &TinyGpt2Config::block_infix, "");
  }
};

constexpr std::int64_t kHeadDim = 16;

class TinyGpt2 final : public Module {
 public:
  explicit TinyGpt2(const TinyGpt2Config& c) : c_(c), root_(std::make_shared<torch::nn::Module>("TinyGpt2")) {
    const std::int64_t d = c.n_embd, h = c.ffn_hidden, kv = c.n_embd / 2;
    wte_ = add("transformer.wte.weight", {c.vocab_size, d}, c.mixed_meta);
    if (c.absolute_positions) add("transformer.wpe.weight", {c.sequence_length, d});
    for (std::int64_t i = 0; i < c.n_layer; ++i) {
      const std::string p = fmt::format("transformer.h.{}.{}", i, c.block_infix);
      norm(p + "attention_norm");
      norm(p + "ffn_norm");
      linear(p + "attn.q_attn", d, d);
      linear(p + "attn.k_attn", kv, d);
      linear(p + "attn.v_attn", kv, d);
      linear(p + "attn.c_proj", d, d);
      if (c.activation == "swiglu") {
        linear(p + "mlp.W", h, d);
        linear(p + "mlp.V", h, d);
        linear(p + "mlp.W_2", d, h);
      } else {
        linear(p + "mlp.c_fc", h, d);
        linear(p + "mlp.c_proj", d, h);
      }
      register_at(p + "attn.qkv_transforms.0.inv_freq", at::empty({kHeadDim / 2}, options()), /*buffer=*/true);
    }
    norm("transformer.lm_head_norm");
    if (c.use_weight_tying) register_at("transformer.lm_head.weight", wte_, false);
    else add("transformer.lm_head.weight", {c.vocab_size, d});
    if (!c.use_meta_device) fill_defaults();
  }

  TensorMap forward(const TensorMap&) override { return {{"logits", at::zeros({1})}}; }
  torch::nn::Module& module() override { return *root_; }
  const torch::nn::Module& module() const override { return *root_; }

  // Constructor-time values (plugins/gpt2/README.md), simplified.
  void reset_parameters() override {
    if (!c_.supports_reset) return Module::reset_parameters();
    fill_defaults();
  }

  void fill_defaults() {
    at::NoGradGuard no_grad;
    for (auto& item : root_->named_parameters()) {
      const std::string& name = item.key();
      at::Tensor& t = item.value();
      if (name.ends_with("norm.weight")) t.fill_(1.0);
      else if (name.ends_with("norm.bias")) t.zero_();
      else if (name.find("wte") != std::string::npos || name.find("wpe") != std::string::npos) t.normal_(0.0, 1.0);
      else if (name.ends_with("weight")) t.uniform_(-1.0 / std::sqrt(t.size(1)), 1.0 / std::sqrt(t.size(1)));
      else t.uniform_(-1.0 / std::sqrt(c_.n_embd), 1.0 / std::sqrt(c_.n_embd));
    }
    for (auto& item : root_->named_buffers()) item.value().copy_(expected_inv_freq());
  }

  static at::Tensor expected_inv_freq() {
    return 1.0 / at::pow(10000.0, at::arange(0, kHeadDim, 2, at::kFloat) / static_cast<double>(kHeadDim));
  }
  const at::Tensor& wte() const { return wte_; }

 private:
  at::TensorOptions options(bool materialized = false) const {
    return at::TensorOptions().dtype(at::kFloat).device(c_.use_meta_device && !materialized ? at::kMeta : at::kCPU);
  }
  at::Tensor add(const std::string& fqn, std::vector<std::int64_t> shape, bool materialized = false) {
    return register_at(fqn, at::empty(shape, options(materialized)), false);
  }
  void linear(const std::string& fqn, std::int64_t out, std::int64_t in) {
    add(fqn + ".weight", {out, in});
    if (c_.bias) add(fqn + ".bias", {out});
  }
  void norm(const std::string& fqn) {
    add(fqn + ".weight", {c_.n_embd});
    if (c_.norm_bias) add(fqn + ".bias", {c_.n_embd});
  }
  // Registers `t` under a dotted name, creating the submodules on the way.
  at::Tensor register_at(const std::string& fqn, at::Tensor t, bool buffer) {
    torch::nn::Module* m = root_.get();
    std::size_t start = 0;
    for (std::size_t dot = fqn.find('.'); dot != std::string::npos; start = dot + 1, dot = fqn.find('.', start)) {
      const std::string part = fqn.substr(start, dot - start);
      auto children = m->named_children();
      if (auto* child = children.find(part)) m = child->get();
      else m = m->register_module(part, std::make_shared<torch::nn::Module>(part)).get();
    }
    const std::string leaf = fqn.substr(start);
    return buffer ? m->register_buffer(leaf, t) : m->register_parameter(leaf, t);
  }

  TinyGpt2Config c_;
  std::shared_ptr<torch::nn::Module> root_;
  at::Tensor wte_;
};

// --- helpers -------------------------------------------------------------------

// Parameters whose name fully matches `pattern`, in order.
std::vector<at::Tensor> select(const Module& m, const std::string& pattern) {
  const std::regex re(pattern);
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : m.named_parameters())
    if (std::regex_match(name, re)) out.push_back(t);
  return out;
}

at::Tensor flat(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> parts;
  for (const auto& t : ts) parts.push_back(t.detach().reshape({-1}).to(at::kDouble));
  return at::cat(parts);
}

void expect_normal(const std::vector<at::Tensor>& ts, double mean, double std, const std::string& what) {
  ASSERT_FALSE(ts.empty()) << what << ": no parameters selected";
  const at::Tensor x = flat(ts);
  const double n = static_cast<double>(x.numel());
  const double m = x.mean().item<double>(), s = x.std().item<double>();
  EXPECT_NEAR(m, mean, 6 * std / std::sqrt(n)) << what << " (n = " << n << ")";
  EXPECT_NEAR(s, std, 6 * std / std::sqrt(2 * n)) << what << " (n = " << n << ")";
}

void expect_all(const std::vector<at::Tensor>& ts, double value, const std::string& what) {
  ASSERT_FALSE(ts.empty()) << what << ": no parameters selected";
  const at::Tensor x = flat(ts);
  EXPECT_EQ((x != value).sum().item<std::int64_t>(), 0) << what << " should all be " << value;
}

// A model node (model/tiny_gpt2), a top-level initializer node and
// model/model_initialized applying it.
std::string graph(const std::string& model_config, const std::string& variant, const std::string& init_config) {
  return fmt::format(R"(
[model_raw]
component_key = "model"
variant_key = "tiny_gpt2"
config = {{ {} }}

[init]
component_key = "model_initialization"
variant_key = "{}"
config = {{ {} }}

[model]
component_key = "model"
variant_key = "model_initialized"
config = {{ model = {{ instance_key = "model_raw", pass_type = "BY_REFERENCE" }}, model_initializer = {{ instance_key = "init", pass_type = "BY_REFERENCE" }} }}
)",
                     model_config, variant, init_config);
}

class InitializationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    at::manual_seed(0);
    auto failure =
        h.registry().register_plugin(core::PluginInfo{"tiny_gpt2_for_tests", "0.0.0", {}, {}, {}}, [](Registrar& r) {
          r.add<Module, TinyGpt2Config>("tiny_gpt2", "GPT-2 names and shapes, no forward.",
                                        [](const TinyGpt2Config& c) { return std::make_shared<TinyGpt2>(c); });
        });
    ASSERT_FALSE(failure) << *failure;
  }
  std::shared_ptr<Module> build(const std::string& model_config, const std::string& variant,
                                const std::string& init_config) {
    h.set_config_text(graph(model_config, variant, init_config));
    return h.get<Module>("model");
  }
  std::string error_of(const std::string& model_config, const std::string& variant, const std::string& init_config) {
    h.set_config_text(graph(model_config, variant, init_config));
    return h.build_error();
  }
  testing::Harness h{MODALITIES_TEST_PLUGIN};
};

const std::string kNorms = R"(transformer\.(h\.\d+\.(attention_norm|ffn_norm)|lm_head_norm)\.)";

// --- composed ----------------------------------------------------------------------

TEST_F(InitializationTest, ComposedScaledDrawsPlainStdAndScaledOutputProjections) {
  auto m = build("bias = true, absolute_positions = true", "composed",
                 R"(model_type = "gpt2", weight_init_type = "scaled", mean = 0.0, std = 0.02, num_layers = 3)");
  ASSERT_NE(m, nullptr) << h.build_error();
  expect_normal(select(*m, R"(transformer\.(wte|wpe|lm_head)\.weight)"), 0.0, 0.02, "embeddings and lm_head");
  expect_normal(select(*m, R"(transformer\.h\.\d+\.attn\.(q_attn|k_attn|v_attn)\.weight)"), 0.0, 0.02, "q/k/v");
  expect_normal(select(*m, R"(transformer\.h\.\d+\.mlp\.(W|V)\.weight)"), 0.0, 0.02, "mlp.W/V");
  expect_normal(select(*m, R"(transformer\.h\.\d+\.(attn\.c_proj|mlp\.W_2)\.weight)"), 0.0, 0.02 / std::sqrt(6.0),
                "output projections: 0.02/sqrt(2*3)");
  expect_all(select(*m, R"(transformer\.h\.\d+\.(attn|mlp)\.\w+\.bias)"), 0.0, "linear biases");
  expect_all(select(*m, kNorms + "weight"), 1.0, "norm weights");
  expect_all(select(*m, kNorms + "bias"), 0.0, "norm biases");
}

TEST_F(InitializationTest, ComposedPlainWithAutoStdUsesHiddenDimAndMean) {
  auto m = build("", "composed",
                 R"(model_type = "gpt2", weight_init_type = "plain", mean = 0.1, std = "auto", hidden_dim = 256)");
  ASSERT_NE(m, nullptr) << h.build_error();
  const double std = std::sqrt(2.0 / (5.0 * 256));
  expect_normal(select(*m, R"(transformer\.(wte|lm_head)\.weight)"), 0.1, std, "embeddings");
  expect_normal(select(*m, R"(transformer\.h\.\d+\.(attn|mlp)\.\w+\.weight)"), 0.1, std, "all block linears, unscaled");
}

TEST_F(InitializationTest, ComposedScaledEmbedRedrawsEmbeddingsWithSqrtPoint4) {
  auto m = build("absolute_positions = true", "composed",
                 R"(model_type = "gpt2", weight_init_type = "scaled_embed", mean = 0.0, std = 0.02, num_layers = 3)");
  ASSERT_NE(m, nullptr) << h.build_error();
  expect_normal(select(*m, R"(transformer\.(wte|wpe|lm_head)\.weight)"), 0.0, std::sqrt(0.4), "embeddings");
  expect_normal(select(*m, R"(transformer\.h\.\d+\.attn\.q_attn\.weight)"), 0.0, 0.02, "q");
  expect_normal(select(*m, R"(transformer\.h\.\d+\.attn\.c_proj\.weight)"), 0.0, 0.02 / std::sqrt(6.0), "c_proj");
}

TEST_F(InitializationTest, ComposedScaledCoversGeluMlp) {
  auto m = build(R"(activation = "gelu", bias = true)", "composed",
                 R"(model_type = "gpt2", weight_init_type = "scaled", mean = 0.0, std = 0.02, num_layers = 3)");
  ASSERT_NE(m, nullptr) << h.build_error();
  expect_normal(select(*m, R"(transformer\.h\.\d+\.mlp\.c_fc\.weight)"), 0.0, 0.02, "mlp.c_fc");
  expect_normal(select(*m, R"(transformer\.h\.\d+\.mlp\.c_proj\.weight)"), 0.0, 0.02 / std::sqrt(6.0), "mlp.c_proj");
  expect_all(select(*m, R"(transformer\.h\.\d+\.mlp\.\w+\.bias)"), 0.0, "mlp biases");
}

TEST_F(InitializationTest, InitializersLeaveNormsAndBuffersUntouched) {
  h.set_config_text(
      graph("norm_bias = true", "composed",
            R"(model_type = "gpt2", weight_init_type = "scaled", mean = 0.0, std = 0.02, num_layers = 3)"));
  auto model = h.get<Module>("model_raw");
  auto init = h.get<ModelInitializer>("init");
  ASSERT_NE(model, nullptr) << h.build_error();
  for (auto& t : select(*model, kNorms + "(weight|bias)")) t.detach().fill_(0.5);
  init->initialize_in_place(*model);
  expect_all(select(*model, kNorms + "(weight|bias)"), 0.5, "norms after composed");
  for (const auto& item : model->module().named_buffers())
    EXPECT_TRUE(item.value().equal(TinyGpt2::expected_inv_freq())) << item.key();
}

TEST_F(InitializationTest, ComposedCocaDrawsEverythingOutsideNormsAndIgnoresScaling) {
  // CoCa's patterns: every .weight/.bias whose name contains neither "norm" nor "ln_";
  // its scaled group is empty, so c_proj keeps the plain std.
  h.set_config_text(
      graph("bias = true", "composed",
            R"(model_type = "coca", weight_init_type = "scaled", mean = 0.0, std = 0.02, num_layers = 3)"));
  auto model = h.get<Module>("model_raw");
  ASSERT_NE(model, nullptr) << h.build_error();
  for (auto& t : select(*model, kNorms + "(weight|bias)")) t.detach().fill_(0.5);
  h.get<ModelInitializer>("init")->initialize_in_place(*model);
  expect_normal(select(*model, R"(transformer\.(wte|lm_head|h\.\d+\.(attn|mlp)\.\w+)\.weight)"), 0.0, 0.02,
                "all non-norm weights");
  expect_all(select(*model, R"(transformer\.h\.\d+\.(attn|mlp)\.\w+\.bias)"), 0.0, "biases");
  expect_all(select(*model, kNorms + "(weight|bias)"), 0.5, "norms");
}

TEST_F(InitializationTest, ParametersLeakingAWrapperInfixAreStillInitialized) {
  // Modalities would skip these (it only deletes "_orig_mod."); see Note [Canonical names].
  auto m = build(R"(block_infix = "_checkpoint_wrapped_module.")", "composed",
                 R"(model_type = "gpt2", weight_init_type = "scaled", mean = 0.0, std = 0.02, num_layers = 3)");
  ASSERT_NE(m, nullptr) << h.build_error();
  ASSERT_EQ(select(*m, R"(transformer\.h\.0\._checkpoint_wrapped_module\.attn\.q_attn\.weight)").size(), 1u);
  expect_normal(select(*m, R"(transformer\.h\.\d+\._checkpoint_wrapped_module\.attn\.q_attn\.weight)"), 0.0, 0.02, "q");
  expect_normal(select(*m, R"(transformer\.h\.\d+\._checkpoint_wrapped_module\.attn\.c_proj\.weight)"), 0.0,
                0.02 / std::sqrt(6.0), "c_proj");
}

TEST_F(InitializationTest, TiedMatrixIsInitializedOnceAndStaysShared) {
  auto m = build("use_weight_tying = true", "composed",
                 R"(model_type = "gpt2", weight_init_type = "scaled", mean = 0.0, std = 0.02, num_layers = 3)");
  ASSERT_NE(m, nullptr) << h.build_error();
  const auto wte = select(*m, R"(transformer\.wte\.weight)"), lm_head = select(*m, R"(transformer\.lm_head\.weight)");
  ASSERT_EQ(wte.size(), 1u);
  ASSERT_EQ(lm_head.size(), 1u);
  EXPECT_TRUE(wte[0].is_same(lm_head[0]));
  expect_normal(wte, 0.0, 0.02, "tied embedding");
}

TEST_F(InitializationTest, SameSeedGivesIdenticalWeights) {
  const std::string init =
      R"(model_type = "gpt2", weight_init_type = "scaled", mean = 0.0, std = 0.02, num_layers = 3)";
  at::manual_seed(7);
  auto a = build("n_layer = 1, n_embd = 32, vocab_size = 64, ffn_hidden = 64", "composed", init)->state_dict();
  at::manual_seed(7);
  auto b = build("n_layer = 1, n_embd = 32, vocab_size = 64, ffn_hidden = 64", "composed", init)->state_dict();
  for (const auto& [name, t] : a) EXPECT_TRUE(t.equal(b.at(name))) << name;
}

TEST_F(InitializationTest, ComposedConfigRulesNameTheField) {
  const std::string model = "n_layer = 1, n_embd = 32, vocab_size = 64, ffn_hidden = 64";
  EXPECT_THAT(
      error_of(model, "composed", R"(model_type = "gpt2", weight_init_type = "plain", mean = 0.0, std = "auto")"),
      HasSubstr("init.config.hidden_dim: required when std = \"auto\""));
  EXPECT_THAT(error_of(model, "composed",
                       R"(model_type = "gpt2", weight_init_type = "plain", mean = 0.0, std = 0.02, hidden_dim = 32)"),
              HasSubstr("init.config.hidden_dim: must not be given when std is a number"));
  EXPECT_THAT(error_of(model, "composed",
                       R"(model_type = "gpt2", weight_init_type = "plain", mean = 0.0, std = 0.02, num_layers = 1)"),
              HasSubstr("init.config.num_layers: must not be given when weight_init_type = \"plain\""));
  EXPECT_THAT(
      error_of(model, "composed", R"(model_type = "gpt2", weight_init_type = "scaled_embed", mean = 0.0, std = 0.02)"),
      HasSubstr("init.config.num_layers: required when weight_init_type = \"scaled_embed\""));
  EXPECT_THAT(error_of(model, "composed", R"(model_type = "gpt2", weight_init_type = "plain", mean = 0.0, std = -0.1)"),
              HasSubstr("init.config.std: must be >= 0 or \"auto\", got -0.1"));
  EXPECT_THAT(
      error_of(model, "composed", R"(model_type = "gpt2", weight_init_type = "plain", mean = 0.0, std = "automatic")"),
      HasSubstr("init.config.std: expected a number >= 0 or \"auto\", got \"automatic\""));
  EXPECT_THAT(
      error_of(model, "composed", R"(model_type = "llama", weight_init_type = "plain", mean = 0.0, std = 0.02)"),
      HasSubstr("init.config.model_type: must be one of 'gpt2', 'coca'"));
  EXPECT_THAT(error_of(model, "composed",
                       R"(model_type = "gpt2", weight_init_type = "scale", mean = 0.0, std = 0.02, num_layers = 1)"),
              HasSubstr("init.config.weight_init_type: must be one of"));
  EXPECT_THAT(error_of(model, "composed",
                       R"(model_type = "gpt2", weight_init_type = "scaled", mean = 0.0, std = 0.02, num_layers = 0)"),
              HasSubstr("init.config.num_layers: must be > 0, got 0"));
  EXPECT_THAT(error_of(model, "composed", R"(model_type = "gpt2", weight_init_type = "plain", std = 0.02)"),
              HasSubstr("init.config.mean: missing required key"));
}

// --- gpt2_llama3_like ------------------------------------------------------------------

const std::string kLlamaModel = "norm_bias = false";

TEST_F(InitializationTest, Llama3LikeDepthInitScalesOutputProjectionsPerLayer) {
  auto m = build(kLlamaModel, "gpt2_llama3_like", "num_layers = 3, n_embd = 256");
  ASSERT_NE(m, nullptr) << h.build_error();
  expect_normal(select(*m, R"(transformer\.wte\.weight)"), 0.0, 1.0, "wte ~ N(0, 1)");
  expect_normal(select(*m, R"(transformer\.h\.\d+\.attn\.(q_attn|k_attn|v_attn)\.weight)"), 0.0, 0.02, "q/k/v");
  expect_normal(select(*m, R"(transformer\.h\.\d+\.mlp\.W\.weight)"), 0.0, 0.02, "mlp.W");
  for (int layer = 0; layer < 3; ++layer) {
    const double std = 0.02 / std::sqrt(2.0 * (layer + 1));
    expect_normal(select(*m, fmt::format(R"(transformer\.h\.{}\.(attn\.c_proj|mlp\.V|mlp\.W_2)\.weight)", layer)), 0.0,
                  std, fmt::format("layer {} output projections", layer));
  }
  // lm_head: N(0, 1/16) truncated at +-3/16; the std of a normal truncated at 3 sigma is 0.986582 sigma.
  const auto lm_head = select(*m, R"(transformer\.lm_head\.weight)");
  EXPECT_LE(flat(lm_head).abs().max().item<double>(), 3.0 / 16);
  EXPECT_GT(flat(lm_head).abs().max().item<double>(), 2.9 / 16);
  expect_normal(lm_head, 0.0, 0.986582 / 16, "lm_head");
  expect_all(select(*m, kNorms + "weight"), 1.0, "norm weights");
}

TEST_F(InitializationTest, Llama3LikeWithoutDepthInitUsesNumLayers) {
  auto m = build(kLlamaModel, "gpt2_llama3_like", "num_layers = 3, n_embd = 256, depth_init = false");
  ASSERT_NE(m, nullptr) << h.build_error();
  expect_normal(select(*m, R"(transformer\.h\.\d+\.(attn\.c_proj|mlp\.V|mlp\.W_2)\.weight)"), 0.0,
                0.02 / std::sqrt(6.0), "output projections");
}

TEST_F(InitializationTest, Llama3LikeOnlyWarnsAboutUnmatchedParameters) {
  auto m = build(kLlamaModel + ", absolute_positions = true", "gpt2_llama3_like", "num_layers = 3, n_embd = 256");
  ASSERT_NE(m, nullptr) << h.build_error();
  expect_normal(select(*m, R"(transformer\.wpe\.weight)"), 0.0, 1.0, "wpe keeps its reset value N(0, 1)");
}

TEST_F(InitializationTest, Llama3LikeRejectsModelsWithoutTheLlamaLayout) {
  const std::string init = "num_layers = 3, n_embd = 256";
  EXPECT_THAT(error_of("norm_bias = false, bias = true", "gpt2_llama3_like", init),
              HasSubstr("has a bias parameter 'transformer.h.0.attn.q_attn.bias'"));
  EXPECT_THAT(error_of("norm_bias = true", "gpt2_llama3_like", init),
              HasSubstr("has a bias parameter 'transformer.h.0.attention_norm.bias'"));
  EXPECT_THAT(error_of("norm_bias = false, use_weight_tying = true", "gpt2_llama3_like", init),
              HasSubstr(R"(rule 'transformer\.lm_head\.weight' matches no parameter)"));
  EXPECT_THAT(error_of(R"(norm_bias = false, activation = "gelu")", "gpt2_llama3_like", init),
              HasSubstr(R"(rule 'transformer\.h\.\d+\.mlp\.(W)\.weight' matches no parameter)"));
}

TEST_F(InitializationTest, Llama3LikeRejectsModelUntouched) {
  h.set_config_text(graph("norm_bias = true", "gpt2_llama3_like", "num_layers = 3, n_embd = 256"));
  h.erase("model");
  auto model = h.get<Module>("model_raw");
  ASSERT_NE(model, nullptr) << h.build_error();
  const StateDict before = model->state_dict();
  StateDict copy;
  for (const auto& [k, t] : before) copy[k] = t.clone();
  EXPECT_THROW(h.get<ModelInitializer>("init")->initialize_in_place(*model), Error);
  for (const auto& [k, t] : model->state_dict()) EXPECT_TRUE(t.equal(copy.at(k))) << k;
}

TEST_F(InitializationTest, Llama3LikeConfigErrors) {
  EXPECT_THAT(error_of(kLlamaModel, "gpt2_llama3_like", "num_layers = 0, n_embd = 256"),
              HasSubstr("init.config.num_layers: must be > 0, got 0"));
  EXPECT_THAT(error_of(kLlamaModel, "gpt2_llama3_like", "num_layers = 3"),
              HasSubstr("init.config.n_embd: missing required key"));
}

TEST(TruncatedNormalTest, MatchesTheTruncatedDistributionAndItsBounds) {
  at::manual_seed(3);
  // N(1, 2^2) truncated at one sigma either side: std = 0.539561 * 2, mean 1.
  at::Tensor t = at::empty({400000});
  trunc_normal_(t, 1.0, 2.0, -1.0, 3.0);
  EXPECT_GE(t.min().item<double>(), -1.0);
  EXPECT_LE(t.max().item<double>(), 3.0);
  EXPECT_NEAR(t.mean().item<double>(), 1.0, 6 * 1.08 / std::sqrt(4e5));
  EXPECT_NEAR(t.std().item<double>(), 0.539561 * 2, 6 * 1.08 / std::sqrt(8e5));
  // Asymmetric: [mean, +inf) gives the half-normal, mean = sigma * sqrt(2/pi).
  trunc_normal_(t, 0.0, 1.0, 0.0, 1e9);
  EXPECT_GE(t.min().item<double>(), 0.0);
  EXPECT_NEAR(t.mean().item<double>(), std::sqrt(2.0 / M_PI), 6 / std::sqrt(4e5));
  // bf16 tensors are drawn in float32 and rounded once.
  at::Tensor b = at::empty({100000}, at::kBFloat16);
  trunc_normal_(b, 0.0, 0.0625, -0.1875, 0.1875);
  EXPECT_EQ(b.scalar_type(), at::kBFloat16);
  EXPECT_LE(b.abs().max().item<double>(), 0.1875);
  EXPECT_NEAR(b.to(at::kDouble).std().item<double>(), 0.986582 * 0.0625, 0.001);
}

// --- model/model_initialized -------------------------------------------------------------

TEST_F(InitializationTest, ModelInitializedMaterializesAMetaModelOnTheRunDevice) {
  h.set_config_text(
      graph("use_meta_device = true, norm_bias = true", "composed",
            R"(model_type = "gpt2", weight_init_type = "scaled", mean = 0.0, std = 0.02, num_layers = 3)"));
  auto model = h.get<Module>("model");
  ASSERT_NE(model, nullptr) << h.build_error();
  EXPECT_EQ(model.get(), h.get<Module>("model_raw").get()) << "model_initialized returns the same object";
  for (const auto& [name, t] : model->state_dict()) {
    EXPECT_EQ(t.device(), run_device()) << name;
    EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
  }
  for (const auto& [name, t] : model->named_parameters()) EXPECT_TRUE(t.requires_grad()) << name;
  // The model's own handle still is the registered parameter (same TensorImpl, now materialized).
  const auto& tiny = static_cast<const TinyGpt2&>(*model);
  EXPECT_TRUE(tiny.wte().is_same(select(*model, R"(transformer\.wte\.weight)")[0]));
  expect_normal({tiny.wte()}, 0.0, 0.02, "wte");
  expect_normal(select(*model, R"(transformer\.h\.\d+\.attn\.c_proj\.weight)"), 0.0, 0.02 / std::sqrt(6.0), "c_proj");
  expect_all(select(*model, kNorms + "weight"), 1.0, "norm weights (reset)");
  expect_all(select(*model, kNorms + "bias"), 0.0, "norm biases (reset)");
  for (const auto& item : model->module().named_buffers())
    EXPECT_TRUE(item.value().equal(TinyGpt2::expected_inv_freq())) << item.key() << " (reset)";
}

TEST_F(InitializationTest, ModelInitializedRejectsAPartlyMaterializedModel) {
  EXPECT_THAT(error_of("use_meta_device = true, mixed_meta = true", "composed",
                       R"(model_type = "gpt2", weight_init_type = "plain", mean = 0.0, std = 0.02)"),
              HasSubstr("mixes meta-device and materialized tensors ('transformer.h.0.attention_norm.weight' is on "
                        "meta, 'transformer.wte.weight' on cpu)"));
}

TEST_F(InitializationTest, ModelInitializedNeedsResetParametersOnlyForMetaModels) {
  const std::string init = R"(model_type = "gpt2", weight_init_type = "plain", mean = 0.0, std = 0.02)";
  EXPECT_THAT(error_of("use_meta_device = true, supports_reset = false", "composed", init),
              HasSubstr("does not support reset_parameters()"));
  auto m = build("supports_reset = false", "composed", init);
  ASSERT_NE(m, nullptr) << h.build_error();
  expect_normal(select(*m, R"(transformer\.wte\.weight)"), 0.0, 0.02, "wte");
}

}  // namespace
}  // namespace modalities::plugins::initialization
