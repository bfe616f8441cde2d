// tokenizer/pretrained_sp_tokenizer: Modalities' PreTrainedSPTokenizer (see
// README.md) on the SentencePiece C++ library: Encode without BOS/EOS,
// Decode, piece count as vocabulary size, PieceToId (the unknown piece is an
// error) and IsControl for special ids.
// (sentencepiece_processor.h aliases absl::string_view to std::string_view, so
// this file must not include Abseil headers.)
#include "sp_load.h"

#include <modalities/sdk/interfaces/tokenizer.h>
#include <modalities/sdk/plugin.h>

#include <sentencepiece_processor.h>

#include <fmt/format.h>

#include <filesystem>

namespace modalities::plugins::sp_tokenizer {
namespace {

struct SpTokenizerConfig {
  std::filesystem::path tokenizer_model_file;

  static void describe(Schema<SpTokenizerConfig>& s) {
    s.field("tokenizer_model_file", &SpTokenizerConfig::tokenizer_model_file, "SentencePiece model file (.model).")
        .required()
        .existing_file();
  }
};

class PretrainedSpTokenizer final : public Tokenizer {
 public:
  explicit PretrainedSpTokenizer(const SpTokenizerConfig& c) : file_(c.tokenizer_model_file) { load_model(sp_, file_); }

  // SentencePieceProcessor's const methods are safe to call concurrently after Load.
  std::vector<std::int64_t> tokenize(std::string_view text) const override {
    std::vector<int> ids;
    if (const auto status = sp_.Encode(text, &ids); !status.ok())
      throw Error(fmt::format("SentencePiece ({}) cannot encode a text of {} bytes: {}", file_.string(), text.size(),
                              status.ToString()));
    return {ids.begin(), ids.end()};
  }

  std::string decode(std::span<const std::int64_t> ids) const override {
    std::vector<int> narrow;
    narrow.reserve(ids.size());
    const std::int64_t size = vocab_size();
    for (std::size_t k = 0; k < ids.size(); ++k) {
      if (ids[k] < 0 || ids[k] >= size)
        throw Error(
            fmt::format("decode: id {} (position {}) is outside the {} pieces of {}", ids[k], k, size, file_.string()));
      narrow.push_back(static_cast<int>(ids[k]));
    }
    std::string text;
    if (const auto status = sp_.Decode(narrow, &text); !status.ok())
      throw Error(fmt::format("SentencePiece ({}) cannot decode: {}", file_.string(), status.ToString()));
    return text;
  }

  std::int64_t vocab_size() const override { return sp_.GetPieceSize(); }

  // As Modalities: a piece that maps to the unknown id is an error (also "<unk>" itself).
  std::int64_t token_id(std::string_view token) const override {
    const int id = sp_.PieceToId(token);
    if (id == sp_.unk_id())
      throw Error(fmt::format("token '{}' is not a piece of {} (it cannot be represented by a single token id)", token,
                              file_.string()));
    return id;
  }

  bool is_special_token_id(std::int64_t id) const override {
    return id >= 0 && id < vocab_size() && sp_.IsControl(static_cast<int>(id));
  }

 private:
  std::filesystem::path file_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

void register_components(Registrar& r) {
  r.add<Tokenizer, SpTokenizerConfig>(
      "pretrained_sp_tokenizer", "SentencePiece model (Encode/Decode without BOS/EOS), as Modalities wraps it.",
      [](const SpTokenizerConfig& c) { return std::make_shared<PretrainedSpTokenizer>(c); });
}

}  // namespace modalities::plugins::sp_tokenizer

MODALITIES_PLUGIN(sp_tokenizer, MODALITIES_PLUGIN_VERSION, modalities::plugins::sp_tokenizer::register_components)
