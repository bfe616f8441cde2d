// Modalities' `mixed_precision_settings = {param_dtype, reduce_dtype}` (names FP_16, FP_32,
// BF_16; and ours, FP_64: float64 compute, e.g. to compare layouts without float32 reordering
// noise), shared by model/mixed_precision (gpt2 plugin) and model/fsdp2_wrapped (fsdp plugin).
// Header-only: a config struct with its schema and the dtype each name means.
#pragma once

#include <modalities/sdk/schema.h>

#include <c10/core/ScalarType.h>

#include <string>
#include <vector>

namespace modalities {

inline const std::vector<std::string>& mixed_precision_dtype_names() {
  static const std::vector<std::string> names = {"FP_16", "FP_32", "BF_16", "FP_64"};
  return names;
}

/// The dtype of a name the schema accepted (FP_16, BF_16, FP_32, FP_64).
inline c10::ScalarType mixed_precision_dtype(const std::string& name) {
  if (name == "FP_16") return c10::ScalarType::Half;
  if (name == "BF_16") return c10::ScalarType::BFloat16;
  if (name == "FP_64") return c10::ScalarType::Double;
  return c10::ScalarType::Float;
}

struct MixedPrecisionSettings {
  std::string param_dtype;
  std::string reduce_dtype;
  static void describe(Schema<MixedPrecisionSettings>& s) {
    s.field("param_dtype", &MixedPrecisionSettings::param_dtype,
            "dtype the model computes in: parameters are cast at each use (activations, logits and loss follow).")
        .required()
        .one_of(mixed_precision_dtype_names());
    s.field("reduce_dtype", &MixedPrecisionSettings::reduce_dtype,
            "dtype of the gradient reduction across ranks (model/fsdp2_wrapped); no effect in one process "
            "(model/mixed_precision: gradients accumulate in the fp32 master parameters).")
        .required()
        .one_of(mixed_precision_dtype_names());
  }
};

}  // namespace modalities
