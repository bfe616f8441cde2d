// model/parallelized in one process: the example (activation checkpointing, initialization, FSDP2)
// gives the weights, losses and gradients of the chained wrapper variants bit for bit, and bad
// tables are refused with their config path. The multi-rank twins (tensor parallel, HSDP,
// pipeline) are compared with their chained configs in tests/distributed.
#include <modalities/sdk/interfaces/module.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>

namespace modalities::plugins::parallelize {
namespace {

using modalities::testing::Harness;
using ::testing::HasSubstr;

std::string example() {
  std::ifstream in(std::string(MODALITIES_TEST_PLUGIN_SOURCE_DIR) + "/configs/example.toml");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The example up to its [model] node: the mesh and the raw GPT-2.
std::string mesh_and_raw_model() {
  const std::string text = example();
  return text.substr(0, text.find("[model]\n"));
}

// The example's graph as Modalities chains it: activation_checkpointed -> model_initialized ->
// fsdp2_wrapped.
std::string chained() {
  return mesh_and_raw_model() + R"(
[checkpointed]
component_key = "model"
variant_key = "activation_checkpointed"
config = { ac_variant = "full_activation_checkpointing", layers_fqn = "transformer.h", model = { instance_key = "model_raw", pass_type = "BY_REFERENCE" }, ac_fun_params = {} }

[initialized]
component_key = "model"
variant_key = "model_initialized"

[initialized.config]
model = { instance_key = "checkpointed", pass_type = "BY_REFERENCE" }

[initialized.config.model_initializer]
component_key = "model_initialization"
variant_key = "composed"
config = { model_type = "gpt2", weight_init_type = "scaled", mean = 0.0, std = 0.02, num_layers = "${model_raw.config.n_layer}" }

[model]
component_key = "model"
variant_key = "fsdp2_wrapped"
config = { model = { instance_key = "initialized", pass_type = "BY_REFERENCE" }, block_names = ["GPT2Block"], mixed_precision_settings = { param_dtype = "FP_32", reduce_dtype = "FP_32" }, reshard_after_forward = true, device_mesh = { instance_key = "device_mesh", pass_type = "BY_REFERENCE" } }
)";
}

Harness harness(const std::string& text) {
  Harness h(MODALITIES_TEST_PLUGIN);
  for (const char* plugin :
       {MODALITIES_TEST_GPT2_PLUGIN, MODALITIES_TEST_FSDP_PLUGIN, MODALITIES_TEST_MODEL_WRAPPERS_PLUGIN,
        MODALITIES_TEST_INITIALIZATION_PLUGIN, MODALITIES_TEST_PIPELINE_PLUGIN, MODALITIES_TEST_MESH_PLUGIN,
        MODALITIES_TEST_LOSSES_PLUGIN})
    h.load_plugin(plugin);
  h.set_config_text(text);
  return h;
}

// `model` of `text`, built after seeding the global generator the initializers draw from.
std::shared_ptr<Module> built_model(Harness& h) {
  at::manual_seed(3);
  auto m = h.get<Module>("model");
  EXPECT_NE(m, nullptr) << h.build_error();
  return m;
}

// The next-token loss of one training forward, backward done; dropout drawn after seeding.
at::Tensor train_step(Module& m, const at::Tensor& ids) {
  m.train(true);
  at::manual_seed(11);
  const at::Tensor logits = m.forward({{"input_ids", ids}}).at("logits");
  const std::int64_t V = logits.size(-1);
  at::Tensor loss = at::cross_entropy_loss(logits.narrow(1, 0, ids.size(1) - 1).reshape({-1, V}),
                                           ids.narrow(1, 1, ids.size(1) - 1).reshape({-1}));
  loss.backward();
  return loss.detach();
}

std::map<std::string, at::Tensor> by_name(const Module& m, bool grads) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, p] : m.named_parameters()) out[name] = grads ? p.grad() : p.detach().clone();
  return out;
}

void expect_equal(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.contains(name)) << what << ": no " << name;
    ASSERT_TRUE(got.at(name).defined()) << what << ": " << name;
    EXPECT_TRUE(at::equal(got.at(name), t))
        << what << ": " << name << " differs by " << (got.at(name) - t).abs().max().item<double>();
  }
}

