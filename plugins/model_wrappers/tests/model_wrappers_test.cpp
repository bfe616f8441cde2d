// model/compiled: returns the model unchanged; an unknown block class is an error.
// model/activation_checkpointed and activation_checkpointed_fsdp1 on the bundled GPT-2 (dropout on,
// training mode): gradients and losses bit for bit those of the same model without checkpointing
// (the random state is replayed, so dropout draws the same masks in the recomputation); the same
// under model/fsdp2_wrapped (its gathers happen around the recomputed block); config errors; and
// the activation memory it saves, counted by a counting CPU allocator, with the time it costs.
#include <modalities/sdk/interfaces/module.h>
#include <modalities/testing/counting_allocator.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

namespace modalities::plugins::model_wrappers {
namespace {

using modalities::testing::Harness;
using ::testing::HasSubstr;

std::string example() {
  std::ifstream in(std::string(MODALITIES_TEST_PLUGIN_SOURCE_DIR) + "/configs/example.toml");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The example's model_raw table under another key (same seed: the same initial weights).
std::string copy_of_raw(const std::string& text, const std::string& key) {
  const auto begin = text.find("[model_raw]");
  const auto end = text.find("[model]\n");
  std::string t = text.substr(begin, end - begin);
  for (std::size_t at; (at = t.find("model_raw")) != std::string::npos;) t.replace(at, 9, key);
  return t;
}

Harness harness(const std::string& text) {
  Harness h(MODALITIES_TEST_PLUGIN);
  h.load_plugin(MODALITIES_TEST_GPT2_PLUGIN);
  h.load_plugin(MODALITIES_TEST_FSDP_PLUGIN);
  h.load_plugin(MODALITIES_TEST_MESH_PLUGIN);
  h.set_config_text(text);
  return h;
}

// Every second block of a copy of the example's model ("every_second_raw"), checkpointed.
constexpr const char* kEverySecond = R"(
[every_second]
component_key = "model"
variant_key = "activation_checkpointed"
config = { ac_variant = "selective_layer_activation_checkpointing", layers_fqn = "transformer.h", model = { instance_key = "every_second_raw", pass_type = "BY_REFERENCE" }, ac_fun_params = { ac_freq = 2 } }
)";

// Selective op checkpointing of a copy ("selective_op_raw"): every block, the projections' outputs
// kept under Modalities' every-second-matmul policy (aten.max: nothing computes it). Only
// projections without a bias count as aten.mm (PyTorch computes the others as addmm), so the
// tests give this copy no biases (nobias()) and compare it with a bias-free plain model.
constexpr const char* kSelectiveOp = R"(
[selective_op]
component_key = "model"
variant_key = "activation_checkpointed"
config = { ac_variant = "selective_op_activation_checkpointing", layers_fqn = "transformer.h", model = { instance_key = "selective_op_raw", pass_type = "BY_REFERENCE" }, ac_fun_params = { save_ops_keys = ["ops.aten.mm.default", "ops.aten.max.default"] } }
)";

// `table` with bias = false.
std::string nobias(std::string table) {
  const auto at = table.find("bias = true");
  if (at == std::string::npos) throw std::runtime_error("the example's model has no 'bias = true'");
  return table.replace(at, 11, "bias = false");
}

// The next-token loss of `m` on `ids`, dropout drawn after seeding.
at::Tensor clm_loss(Module& m, const at::Tensor& ids) {
  at::manual_seed(11);
  const at::Tensor logits = m.forward({{"input_ids", ids}}).at("logits");
  const std::int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.narrow(1, 0, ids.size(1) - 1).reshape({-1, V}),
                                ids.narrow(1, 1, ids.size(1) - 1).reshape({-1}));
}

// Loss of one training forward, backward done.
at::Tensor train_step(Module& m, const at::Tensor& ids) {
  m.train(true);
  at::Tensor loss = clm_loss(m, ids);
  loss.backward();
  return loss.detach();
}

void expect_same_gradients(Module& got, Module& want, const std::string& what) {
  std::map<std::string, at::Tensor> wanted;
  for (const auto& [name, p] : want.named_parameters()) wanted[name] = p.grad();
  for (const auto& [name, p] : got.named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << what << ": " << name;
    EXPECT_TRUE(at::equal(p.grad(), wanted.at(name))) << what << ": gradient of " << name << " differs by "
                                                      << (p.grad() - wanted.at(name)).abs().max().item<double>();
  }
}

