// The gym: trainer + evaluator + checkpoint and logging callbacks of a
// training run (docs/training.md). It sees components only through the
// SDK interfaces, so every model, optimizer, loss or subscriber plugin (and
// the sharding wrappers) plugs in unchanged.
//
//   GymComponents c = GymComponents::from(built);   // the built `training` pipeline
//   GymSummary s = run_gym(c, {.device = run_device()});
//
// Step order, intervals and logged metrics follow Modalities exactly; the
// differences (no per-micro-batch host sync, NaN/inf stop, signal handling)
// are listed in docs/differences.md.
#pragma once

#include <modalities/core/training_settings.h>

#include <c10/core/Device.h>

#include <atomic>
#include <filesystem>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

namespace modalities {
class AppState;
class CheckpointSaving;
class DataLoader;
class Dataset;
class GradientClipper;
class Loss;
class MessageSubscriber;
class MFUCalculator;
class SteppableProfiler;
class DeviceMesh;
class Pipeline;
}  // namespace modalities

namespace modalities::core {

struct BuiltGraph;

/// What the gym needs from a built `training` pipeline.
struct GymComponents {
  TrainingSettings settings;
  std::shared_ptr<AppState> app_state;
  std::shared_ptr<Loss> loss_fn;
  std::shared_ptr<Dataset> train_dataset;
  std::shared_ptr<DataLoader> train_dataloader;
  std::vector<std::shared_ptr<DataLoader>> eval_dataloaders;
  std::shared_ptr<MessageSubscriber> progress_subscriber;
  std::shared_ptr<MessageSubscriber> evaluation_subscriber;
  std::shared_ptr<CheckpointSaving> checkpoint_saving;
  std::shared_ptr<GradientClipper> gradient_clipper;
  std::shared_ptr<MFUCalculator> mfu_calculator;  // optional
  std::shared_ptr<SteppableProfiler> profiler;    // optional
  std::shared_ptr<DeviceMesh> device_mesh;        // optional: the top-level `device_mesh`
  std::shared_ptr<Pipeline> scheduled_pipeline;   // optional: pipeline parallelism

  /// Takes the components out of a built graph. Throws modalities::Error
  /// naming the key when one is missing or of the wrong interface.
  static GymComponents from(const BuiltGraph& built);
};

struct GymOptions {
  c10::Device device = c10::Device(c10::kCPU);
  /// Set asynchronously (by a signal handler) to ask for a clean stop after the
  /// current optimizer step; the value is the signal number.
  const std::atomic<int>* stop_request = nullptr;
  /// Write a checkpoint when stopping on request.
  bool checkpoint_on_stop = false;
  /// Log lines (training log, report, summary). nullptr: std::cout.
  std::ostream* out = nullptr;
  /// Where rank 0 appends the data ledger (Note [Data ledger] in gym.cpp); empty: none.
  std::filesystem::path data_ledger_path;
};

struct GymSummary {
  i64 steps_done = 0;   // optimizer steps in this run
  i64 steps_total = 0;  // including the steps of previous runs
  i64 tokens_total = 0;
  i64 micro_batches = 0;
  double seconds = 0;
  double last_train_loss = 0;  // "train loss avg" of the last log, NaN if none
  bool stopped_on_request = false;
  bool checkpoint_written_on_stop = false;
};

/// Training stopped because the loss or gradient norm became non-finite.
class NonFiniteLossError : public Error {
 public:
  NonFiniteLossError(std::string message, i64 step) : Error(std::move(message)), step_(step) {}
  i64 step() const { return step_; }

 private:
  i64 step_;
};

/// Runs Modalities' training loop to the target step (or until the train
/// loader is exhausted, or a stop request). Throws NonFiniteLossError when a
/// loss or gradient norm is NaN/inf (no checkpoint is written after it).
GymSummary run_gym(GymComponents& components, const GymOptions& options);

/// The "Training Report" printed at start, as Modalities prints it.
std::string training_report(const GymComponents& components, i64 num_parameters);

/// Trainable parameters of the whole model, tied tensors counted once (with a pipeline: summed
/// over the stages of every rank; a collective then).
i64 count_trainable_parameters(const GymComponents& components);

}  // namespace modalities::core
