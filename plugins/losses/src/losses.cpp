// The losses (README.md): loss/clm_cross_entropy_loss, the mean token cross-entropy of a causal
// LM's logits [B, T, V] against the collator's already-shifted targets [B, T], ignore index -100,
// computed in the logits' dtype (so a bf16 forward gives a bf16 loss, exactly as Modalities logs
// it); loss/moe_aux_loss, a model's auxiliary-loss output as a loss; loss/weighted_sum of losses.
#include <modalities/sdk/context_parallel.h>
#include <modalities/sdk/interfaces/batch.h>
#include <modalities/sdk/interfaces/loss.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/tensor_parallel.h>

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

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
    if (batch.sequence_shard) return compute_context_parallel(batch);
    if (batch.vocab_shard) return compute_vocab_parallel(batch);
    return compute(batch.get_predictions(c_.prediction_key), batch.get_targets(c_.target_key));
  }
  bool accepts_vocab_shards() const override { return true; }
  bool accepts_sequence_shards() const override { return true; }

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

  // Context parallel: the logits [B, T / cp, V] (or [..., V / tp] under loss parallelism) are this
  // rank's tokens of whole targets [B, T]. This rank's share of the mean over the whole sequences:
  // the sum of its tokens' losses over the number of counted targets of all cp ranks (one
  // all-reduce of an integer), times cp, so that the mean over the cp ranks, which the gym logs and
  // FSDP's gradient average takes, is the mean loss of the whole sequences as one process computes
  // it, also when the ranks hold different numbers of ignored targets. (Modalities averages the
  // ranks' local means, which differs when they do.)
  at::Tensor compute_context_parallel(const InferenceResultBatch& batch) const {
    const cp::SequenceShard& shard = *batch.sequence_shard;
    const at::Tensor& logits = batch.get_predictions(c_.prediction_key);
    const at::Tensor& targets = batch.get_targets(c_.target_key);
    MODALITIES_CHECK(logits.dim() >= 3 && c10::isFloatingType(logits.scalar_type()),
                     "{}: predictions '{}' must be floating-point logits [B, T / cp, V] under context parallelism, "
                     "got {} {}",
                     c_.tag, c_.prediction_key, c10::toString(logits.scalar_type()), shape_of(logits));
    MODALITIES_CHECK(
        targets.dim() >= 2 && targets.size(0) == logits.size(0) && targets.size(1) == logits.size(1) * shard.size,
        "{}: targets '{}' {} do not fit the logits '{}' {} of this rank's tokens of {} context-parallel "
        "ranks (expected [B, T] with T = {} x the logits' second dimension)",
        c_.tag, c_.target_key, shape_of(targets), c_.prediction_key, shape_of(logits), shard.size, shard.size);
    const at::Tensor labels = shard.shard(targets.to(logits.device(), at::kLong), 1).reshape({-1});
    const std::int64_t vocab = logits.size(-1);
    at::Tensor sum;
    if (batch.vocab_shard)
      sum = tp::vocab_parallel_cross_entropy(logits.reshape({-1, vocab}), labels, batch.vocab_shard->start,
                                             batch.vocab_shard->group, kIgnoreIndex)
                .sum();
    else
      sum = at::cross_entropy_loss(logits.reshape({-1, vocab}), labels, /*weight=*/{}, at::Reduction::Sum, kIgnoreIndex,
                                   /*label_smoothing=*/0.0);
    // The count stays on the labels' device (no host sync; NCCL reduces device tensors), and the
    // scale is formed in float32 (a bf16 count would round).
    std::vector<at::Tensor> counted = {labels.ne(kIgnoreIndex).sum().reshape({1})};
    if (shard.group && shard.size > 1) shard.group->allreduce(counted)->wait();
    const at::Tensor count = counted.front().reshape({}).to(at::kFloat);
    return (sum.to(at::kFloat) * static_cast<double>(shard.size) / count).to(sum.scalar_type());
  }

  std::string tag() const override { return c_.tag; }
  std::string target_key() const override { return c_.target_key; }
  std::string prediction_key() const override { return c_.prediction_key; }

 private:
  ClmCrossEntropyLossConfig c_;
};

// --- moe_aux_loss ---------------------------------------------------------------------

struct MoeAuxLossConfig {
  std::string prediction_key = "moe_aux_loss";
  std::string tag = "MoEAuxLoss";

  static void describe(Schema<MoeAuxLossConfig>& s) {
    s.field("prediction_key", &MoeAuxLossConfig::prediction_key,
            "Model output holding the auxiliary loss, a 0-dim tensor (model/gpt2_moe: moe_config.aux_loss_key).")
        .non_empty();
    s.field("tag", &MoeAuxLossConfig::tag, "Name of this loss in evaluation results.").non_empty();
  }
};

// The model computed the loss (the MoE blocks' load-balancing and z-losses, with their
// coefficients); this hands it to the gym, usually as a term of loss/weighted_sum.
class MoeAuxLoss final : public Loss {
 public:
  explicit MoeAuxLoss(MoeAuxLossConfig c) : c_(std::move(c)) {}

