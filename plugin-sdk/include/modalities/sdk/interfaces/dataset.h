// The dataset interface: a fixed-size, randomly accessible collection of
// samples (named token arrays). Samplers index it, collators stack what it
// returns. Maps torch.utils.data.Dataset as Modalities uses it (`dataset/*`).
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <cstdint>
#include <string_view>

namespace modalities {

/// Random access to `size()` samples.
///
/// Built once per run (or per data command). get() is const and must be safe
/// to call concurrently: the data loader may fetch from several worker
/// threads at once. It should be cheap enough to call per sample (memory
/// mapping, not reading whole files).
///
/// \code
///   for (std::int64_t i = 0; i < ds->size(); ++i) {
///     Sample s = ds->get(i);                 // {"input_ids": [L]}
///     at::Tensor ids = s.at("input_ids");
///   }
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr). Returned tensors
/// may alias read-only memory-mapped storage that lives as long as the
/// dataset; consumers copy (stacking does) before writing.
/// Errors: index outside [0, size()) and corrupt files throw modalities::Error;
/// never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API Dataset {
 public:
  static constexpr std::string_view kInterface = "Dataset";
  static constexpr std::string_view kComponentKey = "dataset";

  Dataset() = default;
  Dataset(const Dataset&) = delete;
  Dataset& operator=(const Dataset&) = delete;
  virtual ~Dataset();  // defined in the SDK library: one vtable, one typeinfo

  /// Number of samples.
  virtual std::int64_t size() const = 0;

  /// Sample `index`, keyed by the dataset's sample key(s), each value a 1-D
  /// token array (int64 or the storage dtype).
  virtual Sample get(std::int64_t index) const = 0;

  /// Bytes per stored token for packed datasets (1, 2 or 4), 0 when not
  /// applicable. Default: 0.
  virtual std::int64_t token_size_in_bytes() const;
};

}  // namespace modalities
