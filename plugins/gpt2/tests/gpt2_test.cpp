// gpt2: model/gpt2 and model/mixed_precision built through the registry.
//  * Parity with Modalities' GPT2LLM: tests/data holds, for a matrix of tiny
//    configs (cases.toml), the logits and loss Modalities computes with every
//    state-dict tensor filled by an integer hash (scripts/reference/gpt2_reference.py).
//    We fill the same values and compare: fp32 logits within 1e-5 absolute, loss
//    within 1e-5, gradient norms within 1e-5 relative plus 1e-6 of the whole gradient's
//    norm; bf16 mixed precision vs Modalities' model cast to bf16 (tolerances at the test).
//  * Structure: FQNs and order, parameter counts (plugins/gpt2/README.md), weight-decay
//    groups, RoPE frequencies, tying, meta device + reset_parameters, clone, errors.
#include "hash_weights.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/removable_handle.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace modalities::plugins::gpt2 {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

const std::filesystem::path kDir = MODALITIES_TEST_PLUGIN_SOURCE_DIR;
const std::filesystem::path kData = kDir / "tests" / "data";
const std::filesystem::path kExample = kDir / "configs" / "example.toml";

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// ---- the reference data --------------------------------------------------------------

struct RefTensor {
  std::string key;
  std::vector<std::int64_t> shape;
  std::uint32_t salt = 0;
  double offset = 0, scale = 0;
};

struct RefCase {
  std::string name;
  std::string dtype;  // "float32" or "bfloat16"
  double loss = 0;
  std::string logits_file;
  std::vector<std::string> keys;                      // every state-dict key, Modalities' order
  std::vector<RefTensor> tensors;                     // filled by the hash
  std::map<std::string, std::string> tied;            // key -> key it shares storage with
  std::map<std::string, std::vector<float>> buffers;  // inv_freq as Modalities computed it
  struct Grad {
    std::string key;
    double norm = 0, sum = 0;
  };
  std::vector<Grad> grads;  // d loss / d parameter (fp32 cases), named_parameters order
};

std::vector<std::int64_t> parse_dims(const std::string& s) {
  std::vector<std::int64_t> dims;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, ',')) dims.push_back(std::stoll(part));
  return dims;
}

const std::vector<RefCase>& reference() {
  static const std::vector<RefCase> cases = [] {
    std::vector<RefCase> out;
    std::ifstream in(kData / "reference.txt");
    EXPECT_TRUE(in) << "missing " << (kData / "reference.txt");
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty() || line[0] == '#') continue;
      std::istringstream ls(line);
      std::string kind;
      ls >> kind;
      if (kind == "case") {
        RefCase c;
        std::string loss;
        ls >> c.name >> c.dtype >> loss >> c.logits_file;
        c.loss = std::stod(loss);
        out.push_back(std::move(c));
      } else if (kind == "tensor") {
        RefTensor t;
        std::string dims, offset, scale;
        ls >> t.key >> dims >> t.salt >> offset >> scale;
        t.shape = parse_dims(dims);
        t.offset = std::stod(offset);  // shortest round-trip reprs: exact
        t.scale = std::stod(scale);
        out.back().keys.push_back(t.key);
        out.back().tensors.push_back(t);
      } else if (kind == "tied") {
        std::string key, source;
        ls >> key >> source;
        out.back().keys.push_back(key);
        out.back().tied[key] = source;
      } else if (kind == "grad") {
        RefCase::Grad g;
        std::string norm, sum;
        ls >> g.key >> norm >> sum;
        g.norm = std::stod(norm);
        g.sum = std::stod(sum);
        out.back().grads.push_back(g);
      } else if (kind == "buffer") {
        std::string key, dims, v;
        ls >> key >> dims;
        std::vector<float> values;
        while (ls >> v) values.push_back(std::stof(v));
        out.back().keys.push_back(key);
        out.back().buffers[key] = values;
      }
    }
    return out;
  }();
  return cases;
}

at::Tensor read_logits(const RefCase& c) {
  const std::string bytes = testing::read_file(kData / c.logits_file);
  const std::vector<std::int64_t> shape = {2, 16, 256};
  if (c.dtype == "float32") {
    EXPECT_EQ(bytes.size(), 2u * 16 * 256 * 4);
    at::Tensor t = at::empty(shape, at::kFloat);
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());  // little-endian host assumed (x86-64/aarch64)
    return t;
  }
  EXPECT_EQ(bytes.size(), 2u * 16 * 256 * 2);
  at::Tensor t = at::empty(shape, at::kBFloat16);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

// ids[b, t] = (7 + 31 t + 97 b + 13 t^2) mod 256, t in 0..16; inputs = [:, :16], targets = [:, 1:], one -100.
std::pair<at::Tensor, at::Tensor> batch() {
  at::Tensor ids = at::empty({2, 17}, at::kLong);
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t t = 0; t <= 16; ++t) ids[b][t] = (7 + 31 * t + 97 * b + 13 * t * t) % 256;
  at::Tensor inputs = ids.narrow(1, 0, 16).clone(), targets = ids.narrow(1, 1, 16).clone();
  targets[1][5] = -100;
  return {inputs, targets};
}

at::Tensor clm_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), {}, at::Reduction::Mean,
                                -100);
}

// Loads the hash values of `c` (our own inv_freq stays) with a strict load, so the key
// sets must be identical.
void fill(Module& m, const RefCase& c) {
  StateDict sd;
  for (const auto& t : c.tensors) sd[t.key] = hash_tensor(t.shape, t.salt, t.offset, t.scale);
  for (const auto& [key, source] : c.tied) sd[key] = sd.at(source);
  const StateDict own = m.state_dict();
  for (const auto& [key, values] : c.buffers) sd[key] = own.at(key);
  m.load_state_dict(sd, /*strict=*/true);
}

// State-dict keys in module order (parameters then buffers of each module, pre-order), as PyTorch lists them.
std::vector<std::string> ordered_state_keys(const Module& m) {
  std::vector<std::string> keys;
  for (const auto& item : m.module().named_modules("", /*include_self=*/false)) {
    const std::string prefix = item.key() + ".";
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) keys.push_back(prefix + p.key());
    for (const auto& b : item.value()->named_buffers(/*recurse=*/false)) keys.push_back(prefix + b.key());
  }
  return keys;
}

std::string cases_toml() { return testing::read_file(kData / "cases.toml"); }

// ---- parity with Modalities ---------------------------------------------------------------

