// The GPT-2 family decoder of Modalities (`model/gpt2`, see README.md) and a
// single-process stand-in for FSDP2's mixed precision (`model/mixed_precision`).
// The torch::nn::Module tree reproduces Modalities' GPT2LLM names and
// registration order exactly, so state dicts and checkpoints
// interchange with Modalities; the forward follows Modalities' op for op, so
// logits match Modalities within the tolerances of tests/gpt2_test.cpp.
//
// Shape legend: B batch, T sequence length, d = n_embd, V = vocab_size,
// Hq / Hkv query / key-value heads, hd = d / Hq head dim, r = Hq / Hkv.
#include "fused_ops.h"
#include "huggingface.h"

#include <modalities/sdk/formats/safetensors.h>
#include <modalities/sdk/huggingface.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/module_hooks.h>
#include <modalities/sdk/interfaces/removable_handle.h>
#include <modalities/sdk/mixed_precision.h>
#include <modalities/sdk/norms.h>
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/run_context.h>
#include <modalities/sdk/tagged_union.h>
#include <modalities/sdk/tensor_parallel.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/dropout.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace modalities::plugins::gpt2 {
namespace {

// ===================================================================================
// Configuration (README.md, "`model/gpt2` config")
// ===================================================================================

// The norm config schemas and formulas are the `layer_norm` component's, from the SDK
// (modalities/sdk/norms.h), so model/gpt2 and layer_norm/* cannot drift apart.

/// `{norm_type, config}` (Modalities' LayerNormWrapperConfig), resolved to what
/// the norm module needs. The config schema is chosen by norm_type.
struct NormWrapperConfig {
  std::string norm_type;
  norms::Kind kind = norms::Kind::kLayerNorm;
  std::int64_t size = 0;
  double eps = 1e-5;
  bool weight = true;
  bool bias = true;
  std::string size_key;  // the config key holding `size` ("normalized_shape" or "ndim"), for messages
};

/// RoPE frequency scaling, as Hugging Face configs state it (`rope_scaling`); ours, not Modalities'.
struct RopeScalingConfig {
  std::string rope_type;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  std::int64_t original_max_position_embeddings = 8192;
  static void describe(Schema<RopeScalingConfig>& s) {
    using C = RopeScalingConfig;
    s.field("rope_type", &C::rope_type,
            "linear (every frequency / factor) or llama3 (Llama 3.1: low frequencies / factor, high ones kept, "
            "smooth in between).")
        .required()
        .one_of({"linear", "llama3"});
    s.field("factor", &C::factor, "Scaling factor.").required().greater_than(0.0);
    s.field("low_freq_factor", &C::low_freq_factor, "llama3: wavelengths above original/low_freq_factor are scaled.")
        .greater_than(0.0);
    s.field("high_freq_factor", &C::high_freq_factor,
            "llama3: wavelengths below original/high_freq_factor are kept; must exceed low_freq_factor.")
        .greater_than(0.0);
    s.field("original_max_position_embeddings", &C::original_max_position_embeddings,
            "llama3: the context length the model was trained with before scaling.")
        .at_least(1);
    s.rule([](const C& c, ParseContext& ctx) {
      if (c.rope_type == "llama3" && c.high_freq_factor <= c.low_freq_factor)
        ctx.fail("high_freq_factor", fmt::format("must exceed low_freq_factor ({}), got {}", c.low_freq_factor,
                                                 c.high_freq_factor));
    });
  }
};

struct RotaryFields {
  std::int64_t n_embd = 0;
  std::int64_t n_head = 0;
  std::int64_t seq_length_dim = -2;
  std::int64_t base_freq = 10000;
  std::optional<RopeScalingConfig> rope_scaling;
  static void describe(Schema<RotaryFields>& s) {
    s.field("n_embd", &RotaryFields::n_embd, "Model width; must equal the model's n_embd.").required().at_least(0);
    s.field("n_head", &RotaryFields::n_head, "Query head count; must equal n_head_q (head dim = n_embd / n_head).")
        .required()
        .at_least(0);
    s.field("seq_length_dim", &RotaryFields::seq_length_dim, "Sequence dimension of [B, H, T, hd]: -2 (or 2).")
        .required();
    s.field("base_freq", &RotaryFields::base_freq, "RoPE theta.").required().at_least(10000);
    s.field("rope_scaling", &RotaryFields::rope_scaling,
            "Ours: frequency scaling {rope_type = linear|llama3, factor, ...} as in Hugging Face configs; null: "
            "none (Modalities).");
  }
};

struct IdentityFields {
  static void describe(Schema<IdentityFields>&) {}
};

/// One entry of attention_config.qkv_transforms: `{type_hint, config}`.
struct QkvTransformConfig {
  std::string type_hint;
  bool rotary = false;
  RotaryFields rope;
};

struct FromPretrainedArgs {};
struct FromPretrainedKwargs {};


// Modalities' two tagged unions of the GPT-2 config (modalities/sdk/tagged_union.h).
const TaggedUnion<NormWrapperConfig>& norm_union() {
  using U = TaggedUnion<NormWrapperConfig>;
  static const U u{
      "norm_type",
      "Norm module: layer_norm (LayerNorm), rms_norm (Modalities' RMSLayerNorm, deprecated), pytorch_rms_norm "
      "(RMSNorm).",
      "Settings; the schema depends on norm_type.",
      {U::alternative<norms::LayerNormConfig>(
           "layer_norm",
           "LayerNorm keys; eps defaults to 1e-5 unless elementwise_affine or bias is given, then 1e-6 (Modalities' "
           "config-union resolution)",
           [](const norms::LayerNormConfig& f, const Value& config, NormWrapperConfig& out, const std::string&,
              ParseContext&) {
             out.norm_type = "layer_norm";
             out.kind = norms::Kind::kLayerNorm;
             out.size = f.normalized_shape;
             out.size_key = "normalized_shape";
             // Note [layer_norm eps default]: Modalities parses the config with a pydantic
             // union tried as (RMSNorm config, RMSLayerNorm config, LayerNorm config); a table
             // giving neither elementwise_affine nor bias is taken by the RMSNorm config class,
             // whose eps default is 1e-5. Only with one of them present does the LayerNorm
             // class (default 1e-6) win. README.md describes it for users.
             const bool layer_norm_class = config.find("elementwise_affine") != nullptr || config.find("bias") != nullptr;
             out.eps = config.find("eps") != nullptr ? f.eps : (layer_norm_class ? 1e-6 : 1e-5);
             out.weight = f.elementwise_affine;
             out.bias = f.elementwise_affine && f.bias;
           }),
       U::alternative<norms::RmsLayerNormConfig>(
           "rms_norm", "RMSLayerNorm keys",
           [](const norms::RmsLayerNormConfig& f, const Value&, NormWrapperConfig& out, const std::string& path,
              ParseContext& ctx) {
             out.norm_type = "rms_norm";
             out.kind = norms::Kind::kRmsLayerNorm;
             out.size = f.ndim;
             out.size_key = "ndim";
             out.eps = f.epsilon;
             out.weight = true;
             out.bias = f.bias;
             ctx.warn(join_path(path, "norm_type"),
                      "rms_norm (Modalities' RMSLayerNorm) is deprecated in Modalities; prefer pytorch_rms_norm");
           }),
       U::alternative<norms::TorchRmsNormConfig>(
           "pytorch_rms_norm", "RMSNorm keys",
           [](const norms::TorchRmsNormConfig& f, const Value&, NormWrapperConfig& out, const std::string&,
              ParseContext&) {
             out.norm_type = "pytorch_rms_norm";
             out.kind = norms::Kind::kTorchRmsNorm;
             out.size = f.normalized_shape;
             out.size_key = "normalized_shape";
             out.eps = f.eps;
             out.weight = true;
             out.bias = false;
           })}};
  return u;
}

const TaggedUnion<QkvTransformConfig>& qkv_transform_union() {
  using U = TaggedUnion<QkvTransformConfig>;
  static const U u{"type_hint", "Transform class applied to (q, k, v) after the head split.",
                   "IdentityTransform: {}; RotaryTransform: the fields below.",
                   {U::alternative<IdentityFields>("IdentityTransform", "no keys",
                                                   [](const IdentityFields&, const Value&, QkvTransformConfig& out,
                                                      const std::string&, ParseContext&) {
                                                     out.type_hint = "IdentityTransform";
                                                     out.rotary = false;
                                                   }),
                    U::alternative<RotaryFields>("RotaryTransform", "RoPE keys",
                                                 [](const RotaryFields& f, const Value&, QkvTransformConfig& out,
                                                    const std::string&, ParseContext&) {
                                                   out.type_hint = "RotaryTransform";
                                                   out.rotary = true;
                                                   out.rope = f;
                                                 })}};
  return u;
}

}  // namespace
}  // namespace modalities::plugins::gpt2

