// Hugging Face transformers architectures <-> model/gpt2; see huggingface.h and README.md,
// "Hugging Face interop". The names and conventions are transformers 4.57's
// (models/{llama,mistral,qwen2,qwen3,gpt2,mixtral,qwen2_moe,qwen3_moe}); tests/huggingface_test.cpp
// and plugins/moe/tests check logits against transformers on tiny models that
// scripts/reference/make_hf_fixtures.py wrote.
#include "huggingface.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/jsonl.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <simdjson.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <set>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

namespace modalities::plugins::gpt2::hf {
namespace fs = std::filesystem;

bool MoeSpec::is_moe_layer(std::int64_t layer) const {
  if ((layer + 1) % decoder_sparse_step != 0) return false;
  return std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) == mlp_only_layers.end();
}

namespace {

// ---------------------------------------------------------------------------------------------
// config.json reading
// ---------------------------------------------------------------------------------------------

class ConfigReader {
 public:
  explicit ConfigReader(fs::path file) : file_(std::move(file)) {
    if (!fs::is_regular_file(file_))
      throw Error(
          fmt::format("{}: no such file (a Hugging Face model folder has config.json next to its "
                      "model.safetensors)",
                      file_.string()));
    if (parser_.load(file_.string()).get(root_) || !root_.is_object())
      throw Error(fmt::format("{}: not a JSON object", file_.string()));
    refuse_duplicate_keys(root_, "");
  }
  Error error(const std::string& key, const std::string& what) const {
    return Error(fmt::format("{}: '{}' {}", file_.string(), key, what));
  }
  bool has(const std::string& key) const {
    simdjson::dom::element e;
    return !root_[key].get(e) && !e.is_null();
  }
  simdjson::dom::element get(const std::string& key) const {
    simdjson::dom::element e;
    if (root_[key].get(e) || e.is_null()) throw error(key, "is missing");
    return e;
  }
  std::int64_t integer(const std::string& key, std::optional<std::int64_t> fallback = std::nullopt) const {
    if (!has(key)) {
      if (fallback) return *fallback;
      throw error(key, "is missing (an integer)");
    }
    std::int64_t v = 0;
    if (get(key).get_int64().get(v)) throw error(key, "must be an integer");
    return v;
  }
  double number(const std::string& key, std::optional<double> fallback = std::nullopt) const {
    if (!has(key)) {
      if (fallback) return *fallback;
      throw error(key, "is missing (a number)");
    }
    return as_number(get(key), key);
  }
  double as_number(simdjson::dom::element e, const std::string& key) const {
    double d = 0;
    std::int64_t i = 0;
    if (!e.get_double().get(d)) return d;
    if (!e.get_int64().get(i)) return static_cast<double>(i);
    throw error(key, "must be a number");
  }
  bool boolean(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    bool b = false;
    if (get(key).get_bool().get(b)) throw error(key, "must be true or false");
    return b;
  }
  std::string string(const std::string& key, std::optional<std::string> fallback = std::nullopt) const {
    if (!has(key)) {
      if (fallback) return *fallback;
      throw error(key, "is missing (a string)");
    }
    std::string_view s;
    if (get(key).get_string().get(s)) throw error(key, "must be a string");
    return std::string(s);
  }
  /// A list of integers or strings (T = std::int64_t or std::string); missing or null: empty.
  template <class T>
  std::vector<T> list(const std::string& key) const {
    std::vector<T> out;
    if (!has(key)) return out;
    const char* what =
        std::is_same_v<T, std::string> ? "must be a list of strings or null" : "must be a list of integers or null";
    simdjson::dom::array a;
    if (get(key).get_array().get(a)) throw error(key, what);
    for (const auto e : a) {
      std::conditional_t<std::is_same_v<T, std::string>, std::string_view, std::int64_t> v{};
      if (e.get(v)) throw error(key, what);
      out.emplace_back(v);
    }
    return out;
  }
  const fs::path& file() const { return file_; }
  /// Whether `key` is there with the value null (has() treats null as absent).
  bool is_null(const std::string& key) const {
    simdjson::dom::element e;
    return !root_[key].get(e) && e.is_null();
  }

 private:
  // simdjson finds the first of two equal keys, Python's json (transformers) keeps the last: a file
  // with a key twice would be read differently here, so it is refused, naming the key.
  void refuse_duplicate_keys(simdjson::dom::element e, const std::string& path) const {
    if (simdjson::dom::object o; !e.get_object().get(o)) {
      std::set<std::string_view> seen;
      for (const auto [key, value] : o) {
        const std::string where = path.empty() ? std::string(key) : path + "." + std::string(key);
        if (!seen.insert(key).second)
          throw error(where, "appears twice (transformers would take the last value, this reader the first); keep one");
        refuse_duplicate_keys(value, where);
      }
    } else if (simdjson::dom::array a; !e.get_array().get(a)) {
      std::size_t i = 0;
      for (const auto value : a) refuse_duplicate_keys(value, fmt::format("{}[{}]", path, i++));
    }
  }