TEST(Gpt2ParityTest, Fp32LogitsAndLossMatchModalities) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(cases_toml(), "cases.toml");
  const auto [inputs, targets] = batch();
  int checked = 0;
  for (const RefCase& c : reference()) {
    if (c.dtype != "float32") continue;
    SCOPED_TRACE(c.name);
    auto m = h.get<Module>(c.name);
    ASSERT_NE(m, nullptr) << h.build_error();
    m->eval();
    fill(*m, c);
    const at::Tensor logits = m->forward({{"input_ids", inputs}}).at("logits");
    ASSERT_EQ(logits.scalar_type(), at::kFloat);
    const at::Tensor expected = read_logits(c);
    // Stated tolerance: 1e-5 absolute on logits of magnitude <= ~3, about 40 float32 ulps at that
    // magnitude (the reference comes from Python PyTorch 2.11, possibly on another CPU: vectorised transcendental and
    // reduction kernels round differently across CPUs and vector widths).
    const double diff = max_abs_diff(logits, expected);
    EXPECT_LE(diff, 1e-5) << "max |logits - Modalities| = " << diff;
    const at::Tensor loss_t = clm_loss(logits, targets);
    const double loss = loss_t.item<double>();
    EXPECT_NEAR(loss, c.loss, 1e-5) << "loss " << loss << " vs Modalities " << c.loss;
    // Backward, per parameter: the L2 norm of the gradient within 1e-5 relative plus 1e-6 of the
    // whole gradient's norm G, and its sum within sqrt(numel) times that. The G term: fp32 rounding
    // noise in a gradient element scales with the upstream gradients, i.e. with G, not with the
    // element's own value; a gradient that is mathematically zero (attn.k_attn.bias: softmax is
    // invariant to a key bias) is pure noise (~1e-9 here) that no relative bound can hold, and
    // 1e-6 * G is about 16 float32 ulps of G.
    loss_t.backward();
    const NamedTensors params = m->named_parameters();
    ASSERT_EQ(params.size(), c.grads.size());
    double total = 0;
    for (const RefCase::Grad& g : c.grads) total += g.norm * g.norm;
    total = std::sqrt(total);
    double worst = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& [name, p] = params[i];
      const RefCase::Grad& g = c.grads[i];
      EXPECT_EQ(name, g.key);
      ASSERT_TRUE(p.grad().defined()) << name;
      const at::Tensor gd = p.grad().to(at::kDouble);
      const double norm = gd.norm().item<double>(), sum = gd.sum().item<double>();
      const double tol = 1e-5 * g.norm + 1e-6 * total;
      EXPECT_NEAR(norm, g.norm, tol) << name << " (whole gradient's norm " << total << ")";
      EXPECT_NEAR(sum, g.sum, std::sqrt(static_cast<double>(p.numel())) * tol) << name;
      worst = std::max(worst, std::abs(norm - g.norm) / tol);
    }
    std::printf("[parity fp32] %-48s max|dlogits| = %.3g  loss %.9g vs %.9g  max |d norm(grad)| / tol = %.3g\n",
                c.name.c_str(), diff, loss, c.loss, worst);
    ++checked;
  }
  EXPECT_EQ(checked, 7);
}

TEST(Gpt2ParityTest, Bf16MixedPrecisionMatchesModalitiesCastToBf16) {
  std::string text = cases_toml();
  std::vector<const RefCase*> bf16;
  for (const RefCase& c : reference())
    if (c.dtype == "bfloat16") {
      bf16.push_back(&c);
      text += fmt::format(
          "\n[{0}_bf16]\ncomponent_key = \"model\"\nvariant_key = \"mixed_precision\"\n"
          "config = {{ model = {{ instance_key = \"{0}\", pass_type = \"BY_REFERENCE\" }}, "
          "mixed_precision_settings = {{ param_dtype = \"BF_16\", reduce_dtype = \"BF_16\" }} }}\n",
          c.name);
    }
  ASSERT_EQ(bf16.size(), 3u);
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(text, "cases_bf16.toml");
  const auto [inputs, targets] = batch();
  for (const RefCase* c : bf16) {
    SCOPED_TRACE(c->name);
    auto m = h.get<Module>(c->name + "_bf16");
    ASSERT_NE(m, nullptr) << h.build_error();
    EXPECT_EQ(m->param_dtype(), at::kBFloat16);
    m->eval();
    fill(*m, *c);
    for (const auto& [name, p] : m->named_parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat) << name;
    at::NoGradGuard no_grad;
    const at::Tensor logits = m->forward({{"input_ids", inputs}}).at("logits");
    ASSERT_EQ(logits.scalar_type(), at::kBFloat16);
    const at::Tensor expected = read_logits(*c);
    // Stated tolerance: the same bf16 op sequence as Modalities' bf16 model; what remains is
    // GEMM/softmax accumulation order between library versions flipping a bf16 rounding,
    // i.e. a few bf16 ulps (ulp = 2^-7 * |x| <= 0.016 here). Loss (a bf16 scalar) within 2 ulps.
    const double diff = max_abs_diff(logits, expected);
    const double mean = (logits.to(at::kDouble) - expected.to(at::kDouble)).abs().mean().item<double>();
    EXPECT_LE(diff, 0.0625) << "max |logits - Modalities bf16| = " << diff;
    EXPECT_LE(mean, 2e-3) << "mean |logits - Modalities bf16| = " << mean;
    const double loss = clm_loss(logits, targets).to(at::kFloat).item<double>();
    EXPECT_NEAR(loss, c->loss, 0.0625) << "loss " << loss << " vs Modalities " << c->loss;
    std::printf("[parity bf16] %-48s max|dlogits| = %.3g mean %.3g  loss %.9g vs %.9g\n", c->name.c_str(), diff, mean,
                loss, c->loss);
  }
}

TEST(Gpt2ParityTest, StateDictKeysAndOrderMatchModalities) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(cases_toml(), "cases.toml");
  for (const RefCase& c : reference()) {
    if (c.dtype != "float32") continue;
    SCOPED_TRACE(c.name);
    auto m = h.get<Module>(c.name);
    ASSERT_NE(m, nullptr);
    EXPECT_THAT(ordered_state_keys(*m), ElementsAreArray(c.keys));
    const StateDict sd = m->state_dict();
    for (const auto& t : c.tensors) EXPECT_EQ(sd.at(t.key).sizes().vec(), t.shape) << t.key;
  }
}

TEST(Gpt2ParityTest, RopeInvFreqMatchesModalitiesBitForBit) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(cases_toml(), "cases.toml");
  int checked = 0;
  for (const RefCase& c : reference()) {
    auto m = h.get<Module>(c.name);
    const StateDict sd = m->state_dict();
    for (const auto& [key, values] : c.buffers) {
      const at::Tensor mine = sd.at(key);
      ASSERT_EQ(mine.numel(), static_cast<std::int64_t>(values.size()));
      for (std::size_t j = 0; j < values.size(); ++j)
        EXPECT_EQ(mine[j].item<float>(), values[j]) << key << "[" << j << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
}

// ---- the tutorial configuration (Modalities') --------------------------------------------------

// The tutorial model with variations: Tutorial().meta().tied()...
struct Tutorial {
  bool tied_ = false;
  bool bias_ = false;
  std::string norm_ = R"(norm_type = "rms_norm"
config = { ndim = 128, bias = true, epsilon = 1e-5 })";
  bool meta_ = false;
  std::string extra_;  // more model_raw.config keys
  Tutorial& tied() { return tied_ = true, *this; }
  Tutorial& bias() { return bias_ = true, *this; }
  Tutorial& meta() { return meta_ = true, *this; }
  Tutorial& norm(std::string n) { return norm_ = std::move(n), *this; }
  Tutorial& extra(std::string e) { return extra_ = std::move(e), *this; }
};

std::string tutorial_toml(const Tutorial& t) {
  std::string norms;
  for (const char* slot : {"attention_norm_config", "ffn_norm_config", "lm_head_norm_config"})
    norms += fmt::format("\n[model_raw.config.{}]\n{}\n", slot, t.norm_);
  return fmt::format(R"(
[model_raw]
component_key = "model"
variant_key = "gpt2"

[model_raw.config]
sample_key = "input_ids"
poe_type = "NOPE"
sequence_length = 256
prediction_key = "logits"
vocab_size = 50304
n_layer = 2
n_head_q = 8
n_head_kv = 4
ffn_hidden = 128
n_embd = 128
dropout = 0.0
bias = {}
attention_implementation = "pytorch_flash"
activation_type = "swiglu"
use_weight_tying = {}
use_meta_device = {}
{}
[[model_raw.config.attention_config.qkv_transforms]]
type_hint = "RotaryTransform"
config = {{ n_embd = 128, n_head = 8, seq_length_dim = -2, base_freq = 100000 }}
{})",
                     t.bias_, t.tied_, t.meta_, t.extra_, norms);
}

std::int64_t count(const Module& m) {
  std::int64_t n = 0;
  for (const auto& [name, p] : m.named_parameters()) n += p.numel();
  return n;
}

std::shared_ptr<Module> build(testing::Harness& h, const Tutorial& t) {
  h.set_config_text(tutorial_toml(t));
  auto m = h.get<Module>("model_raw");
  EXPECT_NE(m, nullptr) << h.build_error();
  return m;
}