TEST(ActivationCheckpointingTest, FullEverySecondBlockAndSelectiveOpGiveTheGradientsOfNoCheckpointingBitForBit) {
  std::string text = example();
  text += copy_of_raw(text, "plain") + copy_of_raw(text, "every_second_raw") + kEverySecond +
          nobias(copy_of_raw(text, "plain_nobias")) + nobias(copy_of_raw(text, "selective_op_raw")) + kSelectiveOp;
  Harness h = harness(text);
  const auto plain = h.get<Module>("plain");
  ASSERT_NE(plain, nullptr) << h.build_error();
  const auto ids = at::randint(0, 128, {4, 32}, at::kLong);
  const at::Tensor want = train_step(*plain, ids);
  for (const char* key : {"model", "every_second", "model_fsdp1_style"}) {
    const auto m = h.get<Module>(key);
    ASSERT_NE(m, nullptr) << h.build_error();
    const at::Tensor got = train_step(*m, ids);
    EXPECT_TRUE(at::equal(got, want)) << key << ": loss " << got.item<double>() << " vs " << want.item<double>();
    expect_same_gradients(*m, *plain, key);
  }
  {
    // Selective op (bias-free, so its projections count): also with a second backward through
    // the same graph (retain_graph), which recomputes and reuses the kept outputs again.
    const auto plain_nobias = h.get<Module>("plain_nobias");
    const auto selective = h.get<Module>("selective_op");
    ASSERT_NE(selective, nullptr) << h.build_error();
    for (Module* m : {plain_nobias.get(), selective.get()}) {
      m->train(true);
      at::Tensor loss = clm_loss(*m, ids);
      loss.backward({}, /*retain_graph=*/true);
      loss.backward();
    }
    expect_same_gradients(*selective, *plain_nobias, "selective_op (two backwards)");
  }
  // Evaluation (no grad) runs the blocks once, as without checkpointing. (The manual attention
  // applies its dropout in every mode, as Modalities' does, hence the seed.)
  at::NoGradGuard no_grad;
  const auto m = h.get<Module>("model");
  m->train(false);
  plain->train(false);
  at::manual_seed(5);
  const at::Tensor a = m->forward({{"input_ids", ids}}).at("logits");
  at::manual_seed(5);
  const at::Tensor b = plain->forward({{"input_ids", ids}}).at("logits");
  EXPECT_TRUE(at::equal(a, b));
}

TEST(ActivationCheckpointingTest, ShardedOverCheckpointedBlocksGivesTheGradientsOfShardedAlone) {
  std::string text = example();
  const std::string sharded = R"(
[device_mesh]
component_key = "device_mesh"
variant_key = "default"
config = { device_type = "cpu", data_parallel_shard_degree = -1, world_size = 1 }

[KEY]
component_key = "model"
variant_key = "fsdp2_wrapped"
config = { model = { instance_key = "INNER", pass_type = "BY_REFERENCE" }, block_names = ["GPT2Block"], mixed_precision_settings = { param_dtype = "FP_32", reduce_dtype = "FP_32" }, reshard_after_forward = true, device_mesh = { instance_key = "device_mesh", pass_type = "BY_REFERENCE" } }
)";
  const auto wrap = [&](const std::string& key, const std::string& inner, bool with_mesh) {
    std::string t = sharded.substr(with_mesh ? 0 : sharded.find("[KEY]"));
    t.replace(t.find("KEY"), 3, key);
    t.replace(t.find("INNER"), 5, inner);
    return t;
  };
  text += copy_of_raw(text, "plain") + wrap("sharded_checkpointed", "model", true) + wrap("sharded", "plain", false);
  Harness h = harness(text);
  const auto a = h.get<Module>("sharded_checkpointed");
  ASSERT_NE(a, nullptr) << h.build_error();
  const auto b = h.get<Module>("sharded");
  ASSERT_NE(b, nullptr) << h.build_error();
  const auto ids = at::randint(0, 128, {4, 32}, at::kLong);
  for (int round = 0; round < 2; ++round) {
    EXPECT_TRUE(at::equal(train_step(*a, ids), train_step(*b, ids))) << "round " << round;
    expect_same_gradients(*a, *b, fmt::format("round {}", round));
    // The gathered parameters of every block were freed again after backward.
    for (const auto& item : a->module().named_parameters(/*recurse=*/true))
      EXPECT_EQ(item.value().storage().nbytes(), 0u) << item.key();
    for (Module* m : {a.get(), b.get()})
      for (const auto& [name, p] : m->named_parameters()) p.mutable_grad().reset();
  }
}

