// Out-of-line members of the component interfaces. Every interface's virtual
// destructor is its key function, so each class gets exactly one vtable and one
// typeinfo, here in libmodalities_sdk.so (see Note [Object identity] in
// schema.h). Also here: the defaults of the non-pure virtuals, kept out of the
// headers so that improving a default does not require rebuilding plugins, and
// the batch helpers that report errors.
#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/app_state.h>
#include <modalities/sdk/interfaces/batch.h>
#include <modalities/sdk/interfaces/checkpoint_loading.h>
#include <modalities/sdk/interfaces/checkpoint_saving.h>
#include <modalities/sdk/interfaces/checkpoint_saving_execution.h>
#include <modalities/sdk/interfaces/checkpoint_saving_strategy.h>
#include <modalities/sdk/interfaces/collate_fn.h>
#include <modalities/sdk/interfaces/data_loader.h>
#include <modalities/sdk/interfaces/dataset.h>
#include <modalities/sdk/interfaces/dataset_batch_generator.h>
#include <modalities/sdk/interfaces/debugging.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/interfaces/gradient_clipper.h>
#include <modalities/sdk/interfaces/loss.h>
#include <modalities/sdk/interfaces/lr_scheduler.h>
#include <modalities/sdk/interfaces/message_subscriber.h>
#include <modalities/sdk/interfaces/mfu_calculator.h>
#include <modalities/sdk/interfaces/model_initializer.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/optimizer.h>
#include <modalities/sdk/interfaces/pipeline.h>
#include <modalities/sdk/interfaces/pipeline_stage.h>
#include <modalities/sdk/interfaces/removable_handle.h>
#include <modalities/sdk/interfaces/sampler.h>
#include <modalities/sdk/interfaces/stages_generator.h>
#include <modalities/sdk/interfaces/steppable_component.h>
#include <modalities/sdk/interfaces/steppable_profiler.h>
#include <modalities/sdk/interfaces/text_inference_component.h>
#include <modalities/sdk/interfaces/tokenizer.h>
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/parameter_count.h>
#include <modalities/sdk/python_format.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <cstddef>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace modalities {

// --- key functions --------------------------------------------------------------

AppState::~AppState() = default;
BatchSampler::~BatchSampler() = default;
CheckpointLoading::~CheckpointLoading() = default;
CheckpointSaving::~CheckpointSaving() = default;
CheckpointSavingExecution::~CheckpointSavingExecution() = default;
CheckpointSavingStrategy::~CheckpointSavingStrategy() = default;
CollateFn::~CollateFn() = default;
DataLoader::~DataLoader() = default;
Dataset::~Dataset() = default;
DatasetBatchGenerator::~DatasetBatchGenerator() = default;
Debugging::~Debugging() = default;
DeviceMesh::~DeviceMesh() = default;
c10::intrusive_ptr<c10d::ProcessGroup> DeviceMesh::expert_shard_process_group() const { return {}; }
DistributedCheckpointLoading::~DistributedCheckpointLoading() = default;
GradientClipper::~GradientClipper() = default;
Loss::~Loss() = default;
bool Loss::accepts_vocab_shards() const { return false; }
bool Loss::accepts_sequence_shards() const { return false; }
LRScheduler::~LRScheduler() = default;
MessageSubscriber::~MessageSubscriber() = default;
MFUCalculator::~MFUCalculator() = default;
ModelInitializer::~ModelInitializer() = default;
Module::~Module() = default;
Optimizer::~Optimizer() = default;
Pipeline::~Pipeline() = default;
PipelineSchedule::~PipelineSchedule() = default;
void PipelineSchedule::set_stage_inputs(TensorMap inputs) {
  if (inputs.empty()) return;
  std::vector<std::string> keys;
  for (const auto& [k, v] : inputs) keys.push_back(k);
  throw Error(fmt::format("this pipeline schedule cannot pass the samples' {} to its stages", fmt::join(keys, ", ")));
}
PipelineStage::~PipelineStage() = default;
RemovableHandle::~RemovableHandle() = default;
Sampler::~Sampler() = default;
StagesGenerator::~StagesGenerator() = default;
SteppableComponent::~SteppableComponent() = default;
SteppableProfiler::~SteppableProfiler() = default;
TextInferenceComponent::~TextInferenceComponent() = default;
Tokenizer::~Tokenizer() = default;
std::optional<std::filesystem::path> Tokenizer::huggingface_folder() const { return std::nullopt; }

