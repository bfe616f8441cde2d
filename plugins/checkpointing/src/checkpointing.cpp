// Checkpointing (README.md; docs/training.md, "Checkpoints"): saving
// strategies, the saving entry point, the two executions (`dcp`, `fsdp1`, both
// writing this plugin's format v1, see format.h / README.md), the app states
// (`raw`, `dcp` = raw + load at build time) and the loaders (`dcp` into an
// AppState, `torch` a model for inference).
#include "format.h"
#include "resume.h"

#include <modalities/sdk/device_setting.h>
#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/safetensors.h>
#include <modalities/sdk/interfaces/app_state.h>
#include <modalities/sdk/interfaces/checkpoint_loading.h>
#include <modalities/sdk/interfaces/checkpoint_saving.h>
#include <modalities/sdk/interfaces/checkpoint_saving_execution.h>
#include <modalities/sdk/interfaces/checkpoint_saving_strategy.h>
#include <modalities/sdk/interfaces/lr_scheduler.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/optimizer.h>
#include <modalities/sdk/log.h>
#include <modalities/sdk/model_parts.h>
#include <modalities/sdk/plugin.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <iostream>

#include <deque>
#include <set>

namespace modalities::plugins::checkpointing {
namespace {

namespace fs = std::filesystem;

// "'a', 'b', 'c' and 7 more"
std::string some_names(const std::vector<std::string>& names, std::size_t max = 5) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < max; ++i) out += fmt::format("{}'{}'", i ? ", " : "", names[i]);
  if (names.size() > max) out += fmt::format(" and {} more", names.size() - max);
  return out;
}

StateDict with_prefix_removed(const StateDict& state, std::string_view prefix) {
  StateDict out;
  for (const auto& [k, v] : state)
    if (k.starts_with(prefix)) out.emplace(k.substr(prefix.size()), v);
  return out;
}

// Where this rank's part of a sharded tensor sits in the full tensor.
struct Placement {
  std::vector<std::int64_t> global_shape, offsets, local_shape;
};

// The sharded model.* entries of the app state (Module::shard_placements of every part), keyed
// "model.<fqn>", with the shapes of the local shards in `state`.
std::map<std::string, Placement> sharded_model_entries(const AppState& app_state, const StateDict& state) {
  std::map<std::string, Placement> out;
  for (const auto& part : app_state.model_parts())
    for (const auto& [fqn, p] : part->shard_placements()) {
      const std::string name = "model." + fqn;
      const auto it = state.find(name);
      if (it == state.end()) continue;
      out[name] = {p.global_shape, p.offsets, it->second.sizes().vec()};
    }
  // An alias of a sharded entry (a tied weight under a second name) is the same shard, even when a
  // wrapper lists only one name: taking it as a whole tensor would save one rank's rows as all.
  std::map<const void*, const Placement*> by_data;
  for (const auto& [name, p] : out)
    if (const auto& t = state.at(name); t.numel() > 0) by_data.emplace(t.data_ptr(), &p);
  for (const auto& [name, t] : state)
    if (name.starts_with("model.") && !out.contains(name) && t.numel() > 0)
      if (const auto it = by_data.find(t.data_ptr()); it != by_data.end() && it->second->local_shape == t.sizes().vec())
        out.emplace(name, *it->second);
  return out;
}

// Optimizer state is sharded like its parameter (Note [Optimizer state dict keys]): the
// placement of "optimizer.state.<fqn>.<name>" is that of model.<fqn> when `matches` accepts it
// (the shapes agree). The longest parameter FQN that prefixes the key wins.
const Placement* optimizer_entry_placement(const std::string& key, const std::map<std::string, Placement>& sharded,
                                           const std::function<bool(const Placement&)>& matches) {
  static constexpr std::string_view kState = "optimizer.state.";
  if (!key.starts_with(kState)) return nullptr;
  const std::string_view rest = std::string_view(key).substr(kState.size());
  const Placement* best = nullptr;
  std::size_t best_len = 0;
  for (const auto& [name, p] : sharded) {
    const std::string_view fqn = std::string_view(name).substr(6);  // without "model."
    if (rest.size() > fqn.size() && rest.starts_with(fqn) && rest[fqn.size()] == '.' && fqn.size() > best_len &&
        matches(p)) {
      best = &p;
      best_len = fqn.size();
    }
  }
  return best;
}

// --- strategies ------------------------------------------------------------------

struct SaveKMostRecentConfig {
  std::int64_t k = -1;
  static void describe(Schema<SaveKMostRecentConfig>& s) {
    s.field("k", &SaveKMostRecentConfig::k,
            "-1: save every time, keep all; 0: never save; k > 0: save every time, keep the k most recent "
            "(older checkpoints of this run are deleted from disk).")
        .required()
        .at_least(-1);
  }
};

