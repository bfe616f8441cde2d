// moe: the MoE feed-forward and model/gpt2_moe.
//  * The block against transformers 4.57.6's own MoE blocks on the same weights and input
//    (tests/data/*.safetensors, written by scripts/reference/make_moe_fixtures.py): Mixtral (softmax
//    top-2, normalized), Qwen2-MoE (not normalized, gated shared expert), Qwen3-MoE (normalized
//    top-3), and a token-by-token reference of DeepSeek-V3's sigmoid rule with a routed scaling
//    factor and a shared expert. Output within 1e-5 of its largest value, every gradient within
//    1e-5 of its largest entry, the tokens per expert exactly.
//  * Expert parallelism on 2 and 4 Gloo ranks against the same references: each rank's output and
//    input gradient rows, its experts' gradients (every rank's tokens), the others' summed.
//  * The two expert backends agree; the layer selection rules; the example model's FQNs, shapes,
//    forward and backward; meta device, reset_parameters and clone; refused configs by key path.
#include "moe.h"
#include "worker_case.h"

#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/safetensors.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/optimizer.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace modalities::plugins::moe {
namespace {

using ::testing::HasSubstr;

const std::filesystem::path kDir = MODALITIES_TEST_PLUGIN_SOURCE_DIR;
const std::filesystem::path kExample = kDir / "configs" / "example.toml";

double max_abs(const at::Tensor& t) { return t.abs().max().item<double>(); }
double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

struct Case {
  MoeConfig config;
  std::map<std::string, at::Tensor> tensors;
  std::string source;
};

Case read_case(const std::string& name) {
  const auto file = kDir / "tests" / "data" / (name + ".safetensors");
  Case c;
  for (auto& [key, t] : formats::read_safetensors(file)) c.tensors[key] = t;
  const auto meta = formats::read_safetensors_metadata(file);
  const auto num = [&](const std::string& k) { return std::stod(meta.at(k)); };
  c.config.num_experts = static_cast<std::int64_t>(num("num_experts"));
  c.config.top_k = static_cast<std::int64_t>(num("top_k"));
  c.config.moe_ffn_hidden = static_cast<std::int64_t>(num("moe_ffn_hidden"));
  c.config.score_function = meta.at("score_function") == "\"sigmoid\"" ? "sigmoid" : "softmax";
  c.config.norm_topk_prob = meta.at("norm_topk_prob") == "true";
  c.config.route_scale = num("route_scale");
  if (const auto h = static_cast<std::int64_t>(num("shared_hidden")); h > 0) {
    c.config.num_shared_experts = 1;
    c.config.shared_expert_ffn_hidden_per_expert = h;
  }
  c.config.shared_expert_gate = meta.at("shared_expert_gate") == "true";
  if (meta.contains("n_group")) {
    c.config.n_group = static_cast<std::int64_t>(num("n_group"));
    c.config.topk_group = static_cast<std::int64_t>(num("topk_group"));
    c.config.use_expert_bias = true;
  }
  if (meta.contains("capacity_factor")) {
    c.config.capacity_factor = num("capacity_factor");
    c.config.min_capacity = 0;
  }
  c.source = meta.at("source");
  return c;
}

std::shared_ptr<MoeFeedForwardImpl> block_with_weights(const Case& c) {
  const std::int64_t d = c.tensors.at("x").size(1);
  auto m = std::make_shared<MoeFeedForwardImpl>(c.config, d, at::TensorOptions().dtype(at::kFloat));
  at::NoGradGuard no_grad;
  std::size_t n = 0;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (auto& item : m->named_parameters(/*recurse=*/true)) tensors.emplace_back(item.key(), item.value());
  for (auto& item : m->named_buffers(/*recurse=*/true)) tensors.emplace_back(item.key(), item.value());
  for (auto& item : tensors) {
    const auto it = c.tensors.find("weight." + item.first);
    EXPECT_NE(it, c.tensors.end()) << "no reference weight for " << item.first;
    if (it == c.tensors.end()) continue;
    EXPECT_EQ(item.second.sizes(), it->second.sizes()) << item.first;
    item.second.copy_(it->second);
    ++n;
  }
  std::size_t expected = 0;
  for (const auto& [key, t] : c.tensors) expected += key.starts_with("weight.");
  EXPECT_EQ(n, expected) << "every reference weight is a parameter or buffer of the block";
  return m;
}

class Reference : public ::testing::TestWithParam<std::string> {};

TEST_P(Reference, OutputGradientsAndLoadMatchTheReference) {
  const Case c = read_case(GetParam());
  SCOPED_TRACE(c.source);
  for (const std::string backend : {"looped", "grouped_mm"}) {
    SCOPED_TRACE(backend);
    Case cb = c;
    cb.config.experts_backend = backend;
    auto m = block_with_weights(cb);
    const at::Tensor x = c.tensors.at("x").clone().set_requires_grad(true);
    const at::Tensor y = m->forward(x, 1, x.size(0), std::nullopt);
    const at::Tensor& want = c.tensors.at("y");
    EXPECT_LE(max_abs_diff(y, want), 1e-5 * max_abs(want));
    const Routing& r = m->last_routing();
    EXPECT_TRUE(at::equal(r.tokens_per_expert - r.dropped_per_expert, c.tensors.at("tokens_per_expert")))
        << r.tokens_per_expert << " - " << r.dropped_per_expert << " vs " << c.tensors.at("tokens_per_expert");
    (y * c.tensors.at("dy")).sum().backward();
    const at::Tensor& gx = c.tensors.at("grad.x");
    EXPECT_LE(max_abs_diff(x.grad(), gx), 1e-5 * max_abs(gx)) << "grad of the input";
    for (const auto& item : m->named_parameters(/*recurse=*/true)) {
      const at::Tensor& g = c.tensors.at("grad." + item.key());
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      EXPECT_LE(max_abs_diff(item.value().grad(), g), 1e-5 * max_abs(g)) << "grad of " << item.key();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Moe, Reference,
                         ::testing::Values("mixtral_top2", "qwen2_moe_shared_gate", "qwen3_moe_norm_topk",
                                           "sigmoid_scaled", "deepseek_v3_grouped", "capacity_drop"));

// DeepSeek-V3's group-limited routing with a selection bias (the fixture's reference chooses
// differently than plain top-k for some tokens): the bias moves the choices, not the weights.
TEST(Moe, TheBiasAndTheGroupsChooseTheExpertsNotTheirWeights) {
  const Case c = read_case("deepseek_v3_grouped");
  ASSERT_GT(std::stod(formats::read_safetensors_metadata(kDir / "tests" / "data" / "deepseek_v3_grouped.safetensors")
                          .at("changed_choices")),
            0);
  Case plain = c;
  plain.config.n_group = 1;
  plain.config.topk_group.reset();
  plain.config.use_expert_bias = false;
  plain.tensors.erase("weight.router.expert_bias");
  const at::Tensor& x = c.tensors.at("x");
  const at::Tensor y_plain = block_with_weights(plain)->forward(x, 1, x.size(0), std::nullopt);
  EXPECT_GT(max_abs_diff(y_plain, c.tensors.at("y")), 1e-3 * max_abs(c.tensors.at("y")))
      << "without the bias and groups the reference is missed";
  // Zero bias, one group: the plain block.
  Case unbiased = c;
  unbiased.config.n_group = 1;
  unbiased.config.topk_group.reset();
  unbiased.tensors.at("weight.router.expert_bias").zero_();
  EXPECT_LE(max_abs_diff(block_with_weights(unbiased)->forward(x, 1, x.size(0), std::nullopt), y_plain), 1e-6);
}

// One step of the auxiliary-loss-free update on the fixture's load, against the script's
// b + gamma * sign(mean load - load); the load counts training forwards with autograd only.
TEST(Moe, TheBiasUpdateMovesTowardsTheMeanLoad) {
  const Case c = read_case("deepseek_v3_grouped");
  auto m = block_with_weights(c);
  const at::Tensor& x = c.tensors.at("x");
  m->eval();
  m->forward(x, 1, x.size(0), std::nullopt);
  EXPECT_EQ(m->take_expert_load().sum().item<std::int64_t>(), 0) << "evaluation counts nothing";
  m->train();
  {
    at::NoGradGuard no_grad;  // an activation-checkpointed block's first forward
    m->forward(x, 1, x.size(0), std::nullopt);
  }
  m->forward(x, 1, x.size(0), std::nullopt);
  const at::Tensor load = m->take_expert_load();
  EXPECT_TRUE(at::equal(load, c.tensors.at("tokens_per_expert")));
  EXPECT_EQ(m->take_expert_load().sum().item<std::int64_t>(), 0) << "taken once";
  const double rate =
      std::stod(formats::read_safetensors_metadata(kDir / "tests" / "data" / "deepseek_v3_grouped.safetensors")
                    .at("expert_bias_update_rate"));
  m->update_expert_bias(load, rate);
  EXPECT_LE(max_abs_diff(m->router->expert_bias(), c.tensors.at("bias.updated")), 1e-9);
  // Twice the load of every expert gives the same signs.
  m->update_expert_bias(load * 2, rate);
  const at::Tensor twice = c.tensors.at("bias.updated") * 2 - c.tensors.at("weight.router.expert_bias");
  EXPECT_LE(max_abs_diff(m->router->expert_bias(), twice), 1e-7);
  // Reset: the bias is zero again.
  m->router->reset();
  EXPECT_EQ(m->router->expert_bias().abs().sum().item<double>(), 0.0);
}

// The capacity drops the overflow: with the residual policy, tokens all of whose slots were
// dropped pass through (the script's y.residual), the others are unchanged.
TEST(Moe, CapacityDropsTheOverflowInTokenOrder) {
  Case c = read_case("capacity_drop");
  const at::Tensor& x = c.tensors.at("x");
  const std::int64_t N = x.size(0);
  EXPECT_EQ(c.config.capacity(N), 6);  // ceil(0.5 * 24 * 2 / 4)
  c.config.min_capacity = 7;
  EXPECT_EQ(c.config.capacity(N), 7);
  c.config.min_capacity = 0;
  for (const std::string backend : {"looped", "grouped_mm"}) {
    SCOPED_TRACE(backend);
    c.config.experts_backend = backend;
    c.config.overflow_policy = "residual";
    auto m = block_with_weights(c);
    const at::Tensor y = m->forward(x, 1, N, std::nullopt);
    EXPECT_LE(max_abs_diff(y, c.tensors.at("y.residual")), 1e-5 * max_abs(c.tensors.at("y.residual")));
    const auto meta = formats::read_safetensors_metadata(kDir / "tests" / "data" / "capacity_drop.safetensors");
    EXPECT_EQ(m->last_routing().dropped_per_expert.sum().item<std::int64_t>(), std::stoll(meta.at("dropped_slots")));
  }
  // Dropless (no capacity_factor): the plain block, which differs.
  c.config.capacity_factor.reset();
  const at::Tensor dropless = block_with_weights(c)->forward(x, 1, N, std::nullopt);
  EXPECT_GT(max_abs_diff(dropless, c.tensors.at("y")), 1e-3 * max_abs(c.tensors.at("y")));
}

// Note [MoE auxiliary losses] (moe.cpp): for one block, transformers' load_balancing_loss_func is k
// times our load-balancing term; its router_z_loss_func is our z-loss. Both coefficients 1.
class AuxReference : public ::testing::TestWithParam<std::string> {};

at::Tensor aux_of(Case c, double aux, double z, const std::string& scope, const at::Tensor& x, std::int64_t B) {
  c.config.aux_loss_coef = aux;
  c.config.z_loss_coef = z;
  c.config.aux_loss_scope = scope;
  auto m = block_with_weights(c);
  m->forward(x, B, x.size(0) / B, std::nullopt);
  at::Tensor a = m->take_aux_loss();
  EXPECT_TRUE(a.defined());
  EXPECT_FALSE(m->take_aux_loss().defined()) << "taken once";
  return a;
}

TEST_P(AuxReference, LoadBalancingAndZLossMatchTransformers) {
  const Case c = read_case(GetParam());
  SCOPED_TRACE(c.source);
  const at::Tensor& x = c.tensors.at("x");
  const double k = static_cast<double>(c.config.top_k);
  const double hf_lb = c.tensors.at("aux.load_balancing").item<double>();
  const double hf_z = c.tensors.at("aux.z_loss").item<double>();
  const at::Tensor lb = aux_of(c, 1.0, 0.0, "micro_batch", x, 1);
  EXPECT_NEAR(lb.item<double>(), hf_lb / k, 1e-6 * hf_lb) << "load balancing";
  EXPECT_NEAR(aux_of(c, 0.0, 1.0, "micro_batch", x, 1).item<double>(), hf_z, 1e-6 * hf_z) << "z-loss";
  EXPECT_NEAR(aux_of(c, 0.01, 0.0, "micro_batch", x, 1).item<double>(), 0.01 * hf_lb / k, 1e-8) << "coefficient";
  // The gradient of both terms reaches the router weight (and nothing else: f has none).
  Case both = c;
  both.config.aux_loss_coef = both.config.z_loss_coef = 1.0;
  auto m = block_with_weights(both);
  m->forward(x, 1, x.size(0), std::nullopt);
  m->take_aux_loss().backward();
  const at::Tensor& want = c.tensors.at("aux.grad.router.gate.weight");
  EXPECT_LE(max_abs_diff(m->gate->weight.grad(), want), 1e-5 * max_abs(want));
  EXPECT_FALSE(m->experts->w1.grad().defined());
  // Sequence scope: the mean of the terms of each sequence alone (the fixture's 24 tokens are 2 x 12).
  const at::Tensor per_sequence = aux_of(c, 1.0, 0.0, "sequence", x, 2);
  const double first = aux_of(c, 1.0, 0.0, "micro_batch", x.narrow(0, 0, 12), 1).item<double>();
  const double second = aux_of(c, 1.0, 0.0, "micro_batch", x.narrow(0, 12, 12), 1).item<double>();
  EXPECT_NEAR(per_sequence.item<double>(), (first + second) / 2, 1e-6);
  EXPECT_GT(std::abs(per_sequence.item<double>() - lb.item<double>()), 1e-6) << "the scopes differ here";
}

INSTANTIATE_TEST_SUITE_P(Moe, AuxReference,
                         ::testing::Values("mixtral_top2", "qwen2_moe_shared_gate", "qwen3_moe_norm_topk"));

TEST(Moe, UniformRouterProbabilitiesGiveTheCoefficient) {
  // p_e = 1/E for every token (zero router weights): E * sum_e f_e / E = 1 whatever the choices,
  // for softmax and for sigmoid scores normalized over the experts.
  for (const std::string score : {"softmax", "sigmoid"}) {
    SCOPED_TRACE(score);
    Case c = read_case("mixtral_top2");
    c.config.score_function = score;
    c.tensors.at("weight.router.gate.weight").zero_();
    EXPECT_NEAR(aux_of(c, 0.3, 0.0, "micro_batch", c.tensors.at("x"), 1).item<double>(), 0.3, 1e-7);
    EXPECT_NEAR(aux_of(c, 0.3, 0.0, "sequence", c.tensors.at("x"), 2).item<double>(), 0.3, 1e-7);
    // z-loss of zero logits: logsumexp = log E.
    EXPECT_NEAR(aux_of(c, 0.0, 1.0, "micro_batch", c.tensors.at("x"), 1).item<double>(), std::pow(std::log(4.0), 2),
                1e-6);
  }
}

TEST(Moe, ABrokenExpertIsCaught) {
  // The comparison above can fail: a wrong expert weight moves the output past the tolerance.
  Case c = read_case("mixtral_top2");
  c.tensors.at("weight.experts.w2").select(0, 1).mul_(1.001);
  auto m = block_with_weights(c);
  const at::Tensor y = m->forward(c.tensors.at("x"), 1, c.tensors.at("x").size(0), std::nullopt);
  EXPECT_GT(max_abs_diff(y, c.tensors.at("y")), 1e-5 * max_abs(c.tensors.at("y")));
}

// A config as the schema would give it: top-1 softmax routing, no shared experts, every block MoE.
MoeConfig top1_softmax(std::int64_t experts, std::int64_t hidden) {
  MoeConfig c;
  c.num_experts = experts;
  c.top_k = 1;
  c.moe_ffn_hidden = hidden;
  c.score_function = "softmax";
  return c;
}

TEST(Moe, LayerSelection) {
  MoeConfig c = top1_softmax(4, 8);
  const auto layers = [&](std::int64_t n) {
    std::vector<std::int64_t> out;
    for (std::int64_t i = 0; i < n; ++i)
      if (c.is_moe_layer(i)) out.push_back(i);
    return out;
  };
  EXPECT_EQ(layers(4), (std::vector<std::int64_t>{0, 1, 2, 3}));
  c.first_k_dense_replace = 1;
  EXPECT_EQ(layers(4), (std::vector<std::int64_t>{1, 2, 3}));
  c.decoder_sparse_step = 2;  // (i + 1) % 2 == 0
  EXPECT_EQ(layers(6), (std::vector<std::int64_t>{1, 3, 5}));
  c.mlp_only_layers = {3};
  EXPECT_EQ(layers(6), (std::vector<std::int64_t>{1, 5}));
  EXPECT_EQ(c.shared_hidden(), 0);
  c.num_shared_experts = 2;
  EXPECT_EQ(c.shared_hidden(), 16);
  c.shared_expert_ffn_hidden_per_expert = 40;
  EXPECT_EQ(c.shared_hidden(), 80);
}

std::shared_ptr<Module> example_model(testing::Harness& h) {
  auto m = h.get<Module>("model_raw");
  EXPECT_NE(m, nullptr) << h.build_error();
  return m;
}

TEST(Gpt2Moe, ExampleModelHasDenseAndMoeBlocks) {
  testing::Harness h(MODALITIES_TEST_PLUGIN, kExample);
  auto m = example_model(h);
  ASSERT_NE(m, nullptr);
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (const auto& [name, t] : m->named_parameters()) shapes[name] = t.sizes().vec();
  EXPECT_EQ(shapes.at("transformer.h.0.mlp.W.weight"),
            (std::vector<std::int64_t>{512, 128}));  // dense SwiGLU: int(2 * 512 / 3) rounded up to 256
  EXPECT_FALSE(shapes.contains("transformer.h.0.mlp.router.gate.weight"));
  EXPECT_EQ(shapes.at("transformer.h.1.mlp.router.gate.weight"), (std::vector<std::int64_t>{8, 128}));
  EXPECT_EQ(shapes.at("transformer.h.1.mlp.experts.w1"), (std::vector<std::int64_t>{8, 128, 128}));
  EXPECT_EQ(shapes.at("transformer.h.1.mlp.experts.w2"), (std::vector<std::int64_t>{8, 128, 128}));
  EXPECT_EQ(shapes.at("transformer.h.1.mlp.experts.w3"), (std::vector<std::int64_t>{8, 128, 128}));
  EXPECT_EQ(shapes.at("transformer.h.1.mlp.shared_experts.W.weight"), (std::vector<std::int64_t>{256, 128}));
  EXPECT_EQ(shapes.at("transformer.h.1.mlp.shared_experts.W_2.weight"), (std::vector<std::int64_t>{128, 256}));
  EXPECT_EQ(shapes.at("transformer.h.1.mlp.shared_expert_gate.weight"), (std::vector<std::int64_t>{1, 128}));
  EXPECT_FALSE(shapes.contains("transformer.h.1.mlp.W.weight"));

  const at::Tensor ids = at::randint(0, 256, {2, 16}, at::kLong);
  const at::Tensor logits = m->forward({{"input_ids", ids}}).at("logits");
  EXPECT_EQ(logits.sizes(), (std::vector<std::int64_t>{2, 16, 256}));
  EXPECT_TRUE(at::isfinite(logits).all().item<bool>());
  logits.pow(2).mean().backward();
  for (const auto& [name, t] : m->named_parameters()) {
    ASSERT_TRUE(t.grad().defined()) << name;
    if (name.find("experts.w") == std::string::npos) {  // an expert no token chose has a zero gradient
      EXPECT_GT(t.grad().abs().sum().item<double>(), 0.0) << name;
    }
  }
}

TEST(Gpt2Moe, AuxiliaryLossesAreAModelOutputSummedOverTheMoeBlocks) {
  testing::Harness h(MODALITIES_TEST_PLUGIN, kExample);
  h.set("model_raw.config.n_layer", std::int64_t{3});  // blocks 1 and 2 are MoE
  h.set("model_raw.config.moe_config.aux_loss_coef", 0.01);
  h.set("model_raw.config.moe_config.z_loss_coef", 0.001);
  h.set("model_raw.config.moe_config.aux_loss_key", std::string("balance"));
  auto m = example_model(h);
  ASSERT_NE(m, nullptr);
  const at::Tensor ids = at::randint(0, 256, {2, 16}, at::kLong);
  const TensorMap out = m->forward({{"input_ids", ids}});
  ASSERT_TRUE(out.contains("balance"));
  const at::Tensor aux = out.at("balance");
  EXPECT_EQ(aux.dim(), 0);
  // The sum of the two blocks' losses, recomputed from what each block's routing kept.
  double sum = 0;
  std::size_t blocks = 0;
  for (const auto& child : m->module().modules(/*include_self=*/false))
    if (const auto* moe = dynamic_cast<const MoeFeedForwardImpl*>(child.get())) {
      sum += moe->aux_loss(moe->last_routing(), 2, 16).item<double>();
      ++blocks;
    }
  EXPECT_EQ(blocks, 2u);
  EXPECT_NEAR(aux.item<double>(), sum, 1e-6 * sum);
  EXPECT_GT(aux.item<double>(), 0.0);
  // The loss reaches the routers and what feeds them (block 1's experts feed block 2's router),
  // not the last block's experts or the head.
  aux.backward();
  for (const auto& [name, t] : m->named_parameters()) {
    const bool has = t.grad().defined() && t.grad().abs().sum().item<double>() > 0;
    if (name.find(".router.gate.") != std::string::npos || name.starts_with("transformer.h.1.mlp.experts")) {
      EXPECT_TRUE(has) << name;
    } else if (name.starts_with("transformer.h.2.mlp.experts") || name.starts_with("transformer.h.2.mlp.shared") ||
               name.find("lm_head") != std::string::npos) {
      EXPECT_FALSE(has) << name;
    }
  }
  // Without coefficients there is no such output.
  testing::Harness plain(MODALITIES_TEST_PLUGIN, kExample);
  EXPECT_FALSE(example_model(plain)->forward({{"input_ids", ids}}).contains("moe_aux_loss"));
}

// A block run by a block runner (activation checkpointing's seam) hands its auxiliary loss out
// with its output (plugins/gpt2, Note [Auxiliary losses through a block runner]): the outputs and
// every gradient equal those of the same model without a runner, bit for bit. A training forward
// without autograd (activation checkpointing's first run) computes the loss too, and a pipeline
// stage keeps its blocks' losses as an output (the pipeline carries them on).
TEST(Gpt2Moe, AuxiliaryLossesPassThroughBlockRunnersAndPipelineStages) {
  const auto build = [] {
    testing::Harness h(MODALITIES_TEST_PLUGIN, kExample);
    h.set("model_raw.config.moe_config.aux_loss_coef", 0.01);
    h.set("model_raw.config.moe_config.z_loss_coef", 0.001);
    return example_model(h);
  };
  auto plain = build(), run = build();
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(run, nullptr);
  int runs = 0;
  const auto handle = run->add_block_runner(
      [&runs](const at::Tensor& x, const BlockFunction& f) {
        ++runs;
        return f(x);
      },
      {});
  const at::Tensor ids = at::randint(0, 256, {2, 8}, at::kLong);
  const TensorMap a = plain->forward({{"input_ids", ids}}), b = run->forward({{"input_ids", ids}});
  EXPECT_EQ(runs, 2);  // both blocks
  ASSERT_TRUE(b.contains("moe_aux_loss"));
  EXPECT_TRUE(at::equal(a.at("logits"), b.at("logits")));
  EXPECT_TRUE(at::equal(a.at("moe_aux_loss"), b.at("moe_aux_loss")));
  for (const TensorMap* out : {&a, &b}) (out->at("logits").square().mean() + out->at("moe_aux_loss") * 3.0).backward();
  const NamedTensors pa = plain->named_parameters(), pb = run->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    ASSERT_TRUE(pa[i].second.grad().defined()) << pa[i].first;
    EXPECT_TRUE(at::equal(pa[i].second.grad(), pb[i].second.grad())) << pa[i].first;
  }
  {
    at::NoGradGuard no_grad;
    EXPECT_TRUE(run->forward({{"input_ids", ids}}).contains("moe_aux_loss"));
  }
  auto stage = build();
  stage->retain_modules({"transformer.wte", "transformer.h.0", "transformer.h.1"});
  const TensorMap s = stage->forward({{"input_ids", ids}});
  ASSERT_TRUE(s.contains("moe_aux_loss"));
  EXPECT_EQ(s.at("moe_aux_loss").dim(), 0);
}

TEST(Gpt2Moe, MetaDeviceResetAndClone) {
  testing::Harness h(MODALITIES_TEST_PLUGIN, kExample);
  h.set("model_raw.config.use_meta_device", true);
  h.erase("model_raw.config.seed");
  auto m = example_model(h);
  ASSERT_NE(m, nullptr);
  for (const auto& [name, t] : m->named_parameters()) EXPECT_TRUE(t.is_meta()) << name;
  m->to(c10::Device(c10::kCPU), std::nullopt);
  m->reset_parameters();
  for (const auto& [name, t] : m->named_parameters()) {
    EXPECT_FALSE(t.is_meta()) << name;
    if (name.ends_with("norm.weight") || name.find(".wte.") != std::string::npos) continue;  // ones, N(0, 1)
    EXPECT_LE(max_abs(t), 1.0) << name;                                                      // U(+-1/sqrt(fan_in))
  }
  const double bound = 1.0 / std::sqrt(128.0);
  for (const auto& [name, t] : m->named_parameters())
    if (name.ends_with("experts.w1")) {
      EXPECT_LE(max_abs(t), bound) << name;
    }
  auto copy = m->clone();
  const at::Tensor ids = at::randint(0, 256, {1, 8}, at::kLong);
  at::NoGradGuard no_grad;
  EXPECT_TRUE(
      at::equal(m->forward({{"input_ids", ids}}).at("logits"), copy->forward({{"input_ids", ids}}).at("logits")));
}

TEST(Gpt2Moe, SeededBuildsAreEqual) {
  testing::Harness a(MODALITIES_TEST_PLUGIN, kExample), b(MODALITIES_TEST_PLUGIN, kExample);
  auto ma = example_model(a), mb = example_model(b);
  ASSERT_TRUE(ma && mb);
  const auto pa = ma->named_parameters(), pb = mb->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i].second, pb[i].second)) << pa[i].first;
}

