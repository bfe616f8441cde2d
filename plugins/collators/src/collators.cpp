// The `collate_fn` variants of Modalities (README.md):
//   gpt_2_llm_collator          stack, then inputs = X[:, :-1], targets = X[:, 1:]
//   mask_loss_collator_wrapper  wrap another collator; keep only target tokens strictly
//                               between a begin and an end marker (instruction tuning)
//   coca_collator               stack several keys; split the text key like GPT-2
// Token tensors come out as int64 whatever the dataset's dtype (quirk Q12).
// Shape legend: b = batch size, B = tokens per sample.
#include <modalities/sdk/interfaces/collate_fn.h>
#include <modalities/sdk/interfaces/tokenizer.h>
#include <modalities/sdk/log.h>
#include <modalities/sdk/plugin.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace modalities::plugins::collators {
namespace {

// The tensors under `key`, one per sample, checked to exist and to have one shape. Errors name
// the key and the sample.
std::vector<at::Tensor> key_parts(std::span<const Sample> samples, const std::string& key, const char* who) {
  MODALITIES_CHECK(!samples.empty(), "{}: cannot collate an empty batch", who);
  std::vector<at::Tensor> parts;
  parts.reserve(samples.size());
  for (std::size_t i = 0; i < samples.size(); ++i) {
    auto it = samples[i].find(key);
    if (it == samples[i].end()) {
      std::string keys;
      for (const auto& [k, v] : samples[i]) keys += (keys.empty() ? "'" : ", '") + k + "'";
      throw Error(fmt::format("{}: sample {} of the batch has no key '{}' (it has {})", who, i, key,
                              keys.empty() ? "no keys" : keys));
    }
    if (!parts.empty() && it->second.sizes() != parts.front().sizes())
      throw Error(fmt::format("{}: sample {} of the batch has '{}' of shape {}, but sample 0 has {}", who, i, key,
                              c10::str(it->second.sizes()), c10::str(parts.front().sizes())));
    parts.push_back(it->second);
  }
  return parts;
}

// Stacks samples[i][key] along a new dim 0: b x [...] -> [b, ...].
at::Tensor stack_key(std::span<const Sample> samples, const std::string& key, const char* who) {
  return at::stack(key_parts(samples, key, who));
}

// Token rows of equal length L on the CPU -> (rows[:, :-1], rows[:, 1:]) as int64 [b, L-1],
// written directly: what stack + to(kLong) + two slices + contiguous compute, without the six
// tensor ops (~30 us per batch of host time, paid per training step). nullopt for other
// layouts, which take the tensor-op path.
template <class T>
void shift_rows(const std::vector<at::Tensor>& parts, std::int64_t* x, std::int64_t* y) {
  for (const at::Tensor& row : parts) {
    const T* t = row.const_data_ptr<T>();
    const std::int64_t n = row.size(0) - 1;
    for (std::int64_t j = 0; j < n; ++j) x[j] = static_cast<std::int64_t>(t[j]);
    for (std::int64_t j = 0; j < n; ++j) y[j] = static_cast<std::int64_t>(t[j + 1]);
    x += n;
    y += n;
  }
}

std::optional<std::pair<at::Tensor, at::Tensor>> shifted_token_rows(const std::vector<at::Tensor>& parts) {
  const at::Tensor& p0 = parts.front();
  if (p0.dim() != 1 || p0.size(0) < 2) return std::nullopt;
  for (const at::Tensor& p : parts)
    if (!p.is_cpu() || !p.is_contiguous() || p.scalar_type() != p0.scalar_type()) return std::nullopt;
  const std::int64_t b = static_cast<std::int64_t>(parts.size()), n = p0.size(0) - 1;
  at::Tensor x = at::empty({b, n}, at::kLong), y = at::empty({b, n}, at::kLong);
  std::int64_t* xp = x.mutable_data_ptr<std::int64_t>();
  std::int64_t* yp = y.mutable_data_ptr<std::int64_t>();
  switch (p0.scalar_type()) {
    case at::kLong: shift_rows<std::int64_t>(parts, xp, yp); break;
    case at::kInt: shift_rows<std::int32_t>(parts, xp, yp); break;
    case at::kUInt32: shift_rows<std::uint32_t>(parts, xp, yp); break;
    case at::kShort: shift_rows<std::int16_t>(parts, xp, yp); break;
    case at::kUInt16: shift_rows<std::uint16_t>(parts, xp, yp); break;
    case at::kByte: shift_rows<std::uint8_t>(parts, xp, yp); break;
    default: return std::nullopt;
  }
  return std::pair{std::move(x), std::move(y)};
}

// --- gpt_2_llm_collator ------------------------------------------------------------

struct Gpt2CollatorConfig {
  std::string sample_key;
  std::string target_key;
  static void describe(Schema<Gpt2CollatorConfig>& s) {
    s.field("sample_key", &Gpt2CollatorConfig::sample_key, "Key of the token array in samples and model inputs.")
        .required();
    s.field("target_key", &Gpt2CollatorConfig::target_key, "Key of the shifted targets.").required();
  }
};

class Gpt2Collator final : public CollateFn {
 public:
  explicit Gpt2Collator(Gpt2CollatorConfig c) : c_(std::move(c)) {}
  DatasetBatch collate(std::span<const Sample> samples) const override {
    const std::vector<at::Tensor> parts = key_parts(samples, c_.sample_key, "gpt_2_llm_collator");
    if (auto rows = shifted_token_rows(parts)) {
      DatasetBatch batch;
      batch.samples[c_.sample_key] = std::move(rows->first);   // [b, B-1]
      batch.targets[c_.target_key] = std::move(rows->second);  // [b, B-1]
      return batch;
    }
    const at::Tensor x = at::stack(parts).to(at::kLong);  // [b, B]
    MODALITIES_CHECK(x.dim() == 2 && x.size(1) >= 2,
                     "gpt_2_llm_collator: '{}' must be 1-D token arrays of at least 2 tokens, got shape {}",
                     c_.sample_key, c10::str(x.sizes()));
    DatasetBatch batch;
    batch.samples[c_.sample_key] = x.slice(1, 0, -1).contiguous();  // [b, B-1]
    batch.targets[c_.target_key] = x.slice(1, 1).contiguous();      // [b, B-1]
    return batch;
  }