namespace modalities {

template <>
struct Codec<plugins::gpt2::NormWrapperConfig> {
  using T = plugins::gpt2::NormWrapperConfig;
  static std::string type_name() { return plugins::gpt2::norm_union().type_name(); }
  static std::string repr(const T&) { return "{...}"; }
  static void annotate(FieldInfo& info) { plugins::gpt2::norm_union().annotate(info); }
  static Parsed parse(const Value& v, T& out, const std::string& path, ParseContext& ctx) {
    return plugins::gpt2::norm_union().parse(v, out, path, ctx);
  }
};

// model/huggingface_pretrained_model's model_args (from_pretrained's positional arguments): only
// null or an empty list.
template <>
struct Codec<plugins::gpt2::FromPretrainedArgs> {
  static std::string type_name() { return "null or []"; }
  static std::string repr(const plugins::gpt2::FromPretrainedArgs&) { return "null"; }
  static Parsed parse(const Value& v, plugins::gpt2::FromPretrainedArgs&, const std::string& path, ParseContext& ctx) {
    if (v.is_null() || (v.is_list() && v.as_list().empty())) return Parsed::kOk;
    ctx.fail(path, "extra positional arguments of from_pretrained are not supported; leave it null");
    return Parsed::kError;
  }
};

// ... and its kwargs: null, or a table whose only key is torch_dtype / dtype = "float32" (or "auto").
template <>
struct Codec<plugins::gpt2::FromPretrainedKwargs> {
  static std::string type_name() { return "null or table {torch_dtype}"; }
  static std::string repr(const plugins::gpt2::FromPretrainedKwargs&) { return "{...}"; }
  static Parsed parse(const Value& v, plugins::gpt2::FromPretrainedKwargs&, const std::string& path,
                      ParseContext& ctx) {
    if (v.is_null()) return Parsed::kOk;
    if (!v.is_table()) return detail::type_error(v, "a table or null", path, ctx);
    Parsed r = Parsed::kOk;
    for (const auto& [key, item] : v.as_table()) {
      if (key != "torch_dtype" && key != "dtype") {
        ctx.fail(join_path(path, key), "not supported (the from_pretrained keyword argument taken here: torch_dtype)");
        r = Parsed::kError;
      } else if (!item.is_string() || (item.as_string() != "float32" && item.as_string() != "torch.float32" &&
                                       item.as_string() != "auto")) {
        ctx.fail(join_path(path, key),
                 "parameters are float32 master weights here (\"float32\" or \"auto\"); for bf16 compute use "
                 "model/mixed_precision or fsdp2_wrapped's mixed_precision_settings");
        r = Parsed::kError;
      }
    }
    return r;
  }
};

template <>
struct Codec<plugins::gpt2::QkvTransformConfig> {
  using T = plugins::gpt2::QkvTransformConfig;
  static std::string type_name() { return plugins::gpt2::qkv_transform_union().type_name(); }
  static std::string repr(const T&) { return "{...}"; }
  static void annotate(FieldInfo& info) { plugins::gpt2::qkv_transform_union().annotate(info); }
  static Parsed parse(const Value& v, T& out, const std::string& path, ParseContext& ctx) {
    return plugins::gpt2::qkv_transform_union().parse(v, out, path, ctx);
  }
};

}  // namespace modalities

namespace modalities::plugins::gpt2 {
namespace {

struct AttentionConfig {
  std::vector<QkvTransformConfig> qkv_transforms;
  std::optional<NormWrapperConfig> qk_norm_config;
  std::optional<std::int64_t> sliding_window;
  static void describe(Schema<AttentionConfig>& s) {
    s.field("qkv_transforms", &AttentionConfig::qkv_transforms,
            "Transforms applied in order to (q, k, v) after the head split: IdentityTransform or RotaryTransform "
            "(RoPE, half-split convention).")
        .required();
    s.field("qk_norm_config", &AttentionConfig::qk_norm_config,
            "Optional norm applied per head (size = head dim) to q and k after the transforms.");
    s.field("sliding_window", &AttentionConfig::sliding_window,
            "Ours: sliding-window attention (Mistral): position i attends to j with i - window < j <= i. "
            "null: full causal attention (Modalities).")
        .at_least(1);
  }
};

std::int64_t swiglu_hidden(std::int64_t ffn_hidden, std::int64_t multiple) {
  // Python: int(2 * ffn_hidden / 3) (float division, truncation), then round up to `multiple`.
  const auto a = static_cast<std::int64_t>(2.0 * static_cast<double>(ffn_hidden) / 3.0);
  return ((a + multiple - 1) / multiple) * multiple;
}

struct GPT2Config {
  std::string sample_key;
  std::string prediction_key;
  std::optional<bool> use_meta_device = false;
  std::string poe_type;
  std::int64_t sequence_length = 0;
  std::int64_t vocab_size = 0;
  std::int64_t n_layer = 0;
  std::int64_t n_head_q = 0;
  std::int64_t n_head_kv = 0;
  std::int64_t n_embd = 0;
  std::int64_t ffn_hidden = 0;
  double dropout = 0.0;
  bool bias = false;
  std::optional<bool> qkv_bias;
  std::optional<bool> attn_proj_bias;
  std::optional<bool> mlp_bias;
  AttentionConfig attention_config;
  std::string attention_implementation;
  std::string activation_type;
  NormWrapperConfig attention_norm_config;
  NormWrapperConfig ffn_norm_config;
  NormWrapperConfig lm_head_norm_config;
  bool use_weight_tying = false;
  std::optional<std::int64_t> seed;
  std::int64_t enforce_swiglu_hidden_dim_multiple_of = 256;

  std::int64_t head_dim() const { return n_embd / n_head_q; }
  bool qkv_bias_on() const { return qkv_bias.value_or(bias); }
  bool attn_proj_bias_on() const { return attn_proj_bias.value_or(bias); }
  bool mlp_bias_on() const { return mlp_bias.value_or(bias); }
  bool gelu() const { return activation_type == "gelu" || activation_type == "gelu_tanh"; }

  static void describe(Schema<GPT2Config>& s) {
    s.field("sample_key", &GPT2Config::sample_key, "Key of the token-id tensor [B, T] in the input map.").required();
    s.field("prediction_key", &GPT2Config::prediction_key, "Key of the logits [B, T, V] in the output map.").required();
    s.field("use_meta_device", &GPT2Config::use_meta_device,
            "Build parameters on the meta device (no storage); materialize with to(device) and initialize with "
            "model/model_initialized. Not allowed with use_weight_tying.");
    s.field("poe_type", &GPT2Config::poe_type,
            "Position encoding: ABSOLUTE (learned table wpe[sequence_length, n_embd]) or NOPE (none; use RoPE).")
        .required()
        .one_of({"ABSOLUTE", "NOPE"});
    s.field("sequence_length", &GPT2Config::sequence_length, "Maximum input length T.").required().at_least(1);
    s.field("vocab_size", &GPT2Config::vocab_size, "Vocabulary size; divisible by 128.").required().at_least(1);
    s.field("n_layer", &GPT2Config::n_layer, "Number of GPT2Block layers.").required().at_least(1);
    s.field("n_head_q", &GPT2Config::n_head_q, "Query heads; n_embd must be divisible by it.").required().at_least(1);
    s.field("n_head_kv", &GPT2Config::n_head_kv,
            "Key/value heads (grouped-query attention); must divide n_head_q (equal: multi-head attention).")
        .required()
        .at_least(1);
    s.field("n_embd", &GPT2Config::n_embd, "Model width d; divisible by 128.").required().at_least(1);
    s.field("ffn_hidden", &GPT2Config::ffn_hidden,
            "MLP hidden size (GELU uses it as is; SwiGLU uses ceil_to_multiple(int(2*ffn_hidden/3), "
            "enforce_swiglu_hidden_dim_multiple_of)); divisible by 128.")
        .required()
        .at_least(1);
    s.field("dropout", &GPT2Config::dropout,
            "Dropout probability: embeddings, attention probabilities (in every mode, as in Modalities), residual "
            "after c_proj, GELU-MLP output.")
        .required()
        .in_closed(0.0, 1.0);
    s.field("bias", &GPT2Config::bias, "Bias on every attention and MLP linear layer (lm_head never has one).")
        .required();
    s.field("qkv_bias", &GPT2Config::qkv_bias,
            "Ours: bias on q_attn/k_attn/v_attn only (Qwen2 has them, its other linears not); null: `bias`.");
    s.field("attn_proj_bias", &GPT2Config::attn_proj_bias, "Ours: bias on attn.c_proj; null: `bias`.");
    s.field("mlp_bias", &GPT2Config::mlp_bias, "Ours: bias on the MLP linears; null: `bias`.");
    s.field("attention_config", &GPT2Config::attention_config, "qkv_transforms and optional qk_norm_config.")
        .required();
    s.field("attention_implementation", &GPT2Config::attention_implementation,
            "manual (explicit softmax(q k^T / sqrt(hd)) v) or pytorch_flash (at::scaled_dot_product_attention); "
            "dao_flash is not available in this build.")
        .required()
        .one_of({"manual", "pytorch_flash", "dao_flash"});
    s.field("activation_type", &GPT2Config::activation_type,
            "MLP: gelu (c_fc, exact GELU, c_proj), gelu_tanh (ours: tanh-approximated GELU, GPT-2's gelu_new) or "
            "swiglu (W, V, W_2).")
        .required()
        .one_of({"gelu", "gelu_tanh", "swiglu"});
    s.field("attention_norm_config", &GPT2Config::attention_norm_config, "Norm before attention (size n_embd).")
        .required();
    s.field("ffn_norm_config", &GPT2Config::ffn_norm_config, "Norm before the MLP (size n_embd).").required();
    s.field("lm_head_norm_config", &GPT2Config::lm_head_norm_config, "Final norm before lm_head (size n_embd).")
        .required();
    s.field("use_weight_tying", &GPT2Config::use_weight_tying,
            "Share transformer.wte.weight with transformer.lm_head.weight.")
        .required();
    s.field("seed", &GPT2Config::seed, "If set, the global RNG is seeded with it before the modules are created.");
    s.field("enforce_swiglu_hidden_dim_multiple_of", &GPT2Config::enforce_swiglu_hidden_dim_multiple_of,
            "SwiGLU hidden size is rounded up to a multiple of this.")
        .at_least(1);
    s.rule(validate);
  }

  static void check_norm(const NormWrapperConfig& n, const std::string& key, std::int64_t expected,
                         const std::string& what, ParseContext& ctx) {
    if (n.size != expected)
      ctx.fail(fmt::format("{}.config.{}", key, n.size_key),
               fmt::format("must equal {} ({}), got {}", what, expected, n.size));
  }