TEST(Gpt2TutorialTest, ParameterCountsOfModelMd8) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  EXPECT_EQ(count(*build(h, Tutorial().meta())), 13'174'016);
  EXPECT_EQ(count(*build(h, Tutorial().tied())), 6'735'104);
  EXPECT_EQ(count(*build(h, Tutorial().bias().meta())), 13'176'064);
  EXPECT_EQ(count(*build(h, Tutorial().meta().norm(R"(norm_type = "pytorch_rms_norm"
config = { normalized_shape = 128 })"))),
            13'173'376);
  EXPECT_EQ(count(*build(h, Tutorial().meta().norm(R"(norm_type = "rms_norm"
config = { ndim = 128, bias = false })"))),
            13'173'376);
  EXPECT_EQ(count(*build(h, Tutorial().meta().norm(R"(norm_type = "layer_norm"
config = { normalized_shape = 128, eps = 1e-5 })"))),
            13'174'016);
  // Buffers are not parameters: two inv_freq of 8 elements.
  auto m = build(h, Tutorial().meta());
  std::int64_t buffers = 0;
  for (const auto& b : m->module().buffers()) buffers += b.numel();
  EXPECT_EQ(buffers, 16);
}

// Optimizer split of Modalities' tutorial config with weight_decay_groups_excluded = [embedding, layernorm].
std::pair<std::int64_t, std::int64_t> decay_split(const Module& m) {
  const auto groups = m.weight_decay_groups();
  std::int64_t decayed = 0, not_decayed = 0;
  for (const auto& [name, p] : m.named_parameters()) {
    bool excluded = false;
    for (const char* g : {"embedding", "layernorm"})
      for (const auto& re : groups.at(g)) excluded = excluded || std::regex_search(name, std::regex(re));
    (excluded ? not_decayed : decayed) += p.numel();
  }
  return {decayed, not_decayed};
}

TEST(Gpt2TutorialTest, WeightDecaySplitOfModelMd8) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  EXPECT_EQ(decay_split(*build(h, Tutorial().meta())),
            std::make_pair(std::int64_t{6'733'824}, std::int64_t{6'440'192}));
  EXPECT_EQ(decay_split(*build(h, Tutorial().tied())), std::make_pair(std::int64_t{294'912}, std::int64_t{6'440'192}));
}

// Each parameter's group: the first group whose regex is found in its name (they are disjoint here).
std::map<std::string, std::string> group_of(const Module& m) {
  std::map<std::string, std::string> out;
  for (const auto& [name, p] : m.named_parameters()) {
    std::set<std::string> hits;
    for (const auto& [group, res] : m.weight_decay_groups())
      for (const auto& re : res)
        if (std::regex_search(name, std::regex(re))) hits.insert(group);
    EXPECT_EQ(hits.size(), 1u) << name;
    out[name] = hits.empty() ? "" : *hits.begin();
  }
  return out;
}

TEST(Gpt2TutorialTest, WeightDecayGroupMembership) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  auto m = build(h, Tutorial().tied().bias().extra(R"([model_raw.config.attention_config.qk_norm_config]
norm_type = "pytorch_rms_norm"
config = { normalized_shape = 16 })"));
  const auto g = group_of(*m);
  EXPECT_EQ(g.at("transformer.wte.weight"), "embedding");  // the tied matrix, listed once
  EXPECT_EQ(g.count("transformer.lm_head.weight"), 0u);
  EXPECT_EQ(g.at("transformer.h.0.attn.q_attn.bias"), "linear");
  EXPECT_EQ(g.at("transformer.h.0.attn.q_norm.weight"), "linear");  // qk-norm weights are decayed (as in Modalities)
  EXPECT_EQ(g.at("transformer.h.1.mlp.W_2.weight"), "linear");
  EXPECT_EQ(g.at("transformer.h.1.attention_norm.bias"), "layernorm");
  EXPECT_EQ(g.at("transformer.lm_head_norm.weight"), "layernorm");
  auto untied = build(h, Tutorial());
  EXPECT_EQ(group_of(*untied).at("transformer.lm_head.weight"), "linear");
}

// Module hooks on the root and the blocks: the order a sharding wrapper relies on (gather before
// a block's forward, free after it, gather again when its output's gradient arrives), the
// gradients they see, and removal.
TEST(Gpt2HookTest, RootAndBlockHooksFireInForwardAndBackwardOrder) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  auto m = build(h, Tutorial());
  std::vector<std::string> calls;
  std::map<std::string, std::vector<std::int64_t>> grad_shapes;
  const auto record = [&](const ModuleHookCall& c) {
    const char* point = c.point == HookPoint::kPreForward ? "pre" : c.point == HookPoint::kForward ? "fwd" : "bwd";
    calls.push_back(fmt::format("{} {} {}", point, c.fqn.empty() ? "<root>" : std::string(c.fqn), c.class_name));
    if (c.point == HookPoint::kBackward) grad_shapes[std::string(c.fqn)] = c.outputs[0].sizes().vec();
    if (c.point == HookPoint::kForward) {
      EXPECT_EQ(c.outputs.size(), 1u);
    }
  };
  auto handle = m->add_hook(record, {});
  const at::Tensor ids = at::randint(0, 50304, {2, 16}, at::kLong);
  at::Tensor logits = m->forward({{"input_ids", ids}}).at("logits");
  EXPECT_THAT(calls,
              ElementsAre("pre <root> GPT2LLM", "pre transformer.h.0 GPT2Block", "fwd transformer.h.0 GPT2Block",
                          "pre transformer.h.1 GPT2Block", "fwd transformer.h.1 GPT2Block", "fwd <root> GPT2LLM"));
  calls.clear();
  logits.to(at::kFloat).square().mean().backward();
  EXPECT_THAT(calls,
              ElementsAre("bwd <root> GPT2LLM", "bwd transformer.h.1 GPT2Block", "bwd transformer.h.0 GPT2Block"));
  EXPECT_EQ(grad_shapes[""], (std::vector<std::int64_t>{2, 16, 50304}));
  EXPECT_EQ(grad_shapes["transformer.h.0"], (std::vector<std::int64_t>{2 * 16, 128}));  // blocks see [B*T, d]

  // Selected blocks only; a removed hook stays silent.
  calls.clear();
  const std::vector<std::string> one = {"transformer.h.1"};
  auto second = m->add_hook(record, one);
  handle->remove();
  handle->remove();  // a second remove does nothing
  (void)m->forward({{"input_ids", ids}});
  EXPECT_THAT(calls, ElementsAre("pre transformer.h.1 GPT2Block", "fwd transformer.h.1 GPT2Block"));
  second->remove();
  calls.clear();
  (void)m->forward({{"input_ids", ids}});
  EXPECT_TRUE(calls.empty());

  const std::vector<std::string> bad = {"transformer.h.0.attn"};
  EXPECT_THAT([&] { (void)m->add_hook(record, bad); },
              ::testing::ThrowsMessage<Error>(HasSubstr("cannot hook 'transformer.h.0.attn'")));
}

TEST(Gpt2TutorialTest, CanonicalNamesOrderAndBlocks) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  auto m = build(h, Tutorial().meta());
  std::vector<std::string> expected = {"transformer.wte.weight"};
  for (int i = 0; i < 2; ++i) {
    const std::string p = fmt::format("transformer.h.{}.", i);
    for (const char* n : {"attention_norm.weight", "attention_norm.bias", "ffn_norm.weight", "ffn_norm.bias",
                          "attn.q_attn.weight", "attn.k_attn.weight", "attn.v_attn.weight", "attn.c_proj.weight",
                          "attn.qkv_transforms.0.inv_freq", "mlp.W.weight", "mlp.V.weight", "mlp.W_2.weight"})
      expected.push_back(p + n);
  }
  expected.push_back("transformer.lm_head_norm.weight");
  expected.push_back("transformer.lm_head_norm.bias");
  expected.push_back("transformer.lm_head.weight");
  EXPECT_THAT(ordered_state_keys(*m), ElementsAreArray(expected));
  const StateDict sd = m->state_dict();
  EXPECT_EQ(sd.at("transformer.h.0.attn.k_attn.weight").sizes().vec(), (std::vector<std::int64_t>{64, 128}));
  EXPECT_EQ(sd.at("transformer.h.0.mlp.W.weight").sizes().vec(), (std::vector<std::int64_t>{256, 128}));
  EXPECT_THAT(m->block_fqns(), ElementsAre("transformer.h.0", "transformer.h.1"));
  EXPECT_THAT(m->submodules_of_class("GPT2Block"), ElementsAre("transformer.h.0", "transformer.h.1"));
  EXPECT_THAT(m->submodules_of_class("RotaryTransform"),
              ElementsAre("transformer.h.0.attn.qkv_transforms.0", "transformer.h.1.attn.qkv_transforms.0"));
  EXPECT_EQ(m->sample_key(), "input_ids");
  EXPECT_EQ(m->prediction_key(), "logits");
  // The Python module tree, container classes included.
  std::vector<std::string> modules;
  for (const auto& item : m->module().named_modules("", false))
    if (item.key().rfind("transformer.h.1", 0) != 0) modules.push_back(item.key());
  EXPECT_THAT(
      modules,
      ElementsAre("transformer", "transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h",
                  "transformer.h.0", "transformer.h.0.attention_norm", "transformer.h.0.ffn_norm",
                  "transformer.h.0.attn", "transformer.h.0.attn.q_attn", "transformer.h.0.attn.k_attn",
                  "transformer.h.0.attn.v_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.attn.resid_dropout",
                  "transformer.h.0.attn.qkv_transforms", "transformer.h.0.attn.qkv_transforms.0", "transformer.h.0.mlp",
                  "transformer.h.0.mlp.W", "transformer.h.0.mlp.silu", "transformer.h.0.mlp.V",
                  "transformer.h.0.mlp.W_2", "transformer.lm_head_norm", "transformer.lm_head"));
}

// ---- RoPE, GQA, attention implementations ------------------------------------------------------

TEST(Gpt2RopeTest, InvFreqAndTheirBf16RoundingOfModelMd5) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  auto check = [&](std::int64_t base, std::vector<float> fp32, std::vector<float> bf16) {
    SCOPED_TRACE(base);
    build(h, Tutorial().meta());
    h.set("model_raw.config.use_meta_device", Value(false));
    h.set("model_raw.config.attention_config.qkv_transforms[0].config.base_freq", Value(base));
    auto m = h.get<Module>("model_raw");
    ASSERT_NE(m, nullptr) << h.build_error();
    const at::Tensor inv = m->state_dict().at("transformer.h.1.attn.qkv_transforms.0.inv_freq");
    ASSERT_EQ(inv.scalar_type(), at::kFloat);
    for (std::size_t j = 0; j < fp32.size(); ++j) EXPECT_FLOAT_EQ(inv[j].item<float>(), fp32[j]) << j;
    const at::Tensor rounded = inv.to(at::kBFloat16).to(at::kFloat);
    for (std::size_t j = 0; j < bf16.size(); ++j) EXPECT_FLOAT_EQ(rounded[j].item<float>(), bf16[j]) << j;
  };
  check(10000, {1, 0.316227764f, 0.1f, 0.0316227786f, 0.01f},
        {1, 0.31640625f, 0.100097656f, 0.0317382812f, 0.0100097656f});
  check(
      100000,
      {1, 0.237137362f, 0.0562341288f, 0.0133352149f, 0.00316227786f, 0.000749894185f, 0.00017782794f, 4.21696532e-05f},
      {1, 0.237304688f, 0.0561523438f, 0.0133056641f, 0.00315856934f, 0.000751495361f, 0.000177383423f,
       4.22000885e-05f});
}

// A tiny model (vocab 256) for behaviour checks.
std::string tiny_toml(const std::string& overrides) {
  return fmt::format(R"(
[m]
component_key = "model"
variant_key = "gpt2"
[m.config]
sample_key = "input_ids"
prediction_key = "logits"
poe_type = "NOPE"
sequence_length = 16
vocab_size = 256
n_layer = 2
n_head_q = 8
n_head_kv = 2
n_embd = 128
ffn_hidden = 512
dropout = 0.0
bias = true
attention_implementation = "manual"
activation_type = "swiglu"
use_weight_tying = false
seed = 7
attention_config = {{ qkv_transforms = [{{ type_hint = "RotaryTransform", config = {{ n_embd = 128, n_head = 8, seq_length_dim = -2, base_freq = 10000 }} }}] }}
attention_norm_config = {{ norm_type = "pytorch_rms_norm", config = {{ normalized_shape = 128 }} }}
ffn_norm_config = {{ norm_type = "layer_norm", config = {{ normalized_shape = 128 }} }}
lm_head_norm_config = {{ norm_type = "rms_norm", config = {{ ndim = 128 }} }}
{}
)",
                     overrides);
}

at::Tensor tiny_ids() { return batch().first; }

at::Tensor logits_of(Module& m, const at::Tensor& ids) {
  at::NoGradGuard no_grad;
  return m.forward({{"input_ids", ids}}).at("logits");
}

at::Tensor logits_of_documents(Module& m, const at::Tensor& ids, const at::Tensor& documents) {
  at::NoGradGuard no_grad;
  return m.forward({{"input_ids", ids}, {"document_ids", documents}}).at("logits");
}

TEST(Gpt2AttentionTest, ManualAndPytorchFlashAgreeWithGqa) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(tiny_toml(""));
  auto manual = h.get<Module>("m");
  const at::Tensor a = logits_of(*manual, tiny_ids());
  h.set("m.config.attention_implementation", Value("pytorch_flash"));
  auto flash = h.get<Module>("m");  // same seed: same weights
  EXPECT_EQ(max_abs_diff(flash->state_dict().at("transformer.h.0.attn.k_attn.weight"),
                         manual->state_dict().at("transformer.h.0.attn.k_attn.weight")),
            0.0);
  const at::Tensor b = logits_of(*flash, tiny_ids());
  EXPECT_LE(max_abs_diff(a, b), 1e-5);
}

// GQA = MHA with each kv head repeated for its group of r consecutive query heads.
TEST(Gpt2AttentionTest, GqaEqualsMhaWithRepeatedKvHeads) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(tiny_toml(""));
  auto gqa = h.get<Module>("m");
  StateDict sd = gqa->state_dict();
  h.set("m.config.n_head_kv", Value(8));
  auto mha = h.get<Module>("m");
  const std::int64_t r = 4, hd = 16;
  for (int i = 0; i < 2; ++i)
    for (const char* w : {"k_attn", "v_attn"}) {
      for (const char* part : {"weight", "bias"}) {
        // [Hkv*hd(, d)] -> [Hkv, 1, hd(, d)] -> [Hkv, r, hd(, d)] -> [Hq*hd(, d)]: kv head j serves q heads j*r..j*r+r-1
        const std::string key = fmt::format("transformer.h.{}.attn.{}.{}", i, w, part);
        const at::Tensor t = sd.at(key);
        std::vector<std::int64_t> view = {2, 1, hd}, expanded = {2, r, hd}, out = {8 * hd};
        if (t.dim() == 2) {
          view.push_back(128);
          expanded.push_back(128);
          out.push_back(128);
        }
        sd[key] = t.view(view).expand(expanded).reshape(out).contiguous();
      }
    }
  mha->load_state_dict(sd, true);
  EXPECT_LE(max_abs_diff(logits_of(*gqa, tiny_ids()), logits_of(*mha, tiny_ids())), 1e-5);
}

TEST(Gpt2AttentionTest, AttentionDropoutAppliesInEvalModeLikeModalities) {
  for (const char* impl : {"manual", "pytorch_flash"}) {
    SCOPED_TRACE(impl);
    testing::Harness h{MODALITIES_TEST_PLUGIN};
    h.set_config_text(tiny_toml(""));
    h.set("m.config.attention_implementation", Value(impl));
    h.set("m.config.dropout", Value(0.5));
    auto m = h.get<Module>("m");
    m->eval();
    EXPECT_GT(max_abs_diff(logits_of(*m, tiny_ids()), logits_of(*m, tiny_ids())), 0.0);
  }
  // With dropout 0, eval is deterministic.
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(tiny_toml(""));
  auto m = h.get<Module>("m");
  m->eval();
  EXPECT_EQ(max_abs_diff(logits_of(*m, tiny_ids()), logits_of(*m, tiny_ids())), 0.0);
}

TEST(Gpt2AttentionTest, IsCausal) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(tiny_toml(""));
  auto m = h.get<Module>("m");
  const at::Tensor ids = tiny_ids();
  at::Tensor changed = ids.clone();
  changed.select(1, 10).fill_(3);
  const at::Tensor a = logits_of(*m, ids), b = logits_of(*m, changed);
  EXPECT_EQ(max_abs_diff(a.narrow(1, 0, 10), b.narrow(1, 0, 10)), 0.0);
  EXPECT_GT(max_abs_diff(a.narrow(1, 10, 6), b.narrow(1, 10, 6)), 0.0);
}

