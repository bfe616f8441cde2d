// UTF-8 helpers and the Unicode data of the hf_tokenizer plugin.
//
// Note [One Unicode table per component]
// Hugging Face's `tokenizers` does not have one Unicode version: its `Split`
// and `Replace` regexes run on Oniguruma, `Digits`, `WhitespaceSplit`, `Strip`
// and `Lowercase` on Rust's standard library, `Punctuation` and the BERT pieces
// on the `unicode_categories` crate, and the NFC/NFD/NFKC/NFKD normalizers on
// `unicode-normalization-alignments`. Each has its own Unicode version, so a
// code point can be punctuation for one component and unassigned for another.
// The tables in unicode_tables.inc were probed from the pinned `tokenizers`
// (scripts/reference/make_unicode_tables.py), one per component, and every
// component here looks code points up in its own table.
#pragma once

#include <modalities/sdk/utf8.h>  // append_utf8

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace modalities::plugins::hf_tokenizer {

// ---- UTF-8 ----------------------------------------------------------------

/// One bit per BMP code point (8 KiB): a per-character answer computed once, for the fast paths.
class BmpBits {
 public:
  BmpBits() = default;
  /// The BMP code points from `from` on (surrogates aside) for which `pred` holds.
  template <class Pred>
  static BmpBits where(char32_t from, Pred&& pred) {
    BmpBits b;
    for (char32_t c = from; c < 0x10000; ++c)
      if ((c < 0xD800 || c > 0xDFFF) && pred(c)) b.words_[c >> 6] |= std::uint64_t{1} << (c & 63);
    return b;
  }
  /// False for every code point above the BMP.
  bool contains(char32_t c) const { return c < 0x10000 && ((words_[c >> 6] >> (c & 63)) & 1) != 0; }

 private:
  std::vector<std::uint64_t> words_ = std::vector<std::uint64_t>(1024, 0);
};

inline std::size_t utf8_len(unsigned char lead) { return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }

/// Code point at s[i] of valid UTF-8; sets *len to its byte length.
[[gnu::always_inline]] inline char32_t decode_at(std::string_view s, std::size_t i, std::size_t* len) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  const std::size_t n = utf8_len(b0);
  *len = n;
  if (n == 1) return b0;
  char32_t cp = b0 & (n == 2 ? 0x1F : n == 3 ? 0x0F : 0x07);
  for (std::size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

/// Start of the last code point of non-empty valid UTF-8 `s`.
inline std::size_t last_char_start(std::string_view s) {
  std::size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

/// Number of code points of valid UTF-8 `s`.
std::size_t count_chars(std::string_view s);

// ---- code point sets ------------------------------------------------------

struct CodePointRange {
  char32_t first, last;
};

/// A set of code points: sorted, disjoint, non-adjacent ranges, plus a bitmap
/// of the BMP so that most lookups are one load.
class CodePointSet {
 public:
  CodePointSet() : bmp_(1024, 0) {}
  explicit CodePointSet(std::span<const CodePointRange> ranges);
  static CodePointSet from_ranges(std::vector<std::pair<char32_t, char32_t>> ranges);

  bool contains(char32_t c) const {
    if (c < 0x10000) return (bmp_[c >> 6] >> (c & 63)) & 1;
    return contains_astral(c);
  }
  bool empty() const { return ranges_.empty(); }
  const std::vector<std::pair<char32_t, char32_t>>& ranges() const { return ranges_; }
  CodePointSet complement() const;
  CodePointSet operator|(const CodePointSet& o) const;
  CodePointSet operator^(const CodePointSet& o) const;
  bool operator==(const CodePointSet& o) const { return ranges_ == o.ranges_; }
  /// The first code point of valid UTF-8 `s` in the set, as a byte offset, or npos.
  std::size_t find_in(std::string_view s) const;

 private:
  bool contains_astral(char32_t c) const;
  std::vector<std::uint64_t> bmp_;
  std::vector<std::pair<char32_t, char32_t>> ranges_;
  std::array<bool, 256> lead_{};  // UTF-8 lead bytes of code points in the set (find_in skips the others)
  // The set's ASCII members when they are one range [lo, hi] (none: lo > hi), for find_in's
  // eight-byte skip; ascii_range_ is false otherwise.
  bool ascii_range_ = true;
  unsigned char ascii_lo_ = 1, ascii_hi_ = 0;
};

// ---- the tables of each Hugging Face component ------------------------------

/// Oniguruma (tokenizers' `Split`/`Replace` regexes, ByteLevel's regex): a property
/// class by its canonical name ("L", "Lu", "Nd", "P", "Alphabetic", "Han", ...) or
/// one of "\\s", "\\w", "\\d", "\\h". Nullptr when the property is not tabled.
const CodePointSet* oniguruma_class(std::string_view name);
/// The canonical name of an Oniguruma property written `name` in a pattern
/// ("Letter" -> "L", "uppercase_letter" -> "Lu", "han" -> "Han"); empty if unknown.
std::string oniguruma_property_name(std::string_view name);

/// Rust `char::is_numeric` (`Digits`).
const CodePointSet& rust_numeric();
/// Rust `char::is_whitespace` (`WhitespaceSplit`, `Strip`, `BertPreTokenizer`).
const CodePointSet& rust_whitespace();
/// `tokenizers`' `Lowercase` (Rust `char::to_lowercase`, per character): appends the
/// lowercase of `c` to `out`.
void append_lowercase(std::string& out, char32_t c);
/// The code points that `tokenizers`' `Lowercase` maps to something else (the others it keeps).
const CodePointSet& lowercase_changes();
/// `is_punc` of `Punctuation` and `BertPreTokenizer` (ASCII punctuation or the
/// `unicode_categories` crate's P*).
const CodePointSet& bert_punctuation();
/// BertNormalizer clean_text: characters removed, and characters that become ' '.
const CodePointSet& bert_removed();
const CodePointSet& bert_to_space();
/// BertNormalizer strip_accents: characters removed after NFD (nonspacing marks).
const CodePointSet& bert_nonspacing_marks();
/// `StripAccents`: characters removed (combining marks).
const CodePointSet& strip_accents_marks();
/// `Whitespace` pre-tokenizer (`\w+|[^\w\s]+`): word characters and spaces.
const CodePointSet& whitespace_pretokenizer_word();
const CodePointSet& whitespace_pretokenizer_space();
/// `Nmt` normalizer: characters removed, and characters that become ' '.
const CodePointSet& nmt_removed();
const CodePointSet& nmt_to_space();

/// Code points that the normalization tables of `tokenizers` do not know and
/// therefore leave alone (no decomposition, combining class 0), while utf8proc
/// (a newer Unicode) would change them or their neighbours.
const CodePointSet& hf_normalization_unknown();

// ---- normalization --------------------------------------------------------

/// utf8proc option bits of the four forms.
int normalization_form_options(std::string_view form);

/// Normalizes `s` into `out` and returns true, or returns false (leaving `out`
/// alone) when `s` is already normalized; the result is what `tokenizers`'
/// normalizer of that form gives.
bool normalize_form(std::string_view s, int options, std::string& out);
/// Whether BMP `c` is unchanged by the form of `options`, has combining class 0 and is the second
/// element of no composition (Note [Normalization fast path]: a boundary before it is safe).
bool form_stable(char32_t c, int options);
/// Whether BMP `c` is a grapheme cluster of its own between neighbours that are ASCII (but '\r',
/// '\n') or such characters too (Note [Lone grapheme clusters]).
bool lone_grapheme(char32_t c);

/// The canonical decomposition of one code point as `tokenizers`' NFD gives it (code points it
/// does not know stay as they are): up to 8 code points, each flagged as a starter (combining
/// class 0) or not. Returns how many; 0 if the decomposition does not fit (never in Unicode 15).
/// NFD of a text is these pieces concatenated and then its non-starters reordered, so where no
/// non-starter is kept the pieces alone give the result (Note [One-pass BertNormalizer]).
std::size_t canonical_decomposition(char32_t c, std::array<char32_t, 8>& out, std::array<bool, 8>& starter);

/// Whether NFD leaves `c` alone and it is a starter (canonical_decomposition gives `c` itself).
bool nfd_inert_starter(char32_t c);

/// Rust's `String::from_utf8_lossy`: each maximal ill-formed subsequence
/// becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes);

// ---- SentencePiece charsmaps ---------------------------------------------

/// The `Precompiled` normalizer: a SentencePiece `precompiled_charsmap` (a darts-clone double-array
/// trie over UTF-8 keys plus a pool of NUL-terminated replacements), applied the way `tokenizers`
/// (spm_precompiled) applies it: per extended grapheme cluster, a cluster shorter than 6 bytes is
/// replaced by the entry of its shortest key prefix if it has one; otherwise each character is
/// replaced by its own entry or kept. Grapheme clusters come from utf8proc (UAX #29 of Unicode
/// 15.0; tokenizers uses a newer Unicode, which differs only where a code point unassigned in
/// 15.0 may extend a cluster: that case is refused, see normalize()).
class PrecompiledCharsmap {
 public:
  /// `blob`: the decoded charsmap bytes (u32 trie size, trie units, pool). Throws
  /// modalities::Error naming `where` when it is malformed.
  PrecompiledCharsmap(std::string blob, const std::string& where);
  bool empty() const { return units_.empty(); }
  /// Whether BMP `c`, a cluster of its own (lone_grapheme), maps to itself.
  bool keeps(char32_t c) const { return same_.contains(c); }
  /// Whether every printable ASCII character (0x20-0x7E), as a cluster of its own, maps to itself.
  bool keeps_printable_ascii() const {
    for (char32_t b = 0x20; b < 0x7F; ++b)
      if (!keeps(b)) return false;
    return true;
  }
  /// Normalizes `in` into `out` and returns true, or returns false when nothing changes. Sets
  /// *first_removed when the first cluster maps to nothing. Throws modalities::Error for text
  /// whose result could depend on the Unicode version of the grapheme rules: a code point
  /// unassigned in Unicode 15.0 right after a character the charsmap maps, within 6 bytes.
  bool normalize(std::string_view in, std::string& out, bool* first_removed) const;
  /// This charsmap without Note [Precompiled on ASCII] and Note [Lone grapheme clusters] (tests).
  PrecompiledCharsmap without_fast_paths() const {
    PrecompiledCharsmap c = *this;
    c.fast_ = false;
    return c;
  }

 private:
  /// The replacement of the shortest key that is a prefix of `chunk` (stopping at a NUL byte).
  std::optional<std::string_view> transform(std::string_view chunk) const;
  std::vector<std::uint32_t> units_;
  std::string pool_;
  bool fast_ = true;
  std::array<std::optional<std::string>, 128> ascii_;  // the replacement of each one-byte cluster
  // One bit per BMP code point: a cluster of its own between simple neighbours (Note [Lone grapheme
  // clusters]; ASCII but '\r' and '\n') that this charsmap leaves as it is.
  BmpBits same_;
  BmpBits simple_;  // ASCII or lone_other: a character that a lone cluster may stand beside
};

}  // namespace modalities::plugins::hf_tokenizer