  static void validate(const GPT2Config& c, ParseContext& ctx) {
    for (const auto& [value, key] : {std::pair{c.vocab_size, "vocab_size"}, std::pair{c.n_embd, "n_embd"},
                                     std::pair{c.ffn_hidden, "ffn_hidden"}})
      if (value % 128 != 0)
        ctx.fail(key, fmt::format("must be divisible by 128 (for efficient training, as in Modalities), got {}", value));
    const bool heads_ok = c.n_embd % c.n_head_q == 0;
    if (!heads_ok)
      ctx.fail("n_head_q", fmt::format("n_embd ({}) must be divisible by n_head_q ({})", c.n_embd, c.n_head_q));
    if (c.n_head_q % c.n_head_kv != 0)
      ctx.fail("n_head_kv", fmt::format("n_head_q ({}) must be divisible by n_head_kv ({})", c.n_head_q, c.n_head_kv));
    if (c.use_meta_device.value_or(false) && c.use_weight_tying)
      ctx.fail("use_meta_device",
               "must be false when use_weight_tying is true (weight tying is not supported on the meta device, "
               "as in Modalities)");
    if (c.attention_implementation == "dao_flash")
      ctx.fail("attention_implementation",
               "'dao_flash' (the flash-attn library) is not available in this build, use 'pytorch_flash'");
    for (std::size_t j = 0; j < c.attention_config.qkv_transforms.size(); ++j) {
      const QkvTransformConfig& t = c.attention_config.qkv_transforms[j];
      if (!t.rotary) continue;
      const std::string base = fmt::format("attention_config.qkv_transforms[{}]", j);
      if (c.poe_type != "NOPE")
        ctx.fail(base + ".type_hint",
                 fmt::format("RotaryTransform requires poe_type = \"NOPE\", got \"{}\"", c.poe_type));
      if (t.rope.n_head != c.n_head_q)
        ctx.fail(base + ".config.n_head",
                 fmt::format("must equal n_head_q ({}) (RoPE's head dim is n_embd / n_head), got {}", c.n_head_q,
                             t.rope.n_head));
      if (t.rope.n_embd != c.n_embd)
        ctx.fail(base + ".config.n_embd", fmt::format("must equal n_embd ({}), got {}", c.n_embd, t.rope.n_embd));
      if (t.rope.seq_length_dim != -2 && t.rope.seq_length_dim != 2)
        ctx.fail(base + ".config.seq_length_dim",
                 fmt::format("must be -2 (the T dimension of [B, H, T, hd]), got {}", t.rope.seq_length_dim));
      if (heads_ok && c.head_dim() % 2 != 0)
        ctx.fail(base, fmt::format("RoPE needs an even head dim, got n_embd / n_head_q = {}", c.head_dim()));
    }
    check_norm(c.attention_norm_config, "attention_norm_config", c.n_embd, "n_embd", ctx);
    check_norm(c.ffn_norm_config, "ffn_norm_config", c.n_embd, "n_embd", ctx);
    check_norm(c.lm_head_norm_config, "lm_head_norm_config", c.n_embd, "n_embd", ctx);
    if (c.attention_config.qk_norm_config && heads_ok)
      check_norm(*c.attention_config.qk_norm_config, "attention_config.qk_norm_config", c.head_dim(),
                 "the head dim n_embd / n_head_q", ctx);
    if (c.ffn_hidden != 4 * c.n_embd)
      ctx.warn("ffn_hidden", fmt::format("expected 4 * n_embd ({}), got {} (allowed; Modalities warns too)",
                                         4 * c.n_embd, c.ffn_hidden));
  }
};

// ===================================================================================
// Modules
// ===================================================================================

// Mixed precision: parameters keep their storage dtype; every use casts to `Dt`
// when set (FSDP2's param_dtype, README.md). See Module::set_param_dtype.
using Dt = std::optional<c10::ScalarType>;

at::Tensor cast(const at::Tensor& t, Dt dt) {
  if (!dt || !t.defined() || t.scalar_type() == *dt) return t;
  return t.to(*dt);
}

using Remap = std::function<at::Tensor(const at::Tensor&)>;

// Tensor parallelism (Module::apply_tensor_parallel, `model/gpt2_tp`, README.md): the SDK's plan
// (modalities/sdk/tensor_parallel.h) says how this rank's part of the model talks to the others.
using TpPlan = tp::Plan;

// Note [Replacing registered tensors]
// libtorch's Module::to() moves tensors with set_data(), which cannot turn a meta
// tensor into a real one (their TensorImpls are not shallow-copy compatible), and
// libtorch has no to_empty(). Materializing a meta model and clone() therefore swap
// the registered tensors themselves: parameters through the protected `parameters_`
// dict, the single buffer of RotaryTransform through the slot that register_buffer
// returned (stable: it is that module's only buffer, so the dict never grows after).
// Every module with parameters or buffers is a Leaf.
class Leaf : public torch::nn::Module {
 public:
  explicit Leaf(std::string name) : torch::nn::Module(std::move(name)) {}
  /// Constructor-time values again (README.md), on whatever device the tensors live.
  virtual void reset() = 0;
  /// Replaces every own parameter and buffer by f(old).
  virtual void remap(const Remap& f) {
    for (auto& item : parameters_) item.value() = f(item.value());
    sync();
  }

 protected:
  /// Refreshes the typed member handles from the registered tensors.
  virtual void sync() {}
  at::Tensor registered(const std::string& name) const {
    const at::Tensor* t = parameters_.find(name);
    return t != nullptr ? *t : at::Tensor();
  }
};

class LinearImpl final : public Leaf {
 public:
  LinearImpl(std::int64_t in, std::int64_t out, bool bias, const at::TensorOptions& o) : Leaf("Linear"), in_(in) {
    register_parameter("weight", at::empty({out, in}, o));
    if (bias) register_parameter("bias", at::empty({out}, o));
    sync();
  }
  void reset() override {
    // torch.nn.Linear.reset_parameters: Kaiming-uniform (a = sqrt(5)) = U(+-1/sqrt(fan_in)) for both.
    torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
    if (bias.defined()) {
      const double bound = in_ > 0 ? 1.0 / std::sqrt(static_cast<double>(in_)) : 0.0;
      bias.uniform_(-bound, bound);
    }
  }
  // x: [..., in] -> [..., out]; fused for the model's 2-d activations (at::linear otherwise).
  at::Tensor operator()(const at::Tensor& x, Dt dt) const { return fused_linear(x, cast(weight, dt), cast(bias, dt)); }

  at::Tensor weight, bias;

 private:
  void sync() override {
    weight = registered("weight");
    bias = registered("bias");
  }
  std::int64_t in_;
};

class EmbeddingImpl final : public Leaf {
 public:
  EmbeddingImpl(std::int64_t num, std::int64_t dim, const at::TensorOptions& o) : Leaf("Embedding") {
    register_parameter("weight", at::empty({num, dim}, o));
    sync();
  }
  void reset() override { weight.normal_(0.0, 1.0); }
  /// Weight tying: this embedding uses `shared` (lm_head's weight) from now on.
  void tie(const at::Tensor& shared) {
    parameters_["weight"] = shared;
    sync();
  }
  // ids: [B, T] -> [B, T, dim]
  at::Tensor operator()(const at::Tensor& ids, Dt dt) const { return at::embedding(cast(weight, dt), ids); }

  at::Tensor weight;

 private:
  void sync() override { weight = registered("weight"); }
};

class NormImpl final : public Leaf {
 public:
  NormImpl(const NormWrapperConfig& c, const at::TensorOptions& o)
      : Leaf(norms::module_name(c.kind)),
        kind_(c.kind),
        n_(c.size),
        eps_(c.eps) {
    if (c.weight) register_parameter("weight", at::empty({n_}, o));
    if (c.bias) register_parameter("bias", at::empty({n_}, o));
    sync();
  }
  void reset() override {
    if (weight.defined()) weight.fill_(1.0);
    if (bias.defined()) bias.zero_();
  }
  // x: [..., n] -> [..., n], Modalities' norm formulas (README.md), in the compute dtype dt.
  at::Tensor operator()(const at::Tensor& x, Dt dt) const {
    const at::Tensor w = partial ? partial->shared(weight) : weight;
    // CPU fast path of RMSNorm, bit-identical to at::rms_norm (fused_ops.h).
    if (kind_ == norms::Kind::kTorchRmsNorm && x.dim() >= 1 && x.size(-1) == n_)
      return fused_rms_norm(x, cast(w, dt), eps_);
    return norms::apply(kind_, x, n_, cast(w, dt), cast(partial ? partial->shared(bias) : bias, dt), eps_);
  }

  at::Tensor weight, bias;
  const TpPlan* partial = nullptr;  // tensor parallel: applied to part of the data (TpPlan::shared)

 private:
  void sync() override {
    weight = registered("weight");
    bias = registered("bias");
  }
  norms::Kind kind_;
  std::int64_t n_;
  double eps_;
};

class IdentityTransformImpl final : public torch::nn::Module {
 public:
  IdentityTransformImpl() : torch::nn::Module("IdentityTransform") {}
};

class IdentityImpl final : public torch::nn::Module {  // wpe with poe_type NOPE (nn.Identity)
 public:
  IdentityImpl() : torch::nn::Module("Identity") {}
};

// RoPE, half-split (NeoX) convention; precision as in README.md, "Numerics".
class RotaryTransformImpl final : public Leaf {
 public:
  RotaryTransformImpl(std::int64_t head_dim, std::int64_t base_freq, std::optional<RopeScalingConfig> scaling,
                      const at::TensorOptions& o)
      : Leaf("RotaryTransform"), hd_(head_dim), base_(base_freq), scaling_(std::move(scaling)) {
    inv_freq_slot_ = &register_buffer("inv_freq", at::empty({hd_ / 2}, o));
  }
  void reset() override {
    // inv_freq[j] = 1 / base^(float32(2j) / hd), in float32 as torch computes it; written in place.
    const at::Tensor& buf = *inv_freq_slot_;
    const at::Tensor exps =
        at::arange(0, hd_, 2, at::TensorOptions().dtype(at::kLong).device(buf.device())).to(at::kFloat) / hd_;
    at::Tensor inv = at::reciprocal(at::pow(at::Scalar(base_), exps));
    if (scaling_) inv = scaled(inv, *scaling_);
    buf.copy_(inv);
    cache_ = {};
  }
  // Frequency scaling with the float32 ops of transformers' rope initialisers
  // (_compute_linear_scaling_rope_parameters, _compute_llama3_parameters), so imported models get
  // the very inv_freq their Hugging Face counterpart computes.
  static at::Tensor scaled(const at::Tensor& inv, const RopeScalingConfig& s) {
    if (s.rope_type == "linear") return inv / s.factor;
    const double old_len = static_cast<double>(s.original_max_position_embeddings);
    const double low_wavelen = old_len / s.low_freq_factor, high_wavelen = old_len / s.high_freq_factor;
    const at::Tensor wavelen = 2 * M_PI / inv;
    const at::Tensor llama = at::where(wavelen > low_wavelen, inv / s.factor, inv);
    const at::Tensor smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    const at::Tensor smoothed = (1 - smooth) * llama / s.factor + smooth * llama;
    const at::Tensor medium = (wavelen < high_wavelen).logical_not() * (wavelen > low_wavelen).logical_not();
    return at::where(medium, smoothed, llama);
  }
  void remap(const Remap& f) override {
    *inv_freq_slot_ = f(*inv_freq_slot_);
    cache_ = {};
  }
  // q: [B, Hq, T, hd], k: [B, Hkv, T, hd] -> rotated q, k (v is unchanged)
  std::pair<at::Tensor, at::Tensor> operator()(const at::Tensor& q, const at::Tensor& k) {
    const auto& [cos, sin] = tables(k.size(-2), k.device(), k.scalar_type());
    return {apply(q, cos, sin), apply(k, cos, sin)};
  }
  const at::Tensor& inv_freq() const { return *inv_freq_slot_; }
  std::int64_t head_dim() const { return hd_; }

