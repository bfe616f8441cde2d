// model/coca (README.md): Modalities' CoCa, the vision-language model of its model zoo: a vision
// transformer encoder, attention pooling of its tokens by learned queries, a unimodal text decoder
// with a CLS token appended, and a multimodal decoder whose blocks cross-attend to the pooled image
// tokens. Names, shapes, state dict and forward follow Modalities 0.5.0 (src/modalities/models/coca
// and models/vision_transformer), op for op, so its checkpoints and configs map 1:1; the checks it
// lacks (widths that heads do not divide, images the patches do not tile, mismatched widths) are
// config errors here, by key.
//
// Shape legend: B batch, C image channels, H x W image, P patch size, S patch stride, Np patches,
// Dv vision width, D text width (= Dv), T text tokens, V vocabulary, Nq pooling queries.
#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/removable_handle.h>
#include <modalities/sdk/module_hooks.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/run_context.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace modalities::plugins::coca {
namespace {

using i64 = std::int64_t;

// --- configs (Modalities' pydantic models) ----------------------------------------------------

struct AttentionConfig {
  std::string attention_engine_type;
  static void describe(Schema<AttentionConfig>& s) {
    s.field("attention_engine_type", &AttentionConfig::attention_engine_type,
            "default_attention (the softmax written out, with a causal-mask buffer of 1024 x 1024 per attention, "
            "as Modalities) or pytorch_flash_attention (SDPA, no buffer).")
        .required()
        .one_of({"default_attention", "pytorch_flash_attention"});
  }
  bool flash() const { return attention_engine_type == "pytorch_flash_attention"; }
};

// img_size: an int (square) or [height, width].
struct ImageSize {
  i64 height = 224, width = 224;
};

}  // namespace
}  // namespace modalities::plugins::coca

namespace modalities {
template <>
struct Codec<plugins::coca::ImageSize> {
  static std::string type_name() { return "int or [height, width]"; }
  static Parsed parse(const Value& v, plugins::coca::ImageSize& out, const std::string& path, ParseContext& ctx) {
    if (ctx.dry_run() && detail::pending_fits(v, {"int"})) return Parsed::kPending;
    if (v.is_int()) {
      out.height = out.width = v.as_int();
    } else if (v.is_list() && v.as_list().size() == 2 && v.as_list()[0].is_int() && v.as_list()[1].is_int()) {
      out.height = v.as_list()[0].as_int();
      out.width = v.as_list()[1].as_int();
    } else {
      return detail::type_error(v, "an integer or a list [height, width] of integers", path, ctx);
    }
    if (out.height < 1 || out.width < 1) {
      ctx.fail(path, fmt::format("must be >= 1, got [{}, {}]", out.height, out.width));
      return Parsed::kError;
    }
    return Parsed::kOk;
  }
  static std::string repr(const plugins::coca::ImageSize& x) { return fmt::format("[{}, {}]", x.height, x.width); }
};
}  // namespace modalities

namespace modalities::plugins::coca {
namespace {

struct VisionTransformerConfig {
  std::string sample_key;
  std::string prediction_key;
  ImageSize img_size;
  std::optional<i64> n_classes = 1000;
  i64 n_layer = 12;
  std::optional<AttentionConfig> attention_config;
  i64 n_head = 8;
  i64 n_embd = 768;
  double dropout = 0.0;
  i64 patch_size = 16;
  i64 patch_stride = 16;
  i64 n_img_channels = 3;
  bool add_cls_token = true;
  bool bias = true;

  static void describe(Schema<VisionTransformerConfig>& s) {
    using C = VisionTransformerConfig;
    s.field("sample_key", &C::sample_key, "Input holding the images [B, C, H, W] (floating point).").required();
    s.field("prediction_key", &C::prediction_key,
            "Name of the encoder's output; CoCa reads it under vision_embd_prediction_key, so both must be equal.")
        .required();
    s.field("img_size", &C::img_size, "Image size: an int (square) or [height, width].");
    s.field("n_classes", &C::n_classes,
            "Must be null for CoCa (the encoder's tokens are pooled, no classification head).");
    s.field("n_layer", &C::n_layer, "Transformer blocks.").positive();
    s.field("attention_config", &C::attention_config, "{ attention_engine_type }; absent: default_attention.");
    s.field("n_head", &C::n_head, "Attention heads; must divide n_embd.").positive();
    s.field("n_embd", &C::n_embd, "Width; must equal the text decoder's n_embd.").positive();
    s.field("dropout", &C::dropout, "Dropout after the positional embedding and in the MLPs.").at_least(0.0);
    s.field("patch_size", &C::patch_size, "Square patch side (the patch convolution's kernel).").positive();
    s.field("patch_stride", &C::patch_stride, "Patch convolution stride.").positive();
    s.field("n_img_channels", &C::n_img_channels, "Image channels.").positive();
    s.field("add_cls_token", &C::add_cls_token, "Prepend a learned cls token to the patches.");
    s.field("bias", &C::bias, "Biases of the MLPs (the attention and the norms always have them, as in Modalities).");
    s.rule([](const C& c, ParseContext& ctx) {
      if (c.n_embd % c.n_head != 0)
        ctx.fail("n_head", fmt::format("must divide n_embd ({}), got {}", c.n_embd, c.n_head));
      for (const auto& [side, name] : {std::pair{c.img_size.height, "height"}, std::pair{c.img_size.width, "width"}}) {
        if (side < c.patch_size)
          ctx.fail("img_size", fmt::format("the image {} {} is smaller than patch_size {}", name, side, c.patch_size));
        else if ((side - c.patch_size) % c.patch_stride != 0)
          ctx.fail("img_size",
                   fmt::format("the patches (patch_size {}, patch_stride {}) do not tile the image {} {}: "
                               "{} pixels would be left over",
                               c.patch_size, c.patch_stride, name, side, (side - c.patch_size) % c.patch_stride));
      }
      if (c.n_classes)
        ctx.fail("n_classes", fmt::format("is {}; CoCa pools the encoder's tokens and needs n_classes = null (no "
                                          "classification head)",
                                          *c.n_classes));
    });
  }
  i64 patches_h() const { return (img_size.height - patch_size) / patch_stride + 1; }
  i64 patches_w() const { return (img_size.width - patch_size) / patch_stride + 1; }
  i64 block_size() const { return patches_h() * patches_w() + (add_cls_token ? 1 : 0); }
  bool flash() const { return attention_config && attention_config->flash(); }
};

struct TextDecoderConfig {
  std::string sample_key;
  std::string prediction_key;
  i64 block_size = 0;
  i64 vocab_size = 0;
  i64 n_layer_text = 0;
  i64 n_layer_multimodal_text = 0;
  i64 n_head = 0;
  i64 n_embd = 0;
  i64 ffn_hidden = 0;
  double dropout = 0.0;
  bool bias = true;
  AttentionConfig attention_config;
  std::string activation;
  double epsilon = 1e-5;

