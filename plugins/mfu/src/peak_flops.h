// Peak 16-bit FLOP/s per GPU for the MFU denominator (README.md),
// looked up by CUDA device-name prefix. Header-only so the plugin test can
// check the table without a GPU.
#pragma once

#include <array>
#include <optional>
#include <string_view>
#include <utility>

namespace modalities::plugins::mfu {

/// Dense bf16/fp16 tensor-core peaks (FLOP/s). Modalities' table plus H200,
/// which Modalities lacks (it reports MFU = -1 there, docs/differences.md);
/// H200 has the same compute as H100 SXM.
inline constexpr std::array<std::pair<std::string_view, double>, 5> kPeakFlops16Bit = {{
    {"NVIDIA A100", 312e12},
    {"NVIDIA H100", 989e12},
    {"NVIDIA H200", 989e12},
    {"NVIDIA GH200", 989e12},
    {"NVIDIA B200", 2.25e15},
}};

/// The peak for a CUDA device name such as "NVIDIA H100 80GB HBM3", or nullopt.
inline std::optional<double> peak_flops_for_device_name(std::string_view device_name) {
  for (const auto& [prefix, flops] : kPeakFlops16Bit)
    if (device_name.starts_with(prefix)) return flops;
  return std::nullopt;
}

}  // namespace modalities::plugins::mfu