// ---- document masking (modules.cpp, Note [Document masking]) ------------------------------------

// Two packed samples of 16 tokens: documents of 5, 7 and 4 tokens, and of 10 and 6.
const std::vector<std::vector<std::int64_t>> kDocuments = {{5, 7, 4}, {10, 6}};

at::Tensor document_ids() {
  std::vector<std::int64_t> ids;
  for (const auto& lengths : kDocuments)
    for (std::size_t d = 0; d < lengths.size(); ++d) ids.insert(ids.end(), lengths[d], static_cast<std::int64_t>(d));
  return at::tensor(ids, at::kLong).view({2, 16});
}

// Logits and every parameter's gradient of (logits * weights).sum() for the packed samples.
struct Pass {
  at::Tensor logits;
  std::map<std::string, at::Tensor> grads;
};

Pass packed_pass(Module& m, const TensorMap& in, const at::Tensor& weights) {
  m.module().zero_grad();
  const at::Tensor logits = m.forward(in).at("logits");
  (logits * weights).sum().backward();
  Pass p{logits.detach(), {}};
  for (const auto& [name, t] : m.named_parameters()) p.grads[name] = t.grad().clone();
  return p;
}

// The same, each document run alone (from position 0) and its loss terms summed.
Pass one_by_one_pass(Module& m, const at::Tensor& ids, const at::Tensor& weights) {
  m.module().zero_grad();
  Pass p{at::zeros_like(weights), {}};
  for (std::int64_t b = 0; b < 2; ++b) {
    std::int64_t start = 0;
    for (const std::int64_t n : kDocuments[static_cast<std::size_t>(b)]) {
      const at::Tensor doc = ids.narrow(0, b, 1).narrow(1, start, n);
      const at::Tensor logits = m.forward({{"input_ids", doc}}).at("logits");
      (logits * weights.narrow(0, b, 1).narrow(1, start, n)).sum().backward();
      p.logits.narrow(0, b, 1).narrow(1, start, n).copy_(logits.detach());
      start += n;
    }
  }
  for (const auto& [name, t] : m.named_parameters()) p.grads[name] = t.grad().clone();
  return p;
}