  fs::path file_;
  simdjson::dom::parser parser_;
  simdjson::dom::element root_;
};

std::int64_t positive(const ConfigReader& r, const std::string& key, std::optional<std::int64_t> fallback = {}) {
  const std::int64_t v = r.integer(key, fallback);
  if (v < 1) throw r.error(key, fmt::format("must be at least 1, got {}", v));
  return v;
}

std::int64_t rope_theta(const ConfigReader& r) {
  if (r.is_null("rope_theta")) throw r.error("rope_theta", "is null (transformers refuses it); give the RoPE base");
  const double theta = r.number("rope_theta", 10000.0);
  if (!(theta >= 1.0) || theta != std::floor(theta) || theta > 1e15)
    throw r.error("rope_theta", fmt::format("must be a whole number (model/gpt2's RotaryTransform base_freq is an "
                                            "integer), got {}",
                                            theta));
  return static_cast<std::int64_t>(theta);
}

std::optional<RopeScaling> rope_scaling(const ConfigReader& r) {
  if (!r.has("rope_scaling")) return std::nullopt;
  simdjson::dom::object o;
  if (r.get("rope_scaling").get_object().get(o)) throw r.error("rope_scaling", "must be an object or null");
  const auto field = [&](const char* key) -> std::optional<simdjson::dom::element> {
    simdjson::dom::element e;
    if (o[key].get(e) || e.is_null()) return std::nullopt;
    return e;
  };
  std::string_view type;
  auto t = field("rope_type");
  if (const auto legacy = field("type"); t && legacy) {
    std::string_view a, b;
    if (t->get_string().get(a) || legacy->get_string().get(b) || a != b)
      throw r.error("rope_scaling", "has both 'rope_type' and the older 'type', and they differ; keep one");
  }
  if (!t) t = field("type");
  if (!t || t->get_string().get(type)) throw r.error("rope_scaling.rope_type", "is missing (a string)");
  if (type == "default") return std::nullopt;
  if (type != "linear" && type != "llama3")
    throw r.error("rope_scaling.rope_type",
                  fmt::format("is '{}'; model/gpt2 implements 'linear' and 'llama3' RoPE scaling (not dynamic, yarn, "
                              "longrope)",
                              type));
  RopeScaling s;
  s.rope_type = std::string(type);
  const auto num = [&](const char* key, std::optional<double> fallback) {
    const auto e = field(key);
    if (!e) {
      if (fallback) return *fallback;
      throw r.error(fmt::format("rope_scaling.{}", key), "is missing (a number)");
    }
    return r.as_number(*e, fmt::format("rope_scaling.{}", key));
  };
  s.factor = num("factor", std::nullopt);
  if (!(s.factor > 0)) throw r.error("rope_scaling.factor", "must be positive");
  if (s.rope_type == "llama3") {
    s.low_freq_factor = num("low_freq_factor", std::nullopt);
    s.high_freq_factor = num("high_freq_factor", std::nullopt);
    s.original_max_position_embeddings =
        static_cast<std::int64_t>(num("original_max_position_embeddings", std::nullopt));
    if (!(s.high_freq_factor > s.low_freq_factor && s.low_freq_factor > 0))
      throw r.error("rope_scaling", "needs 0 < low_freq_factor < high_freq_factor");
  }
  return s;
}

MoeSpec read_moe(const ConfigReader& r, const ImportedConfig& c) {
  const DecoderSpec& s = c.spec;
  MoeSpec m;
  if (c.model_type == "mixtral") {
    m.num_experts = positive(r, "num_local_experts");
    m.expert_hidden = s.mlp_hidden;  // Mixtral's intermediate_size is the experts' (every block is MoE)
    m.norm_topk_prob = true;
    if (r.number("router_jitter_noise", 0.0) != 0.0)
      throw r.error("router_jitter_noise", "must be 0: model/gpt2_moe's router has no training-time jitter");
  } else {
    m.num_experts = positive(r, "num_experts");
    m.expert_hidden = positive(r, "moe_intermediate_size");
    m.norm_topk_prob = r.boolean("norm_topk_prob", false);
    m.decoder_sparse_step = positive(r, "decoder_sparse_step", 1);
    m.mlp_only_layers = r.list<std::int64_t>("mlp_only_layers");
    for (const std::int64_t layer : m.mlp_only_layers)
      if (layer < 0 || layer >= s.n_layer)
        throw r.error("mlp_only_layers",
                      fmt::format("has {}, which is not a layer (num_hidden_layers = {})", layer, s.n_layer));
    if (c.model_type == "qwen2_moe") {
      m.shared_hidden = positive(r, "shared_expert_intermediate_size");
      m.shared_gate = true;
    }
  }
  m.top_k = positive(r, "num_experts_per_tok");
  if (m.top_k > m.num_experts)
    throw r.error("num_experts_per_tok", fmt::format("is {}, more than the {} experts", m.top_k, m.num_experts));
  if (r.boolean("output_router_logits", false)) m.aux_loss_coef = r.number("router_aux_loss_coef", 0.001);
  if (m.aux_loss_coef < 0) throw r.error("router_aux_loss_coef", "must not be negative");
  bool any = false;
  for (std::int64_t i = 0; i < s.n_layer; ++i) any = any || m.is_moe_layer(i);
  if (!any)
    throw r.error("mlp_only_layers",
                  "and decoder_sparse_step leave no MoE layer: the model is dense; give it as a dense family");
  return m;
}

ImportedConfig read_llama_like(const ConfigReader& r, const std::string& model_type) {
  ImportedConfig c;
  c.model_type = model_type;
  DecoderSpec& s = c.spec;
  s.vocab_size = positive(r, "vocab_size");
  s.n_embd = positive(r, "hidden_size");
  s.mlp_hidden = positive(r, "intermediate_size");
  s.n_layer = positive(r, "num_hidden_layers");
  s.n_head_q = positive(r, "num_attention_heads");
  s.n_head_kv = positive(r, "num_key_value_heads", s.n_head_q);
  s.max_positions = positive(r, "max_position_embeddings");
  s.norm = "rms_norm";
  s.norm_eps = r.number("rms_norm_eps", 1e-6);
  s.activation = "swiglu";
  s.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  s.rope_theta = rope_theta(r);
  s.rope_scaling = rope_scaling(r);
  if (const std::string act = r.string("hidden_act", "silu"); act != "silu")
    throw r.error("hidden_act", fmt::format("is '{}'; model/gpt2's SwiGLU uses silu", act));
  if (s.n_head_q % s.n_head_kv != 0)
    throw r.error("num_key_value_heads",
                  fmt::format("must divide num_attention_heads ({}), got {}", s.n_head_q, s.n_head_kv));
  // The head width: head_dim where config.json has it (Qwen3Config's default is 128, the others'
  // hidden_size / num_attention_heads); model/gpt2's head_dim key when it differs from that.
  const std::int64_t even_split = s.n_embd % s.n_head_q == 0 ? s.n_embd / s.n_head_q : 0;
  const std::int64_t head = r.has("head_dim") ? positive(r, "head_dim") : (model_type == "qwen3" ? 128 : even_split);
  if (head == 0)
    throw r.error(
        "num_attention_heads",
        fmt::format("must divide hidden_size ({}) when config.json has no head_dim, got {}", s.n_embd, s.n_head_q));
  if (model_type == "qwen2_moe" && head != even_split)
    throw r.error("head_dim", fmt::format("is {}; Qwen2-MoE's heads are hidden_size / num_attention_heads = {} wide "
                                          "(transformers refuses others)",
                                          head, even_split));
  if (head % 2 != 0) throw r.error(r.has("head_dim") ? "head_dim" : "hidden_size", "RoPE needs an even head dim");
  s.head_dim = head == even_split ? 0 : head;
  if (r.has("partial_rotary_factor") && r.number("partial_rotary_factor") != 1.0)
    throw r.error("partial_rotary_factor", "must be 1 (model/gpt2 rotates the whole head)");
  const auto no_layer_windows = [&](const char* family) {
    if (r.boolean("use_sliding_window", false))
      throw r.error("use_sliding_window",
                    fmt::format("is true: {} then uses sliding windows in some layers only (max_window_layers); "
                                "model/gpt2 has one attention pattern for every layer",
                                family));
    for (const std::string& t : r.list<std::string>("layer_types"))
      if (t != "full_attention")
        throw r.error("layer_types", fmt::format("has '{}'; model/gpt2 has full causal attention in every layer", t));
  };
  if (model_type == "llama") {
    s.qkv_bias = s.attn_proj_bias = r.boolean("attention_bias", false);
    s.mlp_bias = r.boolean("mlp_bias", false);
    c.architecture = "LlamaForCausalLM";
  } else if (model_type == "mistral" || model_type == "mixtral") {
    if (r.has("sliding_window")) s.sliding_window = positive(r, "sliding_window");
    c.architecture = model_type == "mistral" ? "MistralForCausalLM" : "MixtralForCausalLM";
  } else if (model_type == "qwen2") {
    s.qkv_bias = true;
    no_layer_windows("Qwen2");
    c.architecture = "Qwen2ForCausalLM";
  } else if (model_type == "qwen2_moe") {
    s.qkv_bias = r.boolean("qkv_bias", true);
    no_layer_windows("Qwen2-MoE");
    c.architecture = "Qwen2MoeForCausalLM";
  } else if (model_type == "qwen3") {
    s.qkv_bias = s.attn_proj_bias = r.boolean("attention_bias", false);
    s.qk_norm = true;
    no_layer_windows("Qwen3");
    c.architecture = "Qwen3ForCausalLM";
  } else {  // qwen3_moe: with use_sliding_window, every layer has the window
    s.qkv_bias = s.attn_proj_bias = r.boolean("attention_bias", false);
    s.qk_norm = true;
    if (r.boolean("use_sliding_window", false)) s.sliding_window = positive(r, "sliding_window");
    c.architecture = "Qwen3MoeForCausalLM";
  }
  if (model_type == "mixtral" || model_type == "qwen2_moe" || model_type == "qwen3_moe") s.moe = read_moe(r, c);
  return c;
}

ImportedConfig read_gpt2(const ConfigReader& r) {
  ImportedConfig c;
  c.model_type = "gpt2";
  c.architecture = "GPT2LMHeadModel";
  DecoderSpec& s = c.spec;
  s.absolute_positions = true;
  s.vocab_size = positive(r, "vocab_size");
  s.max_positions = positive(r, "n_positions");
  s.n_embd = positive(r, "n_embd");
  s.n_layer = positive(r, "n_layer");
  s.n_head_q = s.n_head_kv = positive(r, "n_head");
  s.mlp_hidden = r.has("n_inner") ? positive(r, "n_inner") : 4 * s.n_embd;
  s.norm = "layer_norm";
  s.norm_eps = r.number("layer_norm_epsilon", 1e-5);
  s.qkv_bias = s.attn_proj_bias = s.mlp_bias = true;
  s.tie_word_embeddings = r.boolean("tie_word_embeddings", true);
  const std::string act = r.string("activation_function", "gelu_new");
  if (act == "gelu_new" || act == "gelu_pytorch_tanh") s.activation = "gelu_tanh";
  else if (act == "gelu") s.activation = "gelu";
  else
    throw r.error(
        "activation_function",
        fmt::format("is '{}'; model/gpt2 has gelu_new / gelu_pytorch_tanh (tanh approximation) and gelu", act));
  if (s.n_embd % s.n_head_q != 0)
    throw r.error("n_head", fmt::format("must divide n_embd ({}), got {}", s.n_embd, s.n_head_q));
  if (!r.boolean("scale_attn_weights", true))
    throw r.error("scale_attn_weights", "is false; model/gpt2 always scales attention scores by 1/sqrt(head dim)");
  if (r.boolean("scale_attn_by_inverse_layer_idx", false))
    throw r.error("scale_attn_by_inverse_layer_idx", "is true; model/gpt2 has no per-layer attention scaling");
  if (r.boolean("add_cross_attention", false))
    throw r.error("add_cross_attention", "is true; decoder-only models only");
  return c;
}

// ---------------------------------------------------------------------------------------------
// Weight names
// ---------------------------------------------------------------------------------------------

enum class Kind {
  kSame,        // same tensor
  kTransposed,  // GPT-2's Conv1D stores [in, out]
  kQkvWeight,   // GPT-2's c_attn.weight [d, 3d] = [q^T | k^T | v^T]
  kQkvBias,     // GPT-2's c_attn.bias [3d] = [q | k | v]
  kStacked,     // the MoE experts: transformers' one tensor per expert, ours stacked [E, ...]
};

struct Link {
  std::string hf;                 // for kStacked: "...experts.{}.w1.weight", {} the expert
  std::vector<std::string> ours;  // one, or q/k/v for the kQkv kinds
  Kind kind = Kind::kSame;
  std::int64_t experts = 0;  // kStacked
};

bool is_gpt2(const std::string& model_type) { return model_type == "gpt2"; }

std::vector<Link> links(const std::string& model_type, const DecoderSpec& s) {
  std::vector<Link> out;
  const auto add = [&](std::string hf, std::string ours, Kind k = Kind::kSame) {
    out.push_back({std::move(hf), {std::move(ours)}, k});
  };
  if (is_gpt2(model_type)) {
    add("transformer.wte.weight", "transformer.wte.weight");
    add("transformer.wpe.weight", "transformer.wpe.weight");
    for (std::int64_t i = 0; i < s.n_layer; ++i) {
      const std::string h = fmt::format("transformer.h.{}.", i), o = fmt::format("transformer.h.{}.", i);
      for (const char* p : {"weight", "bias"}) {
        add(h + "ln_1." + p, o + "attention_norm." + p);
        add(h + "ln_2." + p, o + "ffn_norm." + p);
      }
      out.push_back({h + "attn.c_attn.weight",
                     {o + "attn.q_attn.weight", o + "attn.k_attn.weight", o + "attn.v_attn.weight"},
                     Kind::kQkvWeight});
      out.push_back({h + "attn.c_attn.bias",
                     {o + "attn.q_attn.bias", o + "attn.k_attn.bias", o + "attn.v_attn.bias"},
                     Kind::kQkvBias});
      add(h + "attn.c_proj.weight", o + "attn.c_proj.weight", Kind::kTransposed);
      add(h + "attn.c_proj.bias", o + "attn.c_proj.bias");
      add(h + "mlp.c_fc.weight", o + "mlp.c_fc.weight", Kind::kTransposed);
      add(h + "mlp.c_fc.bias", o + "mlp.c_fc.bias");
      add(h + "mlp.c_proj.weight", o + "mlp.c_proj.weight", Kind::kTransposed);
      add(h + "mlp.c_proj.bias", o + "mlp.c_proj.bias");
    }
    add("transformer.ln_f.weight", "transformer.lm_head_norm.weight");
    add("transformer.ln_f.bias", "transformer.lm_head_norm.bias");
  } else {
    add("model.embed_tokens.weight", "transformer.wte.weight");
    for (std::int64_t i = 0; i < s.n_layer; ++i) {
      const std::string h = fmt::format("model.layers.{}.", i), o = fmt::format("transformer.h.{}.", i);
      add(h + "input_layernorm.weight", o + "attention_norm.weight");
      add(h + "post_attention_layernorm.weight", o + "ffn_norm.weight");
      for (const auto& [hf, ours] :
           {std::pair{"q_proj", "q_attn"}, std::pair{"k_proj", "k_attn"}, std::pair{"v_proj", "v_attn"}}) {
        add(h + "self_attn." + hf + ".weight", o + "attn." + ours + ".weight");
        if (s.qkv_bias) add(h + "self_attn." + hf + ".bias", o + "attn." + ours + ".bias");
      }
      add(h + "self_attn.o_proj.weight", o + "attn.c_proj.weight");
      if (s.attn_proj_bias) add(h + "self_attn.o_proj.bias", o + "attn.c_proj.bias");
      if (s.qk_norm) {
        add(h + "self_attn.q_norm.weight", o + "attn.q_norm.weight");
        add(h + "self_attn.k_norm.weight", o + "attn.k_norm.weight");
      }
      if (s.moe && s.moe->is_moe_layer(i)) {
        // model/gpt2_moe's block (plugins/moe/src/moe.h): router.gate, experts.w1/w3 [E, F, d] (gate,
        // up), experts.w2 [E, d, F] (down), shared_experts (a SwiGLU: W, V, W_2), shared_expert_gate.
        const bool mixtral = model_type == "mixtral";
        const std::string b = h + (mixtral ? "block_sparse_moe." : "mlp."), mo = o + "mlp.";
        add(b + "gate.weight", mo + "router.gate.weight");
        using Names = std::array<std::pair<const char*, const char*>, 3>;  // (transformers, ours)
        static constexpr Names kMixtral{{{"w1", "w1"}, {"w3", "w3"}, {"w2", "w2"}}};
        static constexpr Names kQwen{{{"gate_proj", "w1"}, {"up_proj", "w3"}, {"down_proj", "w2"}}};
        for (const auto& [hf, ours] : mixtral ? kMixtral : kQwen)
          out.push_back(
              {b + "experts.{}." + hf + ".weight", {mo + "experts." + ours}, Kind::kStacked, s.moe->num_experts});
        if (s.moe->shared_hidden > 0) {
          for (const auto& [hf, ours] :
               {std::pair{"gate_proj", "W"}, std::pair{"up_proj", "V"}, std::pair{"down_proj", "W_2"}})
            add(b + "shared_expert." + hf + ".weight", mo + "shared_experts." + ours + ".weight");
          if (s.moe->shared_gate) add(b + "shared_expert_gate.weight", mo + "shared_expert_gate.weight");
        }
        continue;
      }
      for (const auto& [hf, ours] :
           {std::pair{"gate_proj", "W"}, std::pair{"up_proj", "V"}, std::pair{"down_proj", "W_2"}}) {
        add(h + "mlp." + hf + ".weight", o + "mlp." + ours + ".weight");
        if (s.mlp_bias) add(h + "mlp." + hf + ".bias", o + "mlp." + ours + ".bias");
      }
    }
    add("model.norm.weight", "transformer.lm_head_norm.weight");
  }
  if (!s.tie_word_embeddings) add("lm_head.weight", "transformer.lm_head.weight");
  return out;
}

// Tensors a transformers file may hold that are no weights: non-persistent buffers of older
// versions (RoPE tables, GPT-2's causal masks).
bool ignorable(const std::string& hf_name) {
  return hf_name.ends_with("rotary_emb.inv_freq") || hf_name.ends_with(".attn.bias") ||
         hf_name.ends_with(".attn.masked_bias");
}

std::string shape_of(at::IntArrayRef s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

// ---------------------------------------------------------------------------------------------
// JSON writing (sorted keys and two-space indentation, as transformers' to_json_string)
// ---------------------------------------------------------------------------------------------

class JsonObject {
 public:
  JsonObject& raw(const std::string& key, std::string json) {
    fields_[key] = std::move(json);
    return *this;
  }
  JsonObject& str(const std::string& key, const std::string& v) { return raw(key, formats::json_quote(v)); }
  JsonObject& num(const std::string& key, std::int64_t v) { return raw(key, std::to_string(v)); }
  JsonObject& real(const std::string& key, double v) {
    // Shortest text that parses back to the same double, with a decimal point (JSON float).
    std::string t = fmt::format("{}", v);
    if (t.find_first_of(".eE") == std::string::npos && t.find_first_of("ni") == std::string::npos) t += ".0";
    return raw(key, t);
  }
  JsonObject& boolean(const std::string& key, bool v) { return raw(key, v ? "true" : "false"); }
  JsonObject& opt(const std::string& key, std::optional<std::int64_t> v) {
    return raw(key, v ? std::to_string(*v) : "null");
  }
  std::string dump(int indent = 0) const {
    const std::string pad(static_cast<std::size_t>(indent) + 2, ' ');
    std::string s = "{\n";
    bool first = true;
    for (const auto& [k, v] : fields_) {
      s += fmt::format("{}{}{}: {}", first ? "" : ",\n", pad, formats::json_quote(k), v);
      first = false;
    }
    return s + "\n" + std::string(static_cast<std::size_t>(indent), ' ') + "}";
  }

 private:
  std::map<std::string, std::string> fields_;
};

std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kDouble: return "float64";
    default: throw Error(fmt::format("cannot export in dtype {}: use float32, bfloat16 or float16", c10::toString(t)));
  }
}