TEST(CompiledTest, ReturnsTheSameModelAndChecksTheBlockNames) {
  Harness h = harness(example());
  const auto compiled = h.get<Module>("compiled_model");
  ASSERT_NE(compiled, nullptr) << h.build_error();
  EXPECT_EQ(compiled.get(), h.get<Module>("model").get());
  std::string text = example();
  text.replace(text.find("block_names = [\"GPT2Block\"]"), 27, "block_names = [\"GPT2Block\", \"LlamaBlock\"]");
  Harness bad = harness(text);
  EXPECT_THAT(bad.build_error(),
              HasSubstr("compiled_model.config.block_names[1]: the model has no submodule of class 'LlamaBlock'"));
}

TEST(ActivationCheckpointingTest, BadConfigsAreRefusedWithTheirPath) {
  const auto error_of = [](const std::string& variant, const std::string& layers, const std::string& params) {
    std::string text = example();
    const auto at = text.find("ac_variant = \"full_activation_checkpointing\"");
    text.replace(at, std::string("ac_variant = \"full_activation_checkpointing\"").size(),
                 fmt::format("ac_variant = \"{}\"", variant));
    text.replace(text.find("layers_fqn = \"transformer.h\""), 28, fmt::format("layers_fqn = \"{}\"", layers));
    text.replace(text.find("ac_fun_params = {}"), 18, "ac_fun_params = " + params);
    Harness h = harness(text);
    return h.build_error();
  };
  EXPECT_THAT(error_of("full_activation_checkpointing", "transformer.blocks", "{}"),
              HasSubstr("model.config.layers_fqn: 'transformer.blocks' holds none of the model's blocks "
                        "(\"transformer.h.0\" ... \"transformer.h.3\")"));
  EXPECT_THAT(error_of("selective_layer_activation_checkpointing", "transformer.h", "{}"),
              HasSubstr("model.config.ac_fun_params.ac_freq: selective_layer_activation_checkpointing needs ac_freq"));
  EXPECT_THAT(error_of("selective_layer_activation_checkpointing", "transformer.h", "{ ac_freq = 0 }"),
              HasSubstr("model.config.ac_fun_params.ac_freq: must be >= 1"));
  EXPECT_THAT(error_of("full_activation_checkpointing", "transformer.h", "{ ac_freq = 2 }"),
              HasSubstr("model.config.ac_fun_params: full_activation_checkpointing takes no parameters"));
  EXPECT_THAT(error_of("selective_op_activation_checkpointing", "transformer.h", "{}"),
              HasSubstr("model.config.ac_fun_params.save_ops_keys: selective_op_activation_checkpointing needs "
                        "save_ops_keys"));
  EXPECT_THAT(error_of("selective_op_activation_checkpointing", "transformer.h", "{ save_ops_keys = [] }"),
              HasSubstr("model.config.ac_fun_params.save_ops_keys: selective_op_activation_checkpointing needs"));
  EXPECT_THAT(error_of("selective_op_activation_checkpointing", "transformer.h",
                       "{ save_ops_keys = [\"ops.aten.mm.default\", "
                       "\"ops.aten._scaled_dot_product_flash_attention.default\"] }"),
              HasSubstr("model.config.ac_fun_params.save_ops_keys[1]: "
                        "'ops.aten._scaled_dot_product_flash_attention.default' is not supported"));
  EXPECT_THAT(error_of("selective_op_activation_checkpointing", "transformer.h",
                       "{ save_ops_keys = [\"ops._c10d_functional.reduce_scatter_tensor.default\"] }"),
              HasSubstr("model.config.ac_fun_params.save_ops_keys[0]: "
                        "'ops._c10d_functional.reduce_scatter_tensor.default' is not supported"));
  EXPECT_THAT(error_of("selective_op_activation_checkpointing", "transformer.h", "{ save_ops_keys = [\"aten.mm\"] }"),
              HasSubstr("model.config.ac_fun_params.save_ops_keys[0]: unknown key 'aten.mm'"));
  EXPECT_THAT(error_of("selective_op_activation_checkpointing", "transformer.h",
                       "{ ac_freq = 2, save_ops_keys = [\"ops.aten.mm.default\"] }"),
              HasSubstr("model.config.ac_fun_params.ac_freq: not a parameter of selective_op"));
  EXPECT_THAT(error_of("half_activation_checkpointing", "transformer.h", "{}"), HasSubstr("model.config.ac_variant"));
}

