// model/parallelized (README.md): one variant that applies every parallelism a model takes, in one
// fixed order, on the engines of the wrapper variants (the same code, linked in):
//
//   1. tensor_parallel           Module::apply_tensor_parallel over the mesh's tp dim (the model's
//                                own capability; model/gpt2_tp calls the same method)
//   1b. expert parallelism       Module::apply_expert_parallel over the mesh's ep dim, whenever
//                                the mesh has one (expert_parallel_degree > 1; no table)
//   1c. context parallelism      Module::apply_context_parallel over the mesh's cp dim, whenever
//                                the mesh has one (context_parallel_degree > 1; no table)
//   2. activation_checkpointing  the blocks model/activation_checkpointed chooses
//                                (model_wrappers' engine)
//   3. initialization            materialize a meta model, reset, initialize on whole tensors
//                                (model/model_initialized's engine)
//   4. pipeline                  this rank's stages over the pp dim (pipeline/staged's engine)
//   5. fully_shard               FSDP2 over dp_shard x cp (HSDP with dp_replicate) of every stage
//                                module (model/fsdp2_wrapped's engine); expert weights over the
//                                ranks holding the same experts
//   6. the pipeline's schedule   over the sharded stage modules (pipeline/builder and
//                                pipeline/scheduled), which the gym runs
//
// TorchTitan's parallelize_* functions are the model: one function, one order. The order is that
// of the chained configs (configs/distributed/*_cpu.toml), so a parallelized config trains bit for
// bit like its chained twin (tests/distributed: DistributedParallelizedFullTest).
#include "activation_checkpointing.h"
#include "fully_shard.h"
#include "model_initialized.h"
#include "pipeline.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/interfaces/loss.h>
#include <modalities/sdk/interfaces/model_initializer.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/pipeline.h>
#include <modalities/sdk/interfaces/removable_handle.h>
#include <modalities/sdk/interfaces/stages_generator.h>
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/tensor_parallel.h>

#include <fmt/format.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace modalities::plugins::parallelize {
namespace {

using i64 = std::int64_t;

struct TensorParallelOptions {
  bool sequence_parallel = true;
  static void describe(Schema<TensorParallelOptions>& s) {
    s.field("sequence_parallel", &TensorParallelOptions::sequence_parallel,
            "Norms, dropout and residuals on each rank's chunk of the sequence between the parallel regions; false: "
            "replicated activations (all-reduce after each row-parallel layer).");
  }
};

struct PipelineOptions {
  Ref<StagesGenerator> stages_generator;
  std::string pp_schedule_name;
  i64 num_layers_per_stage = 1;
  i64 batch_size = 1;
  i64 microbatch_size = 1;
  Ref<Loss> loss_fn;
  static void describe(Schema<PipelineOptions>& s) {
    using C = PipelineOptions;
    s.field("stages_generator", &C::stages_generator, "Decides which modules each stage holds.").required();
    s.field("pp_schedule_name", &C::pp_schedule_name,
            "gpipe or 1F1B (one stage per rank), Interleaved1F1B or LoopedBFS (stages r, r + pp, ... on rank r); "
            "case-insensitive.")
        .required();
    s.field("num_layers_per_stage", &C::num_layers_per_stage,
            "Compute weight per stage in blocks; the stages generator derives the number of stages from it.")
        .required()
        .positive();
    s.field("batch_size", &C::batch_size, "The local micro-batch size the data loader gives.").required().positive();
    s.field("microbatch_size", &C::microbatch_size,
            "Samples per pipeline micro-batch; batch_size / microbatch_size micro-batches per step.")
        .required()
        .positive();
    s.field("loss_fn", &C::loss_fn, "Loss of the last stage, per pipeline micro-batch.").required();
  }
};

struct ParallelizedConfig {
  Ref<Module> model;
  Ref<DeviceMesh> device_mesh;
  std::optional<TensorParallelOptions> tensor_parallel;
  std::optional<model_wrappers::AcOptions> activation_checkpointing;
  std::optional<Ref<ModelInitializer>> initialization;
  std::optional<PipelineOptions> pipeline;
  std::optional<fsdp::Fsdp2Options> fully_shard;