// Under tensor parallelism a MoE block computes whole on every tp rank (the distributed EP2 x TP2
// run checks the numbers); sequence parallelism is refused by name.
TEST(Gpt2Moe, TensorParallelKeepsTheBlockWhole) {
  const MoeConfig c = top1_softmax(2, 4);
  MoeFeedForwardImpl m(c, 8, at::TensorOptions());
  EXPECT_TRUE(m.replicated_under_tensor_parallel());
  gpt2::TpPlan plan;
  plan.size = 2;
  for (const bool sequence_parallel : {false, true}) {
    plan.sequence_parallel = sequence_parallel;
    EXPECT_NO_THROW(m.check_tensor_parallel(plan));
  }
}

TEST(Gpt2Moe, BadConfigsNameTheKey) {
  struct Bad {
    std::string path;
    Value value;
    std::string message;
  };
  const std::vector<Bad> cases = {
      {"model_raw.config.moe_config.top_k", Value(std::int64_t{9}),
       "model_raw.config.moe_config.top_k: is 9, more than num_experts = 8"},
      {"model_raw.config.moe_config.score_function", Value(std::string("relu")),
       "model_raw.config.moe_config.score_function: must be one of"},
      {"model_raw.config.moe_config.num_experts", Value(std::int64_t{0}), "model_raw.config.moe_config.num_experts"},
      {"model_raw.config.moe_config.route_scale", Value(0.0), "model_raw.config.moe_config.route_scale"},
      {"model_raw.config.moe_config.experts_backend", Value(std::string("cutlass")),
       "model_raw.config.moe_config.experts_backend: must be one of"},
      {"model_raw.config.moe_config.first_k_dense_replace", Value(std::int64_t{2}),
       "model_raw.config.moe_config: selects no MoE block of the 2 blocks"},
      {"model_raw.config.moe_config.mlp_only_layers", Value(Value::List{Value(5)}),
       "model_raw.config.moe_config.mlp_only_layers[0]: is 5, not a block of the model"},
      {"model_raw.config.moe_config.num_shared_experts", Value(std::int64_t{0}),
       "model_raw.config.moe_config.shared_expert_gate: is true, but there is no shared expert"},
      {"model_raw.config.moe_config.aux_loss_coef", Value(-0.1), "model_raw.config.moe_config.aux_loss_coef"},
      {"model_raw.config.moe_config.z_loss_coef", Value(-1.0), "model_raw.config.moe_config.z_loss_coef"},
      {"model_raw.config.moe_config.aux_loss_scope", Value(std::string("batch")),
       "model_raw.config.moe_config.aux_loss_scope: must be one of"},
      {"model_raw.config.moe_config.aux_loss_key", Value(std::string("")), "model_raw.config.moe_config.aux_loss_key"},
      {"model_raw.config.n_head_kv", Value(std::int64_t{3}), "model_raw.config.n_head_kv"},  // gpt2's own checks
  };
  for (const Bad& c : cases) {
    SCOPED_TRACE(c.path);
    testing::Harness h(MODALITIES_TEST_PLUGIN, kExample);
    h.set(c.path, c.value);
    EXPECT_THAT(h.build_error(), HasSubstr(c.message));
  }
  testing::Harness h(MODALITIES_TEST_PLUGIN, kExample);
  h.erase("model_raw.config.moe_config");
  EXPECT_THAT(h.build_error(), HasSubstr("model_raw.config.moe_config: missing required key"));
}

