// model/gpt2's configuration: the alternatives of its tagged unions and the checks across fields.
#include "config.h"

#include <modalities/sdk/norms.h>

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <utility>

namespace modalities::plugins::gpt2 {

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
             const bool layer_norm_class =
                 config.find("elementwise_affine") != nullptr || config.find("bias") != nullptr;
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
       U::alternative<norms::TorchRmsNormConfig>("pytorch_rms_norm", "RMSNorm keys",
                                                 [](const norms::TorchRmsNormConfig& f, const Value&,
                                                    NormWrapperConfig& out, const std::string&, ParseContext&) {
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
  static const U u{"type_hint",
                   "Transform class applied to (q, k, v) after the head split.",
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

void GPT2Config::check_norm(const NormWrapperConfig& n, const std::string& key, std::int64_t expected,
                            const std::string& what, ParseContext& ctx) {
  if (n.size != expected)
    ctx.fail(fmt::format("{}.config.{}", key, n.size_key),
             fmt::format("must equal {} ({}), got {}", what, expected, n.size));
}

void GPT2Config::validate(const GPT2Config& c, ParseContext& ctx) {
  for (const auto& [value, key] :
       {std::pair{c.vocab_size, "vocab_size"}, std::pair{c.n_embd, "n_embd"}, std::pair{c.ffn_hidden, "ffn_hidden"}})
    if (value % 128 != 0)
      ctx.fail(key, fmt::format("must be divisible by 128 (for efficient training, as in Modalities), got {}", value));
  const bool heads_ok = c.explicit_head_dim || c.n_embd % c.n_head_q == 0;
  if (!heads_ok)
    ctx.fail("n_head_q",
             fmt::format("n_embd ({}) must be divisible by n_head_q ({}), or give head_dim", c.n_embd, c.n_head_q));
  if (c.n_head_q % c.n_head_kv != 0)
    ctx.fail("n_head_kv", fmt::format("n_head_q ({}) must be divisible by n_head_kv ({})", c.n_head_q, c.n_head_kv));
  if (c.document_ids_key && (c.document_ids_key->empty() || *c.document_ids_key == c.sample_key))
    ctx.fail("document_ids_key", fmt::format("is '{}'; it must name an input other than sample_key ('{}')",
                                             *c.document_ids_key, c.sample_key));
  if (!c.document_ids_key && c.document_positions == "restart")
    ctx.fail("document_positions", "is restart, but there is no document_ids_key to find the documents by");
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
    if (!c.explicit_head_dim && t.rope.n_embd != c.n_embd)
      ctx.fail(base + ".config.n_embd", fmt::format("must equal n_embd ({}), got {}", c.n_embd, t.rope.n_embd));
    if (c.explicit_head_dim && t.rope.n_embd != c.attention_width())
      ctx.fail(base + ".config.n_embd",
               fmt::format("must equal n_head_q * head_dim ({}), the width of the query heads, got {}",
                           c.attention_width(), t.rope.n_embd));
    if (t.rope.seq_length_dim != -2 && t.rope.seq_length_dim != 2)
      ctx.fail(base + ".config.seq_length_dim",
               fmt::format("must be -2 (the T dimension of [B, H, T, hd]), got {}", t.rope.seq_length_dim));
    if (heads_ok && c.head_dim() % 2 != 0)
      ctx.fail(base, fmt::format("RoPE needs an even head dim, got {} = {}",
                                 c.explicit_head_dim ? "head_dim" : "n_embd / n_head_q", c.head_dim()));
  }
  check_norm(c.attention_norm_config, "attention_norm_config", c.n_embd, "n_embd", ctx);
  check_norm(c.ffn_norm_config, "ffn_norm_config", c.n_embd, "n_embd", ctx);
  check_norm(c.lm_head_norm_config, "lm_head_norm_config", c.n_embd, "n_embd", ctx);
  if (c.attention_config.qk_norm_config && heads_ok)
    check_norm(*c.attention_config.qk_norm_config, "attention_config.qk_norm_config", c.head_dim(),
               c.explicit_head_dim ? "the head dim head_dim" : "the head dim n_embd / n_head_q", ctx);
  if (c.ffn_hidden != 4 * c.n_embd)
    ctx.warn("ffn_hidden", fmt::format("expected 4 * n_embd ({}), got {} (allowed; Modalities warns too)", 4 * c.n_embd,
                                       c.ffn_hidden));
}

}  // namespace modalities::plugins::gpt2