namespace {

// "'a', 'b'" (at most `limit` names, then "... (n more)") for messages.
std::string key_list(const std::vector<std::string>& keys, std::size_t limit = 10) {
  std::string s;
  for (std::size_t i = 0; i < keys.size() && i < limit; ++i) s += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > limit) s += fmt::format(", ... ({} more)", keys.size() - limit);
  return s.empty() ? "none" : s;
}

std::vector<std::string> keys_of(const TensorMap& m) {
  std::vector<std::string> keys;
  keys.reserve(m.size());
  for (const auto& [k, v] : m) keys.push_back(k);
  return keys;
}

std::string shape_string(const at::Tensor& t) {
  std::string s = "[";
  for (std::int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

const at::Tensor& first_tensor(const TensorMap& m, std::string_view owner, std::string_view what) {
  if (m.empty() || !m.begin()->second.defined()) throw Error(fmt::format("{} has no {} tensor", owner, what));
  return m.begin()->second;
}

const at::Tensor& tensor_at(const TensorMap& m, const std::string& key, std::string_view what) {
  auto it = m.find(key);
  if (it == m.end())
    throw Error(fmt::format("InferenceResultBatch has no {} '{}' (has: {})", what, key, key_list(keys_of(m))));
  return it->second;
}

void move_all(TensorMap& m, const c10::Device& device, bool non_blocking) {
  for (auto& [k, t] : m)
    if (t.defined()) t = t.to(device, t.scalar_type(), non_blocking);
}

void detach_all(TensorMap& m) {
  for (auto& [k, t] : m)
    if (t.defined()) t = t.detach();
}

// The class name as configs spell it: torch::nn::Module::name() is the
// demangled C++ type ("modalities::plugins::gpt2::GPT2BlockImpl") unless the
// module set its own; strip namespaces and the TORCH_MODULE "Impl" suffix.
std::string_view config_class_name(std::string_view name) {
  if (auto pos = name.rfind("::"); pos != std::string_view::npos) name.remove_prefix(pos + 2);
  constexpr std::string_view kImpl = "Impl";
  if (name.size() > kImpl.size() && name.ends_with(kImpl)) name.remove_suffix(kImpl.size());
  return name;
}

}  // namespace

// --- batches --------------------------------------------------------------------

void DatasetBatch::to(const c10::Device& device, bool non_blocking) {
  move_all(samples, device, non_blocking);
  move_all(targets, device, non_blocking);
}

void DatasetBatch::detach() {
  detach_all(samples);
  detach_all(targets);
}

c10::Device DatasetBatch::device() const { return first_tensor(samples, "DatasetBatch", "sample").device(); }

std::int64_t DatasetBatch::size() const { return first_tensor(samples, "DatasetBatch", "sample").size(batch_dim); }

const at::Tensor& InferenceResultBatch::get_targets(const std::string& key) const {
  return tensor_at(targets, key, "target");
}

const at::Tensor& InferenceResultBatch::get_predictions(const std::string& key) const {
  return tensor_at(predictions, key, "prediction");
}

void InferenceResultBatch::to(const c10::Device& device, bool non_blocking) {
  move_all(targets, device, non_blocking);
  move_all(predictions, device, non_blocking);
}

void InferenceResultBatch::to_cpu() { to(c10::Device(c10::kCPU), /*non_blocking=*/false); }

void InferenceResultBatch::detach() {
  detach_all(targets);
  detach_all(predictions);
}

std::int64_t InferenceResultBatch::size() const {
  return first_tensor(predictions, "InferenceResultBatch", "prediction").size(batch_dim);
}

std::string result_line(const EvaluationResultBatch& r) {
  std::string s = fmt::format("step: {} | ", r.num_train_steps_done);
  for (const ResultItems* group : {&r.throughput_metrics, &r.losses, &r.metrics}) {
    for (std::size_t i = 0; i < group->size(); ++i) {
      const auto& [key, item] = (*group)[i];
      // Without decimal places Modalities formats the 0-d mean tensor, and Tensor.__format__
      // prints a 0-d tensor as its item(): the float's repr.
      const double mean = py::mean_as_float(item.value);
      if (i > 0) s += " | ";
      s += key + ": " + py::float_repr(item.decimal_places ? py::round(mean, *item.decimal_places) : mean);
    }
    s += " | ";
  }
  return s;
}

namespace {

// The trainable parameters at their global sizes, each tensor once, each weighted by the share
// `activity` gives it (1 when it lists none).
double weighted_trainable_parameters(const std::vector<const Module*>& parts, bool active) {
  std::unordered_set<const void*> seen;
  double n = 0;
  for (const Module* part : parts) {
    const auto placements = part->shard_placements();
    const auto activity = active ? part->parameter_activity() : std::map<std::string, double>{};
    for (const auto& [name, t] : part->named_parameters()) {
      if (!t.requires_grad() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
      std::int64_t numel = t.numel();
      if (auto it = placements.find(name); it != placements.end()) {
        numel = 1;
        for (std::int64_t d : it->second.global_shape) numel *= d;
      }
      const auto share = activity.find(name);
      n += static_cast<double>(numel) * (share == activity.end() ? 1.0 : share->second);
    }
  }
  return n;
}

std::int64_t summed_over_stages(std::int64_t n, const DeviceMesh* mesh) {
  if (mesh == nullptr || !mesh->has_dim(MeshDim::pp) || mesh->size(MeshDim::pp) <= 1) return n;
  std::vector<at::Tensor> t = {at::full({1}, n, at::kLong)};
  mesh->process_group(MeshDim::pp)->allreduce(t)->wait();
  return t.front().item<std::int64_t>();
}

}  // namespace

std::int64_t count_trainable_parameters(const std::vector<const Module*>& parts) {
  return static_cast<std::int64_t>(weighted_trainable_parameters(parts, false));
}

std::int64_t count_trainable_parameters(const std::vector<const Module*>& parts, const DeviceMesh* mesh) {
  return summed_over_stages(count_trainable_parameters(parts), mesh);
}

std::int64_t count_active_parameters(const std::vector<const Module*>& parts, const DeviceMesh* mesh) {
  return summed_over_stages(std::llround(weighted_trainable_parameters(parts, true)), mesh);
}

// --- Module defaults: an unwrapped model whose module() tree has canonical names --

NamedTensors Module::named_parameters() const {
  NamedTensors out;
  for (const auto& item : module().named_parameters(/*recurse=*/true)) out.emplace_back(item.key(), item.value());
  return out;
}

NamedTensors unique_named_parameters(const torch::nn::Module& m) {
  NamedTensors out;
  std::unordered_set<const void*> seen;  // a tied tensor once, under its first name
  for (const auto& item : m.named_parameters(/*recurse=*/true))
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  return out;
}

StateDict Module::state_dict() const {
  StateDict out;
  for (const auto& item : module().named_parameters(/*recurse=*/true)) out.emplace(item.key(), item.value());
  for (const auto& item : module().named_buffers(/*recurse=*/true)) out.emplace(item.key(), item.value());
  return out;
}

void Module::load_state_dict(const StateDict& state, bool strict) {
  const StateDict own = state_dict();
  std::vector<std::string> missing, unexpected;
  for (const auto& [name, target] : own) {
    auto it = state.find(name);
    if (it == state.end()) {
      missing.push_back(name);
      continue;
    }
    if (target.sizes() != it->second.sizes())
      throw Error(fmt::format("load_state_dict: '{}' has shape {} in the model but {} in the state dict", name,
                              shape_string(target), shape_string(it->second)));
  }
  for (const auto& [name, value] : state)
    if (own.find(name) == own.end()) unexpected.push_back(name);
  if (strict && (!missing.empty() || !unexpected.empty()))
    throw Error(fmt::format("load_state_dict (strict): missing keys: {}; unexpected keys: {}", key_list(missing),
                            key_list(unexpected)));
  // Everything is checked before the first copy, so a failed load changes nothing.
  at::NoGradGuard no_grad;
  for (const auto& [name, target] : own) {
    auto it = state.find(name);
    if (it != state.end()) target.copy_(it->second);  // Tensor::copy_ is const (handle semantics)
  }
}

void Module::train(bool on) { module().train(on); }

bool Module::is_training() const { return module().is_training(); }

void Module::to(const c10::Device& device, std::optional<c10::ScalarType> dtype) {
  // Like PyTorch's Module.to (and unlike torch::nn::Module::to): only
  // floating-point tensors change dtype; integer buffers keep theirs.
  auto move = [&](at::Tensor& t) {
    const c10::ScalarType target = dtype && c10::isFloatingType(t.scalar_type()) ? *dtype : t.scalar_type();
    at::Tensor moved = t.to(device, target);
    if (!moved.is_same(t)) t.set_data(moved);
  };
  for (auto& item : module().named_parameters(/*recurse=*/true)) move(item.value());
  for (auto& item : module().named_buffers(/*recurse=*/true)) move(item.value());
}

void Module::set_param_dtype(std::optional<c10::ScalarType> dtype) {
  if (!dtype) return;
  throw Error(fmt::format("model '{}' does not support mixed precision (set_param_dtype({}))", module().name(),
                          c10::toString(*dtype)));
}

std::optional<c10::ScalarType> Module::param_dtype() const { return std::nullopt; }

std::string Module::sample_key() const { return {}; }

std::string Module::prediction_key() const { return {}; }

std::map<std::string, std::vector<std::string>> Module::weight_decay_groups() const { return {}; }

std::vector<std::string> Module::block_fqns() const { return {}; }

std::vector<std::string> Module::submodules_of_class(std::string_view class_name) const {
  std::vector<std::string> out;
  if (config_class_name(module().name()) == class_name) out.emplace_back();  // the root itself, FQN ""
  // include_self=false: true would require the root to be owned by a shared_ptr.
  for (const auto& item : module().named_modules(/*name_prefix=*/"", /*include_self=*/false))
    if (config_class_name(item.value()->name()) == class_name) out.push_back(item.key());
  return out;
}

void Module::reset_parameters() {
  throw Error(
      fmt::format("model '{}' does not support reset_parameters() (needed to initialize a model "
                  "built on the meta device)",
                  module().name()));
}

std::shared_ptr<Module> Module::clone() const {
  throw Error(fmt::format("model '{}' does not support clone() (needed e.g. to split it into pipeline stages)",
                          module().name()));
}

std::shared_ptr<RemovableHandle> Module::add_hook(ModuleHook /*hook*/, std::span<const std::string> /*fqns*/) {
  throw Error(
      fmt::format("model '{}' does not support module hooks (needed by debugging hooks and sharding "
                  "wrappers)",
                  module().name()));
}

std::shared_ptr<RemovableHandle> Module::add_block_runner(BlockRunner /*runner*/,
                                                          std::span<const std::string> /*fqns*/) {
  throw Error(
      fmt::format("model '{}' cannot run its blocks through a block runner (needed by activation "
                  "checkpointing); its forward must call ModuleHooks::around for each block",
                  module().name()));
}

std::map<std::string, ShardPlacement> Module::shard_placements() const { return {}; }

bool Module::synchronizes_gradients() const { return false; }

void Module::set_requires_gradient_sync(bool /*sync*/) {}

void Module::apply_to_full_parameters(const std::function<void(Module&)>& fn) { fn(*this); }
std::optional<tp::VocabShard> Module::vocab_shard() const { return std::nullopt; }
void Module::retain_modules(const std::vector<std::string>&) {
  throw Error(fmt::format("this model ({}) cannot be cut into pipeline stages", module().name()));
}

void Module::apply_tensor_parallel(const ParallelDims&, const tp::Options&) {
  throw Error(
      fmt::format("this model ({}) does not support tensor parallelism: its class does not implement "
                  "Module::apply_tensor_parallel (a wrapper does not either: split the raw model first, "
                  "before activation checkpointing, initialization, pipeline stages and FSDP)",
                  module().name()));
}

void Module::apply_expert_parallel(const ParallelDims& dims) {
  throw Error(
      fmt::format("this model ({}) has no experts to split over the mesh's ep dim of {} ranks: its class does "
                  "not implement Module::apply_expert_parallel (a Mixture-of-Experts model, e.g. "
                  "model/gpt2_moe, does)",
                  module().name(), dims.degree(MeshDim::ep)));
}

std::vector<std::string> Module::expert_parallel_parameters() const { return {}; }

void Module::apply_context_parallel(const ParallelDims& dims) {
  throw Error(
      fmt::format("this model ({}) does not support context parallelism (the mesh's cp dim of {} ranks): its class "
                  "does not implement Module::apply_context_parallel (model/gpt2 and model/gpt2_moe do); set "
                  "device_mesh.config.context_parallel_degree = 1",
                  module().name(), dims.degree(MeshDim::cp)));
}

std::optional<cp::SequenceShard> Module::sequence_shard() const { return std::nullopt; }

std::vector<ModelMetric> Module::take_metrics() { return {}; }

std::map<std::string, double> Module::parameter_activity() const { return {}; }

std::shared_ptr<Pipeline> Module::pipeline() const { return nullptr; }

// --- other defaults ---------------------------------------------------------------

std::int64_t Dataset::token_size_in_bytes() const { return 0; }

void CheckpointSavingExecution::run_checkpoint_instruction(const CheckpointingInstruction& instruction,
                                                           const TrainingProgress& progress, AppState& app_state) {
  if (instruction.save_current) save(app_state, progress);
  for (const TrainingProgress& old : instruction.checkpoints_to_delete) delete_checkpoint(old);
}

}  // namespace modalities
