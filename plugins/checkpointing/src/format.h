// The on-disk checkpoint format of this plugin (README.md, "Format v1"): one
// folder per checkpoint holding app_state.safetensors (the AppState state dict
// plus RNG states) and manifest.json (format version, provenance, progress,
// per-tensor SHA-256). Written into a temporary sibling and renamed, so a
// checkpoint folder either is complete or does not exist.
#pragma once

#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/jsonl.h>
#include <modalities/sdk/interfaces/batch.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace simdjson::dom {
class element;
}

namespace modalities::plugins::checkpointing {

inline constexpr std::string_view kFormatName = "modalities_checkpoint";
inline constexpr int kFormatVersion = 1;
inline constexpr std::string_view kPluginVersion = "0.1.0";
inline constexpr std::string_view kAppStateFile = "app_state.safetensors";
inline constexpr std::string_view kManifestFile = "manifest.json";
inline constexpr std::string_view kLastCheckpointInfoFile = "last_checkpoint_info.json";
// Keys of the RNG states inside app_state.safetensors (U8 tensors, the
// generators' get_state()); never part of AppState::state_dict().
inline constexpr std::string_view kRngPrefix = "rng.";
inline constexpr std::string_view kRngCpu = "rng.cpu";
inline constexpr std::string_view kRngCuda = "rng.cuda";

/// "eid_<E>-seen_steps_<S>-seen_tokens_<K>-target_steps_<TS>-target_tokens_<TT>" (Modalities' DCP folder name).
std::string checkpoint_folder_name(std::string_view experiment_id, const TrainingProgress& progress);

using formats::json_quote;  // modalities/sdk/formats/jsonl.h

/// What the manifest records besides the tensors.
struct CheckpointInfo {
  std::string experiment_id;
  TrainingProgress progress;
  std::string writer_variant;  // "checkpoint_saving_execution/dcp"
};

/// Adds the RNG states of this process (CPU default generator; the CUDA
/// generator of run_device() when it is a CUDA device) under rng.*.
void add_rng_states(StateDict& state);

/// Restores the generators from rng.* entries (a CUDA state only when the run
/// device is CUDA). Returns what was restored, for messages ("cpu", "cuda:0").
std::vector<std::string> restore_rng_states(const StateDict& state);

/// Writes `state` as checkpoint folder `folder` (atomically: temporary sibling,
/// fsync, rename; an existing folder of that name is replaced in one step).
/// On failure nothing under `folder` changes and the temporary folder is removed.
void write_checkpoint_folder(const std::filesystem::path& folder, const StateDict& state, const CheckpointInfo& info);

/// Writes `<dir>/last_checkpoint_info.json` atomically with the given keys (values: absolute paths).
/// Removes temporary checkpoint folders (".<name>.tmp-<pid>-...") left in `dir` by
/// processes that no longer run (killed mid-write). Returns the names removed.
std::vector<std::string> remove_stale_temporaries(const std::filesystem::path& dir);

void write_last_checkpoint_info(const std::filesystem::path& dir, const std::map<std::string, std::string>& entries);

/// A checkpoint folder, validated but not read yet.
class CheckpointReader {
 public:
  /// `path`: the folder, or its app_state.safetensors / manifest.json. Checks
  /// the manifest (format, version) and that app_state.safetensors lists
  /// exactly the manifest's tensors with the same dtype and shape.
  explicit CheckpointReader(const std::filesystem::path& path);

  const std::filesystem::path& folder() const { return folder_; }
  std::filesystem::path app_state_file() const { return folder_ / kAppStateFile; }
  /// Tensor name -> shape, as recorded.
  const std::map<std::string, std::vector<std::int64_t>>& shapes() const { return shapes_; }
  const std::string& experiment_id() const { return experiment_id_; }

  /// The training progress recorded in the manifest (checked against the folder name when that
  /// has Modalities' "eid_…-seen_steps_…" form).
  struct RecordedProgress {
    std::int64_t num_seen_steps = 0, num_seen_tokens = 0, num_target_steps = 0, num_target_tokens = 0;
  };
  const RecordedProgress& progress() const { return progress_; }

  /// Throws "checkpoint '<folder>' was written by a model of a different
  /// shape: <name> is [..] in the checkpoint, [..] in this model" for the first
  /// entry present in both with different shapes. `strip_prefix` is removed
  /// from names in the message ("model.").
  void check_shapes(const StateDict& live, std::string_view strip_prefix = "model.") const;

  /// Reads the selected tensors and verifies each against its SHA-256.
  StateDict read(const std::function<bool(const std::string&)>& select) const;
  StateDict read_all() const {
    return read([](const std::string&) { return true; });
  }

 private:
  void read_and_check_progress(const simdjson::dom::element& progress,
                               const std::function<Error(std::string_view)>& bad);

  std::filesystem::path folder_;
  std::string experiment_id_;
  RecordedProgress progress_;
  std::map<std::string, std::vector<std::int64_t>> shapes_;
  std::map<std::string, std::string> sha256_;
};

/// "[2,3]" for messages.
std::string shape_string(const std::vector<std::int64_t>& shape);

}  // namespace modalities::plugins::checkpointing