 private:
  Gpt2CollatorConfig c_;
};

// --- mask_loss_collator_wrapper --------------------------------------------------------

struct MaskTokens {
  std::string b_include_to_loss_token;
  std::string e_include_to_loss_token;
  static void describe(Schema<MaskTokens>& s) {
    s.field("b_include_to_loss_token", &MaskTokens::b_include_to_loss_token,
            "Token after which targets count (itself excluded).")
        .required();
    s.field("e_include_to_loss_token", &MaskTokens::e_include_to_loss_token,
            "Token at which counting stops (itself excluded).")
        .required();
  }
};

struct MaskLossConfig {
  Ref<CollateFn> wrapped_collate_fn;
  std::vector<std::string> target_keys_to_mask;
  std::int64_t loss_ignore_index = 0;
  MaskTokens mask_tokens;
  Ref<Tokenizer> tokenizer;
  static void describe(Schema<MaskLossConfig>& s) {
    s.field("wrapped_collate_fn", &MaskLossConfig::wrapped_collate_fn, "Collator whose targets are masked.").required();
    s.field("target_keys_to_mask", &MaskLossConfig::target_keys_to_mask, "Target keys to mask.").required();
    s.field("loss_ignore_index", &MaskLossConfig::loss_ignore_index, "Value of masked targets (typically -100).")
        .required();
    s.field("mask_tokens", &MaskLossConfig::mask_tokens, "The begin and end marker tokens.").required();
    s.field("tokenizer", &MaskLossConfig::tokenizer, "Tokenizer that maps the marker tokens to ids.").required();
  }
};

class MaskLossCollator final : public CollateFn {
 public:
  MaskLossCollator(const MaskLossConfig& c, std::int64_t begin_id, std::int64_t end_id)
      : wrapped_(c.wrapped_collate_fn.shared()),
        keys_(c.target_keys_to_mask),
        ignore_(c.loss_ignore_index),
        begin_(begin_id),
        end_(end_id) {}