  static void describe(Schema<ParallelizedConfig>& s) {
    using C = ParallelizedConfig;
    s.field("model", &C::model, "The model as its variant built it (model/gpt2, on the meta device or not).")
        .required();
    s.field("device_mesh", &C::device_mesh, "The run's layout: which of the tables below apply.").required();
    s.field("tensor_parallel", &C::tensor_parallel,
            "Step 1, needed when the mesh has a tp dim: { sequence_parallel = true }. The model must implement "
            "Module::apply_tensor_parallel.");
    s.field("activation_checkpointing", &C::activation_checkpointing,
            "Step 2: { ac_variant, layers_fqn, ac_fun_params }, as model/activation_checkpointed.");
    s.field("initialization", &C::initialization,
            "Step 3: a model_initialization component (e.g. composed); a meta-device model is materialized first, "
            "as model/model_initialized does.");
    s.field("pipeline", &C::pipeline,
            "Step 4, needed when the mesh has a pp dim: { stages_generator, pp_schedule_name, num_layers_per_stage, "
            "batch_size, microbatch_size, loss_fn }; the schedule is attached after fully_shard.");
    s.field("fully_shard", &C::fully_shard,
            "Step 5: { block_names, mixed_precision_settings, reshard_after_forward, layers_per_fsdp_unit, prefetch "
            "}, as model/fsdp2_wrapped, over the mesh's dp_shard (and dp_replicate) dims, per pipeline stage.");
  }
};

// A pipeline rank's stage module that knows its scheduled pipeline (Module::pipeline, which the gym
// runs). Everything else goes to the module it wraps: the optimizer, the clipper and the
// checkpoints see that module's (sharded) parameters under their canonical names.
class PipelinePart final : public Module {
 public:
  PipelinePart(std::shared_ptr<Module> inner, std::shared_ptr<Pipeline> pipeline)
      : inner_(std::move(inner)), pipeline_(std::move(pipeline)) {}

  TensorMap forward(const TensorMap& inputs) override { return inner_->forward(inputs); }
  torch::nn::Module& module() override { return inner_->module(); }
  const torch::nn::Module& module() const override { return inner_->module(); }
  NamedTensors named_parameters() const override { return inner_->named_parameters(); }
  StateDict state_dict() const override { return inner_->state_dict(); }
  void load_state_dict(const StateDict& state, bool strict) override { inner_->load_state_dict(state, strict); }
  void train(bool on) override { inner_->train(on); }
  bool is_training() const override { return inner_->is_training(); }
  void to(const c10::Device& device, std::optional<c10::ScalarType> dtype) override { inner_->to(device, dtype); }
  void set_param_dtype(std::optional<c10::ScalarType> dtype) override { inner_->set_param_dtype(dtype); }
  std::optional<c10::ScalarType> param_dtype() const override { return inner_->param_dtype(); }
  std::string sample_key() const override { return inner_->sample_key(); }
  std::string prediction_key() const override { return inner_->prediction_key(); }
  std::map<std::string, std::vector<std::string>> weight_decay_groups() const override {
    return inner_->weight_decay_groups();
  }
  std::vector<std::string> block_fqns() const override { return inner_->block_fqns(); }
  std::vector<std::string> submodules_of_class(std::string_view class_name) const override {
    return inner_->submodules_of_class(class_name);
  }
  void reset_parameters() override { inner_->reset_parameters(); }
  std::shared_ptr<Module> clone() const override { return inner_->clone(); }
  std::shared_ptr<RemovableHandle> add_hook(ModuleHook hook, std::span<const std::string> fqns) override {
    return inner_->add_hook(std::move(hook), fqns);
  }
  std::shared_ptr<RemovableHandle> add_block_runner(BlockRunner runner, std::span<const std::string> fqns) override {
    return inner_->add_block_runner(std::move(runner), fqns);
  }
  std::map<std::string, ShardPlacement> shard_placements() const override { return inner_->shard_placements(); }
  bool synchronizes_gradients() const override { return inner_->synchronizes_gradients(); }
  void set_requires_gradient_sync(bool sync) override { inner_->set_requires_gradient_sync(sync); }
  void apply_to_full_parameters(const std::function<void(Module&)>& fn) override {
    inner_->apply_to_full_parameters(fn);
  }
  std::optional<tp::VocabShard> vocab_shard() const override { return inner_->vocab_shard(); }
  std::optional<cp::SequenceShard> sequence_shard() const override { return inner_->sequence_shard(); }
  void retain_modules(const std::vector<std::string>& module_fqns) override { inner_->retain_modules(module_fqns); }
  void apply_tensor_parallel(const ParallelDims& dims, const tp::Options& options) override {
    inner_->apply_tensor_parallel(dims, options);
  }
  void apply_expert_parallel(const ParallelDims& dims) override { inner_->apply_expert_parallel(dims); }
  std::vector<std::string> expert_parallel_parameters() const override { return inner_->expert_parallel_parameters(); }
  std::vector<ModelMetric> take_metrics() override { return inner_->take_metrics(); }
  std::map<std::string, double> parameter_activity() const override { return inner_->parameter_activity(); }
  std::shared_ptr<Pipeline> pipeline() const override { return pipeline_; }