std::string architecture_of(const std::string& model_type) {
  static const std::map<std::string, std::string> names = {
      {"gpt2", "GPT2LMHeadModel"},          {"llama", "LlamaForCausalLM"},       {"mistral", "MistralForCausalLM"},
      {"qwen2", "Qwen2ForCausalLM"},        {"qwen3", "Qwen3ForCausalLM"},       {"mixtral", "MixtralForCausalLM"},
      {"qwen2_moe", "Qwen2MoeForCausalLM"}, {"qwen3_moe", "Qwen3MoeForCausalLM"}};
  return names.at(model_type);
}

std::string choose_model_type(const DecoderSpec& s) {
  std::vector<std::string> why;
  if (s.absolute_positions) {
    if (s.activation == "swiglu") why.push_back("learned positions (ABSOLUTE) with SwiGLU");
    if (s.norm != "layer_norm") why.push_back("learned positions need LayerNorm with weight and bias (GPT-2)");
    if (s.n_head_kv != s.n_head_q)
      why.push_back("GPT-2 has no grouped-query attention (n_head_kv must equal n_head_q)");
    if (!(s.qkv_bias && s.attn_proj_bias && s.mlp_bias))
      why.push_back("GPT-2 has biases on every linear (bias = true)");
    if (s.sliding_window) why.push_back("GPT-2 has no sliding window");
    if (why.empty()) return "gpt2";
  } else {
    if (s.activation != "swiglu")
      why.push_back(fmt::format("RoPE with {} (the RoPE families use SwiGLU)", s.activation));
    if (s.norm != "rms_norm")
      why.push_back("RoPE models need RMSNorm without bias (pytorch_rms_norm, or rms_norm with bias = false)");
    const bool no_bias = !s.qkv_bias && !s.attn_proj_bias && !s.mlp_bias;
    if (s.mlp_bias && (s.qk_norm || s.moe)) why.push_back("MLP biases (Qwen3 and the MoE families have none)");
    if (why.empty() && s.moe) {
      const MoeSpec& m = *s.moe;
      if (s.qk_norm) {  // Qwen3-MoE
        if (m.shared_hidden > 0) why.push_back("qk-norm with shared experts (Qwen3-MoE has none)");
        if (s.qkv_bias != s.attn_proj_bias)
          why.push_back("biases on q/k/v and attn.c_proj differ (Qwen3-MoE's attention_bias covers all four)");
        if (why.empty()) return "qwen3_moe";
      } else if (m.shared_hidden > 0) {  // Qwen2-MoE
        if (!m.shared_gate) why.push_back("shared experts without shared_expert_gate (Qwen2-MoE gates them)");
        if (s.attn_proj_bias) why.push_back("a bias on attn.c_proj (Qwen2-MoE has biases on q/k/v at most)");
        if (s.sliding_window) why.push_back("a sliding window with shared experts (Qwen2-MoE has none)");
        if (s.head_dim > 0) why.push_back("head_dim other than n_embd / n_head_q (Qwen2-MoE refuses it)");
        if (why.empty()) return "qwen2_moe";
      } else {  // Mixtral
        if (!no_bias) why.push_back("biases (Mixtral has none; Qwen2-MoE has q/k/v biases with a shared expert)");
        if (!m.norm_topk_prob)
          why.push_back(
              "top-k weights not normalized (Mixtral normalizes them; Qwen2-MoE and Qwen3-MoE do not, and "
              "have a shared expert or qk-norm)");
        if (m.decoder_sparse_step != 1 || !m.mlp_only_layers.empty())
          why.push_back(
              "dense blocks (Mixtral's are all MoE; Qwen2-MoE and Qwen3-MoE have dense ones, with a shared "
              "expert or qk-norm)");
        if (why.empty()) return "mixtral";
      }
    } else if (why.empty() && s.qk_norm) {  // Qwen3
      if (s.qkv_bias != s.attn_proj_bias)
        why.push_back("biases on q/k/v and attn.c_proj differ (Qwen3's attention_bias covers all four)");
      if (s.sliding_window) why.push_back("a sliding window with qk-norm (Qwen3 has windows in some layers only)");
      if (why.empty()) return "qwen3";
    } else if (why.empty()) {
      if (s.sliding_window && !no_bias) why.push_back("a sliding window (Mistral) with biases");
      if (why.empty()) {
        if (s.sliding_window) return "mistral";
        if (s.qkv_bias && !s.attn_proj_bias && !s.mlp_bias) return "qwen2";
        if (s.qkv_bias == s.attn_proj_bias) return "llama";
        why.push_back(
            "biases on q/k/v and attn.c_proj differ (Llama's attention_bias covers all four, Qwen2 has q/k/v only)");
      }
    }
  }
  throw Error(
      fmt::format("this model has no transformers counterpart: {}. Exported are Llama (RoPE, SwiGLU, RMSNorm), "
                  "Mistral (the same with a sliding window), Qwen2 (biases on q/k/v), Qwen3 (qk-norm before RoPE), "
                  "GPT-2 (learned positions, GELU, LayerNorm, biases), and the MoE families Mixtral (normalized "
                  "top-k, every block MoE, no biases), Qwen2-MoE (a gated shared expert) and Qwen3-MoE (qk-norm)",
                  fmt::join(why, "; ")));
}

}  // namespace