class SaveKMostRecent final : public CheckpointSavingStrategy {
 public:
  explicit SaveKMostRecent(std::int64_t k) : k_(k) {}
  CheckpointingInstruction checkpoint_instruction(const TrainingProgress& progress, const EvaluationResultBatch*,
                                                  bool) override {
    CheckpointingInstruction ins;
    ins.save_current = k_ != 0;
    if (k_ > 0 || k_ == -1) saved_.push_front(progress);
    if (k_ > 0 && saved_.size() > static_cast<std::size_t>(k_)) {
      ins.checkpoints_to_delete.push_back(saved_.back());
      saved_.pop_back();
    }
    return ins;
  }

 private:
  std::int64_t k_;
  std::deque<TrainingProgress> saved_;  // newest first; this run's checkpoints only
};

struct SaveEveryKStepsConfig {
  std::int64_t k = 0;
  static void describe(Schema<SaveEveryKStepsConfig>& s) {
    s.field("k", &SaveEveryKStepsConfig::k, "Save when num_seen_steps_total is a multiple of k; never deletes.")
        .required()
        .positive();
  }
};

class SaveEveryKSteps final : public CheckpointSavingStrategy {
 public:
  explicit SaveEveryKSteps(std::int64_t k) : k_(k) {}
  // Also saves when the run stops early (a stop request): the last step is kept.
  CheckpointingInstruction checkpoint_instruction(const TrainingProgress& progress, const EvaluationResultBatch*,
                                                  bool early_stopping_criterion_fulfilled) override {
    return {early_stopping_criterion_fulfilled || progress.num_seen_steps_total() % k_ == 0, {}};
  }

 private:
  std::int64_t k_;
};

// --- checkpoint_saving/default ----------------------------------------------------

struct CheckpointSavingConfig {
  Ref<CheckpointSavingStrategy> checkpoint_saving_strategy;
  Ref<CheckpointSavingExecution> checkpoint_saving_execution;
  static void describe(Schema<CheckpointSavingConfig>& s) {
    s.field("checkpoint_saving_strategy", &CheckpointSavingConfig::checkpoint_saving_strategy,
            "Decides whether to save and what to delete.")
        .required();
    s.field("checkpoint_saving_execution", &CheckpointSavingConfig::checkpoint_saving_execution,
            "Writes and deletes checkpoints on disk.")
        .required();
  }
};

class DefaultCheckpointSaving final : public CheckpointSaving {
 public:
  explicit DefaultCheckpointSaving(const CheckpointSavingConfig& c)
      : strategy_(c.checkpoint_saving_strategy.shared()), execution_(c.checkpoint_saving_execution.shared()) {}
  void save_checkpoint(const TrainingProgress& progress, const EvaluationResultBatch* evaluation_result,
                       AppState& app_state, bool early_stopping_criterion_fulfilled) override {
    const CheckpointingInstruction ins =
        strategy_->checkpoint_instruction(progress, evaluation_result, early_stopping_criterion_fulfilled);
    execution_->run_checkpoint_instruction(ins, progress, app_state);
  }

 private:
  std::shared_ptr<CheckpointSavingStrategy> strategy_;
  std::shared_ptr<CheckpointSavingExecution> execution_;
};

// --- executions ---------------------------------------------------------------------

struct ExecutionConfig {
  fs::path checkpoint_path;
  std::int64_t global_rank = 0;
  std::string experiment_id;
  static void describe(Schema<ExecutionConfig>& s) {
    s.field("checkpoint_path", &ExecutionConfig::checkpoint_path,
            "Directory that receives the checkpoint folders and last_checkpoint_info.json.")
        .required();
    s.field("global_rank", &ExecutionConfig::global_rank, "Rank of this process; only rank 0 writes files.")
        .required()
        .non_negative();
    s.field("experiment_id", &ExecutionConfig::experiment_id, "Experiment id, the eid_<id> of folder names.")
        .required();
  }
};

// Note [One format for both executions]
// `dcp` and `fsdp1` differ in Modalities only by how they gather sharded
// state (PyTorch DCP vs. FSDP1 full state dicts) and by the file layout. Here
// both write the same folder (format v1); `fsdp1` additionally puts
// model_checkpoint_path / optimizer_checkpoint_path into
// last_checkpoint_info.json (both naming the folder's app_state.safetensors),
// so Modalities' FSDP1 warm-start configs keep working.
class FolderCheckpointExecution final : public CheckpointSavingExecution {
 public:
  FolderCheckpointExecution(const ExecutionConfig& c, std::string variant, bool fsdp1_keys)
      : c_(c), variant_(std::move(variant)), fsdp1_keys_(fsdp1_keys) {
    if (dist::initialized() && c_.global_rank != dist::rank())
      throw Error(fmt::format(
          "{}: global_rank is {}, but this process is rank {} of {} (use \"${{settings.cuda_env.global_rank}}\")",
          variant_, c_.global_rank, dist::rank(), dist::world_size()));
    if (c_.global_rank == 0)
      for (const auto& name : remove_stale_temporaries(c_.checkpoint_path))
        log::warning(
            fmt::format("removed '{}' in {}, an unfinished checkpoint of a process that was killed "
                        "while writing it",
                        name, c_.checkpoint_path.string()));
  }

