// model/gpt2's Module as the host sees it (model.cpp), and the loader of model/huggingface_pretrained_model
// (pretrained.cpp). plugin.cpp registers them.
#pragma once

#include "config.h"
#include "huggingface.h"
#include "layers.h"

#include <modalities/sdk/interfaces/module.h>

#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <string>

namespace modalities::plugins::gpt2 {

/// Describes another plugin's feed-forward layers for the Hugging Face export: fills spec.moe
/// (model/gpt2_moe), or throws modalities::Error naming what has no transformers counterpart.
using HfFeedForward = std::function<void(hf::DecoderSpec& spec)>;

/// model/gpt2 built on `device` (the meta device: no storage; materialize with Module::to). `ffn`
/// (layers.h) gives blocks of its choice another feed-forward; model/gpt2_moe (plugins/moe) uses it.
/// The sum of those feed-forwards' auxiliary losses of a forward (FeedForward::take_aux_loss) is
/// the model output `aux_loss_key`, when it is not empty and a block left one. `hf_ffn` describes
/// them for convert_pytorch_to_hf_checkpoint (without it, a model with `ffn` is not exported).
std::shared_ptr<Module> make_gpt2(const GPT2Config& c, const c10::Device& device, FeedForwardFactory ffn = {},
                                  std::string aux_loss_key = {}, HfFeedForward hf_ffn = {});

/// Builds the model of a Mixture-of-Experts family (plugins/moe: model/gpt2_moe) from the decoder's
/// config (config_from_spec) and the MoE description, on `device`, without weights.
using MoeModelFactory =
    std::function<std::shared_ptr<Module>(const GPT2Config& decoder, const hf::MoeSpec& moe, const c10::Device&)>;

/// The variant model/huggingface_pretrained_model hands the MoE families to (plugins/moe registers it).
inline constexpr const char* kHuggingFaceMoeVariant = "huggingface_pretrained_moe_model";

/// The transformers architecture of `c`'s folder (config.json), after the checks of c's keys.
hf::ImportedConfig read_huggingface_config(const HuggingFacePretrainedConfig& c);

/// model/huggingface_pretrained_model: the transformers folder of `c`, whose config.json said
/// `imported` (read_huggingface_config), read into model/gpt2 on the run's device; a
/// Mixture-of-Experts family into the model `moe` builds (refused without it).
std::shared_ptr<Module> load_huggingface(const HuggingFacePretrainedConfig& c, hf::ImportedConfig imported,
                                         const MoeModelFactory& moe = {});

}  // namespace modalities::plugins::gpt2