// optimizer/moe_load_balanced over AdamW: a step updates the parameters and moves every balancing
// block's bias by expert_bias_update_rate towards its mean load.
TEST(MoeLoadBalanced, AStepMovesEveryBiasTowardsTheMeanLoad) {
  testing::Harness h(MODALITIES_TEST_PLUGIN);
  h.load_plugin(MODALITIES_TEST_OPTIMIZERS_PLUGIN);
  h.set_config_text(testing::read_file(kExample) + R"(
[adam]
component_key = "optimizer"
variant_key = "adam_w"
config = { lr = 1e-3, betas = [0.9, 0.95], eps = 1e-8, weight_decay = 0.0, weight_decay_groups_excluded = [], wrapped_model = { instance_key = "model_raw", pass_type = "BY_REFERENCE" } }

[optimizer]
component_key = "optimizer"
variant_key = "moe_load_balanced"
config = { expert_bias_update_rate = 0.01, optimizer = { instance_key = "adam", pass_type = "BY_REFERENCE" }, model = { instance_key = "model_raw", pass_type = "BY_REFERENCE" } }
)");
  h.set("model_raw.config.n_layer", std::int64_t{3});  // blocks 1 and 2 are MoE
  h.set("model_raw.config.moe_config.use_expert_bias", true);
  auto m = h.get<Module>("model_raw");
  auto opt = h.get<Optimizer>("optimizer");
  ASSERT_NE(opt, nullptr) << h.build_error();
  EXPECT_EQ(opt->num_param_groups(), h.get<Optimizer>("adam")->num_param_groups());
  std::vector<MoeFeedForwardImpl*> blocks;
  for (const auto& child : m->module().modules(/*include_self=*/false))
    if (auto* b = dynamic_cast<MoeFeedForwardImpl*>(child.get())) blocks.push_back(b);
  ASSERT_EQ(blocks.size(), 2u);
  for (auto* b : blocks) EXPECT_EQ(b->router->expert_bias().abs().sum().item<double>(), 0.0);
  const at::Tensor before = m->named_parameters().front().second.detach().clone();
  const at::Tensor ids = at::randint(0, 256, {2, 16}, at::kLong);
  std::vector<at::Tensor> loads;
  for (int micro = 0; micro < 2; ++micro) {  // two micro-batches: their loads add up
    m->forward({{"input_ids", ids.roll(micro, 1)}}).at("logits").pow(2).mean().backward();
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const at::Tensor l = blocks[i]->last_routing().tokens_per_expert;
      if (micro == 0) loads.push_back(l.clone());
      else loads[i] += l;
    }
  }
  opt->step();
  EXPECT_FALSE(at::equal(before, m->named_parameters().front().second)) << "AdamW stepped";
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const at::Tensor l = loads[i].to(at::kFloat);
    const at::Tensor want = (l.mean() - l).sign() * 0.01;
    EXPECT_LE(max_abs_diff(blocks[i]->router->expert_bias(), want), 1e-9) << "block " << i;
    EXPECT_GT(blocks[i]->router->expert_bias().abs().sum().item<double>(), 0.0);
  }
  // The bias is part of the model's state (checkpoints hold it).
  EXPECT_TRUE(m->state_dict().contains("transformer.h.1.mlp.router.expert_bias"));
  // A model without balancing blocks is refused by name.
  h.set("model_raw.config.moe_config.use_expert_bias", false);
  EXPECT_THAT(h.build_error(),
              HasSubstr("optimizer.config.model: has no MoE block with moe_config.use_expert_bias = true"));
}