  at::Tensor compute(const InferenceResultBatch& batch) const override {
    const auto it = batch.predictions.find(c_.prediction_key);
    if (it == batch.predictions.end()) {
      std::vector<std::string> keys;
      for (const auto& [k, v] : batch.predictions) keys.push_back(k);
      std::sort(keys.begin(), keys.end());
      throw Error(
          fmt::format("{}: the model gave no output '{}' (prediction_key); it gave {}. model/gpt2_moe gives it when "
                      "moe_config.aux_loss_coef or z_loss_coef is positive, under the name moe_config.aux_loss_key",
                      c_.tag, c_.prediction_key, fmt::join(keys, ", ")));
    }
    MODALITIES_CHECK(it->second.dim() == 0 && c10::isFloatingType(it->second.scalar_type()),
                     "{}: the output '{}' must be a floating-point scalar (0-dim), got {} {}", c_.tag,
                     c_.prediction_key, c10::toString(it->second.scalar_type()), shape_of(it->second));
    return it->second;
  }
  at::Tensor compute(const at::Tensor&, const at::Tensor&) const override {
    throw Error(
        fmt::format("{}: the auxiliary loss is a model output of its own, which a pipeline schedule does not pass on "
                    "(it gives the last stage's logits only); train MoE models with auxiliary losses without pipeline "
                    "parallelism",
                    c_.tag));
  }
  bool accepts_vocab_shards() const override { return true; }  // reads no logits
  // Under context parallelism each rank's blocks route its own tokens, and their loss is this
  // rank's, averaged over the cp ranks as over data-parallel ranks (whose losses are per batch).
  bool accepts_sequence_shards() const override { return true; }
  std::string tag() const override { return c_.tag; }
  std::string target_key() const override { return {}; }
  std::string prediction_key() const override { return c_.prediction_key; }

 private:
  MoeAuxLossConfig c_;
};

// --- weighted_sum ----------------------------------------------------------------------

struct WeightedSumLossConfig {
  std::vector<Ref<Loss>> losses;
  std::vector<double> weights;
  std::string tag = "WeightedSumLoss";

  static void describe(Schema<WeightedSumLossConfig>& s) {
    s.field("losses", &WeightedSumLossConfig::losses,
            "The losses to add up, in order; the first names the logits and targets (prediction_key, "
            "target_key) for the pipeline and tensor-parallel paths.")
        .required()
        .non_empty();
    s.field("weights", &WeightedSumLossConfig::weights,
            "The weight of each loss (one per loss); empty (the default): all 1.");
    s.field("tag", &WeightedSumLossConfig::tag, "Name of this loss in evaluation results.").non_empty();
    s.rule([](const WeightedSumLossConfig& c, ParseContext& ctx) {
      if (!c.weights.empty() && c.weights.size() != c.losses.size())
        ctx.fail("weights",
                 fmt::format("expected one weight per loss ({}), got {}", c.losses.size(), c.weights.size()));
      for (std::size_t i = 0; i < c.weights.size(); ++i)
        if (!std::isfinite(c.weights[i]))
          ctx.fail(fmt::format("weights[{}]", i), fmt::format("is {}; expected a finite number", c.weights[i]));
    });
  }
};

// sum_i weights[i] * losses[i], in the dtype of the first loss's result (the logits' dtype for
// loss/clm_cross_entropy_loss); a weight of exactly 1 multiplies nothing.
class WeightedSumLoss final : public Loss {
 public:
  explicit WeightedSumLoss(const WeightedSumLossConfig& c) : tag_(c.tag), weights_(c.weights) {
    for (const auto& l : c.losses) losses_.push_back(l.shared());
    if (weights_.empty()) weights_.assign(losses_.size(), 1.0);
  }

  at::Tensor compute(const InferenceResultBatch& batch) const override {
    return sum([&](const Loss& l) { return l.compute(batch); });
  }
  at::Tensor compute(const at::Tensor& predictions, const at::Tensor& targets) const override {
    return sum([&](const Loss& l) { return l.compute(predictions, targets); });
  }
  bool accepts_vocab_shards() const override {
    return std::all_of(losses_.begin(), losses_.end(), [](const auto& l) { return l->accepts_vocab_shards(); });
  }
  bool accepts_sequence_shards() const override {
    return std::all_of(losses_.begin(), losses_.end(), [](const auto& l) { return l->accepts_sequence_shards(); });
  }
  std::string tag() const override { return tag_; }
  std::string target_key() const override { return losses_.front()->target_key(); }
  std::string prediction_key() const override { return losses_.front()->prediction_key(); }

 private:
  template <class F>
  at::Tensor sum(F&& term) const {
    at::Tensor total;
    for (std::size_t i = 0; i < losses_.size(); ++i) {
      at::Tensor t = term(*losses_[i]);
      if (total.defined()) t = t.to(total.scalar_type());
      if (weights_[i] != 1.0) t = t * weights_[i];
      total = total.defined() ? total + t : t;
    }
    return total;
  }

  std::string tag_;
  std::vector<std::shared_ptr<Loss>> losses_;
  std::vector<double> weights_;
};

}  // namespace

void register_components(Registrar& r) {
  r.add<Loss, ClmCrossEntropyLossConfig>(
      "clm_cross_entropy_loss", "Mean token cross-entropy of LM logits vs. shifted targets (ignore index -100).",
      [](const ClmCrossEntropyLossConfig& c) { return std::make_shared<ClmCrossEntropyLoss>(c); });
  r.add<Loss, MoeAuxLossConfig>(
      "moe_aux_loss",
      "A model's auxiliary-loss output (0-dim) as a loss: model/gpt2_moe's load-balancing and router z-losses, "
      "usually a term of loss/weighted_sum.",
      [](const MoeAuxLossConfig& c) { return std::make_shared<MoeAuxLoss>(c); });
  r.add<Loss, WeightedSumLossConfig>(
      "weighted_sum", "The weighted sum of other losses (e.g. cross-entropy + a MoE model's auxiliary loss).",
      [](const WeightedSumLossConfig& c) { return std::make_shared<WeightedSumLoss>(c); });
}

}  // namespace modalities::plugins::losses

MODALITIES_PLUGIN(losses, MODALITIES_PLUGIN_VERSION, modalities::plugins::losses::register_components)