  fs::path folder_for(const TrainingProgress& progress) const {
    return c_.checkpoint_path / checkpoint_folder_name(c_.experiment_id, progress);
  }

  void save(AppState& app_state, const TrainingProgress& progress) override {
    StateDict state = app_state.state_dict();  // on every rank: sharded state may need collectives
    for (const auto& [name, t] : state)
      MODALITIES_CHECK(!name.starts_with(kRngPrefix),
                       "{}: the app state uses the reserved key '{}' (rng.* holds RNG states)", variant_, name);
    const fs::path folder = folder_for(progress);
    if (dist::world_size() > 1) {
      save_sharded(app_state, state, folder, progress);
      return;
    }
    if (c_.global_rank != 0) return;
    check_not_sharded(app_state);
    add_rng_states(state);
    write_checkpoint_folder(folder, state, {c_.experiment_id, progress, variant_});
    write_info(folder, /*folder_only=*/false);
  }

  void delete_checkpoint(const TrainingProgress& progress) override {
    if (c_.global_rank != 0) return;
    const fs::path folder = folder_for(progress);
    std::error_code ec;
    if (!fs::exists(folder, ec)) {
      // Already gone (e.g. removed by hand to free disk): the new checkpoint is written,
      // so the run goes on.
      log::warning(fmt::format("old checkpoint folder '{}' was to be deleted but no longer exists", folder.string()));
      return;
    }
    if (!fs::is_directory(folder, ec) || !fs::exists(folder / kManifestFile, ec))
      throw Error(fmt::format("refusing to delete '{}': it is not a checkpoint folder ({} is missing)", folder.string(),
                              kManifestFile));
    fs::remove_all(folder, ec);
    if (ec) throw Error(fmt::format("cannot remove checkpoint folder '{}': {}", folder.string(), ec.message()));
  }

 private:
  // This writer stores the tensors one process holds. Sharded parts would
  // silently lose the other ranks' shards, so they are refused.
  void check_not_sharded(const AppState& app_state) const {
    for (const auto& part : app_state.model_parts()) {
      const StateDict local = part->state_dict();
      for (const auto& [fqn, placement] : part->shard_placements()) {
        auto it = local.find(fqn);
        if (it == local.end()) continue;
        const auto sizes = it->second.sizes();
        if (std::vector<std::int64_t>(sizes.begin(), sizes.end()) != placement.global_shape)
          throw Error(fmt::format(
              "{}: '{}' is sharded across ranks (local {} of {}); this execution writes "
              "unsharded state from rank 0 only, and sharded saving is not implemented",
              variant_, fqn, shape_string({sizes.begin(), sizes.end()}), shape_string(placement.global_shape)));
      }
    }
  }

  // Format v2 (format.h): every rank writes what it holds; see Note [Writing a sharded checkpoint].
  void save_sharded(const AppState& app_state, const StateDict& state, const fs::path& folder,
                    const TrainingProgress& progress) {
    const auto sharded = sharded_model_entries(app_state, state);
    std::vector<LocalTensor> tensors;
    tensors.reserve(state.size());
    for (const auto& [name, t] : state) {
      const std::vector<std::int64_t> local = t.sizes().vec();
      const Placement* p = nullptr;
      if (auto it = sharded.find(name); it != sharded.end()) p = &it->second;
      else p = optimizer_entry_placement(name, sharded, [&](const Placement& q) { return q.local_shape == local; });
      if (p) tensors.push_back({name, t, p->global_shape, p->offsets});
      else tensors.push_back({name, t, local, std::vector<std::int64_t>(local.size(), 0)});
    }
    StateDict rng;
    add_rng_states(rng);
    write_sharded_checkpoint_folder(folder, tensors, rng, {c_.experiment_id, progress, variant_},
                                    [&] { write_info(folder, /*folder_only=*/true); });
  }

  // last_checkpoint_info.json (rank 0). fsdp1 keys name the model and optimizer checkpoint: the
  // single file of format v1, the folder of format v2 (both readers accept either).
  void write_info(const fs::path& folder, bool folder_only) const {
    const std::string absolute = fs::absolute(folder).string();
    std::map<std::string, std::string> info{{"checkpoint_folder_path", absolute}};
    if (fsdp1_keys_) {  // See Note [One format for both executions]
      const std::string file = folder_only ? absolute : (fs::path(absolute) / kAppStateFile).string();
      info["model_checkpoint_path"] = file;
      info["optimizer_checkpoint_path"] = file;
    }
    write_last_checkpoint_info(c_.checkpoint_path, info);
  }

  ExecutionConfig c_;
  std::string variant_;
  bool fsdp1_keys_;
};

