// mfu_calculator/gpt2 (README.md): model FLOPs
// utilization of a GPT-2-style decoder from the global samples per second,
//   flops_per_token = 6·N + 12·n_layer·sequence_length·n_embd
//   mfu = samples/s · sequence_length · flops_per_token / (peak_per_gpu · world_size)
// with N the trainable parameters one token computes with (tied counted once, global sizes
// under sharding; a MoE block's routed experts by top_k / num_experts: count_active_parameters)
// and the peak looked up from the CUDA device name; -1 when unknown.
#include "peak_flops.h"

#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/interfaces/mfu_calculator.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/model_parts.h>
#include <modalities/sdk/parameter_count.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/run_context.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#if defined(MODALITIES_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include <cstdint>
#include <optional>
#include <string>

namespace modalities::plugins::mfu {
namespace {

struct Gpt2MfuConfig {
  std::int64_t n_layer = 0;
  std::int64_t sequence_length = 0;
  std::int64_t n_embd = 0;
  std::int64_t world_size = 0;
  ModelParts model_parts;
  std::optional<Ref<DeviceMesh>> device_mesh;
  std::optional<double> peak_flops_per_device;

  static void describe(Schema<Gpt2MfuConfig>& s) {
    s.field("n_layer", &Gpt2MfuConfig::n_layer, "Number of transformer blocks.").required().positive();
    s.field("sequence_length", &Gpt2MfuConfig::sequence_length, "Tokens per sample.").required().positive();
    s.field("n_embd", &Gpt2MfuConfig::n_embd, "Model width.").required().positive();
    s.field("world_size", &Gpt2MfuConfig::world_size, "Number of GPUs (ranks) sharing the throughput.")
        .required()
        .positive();
    s.field("model_parts", &Gpt2MfuConfig::model_parts,
            "The (wrapped) model, or this rank's pipeline stages, whose trainable parameters are counted (summed "
            "over the pipeline stages of the device_mesh's pp dim).")
        .required()
        .alias("wrapped_model");
    s.field("device_mesh", &Gpt2MfuConfig::device_mesh,
            "Device mesh; needed by Modalities to sum parameters over pipeline stages (see README).");
    s.field("peak_flops_per_device", &Gpt2MfuConfig::peak_flops_per_device,
            "Peak FLOP/s of one device; overrides the GPU table, e.g. for GPUs it does not list (not in "
            "Modalities).")
        .positive();
  }
};

// Name of a CUDA device; nullopt in builds without CUDA.
std::optional<std::string> cuda_device_name(const c10::Device& device) {
#if defined(MODALITIES_WITH_CUDA)
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device.has_index() ? device.index() : 0) != cudaSuccess) return std::nullopt;
  return std::string(prop.name);
#else
  (void)device;
  return std::nullopt;
#endif
}

class Gpt2MfuCalculator final : public MFUCalculator {
 public:
  Gpt2MfuCalculator(const Gpt2MfuConfig& c, BuildContext& ctx) : sequence_length_(c.sequence_length) {
    std::vector<const Module*> parts;
    for (const auto& part : c.model_parts.parts) parts.push_back(part.get());
    // A pipeline rank holds its stages only: summed over the pp group (a collective: every rank
    // builds this component at the same point of the graph).
    const std::int64_t n = count_active_parameters(parts, c.device_mesh ? c.device_mesh->get() : nullptr);
    flops_per_token_ = 6.0 * static_cast<double>(n) + 12.0 * static_cast<double>(c.n_layer) *
                                                          static_cast<double>(c.sequence_length) *
                                                          static_cast<double>(c.n_embd);
    std::optional<double> peak = c.peak_flops_per_device;
    if (!peak) {
      const c10::Device device = run_device();
      const std::optional<std::string> name = device.is_cuda() ? cuda_device_name(device) : std::nullopt;
      if (name) peak = peak_flops_for_device_name(*name);
      if (!peak)
        ctx.warn(
            fmt::format("MFU is reported as -1: no peak FLOP/s known for {}; set peak_flops_per_device to "
                        "enable it",
                        name ? fmt::format("GPU '{}'", *name) : fmt::format("device {}", device.str())));
      else  // Modalities assumes bf16 for FSDP2 models as well
        ctx.warn(fmt::format("MFU assumes 16-bit (bf16/fp16) compute: peak {:.4g} FLOP/s per '{}'", *peak, *name));
    }
    if (peak) peak_total_ = *peak * static_cast<double>(c.world_size);
  }

  double compute(double num_samples_per_second) const override {
    if (!peak_total_) return -1.0;
    return num_samples_per_second * static_cast<double>(sequence_length_) * flops_per_token_ / *peak_total_;
  }

 private:
  std::int64_t sequence_length_;
  double flops_per_token_ = 0.0;
  std::optional<double> peak_total_;
};

}  // namespace

void register_components(Registrar& r) {
  r.add<MFUCalculator, Gpt2MfuConfig>(
      "gpt2", "Model FLOPs utilization of a GPT-2-style decoder (6N + 12·L·T·d FLOPs per token).",
      [](const Gpt2MfuConfig& c, BuildContext& ctx) { return std::make_shared<Gpt2MfuCalculator>(c, ctx); });
}

}  // namespace modalities::plugins::mfu

MODALITIES_PLUGIN(mfu, MODALITIES_PLUGIN_VERSION, modalities::plugins::mfu::register_components)