  DatasetBatch collate(std::span<const Sample> samples) const override {
    DatasetBatch batch = wrapped_->collate(samples);
    for (const auto& key : keys_) {
      auto it = batch.targets.find(key);
      if (it == batch.targets.end()) {
        std::string keys;
        for (const auto& [k, v] : batch.targets) keys += (keys.empty() ? "'" : ", '") + k + "'";
        throw Error(fmt::format("mask_loss_collator_wrapper: the wrapped collator produced no target '{}' (it has {})",
                                key, keys.empty() ? "none" : keys));
      }
      it->second = mask(it->second);
    }
    return batch;
  }

  // README "Loss masking", exactly as Modalities' _mask_target: y: [b, L] -> [b, L].
  at::Tensor mask(const at::Tensor& y) const {
    MODALITIES_CHECK(y.dim() == 2, "mask_loss_collator_wrapper: targets must be [batch, length], got shape {}",
                     c10::str(y.sizes()));
    if (!y.eq(begin_).any().item<bool>()) return skip(y, "begin", begin_);
    if (!y.eq(end_).any().item<bool>()) return skip(y, "end", end_);
    at::Tensor m = at::zeros_like(y);
    // The begin marker opens the span one position later, so it is itself excluded.
    m.slice(1, 1).add_(y.slice(1, 0, -1).eq(begin_).to(m.scalar_type()));
    m.sub_(y.eq(end_).to(m.scalar_type()));
    const at::Tensor include = m.cumsum(-1);
    if (include.lt(0).any().item<bool>() || include.gt(1).any().item<bool>())
      throw Error(
          "mask_loss_collator_wrapper: end mask token indicator is before begin mask token indicator in the target "
          "(or two begin markers without an end). This is not supported by the loss-masking collator (as in "
          "Modalities); make sure every block starts outside an assistant span, e.g. by padding and truncating "
          "for the continuous dataset with reuse_last_target = false");
    return at::where(include.to(at::kBool), y, at::scalar_tensor(ignore_, y.options()));
  }

 private:
  at::Tensor skip(const at::Tensor& y, const char* which, std::int64_t id) const {
    if (!warned_.exchange(true))
      log::rank_warning(fmt::format(
          "mask_loss_collator_wrapper: the {} mask token (id {}) does not occur in the batch's targets; the whole "
          "batch is excluded from the loss (further occurrences are not reported). Check how the tokenizer splits "
          "the marker (' <token>' and '<token>' differ) and whether the context is long enough.",
          which, id));
    return at::full_like(y, ignore_);
  }

