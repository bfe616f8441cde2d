// Hugging Face transformers architectures <-> model/gpt2 (README.md, "Hugging Face interop").
// DecoderSpec describes a decoder-only transformer in neutral terms; this file maps it and its
// weights to and from the transformers families model/gpt2 can express: Llama (2/3, RoPE
// scaling), Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (qk-norm before RoPE), GPT-2,
// and the Mixture-of-Experts families Mixtral, Qwen2-MoE and Qwen3-MoE, whose feed-forward
// model/gpt2_moe (plugins/moe) computes. pretrained.cpp converts between DecoderSpec and its own
// config.
#pragma once

#include <modalities/sdk/huggingface.h>
#include <modalities/sdk/interfaces/batch.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace modalities::plugins::gpt2::hf {

struct RopeScaling {
  std::string rope_type;  // "linear" | "llama3"
  double factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  std::int64_t original_max_position_embeddings = 8192;
};

/// The Mixture-of-Experts feed-forward of the transformers MoE families (Mixtral, Qwen2-MoE,
/// Qwen3-MoE): softmax top-k routing over SwiGLU experts, optionally a sigmoid-gated shared
/// expert; model/gpt2_moe (plugins/moe) computes it.
struct MoeSpec {
  std::int64_t num_experts = 0, top_k = 0, expert_hidden = 0;
  bool norm_topk_prob = true;
  std::int64_t shared_hidden = 0;  // the shared expert's hidden size (0: none)
  bool shared_gate = false;        // its sigmoid gate (Qwen2-MoE)
  std::int64_t decoder_sparse_step = 1;
  std::vector<std::int64_t> mlp_only_layers;
  double aux_loss_coef = 0.0;  // router_aux_loss_coef when output_router_logits, else 0
  /// transformers' rule: block `layer` is MoE unless listed in mlp_only_layers or
  /// (layer + 1) % decoder_sparse_step != 0.
  bool is_moe_layer(std::int64_t layer) const;
};

struct DecoderSpec {
  bool absolute_positions = false;  // learned position table (GPT-2); otherwise RoPE
  std::int64_t max_positions = 0, vocab_size = 0, n_layer = 0, n_head_q = 0, n_head_kv = 0, n_embd = 0;
  std::int64_t mlp_hidden = 0;
  std::string activation;  // "swiglu" | "gelu" | "gelu_tanh"
  std::string norm;        // "rms_norm" | "layer_norm" (with weight and bias)
  double norm_eps = 1e-5;
  bool qkv_bias = false, attn_proj_bias = false, mlp_bias = false;
  std::int64_t rope_theta = 10000;
  std::optional<RopeScaling> rope_scaling;
  std::optional<std::int64_t> sliding_window;
  bool tie_word_embeddings = false;
  double dropout = 0.0;
  std::int64_t head_dim = 0;  // 0: n_embd / n_head_q
  bool qk_norm = false;       // RMSNorm of every q and k head before RoPE (Qwen3), eps norm_eps
  std::optional<MoeSpec> moe;

  std::int64_t head_size() const { return head_dim > 0 ? head_dim : n_embd / n_head_q; }
};

/// The architecture of a Hugging Face folder, from its config.json.
struct ImportedConfig {
  std::string model_type;    // "llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe"
  std::string architecture;  // "LlamaForCausalLM", ...
  DecoderSpec spec;
};

/// Reads `<folder>/config.json`. Throws modalities::Error naming the file and the key for an
/// architecture or setting model/gpt2 cannot express.
ImportedConfig read_config(const std::filesystem::path& folder);

/// transformers' tensors (by their names) -> model/gpt2's state dict (without RoPE buffers).
/// `expected` holds model/gpt2's shapes; every tensor must be used and every expected one found.
StateDict to_modalities(const ImportedConfig& config, const StateDict& hf,
                        const std::map<std::string, std::vector<std::int64_t>>& expected, const std::string& folder);

/// model/gpt2's state dict -> a transformers checkpoint (architecture chosen from the spec:
/// GPT-2 for learned positions, otherwise Mistral with a sliding window, Qwen2 with biases on
/// q/k/v only, Llama for the rest). Throws modalities::Error when nothing fits.
HuggingFaceCheckpoint to_huggingface(const DecoderSpec& spec, const StateDict& ours,
                                     const HuggingFaceExportOptions& options);

}  // namespace modalities::plugins::gpt2::hf
