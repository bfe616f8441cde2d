// Modalities' training loop (docs/training.md, "The training loop") on the SDK interfaces.
//
// Deliberate differences from Modalities (docs/differences.md, "Training"):
//  * no host synchronisation per micro-batch: losses, gradient norms and the
//    first non-finite step are accumulated on the device and read at log,
//    evaluation and checkpoint steps (Modalities calls loss.item() on every
//    micro-batch);
//  * a NaN/inf loss or gradient norm stops the run with the step named, and no
//    checkpoint is written after it;
//  * SIGINT/SIGTERM finish the current optimizer step and stop cleanly
//    (optionally checkpointing);
//  * a train loader that runs out before the target is reported.
#include <modalities/core/graph.h>
#include <modalities/core/gym.h>
#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/fault.h>
#include <modalities/sdk/interfaces/app_state.h>
#include <modalities/sdk/interfaces/checkpoint_saving.h>
#include <modalities/sdk/interfaces/data_loader.h>
#include <modalities/sdk/interfaces/dataset.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/interfaces/gradient_clipper.h>
#include <modalities/sdk/interfaces/loss.h>
#include <modalities/sdk/interfaces/lr_scheduler.h>
#include <modalities/sdk/interfaces/message_subscriber.h>
#include <modalities/sdk/interfaces/mfu_calculator.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/optimizer.h>
#include <modalities/sdk/interfaces/pipeline.h>
#include <modalities/sdk/interfaces/steppable_profiler.h>
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/parameter_count.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <fmt/chrono.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#ifdef MODALITIES_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <iostream>
#include <limits>
#include <mutex>
#include <set>
#include <unordered_set>