// Refuses sizes whose weights cannot be allocated, before anything is: a config.json with
// hidden_size or num_hidden_layers of 2^31 asked for a 256 GB tensor (abort) or built layers until
// killed. The fp32 parameter count of the decoder these sizes describe must fit in this machine's
// memory.
void check_allocatable(const ConfigReader& r, const ImportedConfig& c) {
  const DecoderSpec& s = c.spec;
  const bool gpt2 = c.model_type == "gpt2";
  const long double d = static_cast<long double>(s.n_embd);
  const long double head = static_cast<long double>(s.head_size());
  const long double q = head * static_cast<long double>(s.n_head_q), kv = head * static_cast<long double>(s.n_head_kv);
  long double ffn = (s.activation == "swiglu" ? 3 : 2) * d * static_cast<long double>(s.mlp_hidden);
  if (s.moe)  // every block counted as a MoE block: the experts, the router and the shared expert
    ffn = std::max(
        ffn, 3 * d *
                     (static_cast<long double>(s.moe->num_experts) * static_cast<long double>(s.moe->expert_hidden) +
                      static_cast<long double>(s.moe->shared_hidden)) +
                 d * static_cast<long double>(s.moe->num_experts + 1));
  const long double per_layer = d * (q + 2 * kv) + q * d + ffn;
  // Embedding (and untied head), wpe or the RoPE table, the blocks.
  const long double params = static_cast<long double>(s.vocab_size) * d * (s.tie_word_embeddings ? 1 : 2) +
                             static_cast<long double>(s.max_positions) * (s.absolute_positions ? d : head) +
                             static_cast<long double>(s.n_layer) * per_layer;
  const long double bytes = params * 4;
  const long double memory = static_cast<long double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  if (bytes <= memory) return;
  const std::string sizes =
      gpt2 ? fmt::format("vocab_size {}, n_positions {}, n_embd {}, n_inner {}, n_layer {}", s.vocab_size,
                         s.max_positions, s.n_embd, s.mlp_hidden, s.n_layer)
           : fmt::format(
                 "vocab_size {}, max_position_embeddings {}, hidden_size {}, intermediate_size {}, "
                 "num_hidden_layers {}",
                 s.vocab_size, s.max_positions, s.n_embd, s.mlp_hidden, s.n_layer);
  throw Error(
      fmt::format("{}: the sizes ({}) describe a model of {:.3g} parameters, {:.3g} GB in fp32, more than "
                  "this machine's {:.3g} GB of memory; a size is wrong",
                  r.file().string(), sizes, static_cast<double>(params), static_cast<double>(bytes / 1e9),
                  static_cast<double>(memory / 1e9)));
}

