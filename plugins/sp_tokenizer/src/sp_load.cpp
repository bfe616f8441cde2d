// See sp_load.h. (sentencepiece_processor.h aliases absl::string_view, so no Abseil here.)
#include "sp_load.h"

#include <modalities/sdk/error.h>

#include <sentencepiece_processor.h>

#include <fmt/format.h>

#include <exception>
#include <string>

namespace modalities::plugins::sp_tokenizer {

void load_model(sentencepiece::SentencePieceProcessor& sp, const std::filesystem::path& file) {
  std::string why;
  try {
    if (const auto status = sp.Load(file.string()); !status.ok()) why = status.ToString();
  } catch (const std::exception& e) {  // found by fuzzing: Darts' trie builder throws on a zero-length piece
    why = e.what();
  }
  if (!why.empty())
    throw ConfigError("tokenizer_model_file", fmt::format("'{}' is not a SentencePiece model: {}", file.string(), why));
}

}  // namespace modalities::plugins::sp_tokenizer