  // cos/sin [1, 1, T, hd] in `dtype`, cached per (T, device, dtype, inv_freq version) like
  // Modalities' per-module cache. No host synchronisation: only metadata is compared.
  std::pair<at::Tensor, at::Tensor> tables(std::int64_t T, const c10::Device& device, c10::ScalarType dtype) {
    const at::Tensor& inv = *inv_freq_slot_;
    if (cache_.cos.defined() && cache_.T == T && cache_.device == device && cache_.dtype == dtype &&
        cache_.inv == inv.unsafeGetTensorImpl() && cache_.version == inv._version())
      return {cache_.cos, cache_.sin};
    at::NoGradGuard no_grad;
    const at::Tensor t = at::arange(T, at::TensorOptions().dtype(at::kFloat).device(device));
    // The frequencies are rounded to the activation dtype first (bf16 runs), the product is float32.
    const at::Tensor f = inv.to(device).to(dtype).to(at::kFloat);
    const at::Tensor freqs = t.unsqueeze(1) * f.unsqueeze(0);  // [T, hd/2]
    const at::Tensor emb = at::cat({freqs, freqs}, -1);        // [T, hd]
    cache_.cos = emb.cos().unsqueeze(0).unsqueeze(0).to(dtype);
    cache_.sin = emb.sin().unsqueeze(0).unsqueeze(0).to(dtype);
    cache_.T = T;
    cache_.device = device;
    cache_.dtype = dtype;
    cache_.inv = inv.unsafeGetTensorImpl();
    cache_.version = inv._version();
    return {cache_.cos, cache_.sin};
  }

 private:
  static at::Tensor rotate_half(const at::Tensor& x) {
    const auto halves = x.chunk(2, -1);
    return at::cat({-halves[1], halves[0]}, -1);
  }
  static at::Tensor apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    return x * cos + rotate_half(x) * sin;
  }
  std::int64_t hd_;
  std::int64_t base_;
  std::optional<RopeScalingConfig> scaling_;
  at::Tensor* inv_freq_slot_ = nullptr;  // see Note [Replacing registered tensors]
  struct Cache {
    std::int64_t T = -1;
    c10::Device device = c10::kCPU;
    c10::ScalarType dtype = at::kFloat;
    const void* inv = nullptr;
    std::uint32_t version = 0;
    at::Tensor cos, sin;
  } cache_;
};

// Causal masks, shared by all layers and cached per (T, device, dtype): the additive mask of the
// manual path (0 where position i may attend to j, -inf elsewhere) and, with a sliding window, the
// boolean mask handed to SDPA. Allowed: j <= i, and i - window < j with a window (transformers'
// sliding_window_causal_mask_function).
class CausalMaskCache {
 public:
  explicit CausalMaskCache(std::optional<std::int64_t> window = std::nullopt) : window_(window) {}
  const at::Tensor& get(std::int64_t T, const at::TensorOptions& o) {
    if (mask_.defined() && mask_.size(0) == T && mask_.device() == o.device() &&
        mask_.scalar_type() == o.dtype().toScalarType())
      return mask_;
    mask_ = at::zeros({T, T}, o).masked_fill_(allowed(T, o.device()).logical_not(),
                                               -std::numeric_limits<double>::infinity());
    return mask_;
  }
  // Boolean [T, T] (true: attend) when a sliding window cuts into length T; undefined otherwise
  // (plain causal attention, SDPA's is_causal).
  at::Tensor sliding(std::int64_t T, const c10::Device& device) {
    if (!window_ || *window_ >= T) return {};
    if (!bool_.defined() || bool_.size(0) != T || bool_.device() != device) bool_ = allowed(T, device);
    return bool_;
  }

 private:
  at::Tensor allowed(std::int64_t T, const c10::Device& device) const {
    at::Tensor keep = at::ones({T, T}, at::TensorOptions().dtype(at::kBool).device(device)).tril();
    if (window_) keep = keep.logical_and(at::ones_like(keep).triu(-(*window_ - 1)));
    return keep;
  }
  std::optional<std::int64_t> window_;
  at::Tensor mask_, bool_;
};

enum class AttentionImpl { kManual, kPytorchFlash };

// A row-parallel linear (its weight split on the input dim): the local product, summed over the
// ranks by TpPlan::leave, then the bias, once (a replicated parameter: under sequence parallelism
// each rank adds it to its chunk, so its gradient is summed over the ranks).
at::Tensor row_parallel(const LinearImpl& l, const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt,
                        const TpPlan& tp) {
  at::Tensor y = tp.leave(fused_linear(x, cast(l.weight, dt), at::Tensor()), B, T);
  if (l.bias.defined()) y = y + cast(tp.sequence_parallel ? tp.shared(l.bias) : l.bias, dt);
  return y;
}

class CausalSelfAttentionImpl final : public torch::nn::Module {
 public:
  CausalSelfAttentionImpl(const GPT2Config& c, std::shared_ptr<CausalMaskCache> mask, const at::TensorOptions& o)
      : torch::nn::Module("CausalSelfAttention"),
        hq_(c.n_head_q),
        hkv_(c.n_head_kv),
        hd_(c.head_dim()),
        dropout_(c.dropout),
        impl_(c.attention_implementation == "manual" ? AttentionImpl::kManual : AttentionImpl::kPytorchFlash),
        mask_(std::move(mask)) {
    const std::int64_t kv = c.n_embd / (c.n_head_q / c.n_head_kv);
    q_attn = register_module("q_attn", std::make_shared<LinearImpl>(c.n_embd, c.n_embd, c.qkv_bias_on(), o));
    k_attn = register_module("k_attn", std::make_shared<LinearImpl>(c.n_embd, kv, c.qkv_bias_on(), o));
    v_attn = register_module("v_attn", std::make_shared<LinearImpl>(c.n_embd, kv, c.qkv_bias_on(), o));
    c_proj = register_module("c_proj", std::make_shared<LinearImpl>(c.n_embd, c.n_embd, c.attn_proj_bias_on(), o));
    register_module("resid_dropout", torch::nn::Dropout(c.dropout));
    // A plain module named like nn.ModuleList, entries "0", "1", ...; typed view in `rope_`.
    auto list = register_module("qkv_transforms", std::make_shared<torch::nn::Module>("ModuleList"));
    for (std::size_t j = 0; j < c.attention_config.qkv_transforms.size(); ++j) {
      const QkvTransformConfig& t = c.attention_config.qkv_transforms[j];
      if (t.rotary) {
        auto rope = std::make_shared<RotaryTransformImpl>(t.rope.n_embd / t.rope.n_head, t.rope.base_freq,
                                                          t.rope.rope_scaling, o);
        list->register_module(std::to_string(j), rope);
        rope_.push_back(rope);
      } else {
        list->register_module(std::to_string(j), std::make_shared<IdentityTransformImpl>());
      }
    }
    if (c.attention_config.qk_norm_config) {
      q_norm = register_module("q_norm", std::make_shared<NormImpl>(*c.attention_config.qk_norm_config, o));
      k_norm = register_module("k_norm", std::make_shared<NormImpl>(*c.attention_config.qk_norm_config, o));
    }
  }

  // x: [B*T, d] (rows = tokens, see GPT2LLMImpl::forward) -> [B*T, d]
  at::Tensor operator()(const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt) {
    at::Tensor q, k, v;  // [B, Hq, T, hd] each once expanded
    const std::int64_t r = hq_ / hkv_;
    if (rope_.size() <= 1 && (rope_.empty() || rope_.front()->head_dim() == hd_)) {
      // Common case, fused (fused_ops.h): the three projections, the heads split, RoPE and
      // the GQA expansion as one autograd node. With qk-norm the norms come between RoPE and
      // the expansion, which then happens below.
      HeadsSpec sq, sk, sv;
      sq.heads = hq_;
      sk.heads = sv.heads = hkv_;
      if (!rope_.empty()) {
        std::tie(sq.cos, sq.sin) = rope_.front()->tables(T, x.device(), x.scalar_type());
        sk.cos = sq.cos;
        sk.sin = sq.sin;
      }
      sk.repeat = sv.repeat = q_norm ? 1 : r;
      Qkv h = fused_qkv(x, cast(q_attn->weight, dt), cast(q_attn->bias, dt), cast(k_attn->weight, dt),
                        cast(k_attn->bias, dt), cast(v_attn->weight, dt), cast(v_attn->bias, dt), B, T, hd_, sq, sk, sv);
      q = std::move(h.q);
      k = std::move(h.k);
      v = std::move(h.v);
    } else {
      q = (*q_attn)(x, dt).view({B, T, hq_, hd_}).transpose(1, 2).contiguous();  // [B, Hq, T, hd]
      k = (*k_attn)(x, dt).view({B, T, -1, hd_}).transpose(1, 2).contiguous();   // [B, Hkv, T, hd]
      v = (*v_attn)(x, dt).view({B, T, -1, hd_}).transpose(1, 2).contiguous();   // [B, Hkv, T, hd]
      for (const auto& rope : rope_) std::tie(q, k) = (*rope)(q, k);
    }
    if (q_norm) {
      q = (*q_norm)(q, dt);
      k = (*k_norm)(k, dt);
    }
    // GQA: kv head j serves query heads j*r .. j*r+r-1 (repeat_interleave over dim 1).
    if (hq_ != hkv_ && k.size(1) != hq_) {
      k = k.unsqueeze(2).expand({B, hkv_, r, T, hd_}).reshape({B, hq_, T, hd_});
      v = v.unsqueeze(2).expand({B, hkv_, r, T, hd_}).reshape({B, hq_, T, hd_});
    }
    at::Tensor y;  // [B, Hq, T, hd]
    if (impl_ == AttentionImpl::kManual) {
      at::Tensor s = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd_)));
      s = s + mask_->get(T, q.options());
      at::Tensor p = at::softmax(s, -1);
      if (dropout_ > 0) p = at::dropout(p, dropout_, /*train=*/true);  // in every mode, as in Modalities
      y = at::matmul(p, v);
    } else if (const at::Tensor window = mask_->sliding(T, q.device()); window.defined()) {
      y = at::scaled_dot_product_attention(q, k, v, window, dropout_, /*is_causal=*/false);
    } else {
      // Dropout in every mode too: Modalities passes dropout_p without consulting the mode.
      y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, dropout_, /*is_causal=*/true);
    }
    y = fused_merge_heads(y);  // [B*T, d], heads side by side (this rank's heads under TP)
    y = tp_ ? row_parallel(*c_proj, y, B, T, dt, *tp_) : (*c_proj)(y, dt);
    if (is_training() && dropout_ > 0) y = at::dropout(y, dropout_, /*train=*/true);
    return y;
  }

  // Tensor parallel: this rank computes heads [rank * Hq / size, ...) (and the matching kv heads);
  // the projections' weights were split by GPT2::parallelize.
  void parallelize(const TpPlan& tp) {
    hq_ /= tp.size;
    hkv_ /= tp.size;
    tp_ = &tp;
    if (q_norm) q_norm->partial = k_norm->partial = &tp;  // per-head norms see this rank's heads only
  }

  std::shared_ptr<LinearImpl> q_attn, k_attn, v_attn, c_proj;
  std::shared_ptr<NormImpl> q_norm, k_norm;

 private:
  const TpPlan* tp_ = nullptr;
  std::int64_t hq_, hkv_, hd_;
  double dropout_;
  AttentionImpl impl_;
  std::shared_ptr<CausalMaskCache> mask_;
  std::vector<std::shared_ptr<RotaryTransformImpl>> rope_;
};