// --- app_state/raw ----------------------------------------------------------------------

struct RawAppStateConfig {
  ModelParts model;
  Ref<Optimizer> optimizer;
  std::optional<Ref<LRScheduler>> lr_scheduler;
  static void describe(Schema<RawAppStateConfig>& s) {
    s.field("model", &RawAppStateConfig::model, "The model, or a list of model parts (pipeline stages).").required();
    s.field("optimizer", &RawAppStateConfig::optimizer, "The optimizer over the model's parameters.").required();
    s.field("lr_scheduler", &RawAppStateConfig::lr_scheduler, "The learning-rate scheduler, if the run has one.");
  }
};

class RawAppState final : public AppState {
 public:
  explicit RawAppState(const RawAppStateConfig& c) : parts_(c.model.shared()), optimizer_(c.optimizer.shared()) {
    if (c.lr_scheduler) scheduler_ = c.lr_scheduler->shared();
  }

  std::vector<std::shared_ptr<Module>> model_parts() const override { return parts_; }
  std::shared_ptr<Optimizer> optimizer() const override { return optimizer_; }
  std::shared_ptr<LRScheduler> lr_scheduler() const override { return scheduler_; }
  bool is_loaded() const override { return loaded_; }

  StateDict state_dict() const override {
    StateDict out;
    for (std::size_t i = 0; i < parts_.size(); ++i)
      for (auto& [k, v] : parts_[i]->state_dict())
        MODALITIES_CHECK(out.emplace("model." + k, v).second,
                         "app state: parameter name '{}' occurs in more than one model part (part {}); names must be "
                         "unique across parts",
                         k, i);
    for (auto& [k, v] : optimizer_->state_dict()) out.emplace("optimizer." + k, v);
    if (scheduler_)
      for (auto& [k, v] : scheduler_->state_dict()) out.emplace("lr_scheduler." + k, v);
    return out;
  }

  void load_state_dict(const StateDict& state) override {
    if (loaded_)
      throw Error(
          "cannot load a state dict into the app state twice: it was already loaded (an app state is "
          "restored from one checkpoint only)");
    std::vector<std::string> unknown_prefix;
    for (const auto& [k, v] : state)
      if (!k.starts_with("model.") && !k.starts_with("optimizer.") && !k.starts_with("lr_scheduler."))
        unknown_prefix.push_back(k);
    MODALITIES_CHECK(unknown_prefix.empty(), "app state: keys {} are neither model.*, optimizer.* nor lr_scheduler.*",
                     some_names(unknown_prefix));
    // Model keys are checked over the union of the parts: each part takes its own keys (non-strict per part),
    // but a key no part has, or a part key the state lacks, is an error.
    const StateDict model = with_prefix_removed(state, "model.");
    std::vector<StateDict> per_part(parts_.size());
    std::set<std::string> own;
    std::vector<std::string> missing, unknown;
    for (std::size_t i = 0; i < parts_.size(); ++i)
      for (const auto& [k, v] : parts_[i]->state_dict()) {
        own.insert(k);
        auto it = model.find(k);
        if (it == model.end()) missing.push_back(k);
        else per_part[i].emplace(k, it->second);
      }
    for (const auto& [k, v] : model)
      if (own.count(k) == 0) unknown.push_back(k);
    if (!missing.empty() || !unknown.empty())
      throw Error(fmt::format("app state: the checkpointed model does not match this model: {}{}{}",
                              missing.empty() ? "" : fmt::format("missing {} ", some_names(missing)),
                              missing.empty() || unknown.empty() ? "" : "; ",
                              unknown.empty() ? "" : fmt::format("unknown {}", some_names(unknown))));
    const StateDict sched = with_prefix_removed(state, "lr_scheduler.");
    MODALITIES_CHECK(!scheduler_ || !sched.empty(),
                     "app state: the run has an lr_scheduler, but the checkpoint holds no lr_scheduler.* state");
    for (std::size_t i = 0; i < parts_.size(); ++i) parts_[i]->load_state_dict(per_part[i], /*strict=*/false);
    optimizer_->load_state_dict(with_prefix_removed(state, "optimizer."));
    if (scheduler_) scheduler_->load_state_dict(sched);  // without a scheduler, lr_scheduler.* is ignored
    loaded_ = true;
  }

 private:
  std::vector<std::shared_ptr<Module>> parts_;
  std::shared_ptr<Optimizer> optimizer_;
  std::shared_ptr<LRScheduler> scheduler_;
  bool loaded_ = false;
};

// --- loading a checkpoint folder into an AppState ---------------------------------------

