// A Hugging Face `tokenizer.json` loaded into an immutable, thread-safe
// encoder/decoder that reproduces the `tokenizers` library's ids exactly:
// added-token splitting, normalizers, pre-tokenizers, the BPE, Unigram,
// WordPiece and WordLevel models, post-processors and decoders (README lists
// them). Everything else is refused by name when loading.
// Used by hf_tokenizer.cpp (the transformers-like wrapper) and the benchmark.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace modalities::plugins::hf_tokenizer {

/// One entry of the added vocabulary (tokenizer.json "added_tokens", or
/// tokens registered later as special tokens).
struct AddedToken {
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
  bool operator==(const AddedToken&) const = default;
};

class TokenizerJson {
 public:
  /// Parses `file`. Throws modalities::Error naming the file and the JSON path of
  /// anything malformed or unsupported. Non-fatal findings (e.g. an added token
  /// whose id in the file differs from the id the library would assign) go to
  /// `warnings()`.
  explicit TokenizerJson(const std::filesystem::path& file);
  ~TokenizerJson();
  TokenizerJson(const TokenizerJson&) = delete;
  TokenizerJson& operator=(const TokenizerJson&) = delete;

  // ---- Setup (single-threaded, before the first encode) -------------------

  /// `AddedVocabulary::add_tokens`: known contents keep their id (added map,
  /// then model vocabulary), new ones get the next free id. Returns how many
  /// were new or changed.
  std::size_t add_tokens(std::span<const AddedToken> tokens);
  /// Overrides `add_prefix_space` of a top-level ByteLevel pre-tokenizer
  /// (what transformers' PreTrainedTokenizerFast does when loading). Returns
  /// false when the top-level pre-tokenizer is not ByteLevel.
  bool set_top_level_add_prefix_space(bool value);
  bool top_level_add_prefix_space() const;
  /// Sets add_prefix_space of the ByteLevel pre-tokenizer wherever it is (Bloom, Cohere).
  void set_byte_level_add_prefix_space_everywhere(bool value);
  /// BertTokenizerFast: a top-level BertNormalizer whose lowercase / strip_accents /
  /// handle_chinese_chars differ from these is rebuilt with them. Returns false when the
  /// top-level normalizer is not a BertNormalizer.
  bool configure_bert_normalizer(bool lowercase, std::optional<bool> strip_accents, bool chinese);
  /// Replaces the template tokens around a single sequence (what transformers'
  /// classes do when they rebuild the post-processor, e.g. from add_bos_token).
  void set_template(std::vector<std::int64_t> prefix, std::vector<std::int64_t> suffix);
  /// Note [Cached chunks]: whether this pipeline encodes text in chunks cut at safe spaces (with a
  /// per-thread cache of chunks), and switching that off (tests compare both). Exposed for tests.
  bool chunked() const;
  void set_chunked(bool on);

  // ---- Queries (thread-safe) ---------------------------------------------

  /// Ids of `text` after added-token splitting, normalization,
  /// pre-tokenization and the model; no template tokens. Appends to `out`.
  void encode_sequence(std::string_view text, std::vector<std::int64_t>& out) const;
  /// Template tokens the post-processor puts before and after a single sequence.
  const std::vector<std::int64_t>& template_prefix() const { return prefix_; }
  const std::vector<std::int64_t>& template_suffix() const { return suffix_; }
  /// `encode(text, add_special_tokens=true).ids` without truncation or padding.
  std::vector<std::int64_t> encode(std::string_view text) const;

  /// `Tokenizer::decode(ids, skip_special_tokens=false)`. Unknown ids throw.
  std::string decode(std::span<const std::int64_t> ids) const;

  /// Added vocabulary first, then the model vocabulary.
  std::optional<std::int64_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(std::int64_t id) const;
  /// Number of entries in the model vocabulary (transformers' `vocab_size`).
  std::size_t model_vocab_size() const;
  /// Model vocabulary plus added tokens, counted by distinct string (`len(get_vocab())`).
  std::size_t full_vocab_size() const;
  const std::vector<std::pair<std::int64_t, AddedToken>>& added_tokens() const;
  std::optional<std::string> unk_token() const;

  const std::vector<std::string>& warnings() const { return warnings_; }
  const std::filesystem::path& file() const { return file_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<std::int64_t> prefix_, suffix_;
  std::vector<std::string> warnings_;
  std::filesystem::path file_;
};

/// `text` in Unicode normalization form `form` ("NFC", "NFD", "NFKC", "NFKD"),
/// as `tokenizers`' normalizers compute it. Exposed for tests.
std::string unicode_normalize(std::string_view text, std::string_view form);

/// BertNormalizer (clean_text and handle_chinese_chars on) of `text`, by the one-pass path of
/// Note [One-pass BertNormalizer] when it applies and `one_pass` is set, otherwise by the four
/// passes of `tokenizers`; the flag says whether the first character was removed. Exposed for tests.
std::string bert_normalize(std::string_view text, bool strip_accents, bool lowercase, bool one_pass,
                           bool* start_removed);

/// A Sequence of the normalizers named in `steps` ("NFD", "StripAccents", "Lowercase", "Nmt") on
/// `text`, in one pass (Note [Fused character maps]) when `fused` is set and it applies, otherwise
/// step by step as `tokenizers` runs them; the flag says whether the first character was removed,
/// *one_pass (if given) whether the one pass applied. Exposed for tests.
std::string normalize_steps(std::span<const std::string_view> steps, std::string_view text, bool fused,
                            bool* start_removed, bool* one_pass = nullptr);

/// The pieces that a Sequence of character-class pre-tokenizers ("WhitespaceSplit",
/// "Punctuation" (Isolated), "PunctuationContiguous", "PunctuationRemoved", "Digits",
/// "DigitsIndividual", "CharDelimiterSplit:<c>") leaves of `text`, in one pass (Note [One pass for
/// character splits]) or stage by stage as `tokenizers` runs them. Exposed for tests.
std::vector<std::string> split_characters(std::span<const std::string_view> stages, std::string_view text,
                                          bool one_pass);

/// The words (and whether each starts the text) that a Metaspace pre-tokenizer with `replacement`,
/// prepend scheme `scheme` ("always", "first", "never") and `split` makes of `text`, without a copy
/// of the text where Note [Metaspace without a copy] applies and `in_place` is set, otherwise as
/// `tokenizers` does it (replace, prepend, split). Exposed for tests.
std::vector<std::pair<std::string, bool>> metaspace_words(std::string_view text, std::string_view replacement,
                                                          std::string_view scheme, bool split, bool at_origin,
                                                          bool in_place);

}  // namespace modalities::plugins::hf_tokenizer
