// model_initialized.h. Note [Materializing meta tensors] is below.
#include "model_initialized.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/model_initializer.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/registrar.h>
#include <modalities/sdk/run_context.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/nn/module.h>

#include <string>
#include <utility>
#include <vector>

namespace modalities::plugins::initialization {

void materialize_and_initialize(Module& model, const ModelInitializer& initializer, std::string_view origin,
                                BuildContext& ctx) {
  torch::nn::Module& tree = model.module();
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (auto& item : tree.named_parameters(/*recurse=*/true)) tensors.emplace_back(item.key(), item.value());
  for (auto& item : tree.named_buffers(/*recurse=*/true)) tensors.emplace_back(item.key(), item.value());
  const std::pair<std::string, at::Tensor>* meta = nullptr;
  const std::pair<std::string, at::Tensor>* real = nullptr;
  for (const auto& entry : tensors) {
    if (!entry.second.defined()) continue;
    auto& first = entry.second.is_meta() ? meta : real;  // first tensor of each kind, for the message
    if (first == nullptr) first = &entry;
  }
  if (meta != nullptr && real != nullptr)
    throw Error(
        fmt::format("model/model_initialized: the model ({}) mixes meta-device and materialized tensors "
                    "('{}' is on meta, '{}' on {}); build all of it on the meta device or none of it",
                    origin, meta->first, real->first, real->second.device().str()));
  const bool on_meta = meta != nullptr;

  at::NoGradGuard no_grad;
  if (on_meta) {
    // Note [Materializing meta tensors]
    // Like PyTorch's Module.to_empty(): every tensor gets uninitialized storage
    // of the same shape and dtype on the run device. PyTorch swaps in new
    // Parameter objects (set_data refuses meta -> cpu/cuda as "incompatible
    // tensor type"), which would strand the member handles a libtorch module
    // keeps (e.g. LinearImpl::weight). So the new storage is moved into the
    // existing TensorImpl instead, with what set_data does minus its type check
    // (meta and dense tensors are the same TensorImpl class): identity,
    // requires_grad and the version counter are kept, and every alias sees it.
    const c10::Device device = run_device();
    for (auto& [name, t] : tensors) {
      if (!t.defined() || !t.is_meta()) continue;  // a tied tensor is listed twice
      MODALITIES_CHECK(t.layout() == at::kStrided,
                       "model/model_initialized: cannot materialize '{}': only dense (strided) tensors can be", name);
      const at::Tensor storage = at::empty(t.sizes(), t.options().device(device));
      t.unsafeGetTensorImpl()->shallow_copy_from(storage.getIntrusivePtr());
    }
  }
  // On whole tensors: a sharded model (model_initialized after fsdp2_wrapped, Modalities' order)
  // gathers them, so every world size draws the same weights.
  model.apply_to_full_parameters([&](Module& full) {
    if (on_meta) {
      full.reset_parameters();  // storage is garbage until now: a model without reset_parameters() fails here
    } else {
      // Modalities resets only modules that have reset_parameters(); a model that
      // does not support it keeps its constructor values.
      try {
        full.reset_parameters();
      } catch (const Error& e) {
        ctx.warn(fmt::format("the model's parameters were not reset before initialization: {}", e.what()));
      }
    }
    initializer.initialize_in_place(full);
  });
}

}  // namespace modalities::plugins::initialization