namespace modalities::core {

namespace {

using Clock = std::chrono::steady_clock;

template <class T>
std::shared_ptr<T> object_of(const BuiltGraph& built, std::string_view key, bool required) {
  const Value* v = built.get(key);
  if (v == nullptr || v->is_null()) {
    if (required) throw Error(fmt::format("the training config has no top-level '{}' ({})", key, T::kInterface));
    return nullptr;
  }
  if (!v->is_object() || v->as_object().interface != T::kInterface)
    throw Error(fmt::format("top-level '{}' must produce a {}, got {}", key, T::kInterface, v->type_name()));
  return std::static_pointer_cast<T>(v->as_object().ptr);
}

std::string now_iso() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  return fmt::format("{:%Y-%m-%dT%H:%M:%S}", tm);
}

double peak_memory_mb(const c10::Device& device) {
#ifdef MODALITIES_WITH_CUDA
  if (device.is_cuda()) {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    const auto stats = alloc::getDeviceStats(device.index());
    const double mb = static_cast<double>(stats.allocated_bytes[0].peak) / (1024.0 * 1024.0);
    alloc::resetPeakStats(device.index());
    return mb;
  }
#endif
  (void)device;
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return -1;
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

/// The mean over all ranks of each element of `values` (a float32 CPU tensor), in place; a no-op
/// for one process. Every rank calls it at the same step (log and evaluation steps).
void mean_over_ranks(at::Tensor& values) {
  if (!dist::initialized()) return;
  std::vector<at::Tensor> t = {values};
  dist::world()->allreduce(t)->wait();
  values.div_(static_cast<double>(dist::world_size()));
}

/// A float32 0-dim tensor, as `torch.tensor(python_float)` makes it.
at::Tensor fscalar(double v) { return at::scalar_tensor(v, at::kFloat); }

// Note [Model metrics]
// What the model parts measured (Module::take_metrics), combined over the ranks by each metric's
// reduce, in the order of their first appearance (rank 0's first). Ranks may report different
// metrics (pipeline stages hold different blocks), so the ranks exchange them as text through the
// store, once per training-log step on every rank, rather than in an all-reduce that needs the
// same tensors everywhere. `round` numbers the exchanges (the same on every rank).
std::vector<ModelMetric> combine_over_ranks(const std::vector<ModelMetric>& mine, std::int64_t round) {
  if (!dist::initialized() || dist::world_size() == 1) return mine;
  std::string text;
  for (const ModelMetric& m : mine)
    text += fmt::format("{}\t{}\t{:.17g}\n", static_cast<int>(m.reduce), m.name, m.value);
  struct Acc {
    ModelMetric metric;
    int count = 0;
  };
  std::vector<Acc> acc;
  for (const std::string& theirs : dist::all_gather_strings(fmt::format("gym/metrics/{}", round), text))
    for (std::size_t at = 0, end; (end = theirs.find('\n', at)) != std::string::npos; at = end + 1) {
      const std::string line = theirs.substr(at, end - at);
      const auto tab1 = line.find('\t'), tab2 = line.rfind('\t');
      if (tab1 == std::string::npos || tab2 <= tab1) continue;
      ModelMetric m{line.substr(tab1 + 1, tab2 - tab1 - 1), std::stod(line.substr(tab2 + 1)),
                    static_cast<ModelMetric::Reduce>(std::stoi(line.substr(0, tab1)))};
      auto it = std::find_if(acc.begin(), acc.end(), [&](const Acc& a) { return a.metric.name == m.name; });
      if (it == acc.end()) {
        acc.push_back({std::move(m), 1});
        continue;
      }
      double& v = it->metric.value;
      switch (it->metric.reduce) {
        case ModelMetric::Reduce::kMean:
        case ModelMetric::Reduce::kSum: v += m.value; break;
        case ModelMetric::Reduce::kMin: v = std::min(v, m.value); break;
        case ModelMetric::Reduce::kMax: v = std::max(v, m.value); break;
      }
      ++it->count;
    }
  std::vector<ModelMetric> out;
  for (Acc& a : acc) {
    if (a.metric.reduce == ModelMetric::Reduce::kMean) a.metric.value /= a.count;
    out.push_back(std::move(a.metric));
  }
  return out;
}

/// Saves the default CPU generator (and the run device's) and restores them on scope exit.
class RngStates {
 public:
  explicit RngStates(const c10::Device& device) {
    save(at::globalContext().defaultGenerator(c10::Device(c10::kCPU)));
    if (!device.is_cpu()) save(at::globalContext().defaultGenerator(device));
  }
  ~RngStates() {
    for (auto& [generator, state] : saved_) {
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(state);
    }
  }
  RngStates(const RngStates&) = delete;
  RngStates& operator=(const RngStates&) = delete;

 private:
  void save(at::Generator generator) {  // a handle: copies share the generator
    std::lock_guard<std::mutex> lock(generator.mutex());
    at::Tensor state = generator.get_state();
    saved_.emplace_back(std::move(generator), std::move(state));
  }
  std::vector<std::pair<at::Generator, at::Tensor>> saved_;
};

// Note [Data ledger]
// Proof of which data a run trained on, per optimizer step: the hash of the global batch's sample
// ids (dataset indices), independent of how the batch was split over ranks and micro-batches, so a
// resumed, restarted or resharded run can be compared step by step with the uninterrupted one.
// Each id contributes splitmix64(id) >> 16 (48 bits) to a sum: the sum of a global batch is the
// sum of its ranks' sums (one all-reduce per log interval on the control group; < 2^15 samples per
// step cannot overflow). Ranks that hold the same batch as another (tensor- and pipeline-parallel
// ranks of one data-parallel rank) count once: only the one at coordinate 0 of every other mesh
// dim contributes. Rank 0 appends {"step", "global_samples", "sample_ids_hash"} lines to
// data_ledger.jsonl in the experiment folder; "sample_ids_hash" is null when the data loader does
// not report sample ids.
class DataLedger {
 public:
  explicit DataLedger(std::filesystem::path path) : path_(std::move(path)) {}

  // False on a rank whose batch another rank of its data-parallel rank already counts.
  void set_counted(bool counted) { counted_ = counted; }

  void add(const std::vector<std::int64_t>& ids, i64 batch_size) {
    if (static_cast<i64>(ids.size()) != batch_size) unknown_ = 1;
    for (const std::int64_t id : ids) hash_ += static_cast<std::int64_t>(mix(static_cast<std::uint64_t>(id)) >> 16);
    samples_ += batch_size;
  }

  void end_step(i64 step) {
    pending_.push_back({step, hash_, samples_, unknown_});
    hash_ = samples_ = unknown_ = 0;
  }

  // A collective: every rank calls it at the same steps.
  void flush() {
    if (path_.empty()) return;
    const auto n = static_cast<std::int64_t>(pending_.size());
    at::Tensor t = at::empty({3, std::max<std::int64_t>(n, 1)}, at::kLong).zero_();
    auto a = t.accessor<std::int64_t, 2>();
    if (counted_) {  // the others join the all-reduce with zeros
      for (std::int64_t k = 0; k < n; ++k) {
        a[0][k] = pending_[static_cast<std::size_t>(k)].hash;
        a[1][k] = pending_[static_cast<std::size_t>(k)].samples;
        a[2][k] = pending_[static_cast<std::size_t>(k)].unknown;
      }
    }
    if (dist::initialized()) {
      std::vector<at::Tensor> v = {t};
      dist::control()->allreduce(v)->wait();
    }
    if (dist::rank() == 0 && n > 0) {
      std::string lines;
      for (std::int64_t k = 0; k < n; ++k)
        lines += fmt::format(
            "{{\"step\": {}, \"global_samples\": {}, \"sample_ids_hash\": {}}}\n",
            pending_[static_cast<std::size_t>(k)].step, a[1][k],
            a[2][k] != 0 ? std::string("null") : fmt::format("\"{:016x}\"", static_cast<std::uint64_t>(a[0][k])));
      std::FILE* f = std::fopen(path_.c_str(), "ab");
      if (f == nullptr)
        throw Error(fmt::format("cannot append to the data ledger '{}': {}", path_.string(), std::strerror(errno)));
      const bool ok = std::fwrite(lines.data(), 1, lines.size(), f) == lines.size();
      if (std::fclose(f) != 0 || !ok) throw Error(fmt::format("cannot write the data ledger '{}'", path_.string()));
    }
    pending_.clear();
  }

 private:
  static std::uint64_t mix(std::uint64_t x) {  // splitmix64's finalizer
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  }
  struct Step {
    i64 step;
    std::int64_t hash, samples, unknown;
  };
  std::filesystem::path path_;
  std::int64_t hash_ = 0, samples_ = 0, unknown_ = 0;
  bool counted_ = true;
  std::vector<Step> pending_;
};

class Gym {
 public:
  Gym(GymComponents& c, const GymOptions& o) : c_(c), o_(o), out_(o.out ? *o.out : std::cout) {}

  // The progress this run starts from (settings.training_progress, in a warm start read from the
  // checkpoint folder's name) must agree with the state it resumes: the optimizer's step count
  // (the largest state.<fqn>.step) and the scheduler's last_epoch. A renamed or mixed-up
  // checkpoint would otherwise train on silently with the wrong steps and learning rates. A fresh
  // optimizer (no state) or scheduler (last_epoch 0) is accepted: starting a new one is a choice.
  // The check reads the live objects after loading, so it holds for any checkpoint format.
  void check_resumed_state() const {
    const auto contradiction = [&](const std::string& what, double value) {
      return Error(fmt::format(
          "settings.training_progress.num_seen_steps = {} (the step this run resumes from; a warm start reads it "
          "from the checkpoint folder's name), but {} = {}: the loaded checkpoint does not hold the state of step {}; "
          "was the checkpoint folder renamed or swapped?",
          steps_seen_before_, what, value, steps_seen_before_));
    };
    if (optimizer_) {
      double steps = -1;
      std::string key;
      for (const auto& [k, v] : optimizer_->state_dict())
        if (k.starts_with("state.") && k.ends_with(".step") && v.defined() && v.numel() == 1) {
          const double x = v.item<double>();
          if (x > steps) steps = x, key = k;
        }
      if (steps > 0 && steps != static_cast<double>(steps_seen_before_))
        throw contradiction("the optimizer's " + key, steps);
    }
    if (scheduler_) {
      const StateDict sd = scheduler_->state_dict();
      if (auto it = sd.find("last_epoch"); it != sd.end() && it->second.defined() && it->second.numel() == 1) {
        const double last_epoch = it->second.item<double>();
        if (last_epoch > 0 && last_epoch != static_cast<double>(steps_seen_before_))
          throw contradiction("the learning-rate scheduler's last_epoch", last_epoch);
      }
    }
  }

  // Reads the step profile and the components, and refuses what cannot train: a wrong
  // data-parallel degree, unsynchronised parts on several ranks, a loss that cannot take split
  // logits, a resumed state that contradicts the settings, unallocated (meta) parameters. Moves
  // the parts to the run device.
  void prepare() {
    const auto& s = c_.settings;
    const auto& sp = s.step_profile;
    accumulation_steps_ = sp.gradient_accumulation_steps;
    steps_seen_before_ = s.training_progress.num_seen_steps;
    tokens_seen_before_ = s.training_progress.global_num_seen_tokens;
    dp_ = sp.dp_degree;
    tokens_per_step_ = sp.tokens_per_step();
    parts_ = c_.app_state->model_parts();
    pipeline_ = c_.scheduled_pipeline;
    if (pipeline_ && !pipeline_->schedule())
      throw Error(
          "scheduled_pipeline has no schedule: build it with pipeline/scheduled (or give pipeline/builder a "
          "pp_schedule)");
    // The data-parallel size is what the samplers split the data by and what the token counts
    // assume: a dp_degree that is not the real one trains on more (or fewer) tokens per step
    // than the config says, silently.
    // Without a mesh every rank is data parallel.
    const ParallelDims dims = ParallelDims::of(c_.device_mesh, s.cuda_env.world_size);
    const i64 dp_ranks = dims.dp_size();
    const std::string source =
        c_.device_mesh ? fmt::format("{} (device_mesh {})", dp_ranks, dims.describe())
                       : fmt::format("the world size {} (no device_mesh: every rank is data parallel)", dp_ranks);
    // Note [Data ledger]: one rank per data-parallel rank counts its batch.
    if (c_.device_mesh) ledger_.set_counted(dims.counts_data());
    if (sp.dp_degree != dp_ranks)
      throw Error(
          fmt::format("settings.step_profile.dp_degree = {}, but the run's data-parallel size is {}: "
                      "tokens per step, step targets and throughput would count {} ranks' batches while "
                      "{} train; derive it with number_conversion/parallel_degree from the device mesh "
                      "(configs/distributed/fsdp2_cpu.toml)",
                      sp.dp_degree, source, sp.dp_degree, dp_ranks));
    if (s.cuda_env.world_size > 1) {
      // Several data-parallel ranks train one model only if every part synchronises its gradients
      // across them, which the sharding wrappers do (their parameters are shards). Ranks that only
      // split the model (tensor parallel with dp 1) need no such wrapper.
      // Context-parallel ranks compute gradients of different tokens of the same parameters:
      // they need the same synchronisation (FSDP2 shards over dp_shard x cp).
      if (dp_ranks > 1 || dims.enabled(MeshDim::cp))
        for (const auto& part : parts_)
          if (!part->synchronizes_gradients())
            throw Error(fmt::format(
                "settings.cuda_env.world_size = {}: the model is not wrapped for data parallelism ({} data-parallel "
                "ranks{}), so each rank would train its own copy; wrap it in model/fsdp2_wrapped or "
                "model/fsdp1_wrapped (configs/distributed/fsdp2_cpu.toml)",
                s.cuda_env.world_size, dp_ranks,
                dims.enabled(MeshDim::cp) ? fmt::format(" x {} context-parallel ranks", dims.degree(MeshDim::cp))
                                          : ""));
      if (!dist::initialized())
        throw Error(
            fmt::format("settings.cuda_env.world_size = {}, but no process group was created (launch with "
                        "`modalities launch`, torchrun or srun)",
                        s.cuda_env.world_size));
    }
    // Loss parallel: logits split on the vocabulary reach only a loss that reduces them across
    // the tensor-parallel ranks; any other would read a slice of the vocabulary as all of it.
    if (parts_.size() == 1) vocab_shard_ = parts_.front()->vocab_shard();
    if (vocab_shard_ && !c_.loss_fn->accepts_vocab_shards())
      throw Error(
          fmt::format("loss_fn: the model returns logits split on the vocabulary over the tensor-parallel "
                      "ranks (device_mesh.config.enable_loss_parallel = true), and loss '{}' cannot reduce "
                      "them; use loss/clm_cross_entropy_loss or set enable_loss_parallel = false",
                      c_.loss_fn->tag()));
    // Context parallel: predictions for this rank's tokens reach only a loss that picks the same
    // tokens of the whole targets.
    if (parts_.size() == 1) sequence_shard_ = parts_.front()->sequence_shard();
    if (sequence_shard_ && !c_.loss_fn->accepts_sequence_shards())
      throw Error(
          fmt::format("loss_fn: the model computes this rank's tokens of every sequence (context parallelism over "
                      "{} ranks, device_mesh.config.context_parallel_degree), and loss '{}' cannot take them; use "
                      "loss/clm_cross_entropy_loss or set context_parallel_degree = 1",
                      sequence_shard_->size, c_.loss_fn->tag()));
    optimizer_ = c_.app_state->optimizer();
    scheduler_ = c_.app_state->lr_scheduler();
    check_resumed_state();
    for (auto& part : parts_) {
      for (const auto& [name, t] : part->named_parameters())
        if (t.is_meta())
          throw Error(fmt::format(
              "the model's parameter {} is on the meta device (model.config.use_meta_device = true) and was never "
              "allocated: wrap the model in model/model_initialized, which allocates and initializes it",
              name));
      part->to(o_.device, std::nullopt);
    }
  }

  GymSummary run() {
    prepare();
    const auto& s = c_.settings;
    // Setup before the first micro-batch.
    for (auto& part : parts_) part->train(true);
    const auto fopts = at::TensorOptions().dtype(at::kFloat).device(o_.device);
    loss_sum_ = at::zeros({}, fopts);
    loss_count_ = 0;
    last_loss_ = at::zeros({}, fopts);
    log_timer_ = Clock::now();
    const auto run_start = Clock::now();

    TrainingProgress progress;
    progress.num_seen_steps_previous_run = steps_seen_before_;
    progress.num_seen_tokens_previous_run = tokens_seen_before_;
    progress.num_target_steps = s.training_target.num_target_steps;
    progress.num_target_tokens = s.training_target.num_target_tokens;

    if (steps_seen_before_ > 0 && steps_seen_before_ % s.intervals.evaluation_interval_in_steps == 0)
      evaluate(steps_seen_before_);
    if (steps_seen_before_ > 0 && steps_seen_before_ % s.intervals.checkpointing_interval_in_steps == 0)
      checkpoint(progress);

    const i64 num_batches_todo = (s.training_target.num_target_steps - steps_seen_before_) * accumulation_steps_;
    if (c_.profiler) c_.profiler->enter();
    // The profiler is closed (and writes its trace) also when training fails.
    struct ProfilerExit {
      SteppableProfiler* p;
      ~ProfilerExit() {
        if (p != nullptr) try {
            p->exit();
          } catch (const std::exception& e) {
            std::cerr << "warning: the profiler failed to close: " << e.what() << "\n";
          }
      }
    } profiler_exit{c_.profiler.get()};
    c_.train_dataloader->begin(0);
    const std::string tag = c_.train_dataloader->tag();
    GymSummary summary;
    i64 i = 0;
    bool step_performed = false;
    i64 current_step = steps_seen_before_ + 1;
    try {
      for (; i < num_batches_todo; ++i) {
        std::optional<DatasetBatch> batch = c_.train_dataloader->next();
        if (!batch) {
          std::cerr << fmt::format(
              "warning: train_dataloader '{}' ran out after {} micro-batches; the target needed {} "
              "(steps {} of {}). Check the dataset size and settings.training_target.\n",
              tag, i, num_batches_todo, steps_seen_before_ + i / accumulation_steps_,
              s.training_target.num_target_steps);
          break;
        }
        const std::int64_t batch_size = batch->size();
        ledger_.add(batch->sample_ids, batch_size);
        batch->to(o_.device, /*non_blocking=*/o_.device.is_cuda());
        const i64 step_number =
            steps_seen_before_ + i / accumulation_steps_ + 1;  // 1-based step this micro-batch belongs to
        current_step = step_number;

        // 1. forward / backward.
        // With accumulation, gradients are synchronised across ranks in the step's last backward only.
        if (accumulation_steps_ > 1)
          for (auto& part : parts_) part->set_requires_gradient_sync((i + 1) % accumulation_steps_ == 0);
        at::Tensor loss;
        if (pipeline_) {
          loss = pipeline_step(*batch, /*train=*/true)
                     .value_or(at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(o_.device)));
        } else {
          InferenceResultBatch result;
          result.targets = std::move(batch->targets);
          result.predictions = forward(batch->samples);
          result.vocab_shard = vocab_shard_;
          result.sequence_shard = sequence_shard_;
          loss = c_.loss_fn->compute(result);
          // Dividing by 1 changes no bit: without accumulation the division (an op and an autograd
          // node per step) is skipped.
          (accumulation_steps_ == 1 ? loss : loss / static_cast<double>(accumulation_steps_)).backward();
        }
        fault_point("train_step");  // tests: a rank killed mid-step (modalities/sdk/fault.h)
        at::Tensor loss_f = loss.scalar_type() == at::kFloat ? loss.detach() : loss.detach().to(at::kFloat);
        if (fault_point("train_loss_nan")) loss_f = at::full_like(loss_f, std::nan(""));  // tests only
        mark_non_finite(loss_f, step_number);

        // 2. step boundary.
        step_performed = (i + 1) % accumulation_steps_ == 0;
        if (step_performed) {
          at::Tensor norm = c_.gradient_clipper->clip_gradients().detach();
          mark_non_finite(norm, step_number);
          optimizer_->step();
          if (scheduler_) scheduler_->step();
          optimizer_->zero_grad(true);
          grad_norms_.push_back(norm);
          ledger_.end_step(step_number);
        }
        // 3-6. progress and statistics.
        progress.num_seen_steps_current_run = (i + 1) / accumulation_steps_;
        progress.num_seen_tokens_current_run = tokens_per_step_ * progress.num_seen_steps_current_run;
        loss_sum_.add_(loss_f);
        ++loss_count_;
        last_loss_ = loss_f;
        local_samples_ += batch_size;
        // 7. progress message.
        publish_progress(progress.num_seen_steps_total(), ExperimentStatus::kTrain, tag);
        if (step_performed) {
          const i64 steps_total = progress.num_seen_steps_total();
          // 8. training log.
          if (steps_total % s.intervals.training_log_interval_in_steps == 0) log_training(progress, tag);
          // 9. evaluation and checkpoint callbacks.
          if (steps_total > 0 && steps_total % s.intervals.evaluation_interval_in_steps == 0) evaluate(steps_total);
          if (steps_total > 0 && steps_total % s.intervals.checkpointing_interval_in_steps == 0) checkpoint(progress);
          // Every rank stops at the same step (a signal reaches the ranks at slightly different
          // times; a rank that stopped alone would leave the others waiting in a collective).
          if (dist::any_rank(o_.stop_request != nullptr && o_.stop_request->load() != 0)) {
            summary.stopped_on_request = true;
            const bool on_interval = steps_total % s.intervals.checkpointing_interval_in_steps == 0;
            if (o_.checkpoint_on_stop && !on_interval) checkpoint(progress, /*stopping=*/true);
            summary.checkpoint_written_on_stop = on_interval || o_.checkpoint_on_stop;
            ++i;
            break;
          }
        }
        // 10. profiler.
        if (c_.profiler) c_.profiler->step();
      }
    } catch (const std::exception& e) {
      // A peer lost mid-step fails a collective with Gloo's "Connection closed by peer", which
      // names no rank: say which one, and during what (Note [Lost peers]).
      if (const std::string lost = dist::lost_peer_message(e, fmt::format("step {}", current_step), o_.stop_request);
          !lost.empty())
        throw Error(lost);
      throw;
    }
    profiler_exit.p = nullptr;
    if (c_.profiler) c_.profiler->exit();
    check_finite();
    ledger_.flush();

    summary.micro_batches = i;
    summary.steps_done = progress.num_seen_steps_current_run;
    summary.steps_total = progress.num_seen_steps_total();
    summary.tokens_total = progress.num_seen_tokens_total();
    summary.seconds = std::chrono::duration<double>(Clock::now() - run_start).count();
    summary.last_train_loss = last_logged_loss_;
    return summary;
  }

 private:
  // Pipeline parallelism: the schedule runs forward and backward of every pipeline micro-batch
  // (first stage: the samples, last stage: the targets and the loss). Unlike Modalities, the
  // gradients are scaled by 1 / G, so accumulation gives the gradient of the mean loss as without
  // a pipeline. `train` false: forwards only (evaluation). Returns the mean loss of the pipeline
  // micro-batches on ranks with the last stage, nothing elsewhere (the log averages over the ranks
  // that have one).
  std::optional<at::Tensor> pipeline_step(DatasetBatch& batch, bool train) {
    PipelineSchedule& schedule = *pipeline_->schedule();
    std::optional<at::Tensor> input, target;
    if (pipeline_->has_first_stage()) input = batch.samples.at(parts_.front()->sample_key()).contiguous();
    if (pipeline_->has_last_stage()) target = batch.targets.at(c_.loss_fn->target_key());
    // What the stages need of the sample besides the first stage's input (document ids).
    TensorMap stage_inputs;
    for (const auto& [key, t] : batch.samples)
      if (key != parts_.front()->sample_key()) stage_inputs.emplace(key, t);
    schedule.set_stage_inputs(std::move(stage_inputs));
    if (train) schedule.set_loss_scale(1.0 / static_cast<double>(accumulation_steps_));
    const std::vector<at::Tensor> losses = train ? schedule.step(input, target) : schedule.eval(input, target);
    if (losses.empty()) return std::nullopt;
    return at::stack(losses).mean();
  }

  // The mean over the ranks that computed a loss (with a pipeline: those holding the last stage).
  void mean_over_loss_ranks(at::Tensor& values) {
    if (!pipeline_) return mean_over_ranks(values);
    if (!dist::initialized()) return;
    const float mine = pipeline_->has_last_stage() ? 1.0f : 0.0f;
    std::vector<at::Tensor> t = {at::cat({values.reshape({-1}) * mine, at::full({1}, mine, at::kFloat)})};
    dist::world()->allreduce(t)->wait();
    const at::Tensor& sum = t.front();
    values.copy_((sum.narrow(0, 0, values.numel()) / sum[-1]).reshape(values.sizes()));
  }

  TensorMap forward(const TensorMap& samples) {
    if (parts_.size() != 1)
      throw Error(
          fmt::format("app_state has {} model parts; several parts need a pipeline schedule "
                      "(scheduled_pipeline), which this version does not run",
                      parts_.size()));
    return parts_.front()->forward(samples);
  }

  // Keeps the (device) loss or norm of `step` for the next check_finite():
  // no kernel and no synchronisation per micro-batch.
  void mark_non_finite(const at::Tensor& value, i64 step) {
    unchecked_.emplace_back(step, value);
    if (unchecked_.size() >= 4096) check_finite();  // bounded memory with long log intervals
  }

  // One stack + isfinite + sync for everything since the last check; names
  // the first step whose loss or gradient norm is NaN/inf.
  // Every rank calls it at the same points and they agree on the result (the earliest bad step of
  // any rank): a NaN in one rank's loss stops every rank at once, instead of one rank leaving while
  // the others wait for it in the next collective.
  void check_finite() {
    constexpr i64 kNone = std::numeric_limits<i64>::max();
    i64 bad = kNone;
    if (!unchecked_.empty()) {
      std::vector<at::Tensor> values;
      values.reserve(unchecked_.size());
      for (const auto& [step, v] : unchecked_) values.push_back(v.to(at::kDouble).reshape({}));
      const at::Tensor finite = at::isfinite(at::stack(values)).cpu();
      const bool* ok = finite.data_ptr<bool>();
      for (std::size_t k = 0; k < unchecked_.size(); ++k)
        if (!ok[k]) {
          bad = unchecked_[k].first;
          break;
        }
      unchecked_.clear();
    }
    bad = dist::min_over_ranks(bad);
    if (bad == kNone) return;
    throw NonFiniteLossError(
        fmt::format("the training loss or gradient norm became NaN/inf at step {}; training stopped. Nothing was "
                    "checkpointed after that step: warm start from the last checkpoint (last_checkpoint_info.json) "
                    "with a lower learning rate, stronger clipping or fp32",
                    bad),
        bad);
  }

  void publish_progress(i64 steps, ExperimentStatus status, const std::string& tag) {
    if (!c_.progress_subscriber) return;
    Message m;
    m.message_type = MessageType::kBatchProgressUpdate;
    m.payload = ProgressUpdate{steps, status, tag};
    m.global_rank = c_.settings.cuda_env.global_rank;
    m.local_rank = c_.settings.cuda_env.local_rank;
    c_.progress_subscriber->consume_message(m);
  }

  void publish_result(const EvaluationResultBatch& r) {
    Message m;
    m.message_type = MessageType::kEvaluationResult;
    m.payload = r;
    m.global_rank = c_.settings.cuda_env.global_rank;
    m.local_rank = c_.settings.cuda_env.local_rank;
    if (c_.evaluation_subscriber) c_.evaluation_subscriber->consume_message(m);
    // The progress bar shows the latest loss, lr and throughput (plugins/subscribers README).
    if (c_.progress_subscriber && c_.progress_subscriber != c_.evaluation_subscriber)
      c_.progress_subscriber->consume_message(m);
  }

  // What Modalities logs at a training-log step.
  void log_training(const TrainingProgress& progress, const std::string& tag) {
    check_finite();
    ledger_.flush();
    const auto now = Clock::now();
    const double dt = std::chrono::duration<double>(now - log_timer_).count();
    log_timer_ = now;
    const double global_samples = static_cast<double>(local_samples_ * dp_);
    local_samples_ = 0;
    const double samples_per_s = dt > 0 ? global_samples / dt : 0.0;

    // Values carry Modalities' dtypes (float32 tensors, int64 token count) and float32
    // arithmetic, so the logged digits are the same as Modalities'.
    EvaluationResultBatch r;
    r.dataloader_tag = tag;
    r.num_train_steps_done = progress.num_seen_steps_total();
    // Losses are averaged over the ranks (each rank's loss is the mean over its own samples,
    // and every rank has as many samples), as Modalities all-reduces them.
    at::Tensor losses =
        at::stack({loss_sum_ / static_cast<float>(std::max<i64>(loss_count_, 1)), last_loss_}).to(at::kFloat).cpu();
    mean_over_loss_ranks(losses);
    const at::Tensor loss_avg = losses[0].clone();
    last_logged_loss_ = loss_avg.item<double>();
    r.losses.push_back({"train loss avg", {loss_avg, 2}});
    r.losses.push_back({"train loss last", {losses[1].clone(), 2}});
    r.metrics.push_back({"consumed tokens", {at::scalar_tensor(progress.num_seen_tokens_total(), at::kLong), 0}});
    const at::Tensor norms =
        grad_norms_.empty() ? at::zeros({1}, at::kFloat) : at::stack(grad_norms_).to(at::kFloat).cpu();
    r.metrics.push_back({"grad norm avg", {norms.mean(), 2}});
    r.metrics.push_back({"grad norm last", {norms[-1].clone(), 2}});
    // Note [Model metrics]: e.g. the MoE blocks' load imbalance and auxiliary losses.
    std::vector<ModelMetric> model_metrics;
    for (auto& part : parts_)
      for (ModelMetric& m : part->take_metrics()) model_metrics.push_back(std::move(m));
    for (const ModelMetric& m : combine_over_ranks(model_metrics, metric_rounds_++))
      r.metrics.push_back({m.name, {fscalar(m.value), 4}});
    r.throughput_metrics.push_back({"train samples/s", {fscalar(samples_per_s), 1}});
    const double mfu = c_.mfu_calculator ? c_.mfu_calculator->compute(samples_per_s) : -1.0;
    r.throughput_metrics.push_back({"train mfu (16-bit)", {fscalar(mfu), 2}});
    const std::vector<double> lrs = scheduler_ ? scheduler_->last_lrs() : optimizer_->learning_rates();
    const at::Tensor lr_tensor =
        lrs.empty() ? at::zeros({1}, at::kFloat)
                    : at::tensor(std::vector<float>(lrs.begin(), lrs.end()), at::TensorOptions().dtype(at::kFloat));
    r.throughput_metrics.push_back({"lr mean", {lr_tensor.mean(), std::nullopt}});
    r.throughput_metrics.push_back({"peak memory rank 0 (MB)", {fscalar(peak_memory_mb(o_.device)), 2}});

    if (c_.settings.cuda_env.global_rank == 0) out_ << now_iso() << " | " << result_line(r) << std::endl;
    publish_result(r);
    loss_sum_.zero_();
    loss_count_ = 0;
    grad_norms_.clear();
  }

  // Evaluation, as Modalities' evaluator.
  void evaluate(i64 step) {
    if (c_.eval_dataloaders.empty()) return;
    check_finite();
    // Evaluation must not move the training RNG streams (attention dropout also runs
    // in eval mode, as in Modalities): otherwise evaluating, or re-evaluating at the
    // start of a warm start, would change every later dropout mask. Modalities lets
    // evaluation consume them.
    const RngStates rng(o_.device);
    for (auto& part : parts_) part->train(false);
    for (auto& loader : c_.eval_dataloaders) {
      const std::string tag = loader->tag();
      publish_progress(0, ExperimentStatus::kEvaluation, tag);
      at::Tensor sum = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(o_.device));
      i64 count = 0, samples = 0;
      const auto start = Clock::now();
      {
        at::NoGradGuard no_grad;
        loader->begin(0);
        i64 batch_id = 0;
        while (std::optional<DatasetBatch> batch = loader->next()) {
          samples += batch->size();
          batch->to(o_.device, o_.device.is_cuda());
          if (pipeline_) {
            if (const auto loss = pipeline_step(*batch, /*train=*/false)) sum.add_(loss->to(at::kFloat));
          } else {
            InferenceResultBatch result;
            result.targets = std::move(batch->targets);
            result.predictions = forward(batch->samples);
            result.vocab_shard = vocab_shard_;
            result.sequence_shard = sequence_shard_;
            sum.add_(c_.loss_fn->compute(result).to(at::kFloat));
          }
          ++count;
          publish_progress(++batch_id, ExperimentStatus::kEvaluation, tag);
        }
      }
      const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      EvaluationResultBatch r;
      r.dataloader_tag = tag;
      r.num_train_steps_done = step;
      at::Tensor loss = count > 0 ? (sum / static_cast<float>(count)).cpu().reshape({1}) : at::full({1}, std::nan(""));
      mean_over_loss_ranks(loss);
      loss = loss.reshape({});
      r.losses.push_back({c_.loss_fn->tag(), {loss, 2}});
      r.throughput_metrics.push_back({"evaluation_num_samples_per_second",
                                      {fscalar(elapsed > 0 ? static_cast<double>(samples * dp_) / elapsed : 0.0), 1}});
      if (c_.settings.cuda_env.global_rank == 0)
        out_ << now_iso() << " | " << tag << " | " << result_line(r) << std::endl;
      publish_result(r);
    }
    for (auto& part : parts_) part->train(true);
  }

