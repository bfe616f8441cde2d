// The tokenizer interface: text to token ids and back, plus the id queries
// that datasets, loss-masking collators and text generation need. Free of
// LibTorch on purpose, because the data tools (indexing, packing) use it too.
// Maps Modalities' TokenizerWrapper (`tokenizer/*`).
#pragma once

#include <modalities/sdk/export.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace modalities {

/// Converts between text and token ids for one vocabulary.
///
/// Built once per run or per data command. All methods are const and must be
/// safe to call concurrently from several threads: packing tokenizes with a
/// pool of workers sharing one instance, and data-loader workers may tokenize
/// on the fly (`dataset/mem_map_dataset`).
///
/// \code
///   std::vector<std::int64_t> ids = tok->tokenize("Hello world");
///   std::string text = tok->decode(ids);
///   std::int64_t eod = tok->token_id("<|endoftext|>");
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); returned values
/// are independent copies.
/// Errors: throw modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API Tokenizer {
 public:
  static constexpr std::string_view kInterface = "Tokenizer";
  static constexpr std::string_view kComponentKey = "tokenizer";

  Tokenizer() = default;
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;
  virtual ~Tokenizer();  // defined in the SDK library: one vtable, one typeinfo

  /// Token ids of `text` (UTF-8), with the tokenizer's configured truncation
  /// and padding applied.
  virtual std::vector<std::int64_t> tokenize(std::string_view text) const = 0;

  /// Text of `ids` (UTF-8). Unknown ids are an error.
  virtual std::string decode(std::span<const std::int64_t> ids) const = 0;

  /// Number of ids in the vocabulary, special tokens included.
  virtual std::int64_t vocab_size() const = 0;

  /// The single id of `token`. Throws modalities::Error when the token does
  /// not map to exactly one id. (Mapping to the unknown token is allowed but
  /// should be logged as a warning.)
  virtual std::int64_t token_id(std::string_view token) const = 0;

  /// Whether `id` is a special token (BOS/EOS/PAD/...), e.g. to skip it when
  /// printing generated text.
  virtual bool is_special_token_id(std::int64_t id) const = 0;

  /// The Hugging Face tokenizer folder whose files reproduce this tokenizer with AutoTokenizer
  /// (`tokenizer/pretrained_hf_tokenizer`'s folder), or nullopt when it has no such form. An
  /// export to a transformers folder (`convert_pytorch_to_hf_checkpoint`) copies its files.
  /// Default: nullopt. Since: SDK 0.1 (ABI 6).
  virtual std::optional<std::filesystem::path> huggingface_folder() const;
};

}  // namespace modalities