  static void describe(Schema<TextDecoderConfig>& s) {
    using C = TextDecoderConfig;
    s.field("sample_key", &C::sample_key, "Input holding the token ids [B, T].").required();
    s.field("prediction_key", &C::prediction_key, "Name of the multimodal decoder's logits.").required();
    s.field("block_size", &C::block_size, "Longest text (the CLS token takes one more position).")
        .required()
        .positive();
    s.field("vocab_size", &C::vocab_size, "Vocabulary size.").required().positive();
    s.field("n_layer_text", &C::n_layer_text, "Blocks of the unimodal text decoder.").required().positive();
    s.field("n_layer_multimodal_text", &C::n_layer_multimodal_text, "Blocks of the multimodal decoder.")
        .required()
        .positive();
    s.field("n_head", &C::n_head, "Attention heads (self- and cross-attention); must divide n_embd.")
        .required()
        .positive();
    s.field("n_embd", &C::n_embd, "Width.").required().positive();
    s.field("ffn_hidden", &C::ffn_hidden,
            "MLP hidden size (GELU); SwiGLU uses ceil_to_multiple(int(2 ffn_hidden / 3), 256), as Modalities.")
        .required()
        .positive();
    s.field("dropout", &C::dropout, "Dropout after the embeddings and in the GELU MLPs.").required().at_least(0.0);
    s.field("bias", &C::bias, "Biases of the linear layers and norms.").required();
    s.field("attention_config", &C::attention_config, "{ attention_engine_type }.").required();
    s.field("activation", &C::activation, "MLP activation.").required().one_of({"gelu", "swiglu"});
    s.field("epsilon", &C::epsilon, "LayerNorm epsilon.").required().at_least(0.0);
    s.rule([](const C& c, ParseContext& ctx) {
      if (c.n_embd % c.n_head != 0)
        ctx.fail("n_head", fmt::format("must divide n_embd ({}), got {}", c.n_embd, c.n_head));
    });
  }
  i64 swiglu_hidden() const {
    const i64 h = static_cast<i64>(2.0 * static_cast<double>(ffn_hidden) / 3.0);
    return (h + 255) / 256 * 256;
  }
};

struct CoCaConfig {
  std::string prediction_key = "logits";
  std::string vision_embd_prediction_key;
  std::string text_embd_prediction_key;
  std::string vision_cls_prediction_key;
  std::string text_cls_prediction_key;
  VisionTransformerConfig vision_encoder_config;
  TextDecoderConfig text_decoder_config;
  i64 n_pool_head = 0;
  i64 n_vision_queries = 0;
  bool bias_attn_pool = false;
  double epsilon_attn_pool = 1e-5;
  std::optional<i64> seed;