  // `stopping`: a stop request; passed to the strategy as its early-stopping
  // criterion, which makes the strategies save (unless k = 0: no checkpoints at all).
  void checkpoint(const TrainingProgress& progress, bool stopping = false) {
    check_finite();  // never write a state that has seen a NaN
    c_.checkpoint_saving->save_checkpoint(progress, nullptr, *c_.app_state, stopping);
  }

  GymComponents& c_;
  const GymOptions& o_;
  std::ostream& out_;
  DataLedger ledger_{o_.data_ledger_path};
  // The step profile, and the progress of the runs before this one (a warm start or resume).
  i64 accumulation_steps_ = 1;  // micro-batches per optimizer step
  i64 metric_rounds_ = 0;       // model-metric exchanges so far (Note [Model metrics])
  i64 steps_seen_before_ = 0;   // optimizer steps of the earlier runs
  i64 tokens_seen_before_ = 0;  // tokens of the earlier runs
  i64 dp_ = 1;                  // data-parallel degree
  i64 tokens_per_step_ = 0;
  std::shared_ptr<Pipeline> pipeline_;               // pipeline parallelism: the scheduled pipeline, else null
  std::optional<tp::VocabShard> vocab_shard_;        // loss parallel: the model's logits are split on the vocabulary
  std::optional<cp::SequenceShard> sequence_shard_;  // context parallel: the model's predictions cover its tokens
  std::vector<std::shared_ptr<Module>> parts_;
  std::shared_ptr<Optimizer> optimizer_;
  std::shared_ptr<LRScheduler> scheduler_;
  at::Tensor loss_sum_, last_loss_;
  std::vector<std::pair<i64, at::Tensor>> unchecked_;  // (step, loss or norm) since the last check
  i64 loss_count_ = 0;
  i64 local_samples_ = 0;
  std::vector<at::Tensor> grad_norms_;
  Clock::time_point log_timer_;
  double last_logged_loss_ = std::numeric_limits<double>::quiet_NaN();
};

}  // namespace