// Largest difference over the largest value, of the logits and of the worst parameter gradient
// (each against its own largest entry). Without RoPE (`rope` false) k_attn's bias has a zero
// gradient in exact arithmetic (the softmax is shift invariant): what it gets is rounding noise,
// held to 1e-6 of the largest gradient entry of all instead.
std::pair<double, double> relative_differences(const Pass& a, const Pass& b, bool rope = true) {
  double largest = 0, grads = 0;
  for (const auto& [name, g] : a.grads) largest = std::max(largest, g.abs().max().item<double>());
  for (const auto& [name, g] : a.grads) {
    const bool zero_in_exact_arithmetic = !rope && name.ends_with("attn.k_attn.bias");
    grads = std::max(
        grads, max_abs_diff(g, b.grads.at(name)) / (zero_in_exact_arithmetic ? largest : g.abs().max().item<double>()));
  }
  return {max_abs_diff(a.logits, b.logits) / a.logits.abs().max().item<double>(), grads};
}

// A packed sample's logits and gradients equal those of its documents run one by one, for both
// attention implementations (pytorch_flash: document by document; with a sliding window, and
// manual: the masked T x T), RoPE (positions restarting at each document or continuing: RoPE
// depends on relative positions only, so both give the documents' own attention) and ABSOLUTE
// positions (restarting).
TEST(Gpt2DocumentMaskingTest, APackedSampleEqualsItsDocumentsRunOneByOne) {
  struct Case {
    const char* impl;
    const char* poe;
    const char* positions;
    std::int64_t window = 0;
  };
  for (const Case& c : {Case{"manual", "NOPE", "restart"}, Case{"pytorch_flash", "NOPE", "restart"},
                        Case{"manual", "NOPE", "continue"}, Case{"pytorch_flash", "NOPE", "continue"},
                        Case{"pytorch_flash", "ABSOLUTE", "restart"}, Case{"manual", "ABSOLUTE", "restart"},
                        Case{"pytorch_flash", "NOPE", "restart", 4}, Case{"manual", "NOPE", "continue", 4}}) {
    SCOPED_TRACE(fmt::format("{} {} {} window {}", c.impl, c.poe, c.positions, c.window));
    testing::Harness h{MODALITIES_TEST_PLUGIN};
    h.set_config_text(
        tiny_toml(fmt::format("document_ids_key = \"document_ids\"\ndocument_positions = \"{}\"", c.positions)));
    h.set("m.config.attention_implementation", Value(c.impl));
    h.set("m.config.poe_type", Value(c.poe));
    if (std::string(c.poe) == "ABSOLUTE") h.set("m.config.attention_config.qkv_transforms", Value(Value::List{}));
    if (c.window > 0) h.set("m.config.attention_config.sliding_window", Value(c.window));
    auto m = h.get<Module>("m");
    at::manual_seed(3);
    const at::Tensor ids = at::randint(1, 256, {2, 16}, at::kLong);
    const at::Tensor weights = at::randn({2, 16, 256});
    // In float32 (what training runs) the sums round differently; in float64 the acceptance's
    // bound (1e-6) holds with a wide margin on any CPU.
    for (const c10::ScalarType dtype : {at::kFloat, at::kDouble}) {
      m->to(c10::Device(c10::kCPU), dtype);
      const at::Tensor w = weights.to(dtype);
      const Pass packed = packed_pass(*m, {{"input_ids", ids}, {"document_ids", document_ids()}}, w);
      const Pass alone = one_by_one_pass(*m, ids, w);
      const auto [logits, grads] = relative_differences(alone, packed, std::string(c.poe) == "NOPE");
      std::printf("%s %s %s window %lld %s: logits %.2e, gradients %.2e of the largest value\n", c.impl, c.poe,
                  c.positions, static_cast<long long>(c.window), c10::toString(dtype), logits, grads);
      EXPECT_LE(logits, dtype == at::kDouble ? 1e-6 : 1e-5);
      EXPECT_LE(grads, dtype == at::kDouble ? 1e-6 : 1e-5);
    }
    // Without document ids the documents see each other: the test can fail.
    const Pass mixed = packed_pass(*m, {{"input_ids", ids}}, weights.to(at::kDouble));
    EXPECT_GT(relative_differences(one_by_one_pass(*m, ids, weights.to(at::kDouble)), mixed).first, 1e-3);
  }
}