// Validates everything that can be checked without reading tensor data
// (format, version, shapes, model keys), then reads, verifies checksums,
// loads and restores the RNG states.
// A checkpoint of either format, written at any world size, loads into this rank's app state:
// each rank reads only the regions of the sharded tensors it holds (Module::shard_placements;
// optimizer state follows its parameter) and the whole of everything else.
void load_into_app_state(AppState& app_state, const fs::path& checkpoint_dir) {
  if (app_state.is_loaded())
    throw Error(
        fmt::format("cannot load checkpoint '{}': the app state was already loaded (an app state is restored "
                    "from one checkpoint only)",
                    checkpoint_dir.string()));
  const CheckpointReader reader(checkpoint_dir);
  // A run continued under a new experiment id (the documented way) writes elsewhere, so the
  // unfinished checkpoint that the interrupted run left next to this one would stay forever: rank 0
  // removes such folders there too, as a new run does in its own checkpoint_path.
  if (!dist::initialized() || dist::is_rank0())
    for (const auto& name : remove_stale_temporaries(checkpoint_dir.parent_path()))
      log::warning(
          fmt::format("removed '{}' in {}, an unfinished checkpoint of a process that was killed while "
                      "writing it",
                      name, checkpoint_dir.parent_path().string()));
  const StateDict live = app_state.state_dict();
  const auto sharded = sharded_model_entries(app_state, live);
  std::map<std::string, std::vector<std::int64_t>> global;
  for (const auto& [k, v] : live) {
    const auto it = sharded.find(k);
    global.emplace(k, it == sharded.end() ? v.sizes().vec() : it->second.global_shape);
  }
  reader.check_shapes(global);
  // Pipeline stages: a rank holds part of the model, and the checkpoint's entries of the other
  // parts belong to other ranks. An entry no rank holds is a different model.
  std::set<std::string> held;
  for (const auto& [k, v] : live)
    if (k.starts_with("model.")) held.insert(k);
  const std::set<std::string> local = held;
  if (dist::world_size() > 1) {
    static int loads = 0;  // the same on every rank: every rank loads the same checkpoints in the same order
    std::string mine;
    for (const auto& k : local) mine += k + "\n";
    for (const std::string& theirs : dist::all_gather_strings(fmt::format("checkpoint_load/{}/keys", loads++), mine))
      for (std::size_t at = 0, end; (end = theirs.find('\n', at)) != std::string::npos; at = end + 1)
        held.insert(theirs.substr(at, end - at));
  }
  // Whether checkpoint entry `k` is this rank's to load: its model entries, the optimizer state and
  // settings of its parameters, and everything that is not per parameter.
  const auto is_local = [&](const std::string& k) {
    if (k.starts_with("model.")) return local.contains(k);
    for (const std::string_view prefix : {"optimizer.state.", "optimizer.param_groups."}) {
      if (!k.starts_with(prefix)) continue;
      const std::string_view rest = std::string_view(k).substr(prefix.size());
      return std::any_of(local.begin(), local.end(), [&](const std::string& m) {
        const std::string_view fqn = std::string_view(m).substr(6);
        return rest.size() > fqn.size() && rest.starts_with(fqn) && rest[fqn.size()] == '.';
      });
    }
    return true;
  };
  std::vector<std::string> missing, unknown;
  for (const auto& [k, v] : live)
    if (k.starts_with("model.") && reader.shapes().count(k) == 0) missing.push_back(k.substr(6));
  for (const auto& [k, shape] : reader.shapes())
    if (k.starts_with("model.") && held.count(k) == 0) unknown.push_back(k.substr(6));
  if (!missing.empty() || !unknown.empty())
    throw Error(fmt::format(
        "checkpoint '{}' was written by a different model: {}{}{}", reader.folder().string(),
        missing.empty() ? "" : fmt::format("this model's {} are not in the checkpoint", some_names(missing)),
        missing.empty() || unknown.empty() ? "" : "; ",
        unknown.empty() ? "" : fmt::format("the checkpoint's {} are not in this model", some_names(unknown))));
  std::map<std::string, std::optional<Box>> regions;
  for (const auto& [k, shape] : reader.shapes()) {
    if (k.starts_with(kRngPrefix) || !is_local(k)) continue;
    if (k.starts_with("lr_scheduler.") && !app_state.lr_scheduler()) continue;
    const Placement* p = nullptr;
    if (auto it = sharded.find(k); it != sharded.end()) p = &it->second;
    else p = optimizer_entry_placement(k, sharded, [&](const Placement& q) { return q.global_shape == shape; });
    regions.emplace(k, p ? std::optional<Box>(Box{p->offsets, p->local_shape}) : std::nullopt);
  }
  const StateDict state = reader.read_regions(regions);
  // Same world size: every rank gets its own generators back. Otherwise rank r takes rank r's
  // when that rank existed, else rank 0's (resharding changes the numerics anyway).
  const int rank = dist::rank();
  const StateDict rng = reader.read_rng(rank < reader.saved_world_size() ? rank : 0);
  try {
    app_state.load_state_dict(state);
  } catch (const std::exception& e) {
    throw Error(fmt::format("cannot load checkpoint '{}': {}", reader.folder().string(), e.what()));
  }
  restore_rng_states(rng);
}

