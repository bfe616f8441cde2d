// Hugging Face checkpoint folders, the layout transformers' save_pretrained writes and
// from_pretrained reads: config.json, generation_config.json and the weights as
// model.safetensors, or as model-0000i-of-0000n.safetensors shards listed by
// model.safetensors.index.json. A model that can describe itself as a transformers
// architecture implements HuggingFaceExportable next to Module; `modalities
// convert_pytorch_to_hf_checkpoint` finds it with dynamic_cast and writes the folder.
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace modalities {

/// What the caller knows besides the model (token ids come from the tokenizer).
struct HuggingFaceExportOptions {
  std::optional<c10::ScalarType> dtype;  // cast floating-point tensors to it; nullopt: as stored
  std::optional<std::int64_t> bos_token_id, eos_token_id, pad_token_id;
};

/// A model in transformers' terms: the architecture class, config.json's and
/// generation_config.json's text, and the tensors under transformers' names.
struct HuggingFaceCheckpoint {
  std::string architecture;  // e.g. "LlamaForCausalLM"
  std::string config_json;
  std::string generation_config_json;
  StateDict tensors;
};

/// Implemented by models that map onto a transformers architecture, next to Module
/// (class GPT2 : public Module, public HuggingFaceExportable). to_huggingface() throws
/// modalities::Error naming what has no counterpart (e.g. qk-norm) when the model's
/// configuration does not map. Since: SDK 0.1 (ABI 5).
class MODALITIES_SDK_API HuggingFaceExportable {
 public:
  virtual ~HuggingFaceExportable();  // defined in the SDK library: one vtable, one typeinfo
  virtual HuggingFaceCheckpoint to_huggingface(const HuggingFaceExportOptions& options) const = 0;
};

namespace formats {

/// Writes `checkpoint` as Hugging Face folder `dir`: config.json, generation_config.json (when
/// given), the tensors in one model.safetensors or, above `max_shard_bytes`, in shards with
/// model.safetensors.index.json (transformers' names and index format; every file carries the
/// metadata {"format": "pt"} that transformers checks), and copies of `extra_files` (tokenizer
/// files). Atomic: everything is written into a temporary sibling that is renamed to `dir`, so
/// `dir` either is complete or does not exist. `dir` must not exist or be an empty directory.
MODALITIES_SDK_API void write_huggingface_folder(const std::filesystem::path& dir,
                                                 const HuggingFaceCheckpoint& checkpoint, std::uint64_t max_shard_bytes,
                                                 const std::vector<std::filesystem::path>& extra_files = {});

/// The weights of Hugging Face folder `dir`: model.safetensors, or every shard listed by
/// model.safetensors.index.json (each tensor must be in the file the index names). CPU tensors
/// with the stored dtypes, by transformers' names. Throws modalities::Error naming the file
/// when none exists (e.g. only pytorch_model.bin, which is refused: pickle files can run code).
MODALITIES_SDK_API StateDict read_huggingface_weights(const std::filesystem::path& dir);

/// "5GB", "500MB", "100KB", "1234" (bytes; decimal units as transformers' max_shard_size, plus
/// KiB/MiB/GiB) -> bytes. Throws modalities::Error for anything else.
MODALITIES_SDK_API std::uint64_t parse_byte_size(const std::string& text);

}  // namespace formats
}  // namespace modalities