  static void describe(Schema<CoCaConfig>& s) {
    using C = CoCaConfig;
    s.field("prediction_key", &C::prediction_key, "Output holding the captioning logits [B, T, V].");
    s.field("vision_embd_prediction_key", &C::vision_embd_prediction_key,
            "The vision encoder's output name (its prediction_key).")
        .required();
    s.field("text_embd_prediction_key", &C::text_embd_prediction_key, "Name of the text decoder's embeddings.")
        .required();
    s.field("vision_cls_prediction_key", &C::vision_cls_prediction_key,
            "Output holding the pooled image embedding [B, 1, Dv] (the last pooling query's).")
        .required();
    s.field("text_cls_prediction_key", &C::text_cls_prediction_key,
            "Output holding the text embedding [B, 1, D] (the appended CLS token's).")
        .required();
    s.field("vision_encoder_config", &C::vision_encoder_config, "The vision transformer.").required();
    s.field("text_decoder_config", &C::text_decoder_config, "The unimodal and multimodal text decoders.").required();
    s.field("n_pool_head", &C::n_pool_head, "Heads of the attention pooling; must divide the vision n_embd.")
        .required()
        .positive();
    s.field("n_vision_queries", &C::n_vision_queries,
            "Image tokens the pooling hands the multimodal decoder (one more query gives vision_cls).")
        .required()
        .positive();
    s.field("bias_attn_pool", &C::bias_attn_pool, "Biases of the pooling's norms (its attention always has them).")
        .required();
    s.field("epsilon_attn_pool", &C::epsilon_attn_pool, "Epsilon of the pooling's norms.").required().at_least(0.0);
    s.field("seed", &C::seed,
            "Ours, as model/gpt2's: seeds the random draws of the construction, so every rank and every run builds "
            "the same weights. Modalities' CoCa has none (its fsdp1_wrapped's sync_module_states gives every rank "
            "rank 0's weights, as ours does); FSDP2 shards what each rank built, so give a seed there.");
    s.rule([](const C& c, ParseContext& ctx) {
      const VisionTransformerConfig& v = c.vision_encoder_config;
      if (v.n_embd % c.n_pool_head != 0)
        ctx.fail("n_pool_head",
                 fmt::format("must divide vision_encoder_config.n_embd ({}), got {}", v.n_embd, c.n_pool_head));
      if (v.n_embd != c.text_decoder_config.n_embd)
        ctx.fail("vision_encoder_config.n_embd",
                 fmt::format("is {}, but text_decoder_config.n_embd is {}: the multimodal decoder cross-attends to "
                             "the pooled image tokens, so the widths must be equal",
                             v.n_embd, c.text_decoder_config.n_embd));
      if (v.prediction_key != c.vision_embd_prediction_key)
        ctx.fail("vision_encoder_config.prediction_key",
                 fmt::format("is '{}', but vision_embd_prediction_key is '{}'; CoCa reads the encoder's output under "
                             "that name",
                             v.prediction_key, c.vision_embd_prediction_key));
    });
  }
};

// --- layers -----------------------------------------------------------------------------------

// Mixed precision (Module::set_param_dtype): parameters keep their storage dtype, every use casts
// to `Dt` when set, as model/gpt2 does (FSDP's param_dtype).
using Dt = std::optional<c10::ScalarType>;

at::Tensor cast(const at::Tensor& t, Dt dt) {
  if (!dt || !t.defined() || t.scalar_type() == *dt) return t;
  return t.to(*dt);
}

// nn.Linear: weight [out, in], optional bias [out].
class LinearImpl final : public torch::nn::Module {
 public:
  LinearImpl(i64 in, i64 out, bool bias) : torch::nn::Module("Linear") {
    weight = register_parameter("weight", at::empty({out, in}));
    if (bias) this->bias = register_parameter("bias", at::empty({out}));
    reset();
  }
  // torch.nn.Linear.reset_parameters.
  void reset() {
    at::NoGradGuard no_grad;
    torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
    if (bias.defined()) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(weight.size(1)));
      bias.uniform_(-bound, bound);
    }
  }
  at::Tensor operator()(const at::Tensor& x, Dt dt) const { return at::linear(x, cast(weight, dt), cast(bias, dt)); }
  at::Tensor weight, bias;
};

// nn.LayerNorm(n, eps, bias=...): weight ones, bias zeros.
class LayerNormImpl final : public torch::nn::Module {
 public:
  LayerNormImpl(i64 n, double eps, bool bias) : torch::nn::Module("LayerNorm"), n_(n), eps_(eps) {
    weight = register_parameter("weight", at::ones({n}));
    if (bias) this->bias = register_parameter("bias", at::zeros({n}));
  }
  void reset() {
    at::NoGradGuard no_grad;
    weight.fill_(1.0);
    if (bias.defined()) bias.zero_();
  }
  at::Tensor operator()(const at::Tensor& x, Dt dt) const {
    return at::layer_norm(x, {n_}, cast(weight, dt), cast(bias, dt), eps_);
  }
  at::Tensor weight, bias;

 private:
  i64 n_;
  double eps_;
};

// nn.Embedding: weight [num, dim] ~ N(0, 1).
class EmbeddingImpl final : public torch::nn::Module {
 public:
  EmbeddingImpl(i64 num, i64 dim) : torch::nn::Module("Embedding") {
    weight = register_parameter("weight", at::randn({num, dim}));
  }
  void reset() {
    at::NoGradGuard no_grad;
    weight.normal_(0.0, 1.0);
  }
  // Weight tying: this embedding uses `shared` from now on.
  void tie(const at::Tensor& shared) {
    parameters_["weight"] = shared;
    weight = shared;
  }
  at::Tensor weight;
};

enum class AttentionType { kCausal, kNonCausal, kCross };