// --- expert parallelism (moe.cpp, Note [Expert parallelism]) ------------------------------------

struct EpRuntime {
  EpRuntime() {
    dist::RuntimeOptions o;
    o.backend = "gloo";
    o.timeout = std::chrono::seconds(60);
    dist::init(dist::launch_env(), o);
  }
  ~EpRuntime() { dist::shutdown(); }
};

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

at::Tensor summed_over_ranks(const at::Tensor& t) {
  std::vector<at::Tensor> v = {t.clone()};
  dist::world()->allreduce(v)->wait();
  return v[0];
}

// Rank r of G takes rows [r N/G, (r + 1) N/G) of the reference's input. Its output and input
// gradient are those rows of the reference's; the gradients of its experts are the reference's
// of experts [r E/G, (r + 1) E/G) (every rank's tokens reach them), the router's and the shared
// experts' add up over the ranks to the reference's; its routing is that of its rows alone.
void expect_expert_parallel_matches(const std::string& name, const std::string& backend) {
  const std::int64_t r = dist::rank(), G = dist::world_size();
  Case c = read_case(name);
  c.config.experts_backend = backend;
  SCOPED_TRACE(fmt::format("{}, {}, rank {} of {}", c.source, backend, r, G));
  const at::Tensor& x = c.tensors.at("x");
  const std::int64_t n = x.size(0) / G, L = c.config.num_experts / G;
  auto m = block_with_weights(c);
  m->apply_expert_parallel(ExpertParallel(dist::world(), r, G));
  EXPECT_EQ(m->experts->size(), L);
  const at::Tensor mine = x.narrow(0, r * n, n).clone().set_requires_grad(true);
  const at::Tensor y = m->forward(mine, 1, n, std::nullopt);
  const at::Tensor want = c.tensors.at("y").narrow(0, r * n, n);
  EXPECT_LE(max_abs_diff(y, want), 1e-5 * max_abs(c.tensors.at("y"))) << "output";
  const at::Tensor alone = block_with_weights(c)->route(mine, std::nullopt).tokens_per_expert;
  EXPECT_TRUE(at::equal(m->last_routing().tokens_per_expert, alone)) << "routing of this rank's rows";
  (y * c.tensors.at("dy").narrow(0, r * n, n)).sum().backward();
  const at::Tensor& gx = c.tensors.at("grad.x");
  EXPECT_LE(max_abs_diff(mine.grad(), gx.narrow(0, r * n, n)), 1e-5 * max_abs(gx)) << "grad of the input";
  for (const auto& item : m->named_parameters(/*recurse=*/true)) {
    const at::Tensor& ref = c.tensors.at("grad." + item.key());
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    const bool expert = item.key().starts_with("experts.");
    const at::Tensor got = expert ? item.value().grad() : summed_over_ranks(item.value().grad());
    const at::Tensor wanted = expert ? ref.narrow(0, r * L, L) : ref;
    EXPECT_LE(max_abs_diff(got, wanted), 1e-5 * max_abs(ref)) << "grad of " << item.key();
  }
}

