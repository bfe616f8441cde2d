// The on-disk checkpoint formats of this plugin (README.md, "Format"), one folder per checkpoint,
// written into a temporary sibling and renamed, so a checkpoint folder either is complete or does
// not exist:
//   v1 (one process): app_state.safetensors (the AppState state dict plus RNG states) and
//       manifest.json (format version, provenance, progress, per-tensor SHA-256);
//   v2 (several ranks): rank_<r>.safetensors per rank (the tensor chunks that rank holds and no
//       lower rank holds too, plus its RNG states) and manifest.json, which gives every tensor's
//       global shape and dtype and the chunks (file, offsets, shape, SHA-256) that tile it. A
//       reader assembles any region of any tensor from the chunks, so a checkpoint written at N
//       ranks loads at M.
#pragma once

#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/jsonl.h>
#include <modalities/sdk/interfaces/batch.h>

#include <ATen/core/Tensor.h>

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
inline constexpr int kFormatVersion = 1;         // one file: app_state.safetensors
inline constexpr int kShardedFormatVersion = 2;  // one file per rank: rank_<r>.safetensors
// The plugin's version from its CMakeLists.txt (modalities_add_plugin VERSION; also given to the
// test and fuzz targets that compile this file).
inline constexpr std::string_view kPluginVersion = MODALITIES_PLUGIN_VERSION;
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

/// "rank_00003.safetensors".
std::string rank_file_name(int rank);

/// One tensor of this rank's state: `tensor` is the chunk of the full tensor (of `global_shape`)
/// that starts at `offsets` (all zeros and the full shape for a tensor every rank holds whole).
struct LocalTensor {
  std::string name;
  at::Tensor tensor;
  std::vector<std::int64_t> global_shape;
  std::vector<std::int64_t> offsets;
};

/// Writes checkpoint folder `folder` in format v2, together with every other rank (a collective:
/// all ranks call it with the same folder, in the same order as their other collectives). Each
/// distinct chunk is written once, by the lowest rank that holds it; `rng` (this rank's generator
/// states) goes into this rank's file. Rank 0 checks that the chunks of every tensor tile it
/// exactly, writes manifest.json after every rank has finished writing, renames the temporary
/// folder to `folder` and then runs `after_commit` (e.g. writing last_checkpoint_info.json) before
/// any rank returns. A failure on any rank throws modalities::Error on every rank and leaves no
/// folder under that name; a killed rank makes the others fail within the store's timeout.
void write_sharded_checkpoint_folder(const std::filesystem::path& folder, const std::vector<LocalTensor>& tensors,
                                     const StateDict& rng, const CheckpointInfo& info,
                                     const std::function<void()>& after_commit);

/// Writes `<dir>/last_checkpoint_info.json` atomically with the given keys (values: absolute paths).
/// Removes temporary checkpoint folders (".<name>.tmp-<pid>-...") left in `dir` by
/// processes that no longer run (killed mid-write). Returns the names removed.
std::vector<std::string> remove_stale_temporaries(const std::filesystem::path& dir);

void write_last_checkpoint_info(const std::filesystem::path& dir, const std::map<std::string, std::string>& entries);

/// A region of a tensor: `shape` elements starting at `offsets`.
struct Box {
  std::vector<std::int64_t> offsets;
  std::vector<std::int64_t> shape;
};

/// A checkpoint folder, validated but not read yet.
class CheckpointReader {
 public:
  /// `path`: the folder, or its app_state.safetensors / manifest.json. Checks
  /// the manifest (format, version) and that app_state.safetensors lists
  /// exactly the manifest's tensors with the same dtype and shape.
  /// Format v2: every rank file listed must exist with the recorded size (a missing or truncated
  /// file is an error naming it); their headers are checked when they are read.
  explicit CheckpointReader(const std::filesystem::path& path);

  const std::filesystem::path& folder() const { return folder_; }
  std::filesystem::path app_state_file() const { return folder_ / kAppStateFile; }
  int format_version() const { return version_; }
  /// Ranks that wrote it (1 for format v1).
  int saved_world_size() const { return saved_world_size_; }
  /// Tensor name -> global shape, as recorded (format v1 includes the rng.* entries).
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
  /// The same for global shapes (a sharded model's full tensors).
  void check_shapes(const std::map<std::string, std::vector<std::int64_t>>& live,
                    std::string_view strip_prefix = "model.") const;

  /// Reads the selected tensors whole and verifies every chunk read against its SHA-256.
  StateDict read(const std::function<bool(const std::string&)>& select) const;
  StateDict read_all() const {
    return read([](const std::string&) { return true; });
  }

  /// Reads a region of each named tensor (std::nullopt: the whole tensor), touching only the
  /// chunks that overlap it; every chunk read is verified against its SHA-256. An unknown name or
  /// a region outside the tensor throws modalities::Error.
  StateDict read_regions(const std::map<std::string, std::optional<Box>>& regions) const;

  /// The generator states (rng.cpu, rng.cuda) saved by `rank` (format v1: the only ones).
  StateDict read_rng(int rank) const;

 private:
  struct ChunkRecord {
    std::string file;
    std::vector<std::int64_t> offsets, shape;
    std::string sha256;
  };
  struct TensorRecord {
    std::string dtype;
    std::vector<std::int64_t> shape;
    std::vector<ChunkRecord> chunks;
  };
  void read_v1(const simdjson::dom::element& root, const std::function<Error(std::string_view)>& bad);
  void read_v2(const simdjson::dom::element& root, const std::function<Error(std::string_view)>& bad);
  void read_and_check_progress(const simdjson::dom::element& progress,
                               const std::function<Error(std::string_view)>& bad);

  std::filesystem::path folder_;
  int version_ = kFormatVersion;
  int saved_world_size_ = 1;
  std::string experiment_id_;
  RecordedProgress progress_;
  std::map<std::string, std::vector<std::int64_t>> shapes_;
  std::map<std::string, TensorRecord> tensors_;
  // rank -> (file, rng tensor name -> SHA-256)
  std::map<int, std::pair<std::string, std::map<std::string, std::string>>> rng_;
};

/// "[2,3]" for messages.
std::string shape_string(const std::vector<std::int64_t>& shape);

}  // namespace modalities::plugins::checkpointing