// Modalities' nn/attention.py MultiHeadAttention: four separate projections; default_attention
// writes the softmax out and keeps a [1, 1, 1024, 1024] lower-triangular buffer `bias` (also for the
// non-causal and cross attentions, in every state dict, as Modalities does); pytorch_flash_attention
// is SDPA.
class MultiHeadAttentionImpl final : public torch::nn::Module {
 public:
  static constexpr i64 kMaskSize = 1024;
  MultiHeadAttentionImpl(i64 n_embd, i64 n_head, bool bias, AttentionType type, bool flash)
      : torch::nn::Module("MultiHeadAttention"), n_head_(n_head), type_(type), flash_(flash) {
    if (!flash_)
      mask_ = register_buffer("bias", at::ones({kMaskSize, kMaskSize}).tril().view({1, 1, kMaskSize, kMaskSize}));
    wq = register_module("wq", std::make_shared<LinearImpl>(n_embd, n_embd, bias));
    wk = register_module("wk", std::make_shared<LinearImpl>(n_embd, n_embd, bias));
    wv = register_module("wv", std::make_shared<LinearImpl>(n_embd, n_embd, bias));
    c_proj = register_module("c_proj", std::make_shared<LinearImpl>(n_embd, n_embd, bias));
  }
  // x [B, T, C] (and for cross-attention context [B, Tc, C]) -> [B, T, C].
  at::Tensor operator()(const at::Tensor& x, Dt dt, const at::Tensor& context = {}) {
    const at::Tensor& ctx = type_ == AttentionType::kCross ? context : x;
    const i64 B = x.size(0), T = x.size(1), C = x.size(2), Tc = ctx.size(1), hd = C / n_head_;
    const at::Tensor q = (*wq)(x, dt).view({B, T, n_head_, hd}).transpose(1, 2);
    const at::Tensor k = (*wk)(ctx, dt).view({B, Tc, n_head_, hd}).transpose(1, 2);
    const at::Tensor v = (*wv)(ctx, dt).view({B, Tc, n_head_, hd}).transpose(1, 2);
    const bool causal = type_ == AttentionType::kCausal;
    at::Tensor y;
    if (flash_) {
      y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, 0.0, causal);
    } else {
      at::Tensor att = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
      if (causal) {
        if (T > kMaskSize)
          throw Error(
              fmt::format("coca: default_attention's causal mask covers {} positions (as in Modalities), "
                          "the text has {} with its CLS token; use pytorch_flash_attention or shorter text",
                          kMaskSize, T));
        att = att.masked_fill(mask_.narrow(2, 0, T).narrow(3, 0, T) == 0, -std::numeric_limits<double>::infinity());
        // (The mask buffer is compared with 0 only: its dtype, which a mixed-precision cast leaves, does not matter.)
      }
      y = at::matmul(at::softmax(att, -1), v);
    }
    return (*c_proj)(y.transpose(1, 2).contiguous().view({B, T, C}), dt);
  }
  std::shared_ptr<LinearImpl> wq, wk, wv, c_proj;

 private:
  i64 n_head_;
  AttentionType type_;
  bool flash_;
  at::Tensor mask_;
};

// The MLPs: GELU (fc1 -> GELU -> dropout -> fc2 -> dropout) or SwiGLU (W_2(silu(W x) * V x)).
class FeedForwardImpl final : public torch::nn::Module {
 public:
  FeedForwardImpl(bool swiglu, i64 d, i64 hidden, bool bias, double dropout)
      : torch::nn::Module(swiglu ? "SwiGLU" : "MLP"), swiglu_(swiglu), dropout_(dropout) {
    if (swiglu_) {
      W = register_module("W", std::make_shared<LinearImpl>(d, hidden, bias));
      V = register_module("V", std::make_shared<LinearImpl>(d, hidden, bias));
      W_2 = register_module("W_2", std::make_shared<LinearImpl>(hidden, d, bias));
    } else {
      fc1 = register_module("fc1", std::make_shared<LinearImpl>(d, hidden, bias));
      fc2 = register_module("fc2", std::make_shared<LinearImpl>(hidden, d, bias));
    }
  }
  at::Tensor operator()(const at::Tensor& x, Dt dt) {
    if (swiglu_) return (*W_2)(at::silu((*W)(x, dt)) * (*V)(x, dt), dt);
    at::Tensor h = at::gelu((*fc1)(x, dt));
    if (dropout_ > 0) h = at::dropout(h, dropout_, is_training());
    h = (*fc2)(h, dt);
    if (dropout_ > 0) h = at::dropout(h, dropout_, is_training());
    return h;
  }
  std::shared_ptr<LinearImpl> W, V, W_2, fc1, fc2;

 private:
  bool swiglu_;
  double dropout_;
};

class VisionTransformerBlockImpl final : public torch::nn::Module {
 public:
  VisionTransformerBlockImpl(const VisionTransformerConfig& c) : torch::nn::Module("VisionTransformerBlock") {
    norm1 = register_module("norm1", std::make_shared<LayerNormImpl>(c.n_embd, 1e-5, true));
    attention = register_module("attention", std::make_shared<MultiHeadAttentionImpl>(
                                                 c.n_embd, c.n_head, true, AttentionType::kNonCausal, c.flash()));
    norm2 = register_module("norm2", std::make_shared<LayerNormImpl>(c.n_embd, 1e-5, true));
    // Modalities builds the ViT MLP 3072 wide whatever the config (VisionTransformer's ffn_hidden default).
    mlp = register_module("mlp", std::make_shared<FeedForwardImpl>(false, c.n_embd, 3072, c.bias, c.dropout));
  }
  at::Tensor operator()(at::Tensor x, Dt dt) {
    x = x + (*attention)((*norm1)(x, dt), dt);
    return x + (*mlp)((*norm2)(x, dt), dt);
  }
  std::shared_ptr<LayerNormImpl> norm1, norm2;
  std::shared_ptr<MultiHeadAttentionImpl> attention;
  std::shared_ptr<FeedForwardImpl> mlp;
};