TEST(ParallelizedTest, ExampleTrainsLikeTheChainedWrappersBitForBit) {
  Harness one = harness(example());
  Harness chain = harness(chained());
  const auto a = built_model(one);
  const auto b = built_model(chain);
  ASSERT_TRUE(a && b);
  EXPECT_TRUE(a->synchronizes_gradients());  // sharded
  EXPECT_EQ(a->pipeline(), nullptr);         // no pipeline table
  expect_equal(by_name(*a, false), by_name(*b, false), "initial weights");
  // The initializer ran: the scaled projections have std 0.02 / sqrt(2 n_layer), not the default.
  const at::Tensor proj = by_name(*a, false).at("transformer.h.0.attn.c_proj.weight");
  EXPECT_NEAR(proj.std().item<double>(), 0.02 / 2.0, 0.002);
  const auto ids = at::randint(0, 128, {4, 32}, at::kLong);
  for (int round = 0; round < 2; ++round) {
    EXPECT_TRUE(at::equal(train_step(*a, ids), train_step(*b, ids))) << "round " << round;
    expect_equal(by_name(*a, true), by_name(*b, true), fmt::format("gradients, round {}", round));
  }
}

TEST(ParallelizedTest, WithoutTablesTheModelIsReturnedAsBuilt) {
  std::string text = mesh_and_raw_model() + R"(
[model]
component_key = "model"
variant_key = "parallelized"
config = { model = { instance_key = "model_raw", pass_type = "BY_REFERENCE" }, device_mesh = { instance_key = "device_mesh", pass_type = "BY_REFERENCE" } }
)";
  Harness h = harness(text);
  const auto m = h.get<Module>("model");
  ASSERT_NE(m, nullptr) << h.build_error();
  EXPECT_EQ(m, h.get<Module>("model_raw"));
  EXPECT_FALSE(m->synchronizes_gradients());
}

// `edit` applied to the example's [model.config] line with `from`.
std::string example_with(const std::string& from, const std::string& to) {
  std::string text = example();
  const auto at = text.find(from);
  if (at == std::string::npos) throw std::runtime_error("the example has no '" + from + "'");
  return text.replace(at, from.size(), to);
}

TEST(ParallelizedTest, BadTablesAreRefusedWithTheirConfigPath) {
  const std::string fully_shard = "fully_shard = { block_names";
  {  // a table for a dim the mesh does not split over
    Harness h = harness(example_with(fully_shard, "tensor_parallel = { sequence_parallel = true }\n" + fully_shard));
    const std::string e = h.build_error();
    EXPECT_THAT(e, HasSubstr("model.config.tensor_parallel"));
    EXPECT_THAT(e, HasSubstr("has no tp dim"));
  }
  const std::string pipeline =
      "pipeline = { stages_generator = { component_key = \"stages_generator\", variant_key = "
      "\"gpt2_stages_generator\", config = { num_model_layers = 2, input_layer_equivalence = 1, "
      "output_layer_equivalence = 1 } }, pp_schedule_name = \"gpipe\", num_layers_per_stage = 1, batch_size = 4, "
      "microbatch_size = 2, loss_fn = LOSS }\n";
  const auto with_loss = [&](const std::string& loss) {
    std::string p = pipeline;
    return p.replace(p.find("LOSS"), 4, loss);
  };
  {
    Harness h = harness(example_with(fully_shard, with_loss("{ component_key = \"loss\", variant_key = "
                                                            "\"clm_cross_entropy_loss\", config = { target_key = "
                                                            "\"target_ids\", prediction_key = \"logits\" } }") +
                                                      fully_shard));
    const std::string e = h.build_error();
    EXPECT_THAT(e, HasSubstr("model.config.pipeline"));
    EXPECT_THAT(e, HasSubstr("has no pp dim"));
  }
  {  // loss_fn names a Module: refused before anything is built, under its path
    Harness h = harness(example_with(
        fully_shard, with_loss("{ instance_key = \"model_raw\", pass_type = \"BY_REFERENCE\" }") + fully_shard));
    EXPECT_THAT(h.build_error(), HasSubstr("model.config.pipeline.loss_fn"));
  }
  {  // an engine's error lands under the table it came from
    Harness h = harness(example_with("layers_fqn = \"transformer.h\"", "layers_fqn = \"transformer.blocks\""));
    const std::string e = h.build_error();
    EXPECT_THAT(e, HasSubstr("model.config.activation_checkpointing.layers_fqn"));
    EXPECT_THAT(e, HasSubstr("holds none of the model's blocks"));
  }
  {
    Harness h = harness(example_with("reshard_after_forward = true", "reshard_after_forward = true, prefetch = 3"));
    EXPECT_THAT(h.build_error(), HasSubstr("model.config.fully_shard.prefetch"));
  }
  {
    Harness h = harness(example_with("fully_shard = {", "fully_shared = {"));
    const std::string e = h.build_error();
    EXPECT_THAT(e, HasSubstr("model.config.fully_shared"));
    EXPECT_THAT(e, HasSubstr("did you mean 'fully_shard'"));
  }
}

}  // namespace
}  // namespace modalities::plugins::parallelize
