// model/gpt2's configuration (README.md, "`model/gpt2` config"), and model/huggingface_pretrained_model's:
// the config structs, their schemas and checks. The tagged unions norm_type / type_hint are the SDK's
// TaggedUnion (modalities/sdk/tagged_union.h); their alternatives are in config.cpp.
#pragma once

#include <modalities/sdk/norms.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/tagged_union.h>

#include <fmt/format.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace modalities::plugins::gpt2 {

namespace hf {
struct DecoderSpec;
}  // namespace hf

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
        ctx.fail("high_freq_factor",
                 fmt::format("must exceed low_freq_factor ({}), got {}", c.low_freq_factor, c.high_freq_factor));
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

// Modalities' two tagged unions of the GPT-2 config (config.cpp).
const TaggedUnion<NormWrapperConfig>& norm_union();
const TaggedUnion<QkvTransformConfig>& qkv_transform_union();

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
      } else if (!item.is_string() ||
                 (item.as_string() != "float32" && item.as_string() != "torch.float32" && item.as_string() != "auto")) {
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

struct AttentionConfig {
  std::vector<QkvTransformConfig> qkv_transforms;
  std::optional<NormWrapperConfig> qk_norm_config;
  std::string qk_norm_position = "after_transforms";
  std::optional<std::int64_t> sliding_window;
  bool qk_norm_before_transforms() const { return qk_norm_config && qk_norm_position == "before_transforms"; }
  static void describe(Schema<AttentionConfig>& s) {
    s.field("qkv_transforms", &AttentionConfig::qkv_transforms,
            "Transforms applied in order to (q, k, v) after the head split: IdentityTransform or RotaryTransform "
            "(RoPE, half-split convention).")
        .required();
    s.field("qk_norm_config", &AttentionConfig::qk_norm_config,
            "Optional norm applied per head (size = head dim) to q and k, after the transforms (Modalities) or "
            "before them (qk_norm_position).");
    s.field("qk_norm_position", &AttentionConfig::qk_norm_position,
            "Ours: where qk_norm_config normalizes q and k: after_transforms (Modalities: after RoPE) or "
            "before_transforms (Qwen3, Qwen3-MoE: before RoPE).")
        .one_of({"after_transforms", "before_transforms"});
    s.field("sliding_window", &AttentionConfig::sliding_window,
            "Ours: sliding-window attention (Mistral): position i attends to j with i - window < j <= i. "
            "null: full causal attention (Modalities).")
        .at_least(1);
  }
};

inline std::int64_t swiglu_hidden(std::int64_t ffn_hidden, std::int64_t multiple) {
  // Python: int(2 * ffn_hidden / 3) (float division, truncation), then round up to `multiple`.
  const auto a = static_cast<std::int64_t>(2.0 * static_cast<double>(ffn_hidden) / 3.0);
  return ((a + multiple - 1) / multiple) * multiple;
}

struct GPT2Config;

/// A member of GPT2Config as a member of C (GPT2Config or a config derived from it), for
/// Schema<C>::field, which deduces the member's type from `T C::*`.
template <class C, class T>
constexpr T C::*field_of(T GPT2Config::*member) {
  return member;
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
  std::optional<std::int64_t> explicit_head_dim;  // config key head_dim
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
  std::optional<std::string> document_ids_key;
  std::string document_positions = "continue";

  /// The width of one attention head: head_dim, or n_embd / n_head_q.
  std::int64_t head_dim() const { return explicit_head_dim.value_or(n_head_q > 0 ? n_embd / n_head_q : 0); }
  /// The width of all query heads together (q_attn's output, c_proj's input).
  std::int64_t attention_width() const { return n_head_q * head_dim(); }
  bool qkv_bias_on() const { return qkv_bias.value_or(bias); }
  bool attn_proj_bias_on() const { return attn_proj_bias.value_or(bias); }
  bool mlp_bias_on() const { return mlp_bias.value_or(bias); }
  bool gelu() const { return activation_type == "gelu" || activation_type == "gelu_tanh"; }

  static void describe(Schema<GPT2Config>& s) { describe_fields(s); }

  // The fields and checks of model/gpt2, for its config and for configs that extend it
  // (model/gpt2_moe's Gpt2MoeConfig derives from GPT2Config).
  template <class C>
  static void describe_fields(Schema<C>& s) {
    s.field("sample_key", field_of<C>(&GPT2Config::sample_key), "Key of the token-id tensor [B, T] in the input map.")
        .required();
    s.field("prediction_key", field_of<C>(&GPT2Config::prediction_key),
            "Key of the logits [B, T, V] in the output map.")
        .required();
    s.field("use_meta_device", field_of<C>(&GPT2Config::use_meta_device),
            "Build parameters on the meta device (no storage); materialize with to(device) and initialize with "
            "model/model_initialized. Not allowed with use_weight_tying.");
    s.field("poe_type", field_of<C>(&GPT2Config::poe_type),
            "Position encoding: ABSOLUTE (learned table wpe[sequence_length, n_embd]) or NOPE (none; use RoPE).")
        .required()
        .one_of({"ABSOLUTE", "NOPE"});
    s.field("sequence_length", field_of<C>(&GPT2Config::sequence_length), "Maximum input length T.")
        .required()
        .at_least(1);
    s.field("vocab_size", field_of<C>(&GPT2Config::vocab_size), "Vocabulary size; divisible by 128.")
        .required()
        .at_least(1);
    s.field("n_layer", field_of<C>(&GPT2Config::n_layer), "Number of GPT2Block layers.").required().at_least(1);
    s.field("n_head_q", field_of<C>(&GPT2Config::n_head_q),
            "Query heads; n_embd must be divisible by it unless head_dim is given.")
        .required()
        .at_least(1);
    s.field("n_head_kv", field_of<C>(&GPT2Config::n_head_kv),
            "Key/value heads (grouped-query attention); must divide n_head_q (equal: multi-head attention).")
        .required()
        .at_least(1);
    s.field("n_embd", field_of<C>(&GPT2Config::n_embd), "Model width d; divisible by 128.").required().at_least(1);
    s.field("head_dim", field_of<C>(&GPT2Config::explicit_head_dim),
            "Ours: the width of one attention head, when it is not n_embd / n_head_q (Qwen3, Mistral-Nemo): q_attn "
            "then maps n_embd to n_head_q * head_dim and c_proj back. null: n_embd / n_head_q (Modalities).")
        .at_least(1);
    s.field("ffn_hidden", field_of<C>(&GPT2Config::ffn_hidden),
            "MLP hidden size (GELU uses it as is; SwiGLU uses ceil_to_multiple(int(2*ffn_hidden/3), "
            "enforce_swiglu_hidden_dim_multiple_of)); divisible by 128.")
        .required()
        .at_least(1);
    s.field("dropout", field_of<C>(&GPT2Config::dropout),
            "Dropout probability: embeddings, attention probabilities (in every mode, as in Modalities), residual "
            "after c_proj, GELU-MLP output.")
        .required()
        .in_closed(0.0, 1.0);
    s.field("bias", field_of<C>(&GPT2Config::bias),
            "Bias on every attention and MLP linear layer (lm_head never has one).")
        .required();
    s.field("qkv_bias", field_of<C>(&GPT2Config::qkv_bias),
            "Ours: bias on q_attn/k_attn/v_attn only (Qwen2 has them, its other linears not); null: `bias`.");
    s.field("attn_proj_bias", field_of<C>(&GPT2Config::attn_proj_bias), "Ours: bias on attn.c_proj; null: `bias`.");
    s.field("mlp_bias", field_of<C>(&GPT2Config::mlp_bias), "Ours: bias on the MLP linears; null: `bias`.");
    s.field("attention_config", field_of<C>(&GPT2Config::attention_config),
            "qkv_transforms and optional qk_norm_config.")
        .required();
    s.field("attention_implementation", field_of<C>(&GPT2Config::attention_implementation),
            "manual (explicit softmax(q k^T / sqrt(hd)) v) or pytorch_flash (at::scaled_dot_product_attention); "
            "dao_flash is not available in this build.")
        .required()
        .one_of({"manual", "pytorch_flash", "dao_flash"});
    s.field("activation_type", field_of<C>(&GPT2Config::activation_type),
            "MLP: gelu (c_fc, exact GELU, c_proj), gelu_tanh (ours: tanh-approximated GELU, GPT-2's gelu_new) or "
            "swiglu (W, V, W_2).")
        .required()
        .one_of({"gelu", "gelu_tanh", "swiglu"});
    s.field("attention_norm_config", field_of<C>(&GPT2Config::attention_norm_config),
            "Norm before attention (size n_embd).")
        .required();
    s.field("ffn_norm_config", field_of<C>(&GPT2Config::ffn_norm_config), "Norm before the MLP (size n_embd).")
        .required();
    s.field("lm_head_norm_config", field_of<C>(&GPT2Config::lm_head_norm_config),
            "Final norm before lm_head (size n_embd).")
        .required();
    s.field("use_weight_tying", field_of<C>(&GPT2Config::use_weight_tying),
            "Share transformer.wte.weight with transformer.lm_head.weight.")
        .required();
    s.field("seed", field_of<C>(&GPT2Config::seed),
            "If set, the global RNG is seeded with it before the modules are created.");
    s.field("enforce_swiglu_hidden_dim_multiple_of", field_of<C>(&GPT2Config::enforce_swiglu_hidden_dim_multiple_of),
            "SwiGLU hidden size is rounded up to a multiple of this.")
        .at_least(1);
    s.field("document_ids_key", field_of<C>(&GPT2Config::document_ids_key),
            "Ours: the model input holding each token's document within its packed sample ([B, T] integers, equal "
            "for the tokens of one document; collate_fn/document_masking_collator_wrapper writes it). When the "
            "input has it, attention stays inside each token's document (block-diagonal causal); without it (or "
            "null) every token attends to all earlier tokens of its sample.");
    s.field("document_positions", field_of<C>(&GPT2Config::document_positions),
            "Ours, with document_ids_key: positions (RoPE, ABSOLUTE) continue across the documents of a sample "
            "(continue) or restart at 0 at each document (restart).")
        .one_of({"continue", "restart"});
    s.rule([](const C& c, ParseContext& ctx) { validate(c, ctx); });
  }

  static void check_norm(const NormWrapperConfig& n, const std::string& key, std::int64_t expected,
                         const std::string& what, ParseContext& ctx);
  static void validate(const GPT2Config& c, ParseContext& ctx);
};

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

// Hugging Face interop (pretrained.cpp): model/gpt2's config <-> the neutral decoder description of
// huggingface.h. spec_from_config throws modalities::Error naming what has no transformers counterpart.
hf::DecoderSpec spec_from_config(const GPT2Config& c);
GPT2Config config_from_spec(const hf::DecoderSpec& s);

}  // namespace modalities::plugins::gpt2