// nn.Conv2d(C, Dv, kernel P, stride S) with its bias (PyTorch's default initialization).
class Conv2dImpl final : public torch::nn::Module {
 public:
  Conv2dImpl(i64 in, i64 out, i64 kernel, i64 stride) : torch::nn::Module("Conv2d"), stride_(stride) {
    weight = register_parameter("weight", at::empty({out, in, kernel, kernel}));
    bias = register_parameter("bias", at::empty({out}));
    reset();
  }
  // torch.nn.Conv2d.reset_parameters.
  void reset() {
    at::NoGradGuard no_grad;
    torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
    const double bound = 1.0 / std::sqrt(static_cast<double>(weight.size(1) * weight.size(2) * weight.size(3)));
    bias.uniform_(-bound, bound);
  }
  at::Tensor operator()(const at::Tensor& x, Dt dt) const {
    return at::conv2d(x, cast(weight, dt), cast(bias, dt), {stride_, stride_});
  }
  at::Tensor weight, bias;

 private:
  i64 stride_;
};

// ImagePatchEmbedding: the patches row-major ("b c h w -> b (h w) c"), an optional cls token first.
class ImagePatchEmbeddingImpl final : public torch::nn::Module {
 public:
  explicit ImagePatchEmbeddingImpl(const VisionTransformerConfig& c) : torch::nn::Module("ImagePatchEmbedding") {
    conv =
        register_module("conv", std::make_shared<Conv2dImpl>(c.n_img_channels, c.n_embd, c.patch_size, c.patch_stride));
    if (c.add_cls_token) cls_token = register_parameter("cls_token", at::zeros({1, 1, c.n_embd}));
  }
  at::Tensor operator()(const at::Tensor& images, Dt dt) const {
    at::Tensor x = (*conv)(images, dt);  // [B, Dv, H', W']
    x = x.flatten(2).transpose(1, 2);    // [B, Np, Dv]
    if (cls_token.defined()) x = at::cat({cast(cls_token, dt).expand({x.size(0), 1, x.size(2)}), x}, 1);
    return x;
  }
  std::shared_ptr<Conv2dImpl> conv;
  at::Tensor cls_token;
};

// VisionTransformer without its classification head (n_classes = null): patches + learned
// positions, blocks, no final norm.
class VisionTransformerImpl final : public torch::nn::Module {
 public:
  explicit VisionTransformerImpl(const VisionTransformerConfig& c)
      : torch::nn::Module("VisionTransformer"), dropout_(c.dropout) {
    embedding_fn = register_module("embedding_fn", std::make_shared<ImagePatchEmbeddingImpl>(c));
    positional_embedding_fn =
        register_module("positional_embedding_fn", std::make_shared<EmbeddingImpl>(c.block_size(), c.n_embd));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (i64 i = 0; i < c.n_layer; ++i) blocks->push_back(std::make_shared<VisionTransformerBlockImpl>(c));
  }
  // The patches with their positions, before the blocks (which the Module runs, with its hooks).
  at::Tensor embed(const at::Tensor& images, Dt dt) {
    at::Tensor x = (*embedding_fn)(images, dt) + cast(positional_embedding_fn->weight, dt);
    if (dropout_ > 0) x = at::dropout(x, dropout_, is_training());
    return x;
  }
  std::shared_ptr<ImagePatchEmbeddingImpl> embedding_fn;
  std::shared_ptr<EmbeddingImpl> positional_embedding_fn;
  torch::nn::ModuleList blocks{nullptr};

 private:
  double dropout_;
};

// A decoder block (Modalities' TransformerBlock): causal self-attention and the MLP; with a
// context (the multimodal decoder) the cross-attention comes between them and the norms are
// ln_1, ln_3, ln_4 and the MLP mlp_2.
class TransformerBlockImpl final : public torch::nn::Module {
 public:
  TransformerBlockImpl(const TextDecoderConfig& c, bool with_context) : torch::nn::Module("TransformerBlock") {
    const bool swiglu = c.activation == "swiglu";
    const i64 hidden = swiglu ? c.swiglu_hidden() : c.ffn_hidden;
    const bool flash = c.attention_config.flash();
    ln_1 = register_module("ln_1", std::make_shared<LayerNormImpl>(c.n_embd, c.epsilon, c.bias));
    attn = register_module(
        "attn", std::make_shared<MultiHeadAttentionImpl>(c.n_embd, c.n_head, c.bias, AttentionType::kCausal, flash));
    if (!with_context) {
      ln_2 = register_module("ln_2", std::make_shared<LayerNormImpl>(c.n_embd, c.epsilon, c.bias));
      mlp = register_module("mlp", std::make_shared<FeedForwardImpl>(swiglu, c.n_embd, hidden, c.bias, c.dropout));
    } else {
      ln_3 = register_module("ln_3", std::make_shared<LayerNormImpl>(c.n_embd, c.epsilon, c.bias));
      cross_attn = register_module("cross_attn", std::make_shared<MultiHeadAttentionImpl>(
                                                     c.n_embd, c.n_head, c.bias, AttentionType::kCross, flash));
      ln_4 = register_module("ln_4", std::make_shared<LayerNormImpl>(c.n_embd, c.epsilon, c.bias));
      mlp = register_module("mlp_2", std::make_shared<FeedForwardImpl>(swiglu, c.n_embd, hidden, c.bias, c.dropout));
    }
  }
  at::Tensor operator()(at::Tensor x, Dt dt, const at::Tensor& context = {}) {
    x = x + (*attn)((*ln_1)(x, dt), dt);
    if (!cross_attn) return x + (*mlp)((*ln_2)(x, dt), dt);
    x = x + (*cross_attn)((*ln_3)(x, dt), dt, context);
    return x + (*mlp)((*ln_4)(x, dt), dt);
  }
  std::shared_ptr<LayerNormImpl> ln_1, ln_2, ln_3, ln_4;
  std::shared_ptr<MultiHeadAttentionImpl> attn, cross_attn;
  std::shared_ptr<FeedForwardImpl> mlp;
};

