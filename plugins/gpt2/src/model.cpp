// model/gpt2 as a modalities::Module (model.h): state dicts as Modalities writes them (weight tying),
// meta-device materialization, mixed precision, hooks and block runners for the wrappers, pipeline
// stages (retain_modules), tensor parallelism (apply_tensor_parallel: the split of every weight and
// the shard placements of checkpoints) and the Hugging Face export.
#include "model.h"

#include "huggingface.h"
#include "modules.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/huggingface.h>
#include <modalities/sdk/interfaces/removable_handle.h>
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/tensor_parallel.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace modalities::plugins::gpt2 {
namespace {

constexpr const char* kWteKey = "transformer.wte.weight";
constexpr const char* kLmHeadKey = "transformer.lm_head.weight";

// Tensor parallel: the dim along which `model/gpt2_tp` splits a parameter (0: the output
// features, column-parallel, and the embedding's vocabulary; 1: the input features,
// row-parallel), or none for a replicated one (norms, row-parallel biases, wpe).
std::optional<std::int64_t> tp_split_dim(std::string_view fqn) {
  if (fqn == kWteKey || fqn == kLmHeadKey) return 0;
  for (std::string_view s : {".attn.q_attn.", ".attn.k_attn.", ".attn.v_attn.", ".mlp.W.", ".mlp.V.", ".mlp.c_fc."})
    if (fqn.find(s) != std::string_view::npos) return 0;
  for (std::string_view s : {".attn.c_proj.weight", ".mlp.W_2.weight", ".mlp.c_proj.weight"})
    if (fqn.ends_with(s)) return 1;
  return std::nullopt;
}

// How a parameter is split over ranks: along `dim`, this rank's chunk being number `rank` of
// `size` equal ones (tensor parallel: the tp group; expert parallel: the ep group, dim 0).
struct Split {
  std::int64_t dim = 0;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::int64_t rank = 0, size = 1;
  bool experts = false;  // split over the ep ranks
};

// Expert parallelism (Module::apply_expert_parallel): the ep group and the parameters it split.
struct EpPlan {
  ExpertParallel ep;
  std::vector<std::string> fqns;
};

class GPT2 final : public Module, public HuggingFaceExportable {
 public:
  GPT2(const GPT2Config& c, const c10::Device& device, FeedForwardFactory ffn = {}, std::string aux_loss_key = {},
       HfFeedForward hf_ffn = {})
      : config_(c), ffn_(std::move(ffn)), aux_loss_key_(std::move(aux_loss_key)), hf_ffn_(std::move(hf_ffn)) {
    if (c.seed) {
      // torch.manual_seed reinterprets a negative seed as its two's complement uint64.
      at::manual_seed(static_cast<std::uint64_t>(*c.seed));
    }
    impl_ = std::make_shared<GPT2LLMImpl>(c, at::TensorOptions().dtype(at::kFloat).device(device), ffn_);
  }

  TensorMap forward(const TensorMap& inputs) override {
    auto it = inputs.find(config_.sample_key);
    if (it == inputs.end()) {
      std::vector<std::string> keys;
      for (const auto& [k, v] : inputs) keys.push_back(k);
      throw Error(
          fmt::format("gpt2: the input has no '{}' (sample_key); it has {}", config_.sample_key, quoted_list(keys)));
    }
    std::shared_ptr<const Documents> docs;
    at::Tensor doc_ids;
    // The whole sequence's length: ids [B, T], or a later pipeline stage's hidden states [B, T, d]
    // (of this rank's tokens under context parallelism).
    const at::Tensor& x = it->second;
    const std::int64_t length = x.dim() == 2 || !cp_ ? x.size(1) : x.size(1) * cp_->size;
    if (config_.document_ids_key)
      if (auto d = inputs.find(*config_.document_ids_key); d != inputs.end())
        doc_ids = checked_document_ids(x, length, d->second);
    if (cp_) {
      docs = impl_->context_parallel_documents(doc_ids, length, config_.document_positions == "restart", x.device());
    } else if (doc_ids.defined()) {
      docs = impl_->documents(doc_ids, config_.document_positions == "restart");
    }
    TensorMap out{{config_.prediction_key, impl_->hooked_forward(it->second, param_dtype_, std::move(docs))}};
    // The feed-forwards' auxiliary losses (MoE load balancing), summed over the blocks.
    if (!aux_loss_key_.empty())
      if (at::Tensor aux = impl_->take_aux_losses(); aux.defined()) out.emplace(aux_loss_key_, std::move(aux));
    return out;
  }
  // The input `document_ids_key` for the input `x` of sequences of `length` tokens (Note [Document
  // masking]), checked, on x's device.
  at::Tensor checked_document_ids(const at::Tensor& x, std::int64_t length, const at::Tensor& doc_ids) const {
    const std::string& key = *config_.document_ids_key;
    if (doc_ids.dim() != 2 || doc_ids.size(0) != x.size(0) || doc_ids.size(1) != length)
      throw Error(
          fmt::format("gpt2: the input '{}' (document_ids_key) has shape {}, but '{}' has {}; expected [{}, {}]", key,
                      c10::str(doc_ids.sizes()), config_.sample_key, c10::str(x.sizes()), x.size(0), length));
    if (at::isFloatingType(doc_ids.scalar_type()) || doc_ids.scalar_type() == at::kBool)
      throw Error(fmt::format("gpt2: the input '{}' (document_ids_key) must hold integer document ids, got {}", key,
                              c10::toString(doc_ids.scalar_type())));
    return doc_ids.to(x.device());
  }
  torch::nn::Module& module() override { return *impl_; }
  const torch::nn::Module& module() const override { return *impl_; }

  // With weight tying the shared tensor is listed once, as transformer.wte.weight (as in Modalities).
  NamedTensors named_parameters() const override { return unique_named_parameters(*impl_); }

  // Tied models: either key alone is enough; with both, lm_head's value wins (PyTorch
  // loads in module order, lm_head last).
  void load_state_dict(const StateDict& state, bool strict) override {
    if (split() && !whole_) {  // split: whole tensors give this rank's chunk
      StateDict s = state;
      for (auto& [key, t] : s) {
        const auto d = split_of(key);
        const auto mine = local_shapes_.find(key);
        if (!d || mine == local_shapes_.end() || t.sizes().vec() == mine->second) continue;
        const std::int64_t n = mine->second[static_cast<std::size_t>(d->dim)];
        if (t.dim() == static_cast<std::int64_t>(mine->second.size()) && t.size(d->dim) == n * d->size)
          t = t.narrow(d->dim, d->rank * n, n);
      }
      return load_unsplit(s, strict);
    }
    load_unsplit(state, strict);
  }

  void load_unsplit(const StateDict& state, bool strict) {
    if (!impl_->tied()) return Module::load_state_dict(state, strict);
    StateDict s = state;
    const auto wte = s.find(kWteKey), head = s.find(kLmHeadKey);
    if (head != s.end()) s[kWteKey] = head->second;
    else if (wte != s.end()) s[kLmHeadKey] = wte->second;
    Module::load_state_dict(s, strict);
  }

  // Moving off the meta device allocates uninitialized storage (PyTorch's to_empty);
  // call reset_parameters() (or an initializer) afterwards. See Note [Replacing registered tensors].
  void to(const c10::Device& device, std::optional<c10::ScalarType> dtype) override {
    bool any_meta = false;
    for (const auto& t : impl_->parameters()) any_meta = any_meta || t.is_meta();
    for (const auto& t : impl_->buffers()) any_meta = any_meta || t.is_meta();
    if (!any_meta) return Module::to(device, dtype);
    impl_->remap_leaves([&](const at::Tensor& t) {
      const c10::ScalarType target = dtype && c10::isFloatingType(t.scalar_type()) ? *dtype : t.scalar_type();
      at::Tensor out =
          t.is_meta() ? at::empty(t.sizes(), t.options().device(device).dtype(target)) : t.detach().to(device, target);
      return out.set_requires_grad(t.requires_grad());
    });
  }

  void set_param_dtype(std::optional<c10::ScalarType> dtype) override {
    if (dtype && !c10::isFloatingType(*dtype))
      throw Error(fmt::format("gpt2: set_param_dtype needs a floating-point dtype, got {}", c10::toString(*dtype)));
    const c10::ScalarType storage = impl_->storage_dtype();
    param_dtype_ = dtype && *dtype != storage ? dtype : std::nullopt;
  }
  std::optional<c10::ScalarType> param_dtype() const override { return param_dtype_; }

  std::string sample_key() const override { return config_.sample_key; }
  std::string prediction_key() const override { return config_.prediction_key; }

  // Modalities' GPT-2 weight-decay groups: regexes searched in parameter names.
  std::map<std::string, std::vector<std::string>> weight_decay_groups() const override {
    return {{"linear", {".attn", ".mlp", ".lm_head.weight"}},
            {"embedding", {".wte", ".wpe"}},
            {"layernorm", {".attention_norm", ".ffn_norm", ".lm_head_norm"}}};
  }

  std::vector<std::string> block_fqns() const override {
    std::vector<std::string> out;
    for (const auto& key : impl_->block_keys()) out.push_back("transformer.h." + key);
    return out;
  }

  // Hooks fire on the root ("") and the blocks; `fqns` empty means all of them.
  std::shared_ptr<RemovableHandle> add_hook(ModuleHook hook, std::span<const std::string> fqns) override {
    return impl_->hooks().add(std::move(hook), fqns, block_fqns(), "gpt2");
  }
  std::shared_ptr<RemovableHandle> add_block_runner(BlockRunner runner, std::span<const std::string> fqns) override {
    return impl_->hooks().add_runner(std::move(runner), fqns, block_fqns(), "gpt2");
  }

  void reset_parameters() override {
    for (const auto& t : impl_->parameters())
      if (t.is_meta())
        throw Error(
            "gpt2: reset_parameters() needs materialized tensors; the model is on the meta device "
            "(move it with to(device) first)");
    // Split: the whole model is initialized as in one process (same random numbers), each rank keeps its part.
    if (split() && !whole_) return apply_to_full_parameters([](Module& full) { full.reset_parameters(); });
    GPT2LLMImpl::reset_leaves(*impl_);
  }

  // Document masking reaches every stage: the schedule passes the document ids to each stage's
  // forward (PipelineSchedule::set_stage_inputs).
  void retain_modules(const std::vector<std::string>& module_fqns) override {
    impl_->retain(module_fqns);
    retained_ = module_fqns;
  }

  // `modalities convert_pytorch_to_hf_checkpoint` (README.md, "Hugging Face interop").
  HuggingFaceCheckpoint to_huggingface(const HuggingFaceExportOptions& options) const override {
    if (split() || retained_)
      throw Error(
          "gpt2: a tensor-, expert-parallel or pipeline-split model holds part of the weights; export the whole "
          "model (a conversion config builds model/gpt2 and loads the checkpoint into it, which reads "
          "sharded checkpoints whole)");
    if (ffn_ && !hf_ffn_)
      throw Error(
          "gpt2: this model has feed-forward layers of another plugin that has no Hugging Face description of "
          "them; the export covers model/gpt2's dense MLPs and model/gpt2_moe's MoE blocks");
    for (const auto& t : impl_->parameters())
      if (t.is_meta()) throw Error("gpt2: the model is on the meta device; load a checkpoint into it before exporting");
    hf::DecoderSpec spec = spec_from_config(config_);
    if (hf_ffn_) hf_ffn_(spec);
    return hf::to_huggingface(spec, state_dict(), options);
  }

  // --- tensor parallel (model/gpt2_tp) ---------------------------------------------------

  // Splits the model over plan.size ranks: every split parameter (tp_split_dim) is replaced by
  // this rank's chunk, the modules compute their local heads and hidden units. Works on the meta
  // device too (the chunks are meta then).
  void apply_tensor_parallel(const ParallelDims& dims, const tp::Options& options) override {
    if (dims.has(MeshDim::dp_replicate))
      throw ConfigError("device_mesh",
                        "has a dp_replicate dim; tensor parallelism composes with dp_shard only (as in "
                        "Modalities)");
    parallelize(TpPlan::from(dims, options));
  }

  void parallelize(const TpPlan& plan) {
    if (tp_) throw Error("gpt2_tp: the model is split already (tensor parallelism applied twice)");
    impl_->check_tensor_parallel(plan);
    const std::int64_t p = plan.size;
    const auto divisible = [&](std::string_view field, std::int64_t value) {
      if (value % p != 0)
        throw ConfigError("model", fmt::format("model/gpt2's {} = {} is not divisible by the tensor-parallel degree "
                                               "{} (device_mesh.config.tensor_parallel_degree)",
                                               field, value, p));
    };
    divisible("n_head_q", config_.n_head_q);
    divisible("n_head_kv", config_.n_head_kv);
    divisible("vocab_size", config_.vocab_size);
    divisible(config_.activation_type == "swiglu" ? "SwiGLU hidden size (from ffn_hidden)" : "ffn_hidden",
              config_.activation_type == "swiglu"
                  ? swiglu_hidden(config_.ffn_hidden, config_.enforce_swiglu_hidden_dim_multiple_of)
                  : config_.ffn_hidden);
    if (plan.sequence_parallel) divisible("sequence_length (sequence parallelism splits it)", config_.sequence_length);
    std::unordered_map<const void*, std::int64_t> dim_of;
    for (const auto& item : impl_->named_parameters(/*recurse=*/true))
      if (const auto d = tp_split_dim(item.key())) dim_of[item.value().unsafeGetTensorImpl()] = *d;
    impl_->remap_leaves([&](const at::Tensor& t) {
      const auto it = dim_of.find(t.unsafeGetTensorImpl());
      if (it == dim_of.end()) return t;
      const std::int64_t n = t.size(it->second) / p;
      at::NoGradGuard no_grad;
      return t.narrow(it->second, plan.rank * n, n).clone().set_requires_grad(t.requires_grad());
    });
    tp_ = std::make_shared<const TpPlan>(plan);
    impl_->parallelize(tp_);
    record_local_shapes();
  }

  // --- expert parallel (model/parallelized over a mesh with an ep dim) ------------------------

  void apply_expert_parallel(const ParallelDims& dims) override {
    if (!dims.enabled(MeshDim::ep)) throw Error("gpt2: apply_expert_parallel needs a mesh with an ep dim of > 1 ranks");
    parallelize_experts(
        ExpertParallel(dims.group(MeshDim::ep), dims.coordinate(MeshDim::ep), dims.degree(MeshDim::ep)));
  }

  void parallelize_experts(const ExpertParallel& ep) {
    if (ep_) throw Error("gpt2: the experts are split already (expert parallelism applied twice)");
    EpPlan plan{ep, impl_->parallelize_experts(ep)};
    if (plan.fqns.empty())
      throw ConfigError("device_mesh",
                        fmt::format("has an ep dim of {} ranks (expert_parallel_degree), but the model has no experts "
                                    "to split: expert parallelism needs a Mixture-of-Experts model (model/gpt2_moe)",
                                    ep.size));
    ep_ = std::make_shared<const EpPlan>(std::move(plan));
    record_local_shapes();
  }

  std::vector<std::string> expert_parallel_parameters() const override {
    return ep_ ? ep_->fqns : std::vector<std::string>{};
  }

  // --- context parallel (model/parallelized over a mesh with a cp dim, model/gpt2_cp) ----------

  void apply_context_parallel(const ParallelDims& dims) override {
    if (!dims.enabled(MeshDim::cp)) throw Error("gpt2: apply_context_parallel needs a mesh with a cp dim of > 1 ranks");
    parallelize_context(
        cp::SequenceShard(dims.group(MeshDim::cp), dims.coordinate(MeshDim::cp), dims.degree(MeshDim::cp)));
  }

  void parallelize_context(const cp::SequenceShard& shard) {
    if (cp_) throw Error("gpt2: context parallelism applied twice");
    // Each rank's 2 chunks, and under sequence parallelism each tp rank's part of them.
    const std::int64_t sp = tp_ && tp_->sequence_parallel ? tp_->size : 1;
    if (config_.sequence_length % (2 * shard.size * sp) != 0)
      throw ConfigError(
          "model",
          fmt::format("model/gpt2's sequence_length = {} is not divisible by 2 x the context-parallel "
                      "degree {}{} = {}: context parallelism cuts every sequence into {} equal chunks "
                      "(rank r holds chunks r and {} - r){}",
                      config_.sequence_length, shard.size,
                      sp > 1 ? fmt::format(" x the tensor-parallel degree {}", sp) : "", 2 * shard.size * sp,
                      2 * shard.size, 2 * shard.size - 1, sp > 1 ? ", which sequence parallelism splits further" : ""));
    cp_ = std::make_shared<const cp::SequenceShard>(shard);
    impl_->set_context_parallel(cp_);
  }

  std::optional<cp::SequenceShard> sequence_shard() const override {
    if (!cp_) return std::nullopt;
    return *cp_;
  }

  std::vector<ModelMetric> take_metrics() override { return impl_->take_metrics(); }
  std::map<std::string, double> parameter_activity() const override { return impl_->parameter_activity(); }

  // Every parameter, split or replicated (then held alike by the tp ranks), as a block of the full tensor.
  // Under expert parallelism alone the rest is whole on every rank (not listed).
  std::map<std::string, ShardPlacement> shard_placements() const override {
    if (!split() || whole_) return {};
    std::map<std::string, ShardPlacement> out;
    for (const auto& [fqn, shape] : local_shapes_) {
      const auto d = split_of(fqn);
      if (!d && !tp_) continue;
      ShardPlacement s;
      s.global_shape = shape;
      s.offsets.assign(s.global_shape.size(), 0);
      if (d) {
        s.offsets[static_cast<std::size_t>(d->dim)] = d->rank * s.global_shape[static_cast<std::size_t>(d->dim)];
        s.global_shape[static_cast<std::size_t>(d->dim)] *= d->size;
      }
      // The tp ranks hold the same replicated tensors and the same experts.
      if (tp_ && (!d || d->experts)) s.replicas = tp_->size;
      out[fqn] = std::move(s);
    }
    return out;
  }

  // Split: whole tensors gathered over the tp (or ep) ranks, `fn` on the whole model, each rank
  // keeps its chunk of whatever fn wrote. A collective.
  void apply_to_full_parameters(const std::function<void(Module&)>& fn) override {
    if (!split() || whole_) return fn(*this);
    at::NoGradGuard no_grad;
    struct Gathered {
      at::Tensor local, full;
      Split how;
    };
    std::unordered_map<const void*, Gathered> split;  // by the local tensor
    for (const auto& item : impl_->named_parameters(/*recurse=*/true)) {
      const auto d = split_of(item.key());
      const at::Tensor& t = item.value();
      if (!d || split.contains(t.unsafeGetTensorImpl())) continue;
      if (t.is_meta())
        throw Error(
            "gpt2: the model's parameters are split over ranks and on the meta device; move it to a device before "
            "initializing it (model/model_initialized does)");
      at::Tensor full = tp::gather_from_tensor_parallel(t, d->dim, d->group).set_requires_grad(t.requires_grad());
      split.emplace(t.unsafeGetTensorImpl(), Gathered{t, std::move(full), *d});
    }
    const auto swap_to = [&](bool whole) {
      std::unordered_map<const void*, at::Tensor> to;
      for (const auto& [impl, s] : split)
        to.emplace(whole ? s.local.unsafeGetTensorImpl() : s.full.unsafeGetTensorImpl(), whole ? s.full : s.local);
      impl_->remap_leaves([&](const at::Tensor& t) {
        const auto it = to.find(t.unsafeGetTensorImpl());
        return it == to.end() ? t : it->second;
      });
    };
    swap_to(true);
    whole_ = true;
    try {
      fn(*this);
    } catch (...) {
      whole_ = false;
      swap_to(false);
      throw;
    }
    whole_ = false;
    for (auto& [impl, s] : split) {
      const std::int64_t n = s.local.size(s.how.dim);
      s.local.copy_(s.full.narrow(s.how.dim, s.how.rank * n, n));
    }
    swap_to(false);
  }

  std::optional<tp::VocabShard> vocab_shard() const override {
    if (!tp_ || !tp_->loss_parallel || !impl_->has_lm_head()) return std::nullopt;
    return tp::VocabShard{tp_->group, tp_->rank * (config_.vocab_size / tp_->size), config_.vocab_size};
  }

  std::shared_ptr<Module> clone() const override {
    // Built on the meta device (no storage, no RNG use), then every tensor is replaced by a
    // copy of ours: same values, device, dtype and requires_grad; tying is preserved.
    auto copy = std::make_shared<GPT2>(config_without_seed(), c10::Device(c10::kMeta), ffn_, aux_loss_key_, hf_ffn_);
    if (tp_) copy->parallelize(*tp_);  // the same local shapes and plan
    if (ep_) copy->parallelize_experts(ep_->ep);
    if (cp_) copy->parallelize_context(*cp_);
    if (retained_) copy->retain_modules(*retained_);  // the same pipeline stage
    std::unordered_map<std::string, at::Tensor> mine;
    for (const auto& item : impl_->named_parameters(true)) mine.emplace(item.key(), item.value());
    for (const auto& item : impl_->named_buffers(true)) mine.emplace(item.key(), item.value());
    std::unordered_map<const void*, std::string> names;  // meta tensor of the copy -> its FQN
    for (const auto& item : copy->impl_->named_parameters(true))
      names.emplace(item.value().unsafeGetTensorImpl(), item.key());
    for (const auto& item : copy->impl_->named_buffers(true))
      names.emplace(item.value().unsafeGetTensorImpl(), item.key());
    copy->impl_->remap_leaves([&](const at::Tensor& t) {
      const at::Tensor& src = mine.at(names.at(t.unsafeGetTensorImpl()));
      return src.detach().clone().set_requires_grad(src.requires_grad());
    });
    copy->impl_->train(impl_->is_training());
    copy->param_dtype_ = param_dtype_;
    return copy;
  }

 private:
  bool split() const { return tp_ || ep_; }

  // How `fqn` is split (expert parallel first: the experts are not split by tensor parallelism).
  std::optional<Split> split_of(const std::string& fqn) const {
    if (ep_ && std::find(ep_->fqns.begin(), ep_->fqns.end(), fqn) != ep_->fqns.end())
      return Split{0, ep_->ep.group, ep_->ep.rank, ep_->ep.size, true};
    if (tp_)
      if (const auto d = tp_split_dim(fqn)) return Split{*d, tp_->group, tp_->rank, tp_->size, false};
    return std::nullopt;
  }

  // Recorded when a parallelism splits the model: a wrapper (fsdp2_wrapped) may free the module's
  // tensors between uses.
  void record_local_shapes() {
    for (const auto& item : impl_->named_parameters(/*recurse=*/true))
      local_shapes_[item.key()] = item.value().sizes().vec();
  }

  GPT2Config config_without_seed() const {
    GPT2Config c = config_;
    c.seed.reset();
    return c;
  }

  GPT2Config config_;
  FeedForwardFactory ffn_;    // another plugin's feed-forward layers (make_gpt2)
  std::string aux_loss_key_;  // the model output of their auxiliary losses (make_gpt2)
  HfFeedForward hf_ffn_;      // their Hugging Face description (make_gpt2)
  std::shared_ptr<GPT2LLMImpl> impl_;
  Dt param_dtype_;
  std::shared_ptr<const TpPlan> tp_;                               // model/gpt2_tp
  std::shared_ptr<const EpPlan> ep_;                               // expert parallelism
  std::shared_ptr<const cp::SequenceShard> cp_;                    // context parallelism
  std::map<std::string, std::vector<std::int64_t>> local_shapes_;  // of every parameter, once split
  bool whole_ = false;                                // inside apply_to_full_parameters: the tensors are whole
  std::optional<std::vector<std::string>> retained_;  // a pipeline stage's modules
};

}  // namespace

std::shared_ptr<Module> make_gpt2(const GPT2Config& c, const c10::Device& device, FeedForwardFactory ffn,
                                  std::string aux_loss_key, HfFeedForward hf_ffn) {
  return std::make_shared<GPT2>(c, device, std::move(ffn), std::move(aux_loss_key), std::move(hf_ffn));
}

}  // namespace modalities::plugins::gpt2