struct DcpAppStateConfig {
  Ref<AppState> raw_app_state;
  fs::path checkpoint_dir_path;
  static void describe(Schema<DcpAppStateConfig>& s) {
    s.field("raw_app_state", &DcpAppStateConfig::raw_app_state, "The app state to restore (must not be loaded yet).")
        .required();
    s.field("checkpoint_dir_path", &DcpAppStateConfig::checkpoint_dir_path,
            "Checkpoint folder (checkpoint_folder_path of last_checkpoint_info.json).")
        .required();
  }
};

struct DcpLoadingConfig {
  std::int64_t global_rank = 0;
  static void describe(Schema<DcpLoadingConfig>& s) {
    s.field("global_rank", &DcpLoadingConfig::global_rank, "Rank of this process (every rank reads the folder).")
        .required()
        .non_negative();
  }
};

class DcpCheckpointLoading final : public DistributedCheckpointLoading {
 public:
  void load_checkpoint(AppState& app_state, const fs::path& checkpoint_dir) override {
    load_into_app_state(app_state, checkpoint_dir);
  }
};

// --- checkpoint_loading/torch -----------------------------------------------------

struct TorchLoadingConfig {
  DeviceSetting device;
  std::optional<std::string> precision;
  static void describe(Schema<TorchLoadingConfig>& s) {
    s.field("device", &TorchLoadingConfig::device, "Device to load the model onto: N (cuda:N) or \"cpu\".").required();
    s.field("precision", &TorchLoadingConfig::precision,
            "Cast the model's floating-point tensors to this dtype; null keeps the checkpoint's dtype.")
        .one_of({"FP32", "FP16", "BF16"});
  }
};

// A model state dict from: a checkpoint folder (its model.* entries, verified),
// a checkpoint's app_state.safetensors, or any flat .safetensors file.
StateDict read_model_state(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Error(fmt::format("model checkpoint '{}' does not exist", path.string()));
  const auto is_model = [](const std::string& k) { return k.starts_with("model."); };
  if (fs::is_directory(path, ec)) return with_prefix_removed(CheckpointReader(path).read(is_model), "model.");
  const std::string ext = path.extension().string();
  if (ext == ".bin" || ext == ".pt" || ext == ".pth")
    throw Error(
        fmt::format("'{}' looks like a PyTorch pickle checkpoint (torch.save), which LibTorch cannot read\n"
                    "  hint: convert it with scripts/convert_checkpoint.py bin-to-safetensors <file> <out.safetensors>",
                    path.string()));
  const auto meta = formats::read_safetensors_metadata(path);
  if (auto it = meta.find("format"); it != meta.end() && it->second == kFormatName) {
    if (fs::exists(path.parent_path() / kManifestFile, ec))
      return with_prefix_removed(CheckpointReader(path).read(is_model), "model.");
    return with_prefix_removed(formats::read_safetensors(path, is_model), "model.");
  }
  return formats::read_safetensors(path);
}

StateDict read_optimizer_state(const fs::path& path) {
  std::error_code ec;
  const auto is_opt = [](const std::string& k) { return k.starts_with("optimizer."); };
  StateDict state;
  if (fs::is_directory(path, ec) ||
      (fs::exists(path.parent_path() / kManifestFile, ec) && path.filename() == kAppStateFile))
    state = CheckpointReader(path).read(is_opt);
  else state = formats::read_safetensors(path, is_opt);
  MODALITIES_CHECK(!state.empty(), "'{}' holds no optimizer state (no optimizer.* tensors)", path.string());
  return with_prefix_removed(state, "optimizer.");
}

class TorchCheckpointLoading final : public CheckpointLoading {
 public:
  explicit TorchCheckpointLoading(const TorchLoadingConfig& c) : device_(c.device.text) {
    if (device_.is_cuda() && !at::hasCUDA())
      throw Error(fmt::format("device {} requested, but this build or machine has no CUDA device", device_.str()));
    if (c.precision == "FP32") precision_ = at::kFloat;
    if (c.precision == "FP16") precision_ = at::kHalf;
    if (c.precision == "BF16") precision_ = at::kBFloat16;
  }

  std::shared_ptr<Module> load_model_checkpoint(std::shared_ptr<Module> model, const fs::path& file) override {
    const StateDict state = read_model_state(file);
    std::optional<c10::ScalarType> stored;
    for (const auto& [k, v] : state)
      if (c10::isFloatingType(v.scalar_type())) {
        stored = v.scalar_type();
        break;
      }
    if (precision_ && stored && *stored != *precision_)
      log::warning(fmt::format("model checkpoint '{}' was stored with precision {} but is loaded with precision {}",
                               file.string(), c10::toString(*stored), c10::toString(*precision_)));
    // Without a precision the model adopts the stored dtype (Modalities loads with assign=True).
    model->to(device_, precision_ ? precision_ : stored);
    try {
      model->load_state_dict(state, /*strict=*/true);
    } catch (const std::exception& e) {
      throw Error(fmt::format("cannot load model checkpoint '{}': {}", file.string(), e.what()));
    }
    return model;
  }