GymComponents GymComponents::from(const BuiltGraph& built) {
  GymComponents c;
  const Value* settings = built.get("settings");
  if (settings == nullptr) throw Error("the training config has no top-level 'settings' table");
  c.settings = parse_training_settings(*settings);
  c.app_state = object_of<AppState>(built, "app_state", true);
  c.loss_fn = object_of<Loss>(built, "loss_fn", true);
  c.train_dataset = object_of<Dataset>(built, "train_dataset", false);
  c.train_dataloader = object_of<DataLoader>(built, "train_dataloader", true);
  if (const Value* evals = built.get("eval_dataloaders"); evals != nullptr && evals->is_list()) {
    std::size_t index = 0;
    for (const Value& v : evals->as_list()) {
      if (!v.is_object() || v.as_object().interface != DataLoader::kInterface)
        throw Error(fmt::format("eval_dataloaders[{}] must be a DataLoader, got {}", index, v.type_name()));
      c.eval_dataloaders.push_back(std::static_pointer_cast<DataLoader>(v.as_object().ptr));
      ++index;
    }
  }
  c.progress_subscriber = object_of<MessageSubscriber>(built, "progress_subscriber", true);
  c.evaluation_subscriber = object_of<MessageSubscriber>(built, "evaluation_subscriber", true);
  c.checkpoint_saving = object_of<CheckpointSaving>(built, "checkpoint_saving", true);
  c.gradient_clipper = object_of<GradientClipper>(built, "gradient_clipper", true);
  c.mfu_calculator = object_of<MFUCalculator>(built, "mfu_calculator", false);
  c.scheduled_pipeline = object_of<Pipeline>(built, "scheduled_pipeline", false);
  if (!c.scheduled_pipeline) {
    // A model whose variant also scheduled its pipeline brings it along (Module::pipeline).
    for (const auto& part : c.app_state->model_parts())
      if (std::shared_ptr<Pipeline> p = part->pipeline()) {
        c.scheduled_pipeline = std::move(p);
        break;
      }
  }
  c.profiler = object_of<SteppableProfiler>(built, "profiler", false);
  c.device_mesh = object_of<DeviceMesh>(built, "device_mesh", false);
  return c;
}

