// The loss interface: turns a forward pass's predictions and the batch's
// targets into a scalar to backpropagate, and names itself for evaluation
// results. Maps Modalities' Loss (`loss/clm_cross_entropy_loss`).
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <ATen/core/Tensor.h>

#include <string>
#include <string_view>

namespace modalities {

/// A training objective over named predictions and targets.
///
/// Built once per run. The gym calls compute(batch) on its thread once per
/// micro-batch (training and evaluation); a pipeline schedule calls
/// compute(predictions, targets) on the last stage once per pipeline
/// micro-batch. Both must agree for the same tensors.
///
/// \code
///   InferenceResultBatch r{batch.targets, model->forward(batch.samples)};
///   at::Tensor loss = loss_fn->compute(r);  // 0-dim, dtype of the logits
///   (loss / grad_acc_steps).backward();
///   evaluation.losses.push_back({loss_fn->tag(), {loss, 2}});
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); it keeps no
/// reference to the tensors it was given.
/// Errors: throw modalities::Error (a missing key comes from
/// InferenceResultBatch::get_*); TORCH_CHECK in tensor code is fine; never
/// exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API Loss {
 public:
  static constexpr std::string_view kInterface = "Loss";
  static constexpr std::string_view kComponentKey = "loss";

  Loss() = default;
  Loss(const Loss&) = delete;
  Loss& operator=(const Loss&) = delete;
  virtual ~Loss();  // defined in the SDK library: one vtable, one typeinfo

  /// Scalar loss of predictions[prediction_key()] against targets[target_key()].
  virtual at::Tensor compute(const InferenceResultBatch& batch) const = 0;

  /// Same loss from the two tensors directly, e.g. logits [B, T, V] and
  /// labels [B, T] (the pipeline schedule's loss function).
  virtual at::Tensor compute(const at::Tensor& predictions, const at::Tensor& targets) const = 0;

  /// Name under which evaluation reports this loss ("CLMCrossEntropyLoss").
  virtual std::string tag() const = 0;

  /// Keys it reads; the pipeline path uses target_key() to pick the target tensor.
  virtual std::string target_key() const = 0;
  virtual std::string prediction_key() const = 0;

  /// Whether compute(batch) handles batch.vocab_shard: logits split on the vocabulary over a
  /// tensor-parallel group, reduced across it without gathering them. The gym refuses a model
  /// with a vocab shard and a loss without. Default: false.
  virtual bool accepts_vocab_shards() const;

  /// Whether compute(batch) handles batch.sequence_shard: predictions for this rank's tokens of
  /// sequences split over context-parallel ranks, against whole targets. Such a loss picks the
  /// same tokens of the targets and returns this rank's share of the loss of the whole sequences,
  /// scaled so that the mean over the cp ranks is that loss (the gym and FSDP average over them).
  /// The gym refuses a model with a sequence shard and a loss without. Default: false. Since: SDK
  /// 0.1 (ABI 9).
  virtual bool accepts_sequence_shards() const;
};

}  // namespace modalities