// The unimodal text decoder: token + learned positions with a CLS token appended at the end (its
// position T), causal blocks, no final norm. Returns [B, T + 1, D].
class TextDecoderImpl final : public torch::nn::Module {
 public:
  explicit TextDecoderImpl(const TextDecoderConfig& c)
      : torch::nn::Module("TextDecoder"), dropout_(c.dropout), block_size_(c.block_size + 1) {
    // Modalities allocates it with torch.empty and never initializes it; here it starts at zero.
    cls_token = register_parameter("cls_token", at::zeros({1, 1, c.n_embd}));
    transformer = register_module("transformer", torch::nn::ModuleDict());
    wte = std::make_shared<EmbeddingImpl>(c.vocab_size, c.n_embd);
    wpe = std::make_shared<EmbeddingImpl>(block_size_, c.n_embd);
    h = torch::nn::ModuleList();
    for (i64 i = 0; i < c.n_layer_text; ++i) h->push_back(std::make_shared<TransformerBlockImpl>(c, false));
    transformer->update(std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{
        {"wte", wte}, {"wpe", wpe}, {"h", h.ptr()}});
  }
  // The tokens with the CLS token appended and their positions, before the blocks.
  at::Tensor embed(const at::Tensor& ids, Dt dt) {
    const i64 B = ids.size(0), T = ids.size(1);
    if (T + 1 > block_size_)
      throw Error(fmt::format("coca: a text of {} tokens is longer than text_decoder_config.block_size {}", T,
                              block_size_ - 1));
    at::Tensor x =
        at::cat({at::embedding(cast(wte->weight, dt), ids), cast(cls_token, dt).expand({B, 1, cls_token.size(2)})}, 1);
    x = x + cast(wpe->weight, dt).narrow(0, 0, T + 1);
    if (dropout_ > 0) x = at::dropout(x, dropout_, is_training());
    return x;
  }
  at::Tensor cls_token;
  torch::nn::ModuleDict transformer{nullptr};
  std::shared_ptr<EmbeddingImpl> wte, wpe;
  torch::nn::ModuleList h{nullptr};

 private:
  double dropout_;
  i64 block_size_;
};

// The multimodal decoder: blocks with cross-attention to the pooled image tokens, ln_f, lm_head
// (no bias; its weight is the text decoder's wte, tied).
class MultiModalTextDecoderImpl final : public torch::nn::Module {
 public:
  explicit MultiModalTextDecoderImpl(const TextDecoderConfig& c) : torch::nn::Module("MultiModalTextDecoder") {
    transformer = register_module("transformer", torch::nn::ModuleDict());
    h = torch::nn::ModuleList();
    for (i64 i = 0; i < c.n_layer_multimodal_text; ++i) h->push_back(std::make_shared<TransformerBlockImpl>(c, true));
    ln_f = std::make_shared<LayerNormImpl>(c.n_embd, c.epsilon, c.bias);
    transformer->update(
        std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{{"h", h.ptr()}, {"ln_f", ln_f}});
    lm_head = register_module("lm_head", std::make_shared<LinearImpl>(c.n_embd, c.vocab_size, false));
  }
  // After the blocks: ln_f and the (tied) head.
  at::Tensor head(const at::Tensor& x, Dt dt) { return (*lm_head)((*ln_f)(x, dt), dt); }
  torch::nn::ModuleDict transformer{nullptr};
  torch::nn::ModuleList h{nullptr};
  std::shared_ptr<LayerNormImpl> ln_f;
  std::shared_ptr<LinearImpl> lm_head;
};

// Attention pooling: learned queries cross-attend to the normed image tokens; the output normed
// again (no residual, no MLP).
class AttentionPoolingImpl final : public torch::nn::Module {
 public:
  AttentionPoolingImpl(i64 n_embd, i64 n_head, bool bias, double eps, bool flash)
      : torch::nn::Module("AttentionPooling") {
    ln_1 = register_module("ln_1", std::make_shared<LayerNormImpl>(n_embd, eps, bias));
    attn = register_module(
        "attn", std::make_shared<MultiHeadAttentionImpl>(n_embd, n_head, true, AttentionType::kCross, flash));
    ln_2 = register_module("ln_2", std::make_shared<LayerNormImpl>(n_embd, eps, bias));
  }
  at::Tensor operator()(const at::Tensor& queries, const at::Tensor& tokens, Dt dt) {
    return (*ln_2)((*attn)(queries, dt, (*ln_1)(tokens, dt)), dt);
  }
  std::shared_ptr<LayerNormImpl> ln_1, ln_2;
  std::shared_ptr<MultiHeadAttentionImpl> attn;
};