// --- activation memory --------------------------------------------------------------------------

using testing::CountingAllocator;  // modalities/testing/counting_allocator.h

// A GPT-2 whose block activations dominate (128-token vocabulary, 8 blocks, 256 tokens x 8
// samples): live bytes after forward (what backward will need) and the peak over forward +
// backward, without checkpointing, with every second block and with every block checkpointed;
// plus the time of a forward + backward. Checkpointing every block must keep less than half.
TEST(ActivationCheckpointingTest, SavesActivationMemoryAndReportsTheCost) {
  std::string base = example();
  for (const auto& [from, to] : std::map<std::string, std::string>{{"n_layer = 4", "n_layer = 8"},
                                                                   {"sequence_length = 32", "sequence_length = 256"}})
    for (std::size_t at; (at = base.find(from)) != std::string::npos;) base.replace(at, from.size(), to);
  // The same selective op on a copy with biases ("selective_op_bias").
  std::string selective_bias = kSelectiveOp;
  selective_bias.replace(selective_bias.find("[selective_op]"), 14, "[selective_op_bias]");
  selective_bias.replace(selective_bias.find("\"selective_op_raw\""), 18, "\"selective_op_bias_raw\"");
  const std::string text = base + copy_of_raw(base, "plain") + copy_of_raw(base, "every_second_raw") + kEverySecond +
                           nobias(copy_of_raw(base, "selective_op_raw")) + kSelectiveOp +
                           copy_of_raw(base, "selective_op_bias_raw") + selective_bias;
  Harness h = harness(text);
  ASSERT_NE(h.get<Module>("plain"), nullptr) << h.build_error();
  static CountingAllocator counting(c10::GetDefaultCPUAllocator());
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  const auto ids = at::randint(0, 128, {8, 256}, at::kLong);
  std::map<std::string, std::int64_t> kept;
  for (const char* key : {"plain", "every_second", "selective_op", "selective_op_bias", "model"}) {
    const auto m = h.get<Module>(key);
    m->train(true);
    for (int warm = 0; warm < 2; ++warm) {  // the second round is measured (first-touch effects gone)
      for (const auto& [name, p] : m->named_parameters()) p.mutable_grad().reset();
      const std::int64_t before = counting.live();
      counting.reset_peak();
      const auto t0 = std::chrono::steady_clock::now();
      at::Tensor loss = clm_loss(*m, ids);
      const std::int64_t after_forward = counting.live() - before;
      loss.backward();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (warm == 1) {
        kept[key] = after_forward;
        std::printf("%-13s kept after forward %8.2f MB, peak over forward+backward %8.2f MB, %.3f s\n", key,
                    static_cast<double>(after_forward) / 1e6, static_cast<double>(counting.peak() - before) / 1e6,
                    seconds);
      }
    }
  }
  c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), /*priority=*/101);
  EXPECT_LT(kept["every_second"], kept["plain"]);
  EXPECT_LT(kept["model"], kept["every_second"]);
  EXPECT_LT(kept["model"] * 2, kept["plain"]);
  // Selective op keeps some projections' outputs of every block: between full and nothing. With
  // biases its projections are addmm for Modalities' policy: nothing is kept, as with full.
  EXPECT_LT(kept["model"], kept["selective_op"]);
  EXPECT_LT(kept["selective_op"], kept["plain"]);
  EXPECT_EQ(kept["selective_op_bias"], kept["model"]);
}

}  // namespace
}  // namespace modalities::plugins::model_wrappers
