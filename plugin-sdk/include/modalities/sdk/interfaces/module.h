// The model interface: what the gym, optimizers, checkpointing and the model
// wrappers (FSDP, tensor/pipeline parallelism, activation checkpointing,
// compile) need from a network without knowing its class. A Module owns (or
// wraps) a torch::nn::Module tree and adds the named-tensor forward plus the
// metadata Modalities models carry. A wrapper is itself a Module around another
// one, so wrappers stack without changing this interface.
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace modalities {

class RemovableHandle;
class ParallelDims;
class Pipeline;

/// (fully qualified name, tensor) pairs in registration order. A vector, not a
/// map, because optimizers group parameters in this order.
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Where a module hook fires.
enum class HookPoint {
  kPreForward,  // before a submodule's forward; `inputs` set
  kForward,     // after it; `inputs` and `outputs` set
  kBackward,    // when the gradients w.r.t. its outputs are known, before its own
                // backward runs; `outputs` holds those gradients
};

/// One hooked submodule call, as seen by a ModuleHook. Views are valid only
/// during the call.
struct ModuleHookCall {
  HookPoint point = HookPoint::kForward;
  std::string_view fqn;         // "transformer.h.0.attn"; "" for the root
  std::string_view class_name;  // the name used by submodules_of_class, e.g. "GPT2Block"
  std::span<const at::Tensor> inputs;
  std::span<const at::Tensor> outputs;
};

/// Observes (and may launch side effects around) submodule calls: NaN checks,
/// tensor statistics, or a sharding wrapper's gather-before / free-after.
/// Must not replace the tensors it is shown.
using ModuleHook = std::function<void(const ModuleHookCall&)>;

/// One block's forward as a function of its input, as the model hands it to a BlockRunner. It
/// must stay callable, with the same result, until the backward of that forward has run (capture
/// by value, never references to the model's locals).
using BlockFunction = std::function<at::Tensor(const at::Tensor& input)>;

/// Runs one block in place of the model: returns what `run(input)` returns, but may run it
/// differently, e.g. without keeping its activations and running it again in backward (activation
/// checkpointing). Called inside the block's hooks (a sharding wrapper's gather is around it).
using BlockRunner = std::function<at::Tensor(const at::Tensor& input, const BlockFunction& run)>;

/// Where a local tensor sits in the full, unsharded tensor: the local tensor
/// is the block starting at `offsets` with the local tensor's own shape.
/// Used by checkpoint writers and parameter counting under sharding.
struct ShardPlacement {
  std::vector<std::int64_t> global_shape;
  std::vector<std::int64_t> offsets;
  /// How many ranks of the world hold this same block (a tensor-parallel model's replicated norm
  /// weights: the tp degree; HSDP: times dp_replicate). Norms over the world divide it out.
  std::int64_t replicas = 1;
};

/// A number a model measured in its training forwards, for the training log (Module::take_metrics),
/// e.g. a Mixture-of-Experts block's load imbalance. `reduce` says how the ranks' values combine
/// (ranks without the metric, such as other pipeline stages, take no part).
struct ModelMetric {
  enum class Reduce : std::uint8_t { kMean, kMin, kMax, kSum };
  std::string name;  // as logged: "moe load max over mean (block 1)"
  double value = 0;
  Reduce reduce = Reduce::kMean;
};

/// A trainable network seen through named tensors, e.g. the GPT-2 decoder.
///
/// Built once per run by a `model` variant (or `layer_norm`, `pipeline/selector`)
/// and then possibly replaced by wrapper variants (`model_initialized`,
/// `fsdp2_wrapped`, ...) that return a Module around it. The gym calls
/// train()/forward() from its single thread; hooks registered for kBackward
/// run on autograd's threads. Accessors may be called at build time by other
/// components (optimizer grouping, FSDP block discovery).
///
/// Only forward() and module() are required. Every other virtual has a default
/// in the SDK library that works for an unwrapped model whose torch::nn::Module
/// tree uses the canonical names; wrappers that rename, shard or re-layout
/// parameters override them so that consumers keep seeing canonical FQNs.
///
/// \code
///   model->train(true);
///   TensorMap out = model->forward({{model->sample_key(), batch.samples.at("input_ids")}});
///   at::Tensor logits = out.at(model->prediction_key());  // [B, T, V]
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); wrappers hold a
/// shared_ptr to the Module they wrap. Tensors returned by accessors alias the
/// live parameters. module() references live as long as the instance.
/// Errors: throw modalities::Error (TORCH_CHECK inside tensor code is fine);
/// never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API Module {
 public:
  static constexpr std::string_view kInterface = "Module";
  static constexpr std::string_view kComponentKey = "model";

  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  virtual ~Module();  // defined in the SDK library: one vtable, one typeinfo

  // --- required ---------------------------------------------------------------

  /// Runs the network. Modalities' convention: inputs under sample_key(),
  /// outputs under prediction_key(); other models document their keys. A bare
  /// tensor input (accepted by Modalities models) is not supported: wrap it in
  /// a one-entry map.
  virtual TensorMap forward(const TensorMap& inputs) = 0;

  /// The underlying module tree, for traversal (named_modules, named_children),
  /// submodule lookup and replace_module. Wrappers return the tree they act on.
  virtual torch::nn::Module& module() = 0;
  virtual const torch::nn::Module& module() const = 0;

  // --- parameters, state and mode (defaults: delegate to module()) ------------

  /// Parameters by canonical fully qualified name (no wrapper infixes), in
  /// registration order. Under sharding the tensors are the local shards. A model with tied
  /// weights lists each once with unique_named_parameters (below).
  /// Used for optimizer construction/grouping, gradient clipping, parameter
  /// counting and optimizer state keys.
  virtual NamedTensors named_parameters() const;

  /// The tensors of named_parameters(), same order; e.g. to construct a
  /// torch::optim optimizer. Not virtual: override named_parameters().
  std::vector<at::Tensor> parameters() const {
    std::vector<at::Tensor> out;
    for (auto& [name, tensor] : named_parameters()) out.push_back(std::move(tensor));
    return out;
  }

  /// Parameters and persistent buffers by canonical FQN (local shards under
  /// sharding; see shard_placements()). What checkpoints store.
  virtual StateDict state_dict() const;

  /// Copies `state` into the parameters and buffers (no autograd recording).
  /// strict: every own key must be present and no other key may exist.
  /// Non-strict loading (one pipeline part of a full checkpoint) skips both.
  /// A shape mismatch is an error either way.
  virtual void load_state_dict(const StateDict& state, bool strict);

  /// Training mode on/off (dropout etc.); eval() is train(false).
  virtual void train(bool on);
  virtual bool is_training() const;
  void eval() { train(false); }

  /// Moves parameters and buffers to `device`, and casts floating-point ones
  /// to `dtype` when given. Used for inference and single-device runs.
  virtual void to(const c10::Device& device, std::optional<c10::ScalarType> dtype);

  /// Mixed precision the way FSDP2 applies it (docs/training.md): parameters
  /// keep their storage dtype (the fp32 master weights that optimizers,
  /// clippers and checkpoints see) and forward() computes with copies cast to
  /// `dtype` at each use, so activations, logits and the loss are in `dtype`
  /// while autograd casts every micro-batch's gradient back and accumulates it
  /// in fp32. Buffers (e.g. RoPE inv_freq) are not cast; floating-point inputs
  /// are. std::nullopt (or the storage dtype) turns it off. Set by
  /// `model/mixed_precision` and, later, the sharding wrappers.
  /// Default: throws modalities::Error ("not supported") for any dtype.
  virtual void set_param_dtype(std::optional<c10::ScalarType> dtype);
  virtual std::optional<c10::ScalarType> param_dtype() const;

  // --- model metadata (defaults: empty) ---------------------------------------

  /// Input/output keys of a language model ("input_ids", "logits"); empty for
  /// modules that are not LLMs. The pipeline path reads sample_key(); the
  /// text-inference component and losses are configured with the same keys.
  virtual std::string sample_key() const;
  virtual std::string prediction_key() const;

  /// Weight-decay groups: group name -> regexes searched (not fully matched)
  /// in parameter FQNs, e.g. {"linear": {"attn", "mlp", "lm_head.weight"}, ...}.
  /// The optimizer's `weight_decay_groups_excluded` refers to these names.
  virtual std::map<std::string, std::vector<std::string>> weight_decay_groups() const;

  /// FQNs of the repeated blocks, in execution order ("transformer.h.0", ...):
  /// the units of FSDP sharding, activation checkpointing, compilation and
  /// pipeline splitting.
  virtual std::vector<std::string> block_fqns() const;

  /// FQNs (pre-order) of the submodules whose class is `class_name`, the way
  /// configs name them (`block_names = ["GPT2Block"]`). Empty when none: the
  /// caller decides whether that is an error. Default: compares
  /// torch::nn::Module::name() without namespaces and without a trailing
  /// "Impl" (so GPT2BlockImpl registered via TORCH_MODULE matches "GPT2Block").
  virtual std::vector<std::string> submodules_of_class(std::string_view class_name) const;

  // --- capabilities for wrappers (defaults: unsupported / nothing sharded) ----

  /// Gives every parameter and buffer its constructor-time value again, on
  /// whatever device it now lives (norm weights 1, RoPE tables recomputed,
  /// random init for the rest). Needed after a meta-device model has been
  /// materialized with uninitialized storage (`model/model_initialized`).
  /// Default: throws modalities::Error ("not supported").
  virtual void reset_parameters();

  /// An independent deep copy (same class, same values, own storage), e.g. one
  /// per local pipeline stage before pruning it (`pipeline/staged`).
  /// Default: throws modalities::Error ("not supported").
  virtual std::shared_ptr<Module> clone() const;

  /// Calls `hook` around the forward (and backward) of the submodules named
  /// in `fqns`, or of every submodule when `fqns` is empty. libtorch has no
  /// module hooks, so the model's own forward calls them. The hook stays until
  /// the returned handle's remove(). Used by `model_debugging_hook/*`,
  /// `debugging_enriched`, and sharding wrappers (gather parameters before a
  /// block runs, free them after). Default: throws modalities::Error ("not supported").
  virtual std::shared_ptr<RemovableHandle> add_hook(ModuleHook hook, std::span<const std::string> fqns);

  /// Runs the blocks named in `fqns` (from block_fqns(); empty: every block) through `runner`
  /// instead of calling them directly, until the handle's remove(); one runner per block. The
  /// model calls the runner inside the block's hooks. Used by `model/activation_checkpointed`.
  /// Wrappers forward it to the model they wrap. Default: throws modalities::Error ("not
  /// supported"). Since: SDK 0.1 (ABI 4).
  virtual std::shared_ptr<RemovableHandle> add_block_runner(BlockRunner runner, std::span<const std::string> fqns);

  /// Placement of every *sharded* entry of state_dict() in its full tensor,
  /// by FQN; entries not listed are complete on every rank. Default: empty.
  virtual std::map<std::string, ShardPlacement> shard_placements() const;

  /// Data parallelism: whether backward() leaves every data-parallel rank with the same (reduced)
  /// gradient, as the sharding and replicating wrappers (`fsdp2_wrapped`, `fsdp1_wrapped`) do.
  /// The gym refuses several ranks for a model part that does not. Default: false.
  virtual bool synchronizes_gradients() const;

  /// Gradient accumulation without communication: with `false`, following backward passes only
  /// accumulate local gradients; with `true` (the state a wrapper starts in) the next backward
  /// also synchronises everything accumulated. The gym sets false for every micro-batch of an
  /// optimizer step but the last, so gradients cross the network once per step (FSDP2's
  /// set_requires_gradient_sync, DDP's no_sync). Default: a no-op.
  virtual void set_requires_gradient_sync(bool sync);

  /// Runs `fn` on the model with whole parameters: a sharding wrapper gathers every parameter,
  /// calls `fn` on the inner model and keeps this rank's part of whatever `fn` wrote (so
  /// `model_initialized` after `fsdp2_wrapped`, Modalities' order, initializes the full tensors
  /// the same way at every world size). Default: fn(*this).
  virtual void apply_to_full_parameters(const std::function<void(Module&)>& fn);

  /// Loss parallel: where this rank's slice of the vocabulary lies when forward() returns logits
  /// split on the vocabulary over a tensor-parallel group (`model/gpt2_tp` with the mesh's
  /// enable_loss_parallel). Wrappers forward it. Default: none (whole logits).
  virtual std::optional<tp::VocabShard> vocab_shard() const;

  /// Pipeline stages: removes every submodule that is neither named in `module_fqns` nor an
  /// ancestor of a named one (FQNs of the kept ones do not change), so the forward runs only the
  /// stage's part (`pipeline/staged` calls it on a clone of the whole model). Default: throws
  /// (the model cannot be cut into stages).
  virtual void retain_modules(const std::vector<std::string>& module_fqns);

  /// Tensor parallelism: splits this model's layers over the tp dim of `dims` (tp::Plan::from
  /// gives the group, this rank's place and the region edges), in place, before any other wrapper
  /// (activation checkpointing, initialization, pipeline split, FSDP). Afterwards forward() takes
  /// the whole batch on every tp rank and returns what the unsplit model returns (logits split on
  /// the vocabulary under loss parallelism: vocab_shard() says where), and shard_placements()
  /// places every split tensor in its full one, so checkpoints, norms and parameter counts see
  /// the unsplit model. An architecture opts in with this one method (`model/gpt2_tp` calls it
  /// on any model). Default: throws modalities::Error ("does not support tensor parallelism").
  /// Since: SDK 0.1 (ABI 6).
  virtual void apply_tensor_parallel(const ParallelDims& dims, const tp::Options& options);

  /// Expert parallelism: splits the model's routed experts over the ep dim of `dims` (rank r of
  /// the ep group keeps experts [r E / ep, (r + 1) E / ep) of every MoE block), in place, after
  /// tensor parallelism and before activation checkpointing, initialization, the pipeline split
  /// and FSDP (model/parallelized applies it when the mesh has an ep dim). Afterwards forward()
  /// sends every routed token to the rank of its expert and back (a collective over the ep
  /// group), shard_placements() places the expert weights in the global stack, and
  /// expert_parallel_parameters() names them. Default: throws modalities::Error (the model has
  /// no experts). Since: SDK 0.1 (ABI 7).
  virtual void apply_expert_parallel(const ParallelDims& dims);

  /// What the model measured in its training forwards (with autograd) since the last call, then
  /// forgotten. The gym takes them from every model part on every rank at each training-log step
  /// and logs them, combined over the ranks, next to the losses (Note [Model metrics] in
  /// core/src/gym.cpp). Must not communicate. Wrappers forward it. Default: none. Since: SDK 0.1
  /// (ABI 7).
  virtual std::vector<ModelMetric> take_metrics();

  /// Sparse models: the share of each parameter that one token computes with, by FQN (a MoE
  /// block's routed experts: top_k / num_experts of the stack); parameters not listed count whole.
  /// MFU counts these active parameters (count_active_parameters). Wrappers forward it. Default:
  /// none. Since: SDK 0.1 (ABI 7).
  virtual std::map<std::string, double> parameter_activity() const;

  /// The FQNs of the parameters apply_expert_parallel split over the ep ranks (each rank holds
  /// other experts). FSDP shards them over the ranks that hold the same experts
  /// (ParallelDims::expert_shard_group) and averages their gradients over all data-parallel
  /// ranks. Wrappers forward it. Default: none. Since: SDK 0.1 (ABI 7).
  virtual std::vector<std::string> expert_parallel_parameters() const;

  /// Context parallelism: this model takes part in splitting every sequence over the cp dim of
  /// `dims` (cp::SequenceShard's head-tail chunks), in place, before any other wrapper
  /// (model/parallelized applies it when the mesh has a cp dim). Afterwards forward() takes the
  /// whole sample on every cp rank (they all read the same one), computes on this rank's tokens
  /// only (attention over the whole sequence's keys and values, gathered from the cp ranks) and
  /// returns predictions for them; sequence_shard() says which. Parameters stay whole: FSDP shards
  /// them over dp_shard x cp (ParallelDims::shard_group), which also averages their gradients
  /// over the cp ranks. Default: throws modalities::Error (no context-parallel support). Since:
  /// SDK 0.1 (ABI 9).
  virtual void apply_context_parallel(const ParallelDims& dims);

  /// Context parallelism: the split of the sequence whose tokens forward()'s predictions cover,
  /// after apply_context_parallel; the loss takes the same tokens of the targets
  /// (InferenceResultBatch::sequence_shard). Wrappers forward it. Default: none (every token).
  /// Since: SDK 0.1 (ABI 9).
  virtual std::optional<cp::SequenceShard> sequence_shard() const;

  /// Pipeline parallelism: the scheduled pipeline whose stage this module is, when the variant
  /// that built it also scheduled the pipeline (`model/parallelized` with a `pipeline` table);
  /// the gym runs it when the config has no `scheduled_pipeline`. Default: null (a wrapper around
  /// a stage module of pipeline/selector is not one). Since: SDK 0.1 (ABI 6).
  virtual std::shared_ptr<Pipeline> pipeline() const;
};

/// The parameters of `m` in registration order, a tensor registered under several names (weight
/// tying) once, under the first: PyTorch's named_parameters, for Module::named_parameters of a
/// model with tied weights. Since: SDK 0.1 (ABI 9).
MODALITIES_SDK_API NamedTensors unique_named_parameters(const torch::nn::Module& m);

}  // namespace modalities