// The bytes this rank's all-to-alls must send for one forward and backward of `routing` (this
// rank's) under expert parallelism over the world, rows of `row_bytes`: the rows of its tokens for
// the other ranks' experts and the results of their tokens for its experts, each twice (the
// backward retraces both). Collective: every rank's tokens per expert are summed into [G, E].
std::int64_t all_to_all_bytes_of(const Routing& routing, std::int64_t row_bytes) {
  const std::int64_t r = dist::rank(), G = dist::world_size();
  const at::Tensor mine = routing.tokens_per_expert.to(at::kLong).cpu();
  const std::int64_t E = mine.numel();
  std::vector<at::Tensor> all = {at::zeros({G, E}, mine.options())};
  all[0][r].copy_(mine);
  dist::world()->allreduce(all)->wait();                         // every rank's row
  const at::Tensor by_rank = all[0].view({G, G, E / G}).sum(2);  // [source rank, rank of the experts]
  const std::int64_t own = by_rank[r][r].item<std::int64_t>();
  const std::int64_t sent = by_rank[r].sum().item<std::int64_t>() - own;
  const std::int64_t returned = by_rank.select(1, r).sum().item<std::int64_t>() - own;
  return 2 * (sent + returned) * row_bytes;
}

MODALITIES_WORKER_CASE(MoeEpWorker, MatchesTheReferences) {
  const EpRuntime runtime;
  std::int64_t cases = 0;
  for (const std::string name : {"mixtral_top2", "qwen2_moe_shared_gate", "qwen3_moe_norm_topk"}) {
    if (read_case(name).config.num_experts % dist::world_size() != 0) continue;
    ++cases;
    for (const std::string backend : {"looped", "grouped_mm"}) expect_expert_parallel_matches(name, backend);
  }
  EXPECT_GT(cases, 0);
  // Ranks whose experts no token chooses (a selection bias of -1000 on experts 2 and 3) receive
  // no rows, and every rank still completes forward and backward with the one-process result.
  const std::int64_t r = dist::rank(), G = dist::world_size();
  for (const std::string backend : {"looped", "grouped_mm"}) {
    SCOPED_TRACE(backend);
    Case c = read_case("mixtral_top2");
    c.config.experts_backend = backend;
    c.config.use_expert_bias = true;
    c.tensors["weight.router.expert_bias"] = at::tensor({0.0f, 0.0f, -1000.0f, -1000.0f});
    const std::int64_t n = c.tensors.at("x").size(0) / G;
    const at::Tensor x = c.tensors.at("x").narrow(0, r * n, n);
    const at::Tensor x1 = x.clone().set_requires_grad(true), x2 = x.clone().set_requires_grad(true);
    auto alone = block_with_weights(c);
    alone->forward(x1, 1, n, std::nullopt).sum().backward();
    auto ep = block_with_weights(c);
    ep->apply_expert_parallel(ExpertParallel(dist::world(), r, G));
    const at::Tensor y = ep->forward(x2, 1, n, std::nullopt);
    EXPECT_EQ(ep->last_routing().tokens_per_expert.narrow(0, 2, 2).sum().item<std::int64_t>(), 0);
    y.sum().backward();
    EXPECT_LE(max_abs_diff(x2.grad(), x1.grad()), 1e-5 * max_abs(x1.grad()));
    // What the all-to-alls sent is what this routing needs (rank 1's experts receive nothing).
    EXPECT_EQ(ep->take_all_to_all_bytes(), all_to_all_bytes_of(ep->last_routing(), x.size(1) * 4));
    EXPECT_EQ(ep->take_all_to_all_bytes(), 0);
  }
}

