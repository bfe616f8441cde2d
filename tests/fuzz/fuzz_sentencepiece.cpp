// The SentencePiece target (see fuzz_targets.h): the sp_tokenizer plugin's loader
// (plugins/sp_tokenizer/src/sp_load.cpp, compiled in), then what the plugin's Tokenizer does
// with a loaded model: Encode, the id range check and Decode, GetPieceSize,
// PieceToId/unk_id, IsControl.
// Own translation unit: sentencepiece_processor.h declares absl::string_view itself, so no
// Abseil header may be included next to it (as in the plugin).
#include "fuzz_support.h"
#include "fuzz_targets.h"
#include "sp_tokenizer/src/sp_load.h"

#include <modalities/sdk/error.h>

#include <sentencepiece_processor.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr std::string_view kSampleText =
    "Hello world!  It's 2024-06-01, 3.14159.\tTabs\r\nnewlines \xE2\x96\x81 caf\xC3\xA9 "
    "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x98\x80 <s></s><unk>";

void exercise(const sentencepiece::SentencePieceProcessor& sp, std::string_view text) {
  std::vector<int> ids;
  if (!sp.Encode(text, &ids).ok()) return;  // the plugin: Error "cannot encode a text of N bytes"
  const int size = sp.GetPieceSize();
  // The plugin's decode refuses ids outside [0, GetPieceSize()) before calling Decode.
  std::vector<int> in_range;
  for (int id : ids)
    if (id >= 0 && id < size) in_range.push_back(id);
  std::string decoded;
  (void)sp.Decode(in_range, &decoded);
  for (std::size_t k = 0; k < in_range.size() && k < 8; ++k) (void)sp.IsControl(in_range[k]);
}

}  // namespace

int modalities_fuzz_sentencepiece(const std::uint8_t* data, std::size_t size) {
  using modalities::fuzz::scratch_dir;
  const std::filesystem::path file = scratch_dir() / "fuzz.model";
  modalities::fuzz::write_file(file, data, size);
  sentencepiece::SentencePieceProcessor sp;
  try {
    modalities::plugins::sp_tokenizer::load_model(sp, file);  // the plugin's loader
  } catch (const modalities::Error& e) {
    modalities::fuzz::expect_names_file("sentencepiece: load_model", e.what(), file.string());
    return 0;
  }
  const int size_pieces = sp.GetPieceSize();
  (void)sp.unk_id();
  (void)sp.PieceToId("<unk>");
  (void)sp.PieceToId("<s>");
  (void)sp.PieceToId("\xE2\x96\x81the");
  for (int id = 0; id < std::min(size_pieces, 4); ++id) (void)sp.IsControl(id);
  exercise(sp, kSampleText);
  const std::string_view all = modalities::fuzz::as_text(data, size);
  exercise(sp, all.substr(all.size() / 2, 256));
  return 0;
}
