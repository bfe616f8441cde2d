// The weight formula of scripts/reference/gpt2_reference.py (murmur3 fmix32 of i + salt * 0x9E3779B9),
// shared by the gpt2 plugin's tests that fill a model with the values a Python reference used.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace modalities::plugins::gpt2 {

inline at::Tensor hash_tensor(at::IntArrayRef shape, std::uint32_t salt, double offset, double scale) {
  at::Tensor t = at::empty(shape, at::kFloat);
  float* p = t.data_ptr<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    std::uint32_t h = static_cast<std::uint32_t>(i) + salt * 0x9E3779B9u;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    p[i] = static_cast<float>((static_cast<double>(h) / 4294967296.0 - 0.5) * scale + offset);
  }
  return t;
}

}  // namespace modalities::plugins::gpt2