ImportedConfig read_config(const fs::path& folder) {
  const ConfigReader r(folder / "config.json");
  if (r.has("quantization_config")) throw r.error("quantization_config", "is set; quantized checkpoints are not read");
  const std::string model_type = r.string("model_type");
  ImportedConfig c;
  if (model_type == "llama" || model_type == "mistral" || model_type == "qwen2" || model_type == "qwen3" ||
      model_type == "mixtral" || model_type == "qwen2_moe" || model_type == "qwen3_moe")
    c = read_llama_like(r, model_type);
  else if (model_type == "gpt2") c = read_gpt2(r);
  else
    throw r.error("model_type", fmt::format("is '{}'; model/gpt2 takes the decoder-only families llama (Llama 2, "
                                            "Llama 3), mistral, qwen2, qwen3 and gpt2, and model/gpt2_moe "
                                            "(plugins/moe) the Mixture-of-Experts families mixtral, qwen2_moe and "
                                            "qwen3_moe",
                                            model_type));
  check_allocatable(r, c);
  return c;
}

StateDict to_modalities(const ImportedConfig& config, const StateDict& hf_in,
                        const std::map<std::string, std::vector<std::int64_t>>& expected, const std::string& folder) {
  // GPT-2 files written by older transformers lack the "transformer." prefix.
  StateDict hf;
  for (const auto& [name, t] : hf_in) {
    if (ignorable(name)) continue;
    if (is_gpt2(config.model_type) && !name.starts_with("transformer.") && name != "lm_head.weight")
      hf.emplace("transformer." + name, t);
    else hf.emplace(name, t);
  }
  if (config.spec.tie_word_embeddings) hf.erase("lm_head.weight");  // transformers ties it to the embedding
  StateDict out;
  std::set<std::string> used;
  const auto take = [&](const std::string& name) -> const at::Tensor& {
    const auto it = hf.find(name);
    if (it == hf.end())
      throw Error(fmt::format("{}: the weights have no '{}', which a {} with this config.json has", folder, name,
                              config.architecture));
    used.insert(name);
    return it->second;
  };
  const auto put = [&](const std::string& ours, const at::Tensor& t, const std::string& hf_name) {
    const auto e = expected.find(ours);
    if (e == expected.end()) throw Error(fmt::format("internal: model/gpt2 has no '{}'", ours));
    if (t.sizes().vec() != e->second)
      throw Error(fmt::format("{}: '{}' is {}; config.json implies {}", folder, hf_name, shape_of(t.sizes()),
                              shape_of(e->second)));
    out.emplace(ours, t.contiguous());
  };
  const std::int64_t d = config.spec.n_embd;
  for (const Link& l : links(config.model_type, config.spec)) {
    if (l.kind == Kind::kStacked) {
      std::vector<at::Tensor> parts;
      for (std::int64_t e = 0; e < l.experts; ++e) {
        const std::string name = fmt::format(fmt::runtime(l.hf), e);
        parts.push_back(take(name));
        if (e > 0 && parts[e].sizes() != parts[0].sizes())
          throw Error(fmt::format("{}: '{}' is {}; expert 0's is {}", folder, name, shape_of(parts[e].sizes()),
                                  shape_of(parts[0].sizes())));
      }
      put(l.ours[0], at::stack(parts), fmt::format(fmt::runtime(l.hf), "*") + " (stacked)");
      continue;
    }
    const at::Tensor& t = take(l.hf);
    switch (l.kind) {
      case Kind::kStacked: break;
      case Kind::kSame: put(l.ours[0], t, l.hf); break;
      case Kind::kTransposed:
        if (t.dim() != 2)
          throw Error(fmt::format("{}: '{}' is {}, expected a matrix", folder, l.hf, shape_of(t.sizes())));
        put(l.ours[0], t.t(), l.hf);
        break;
      case Kind::kQkvWeight:
      case Kind::kQkvBias: {
        const bool w = l.kind == Kind::kQkvWeight;
        if (t.dim() != (w ? 2 : 1) || t.size(w ? 1 : 0) != 3 * d)
          throw Error(fmt::format("{}: '{}' is {}, expected {}", folder, l.hf, shape_of(t.sizes()),
                                  w ? shape_of({d, 3 * d}) : shape_of({3 * d})));
        const auto parts = t.split(d, w ? 1 : 0);
        for (std::size_t j = 0; j < 3; ++j) put(l.ours[j], w ? parts[j].t() : parts[j], l.hf);
        break;
      }
    }
  }
  std::vector<std::string> unused;
  for (const auto& [name, t] : hf)
    if (!used.count(name)) unused.push_back(name);
  if (!unused.empty())
    throw Error(fmt::format("{}: the weights hold {} tensor(s) a {} with this config.json does not have: {}{}", folder,
                            unused.size(), config.architecture,
                            fmt::join(unused.begin(), unused.begin() + std::min<std::size_t>(unused.size(), 5), ", "),
                            unused.size() > 5 ? ", ..." : ""));
  return out;
}

