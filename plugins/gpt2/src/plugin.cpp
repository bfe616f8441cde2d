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
#include <optional>
#include <string>

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
  std::optional<std::string> context_parallel_load_balancer;
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
    s.field("context_parallel_load_balancer", &Gpt2TpConfig::context_parallel_load_balancer,
            "Modalities' key: with a cp dim in the mesh, gpt2_tp also applies context parallelism (as model/gpt2_cp) "
            "with this chunking; \"headtail\" (rank r holds chunks r and 2 cp - 1 - r), the default. Only with a cp "
            "dim.")
        .one_of({"headtail"});
  }
};

// model/gpt2_cp (Modalities' key): context parallelism over the mesh's cp dim.
struct Gpt2CpConfig {
  Ref<Module> model;
  Ref<DeviceMesh> device_mesh;
  std::string context_parallel_load_balancer = "headtail";
  static void describe(Schema<Gpt2CpConfig>& s) {
    s.field("model", &Gpt2CpConfig::model,
            "The model (returned, modified): model/gpt2, model/gpt2_moe or any model implementing "
            "Module::apply_context_parallel; apply gpt2_cp to model_raw (after gpt2_tp), before fsdp2_wrapped and "
            "model_initialized.")
        .required();
    s.field("device_mesh", &Gpt2CpConfig::device_mesh,
            "Mesh with a cp dim (context_parallel_degree > 1); fsdp2_wrapped then shards over dp_shard x cp.")
        .required();
    s.field("context_parallel_load_balancer", &Gpt2CpConfig::context_parallel_load_balancer,
            "How each sequence is cut: \"headtail\", 2 cp equal chunks, rank r holding chunks r and 2 cp - 1 - r "
            "(equal causal attention work per rank). Modalities' \"ptrr\" and null are not offered (Modalities "
            "refuses ptrr for plain tensor inputs too).")
        .one_of({"headtail"});
  }
};

// Module::apply_context_parallel over the mesh's cp dim; config errors under `model`.
void apply_context(Module& model, const ParallelDims& dims) {
  try {
    model.apply_context_parallel(dims);
  } catch (const ConfigError&) {
    throw;
  } catch (const Error& e) {
    throw ConfigError("model", e.what());
  }
}

std::shared_ptr<Module> context_parallel_model(const Gpt2CpConfig& c) {
  const ParallelDims dims(c.device_mesh.shared());
  if (!dims.enabled(MeshDim::cp))
    throw ConfigError("device_mesh", fmt::format("has no cp dim (dims: {}); set context_parallel_degree > 1",
                                                 join_mesh_dims(dims.dims())));
  apply_context(*c.model, dims);
  return c.model.shared();
}

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
  // Modalities' gpt2_tp applies context parallelism too when the mesh has a cp dim.
  if (dims.enabled(MeshDim::cp)) apply_context(*c.model, dims);
  else if (c.context_parallel_load_balancer)
    throw ConfigError(
        "context_parallel_load_balancer",
        fmt::format("is given, but the device mesh ({}) has no cp dim of more than one rank", dims.describe()));
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
  r.add<Module, Gpt2CpConfig>(
      "gpt2_cp",
      "Context parallelism over the mesh's cp dim for any model that implements Module::apply_context_parallel: "
      "each sequence cut into 2 cp chunks (headtail), every rank computing its two, attention over the whole "
      "sequence with the keys and values all-gathered; the loss on the true positions. Returns the same model.",
      context_parallel_model);
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
