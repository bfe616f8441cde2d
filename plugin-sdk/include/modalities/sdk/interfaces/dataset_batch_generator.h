// The dataset-batch-generator interface: produces synthetic batches on demand,
// so a forward/backward step can be profiled without a dataset or loader.
// Used by `steppable_component/forward_pass`. Maps Modalities'
// DatasetBatchGeneratorIF (`dataset_batch_generator/random`).
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <string_view>

namespace modalities {

/// A source of ready-made DatasetBatch values.
///
/// Built once per profiling run; dataset_batch() is called once per profiled
/// step from the profiling thread. It may advance internal or global RNG state.
///
/// \code
///   DatasetBatch b = generator->dataset_batch();  // {"input_ids"}, {"target_ids"}
///   b.to(device);
///   model->forward(b.samples);
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); each batch is a
/// new value owned by the caller.
/// Errors: throw modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API DatasetBatchGenerator {
 public:
  static constexpr std::string_view kInterface = "DatasetBatchGenerator";
  static constexpr std::string_view kComponentKey = "dataset_batch_generator";

  DatasetBatchGenerator() = default;
  DatasetBatchGenerator(const DatasetBatchGenerator&) = delete;
  DatasetBatchGenerator& operator=(const DatasetBatchGenerator&) = delete;
  virtual ~DatasetBatchGenerator();  // defined in the SDK library: one vtable, one typeinfo

  /// A fresh batch (Modalities' get_dataset_batch()).
  virtual DatasetBatch dataset_batch() = 0;
};

}  // namespace modalities
