// The gpt2 plugin (README.md): the GPT-2 family decoder of Modalities (`model/gpt2`), its loader from
// Hugging Face folders (`model/huggingface_pretrained_model`), tensor parallelism for any model with
// the capability (`model/gpt2_tp`) and a single-process stand-in for FSDP2's mixed precision
// (`model/mixed_precision`). The torch::nn::Module tree reproduces Modalities' GPT2LLM names and
// registration order exactly, so state dicts and checkpoints interchange with Modalities; the forward
// follows Modalities' op for op, so logits match Modalities within the tolerances of tests/gpt2_test.cpp.
//
// Files by concern: config.{h,cpp} (the configs, their schemas and checks), modules.{h,cpp} (the
// torch::nn tree and its forward), model.{h,cpp} (the Module seen by the host: state dicts, meta device,
// hooks, pipeline stages, TP split), pretrained.cpp (Hugging Face config and weights), huggingface.{h,cpp}
// (transformers families <-> a neutral decoder description), fused_ops.{h,cpp} (the fused kernels).
#include "config.h"
#include "model.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/mixed_precision.h>
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/run_context.h>
#include <modalities/sdk/tensor_parallel.h>

#include <fmt/format.h>

#include <memory>

namespace modalities::plugins::gpt2 {
namespace {

struct MixedPrecisionConfig {
  Ref<Module> model;
  MixedPrecisionSettings mixed_precision_settings;
  static void describe(Schema<MixedPrecisionConfig>& s) {
    s.field("model", &MixedPrecisionConfig::model, "Model to run in mixed precision (returned, modified).").required();
    s.field("mixed_precision_settings", &MixedPrecisionConfig::mixed_precision_settings,
            "{param_dtype, reduce_dtype}, as in model/fsdp2_wrapped.")
        .required();
  }
};

struct Gpt2TpConfig {
  Ref<Module> model;
  Ref<DeviceMesh> device_mesh;
  bool sequence_parallel = true;
  static void describe(Schema<Gpt2TpConfig>& s) {
    s.field("model", &Gpt2TpConfig::model,
            "The model to split (returned, modified): model/gpt2 or any model implementing "
            "Module::apply_tensor_parallel; apply gpt2_tp to model_raw, before fsdp2_wrapped and model_initialized.")
        .required();
    s.field("device_mesh", &Gpt2TpConfig::device_mesh,
            "Mesh with a tp dim (tensor_parallel_degree > 1) and no dp_replicate; enable_loss_parallel keeps the "
            "logits split on the vocabulary for the loss.")
        .required();
    s.field("sequence_parallel", &Gpt2TpConfig::sequence_parallel,
            "Ours (Modalities always does it): norms, dropout and residuals on each rank's chunk of the sequence "
            "between the parallel regions (all-gather / reduce-scatter at their edges); false: replicated "
            "activations (all-reduce after each row-parallel layer).");
  }
};

// Any model that implements Module::apply_tensor_parallel; the name is Modalities'.
std::shared_ptr<Module> split_model(const Gpt2TpConfig& c) {
  const ParallelDims dims(c.device_mesh.shared());
  if (!dims.enabled(MeshDim::tp))
    throw ConfigError("device_mesh", fmt::format("has no tp dim (dims: {}); set tensor_parallel_degree > 1",
                                                 join_mesh_dims(dims.dims())));
  try {
    c.model->apply_tensor_parallel(dims, tp::Options{c.sequence_parallel});
  } catch (const ConfigError&) {
    throw;
  } catch (const Error& e) {
    throw ConfigError("model", e.what());
  }
  return c.model.shared();
}

}  // namespace

void register_components(Registrar& r) {
  r.add<Module, GPT2Config>(
      "gpt2",
      "Modalities' GPT-2 family decoder (RoPE/absolute positions, GQA, SwiGLU/GELU, three norm types, weight "
      "tying); FQNs and numerics as in Modalities.",
      [](const GPT2Config& c) {
        // Built where the run computes (settings.device / MODALITIES_DEVICE), so that
        // optimizer state and checkpoints loaded at build time land on that device too.
        return make_gpt2(c, c.use_meta_device.value_or(false) ? c10::Device(c10::kMeta) : run_device());
      });
  r.add<Module, HuggingFacePretrainedConfig>(
      "huggingface_pretrained_model",
      "A Hugging Face causal LM folder (Llama 2/3, Mistral, Qwen2, Qwen3, GPT-2; safetensors) loaded into "
      "model/gpt2, to continue pre-training or to generate; its state dict, checkpoints and wrappers are "
      "model/gpt2's. The Mixture-of-Experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) are handed to "
      "model/huggingface_pretrained_moe_model of plugins/moe, which loads them into model/gpt2_moe.",
      [](const HuggingFacePretrainedConfig& c, BuildContext& ctx) -> std::shared_ptr<Module> {
        hf::ImportedConfig imported = read_huggingface_config(c);
        if (!imported.spec.moe) return load_huggingface(c, std::move(imported));
        Value built;
        try {
          built = ctx.build(Module::kComponentKey, kHuggingFaceMoeVariant, ctx.config());
        } catch (const ConfigError&) {
          throw;
        } catch (const Error& e) {
          throw Error(
              fmt::format("{} ({}) is a Mixture-of-Experts family, imported by plugins/moe "
                          "(libmodalities_moe.so, on the plugin path): {}",
                          c.model_name.string(), imported.model_type, e.what()));
        }
        if (!built.is_object() || built.as_object().interface != Module::kInterface)
          throw Error(fmt::format("model/{} did not return a Module", kHuggingFaceMoeVariant));
        return std::static_pointer_cast<Module>(built.as_object().ptr);
      });
  r.add<Module, Gpt2TpConfig>(
      "gpt2_tp",
      "Tensor parallelism over the mesh's tp dim for any model that implements Module::apply_tensor_parallel; "
      "model/gpt2: column-parallel q/k/v and MLP input, row-parallel attention and MLP outputs (local heads, GQA "
      "included), vocabulary-parallel embedding and head, sequence parallel norms; loss parallel with "
      "enable_loss_parallel. Returns the same model, split.",
      split_model);
  r.add<Module, MixedPrecisionConfig>(
      "mixed_precision",
      "FSDP2-style mixed precision on one process: fp32 master parameters, each use cast to param_dtype. "
      "Returns the same model.",
      [](const MixedPrecisionConfig& c) {
        c.model->set_param_dtype(mixed_precision_dtype(c.mixed_precision_settings.param_dtype));
        return c.model.shared();
      });
}

}  // namespace modalities::plugins::gpt2

MODALITIES_PLUGIN(gpt2, MODALITIES_PLUGIN_VERSION, modalities::plugins::gpt2::register_components)
