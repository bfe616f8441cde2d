// Loading a SentencePiece model file the way the sp_tokenizer plugin does it, shared with the
// fuzz target (tests/fuzz/fuzz_sentencepiece.cpp). Declares no SentencePiece or Abseil type.
#pragma once

#include <filesystem>

namespace sentencepiece {
class SentencePieceProcessor;
}  // namespace sentencepiece

namespace modalities::plugins::sp_tokenizer {

/// Loads `file` into `sp`. Every rejection, whether SentencePiece reports it as a status or
/// throws (its trie builder throws on e.g. an empty piece), becomes a ConfigError on
/// `tokenizer_model_file` naming the file.
void load_model(sentencepiece::SentencePieceProcessor& sp, const std::filesystem::path& file);

}  // namespace modalities::plugins::sp_tokenizer
