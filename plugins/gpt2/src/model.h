// model/gpt2's Module as the host sees it (model.cpp), and the loader of model/huggingface_pretrained_model
// (pretrained.cpp). plugin.cpp registers them.
#pragma once

#include "config.h"
#include "layers.h"

#include <modalities/sdk/interfaces/module.h>

#include <c10/core/Device.h>

#include <memory>
#include <string>

namespace modalities::plugins::gpt2 {

/// model/gpt2 built on `device` (the meta device: no storage; materialize with Module::to). `ffn`
/// (layers.h) gives blocks of its choice another feed-forward; model/gpt2_moe (plugins/moe) uses it.
/// The sum of those feed-forwards' auxiliary losses of a forward (FeedForward::take_aux_loss) is
/// the model output `aux_loss_key`, when it is not empty and a block left one.
std::shared_ptr<Module> make_gpt2(const GPT2Config& c, const c10::Device& device, FeedForwardFactory ffn = {},
                                  std::string aux_loss_key = {});

/// model/huggingface_pretrained_model: a transformers folder read into model/gpt2 on the run's device.
std::shared_ptr<Module> load_huggingface(const HuggingFacePretrainedConfig& c);

}  // namespace modalities::plugins::gpt2
