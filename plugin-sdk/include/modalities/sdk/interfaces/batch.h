// Plain data types that travel between the component interfaces: batches of
// named tensors, the training progress that drives checkpointing, and the
// messages published to subscribers. They mirror Modalities' batch.py and its
// logging-broker payloads (see interfaces/README.md and
// plugins/subscribers/README.md). Members that report errors are in the SDK library
// (src/interfaces.cpp), so the structs that have them are exported.
#pragma once

#include <modalities/sdk/context_parallel.h>
#include <modalities/sdk/export.h>
#include <modalities/sdk/tensor_parallel.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace modalities {

// Note [at::Tensor spelling]
// torch::Tensor and at::Tensor are the same class. The SDK headers spell it
// at::Tensor because torch::Tensor is only declared by <torch/types.h>, which
// pulls in all of <ATen/ATen.h>; <ATen/core/Tensor.h> is enough to declare and
// pass tensors. Plugins may keep writing torch::Tensor.

/// Named tensors: {"input_ids": [B, T]} into a model, {"logits": [B, T, V]} out
/// of it. A std::map, so iteration is alphabetical where Python dicts keep
/// insertion order; only "the first entry" below depends on that, and batches
/// in practice carry one sample key. See Note [at::Tensor spelling].
using TensorMap = std::map<std::string, at::Tensor>;

/// A flat state dict: key -> tensor. For modules the keys are fully qualified
/// parameter/buffer names ("transformer.h.0.attn.q_attn.weight"); optimizers,
/// schedulers and AppState document their own key schemes. Same type as
/// TensorMap; the second name says what the keys mean.
using StateDict = std::map<std::string, at::Tensor>;

/// One dataset item: sample key -> 1-D token array (int64, or the dataset's
/// storage dtype). What Dataset::get returns and CollateFn::collate stacks.
using Sample = TensorMap;

/// A collated micro-batch: model inputs and the targets the loss compares
/// against. Produced by CollateFn and DatasetBatchGenerator, consumed by the
/// gym on its own thread. Copies share tensor storage (tensors are handles).
/// Since: SDK 0.1.
struct MODALITIES_SDK_API DatasetBatch {
  TensorMap samples;  // e.g. {"input_ids": [B, T]}
  TensorMap targets;  // e.g. {"target_ids": [B, T]}
  std::int64_t batch_dim = 0;
  /// Dataset indices of the samples, in batch order (set by `data_loader/default`; empty when the
  /// loader does not know them). The gym's data ledger hashes them per optimizer step.
  std::vector<std::int64_t> sample_ids;

  /// Moves every sample and target tensor to `device`, in place.
  void to(const c10::Device& device, bool non_blocking = false);
  /// Replaces every tensor by its detached view, in place.
  void detach();
  /// Device of the first sample tensor. Throws modalities::Error when there is none.
  c10::Device device() const;
  /// Number of samples: size of the first sample tensor along batch_dim.
  /// Throws modalities::Error when there is none.
  std::int64_t size() const;
};

/// What a forward pass produced, next to what it should have produced: the
/// argument of Loss::compute. Built by the gym from DatasetBatch::targets and
/// Module::forward's result. Since: SDK 0.1.
struct MODALITIES_SDK_API InferenceResultBatch {
  TensorMap targets;
  TensorMap predictions;
  std::int64_t batch_dim = 0;
  /// Set when the predictions are logits split on the vocabulary over a tensor-parallel group
  /// (the model's Module::vocab_shard); only a loss that accepts_vocab_shards() may take them.
  std::optional<tp::VocabShard> vocab_shard;
  /// Set when the predictions cover this rank's tokens of a sequence split over context-parallel
  /// ranks (the model's Module::sequence_shard); only a loss that accepts_sequence_shards() may
  /// take them. The targets are whole. Since: SDK 0.1 (ABI 9).
  std::optional<cp::SequenceShard> sequence_shard;

  /// The target / prediction under `key`. Throws modalities::Error naming the
  /// keys that exist when `key` is missing.
  const at::Tensor& get_targets(const std::string& key) const;
  const at::Tensor& get_predictions(const std::string& key) const;
  /// Moves every tensor to `device`, in place.
  void to(const c10::Device& device, bool non_blocking = false);
  void to_cpu();
  void detach();
  /// Size of the first prediction tensor along batch_dim. Throws
  /// modalities::Error when there is none.
  std::int64_t size() const;
};

/// One logged number. `decimal_places` rounds it when printed; without it the
/// tensor is printed as is (Modalities prints the tensor repr, e.g. "lr mean").
struct ResultItem {
  at::Tensor value;
  std::optional<int> decimal_places;
};