GymSummary run_gym(GymComponents& components, const GymOptions& options) { return Gym(components, options).run(); }

i64 count_trainable_parameters(const GymComponents& c) {
  std::vector<const Module*> parts;
  for (const auto& part : c.app_state->model_parts()) parts.push_back(part.get());
  // A pipeline rank holds its stages only: summed over the pp group.
  return modalities::count_trainable_parameters(parts, c.scheduled_pipeline ? c.device_mesh.get() : nullptr);
}

std::string training_report(const GymComponents& c, i64 num_parameters) {
  const auto& s = c.settings;
  const auto& sp = s.step_profile;
  const auto& t = s.training_target;
  const auto& p = s.training_progress;
  const auto& iv = s.intervals;
  const auto& ce = s.consistency_enforcement;
  std::string r = "Training Report\n";
  r += fmt::format("  experiment id:        {}\n", s.experiment_id);
  r += fmt::format("  trainable parameters: {}\n", num_parameters);
  r += fmt::format("  training target:      {} steps, {} tokens\n", t.num_target_steps, t.num_target_tokens);
  r += fmt::format("  training progress:    {} steps, {} tokens, {} samples seen (last step {})\n", p.num_seen_steps,
                   p.global_num_seen_tokens, p.num_seen_samples, p.last_step);
  r += fmt::format(
      "  step profile:         micro batch {} x sequence {} x grad. accumulation {} x dp {} = {} "
      "tokens/step\n",
      sp.local_train_micro_batch_size, sp.sequence_length, sp.gradient_accumulation_steps, sp.dp_degree,
      sp.tokens_per_step());
  r += fmt::format("  intervals:            log every {}, evaluate every {}, checkpoint every {} steps\n",
                   iv.training_log_interval_in_steps, iv.evaluation_interval_in_steps,
                   iv.checkpointing_interval_in_steps);
  r += fmt::format("  cuda env:             rank {} (local {}) of {}\n", s.cuda_env.global_rank, s.cuda_env.local_rank,
                   s.cuda_env.world_size);
  r += fmt::format(
      "  consistency checks:   tokens/step {}, last step logged {}, evaluated {}, checkpointed {}, "
      "enough tokens {}\n",
      ce.enforce_tokens_per_step_consistency, ce.enforce_last_step_logged, ce.enforce_last_step_evaluated,
      ce.enforce_last_step_checkpointed, ce.enforce_enough_tokens_in_dataset);
  // Warnings of Modalities' training report. Modalities multiplies by the world size, which
  // warns of a negative "missing" share under tensor or pipeline parallelism (ranks that share a
  // batch); the data-parallel degree is what feeds tokens (docs/differences.md).
  std::vector<std::string> warnings;
  const double num_tokens = static_cast<double>(sp.tokens_per_step()) * static_cast<double>(t.num_target_steps);
  if (num_tokens != static_cast<double>(t.num_target_tokens))
    warnings.push_back(fmt::format("Missing {:.2f}% of target tokens",
                                   (1.0 - num_tokens / static_cast<double>(t.num_target_tokens)) * 100.0));
  if (c.train_dataset) {
    const double in_dataset = static_cast<double>(c.train_dataset->size() * sp.sequence_length);
    if (num_tokens < in_dataset)
      warnings.push_back(fmt::format("Not all tokens of the dataset are used: {:.2f}% unused",
                                     (1.0 - num_tokens / in_dataset) * 100.0));
  }
  const i64 left = t.num_target_steps - p.num_seen_steps;
  if (left % iv.training_log_interval_in_steps != 0) warnings.emplace_back("the last step will not be logged");
  if (left % iv.evaluation_interval_in_steps != 0) warnings.emplace_back("the last step will not be evaluated");
  if (left % iv.checkpointing_interval_in_steps != 0) warnings.emplace_back("the last step will not be checkpointed");
  for (const auto& w : warnings) r += fmt::format("  warning: {}\n", w);
  return r;
}

}  // namespace modalities::core
