// The gradient-clipper interface: computes the total gradient norm over all
// parameters (synchronized across ranks) and optionally scales the gradients
// down to a maximum norm. Maps Modalities' GradientClipperIF
// (`gradient_clipper/*`).
#pragma once

#include <modalities/sdk/export.h>

#include <ATen/core/Tensor.h>

#include <string_view>

namespace modalities {

/// Measures, and possibly clips, the gradients of the model parts it was
/// built with.
///
/// Built once per run after the model. The gym calls clip_gradients() once
/// per optimizer step, after the last backward of the step and before
/// Optimizer::step(), on its thread, on every rank at the same time: it runs
/// collectives (shard, tensor and pipeline groups), so all ranks must call it.
///
/// \code
///   at::Tensor norm = clipper->clip_gradients();  // pre-clip total norm, same on every rank
///   optimizer->step();
///   grad_norms.push_back(norm.item<double>());
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); it holds
/// shared_ptrs to the model parts (and device mesh) it works on.
/// Errors: throw modalities::Error; a non-finite norm is returned, not thrown.
/// Never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API GradientClipper {
 public:
  static constexpr std::string_view kInterface = "GradientClipper";
  static constexpr std::string_view kComponentKey = "gradient_clipper";

  GradientClipper() = default;
  GradientClipper(const GradientClipper&) = delete;
  GradientClipper& operator=(const GradientClipper&) = delete;
  virtual ~GradientClipper();  // defined in the SDK library: one vtable, one typeinfo

  /// Total norm of all gradients *before* clipping (0-dim tensor); logging-only
  /// variants leave the gradients untouched.
  virtual at::Tensor clip_gradients() = 0;
};

}  // namespace modalities