HuggingFaceCheckpoint to_huggingface(const DecoderSpec& s, const StateDict& ours,
                                     const HuggingFaceExportOptions& options) {
  const std::string model_type = choose_model_type(s);
  HuggingFaceCheckpoint c;
  // Tensors.
  const auto get = [&](const std::string& name) -> at::Tensor {
    const auto it = ours.find(name);
    if (it == ours.end()) throw Error(fmt::format("the model has no '{}' to export", name));
    at::Tensor t = it->second.detach().to(at::kCPU);
    if (options.dtype && t.is_floating_point()) t = t.to(*options.dtype);
    return t;
  };
  for (const Link& l : links(model_type, s)) {
    switch (l.kind) {
      case Kind::kSame: c.tensors[l.hf] = get(l.ours[0]).contiguous(); break;
      case Kind::kTransposed: c.tensors[l.hf] = get(l.ours[0]).t().contiguous(); break;
      case Kind::kQkvWeight:
        c.tensors[l.hf] = at::cat({get(l.ours[0]).t(), get(l.ours[1]).t(), get(l.ours[2]).t()}, 1).contiguous();
        break;
      case Kind::kQkvBias: c.tensors[l.hf] = at::cat({get(l.ours[0]), get(l.ours[1]), get(l.ours[2])}, 0); break;
      case Kind::kStacked: {
        const at::Tensor stack = get(l.ours[0]);
        if (stack.dim() < 1 || stack.size(0) != l.experts)
          throw Error(
              fmt::format("'{}' is {}, expected {} experts stacked", l.ours[0], shape_of(stack.sizes()), l.experts));
        for (std::int64_t e = 0; e < l.experts; ++e)
          c.tensors[fmt::format(fmt::runtime(l.hf), e)] = stack[e].contiguous();
        break;
      }
    }
  }
  const at::Tensor& wte = ours.count("transformer.wte.weight") ? ours.at("transformer.wte.weight") : at::Tensor();
  const std::string dtype = dtype_name(options.dtype.value_or(wte.defined() ? wte.scalar_type() : at::kFloat));

  JsonObject j;
  j.raw("architectures", fmt::format("[\n    {}\n  ]", formats::json_quote(architecture_of(model_type))));
  j.str("model_type", model_type).num("vocab_size", s.vocab_size).boolean("tie_word_embeddings", s.tie_word_embeddings);
  j.opt("bos_token_id", options.bos_token_id).opt("eos_token_id", options.eos_token_id);
  if (options.pad_token_id) j.num("pad_token_id", *options.pad_token_id);
  j.str("torch_dtype", dtype).boolean("use_cache", true).real("initializer_range", 0.02);
  if (model_type == "gpt2") {
    j.num("n_positions", s.max_positions).num("n_embd", s.n_embd).num("n_layer", s.n_layer).num("n_head", s.n_head_q);
    j.num("n_inner", s.mlp_hidden).str("activation_function", s.activation == "gelu" ? "gelu" : "gelu_new");
    j.real("layer_norm_epsilon", s.norm_eps);
    j.real("attn_pdrop", s.dropout).real("resid_pdrop", s.dropout).real("embd_pdrop", s.dropout);
    j.boolean("scale_attn_weights", true).boolean("scale_attn_by_inverse_layer_idx", false);
    j.boolean("reorder_and_upcast_attn", false);
  } else {
    j.num("hidden_size", s.n_embd).num("intermediate_size", s.mlp_hidden).num("num_hidden_layers", s.n_layer);
    j.num("num_attention_heads", s.n_head_q).num("num_key_value_heads", s.n_head_kv);
    j.num("head_dim", s.head_size()).str("hidden_act", "silu");
    j.num("max_position_embeddings", s.max_positions).real("rms_norm_eps", s.norm_eps);
    j.real("rope_theta", static_cast<double>(s.rope_theta)).real("attention_dropout", s.dropout);
    if (s.rope_scaling) {
      JsonObject r;
      r.str("rope_type", s.rope_scaling->rope_type).real("factor", s.rope_scaling->factor);
      if (s.rope_scaling->rope_type == "llama3")
        r.real("low_freq_factor", s.rope_scaling->low_freq_factor)
            .real("high_freq_factor", s.rope_scaling->high_freq_factor)
            .num("original_max_position_embeddings", s.rope_scaling->original_max_position_embeddings);
      j.raw("rope_scaling", r.dump(2));
    } else {
      j.raw("rope_scaling", "null");
    }
    if (model_type == "llama")
      j.boolean("attention_bias", s.qkv_bias).boolean("mlp_bias", s.mlp_bias).num("pretraining_tp", 1);
    if (model_type == "mistral" || model_type == "mixtral") j.opt("sliding_window", s.sliding_window);
    if (model_type == "qwen2" || model_type == "qwen2_moe" || model_type == "qwen3")
      j.boolean("use_sliding_window", false).raw("sliding_window", "null").num("max_window_layers", s.n_layer);
    if (model_type == "qwen3_moe")
      j.boolean("use_sliding_window", s.sliding_window.has_value()).opt("sliding_window", s.sliding_window);
    if (model_type == "qwen3" || model_type == "qwen3_moe") j.boolean("attention_bias", s.qkv_bias);
    if (model_type == "qwen2_moe") j.boolean("qkv_bias", s.qkv_bias);
    if (s.moe) {
      const MoeSpec& m = *s.moe;
      j.num("num_experts_per_tok", m.top_k).real("router_aux_loss_coef", m.aux_loss_coef);
      j.boolean("output_router_logits", false);
      if (model_type == "mixtral") {
        // Mixtral's intermediate_size is the experts' hidden size.
        j.num("intermediate_size", m.expert_hidden).num("num_local_experts", m.num_experts);
        j.real("router_jitter_noise", 0.0);
      } else {
        j.num("num_experts", m.num_experts).num("moe_intermediate_size", m.expert_hidden);
        j.boolean("norm_topk_prob", m.norm_topk_prob).num("decoder_sparse_step", m.decoder_sparse_step);
        j.raw("mlp_only_layers", fmt::format("[{}]", fmt::join(m.mlp_only_layers, ", ")));
        if (model_type == "qwen2_moe") j.num("shared_expert_intermediate_size", m.shared_hidden);
      }
    }
  }
  c.architecture = architecture_of(model_type);
  c.config_json = j.dump() + "\n";
  JsonObject g;
  g.boolean("_from_model_config", true)
      .opt("bos_token_id", options.bos_token_id)
      .opt("eos_token_id", options.eos_token_id);
  if (options.pad_token_id) g.num("pad_token_id", *options.pad_token_id);
  c.generation_config_json = g.dump() + "\n";
  return c;
}

}  // namespace modalities::plugins::gpt2::hf
