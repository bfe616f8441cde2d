// The data-loader interface: yields the micro-batches of one pass over a
// dataset, in batch-sampler order, possibly prefetched by worker threads, and
// can start a pass at any batch so a resumed run continues where it stopped.
// Maps Modalities' LLMDataLoader (`data_loader/default`).
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace modalities {

/// A named, restartable source of DatasetBatch.
///
/// Built once per run; the gym iterates the train loader once and every eval
/// loader fully at each evaluation. begin() and next() are called from one
/// thread at a time (the gym's); an implementation may run worker threads
/// internally, but must deliver batches in order and stop them when a pass
/// ends, when begin() restarts, and in its destructor. tag() and size() are
/// const and thread-safe.
///
/// \code
///   loader->begin(0);
///   while (std::optional<DatasetBatch> batch = loader->next()) {
///     batch->to(device);
///     ...
///   }
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); it holds
/// shared_ptrs to its dataset, batch sampler and collate function. Batches are
/// returned by value and owned by the caller (on CPU; pinned if configured).
/// Errors: throw modalities::Error (an error in a worker is rethrown from
/// next()); never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API DataLoader {
 public:
  static constexpr std::string_view kInterface = "DataLoader";
  static constexpr std::string_view kComponentKey = "data_loader";

  DataLoader() = default;
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;
  virtual ~DataLoader();  // defined in the SDK library: one vtable, one typeinfo

  /// Name used in logs and metrics ("train", "val").
  virtual std::string tag() const = 0;

  /// Number of batches in a full pass (the batch sampler's size).
  virtual std::int64_t size() const = 0;

  /// Starts a new pass at batch `first_batch` (0 for a full pass; <= size()),
  /// discarding anything prefetched for the previous one.
  virtual void begin(std::int64_t first_batch) = 0;

  /// The next batch of the current pass, or std::nullopt when it is done.
  /// Calling next() without a begin() first is an error.
  virtual std::optional<DatasetBatch> next() = 0;
};

}  // namespace modalities