  // Modalities' torch loader has no optimizer loading; this format has the
  // optimizer next to the model, so it is offered here.
  void load_optimizer_checkpoint(Optimizer& optimizer, Module&, const fs::path& file) override {
    optimizer.load_state_dict(read_optimizer_state(file));
  }

 private:
  c10::Device device_;
  std::optional<c10::ScalarType> precision_;
};

// checkpoint_loading/fsdp1 on one process: the full state dict is loaded into the
// model where it lives (FSDP1 loads on rank 0 and broadcasts; with one rank there is
// nothing to broadcast or shard), then the FSDP1 mixed-precision preset is applied as
// per-use parameter casting (Module::set_param_dtype). Differences from FSDP1, stated
// in the README: buffers are never cast, and the sharding strategy has no effect.
struct Fsdp1LoadingConfig {
  std::int64_t global_rank = 0;
  std::vector<std::string> block_names;
  std::string mixed_precision_settings;
  std::string sharding_strategy;
  static void describe(Schema<Fsdp1LoadingConfig>& s) {
    using C = Fsdp1LoadingConfig;
    s.field("global_rank", &C::global_rank, "Rank of this process (one process: 0).").required().non_negative();
    s.field("block_names", &C::block_names, "Class names of the FSDP units, e.g. [\"GPT2Block\"]; each must exist.")
        .required();
    s.field("mixed_precision_settings", &C::mixed_precision_settings,
            "FSDP1 preset: parameters used in FP_16 / BF_16 / MIXED_PRECISION_MEGATRON (bf16), or fp32 "
            "(BF_16_WORKING, FP_32, NO_MIXED_PRECISION).")
        .required()
        .one_of({"FP_16", "BF_16", "BF_16_WORKING", "FP_32", "MIXED_PRECISION_MEGATRON", "NO_MIXED_PRECISION"});
    s.field("sharding_strategy", &C::sharding_strategy, "FSDP1 sharding strategy (no effect on one process).")
        .required()
        .one_of({"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"});
  }
};

class Fsdp1CheckpointLoading final : public CheckpointLoading {
 public:
  explicit Fsdp1CheckpointLoading(const Fsdp1LoadingConfig& c) : c_(c) {
    if (c.mixed_precision_settings == "FP_16") param_dtype_ = at::kHalf;
    if (c.mixed_precision_settings == "BF_16" || c.mixed_precision_settings == "MIXED_PRECISION_MEGATRON")
      param_dtype_ = at::kBFloat16;
  }

  std::shared_ptr<Module> load_model_checkpoint(std::shared_ptr<Module> model, const fs::path& file) override {
    for (const auto& name : c_.block_names)
      MODALITIES_CHECK(!model->submodules_of_class(name).empty(),
                       "checkpoint_loading/fsdp1: block_names: the model has no submodule of class '{}'", name);
    const StateDict state = read_model_state(file);
    try {
      model->load_state_dict(state, /*strict=*/true);
    } catch (const std::exception& e) {
      throw Error(fmt::format("cannot load model checkpoint '{}': {}", file.string(), e.what()));
    }
    model->set_param_dtype(param_dtype_);
    return model;
  }

  void load_optimizer_checkpoint(Optimizer& optimizer, Module&, const fs::path& file) override {
    optimizer.load_state_dict(read_optimizer_state(file));
  }

 private:
  Fsdp1LoadingConfig c_;
  std::optional<c10::ScalarType> param_dtype_;
};

// model/fsdp1_checkpointed: the model with a checkpoint loaded into it by a
// CheckpointLoading (in practice checkpoint_loading/torch, for inference).
// Modalities' name is kept; nothing is FSDP-wrapped in one process.
struct CheckpointedModelConfig {
  Ref<CheckpointLoading> checkpoint_loading;
  fs::path checkpoint_path;
  Ref<Module> model;
  static void describe(Schema<CheckpointedModelConfig>& s) {
    using C = CheckpointedModelConfig;
    s.field("checkpoint_loading", &C::checkpoint_loading, "How to load (checkpoint_loading/torch).").required();
    s.field("checkpoint_path", &C::checkpoint_path,
            "Checkpoint folder, its app_state.safetensors, or a plain .safetensors state dict.")
        .required();
    s.field("model", &C::model, "The (unwrapped) model to load into.").required();
  }
};