  std::shared_ptr<CollateFn> wrapped_;
  std::vector<std::string> keys_;
  std::int64_t ignore_, begin_, end_;
  mutable std::atomic<bool> warned_{false};
};

std::shared_ptr<CollateFn> make_mask_loss(const MaskLossConfig& c) {
  auto id_of = [&](const std::string& token, const char* key) {
    try {
      return c.tokenizer->token_id(token);
    } catch (const std::exception& e) {
      throw ConfigError(fmt::format("mask_tokens.{}", key), e.what());
    }
  };
  const std::int64_t b = id_of(c.mask_tokens.b_include_to_loss_token, "b_include_to_loss_token");
  const std::int64_t e = id_of(c.mask_tokens.e_include_to_loss_token, "e_include_to_loss_token");
  if (b == e)
    throw ConfigError("mask_tokens",
                      fmt::format("b_mask_token_id and e_mask_token_id must be different, both are {} "
                                  "('{}' and '{}')",
                                  b, c.mask_tokens.b_include_to_loss_token, c.mask_tokens.e_include_to_loss_token));
  return std::make_shared<MaskLossCollator>(c, b, e);
}

// --- coca_collator ---------------------------------------------------------------------

struct CocaCollatorConfig {
  std::vector<std::string> sample_keys;
  std::vector<std::string> target_keys;
  std::string text_sample_key;
  std::string text_target_key;
  static void describe(Schema<CocaCollatorConfig>& s) {
    s.field("sample_keys", &CocaCollatorConfig::sample_keys, "Keys stacked into the model inputs.").required();
    s.field("target_keys", &CocaCollatorConfig::target_keys, "Keys stacked into the targets.").required();
    s.field("text_sample_key", &CocaCollatorConfig::text_sample_key, "Text key; inputs get all but its last token.")
        .required();
    s.field("text_target_key", &CocaCollatorConfig::text_target_key,
            "Target key receiving the text shifted by one token.")
        .required();
    s.rule([](const CocaCollatorConfig& c, ParseContext& ctx) {
      if (std::find(c.sample_keys.begin(), c.sample_keys.end(), c.text_sample_key) == c.sample_keys.end())
        ctx.fail("text_sample_key", fmt::format("'{}' must be one of sample_keys", c.text_sample_key));
      if (std::find(c.target_keys.begin(), c.target_keys.end(), c.text_target_key) != c.target_keys.end())
        ctx.fail("text_target_key", fmt::format("'{}' must not be one of target_keys", c.text_target_key));
    });
  }
};

class CocaCollator final : public CollateFn {
 public:
  explicit CocaCollator(CocaCollatorConfig c) : c_(std::move(c)) {}
  DatasetBatch collate(std::span<const Sample> samples) const override {
    DatasetBatch batch;
    for (const auto& k : c_.sample_keys) batch.samples[k] = stack_key(samples, k, "coca_collator");
    for (const auto& k : c_.target_keys) batch.targets[k] = stack_key(samples, k, "coca_collator");
    at::Tensor text = batch.samples[c_.text_sample_key].to(at::kLong);  // [b, B]
    MODALITIES_CHECK(text.dim() == 2 && text.size(1) >= 2,
                     "coca_collator: '{}' must be 1-D token arrays of at least 2 tokens", c_.text_sample_key);
    batch.targets[c_.text_target_key] = text.slice(1, 1).contiguous();
    batch.samples[c_.text_sample_key] = text.slice(1, 0, -1).contiguous();
    return batch;
  }

 private:
  CocaCollatorConfig c_;
};

// --- document_masking_collator_wrapper ---------------------------------------------------
// Note [Document ids]: a packed sample's documents end with the EOD token. For the inputs X
// [b, L] of the wrapped collator, the document of position t is the number of EOD tokens at
// positions before t: an EOD belongs to the document it ends, the token after it starts the next.
// With mask_boundary_targets the target at an EOD input (the next document's first token,
// predicted from the end of the previous one) becomes loss_ignore_index.

struct DocumentMaskingConfig {
  Ref<CollateFn> wrapped_collate_fn;
  std::string sample_key;
  std::string document_ids_key = "document_ids";
  std::int64_t eod_token_id = -1;
  bool mask_boundary_targets = false;
  std::optional<std::string> target_key;
  std::int64_t loss_ignore_index = -100;
  static void describe(Schema<DocumentMaskingConfig>& s) {
    using C = DocumentMaskingConfig;
    s.field("wrapped_collate_fn", &C::wrapped_collate_fn, "Collator whose batches get document ids.").required();
    s.field("sample_key", &C::sample_key, "Input key of the token ids [b, L] the documents are found in.").required();
    s.field("document_ids_key", &C::document_ids_key,
            "Input key the document ids [b, L] (int64) are written to; model/gpt2's document_ids_key reads it.")
        .non_empty();
    s.field("eod_token_id", &C::eod_token_id,
            "Id of the end-of-document token that separates the packed documents (the tokenizer's eod_token, "
            "e.g. 50256 for GPT-2's <|endoftext|>).")
        .required()
        .non_negative();
    s.field("mask_boundary_targets", &C::mask_boundary_targets,
            "Replace the target at every EOD input (the next document's first token) by loss_ignore_index.");
    s.field("target_key", &C::target_key, "Target key masked by mask_boundary_targets (required with it).");
    s.field("loss_ignore_index", &C::loss_ignore_index, "Value of masked targets.");
    s.rule([](const C& c, ParseContext& ctx) {
      if (c.mask_boundary_targets && !c.target_key)
        ctx.fail("target_key", "is missing; mask_boundary_targets = true needs the target key to mask");
      if (c.document_ids_key == c.sample_key)
        ctx.fail("document_ids_key", fmt::format("is '{}', the sample_key; choose another key", c.sample_key));
    });
  }
};

class DocumentMaskingCollator final : public CollateFn {
 public:
  explicit DocumentMaskingCollator(const DocumentMaskingConfig& c) : wrapped_(c.wrapped_collate_fn.shared()), c_(c) {}