class SwiGLUImpl final : public torch::nn::Module {
 public:
  SwiGLUImpl(const GPT2Config& c, const at::TensorOptions& o) : torch::nn::Module("SwiGLU") {
    const std::int64_t h = swiglu_hidden(c.ffn_hidden, c.enforce_swiglu_hidden_dim_multiple_of);
    W = register_module("W", std::make_shared<LinearImpl>(c.n_embd, h, c.mlp_bias_on(), o));
    register_module("silu", torch::nn::SiLU());
    V = register_module("V", std::make_shared<LinearImpl>(c.n_embd, h, c.mlp_bias_on(), o));
    W_2 = register_module("W_2", std::make_shared<LinearImpl>(h, c.n_embd, c.mlp_bias_on(), o));
  }
  // x: [B*T, d] -> [B*T, h] -> [B*T, d]; no dropout (as in Modalities). Under TP h is this
  // rank's part of the hidden units and W_2 is row-parallel.
  at::Tensor operator()(const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt) const {
    const at::Tensor g = fused_swiglu(x, cast(W->weight, dt), cast(W->bias, dt), cast(V->weight, dt), cast(V->bias, dt));
    return tp ? row_parallel(*W_2, g, B, T, dt, *tp) : (*W_2)(g, dt);
  }

  std::shared_ptr<LinearImpl> W, V, W_2;
  const TpPlan* tp = nullptr;
};

class TransformerMLPImpl final : public torch::nn::Module {
 public:
  TransformerMLPImpl(const GPT2Config& c, const at::TensorOptions& o)
      : torch::nn::Module("TransformerMLP"), dropout_(c.dropout), tanh_(c.activation_type == "gelu_tanh") {
    c_fc = register_module("c_fc", std::make_shared<LinearImpl>(c.n_embd, c.ffn_hidden, c.mlp_bias_on(), o));
    register_module("gelu", torch::nn::GELU(torch::nn::GELUOptions().approximate(tanh_ ? "tanh" : "none")));
    c_proj = register_module("c_proj", std::make_shared<LinearImpl>(c.ffn_hidden, c.n_embd, c.mlp_bias_on(), o));
    register_module("dropout", torch::nn::Dropout(c.dropout));
  }
  // x: [B*T, d] -> [B*T, ffn_hidden] -> [B*T, d]; exact (erf) GELU, or its tanh approximation
  // (gelu_tanh, GPT-2's gelu_new). Under TP c_fc is column-parallel, c_proj row-parallel.
  at::Tensor operator()(const at::Tensor& x, std::int64_t B, std::int64_t T, Dt dt) const {
    const at::Tensor a = at::gelu((*c_fc)(x, dt), tanh_ ? "tanh" : "none");
    at::Tensor y = tp ? row_parallel(*c_proj, a, B, T, dt, *tp) : (*c_proj)(a, dt);
    if (is_training() && dropout_ > 0) y = at::dropout(y, dropout_, /*train=*/true);
    return y;
  }

  std::shared_ptr<LinearImpl> c_fc, c_proj;
  const TpPlan* tp = nullptr;

 private:
  double dropout_;
  bool tanh_;
};

class GPT2BlockImpl final : public torch::nn::Module {
 public:
  GPT2BlockImpl(const GPT2Config& c, std::shared_ptr<CausalMaskCache> mask, const at::TensorOptions& o)
      : torch::nn::Module("GPT2Block") {
    attention_norm = register_module("attention_norm", std::make_shared<NormImpl>(c.attention_norm_config, o));
    ffn_norm = register_module("ffn_norm", std::make_shared<NormImpl>(c.ffn_norm_config, o));
    attn = register_module("attn", std::make_shared<CausalSelfAttentionImpl>(c, std::move(mask), o));
    if (c.activation_type == "swiglu") swiglu = register_module("mlp", std::make_shared<SwiGLUImpl>(c, o));
    else gelu_mlp = register_module("mlp", std::make_shared<TransformerMLPImpl>(c, o));
  }
  // Pre-norm residual block. x: [B*T, d] -> [B*T, d]; under sequence parallelism this rank's
  // sequence chunk [B*(T/tp), d], gathered whole into the attention and the MLP.
  at::Tensor operator()(at::Tensor x, std::int64_t B, std::int64_t T, Dt dt) {
    const auto enter = [&](const at::Tensor& n) { return tp ? tp->enter(n, B, T) : n; };
    x = x + (*attn)(enter((*attention_norm)(x, dt)), B, T, dt);
    const at::Tensor n = enter((*ffn_norm)(x, dt));
    return x + (swiglu ? (*swiglu)(n, B, T, dt) : (*gelu_mlp)(n, B, T, dt));
  }

  void parallelize(const TpPlan& plan) {
    tp = &plan;
    attn->parallelize(plan);
    if (swiglu) swiglu->tp = &plan;
    else gelu_mlp->tp = &plan;
    if (plan.sequence_parallel) attention_norm->partial = ffn_norm->partial = &plan;
  }
  const TpPlan* tp = nullptr;

  std::shared_ptr<NormImpl> attention_norm, ffn_norm;
  std::shared_ptr<CausalSelfAttentionImpl> attn;
  std::shared_ptr<SwiGLUImpl> swiglu;
  std::shared_ptr<TransformerMLPImpl> gelu_mlp;
};

// Module hooks (Module::add_hook, modalities/sdk/module_hooks.h) fire on the root ("") and the
// blocks ("transformer.h.<i>"): the points where wrappers act (a sharding wrapper gathers a block's
// parameters before it runs and frees them after; debugging hooks look at activations).

// The root (Modalities' GPT2LLM): a `transformer` ModuleDict holding wte, wpe,
// drop, h (ModuleDict of GPT2Block), lm_head_norm, lm_head.
class GPT2LLMImpl final : public torch::nn::Module {
 public:
  GPT2LLMImpl(const GPT2Config& c, const at::TensorOptions& o)
      : torch::nn::Module("GPT2LLM"),
        absolute_(c.poe_type == "ABSOLUTE"),
        sequence_length_(c.sequence_length),
        dropout_(c.dropout) {
    auto mask = std::make_shared<CausalMaskCache>(c.attention_config.sliding_window);
    // Objects are created (and, off the meta device, initialized) in Modalities' construction
    // order so that a seeded build draws random numbers in the same sequence: wpe, wte,
    // blocks, lm_head; they are registered in the canonical FQN order below.
    std::shared_ptr<torch::nn::Module> wpe;
    if (absolute_) wpe = wpe_ = init(std::make_shared<EmbeddingImpl>(c.sequence_length, c.n_embd, o), o);
    else wpe = std::make_shared<IdentityImpl>();
    wte_ = init(std::make_shared<EmbeddingImpl>(c.vocab_size, c.n_embd, o), o);
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> blocks;
    for (std::int64_t i = 0; i < c.n_layer; ++i) {
      auto block = std::make_shared<GPT2BlockImpl>(c, mask, o);
      if (!o.device().is_meta()) reset_leaves(*block);
      blocks.emplace_back(std::to_string(i), block);
    }
    lm_head_norm_ = init(std::make_shared<NormImpl>(c.lm_head_norm_config, o), o);
    lm_head_ = init(std::make_shared<LinearImpl>(c.n_embd, c.vocab_size, /*bias=*/false, o), o);
    if (c.use_weight_tying) wte_->tie(lm_head_->weight);

    h_ = torch::nn::ModuleDict(blocks);
    transformer_ = torch::nn::ModuleDict(std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{
        {"wte", wte_},
        {"wpe", wpe},
        {"drop", torch::nn::Dropout(c.dropout).ptr()},
        {"h", h_.ptr()},
        {"lm_head_norm", lm_head_norm_},
        {"lm_head", lm_head_}});
    register_module("transformer", transformer_);
  }

