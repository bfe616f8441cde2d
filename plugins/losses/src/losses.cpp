// loss/clm_cross_entropy_loss (README.md): mean
// token cross-entropy of a causal LM's logits [B, T, V] against the collator's
// already-shifted targets [B, T], ignore index -100, computed in the logits'
// dtype (so a bf16 forward gives a bf16 loss, exactly as Modalities logs it).
#include <modalities/sdk/interfaces/batch.h>
#include <modalities/sdk/interfaces/loss.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/tensor_parallel.h>

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>
#include <fmt/format.h>

#include <string>

namespace modalities::plugins::losses {
namespace {

constexpr std::int64_t kIgnoreIndex = -100;  // PyTorch's CrossEntropyLoss default

struct ClmCrossEntropyLossConfig {
  std::string target_key;
  std::string prediction_key;
  std::string tag = "CLMCrossEntropyLoss";

  static void describe(Schema<ClmCrossEntropyLossConfig>& s) {
    s.field("target_key", &ClmCrossEntropyLossConfig::target_key, "Batch target holding the labels [B, T].")
        .required()
        .non_empty();
    s.field("prediction_key", &ClmCrossEntropyLossConfig::prediction_key, "Model output holding the logits [B, T, V].")
        .required()
        .non_empty();
    s.field("tag", &ClmCrossEntropyLossConfig::tag,
            "Name of this loss in evaluation results (Modalities' config ignores this key).")
        .non_empty();
  }
};

std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (std::int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

class ClmCrossEntropyLoss final : public Loss {
 public:
  explicit ClmCrossEntropyLoss(ClmCrossEntropyLossConfig c) : c_(std::move(c)) {}

  at::Tensor compute(const InferenceResultBatch& batch) const override {
    if (batch.vocab_shard) return compute_vocab_parallel(batch);
    return compute(batch.get_predictions(c_.prediction_key), batch.get_targets(c_.target_key));
  }
  bool accepts_vocab_shards() const override { return true; }

  // logits: [..., V], labels: [...] with the same leading shape -> 0-dim loss in
  // the logits' dtype. All labels ignored -> NaN (0/0), as in PyTorch.
  at::Tensor compute(const at::Tensor& logits, const at::Tensor& targets) const override {
    MODALITIES_CHECK(logits.defined() && targets.defined(), "{}: undefined logits or targets tensor", c_.tag);
    MODALITIES_CHECK(logits.dim() >= 2 && c10::isFloatingType(logits.scalar_type()),
                     "{}: predictions '{}' must be floating-point logits [B, T, V], got {} {}", c_.tag,
                     c_.prediction_key, c10::toString(logits.scalar_type()), shape_of(logits));
    const std::int64_t vocab = logits.size(-1);
    MODALITIES_CHECK(targets.numel() * vocab == logits.numel(),
                     "{}: targets '{}' {} do not fit the logits '{}' {} (expected the logits' shape without its last "
                     "dimension)",
                     c_.tag, c_.target_key, shape_of(targets), c_.prediction_key, shape_of(logits));
    // Labels follow the logits (model parallelism may put them elsewhere) as int64.
    const at::Tensor labels = targets.to(logits.device(), at::kLong);
    return at::cross_entropy_loss(logits.reshape({-1, vocab}), labels.reshape({-1}), /*weight=*/{}, at::Reduction::Mean,
                                  kIgnoreIndex, /*label_smoothing=*/0.0);
  }

  // Loss parallel: logits [..., V / tp] hold classes [start, start + V / tp) on this rank; the
  // per-token losses come from tp::vocab_parallel_cross_entropy (three all-reduces of one value
  // per token, no logits gathered), then the same mean over the tokens that are not ignored.
  at::Tensor compute_vocab_parallel(const InferenceResultBatch& batch) const {
    const at::Tensor& logits = batch.get_predictions(c_.prediction_key);
    const at::Tensor& targets = batch.get_targets(c_.target_key);
    const tp::VocabShard& shard = *batch.vocab_shard;
    MODALITIES_CHECK(logits.dim() >= 2 && c10::isFloatingType(logits.scalar_type()),
                     "{}: predictions '{}' must be floating-point logits [B, T, V / tp], got {} {}", c_.tag,
                     c_.prediction_key, c10::toString(logits.scalar_type()), shape_of(logits));
    const std::int64_t local_vocab = logits.size(-1);
    MODALITIES_CHECK(targets.numel() * local_vocab == logits.numel(),
                     "{}: targets '{}' {} do not fit the vocabulary-split logits '{}' {}", c_.tag, c_.target_key,
                     shape_of(targets), c_.prediction_key, shape_of(logits));
    const at::Tensor labels = targets.to(logits.device(), at::kLong).reshape({-1});
    const at::Tensor per_token = tp::vocab_parallel_cross_entropy(logits.reshape({-1, local_vocab}), labels,
                                                                  shard.start, shard.group, kIgnoreIndex);
    const at::Tensor counted = labels.ne(kIgnoreIndex).sum().to(per_token.scalar_type());
    return per_token.sum() / counted;
  }

  std::string tag() const override { return c_.tag; }
  std::string target_key() const override { return c_.target_key; }
  std::string prediction_key() const override { return c_.prediction_key; }

 private:
  ClmCrossEntropyLossConfig c_;
};

}  // namespace

void register_components(Registrar& r) {
  r.add<Loss, ClmCrossEntropyLossConfig>(
      "clm_cross_entropy_loss", "Mean token cross-entropy of LM logits vs. shifted targets (ignore index -100).",
      [](const ClmCrossEntropyLossConfig& c) { return std::make_shared<ClmCrossEntropyLoss>(c); });
}

}  // namespace modalities::plugins::losses

MODALITIES_PLUGIN(losses, MODALITIES_PLUGIN_VERSION, modalities::plugins::losses::register_components)