// A sample of one document gives exactly what the model gives without document ids, and so does
// an input without the key (generation, evaluation without the collator).
TEST(Gpt2DocumentMaskingTest, OneDocumentPerSampleIsTheUnmaskedModelBitForBit) {
  for (const char* impl : {"manual", "pytorch_flash"}) {
    SCOPED_TRACE(impl);
    testing::Harness h{MODALITIES_TEST_PLUGIN};
    h.set_config_text(tiny_toml("document_ids_key = \"document_ids\"\ndocument_positions = \"restart\""));
    h.set("m.config.attention_implementation", Value(impl));
    auto masked = h.get<Module>("m");
    h.set_config_text(tiny_toml(""));
    h.set("m.config.attention_implementation", Value(impl));
    auto plain = h.get<Module>("m");
    const at::Tensor ids = tiny_ids(), weights = at::randn({ids.size(0), ids.size(1), 256});
    const Pass a = packed_pass(*plain, {{"input_ids", ids}}, weights);
    for (const TensorMap& in :
         {TensorMap{{"input_ids", ids}, {"document_ids", at::zeros_like(ids)}},
          TensorMap{{"input_ids", ids}, {"document_ids", at::full_like(ids, 7)}}, TensorMap{{"input_ids", ids}}}) {
      const Pass b = packed_pass(*masked, in, weights);
      EXPECT_TRUE(at::equal(a.logits, b.logits));
      for (const auto& [name, g] : a.grads) EXPECT_TRUE(at::equal(g, b.grads.at(name))) << name;
    }
  }
}

// Pipeline stages with document masking: each stage gets the document ids with its input (the
// schedule's stage inputs), so two stages chained give the whole model's logits bit for bit, with
// positions restarting (RoPE) or ABSOLUTE positions restarting in the first stage.
TEST(Gpt2DocumentMaskingTest, PipelineStagesTakeTheDocumentIdsWithTheirInput) {
  for (const char* poe : {"NOPE", "ABSOLUTE"}) {
    SCOPED_TRACE(poe);
    testing::Harness h{MODALITIES_TEST_PLUGIN};
    h.set_config_text(tiny_toml("document_ids_key = \"document_ids\"\ndocument_positions = \"restart\""));
    h.set("m.config.attention_implementation", Value("pytorch_flash"));
    h.set("m.config.poe_type", Value(poe));
    if (std::string(poe) == "ABSOLUTE") h.set("m.config.attention_config.qkv_transforms", Value(Value::List{}));
    auto whole = h.get<Module>("m");
    at::manual_seed(3);
    const at::Tensor ids = at::randint(1, 256, {2, 16}, at::kLong), docs = document_ids();
    const at::Tensor want = logits_of_documents(*whole, ids, docs);
    auto first = whole->clone(), last = whole->clone();
    first->retain_modules({"transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0"});
    last->retain_modules({"transformer.h.1", "transformer.lm_head_norm", "transformer.lm_head"});
    at::NoGradGuard no_grad;
    const at::Tensor hidden = first->forward({{"input_ids", ids}, {"document_ids", docs}}).at("logits");
    const at::Tensor got = last->forward({{"input_ids", hidden}, {"document_ids", docs}}).at("logits");
    EXPECT_TRUE(at::equal(got, want));
    // Without the ids the second stage attends across documents: the test can fail.
    EXPECT_FALSE(at::equal(last->forward({{"input_ids", hidden}}).at("logits"), want));
  }
}

TEST(Gpt2DocumentMaskingTest, BadDocumentIdsAndConfigsAreRefused) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(tiny_toml("document_ids_key = \"document_ids\""));
  auto m = h.get<Module>("m");
  const at::Tensor ids = tiny_ids();
  const auto error = [&](const TensorMap& in) {
    try {
      m->forward(in);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_THAT(error({{"input_ids", ids}, {"document_ids", at::zeros({ids.size(0), 3}, at::kLong)}}),
              HasSubstr("the input 'document_ids' (document_ids_key) has shape"));
  EXPECT_THAT(error({{"input_ids", ids}, {"document_ids", at::zeros(ids.sizes(), at::kFloat)}}),
              HasSubstr("must hold integer document ids"));
  h.set("m.config.document_ids_key", Value("input_ids"));
  EXPECT_THAT(h.build_error(), HasSubstr("m.config.document_ids_key: is 'input_ids'"));
  h.erase("m.config.document_ids_key");
  h.set("m.config.document_positions", Value("restart"));
  EXPECT_THAT(h.build_error(), HasSubstr("m.config.document_positions: is restart, but there is no document_ids_key"));
  h.set("m.config.document_positions", Value("sometimes"));
  EXPECT_THAT(h.build_error(), HasSubstr("m.config.document_positions: must be one of"));
}

// ---- tying, meta device, clone, seed, mixed precision -----------------------------------------

TEST(Gpt2TyingTest, SharedMatrixListedOnceStoredTwiceLoadedFromEitherKey) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(tiny_toml(""));
  h.set("m.config.use_weight_tying", Value(true));
  auto m = h.get<Module>("m");
  std::int64_t listed = 0;
  for (const auto& [name, p] : m->named_parameters())
    listed += name == "transformer.wte.weight" || name == "transformer.lm_head.weight";
  EXPECT_EQ(listed, 1);
  StateDict sd = m->state_dict();
  ASSERT_EQ(sd.count("transformer.wte.weight"), 1u);
  ASSERT_EQ(sd.count("transformer.lm_head.weight"), 1u);
  EXPECT_TRUE(sd.at("transformer.wte.weight").is_same(sd.at("transformer.lm_head.weight")));
  const at::Tensor w = at::randn({256, 128});
  StateDict only_head;
  for (const auto& [k, v] : sd) only_head[k] = v.clone();
  only_head.erase("transformer.wte.weight");
  only_head["transformer.lm_head.weight"] = w;
  m->load_state_dict(only_head, /*strict=*/true);
  EXPECT_EQ(max_abs_diff(m->state_dict().at("transformer.wte.weight"), w), 0.0);
  only_head["transformer.wte.weight"] = at::zeros({256, 128});  // both given: lm_head's wins (PyTorch order)
  m->load_state_dict(only_head, true);
  EXPECT_EQ(max_abs_diff(m->state_dict().at("transformer.wte.weight"), w), 0.0);
  // Gradients of both uses reach the one tensor.
  m->train(true);
  m->forward({{"input_ids", tiny_ids()}}).at("logits").sum().backward();
  EXPECT_TRUE(m->named_parameters().front().second.grad().defined());
}

TEST(Gpt2MetaTest, MetaModelMaterializesAndResets) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(tiny_toml("use_meta_device = true\n"));
  h.set("m.config.n_head_kv", Value(8));
  h.set("m.config.poe_type", Value("ABSOLUTE"));
  h.set("m.config.attention_config.qkv_transforms", Value(Value::List{}));
  auto m = h.get<Module>("m");
  ASSERT_NE(m, nullptr) << h.build_error();
  for (const auto& [name, p] : m->named_parameters()) EXPECT_TRUE(p.is_meta()) << name;
  EXPECT_THAT([&] { m->reset_parameters(); }, ::testing::ThrowsMessage<Error>(HasSubstr("meta device")));
  m->to(c10::kCPU, std::nullopt);  // uninitialized storage (to_empty)
  for (const auto& [name, p] : m->named_parameters()) {
    EXPECT_EQ(p.device(), c10::Device(c10::kCPU)) << name;
    EXPECT_TRUE(p.requires_grad()) << name;
  }
  m->reset_parameters();
  const StateDict sd = m->state_dict();
  EXPECT_EQ(max_abs_diff(sd.at("transformer.h.0.attention_norm.weight"), at::ones({128})), 0.0);
  EXPECT_EQ(max_abs_diff(sd.at("transformer.lm_head_norm.bias"), at::zeros({128})), 0.0);
  const double bound = 1.0 / std::sqrt(128.0);
  EXPECT_LE(sd.at("transformer.h.1.attn.q_attn.weight").abs().max().item<double>(), bound);
  EXPECT_LE(sd.at("transformer.h.1.attn.q_attn.bias").abs().max().item<double>(), bound);
  // SwiGLU hidden: int(2 * 512 / 3) = 341 -> 512, so W_2 has fan_in 512.
  EXPECT_LE(sd.at("transformer.h.1.mlp.W_2.weight").abs().max().item<double>(), 1.0 / std::sqrt(512.0));
  EXPECT_NEAR(sd.at("transformer.wte.weight").std().item<double>(), 1.0, 0.02);
  EXPECT_NEAR(sd.at("transformer.wpe.weight").std().item<double>(), 1.0, 0.05);
  const at::Tensor logits = logits_of(*m, tiny_ids());
  EXPECT_TRUE(logits.isfinite().all().item<bool>());
  // RoPE inv_freq of a rebuilt meta model (with RoPE) is recomputed too.
  h.set_config_text(tiny_toml("use_meta_device = true\n"));
  auto rope = h.get<Module>("m");
  rope->to(c10::kCPU, std::nullopt);
  rope->reset_parameters();
  const at::Tensor inv = rope->state_dict().at("transformer.h.0.attn.qkv_transforms.0.inv_freq");
  EXPECT_FLOAT_EQ(inv[1].item<float>(), 0.316227764f);
  EXPECT_TRUE(logits_of(*rope, tiny_ids()).isfinite().all().item<bool>());
}