  // ids: [B, T] token ids -> logits [B, T, V]. A pipeline part without wte takes
  // hidden states [B, T, d] instead; parts without lm_head return hidden states.
  //
  // Inside, activations are [B*T, d] matrices (one row per token): every Linear is then a
  // plain mm, without the flatten/unflatten views (and their backward nodes) that a
  // [B, T, d] input costs per projection. Same kernels on the same memory, so the results
  // are bit-identical to the 3-d layout; it saves ~10 ops per projection per step.
  at::Tensor forward(const at::Tensor& input, Dt dt) {
    TORCH_CHECK(input.dim() >= 2, "gpt2: expected input of shape [B, T], got ", input.sizes());
    const std::int64_t B = input.size(0), T = input.size(1);
    TORCH_CHECK(T <= sequence_length_, "gpt2: cannot forward a sequence of length ", T,
                ", the model's maximum input sequence length (sequence_length) is ", sequence_length_);
    const TpPlan* tp = tp_.get();
    const bool sp = tp && tp->sequence_parallel;
    TORCH_CHECK(!sp || T % tp->size == 0, "gpt2_tp: sequence parallelism splits the sequence over the ", tp->size,
                " tensor-parallel ranks; an input of length ", T, " does not split evenly");
    at::Tensor h;
    if (transformer_->contains("wte") && tp) {
      h = vocab_parallel_embedding(input, B, T, dt);  // [B*T, d], or [B*(T/tp), d] with SP
      if (absolute_ && transformer_->contains("wpe")) {
        const std::int64_t Tl = sp ? T / tp->size : T;
        const at::Tensor w = cast(sp ? tp->shared(wpe_->weight) : wpe_->weight, dt).narrow(0, sp ? tp->rank * Tl : 0, Tl);
        h = (h.view({B, Tl, -1}) + w).view({B * Tl, -1});
      }
    } else if (transformer_->contains("wte")) {
      if (absolute_ && transformer_->contains("wpe"))
        h = ((*wte_)(input, dt) + cast(wpe_->weight, dt).narrow(0, 0, T)).view({B * T, -1});
      else
        h = (*wte_)(input.reshape({B * T}), dt);  // [B*T, d]
    } else {
      TORCH_CHECK(input.dim() == 3, "gpt2: a part without wte expects hidden states [B, T, d], got ", input.sizes());
      h = (input.is_floating_point() ? cast(input, dt) : input).reshape({B * T, input.size(2)});
      if (absolute_ && transformer_->contains("wpe"))
        h = (h.view({B, T, -1}) + cast(wpe_->weight, dt).narrow(0, 0, T)).view({B * T, -1});
      if (sp)  // replicated hidden states -> this rank's sequence chunk
        h = tp::split_to_tensor_parallel(h.view({B, T, -1}), 1, tp->group).reshape({B * (T / tp->size), -1});
    }
    if (is_training() && dropout_ > 0) h = at::dropout(h, dropout_, /*train=*/true);
    if (transformer_->contains("h")) {
      for (const auto& item : *h_) {
        auto& block = *item.value()->as<GPT2BlockImpl>();
        if (hooks_.empty()) {  // the common case: no fqn string, no std::function per block
          h = block(h, B, T, dt);
          continue;
        }
        // Only the model-owned block and values: a block runner (activation checkpointing) may call
        // it again in backward.
        h = hooks_.around("transformer.h." + item.key(), "GPT2Block", h,
                          [&block, B, T, dt](const at::Tensor& x) { return block(x, B, T, dt); });
      }
    }
    if (transformer_->contains("lm_head_norm")) h = (*lm_head_norm_)(h, dt);
    if (transformer_->contains("lm_head") && tp) {
      // Column-parallel head: this rank's vocabulary slice [B*T, V/tp], gathered to [B*T, V]
      // unless the loss takes the slices (loss parallel).
      h = fused_linear(tp->enter(h, B, T), cast(lm_head_->weight, dt), at::Tensor());
      if (!tp->loss_parallel) h = tp::gather_from_tensor_parallel(h, 1, tp->group);
    } else if (transformer_->contains("lm_head")) {
      h = (*lm_head_)(h, dt);  // [B*T, V]
    } else if (sp) {  // a part without the head hands on whole, replicated hidden states
      h = tp::gather_from_tensor_parallel(h.view({B, T / tp->size, -1}), 1, tp->group).reshape({B * T, -1});
    }
    return h.view({B, T, -1});
  }

  // Pipeline stage: drops every module of `transformer` (and every block) that is neither named
  // nor an ancestor of a named one. The forward skips what is missing.
  void retain(const std::vector<std::string>& fqns) {
    const auto kept = [&](const std::string& fqn) {
      return std::any_of(fqns.begin(), fqns.end(),
                         [&](const std::string& f) { return f == fqn || f.starts_with(fqn + "."); });
    };
    if (tied() && kept("transformer.wte") != kept("transformer.lm_head"))
      throw ConfigError("whole_model",
                        "model/gpt2 has use_weight_tying = true, and the pipeline puts transformer.wte and "
                        "transformer.lm_head (one shared weight) into different stages; set use_weight_tying = false "
                        "for pipeline parallelism");
    const auto drop = [](torch::nn::ModuleDict& dict, const std::string& key) {
      dict->pop(key);
      dict->unregister_module(key);
    };
    if (transformer_->contains("h"))
      for (const std::string& key : block_keys())
        if (!kept("transformer.h." + key)) drop(h_, key);
    for (const std::string key : {"wte", "wpe", "drop", "h", "lm_head_norm", "lm_head"}) {
      if (!transformer_->contains(key)) continue;
      const bool keep = key == "h" ? !block_keys().empty() : kept("transformer." + key);
      if (!keep) drop(transformer_, key);
    }
  }

  // Tensor parallel: every module learns the plan; the weights were split by GPT2::parallelize.
  void parallelize(std::shared_ptr<const TpPlan> plan) {
    tp_ = std::move(plan);
    if (transformer_->contains("h"))
      for (const auto& item : *h_) item.value()->as<GPT2BlockImpl>()->parallelize(*tp_);
    if (tp_->sequence_parallel && lm_head_norm_) lm_head_norm_->partial = tp_.get();
  }
  const TpPlan* tp_plan() const { return tp_.get(); }

  // The root's forward with its hooks around it (kPreForward, kForward, kBackward of "").
  at::Tensor hooked_forward(const at::Tensor& input, Dt dt) {
    if (hooks_.empty()) return forward(input, dt);
    const at::Tensor in[] = {input};
    hooks_.call(HookPoint::kPreForward, "", "GPT2LLM", in, {});
    at::Tensor out = forward(input, dt);
    const at::Tensor outs[] = {out};
    hooks_.call(HookPoint::kForward, "", "GPT2LLM", in, outs);
    if (hooks_.wants("")) hooks_.on_backward(out, "", "GPT2LLM");
    return out;
  }

  ModuleHooks& hooks() { return hooks_; }

  std::vector<std::string> block_keys() const {
    std::vector<std::string> keys;
    if (transformer_->contains("h"))
      for (const auto& item : *h_) keys.push_back(item.key());
    return keys;
  }
  bool tied() const {
    return wte_ && lm_head_ && wte_->weight.defined() &&
           wte_->weight.unsafeGetTensorImpl() == lm_head_->weight.unsafeGetTensorImpl();
  }
  const std::shared_ptr<EmbeddingImpl>& wte() const { return wte_; }
  const std::shared_ptr<LinearImpl>& lm_head() const { return lm_head_; }

  /// reset() of every Leaf under `m` (including m), pre-order = Modalities' post-order
  /// over modules with reset_parameters (only leaves own tensors).
  static void reset_leaves(torch::nn::Module& m) {
    at::NoGradGuard no_grad;
    if (auto* leaf = dynamic_cast<Leaf*>(&m)) leaf->reset();
    for (const auto& child : m.modules(/*include_self=*/false))
      if (auto* leaf = dynamic_cast<Leaf*>(child.get())) leaf->reset();
  }
  /// remap() of every Leaf; tensors shared between leaves (weight tying) stay shared.
  void remap_leaves(const Remap& f) {
    std::unordered_map<const void*, at::Tensor> done;
    const Remap once = [&](const at::Tensor& t) {
      if (!t.defined()) return t;
      auto [it, fresh] = done.try_emplace(t.unsafeGetTensorImpl());
      if (fresh) it->second = f(t);
      return it->second;
    };
    for (const auto& child : modules(/*include_self=*/false))
      if (auto* leaf = dynamic_cast<Leaf*>(child.get())) leaf->remap(once);
  }

 private:
  template <class M>
  static std::shared_ptr<M> init(std::shared_ptr<M> m, const at::TensorOptions& o) {
    if (!o.device().is_meta()) reset_leaves(*m);
    return m;
  }

  // The embedding of token ids with this rank's rows [rank * V/tp, ...) of the table: ids outside
  // the slice look up row 0 and are zeroed, and the sum over the ranks (TpPlan::leave) is the
  // whole embedding, exactly (x + 0 = x).
  at::Tensor vocab_parallel_embedding(const at::Tensor& ids, std::int64_t B, std::int64_t T, Dt dt) const {
    const at::Tensor w = cast(wte_->weight, dt);
    const std::int64_t rows = w.size(0);
    const at::Tensor local = ids.reshape({B * T}) - tp_->rank * rows;
    const at::Tensor outside = local.lt(0).logical_or(local.ge(rows));
    const at::Tensor e = at::embedding(w, local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(1), 0.0);
    return tp_->leave(e, B, T);
  }

  bool absolute_;
  std::int64_t sequence_length_;
  double dropout_;
  std::shared_ptr<EmbeddingImpl> wte_, wpe_;
  std::shared_ptr<NormImpl> lm_head_norm_;
  std::shared_ptr<LinearImpl> lm_head_;
  torch::nn::ModuleDict h_{nullptr};
  torch::nn::ModuleDict transformer_{nullptr};
  ModuleHooks hooks_;
  std::shared_ptr<const TpPlan> tp_;  // model/gpt2_tp
};

// ===================================================================================
// The Module seen by the host
// ===================================================================================

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

hf::DecoderSpec spec_from_config(const GPT2Config& c);

class GPT2 final : public Module, public HuggingFaceExportable {
 public:
  GPT2(const GPT2Config& c, const c10::Device& device) : config_(c) {
    if (c.seed) {
      // torch.manual_seed reinterprets a negative seed as its two's complement uint64.
      at::manual_seed(static_cast<std::uint64_t>(*c.seed));
    }
    impl_ = std::make_shared<GPT2LLMImpl>(c, at::TensorOptions().dtype(at::kFloat).device(device));
  }