void run_ep(int ranks) {
  testing::expect_workers_pass(
      testing::run_workers(MODALITIES_TEST_HOST_BINARY, ranks, "MoeEpWorker.MatchesTheReferences", {}, 120), ranks);
}

TEST(MoeExpertParallel, TwoRanksMatchTransformersBlocks) { run_ep(2); }
TEST(MoeExpertParallel, FourRanksMatchTransformersBlocks) { run_ep(4); }

TEST(MoeExpertParallel, OneRankIsTheBlockAndBadDegreesAreRefused) {
  const Case c = read_case("mixtral_top2");
  auto m = block_with_weights(c);
  m->apply_expert_parallel(ExpertParallel({}, 0, 1));
  const at::Tensor& x = c.tensors.at("x");
  EXPECT_LE(max_abs_diff(m->forward(x, 1, x.size(0), std::nullopt), c.tensors.at("y")),
            1e-5 * max_abs(c.tensors.at("y")));
  EXPECT_THAT(error_of([&] { m->apply_expert_parallel(ExpertParallel({}, 0, 1)); }), HasSubstr("applied twice"));
  EXPECT_THAT(error_of([&] { block_with_weights(c)->apply_expert_parallel(ExpertParallel({}, 0, 3)); }),
              HasSubstr("is 4, which is not divisible by the expert-parallel degree 3"));
  EXPECT_THAT(error_of([&] { block_with_weights(c)->apply_expert_parallel(ExpertParallel({}, 0, 2)); }),
              HasSubstr("needs a process group of 2 ranks, got none"));
  EXPECT_THAT(error_of([&] { block_with_weights(c)->apply_expert_parallel(ExpertParallel({}, 2, 2)); }),
              HasSubstr("needs a rank in [0, 2), got 2"));
}