TEST(Gpt2CloneTest, CloneIsADeepIndependentCopy) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied);
    testing::Harness h{MODALITIES_TEST_PLUGIN};
    h.set_config_text(tiny_toml(""));
    h.set("m.config.use_weight_tying", Value(tied));
    auto m = h.get<Module>("m");
    m->eval();
    auto c = m->clone();
    EXPECT_FALSE(c->is_training());
    const at::Tensor before = logits_of(*m, tiny_ids());
    EXPECT_EQ(max_abs_diff(logits_of(*c, tiny_ids()), before), 0.0);
    const StateDict cs = c->state_dict();
    EXPECT_EQ(cs.at("transformer.wte.weight").is_same(cs.at("transformer.lm_head.weight")), tied);
    {
      at::NoGradGuard no_grad;
      for (const auto& [name, p] : c->named_parameters()) p.add_(1.0);
    }
    EXPECT_EQ(max_abs_diff(logits_of(*m, tiny_ids()), before), 0.0);
    EXPECT_GT(max_abs_diff(logits_of(*c, tiny_ids()), before), 0.0);
    for (const auto& [name, p] : c->named_parameters()) EXPECT_TRUE(p.requires_grad()) << name;
    EXPECT_EQ(c->named_parameters().size(), m->named_parameters().size());
  }
}

TEST(Gpt2SeedTest, SeedMakesConstructionReproducible) {
  testing::Harness a{MODALITIES_TEST_PLUGIN}, b{MODALITIES_TEST_PLUGIN};
  a.set_config_text(tiny_toml(""));
  b.set_config_text(tiny_toml(""));
  const StateDict sa = a.get<Module>("m")->state_dict(), sb = b.get<Module>("m")->state_dict();
  for (const auto& [k, v] : sa) EXPECT_EQ(max_abs_diff(v, sb.at(k)), 0.0) << k;
  b.set("m.config.seed", Value(8));
  EXPECT_GT(max_abs_diff(sa.at("transformer.h.0.attn.q_attn.weight"),
                         b.get<Module>("m")->state_dict().at("transformer.h.0.attn.q_attn.weight")),
            0.0);
}

TEST(Gpt2MixedPrecisionTest, ExampleConfigRunsBf16WithFp32MasterWeights) {
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  auto raw = h.get<Module>("model_raw");
  auto m = h.get<Module>("model");
  ASSERT_NE(m, nullptr) << h.build_error();
  EXPECT_EQ(m.get(), raw.get());  // the same model, now in mixed precision
  EXPECT_EQ(m->param_dtype(), at::kBFloat16);
  m->train(true);
  const at::Tensor logits = m->forward({{"input_ids", tiny_ids()}}).at("logits");
  EXPECT_EQ(logits.scalar_type(), at::kBFloat16);
  logits.to(at::kFloat).logsumexp(-1).mean().backward();
  for (const auto& [name, p] : m->named_parameters()) {
    EXPECT_EQ(p.scalar_type(), at::kFloat) << name;
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_EQ(p.grad().scalar_type(), at::kFloat) << name;
  }
  // The buffer stays fp32.
  EXPECT_EQ(m->state_dict().at("transformer.h.0.attn.qkv_transforms.0.inv_freq").scalar_type(), at::kFloat);
  // FP_32 (the storage dtype) switches it off.
  h.set("model.config.mixed_precision_settings.param_dtype", Value("FP_32"));
  EXPECT_EQ(h.get<Module>("model")->param_dtype(), std::nullopt);
  EXPECT_THAT(h.get<Module>("model")->forward({{"input_ids", tiny_ids()}}).at("logits").scalar_type(), at::kFloat);
  h.set("model.config.mixed_precision_settings.param_dtype", Value("BF16"));
  EXPECT_THAT(h.build_error(), HasSubstr("model.config.mixed_precision_settings.param_dtype: must be one of"));
}

TEST(Gpt2ForwardTest, InputErrorsAreExplained) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(tiny_toml(""));
  auto m = h.get<Module>("m");
  EXPECT_THAT(
      [&] {
        m->forward({{"ids", tiny_ids()}});
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("the input has no 'input_ids' (sample_key)")));
  EXPECT_THAT([&] { m->forward({{"input_ids", at::zeros({1, 17}, at::kLong)}}); }, ::testing::Throws<std::exception>());
  try {
    m->forward({{"input_ids", at::zeros({1, 17}, at::kLong)}});
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("sequence_length) is 16"));
  }
  // Shorter sequences are fine.
  EXPECT_EQ(m->forward({{"input_ids", at::zeros({3, 5}, at::kLong)}}).at("logits").sizes().vec(),
            (std::vector<std::int64_t>{3, 5, 256}));
}

// ---- configuration errors (one per validator) ----------------------------------------------------

struct BadCase {
  std::string key;
  Value value;
  std::string message;
};

