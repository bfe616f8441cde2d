// Hugging Face interop of model/gpt2 (README.md, "Hugging Face interop"): its config <-> the neutral
// decoder description of huggingface.h, and model/huggingface_pretrained_model.
#include "config.h"
#include "huggingface.h"
#include "model.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/safetensors.h>
#include <modalities/sdk/run_context.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace modalities::plugins::gpt2 {

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
  if (c.explicit_head_dim && c.n_embd % c.n_head_q == 0 && *c.explicit_head_dim == c.n_embd / c.n_head_q)
    s.head_dim = 0;
  else s.head_dim = c.explicit_head_dim.value_or(0);
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
  if (const auto& qk = c.attention_config.qk_norm_config) {
    if (!c.attention_config.qk_norm_before_transforms())
      why.push_back(
          "qk_norm_config after the transforms (Modalities normalizes q and k after RoPE; no transformers family "
          "does; Qwen3 normalizes before: qk_norm_position = \"before_transforms\")");
    else if (kind(*qk) != "rms_norm" || qk->eps != s.norm_eps)
      why.push_back("a qk-norm other than the model's RMSNorm with the same eps (Qwen3 uses rms_norm_eps for all)");
    s.qk_norm = true;
  }
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
    t.rope.n_embd = s.n_head_q * s.head_size();
    t.rope.n_head = s.n_head_q;
    t.rope.seq_length_dim = -2;
    t.rope.base_freq = s.rope_theta;
    if (s.rope_scaling)
      t.rope.rope_scaling =
          RopeScalingConfig{s.rope_scaling->rope_type, s.rope_scaling->factor, s.rope_scaling->low_freq_factor,
                            s.rope_scaling->high_freq_factor, s.rope_scaling->original_max_position_embeddings};
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
  if (s.head_dim > 0) c.explicit_head_dim = s.head_dim;
  if (s.qk_norm) {
    NormWrapperConfig qk = n;
    qk.size = s.head_size();
    c.attention_config.qk_norm_config = qk;
    c.attention_config.qk_norm_position = "before_transforms";
  }
  return c;
}

hf::ImportedConfig read_huggingface_config(const HuggingFacePretrainedConfig& c) {
  if (c.model_type != "AutoModelForCausalLM")
    throw ConfigError("model_type",
                      "AutoModelForMaskedLM (encoder models such as BERT) is not supported: model/gpt2 "
                      "is a causal decoder; use AutoModelForCausalLM");
  const std::filesystem::path folder = c.model_name;
  if (!std::filesystem::is_directory(folder))
    throw ConfigError("model_name",
                      fmt::format("'{}' is not a folder. Hub ids are not downloaded here: fetch the model first "
                                  "(e.g. `huggingface-cli download {} --local-dir <dir>`) and give the folder",
                                  folder.string(), folder.string()));
  return hf::read_config(folder);
}

std::shared_ptr<Module> load_huggingface(const HuggingFacePretrainedConfig& c, hf::ImportedConfig imported,
                                         const MoeModelFactory& moe) {
  const std::filesystem::path folder = c.model_name;
  if (imported.spec.moe && !moe)
    throw Error(fmt::format("{}: {} is a Mixture-of-Experts family, which model/gpt2_moe (plugins/moe) imports",
                            folder.string(), imported.model_type));
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
  std::shared_ptr<Module> model =
      imported.spec.moe ? moe(g, *imported.spec.moe, run_device()) : make_gpt2(g, run_device());
  StateDict live = model->state_dict();
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (const auto& [name, t] : live) shapes[name] = t.sizes().vec();
  StateDict weights = hf::to_modalities(imported, formats::read_huggingface_weights(folder), shapes, folder.string());
  for (const auto& [name, t] : live)  // RoPE tables: model/gpt2 computes them (transformers does not store them)
    if (name.ends_with(".inv_freq")) weights.emplace(name, t);
  model->load_state_dict(weights, /*strict=*/true);
  return model;
}

}  // namespace modalities::plugins::gpt2
