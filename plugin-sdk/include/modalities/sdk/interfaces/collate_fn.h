// The collate-function interface: stacks a micro-batch of samples into model
// inputs and loss targets (e.g. the GPT-2 shift by one token), optionally
// post-processing them (loss masking). Maps Modalities' CollateFnIF
// (`collate_fn/*`).
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <span>
#include <string_view>

namespace modalities {

/// Turns samples into a DatasetBatch.
///
/// Built once per run. collate() is const and must be safe to call
/// concurrently: loader workers collate different batches at the same time.
/// Wrappers (`mask_loss_collator_wrapper`) call the wrapped CollateFn, then
/// rewrite its targets.
///
/// \code
///   std::vector<Sample> samples = ...;              // each {"input_ids": [L]}
///   DatasetBatch b = collate->collate(samples);
///   // b.samples["input_ids"]: [B, L-1], b.targets["target_ids"]: [B, L-1]
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr). The result owns
/// new tensors (stacking copies), so samples may alias read-only storage.
/// Errors: mismatched lengths or missing keys throw modalities::Error; never
/// exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API CollateFn {
 public:
  static constexpr std::string_view kInterface = "CollateFn";
  static constexpr std::string_view kComponentKey = "collate_fn";

  CollateFn() = default;
  CollateFn(const CollateFn&) = delete;
  CollateFn& operator=(const CollateFn&) = delete;
  virtual ~CollateFn();  // defined in the SDK library: one vtable, one typeinfo

  /// One batch from `samples` (batch dimension 0, in the given order).
  virtual DatasetBatch collate(std::span<const Sample> samples) const = 0;
};

}  // namespace modalities