TEST(Gpt2ConfigTest, EveryValidatorNamesTheField) {
  const std::vector<BadCase> cases = {
      {"n_embd", Value(192), "m.config.n_embd: must be divisible by 128"},
      {"vocab_size", Value(250), "m.config.vocab_size: must be divisible by 128"},
      {"ffn_hidden", Value(100), "m.config.ffn_hidden: must be divisible by 128"},
      {"n_head_q", Value(3), "m.config.n_head_q: n_embd (128) must be divisible by n_head_q (3)"},
      {"n_head_kv", Value(3), "m.config.n_head_kv: n_head_q (8) must be divisible by n_head_kv (3)"},
      {"n_layer", Value(0), "m.config.n_layer: must be >= 1, got 0"},
      {"poe_type", Value("ABSOLUTE"),
       "m.config.attention_config.qkv_transforms[0].type_hint: RotaryTransform requires poe_type = \"NOPE\""},
      {"poe_type", Value("RELATIVE"), "m.config.poe_type: must be one of 'ABSOLUTE', 'NOPE'"},
      {"attention_config.qkv_transforms[0].config.n_head", Value(4),
       "m.config.attention_config.qkv_transforms[0].config.n_head: must equal n_head_q (8)"},
      {"attention_config.qkv_transforms[0].config.n_embd", Value(256),
       "m.config.attention_config.qkv_transforms[0].config.n_embd: must equal n_embd (128)"},
      {"attention_config.qkv_transforms[0].config.seq_length_dim", Value(-1),
       "m.config.attention_config.qkv_transforms[0].config.seq_length_dim: must be -2"},
      {"attention_config.qkv_transforms[0].config.base_freq", Value(5000),
       "m.config.attention_config.qkv_transforms[0].config.base_freq: must be >= 10000"},
      {"attention_config.qkv_transforms[0].type_hint", Value("RotaryTransfrom"),
       "m.config.attention_config.qkv_transforms[0].type_hint: must be one of 'IdentityTransform', "
       "'RotaryTransform', got 'RotaryTransfrom'"},
      {"use_meta_device", Value(true), "m.config.use_meta_device: must be false when use_weight_tying is true"},
      {"attention_implementation", Value("dao_flash"),
       "m.config.attention_implementation: 'dao_flash' (the flash-attn library) is not available in this build, use "
       "'pytorch_flash'"},
      {"activation_type", Value("relu"), "m.config.activation_type: must be one of 'gelu', 'gelu_tanh', 'swiglu'"},
      {"dropout", Value(-0.1), "m.config.dropout: must be in [0, 1]"},
      {"attention_norm_config.config.normalized_shape", Value(64),
       "m.config.attention_norm_config.config.normalized_shape: must equal n_embd (128), got 64"},
      {"lm_head_norm_config.config.ndim", Value(64),
       "m.config.lm_head_norm_config.config.ndim: must equal n_embd (128)"},
      {"ffn_norm_config.config.epsilon", Value(1e-6), "m.config.ffn_norm_config.config.epsilon: unknown key"},
      {"ffn_norm_config.norm_type", Value("batch_norm"),
       "m.config.ffn_norm_config.norm_type: must be one of 'layer_norm', 'rms_norm', 'pytorch_rms_norm'"},
      {"attention_config.qk_norm_config",
       Value(Value::Table{{"norm_type", Value("pytorch_rms_norm")},
                          {"config", Value(Value::Table{{"normalized_shape", Value(128)}})}}),
       "m.config.attention_config.qk_norm_config.config.normalized_shape: must equal the head dim n_embd / n_head_q "
       "(16)"},
      {"head_dim", Value(32),
       "m.config.attention_config.qkv_transforms[0].config.n_embd: must equal n_head_q * head_dim (256), the width "
       "of the query heads, got 128"},
      {"head_dim", Value(0), "m.config.head_dim: must be >= 1"},
      {"attention_config.qk_norm_position", Value("before_rope"),
       "m.config.attention_config.qk_norm_position: must be one of 'after_transforms', 'before_transforms'"},
      {"enforce_swiglu_hidden_dim_multiple_of", Value(0),
       "m.config.enforce_swiglu_hidden_dim_multiple_of: must be >= 1"},
      {"n_embd", Value(128.0), "m.config.n_embd: expected an integer"},
  };
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.key);
    testing::Harness h{MODALITIES_TEST_PLUGIN};
    h.set_config_text(tiny_toml(""));
    if (c.key == "use_meta_device") h.set("m.config.use_weight_tying", Value(true));
    h.set("m.config." + c.key, c.value);
    EXPECT_THAT(h.build_error(), HasSubstr(c.message));
  }
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.set_config_text(tiny_toml(""));
  h.erase("m.config.use_weight_tying");
  EXPECT_THAT(h.build_error(), HasSubstr("m.config.use_weight_tying: missing required key"));
}

// ffn_hidden != 4 n_embd is allowed (a warning, as in Modalities); layer_norm eps defaults of
// Note [layer_norm eps default] are covered by the parity cases (tiny embeddings make eps decisive).
TEST(Gpt2ConfigTest, ExampleConfigValidates) {
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  EXPECT_EQ(h.build_error(), "");
}

// --- document-masking step time (scripts/bench_document_masking.sh; opt-in) -----------------------
// Forward + backward of a small decoder (d 256, 4 blocks of 8 heads, RoPE, pytorch_flash, fp32) on
// 4 samples of T tokens cut from data/sample/train.pbin: plain causal attention next to
// document-masked attention on the bundled data's own document boundaries (its EOD tokens, id 0).

// The first b * (T + 1) tokens of the bundled packed file as b samples of T + 1.
at::Tensor bundled_samples(std::int64_t b, std::int64_t T) {
  std::ifstream in(std::string(MODALITIES_TEST_SOURCE_ROOT) + "/data/sample/train.pbin", std::ios::binary);
  std::uint64_t data_bytes = 0;
  std::uint32_t token_bytes = 0;
  in.read(reinterpret_cast<char*>(&data_bytes), 8);
  in.read(reinterpret_cast<char*>(&token_bytes), 4);
  if (!in || token_bytes != 2) throw Error("bench: data/sample/train.pbin is not the bundled 2-byte token file");
  std::vector<std::uint16_t> tokens(static_cast<std::size_t>(b * (T + 1)));
  in.read(reinterpret_cast<char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
  if (!in) throw Error("bench: data/sample/train.pbin is too short");
  return at::tensor(std::vector<std::int64_t>(tokens.begin(), tokens.end()), at::kLong).view({b, T + 1});
}

TEST(Gpt2DocumentMaskingBench, StepTimeNextToCausalAttention) {
  if (std::getenv("MODALITIES_DOCUMENT_MASKING_BENCH") == nullptr)
    GTEST_SKIP() << "set MODALITIES_DOCUMENT_MASKING_BENCH=1 (scripts/bench_document_masking.sh)";
  for (const std::int64_t T : {1024, 2048, 4096}) {
    testing::Harness h{MODALITIES_TEST_PLUGIN};
    h.set_config_text(tiny_toml("document_ids_key = \"document_ids\"\ndocument_positions = \"restart\""));
    h.set("m.config.attention_implementation", Value("pytorch_flash"));
    h.set("m.config.sequence_length", Value(T));
    h.set("m.config.n_layer", Value(4));
    h.set("m.config.n_embd", Value(256));
    h.set("m.config.ffn_hidden", Value(1024));
    h.set("m.config.vocab_size", Value(8192));
    h.set("m.config.attention_config.qkv_transforms",
          Value(Value::List{Value(Value::Table{{"type_hint", Value("RotaryTransform")},
                                               {"config", Value(Value::Table{{"n_embd", Value(256)},
                                                                             {"n_head", Value(8)},
                                                                             {"seq_length_dim", Value(-2)},
                                                                             {"base_freq", Value(10000)}})}})}));
    for (const char* norm : {"attention_norm_config", "ffn_norm_config"})
      h.set(fmt::format("m.config.{}.config.normalized_shape", norm), Value(256));
    h.set("m.config.lm_head_norm_config.config.ndim", Value(256));
    auto m = h.get<Module>("m");
    const at::Tensor rows = bundled_samples(4, T);
    const at::Tensor ids = rows.narrow(1, 0, T).contiguous();
    const at::Tensor eod = ids.eq(0).to(at::kLong);
    const at::Tensor docs = eod.cumsum(1) - eod;  // the collator's ids (collators.cpp, Note [Document ids])
    const double mean_length = static_cast<double>(4 * T) / (docs.select(1, T - 1) + 1).sum().item<double>();
    const auto step_ms = [&](const TensorMap& in) {
      const auto pass = [&] { m->forward(in).at("logits").logsumexp(-1).mean().backward(); };
      pass();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 3; ++i) pass();
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 3;
    };
    const double causal = step_ms({{"input_ids", ids}});
    const double masked = step_ms({{"input_ids", ids}, {"document_ids", docs}});
    std::printf(
        "bench_document_masking: T %lld, 4 samples, %.0f tokens per document on average, %d threads: causal "
        "%.1f ms, document-masked %.1f ms (%.2fx causal)\n",
        static_cast<long long>(T), mean_length, at::get_num_threads(), causal, masked, masked / causal);
  }
}

// Rough CPU timing of the tutorial config (run with --gtest_also_run_disabled_tests).
TEST(Gpt2TimingTest, DISABLED_TutorialForwardBackwardOnCpu) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  auto m = build(h, Tutorial());
  m->train(true);
  for (const std::int64_t bsz : {8}) {
    const at::Tensor ids = at::randint(0, 50304, {bsz, 256}, at::kLong);
    const at::Tensor targets = at::randint(0, 50304, {bsz, 256}, at::kLong);
    auto step = [&] {
      const at::Tensor loss = clm_loss(m->forward({{"input_ids", ids}}).at("logits"), targets);
      loss.backward();
    };
    step();
    const auto t0 = std::chrono::steady_clock::now();
    const int n = 3;
    for (int i = 0; i < n; ++i) step();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n;
    std::printf("[timing] tutorial config, batch %lld x 256, fp32, %d threads: %.3f s per forward+backward\n",
                static_cast<long long>(bsz), at::get_num_threads(), s);
  }
}

}  // namespace
}  // namespace modalities::plugins::gpt2