/// (name, item) pairs in insertion order. Not a map, because the order is
/// visible: it is the order of the printed log line and of the keys in the
/// JSONL results file.
using ResultItems = std::vector<std::pair<std::string, ResultItem>>;

/// Losses and metrics of one training-log step or one evaluation pass over a
/// loader, published as an EVALUATION_RESULT message. Since: SDK 0.1.
struct EvaluationResultBatch {
  std::string dataloader_tag;  // "train", "val", ...
  std::int64_t num_train_steps_done = 0;
  ResultItems losses;              // "train loss avg", "CLMCrossEntropyLoss", ...
  ResultItems metrics;             // "consumed tokens", "grad norm avg", ...
  ResultItems throughput_metrics;  // "train samples/s", "lr mean", ...
};

/// Modalities' text of a result, "step: n | k: v | ... | ": the throughput
/// metrics, losses and metrics in order, each group followed by " | " (also when
/// empty), every value the float32 mean of its tensor, rounded to its decimal
/// places and spelled as Python prints it. The one formatter of the training log
/// line: the gym and results_subscriber/rich both print it. Since: SDK 0.1 (ABI 4).
MODALITIES_SDK_API std::string result_line(const EvaluationResultBatch& r);

/// How far training is, counted in optimizer steps and tokens. The previous-run
/// counters are non-zero after a warm start; the totals are what checkpoint
/// names and interval checks use. Since: SDK 0.1.
struct TrainingProgress {
  std::int64_t num_seen_steps_current_run = 0;
  std::int64_t num_seen_tokens_current_run = 0;
  std::int64_t num_target_steps = 0;
  std::int64_t num_target_tokens = 0;
  std::int64_t num_seen_steps_previous_run = 0;
  std::int64_t num_seen_tokens_previous_run = 0;

  constexpr std::int64_t num_seen_steps_total() const noexcept {
    return num_seen_steps_previous_run + num_seen_steps_current_run;
  }
  constexpr std::int64_t num_seen_tokens_total() const noexcept {
    return num_seen_tokens_previous_run + num_seen_tokens_current_run;
  }
  friend bool operator==(const TrainingProgress&, const TrainingProgress&) = default;
};

/// What a CheckpointSavingStrategy decided: save the current state or not, and
/// which earlier checkpoints (identified by their progress) to delete after
/// saving. Since: SDK 0.1.
struct CheckpointingInstruction {
  bool save_current = false;
  std::vector<TrainingProgress> checkpoints_to_delete;
};

/// Message kinds of the logging broker. Only kBatchProgressUpdate and
/// kEvaluationResult are published today; the others exist so subscribers can
/// be written against the full Modalities set.
enum class MessageType {
  kHighLevelProgressUpdate,
  kBatchProgressUpdate,
  kErrorMessage,
  kEvaluationResult,
};

/// The Modalities spelling (enum value) of a message type.
constexpr std::string_view to_string(MessageType type) noexcept {
  switch (type) {
    case MessageType::kHighLevelProgressUpdate: return "HIGH_LEVEL_PROGRESS_UPDATE";
    case MessageType::kBatchProgressUpdate: return "PROGRESS_UPDATE";  // sic: value differs from the name
    case MessageType::kErrorMessage: return "ERROR_MESSAGE";
    case MessageType::kEvaluationResult: return "EVALUATION_RESULT";
  }
  return "UNKNOWN";
}

enum class ExperimentStatus { kTrain, kEvaluation };

constexpr std::string_view to_string(ExperimentStatus status) noexcept {
  switch (status) {
    case ExperimentStatus::kTrain: return "TRAIN";
    case ExperimentStatus::kEvaluation: return "EVALUATION";
  }
  return "UNKNOWN";
}

/// Progress of the loop that is running: training publishes the total step
/// count once per micro-batch; evaluation publishes 0 at the start of a loader
/// and then the number of batches done.
struct ProgressUpdate {
  std::int64_t num_steps_done = 0;
  ExperimentStatus experiment_status = ExperimentStatus::kTrain;
  std::string dataloader_tag;
};

/// Python's Message[T] is generic; the two payloads actually published are
/// listed here. A new payload type is an ABI change.
using MessagePayload = std::variant<ProgressUpdate, EvaluationResultBatch>;

/// One published message, delivered synchronously to MessageSubscriber::consume_message.
/// Since: SDK 0.1.
struct Message {
  MessageType message_type = MessageType::kBatchProgressUpdate;
  MessagePayload payload;
  std::int64_t global_rank = 0;
  std::int64_t local_rank = 0;
};

}  // namespace modalities