// The root, CoCa: registered in Modalities' order (vision_queries is the root's own parameter).
class CoCaImpl final : public torch::nn::Module {
 public:
  explicit CoCaImpl(const CoCaConfig& c) : torch::nn::Module("CoCa") {
    const VisionTransformerConfig& v = c.vision_encoder_config;
    vision_queries = register_parameter("vision_queries", at::randn({c.n_vision_queries + 1, v.n_embd}));
    vision_encoder = register_module("vision_encoder", std::make_shared<VisionTransformerImpl>(v));
    text_decoder = register_module("text_decoder", std::make_shared<TextDecoderImpl>(c.text_decoder_config));
    multimodal_decoder =
        register_module("multimodal_decoder", std::make_shared<MultiModalTextDecoderImpl>(c.text_decoder_config));
    attn_pool = register_module("attn_pool", std::make_shared<AttentionPoolingImpl>(
                                                 v.n_embd, c.n_pool_head, c.bias_attn_pool, c.epsilon_attn_pool,
                                                 c.text_decoder_config.attention_config.flash()));
    tie();
  }
  // Weight tying: the text decoder's wte is lm_head's weight (one tensor under both names).
  void tie() { text_decoder->wte->tie(multimodal_decoder->lm_head->weight); }
  std::shared_ptr<VisionTransformerImpl> vision_encoder;
  std::shared_ptr<TextDecoderImpl> text_decoder;
  std::shared_ptr<MultiModalTextDecoderImpl> multimodal_decoder;
  std::shared_ptr<AttentionPoolingImpl> attn_pool;
  at::Tensor vision_queries;
};

// --- the Module -------------------------------------------------------------------------------

std::string keys_of(const TensorMap& inputs) {
  std::string out;
  for (const auto& [k, v] : inputs) out += (out.empty() ? "'" : ", '") + k + "'";
  return out.empty() ? "nothing" : out;
}

class CoCa final : public Module {
 public:
  CoCa(CoCaConfig c, const c10::Device& device) : c_(std::move(c)) {
    impl_ = std::make_shared<CoCaImpl>(c_);
    if (device != c10::Device(c10::kCPU)) Module::to(device, std::nullopt);
  }

  // inputs: images [B, C, H, W] (any floating dtype: cast to the model's, as FSDP1's mixed precision
  // casts Modalities' float64 dummy images) and token ids [B, T] -> logits [B, T, V], vision_cls
  // [B, 1, Dv], text_cls [B, 1, D].
  TensorMap forward(const TensorMap& inputs) override {
    const VisionTransformerConfig& v = c_.vision_encoder_config;
    const TextDecoderConfig& t = c_.text_decoder_config;
    const at::Tensor& images = input(inputs, v.sample_key, "vision_encoder_config.sample_key");
    const at::Tensor& ids = input(inputs, t.sample_key, "text_decoder_config.sample_key");
    if (images.dim() != 4 || images.size(1) != v.n_img_channels || images.size(2) != v.img_size.height ||
        images.size(3) != v.img_size.width || !images.is_floating_point())
      throw Error(
          fmt::format("coca: the input '{}' is {} {}; expected floating-point images [B, {}, {}, {}] "
                      "(vision_encoder_config.n_img_channels, img_size)",
                      v.sample_key, c10::toString(images.scalar_type()), c10::str(images.sizes()), v.n_img_channels,
                      v.img_size.height, v.img_size.width));
    if (ids.dim() != 2 || ids.size(0) != images.size(0) || ids.is_floating_point())
      throw Error(
          fmt::format("coca: the input '{}' is {} {}; expected integer token ids [B, T] with the images' B = {}",
                      t.sample_key, c10::toString(ids.scalar_type()), c10::str(ids.sizes()), images.size(0)));
    const Dt dt = param_dtype_;
    const at::Tensor& w = impl_->vision_queries;
    const i64 B = images.size(0);
    const at::Tensor root_in[] = {ids};
    if (!hooks_.empty()) hooks_.call(HookPoint::kPreForward, "", "CoCa", root_in, {});
    at::Tensor x = impl_->vision_encoder->embed(images.to(dt ? *dt : w.scalar_type()), dt);  // [B, Np, Dv]
    i64 k = 0;
    for (const auto& m : *impl_->vision_encoder->blocks) {
      auto* block = m->as<VisionTransformerBlockImpl>();
      x = run_block(fmt::format("vision_encoder.blocks.{}", k++), "VisionTransformerBlock", x,
                    [block, dt](const at::Tensor& in) { return (*block)(in, dt); });
    }
    const at::Tensor queries = cast(w, dt).unsqueeze(0).expand({B, w.size(0), w.size(1)});
    const at::Tensor pooled = (*impl_->attn_pool)(queries, x, dt);  // [B, Nq + 1, Dv]
    const i64 nq = w.size(0) - 1;
    const at::Tensor image_tokens = pooled.narrow(1, 0, nq);
    at::Tensor text = impl_->text_decoder->embed(ids.to(at::kLong), dt);  // [B, T + 1, D]
    k = 0;
    for (const auto& m : *impl_->text_decoder->h) {
      auto* block = m->as<TransformerBlockImpl>();
      text = run_block(fmt::format("text_decoder.transformer.h.{}", k++), "TransformerBlock", text,
                       [block, dt](const at::Tensor& in) { return (*block)(in, dt); });
    }
    const i64 T = text.size(1) - 1;
    at::Tensor y = text.narrow(1, 0, T);
    k = 0;
    for (const auto& m : *impl_->multimodal_decoder->h) {
      auto* block = m->as<TransformerBlockImpl>();
      y = run_block(fmt::format("multimodal_decoder.transformer.h.{}", k++), "TransformerBlock", y,
                    [block, dt, image_tokens](const at::Tensor& in) { return (*block)(in, dt, image_tokens); });
    }
    const at::Tensor logits = impl_->multimodal_decoder->head(y, dt);
    if (!hooks_.empty()) {
      const at::Tensor root_out[] = {logits};
      hooks_.call(HookPoint::kForward, "", "CoCa", root_in, root_out);
      if (hooks_.wants("")) hooks_.on_backward(logits, "", "CoCa");
    }
    return {{c_.prediction_key, logits},
            {c_.vision_cls_prediction_key, pooled.narrow(1, nq, 1)},
            {c_.text_cls_prediction_key, text.narrow(1, T, 1)}};
  }