// optimizer/fsdp1_checkpointed: the optimizer with a checkpoint's optimizer state loaded
// into it (Modalities' FSDP1 warm start: model and optimizer checkpoint paths from
// last_checkpoint_info.json). One process: nothing to scatter.
struct CheckpointedOptimizerConfig {
  Ref<CheckpointLoading> checkpoint_loading;
  fs::path checkpoint_path;
  Ref<Module> wrapped_model;
  Ref<Optimizer> optimizer;
  static void describe(Schema<CheckpointedOptimizerConfig>& s) {
    using C = CheckpointedOptimizerConfig;
    s.field("checkpoint_loading", &C::checkpoint_loading, "How to load (checkpoint_loading/torch).").required();
    s.field("checkpoint_path", &C::checkpoint_path,
            "Checkpoint folder or its app_state.safetensors (optimizer_checkpoint_path of last_checkpoint_info.json).")
        .required();
    s.field("wrapped_model", &C::wrapped_model, "The model the optimizer was built on.").required();
    s.field("optimizer", &C::optimizer, "The optimizer to restore, in place (and returned).").required();
  }
};

}  // namespace

void register_components(Registrar& r) {
  r.add<CheckpointLoading, Fsdp1LoadingConfig>(
      "fsdp1", "Loads a checkpoint's model (and optimizer) state; one process: no sharding, mixed precision per use.",
      [](const Fsdp1LoadingConfig& c) { return std::make_shared<Fsdp1CheckpointLoading>(c); });
  r.add<Optimizer, CheckpointedOptimizerConfig>(
      "fsdp1_checkpointed", "The optimizer with a checkpoint's optimizer state loaded into it (in place).",
      [](const CheckpointedOptimizerConfig& c) {
        c.checkpoint_loading->load_optimizer_checkpoint(*c.optimizer, *c.wrapped_model, c.checkpoint_path);
        return c.optimizer.shared();
      });
  r.add<Module, CheckpointedModelConfig>(
      "fsdp1_checkpointed", "The model with a checkpoint's weights loaded by checkpoint_loading (inference).",
      [](const CheckpointedModelConfig& c) {
        return c.checkpoint_loading->load_model_checkpoint(c.model.shared(), c.checkpoint_path);
      });
  r.add<CheckpointSavingStrategy, SaveKMostRecentConfig>(
      "save_k_most_recent_checkpoints_strategy", "Keep the k most recent checkpoints of this run (-1: all, 0: none).",
      [](const SaveKMostRecentConfig& c) { return std::make_shared<SaveKMostRecent>(c.k); });
  r.add<CheckpointSavingStrategy, SaveEveryKStepsConfig>(
      "save_every_k_steps_checkpointing_strategy", "Save when the step count is a multiple of k; never delete.",
      [](const SaveEveryKStepsConfig& c) { return std::make_shared<SaveEveryKSteps>(c.k); });
  r.add<CheckpointSaving, CheckpointSavingConfig>(
      "default", "Asks the strategy, then lets the execution save and delete.",
      [](const CheckpointSavingConfig& c) { return std::make_shared<DefaultCheckpointSaving>(c); });
  r.add<CheckpointSavingExecution, ExecutionConfig>(
      "dcp", "Writes checkpoint folders (format v1: app_state.safetensors + manifest.json).",
      [](const ExecutionConfig& c) {
        return std::make_shared<FolderCheckpointExecution>(c, "checkpoint_saving_execution/dcp", false);
      });
  r.add<CheckpointSavingExecution, ExecutionConfig>(
      "fsdp1", "Same folders as dcp; last_checkpoint_info.json also names model/optimizer checkpoint paths.",
      [](const ExecutionConfig& c) {
        return std::make_shared<FolderCheckpointExecution>(c, "checkpoint_saving_execution/fsdp1", true);
      });
  r.add<AppState, RawAppStateConfig>("raw", "Model part(s), optimizer and optional scheduler as one state.",
                                     [](const RawAppStateConfig& c) { return std::make_shared<RawAppState>(c); });
  r.add<AppState, DcpAppStateConfig>("dcp", "raw_app_state, restored in place from a checkpoint folder.",
                                     [](const DcpAppStateConfig& c) {
                                       load_into_app_state(*c.raw_app_state, c.checkpoint_dir_path);
                                       return c.raw_app_state.shared();
                                     });
  r.add<DistributedCheckpointLoading, DcpLoadingConfig>(
      "dcp", "Loads a checkpoint folder into an app state.",
      [](const DcpLoadingConfig&) { return std::make_shared<DcpCheckpointLoading>(); });
  r.add<CheckpointLoading, TorchLoadingConfig>(
      "torch", "Loads the model of a checkpoint folder or .safetensors file (inference).",
      [](const TorchLoadingConfig& c) { return std::make_shared<TorchCheckpointLoading>(c); });
  r.add_run_resume(
      {"app_state/raw wrapped in app_state/dcp, training progress from the checkpoint folder's name", resume_run});
}

}  // namespace modalities::plugins::checkpointing

MODALITIES_PLUGIN(checkpointing, MODALITIES_PLUGIN_VERSION, modalities::plugins::checkpointing::register_components)