 private:
  std::shared_ptr<Module> inner_;
  std::shared_ptr<Pipeline> pipeline_;
};

// Runs `step`, reporting its config errors under `table` (`fully_shard.block_names`) and its other
// errors as an error of the table itself.
template <class F>
auto in_table(const std::string& table, F&& step) -> decltype(step()) {
  try {
    return step();
  } catch (const ConfigError& e) {
    std::vector<FieldError> errors = e.errors();
    for (FieldError& f : errors)
      if (f.path != "device_mesh") f.path = f.path.empty() ? table : table + "." + f.path;
    throw ConfigError(std::move(errors));
  } catch (const Error& e) {
    throw ConfigError(table, e.what());
  }
}

// A dim the mesh splits over needs the table that says how, and a table needs its dim.
void expect_table(const ParallelDims& dims, MeshDim dim, bool given, const std::string& table,
                  const std::string& example) {
  if (dims.enabled(dim) && !given)
    throw ConfigError(table, fmt::format("the device mesh ({}) has a {} dim of {} ranks: give `{} = {}`",
                                         dims.describe(), mesh_dim_name(dim), dims.degree(dim), table, example));
  if (!dims.enabled(dim) && given)
    throw ConfigError(table, fmt::format("is given, but the device mesh ({}) has no {} dim of more than one rank",
                                         dims.describe(), mesh_dim_name(dim)));
}

Value parallelize(const ParallelizedConfig& c, BuildContext& ctx) {
  const ParallelDims dims(c.device_mesh.shared());
  const DeviceMesh& mesh = *c.device_mesh;
  std::shared_ptr<Module> model = c.model.shared();

  expect_table(dims, MeshDim::tp, c.tensor_parallel.has_value(), "tensor_parallel", "{ sequence_parallel = true }");
  if (c.tensor_parallel)
    in_table("tensor_parallel",
             [&] { model->apply_tensor_parallel(dims, tp::Options{c.tensor_parallel->sequence_parallel}); });
  // Expert and context parallelism need no table: the mesh's ep and cp dims say everything (the
  // model splits its experts; it computes its tokens of every sequence).
  if (dims.enabled(MeshDim::ep)) in_table("model", [&] { model->apply_expert_parallel(dims); });
  if (dims.enabled(MeshDim::cp)) in_table("model", [&] { model->apply_context_parallel(dims); });
  if (c.activation_checkpointing)
    in_table("activation_checkpointing",
             [&] { model_wrappers::apply_activation_checkpointing(*model, *c.activation_checkpointing, ctx); });
  if (c.initialization)
    in_table("initialization",
             [&] { initialization::materialize_and_initialize(*model, **c.initialization, c.model.origin(), ctx); });

  expect_table(dims, MeshDim::pp, c.pipeline.has_value(), "pipeline",
               "{ stages_generator = ..., pp_schedule_name = \"gpipe\", num_layers_per_stage = ..., batch_size = ..., "
               "microbatch_size = ..., loss_fn = ... }");
  std::shared_ptr<Pipeline> staged;
  std::vector<std::shared_ptr<Module>> parts = {model};
  if (c.pipeline) {
    const PipelineOptions& p = *c.pipeline;
    staged = in_table("pipeline", [&] {
      return pipeline::stage_model(model, *p.stages_generator, mesh, p.pp_schedule_name, p.num_layers_per_stage);
    });
    parts = staged->model_parts();
  }
  if (c.fully_shard)
    for (std::shared_ptr<Module>& part : parts)
      part = in_table("fully_shard", [&] { return fsdp::shard_over_mesh(part, mesh, *c.fully_shard); });

  const std::string origin = "model/parallelized";
  const auto object = [&](std::shared_ptr<Module> m) {
    return Value(Object{std::string(Module::kInterface), std::static_pointer_cast<void>(std::move(m)), origin});
  };
  if (!staged) return object(parts.front());
  const PipelineOptions& p = *c.pipeline;
  std::shared_ptr<Pipeline> scheduled = pipeline::with_model_parts(*staged, parts);
  in_table("pipeline", [&] {
    pipeline::attach_schedule(*scheduled, p.loss_fn.shared(), p.pp_schedule_name, p.batch_size, p.microbatch_size);
  });
  // One stage module: a Module (as a one-model config expects); several (Interleaved1F1B,
  // LoopedBFS): the list, as pipeline/selector MODEL_PART gives it.
  if (parts.size() == 1) return object(std::make_shared<PipelinePart>(parts.front(), scheduled));
  Value::List out;
  for (const auto& part : parts) out.push_back(object(std::make_shared<PipelinePart>(part, scheduled)));
  return out;
}

void register_components(Registrar& r) {
  // A Module, or a list of them for a pipeline rank with several stages: registered by hand, as
  // model/fsdp2_wrapped is.
  VariantSpec spec = detail::make_spec<ParallelizedConfig>(
      "model", "parallelized",
      "Ours: tensor parallel, activation checkpointing, initialization, pipeline stages and FSDP2/HSDP applied in "
      "one fixed order from one table each; the same engines as the chained wrapper variants, bit for bit.",
      std::string(Module::kInterface));
  spec.build = [](const Value& config, BuildContext& ctx) -> Value {
    return parallelize(detail::parse_or_throw<ParallelizedConfig>(config), ctx);
  };
  r.add_variant(std::move(spec));
}

}  // namespace
}  // namespace modalities::plugins::parallelize

MODALITIES_PLUGIN(parallelize, MODALITIES_PLUGIN_VERSION, modalities::plugins::parallelize::register_components)