  torch::nn::Module& module() override { return *impl_; }
  const torch::nn::Module& module() const override { return *impl_; }
  std::string sample_key() const override { return c_.text_decoder_config.sample_key; }
  std::string prediction_key() const override { return c_.prediction_key; }

  // The tied weight once, as text_decoder.transformer.wte.weight (PyTorch's named_parameters).
  NamedTensors named_parameters() const override { return unique_named_parameters(*impl_); }

  // Mixed precision (model/mixed_precision, FSDP's param_dtype): every use casts to `dtype`.
  void set_param_dtype(std::optional<c10::ScalarType> dtype) override {
    if (dtype && !c10::isFloatingType(*dtype))
      throw Error(fmt::format("coca: set_param_dtype needs a floating-point dtype, got {}", c10::toString(*dtype)));
    const c10::ScalarType storage = impl_->vision_queries.scalar_type();
    param_dtype_ = dtype && *dtype != storage ? dtype : std::nullopt;
  }
  std::optional<c10::ScalarType> param_dtype() const override { return param_dtype_; }

  // The blocks FSDP wraps and activation checkpointing runs (block_names TransformerBlock,
  // VisionTransformerBlock find them by class).
  std::vector<std::string> block_fqns() const override {
    std::vector<std::string> out;
    for (std::size_t i = 0; i < impl_->vision_encoder->blocks->size(); ++i)
      out.push_back(fmt::format("vision_encoder.blocks.{}", i));
    for (std::size_t i = 0; i < impl_->text_decoder->h->size(); ++i)
      out.push_back(fmt::format("text_decoder.transformer.h.{}", i));
    for (std::size_t i = 0; i < impl_->multimodal_decoder->h->size(); ++i)
      out.push_back(fmt::format("multimodal_decoder.transformer.h.{}", i));
    return out;
  }
  std::shared_ptr<RemovableHandle> add_hook(ModuleHook hook, std::span<const std::string> fqns) override {
    return hooks_.add(std::move(hook), fqns, block_fqns(), "coca");
  }
  std::shared_ptr<RemovableHandle> add_block_runner(BlockRunner runner, std::span<const std::string> fqns) override {
    return hooks_.add_runner(std::move(runner), fqns, block_fqns(), "coca");
  }

  // Modalities' model_initialized first calls reset_parameters() of every submodule that has one
  // (Conv2d, Linear, Embedding, LayerNorm; the tied weight twice), then the initializer; the pooling
  // queries and the text CLS token keep their values.
  void reset_parameters() override {
    for (const auto& t : impl_->parameters())
      if (t.is_meta()) throw Error("coca: reset_parameters() needs materialized tensors");
    for (const auto& m : impl_->modules(/*include_self=*/false)) {
      if (auto* l = dynamic_cast<LinearImpl*>(m.get())) l->reset();
      else if (auto* n = dynamic_cast<LayerNormImpl*>(m.get())) n->reset();
      else if (auto* e = dynamic_cast<EmbeddingImpl*>(m.get())) e->reset();
      else if (auto* c = dynamic_cast<Conv2dImpl*>(m.get())) c->reset();
    }
  }

  // The tied weight under either name is enough (with both, lm_head's wins: PyTorch loads it last).
  void load_state_dict(const StateDict& state, bool strict) override {
    StateDict s = state;
    const auto wte = s.find(kWte), head = s.find(kLmHead);
    if (head != s.end()) s[kWte] = head->second;
    else if (wte != s.end()) s[kLmHead] = wte->second;
    Module::load_state_dict(s, strict);
  }

 private:
  static constexpr const char* kWte = "text_decoder.transformer.wte.weight";
  static constexpr const char* kLmHead = "multimodal_decoder.lm_head.weight";

  static const at::Tensor& input(const TensorMap& inputs, const std::string& key, const char* field) {
    const auto it = inputs.find(key);
    if (it == inputs.end())
      throw Error(fmt::format("coca: the input has no '{}' ({}); it has {}", key, field, keys_of(inputs)));
    return it->second;
  }

  at::Tensor run_block(const std::string& fqn, const std::string& class_name, const at::Tensor& x,
                       const BlockFunction& f) const {
    return hooks_.empty() ? f(x) : hooks_.around(fqn, class_name, x, f);
  }

  CoCaConfig c_;
  std::shared_ptr<CoCaImpl> impl_;
  Dt param_dtype_;
  ModuleHooks hooks_;
};

}  // namespace

void register_components(Registrar& r) {
  r.add<Module, CoCaConfig>(
      "coca",
      "Modalities' CoCa: a vision transformer, attention pooling by learned queries, a text decoder with an "
      "appended CLS token and a multimodal decoder cross-attending to the pooled image tokens; captioning logits "
      "and the pooled image / text embeddings, state dict and numerics as in Modalities.",
      [](const CoCaConfig& c) {
        // torch.manual_seed reinterprets a negative seed as its two's complement uint64.
        if (c.seed) at::manual_seed(static_cast<std::uint64_t>(*c.seed));
        return std::make_shared<CoCa>(c, run_device());
      });
}

}  // namespace modalities::plugins::coca

MODALITIES_PLUGIN(coca, MODALITIES_PLUGIN_VERSION, modalities::plugins::coca::register_components)