  DatasetBatch collate(std::span<const Sample> samples) const override {
    DatasetBatch batch = wrapped_->collate(samples);
    const auto it = batch.samples.find(c_.sample_key);
    if (it == batch.samples.end())
      throw Error(
          fmt::format("document_masking_collator_wrapper: the wrapped collator's batch has no input '{}' "
                      "(sample_key)",
                      c_.sample_key));
    const at::Tensor& x = it->second;
    MODALITIES_CHECK(x.dim() == 2 && !at::isFloatingType(x.scalar_type()),
                     "document_masking_collator_wrapper: input '{}' must be token ids [b, L], got {} of shape {}",
                     c_.sample_key, c10::toString(x.scalar_type()), c10::str(x.sizes()));
    const at::Tensor eod = x.eq(c_.eod_token_id);
    // Ids count the EODs strictly before each position (Note [Document ids]).
    const at::Tensor counted = eod.to(at::kLong);
    const at::Tensor ids = counted.cumsum(1) - counted;
    if (c_.mask_boundary_targets) {
      const auto t = batch.targets.find(*c_.target_key);
      if (t == batch.targets.end())
        throw Error(
            fmt::format("document_masking_collator_wrapper: the wrapped collator's batch has no target '{}' "
                        "(target_key)",
                        *c_.target_key));
      MODALITIES_CHECK(t->second.sizes() == x.sizes(),
                       "document_masking_collator_wrapper: target '{}' has shape {}, input '{}' {}", *c_.target_key,
                       c10::str(t->second.sizes()), c_.sample_key, c10::str(x.sizes()));
      t->second = t->second.masked_fill(eod, c_.loss_ignore_index);
    }
    batch.samples[c_.document_ids_key] = ids.contiguous();
    return batch;
  }

 private:
  std::shared_ptr<CollateFn> wrapped_;
  DocumentMaskingConfig c_;
};

}  // namespace

void register_components(Registrar& r) {
  r.add<CollateFn, Gpt2CollatorConfig>(
      "gpt_2_llm_collator", "Stacks token arrays; inputs = all but the last token, targets = all but the first.",
      [](const Gpt2CollatorConfig& c) { return std::make_shared<Gpt2Collator>(c); });
  r.add<CollateFn, MaskLossConfig>(
      "mask_loss_collator_wrapper",
      "Keeps only target tokens strictly between begin and end markers; the rest become loss_ignore_index.",
      [](const MaskLossConfig& c) { return make_mask_loss(c); });
  r.add<CollateFn, DocumentMaskingConfig>(
      "document_masking_collator_wrapper",
      "Adds each token's document id within its packed sample (from the EOD token) for document-masked attention; "
      "optionally masks the targets across document boundaries.",
      [](const DocumentMaskingConfig& c) { return std::make_shared<DocumentMaskingCollator>(c); });
  r.add<CollateFn, CocaCollatorConfig>("coca_collator",
                                       "Stacks several keys; the text key is split into inputs and shifted targets.",
                                       [](const CocaCollatorConfig& c) { return std::make_shared<CocaCollator>(c); });
}

}  // namespace modalities::plugins::collators

MODALITIES_PLUGIN(collators, MODALITIES_PLUGIN_VERSION, modalities::plugins::collators::register_components)