// --- step-time benchmark (scripts/bench_moe.sh; opt-in: MODALITIES_MOE_BENCH=1) ---------------------
// Forward + backward of one feed-forward on B = 8 sequences of T = 256 tokens of width 256: the MoE
// block (8 experts of hidden 512, top-2 softmax, each backend) next to the dense SwiGLU of the same
// active size (hidden 2 x 512), fp32 on the CPU; with two ranks, expert parallelism over them
// (each rank its own 8 sequences). Prints mean milliseconds over 10 timed passes after 3 warm-up
// passes, and under EP the all-to-all bytes per step against those of perfectly balanced routing.
constexpr std::int64_t kBenchD = 256, kBenchE = 8, kBenchK = 2, kBenchF = 512, kBenchB = 8, kBenchT = 256;

MoeConfig bench_config(const std::string& backend) {
  MoeConfig c;
  c.num_experts = kBenchE;
  c.top_k = kBenchK;
  c.moe_ffn_hidden = kBenchF;
  c.score_function = "softmax";
  c.experts_backend = backend;
  return c;
}

template <class F>
double mean_ms(F&& pass) {
  for (int i = 0; i < 3; ++i) pass();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 10; ++i) pass();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 10;
}

std::shared_ptr<MoeFeedForwardImpl> bench_block(const std::string& backend) {
  at::manual_seed(0);
  auto m = std::make_shared<MoeFeedForwardImpl>(bench_config(backend), kBenchD, at::TensorOptions().dtype(at::kFloat));
  at::NoGradGuard no_grad;
  m->gate->reset();
  m->experts->reset();
  return m;
}