  TensorMap forward(const TensorMap& inputs) override {
    auto it = inputs.find(config_.sample_key);
    if (it == inputs.end()) {
      std::vector<std::string> keys;
      for (const auto& [k, v] : inputs) keys.push_back(k);
      throw Error(fmt::format("gpt2: the input has no '{}' (sample_key); it has {}", config_.sample_key,
                              quoted_list(keys)));
    }
    return {{config_.prediction_key, impl_->hooked_forward(it->second, param_dtype_)}};
  }
  torch::nn::Module& module() override { return *impl_; }
  const torch::nn::Module& module() const override { return *impl_; }

  // With weight tying the shared tensor is listed once, as transformer.wte.weight (as in Modalities).
  NamedTensors named_parameters() const override {
    NamedTensors out;
    std::unordered_set<const void*> seen;
    for (const auto& item : impl_->named_parameters(/*recurse=*/true))
      if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
    return out;
  }

  // Tied models: either key alone is enough; with both, lm_head's value wins (PyTorch
  // loads in module order, lm_head last).
  void load_state_dict(const StateDict& state, bool strict) override {
    if (tp_ && !whole_) {  // split: whole tensors give this rank's chunk
      StateDict s = state;
      for (auto& [key, t] : s) {
        const auto d = tp_split_dim(key);
        const auto mine = local_shapes_.find(key);
        if (!d || mine == local_shapes_.end() || t.sizes().vec() == mine->second) continue;
        const std::int64_t n = mine->second[static_cast<std::size_t>(*d)];
        if (t.dim() == static_cast<std::int64_t>(mine->second.size()) && t.size(*d) == n * tp_->size)
          t = t.narrow(*d, tp_->rank * n, n);
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
      at::Tensor out = t.is_meta() ? at::empty(t.sizes(), t.options().device(device).dtype(target))
                                   : t.detach().to(device, target);
      return out.set_requires_grad(t.requires_grad());
    });
  }

  void set_param_dtype(std::optional<c10::ScalarType> dtype) override {
    if (dtype && !c10::isFloatingType(*dtype))
      throw Error(fmt::format("gpt2: set_param_dtype needs a floating-point dtype, got {}", c10::toString(*dtype)));
    const c10::ScalarType storage = impl_->wte() ? impl_->wte()->weight.scalar_type() : at::kFloat;
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
        throw Error("gpt2: reset_parameters() needs materialized tensors; the model is on the meta device "
                    "(move it with to(device) first)");
    // Split: the whole model is initialized as in one process (same random numbers), each rank keeps its part.
    if (tp_ && !whole_) return apply_to_full_parameters([](Module& full) { full.reset_parameters(); });
    GPT2LLMImpl::reset_leaves(*impl_);
  }

  void retain_modules(const std::vector<std::string>& module_fqns) override {
    impl_->retain(module_fqns);
    retained_ = module_fqns;
  }

  // `modalities convert_pytorch_to_hf_checkpoint` (README.md, "Hugging Face interop").
  HuggingFaceCheckpoint to_huggingface(const HuggingFaceExportOptions& options) const override {
    if (tp_ || retained_)
      throw Error("gpt2: a tensor-parallel or pipeline-split model holds part of the weights; export the whole "
                  "model (a conversion config builds model/gpt2 and loads the checkpoint into it, which reads "
                  "sharded checkpoints whole)");
    for (const auto& t : impl_->parameters())
      if (t.is_meta()) throw Error("gpt2: the model is on the meta device; load a checkpoint into it before exporting");
    return hf::to_huggingface(spec_from_config(config_), state_dict(), options);
  }

  // --- tensor parallel (model/gpt2_tp) ---------------------------------------------------

  // Splits the model over plan.size ranks: every split parameter (tp_split_dim) is replaced by
  // this rank's chunk, the modules compute their local heads and hidden units. Works on the meta
  // device too (the chunks are meta then).
  void apply_tensor_parallel(const ParallelDims& dims, const tp::Options& options) override {
    if (dims.has(MeshDim::dp_replicate))
      throw ConfigError("device_mesh", "has a dp_replicate dim; tensor parallelism composes with dp_shard only (as in "
                                       "Modalities)");
    parallelize(TpPlan::from(dims, options));
  }

  void parallelize(const TpPlan& plan) {
    if (tp_) throw Error("gpt2_tp: the model is split already (tensor parallelism applied twice)");
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
    // Recorded now: a wrapper (fsdp2_wrapped) may free the module's tensors between uses.
    for (const auto& item : impl_->named_parameters(/*recurse=*/true))
      local_shapes_[item.key()] = item.value().sizes().vec();
  }

  // Every parameter, split or replicated (then held alike by the tp ranks), as a block of the full tensor.
  std::map<std::string, ShardPlacement> shard_placements() const override {
    if (!tp_ || whole_) return {};
    std::map<std::string, ShardPlacement> out;
    for (const auto& [fqn, shape] : local_shapes_) {
      ShardPlacement s;
      s.global_shape = shape;
      s.offsets.assign(s.global_shape.size(), 0);
      if (const auto d = tp_split_dim(fqn)) {
        s.offsets[*d] = tp_->rank * s.global_shape[*d];
        s.global_shape[*d] *= tp_->size;
      } else {
        s.replicas = tp_->size;
      }
      out[fqn] = std::move(s);
    }
    return out;
  }

  // Split: whole tensors gathered over the tp ranks, `fn` on the whole model, each rank keeps its
  // chunk of whatever fn wrote. A collective.
  void apply_to_full_parameters(const std::function<void(Module&)>& fn) override {
    if (!tp_ || whole_) return fn(*this);
    at::NoGradGuard no_grad;
    struct Split {
      at::Tensor local, full;
      std::int64_t dim;
    };
    std::unordered_map<const void*, Split> split;  // by the local tensor
    for (const auto& item : impl_->named_parameters(/*recurse=*/true)) {
      const auto d = tp_split_dim(item.key());
      const at::Tensor& t = item.value();
      if (!d || split.contains(t.unsafeGetTensorImpl())) continue;
      if (t.is_meta())
        throw Error("gpt2_tp: the model's parameters are on the meta device; move it to a device before "
                    "initializing it (model/model_initialized does)");
      at::Tensor full = tp::gather_from_tensor_parallel(t, *d, tp_->group).set_requires_grad(t.requires_grad());
      split.emplace(t.unsafeGetTensorImpl(), Split{t, std::move(full), *d});
    }
    const auto swap_to = [&](bool whole) {
      std::unordered_map<const void*, at::Tensor> to;
      for (const auto& [impl, s] : split) to.emplace(whole ? s.local.unsafeGetTensorImpl() : s.full.unsafeGetTensorImpl(), whole ? s.full : s.local);
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
      const std::int64_t n = s.local.size(s.dim);
      s.local.copy_(s.full.narrow(s.dim, tp_->rank * n, n));
    }
    swap_to(false);
  }

  std::optional<tp::VocabShard> vocab_shard() const override {
    if (!tp_ || !tp_->loss_parallel || !impl_->lm_head()) return std::nullopt;
    return tp::VocabShard{tp_->group, tp_->rank * (config_.vocab_size / tp_->size), config_.vocab_size};
  }

  std::shared_ptr<Module> clone() const override {
    // Built on the meta device (no storage, no RNG use), then every tensor is replaced by a
    // copy of ours: same values, device, dtype and requires_grad; tying is preserved.
    auto copy = std::make_shared<GPT2>(config_without_seed(), c10::Device(c10::kMeta));
    if (tp_) copy->parallelize(*tp_);  // the same local shapes and plan
    if (retained_) copy->retain_modules(*retained_);  // the same pipeline stage
    std::unordered_map<std::string, at::Tensor> mine;
    for (const auto& item : impl_->named_parameters(true)) mine.emplace(item.key(), item.value());
    for (const auto& item : impl_->named_buffers(true)) mine.emplace(item.key(), item.value());
    std::unordered_map<const void*, std::string> names;  // meta tensor of the copy -> its FQN
    for (const auto& item : copy->impl_->named_parameters(true)) names.emplace(item.value().unsafeGetTensorImpl(), item.key());
    for (const auto& item : copy->impl_->named_buffers(true)) names.emplace(item.value().unsafeGetTensorImpl(), item.key());
    copy->impl_->remap_leaves([&](const at::Tensor& t) {
      const at::Tensor& src = mine.at(names.at(t.unsafeGetTensorImpl()));
      return src.detach().clone().set_requires_grad(src.requires_grad());
    });
    copy->impl_->train(impl_->is_training());
    copy->param_dtype_ = param_dtype_;
    return copy;
  }

 private:
  GPT2Config config_without_seed() const {
    GPT2Config c = config_;
    c.seed.reset();
    return c;
  }

  GPT2Config config_;
  std::shared_ptr<GPT2LLMImpl> impl_;
  Dt param_dtype_;
  std::shared_ptr<const TpPlan> tp_;  // model/gpt2_tp
  std::map<std::string, std::vector<std::int64_t>> local_shapes_;  // of every parameter, once split
  bool whole_ = false;                // inside apply_to_full_parameters: the tensors are whole
  std::optional<std::vector<std::string>> retained_;  // a pipeline stage's modules
};

// ===================================================================================
// model/mixed_precision
// ===================================================================================

