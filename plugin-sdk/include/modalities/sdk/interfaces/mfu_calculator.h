// The MFU-calculator interface: converts measured throughput into model FLOPs
// utilization for the training log ("train mfu (16-bit)"). Maps Modalities'
// MFUCalculatorABC (`mfu_calculator/gpt2`).
#pragma once

#include <modalities/sdk/export.h>

#include <string_view>

namespace modalities {

/// Model FLOPs utilization from samples per second.
///
/// Built once per run after the model; count parameters (which may need a
/// collective under sharding) at construction. The gym calls compute() on
/// its thread at each training-log step, on every rank.
///
/// \code
///   double mfu = mfu_calculator->compute(global_samples / seconds);  // -1 when unknown
///   result.throughput_metrics.push_back({"train mfu (16-bit)", {at::scalar_tensor(mfu), 2}});
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr).
/// Errors: an unknown GPU or precision is not an error: compute() returns -1.
/// Other failures throw modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API MFUCalculator {
 public:
  static constexpr std::string_view kInterface = "MFUCalculator";
  static constexpr std::string_view kComponentKey = "mfu_calculator";

  MFUCalculator() = default;
  MFUCalculator(const MFUCalculator&) = delete;
  MFUCalculator& operator=(const MFUCalculator&) = delete;
  virtual ~MFUCalculator();  // defined in the SDK library: one vtable, one typeinfo

  /// MFU in [0, 1] for a global throughput of `num_samples_per_second`, or -1
  /// when the peak FLOP/s of this device or precision is unknown.
  virtual double compute(double num_samples_per_second) const = 0;
};

}  // namespace modalities