double block_ms(gpt2::FeedForward& ffn, const at::Tensor& x) {
  return mean_ms([&] {
    const at::Tensor in = x.detach().requires_grad_(true);
    ffn.forward(in, kBenchB, kBenchT, std::nullopt).sum().backward();
  });
}

TEST(MoeBench, StepTimeNextToTheDenseFeedForward) {
  if (std::getenv("MODALITIES_MOE_BENCH") == nullptr)
    GTEST_SKIP() << "set MODALITIES_MOE_BENCH=1 (scripts/bench_moe.sh)";
  at::manual_seed(1);
  const at::Tensor x = at::randn({kBenchB * kBenchT, kBenchD});
  gpt2::SwiGLUImpl dense(kBenchD, kBenchK * kBenchF, /*bias=*/false, at::TensorOptions().dtype(at::kFloat));
  for (auto* l : {dense.W.get(), dense.V.get(), dense.W_2.get()}) l->reset();
  const double dense_ms = block_ms(dense, x);
  std::printf("bench_moe: threads %d, tokens %lld, d %lld, experts %lld, top-%lld, expert hidden %lld\n",
              at::get_num_threads(), static_cast<long long>(kBenchB * kBenchT), static_cast<long long>(kBenchD),
              static_cast<long long>(kBenchE), static_cast<long long>(kBenchK), static_cast<long long>(kBenchF));
  std::printf("bench_moe: cpp dense_swiglu_hidden_%lld %.2f ms\n", static_cast<long long>(kBenchK * kBenchF), dense_ms);
  for (const std::string backend : {"looped", "grouped_mm"}) {
    auto m = bench_block(backend);
    const double ms = block_ms(*m, x);
    std::printf("bench_moe: cpp moe_%s %.2f ms (%.2fx dense)\n", backend.c_str(), ms, ms / dense_ms);
  }
}

MODALITIES_WORKER_CASE(MoeEpWorker, Bench) {
  const EpRuntime runtime;
  const std::int64_t r = dist::rank(), G = dist::world_size();
  auto m = bench_block("looped");
  m->apply_expert_parallel(ExpertParallel(dist::world(), r, G));
  at::manual_seed(100 + r);
  const at::Tensor x = at::randn({kBenchB * kBenchT, kBenchD});
  const double ms = block_ms(*m, x);
  // What the all-to-alls sent (counted in the calls) against what this routing needs: every rank's
  // tokens per expert (the same routing at every pass: the weights do not change) give the rows
  // this rank sends for the other ranks' experts and the results of their tokens it sends back;
  // the backward sends both again, fp32 rows of d.
  (void)m->take_all_to_all_bytes();  // the timed passes'
  {
    const at::Tensor in = x.detach().requires_grad_(true);
    m->forward(in, kBenchB, kBenchT, std::nullopt).sum().backward();
  }
  const double counted = static_cast<double>(m->take_all_to_all_bytes());  // one more pass's
  const double theory = static_cast<double>(all_to_all_bytes_of(m->last_routing(), kBenchD * 4));
  EXPECT_EQ(counted, theory) << "rank " << r;
  const double balanced = 4.0 * static_cast<double>(kBenchB * kBenchT * kBenchK * (G - 1) / G * kBenchD * 4);
  const at::Tensor t = at::tensor({ms, counted, theory, balanced}, at::kDouble);
  std::vector<at::Tensor> v = {t.clone()};
  dist::world()->allreduce(v)->wait();
  if (r == 0)
    std::printf(
        "bench_moe: cpp moe_ep%lld_looped %.2f ms per rank (1 thread each; mean over ranks), all-to-all %.4f MB per "
        "rank and step as sent (this routing needs %.4f MB; balanced routing: %.4f MB)\n",
        static_cast<long long>(G), v[0][0].item<double>() / G, v[0][1].item<double>() / G / 1e6,
        v[0][2].item<double>() / G / 1e6, v[0][3].item<double>() / G / 1e6);
}

TEST(MoeBench, ExpertParallelStepTimeOnTwoRanks) {
  if (std::getenv("MODALITIES_MOE_BENCH") == nullptr)
    GTEST_SKIP() << "set MODALITIES_MOE_BENCH=1 (scripts/bench_moe.sh)";
  const testing::CommandResult r = testing::run_workers(MODALITIES_TEST_HOST_BINARY, 2, "MoeEpWorker.Bench", {}, 300);
  testing::expect_workers_pass(r, 2);
  std::printf("%s", r.out.c_str());
}

}  // namespace
}  // namespace modalities::plugins::moe