struct MixedPrecisionConfig {
  Ref<Module> model;
  MixedPrecisionSettings mixed_precision_settings;
  static void describe(Schema<MixedPrecisionConfig>& s) {
    s.field("model", &MixedPrecisionConfig::model, "Model to run in mixed precision (returned, modified).")
        .required();
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

// ===================================================================================
// Hugging Face interop (huggingface.h): GPT2Config <-> hf::DecoderSpec, and
// model/huggingface_pretrained_model
// ===================================================================================

hf::DecoderSpec spec_from_config(const GPT2Config& c) {
  std::vector<std::string> why;
  hf::DecoderSpec s;
  s.absolute_positions = c.poe_type == "ABSOLUTE";
  s.max_positions = c.sequence_length;
  s.vocab_size = c.vocab_size;
  s.n_layer = c.n_layer;
  s.n_head_q = c.n_head_q;
  s.n_head_kv = c.n_head_kv;
  s.n_embd = c.n_embd;
  s.activation = c.activation_type;
  s.mlp_hidden = c.activation_type == "swiglu" ? swiglu_hidden(c.ffn_hidden, c.enforce_swiglu_hidden_dim_multiple_of)
                                               : c.ffn_hidden;
  s.qkv_bias = c.qkv_bias_on();
  s.attn_proj_bias = c.attn_proj_bias_on();
  s.mlp_bias = c.mlp_bias_on();
  s.tie_word_embeddings = c.use_weight_tying;
  s.dropout = c.dropout;
  s.sliding_window = c.attention_config.sliding_window;
  // One norm for all three places: RMSNorm (pytorch_rms_norm, or rms_norm without bias) or LayerNorm with
  // weight and bias.
  const auto kind = [](const NormWrapperConfig& n) -> std::string {
    if (n.kind == norms::Kind::kTorchRmsNorm || (n.kind == norms::Kind::kRmsLayerNorm && !n.bias)) return "rms_norm";
    if (n.kind == norms::Kind::kLayerNorm && n.weight && n.bias) return "layer_norm";
    return n.norm_type + (n.kind == norms::Kind::kRmsLayerNorm ? " with bias" : " without weight or bias");
  };
  const NormWrapperConfig* norms3[] = {&c.attention_norm_config, &c.ffn_norm_config, &c.lm_head_norm_config};
  s.norm = kind(*norms3[0]);
  s.norm_eps = norms3[0]->eps;
  for (const NormWrapperConfig* n : norms3)
    if (kind(*n) != s.norm || n->eps != s.norm_eps) {
      why.push_back("the three norms differ in type or eps (transformers models use one norm everywhere)");
      break;
    }
  if (s.norm != "rms_norm" && s.norm != "layer_norm")
    why.push_back(fmt::format("{} has no transformers counterpart", s.norm));
  if (c.attention_config.qk_norm_config)
    why.push_back("qk_norm_config (Modalities normalizes q and k after RoPE; no transformers family does)");
  int rotary = 0;
  for (const QkvTransformConfig& t : c.attention_config.qkv_transforms) {
    if (!t.rotary) continue;
    ++rotary;
    s.rope_theta = t.rope.base_freq;
    if (t.rope.rope_scaling) {
      const RopeScalingConfig& r = *t.rope.rope_scaling;
      s.rope_scaling = hf::RopeScaling{r.rope_type, r.factor, r.low_freq_factor, r.high_freq_factor,
                                       r.original_max_position_embeddings};
    }
  }
  if (rotary > 1) why.push_back("more than one RotaryTransform");
  if (rotary == 0 && !s.absolute_positions)
    why.push_back("no position encoding (poe_type NOPE without RotaryTransform)");
  if (!why.empty())
    throw Error(fmt::format("gpt2: this model has no transformers counterpart: {}", fmt::join(why, "; ")));
  return s;
}

GPT2Config config_from_spec(const hf::DecoderSpec& s) {
  GPT2Config c;
  c.poe_type = s.absolute_positions ? "ABSOLUTE" : "NOPE";
  c.sequence_length = s.max_positions;
  c.vocab_size = s.vocab_size;
  c.n_layer = s.n_layer;
  c.n_head_q = s.n_head_q;
  c.n_head_kv = s.n_head_kv;
  c.n_embd = s.n_embd;
  c.activation_type = s.activation;
  // SwiGLU's hidden size is derived from ffn_hidden; with the multiple equal to the wanted size,
  // ceil_to_multiple(int(2 * h / 3), h) = h for any h >= 2.
  c.ffn_hidden = s.mlp_hidden;
  c.enforce_swiglu_hidden_dim_multiple_of = s.activation == "swiglu" ? s.mlp_hidden : 256;
  c.dropout = s.dropout;
  c.bias = s.qkv_bias && s.attn_proj_bias && s.mlp_bias;
  c.qkv_bias = s.qkv_bias;
  c.attn_proj_bias = s.attn_proj_bias;
  c.mlp_bias = s.mlp_bias;
  c.use_weight_tying = s.tie_word_embeddings;
  c.attention_implementation = "pytorch_flash";
  c.attention_config.sliding_window = s.sliding_window;
  if (!s.absolute_positions) {
    QkvTransformConfig t;
    t.type_hint = "RotaryTransform";
    t.rotary = true;
    t.rope.n_embd = s.n_embd;
    t.rope.n_head = s.n_head_q;
    t.rope.seq_length_dim = -2;
    t.rope.base_freq = s.rope_theta;
    if (s.rope_scaling)
      t.rope.rope_scaling = RopeScalingConfig{s.rope_scaling->rope_type, s.rope_scaling->factor,
                                              s.rope_scaling->low_freq_factor, s.rope_scaling->high_freq_factor,
                                              s.rope_scaling->original_max_position_embeddings};
    c.attention_config.qkv_transforms.push_back(t);
  }
  NormWrapperConfig n;
  n.size = s.n_embd;
  n.eps = s.norm_eps;
  if (s.norm == "rms_norm") {
    n.norm_type = "pytorch_rms_norm";
    n.kind = norms::Kind::kTorchRmsNorm;
    n.size_key = "normalized_shape";
    n.weight = true;
    n.bias = false;
  } else {
    n.norm_type = "layer_norm";
    n.kind = norms::Kind::kLayerNorm;
    n.size_key = "normalized_shape";
    n.weight = n.bias = true;
  }
  c.attention_norm_config = c.ffn_norm_config = c.lm_head_norm_config = n;
  return c;
}

/// model/huggingface_pretrained_model: Modalities' keys; see README.md.
struct HuggingFacePretrainedConfig {
  std::string model_type;
  std::filesystem::path model_name;
  std::string prediction_key;
  std::string huggingface_prediction_subscription_key;
  std::string sample_key;
  FromPretrainedArgs model_args;
  FromPretrainedKwargs kwargs;
  double dropout = 0.0;
  std::optional<std::int64_t> sequence_length;
  std::string attention_implementation = "pytorch_flash";
  static void describe(Schema<HuggingFacePretrainedConfig>& s) {
    using C = HuggingFacePretrainedConfig;
    s.field("model_type", &C::model_type, "AutoModelForCausalLM (AutoModelForMaskedLM is not supported).")
        .required()
        .one_of({"AutoModelForCausalLM", "AutoModelForMaskedLM"});
    s.field("model_name", &C::model_name,
            "A local Hugging Face folder (config.json + model.safetensors or sharded safetensors with "
            "model.safetensors.index.json). Hub ids are not downloaded: fetch the folder first (e.g. "
            "`huggingface-cli download <id> --local-dir <dir>`).")
        .required();
    s.field("prediction_key", &C::prediction_key, "Key of the logits [B, T, V] in the output map.").required();
    s.field("huggingface_prediction_subscription_key", &C::huggingface_prediction_subscription_key,
            "The field of transformers' output to return; only \"logits\" exists here.")
        .required()
        .one_of({"logits"});
    s.field("sample_key", &C::sample_key, "Key of the token ids [B, T] in the input map.").required();
    s.field("model_args", &C::model_args, "Extra positional arguments of from_pretrained: must be null or empty.");
    s.field("kwargs", &C::kwargs,
            "Extra keyword arguments of from_pretrained: null or a table with torch_dtype/dtype (\"float32\" only: "
            "parameters are float32 master weights; use model/mixed_precision or FSDP's mixed precision for bf16).");
    s.field("dropout", &C::dropout,
            "Ours: model/gpt2's dropout for the imported model (embeddings, attention probabilities in every mode, "
            "residuals); default 0. The Hugging Face config's dropout rates are not taken over.")
        .in_closed(0.0, 1.0);
    s.field("sequence_length", &C::sequence_length,
            "Ours: maximum input length of a RoPE model; default max_position_embeddings (an export writes it back "
            "as max_position_embeddings). GPT-2's is n_positions, the size of its position table: leave it out.")
        .at_least(1);
    s.field("attention_implementation", &C::attention_implementation, "Ours: manual or pytorch_flash (default).")
        .one_of({"manual", "pytorch_flash"});
  }
};

std::shared_ptr<Module> load_huggingface(const HuggingFacePretrainedConfig& c) {
  if (c.model_type != "AutoModelForCausalLM")
    throw ConfigError("model_type", "AutoModelForMaskedLM (encoder models such as BERT) is not supported: model/gpt2 "
                                    "is a causal decoder; use AutoModelForCausalLM");
  const std::filesystem::path folder = c.model_name;
  if (!std::filesystem::is_directory(folder))
    throw ConfigError("model_name",
                      fmt::format("'{}' is not a folder. Hub ids are not downloaded here: fetch the model first "
                                  "(e.g. `huggingface-cli download {} --local-dir <dir>`) and give the folder",
                                  folder.string(), folder.string()));
  hf::ImportedConfig imported = hf::read_config(folder);
  imported.spec.dropout = c.dropout;
  GPT2Config g = config_from_spec(imported.spec);
  g.sample_key = c.sample_key;
  g.prediction_key = c.prediction_key;
  g.attention_implementation = c.attention_implementation;
  if (c.sequence_length) {
    if (imported.spec.absolute_positions && *c.sequence_length != g.sequence_length)
      throw ConfigError("sequence_length",
                        fmt::format("GPT-2's position table has n_positions = {} rows, which is its maximum input "
                                    "length; leave sequence_length out (got {})",
                                    g.sequence_length, *c.sequence_length));
    g.sequence_length = *c.sequence_length;
  }
  auto model = std::make_shared<GPT2>(g, run_device());
  StateDict live = model->state_dict();
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (const auto& [name, t] : live) shapes[name] = t.sizes().vec();
  StateDict weights = hf::to_modalities(imported, formats::read_huggingface_weights(folder), shapes, folder.string());
  for (const auto& [name, t] : live)  // RoPE tables: model/gpt2 computes them (transformers does not store them)
    if (name.ends_with(".inv_freq")) weights.emplace(name, t);
  model->load_state_dict(weights, /*strict=*/true);
  return model;
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
        return std::make_shared<GPT2>(c, c.use_meta_device.value_or(false) ? c10::Device(c10::kMeta) : run_device());
      });
  r.add<Module, HuggingFacePretrainedConfig>(
      "huggingface_pretrained_model",
      "A Hugging Face causal LM folder (Llama 2/3, Mistral, Qwen2, GPT-2; safetensors) loaded into model/gpt2, to "
      "continue pre-training or to generate; its state dict, checkpoints and wrappers are model/gpt2's.",
      load_huggingface);
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
