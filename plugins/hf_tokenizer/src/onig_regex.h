// Oniguruma patterns (as written in tokenizer.json, the syntax `tokenizers`
// compiles with the `onig` crate) run with PCRE2, with Oniguruma's meaning and
// Unicode tables. See Note [Two compiled patterns] in onig_regex.cpp.
#pragma once

#include "unicode.h"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

namespace modalities::plugins::hf_tokenizer {

class Regex {
 public:
  Regex() = default;
  /// Compiles `onig_pattern`; throws modalities::Error naming `file` and `where`
  /// when the pattern uses something that is not supported or does not compile.
  Regex(const std::string& onig_pattern, const std::filesystem::path& file, std::string_view where);
  explicit operator bool() const { return static_cast<bool>(native_); }

  /// All matches as [start, end) byte ranges, with the iteration rules of the
  /// `onig` crate's find_iter: after an empty match the search moves on by one
  /// character, and an empty match right after a non-empty one is skipped.
  template <class F>
  void for_each_match(std::string_view text, F&& on_match) const {
    if (run_class_) {  // Note [Runs of one class]
      class_runs(text, on_match);
      return;
    }
    if (fast_ != Fast::kNone) {  // Note [Common patterns on every code point]
      for (std::size_t i = 0; i < text.size();) {
        std::size_t start = i;
        const std::size_t end =
            fast_ == Fast::kDeepSeekV3 ? deepseek_v3_match(text, start) : word_match(fast_, text, i);
        if (end == std::string_view::npos) break;
        on_match(start, end);
        i = end;
      }
      return;
    }
    const Compiled& c = pick(text);
    std::size_t last_end = 0;
    bool skip_next_empty = false;
    while (last_end <= text.size()) {
      std::size_t s, e;
      if (!search(c, text, last_end, &s, &e)) break;
      last_end = e;
      if (s == e) {
        last_end += last_end < text.size() ? utf8_len(static_cast<unsigned char>(text[last_end])) : 1;
        if (skip_next_empty) {
          skip_next_empty = false;
          continue;
        }
      } else {
        skip_next_empty = true;
      }
      on_match(s, e);
    }
  }

  /// This pattern with the explicit Oniguruma tables wherever PCRE2 matches it (tests; the
  /// hand-written matchers already read Oniguruma's tables).
  Regex with_exact_tables() const;
  /// This pattern without the hand-written matchers of Note [Common patterns on every code point],
  /// deepseek_v3_match and Note [Runs of one class]: PCRE2 alone (tests).
  Regex without_hand_written_matchers() const;
  bool has_hand_written_matcher() const { return fast_ != Fast::kNone || run_class_ != nullptr; }
  /// One of the tiling patterns of GPT-2, Llama-3, Qwen2, GPT-4o and Tekken: no lookbehind, and no
  /// match goes past a space that follows a character other than whitespace, so a space between
  /// two such characters always starts a match (Note [Cached chunks]).
  bool splits_before_lone_spaces() const { return fast_ != Fast::kNone && fast_ != Fast::kDeepSeekV3; }
  /// The PCRE2 patterns (for tests and error messages).
  const std::string& native_pattern() const;
  const std::string& exact_pattern() const;
  /// Code points on which PCRE2's own tables and Oniguruma's disagree for the
  /// classes of this pattern (a text containing one runs the exact pattern).
  const CodePointSet& delta() const { return *delta_; }

  struct Compiled;

 private:
  const Compiled& pick(std::string_view text) const {
    if (delta_->empty() || delta_->find_in(text) == std::string_view::npos) return *native_;
    return *exact_;
  }
  static bool search(const Compiled& c, std::string_view text, std::size_t from, std::size_t* start, std::size_t* end);
  enum class Fast { kNone, kGpt2, kLlama3, kQwen2, kGpt4o, kTekken, kDeepSeekV3 };
  // The end of the match at `from` < text.size() of one of the tiling patterns (Note [Common
  // patterns on every code point]).
  static std::size_t word_match(Fast pattern, std::string_view text, std::size_t from);
  // DeepSeek-V3's third split: the end of the match that a search from `from` finds (which moves
  // `from` to its start), or npos when there is none.
  static std::size_t deepseek_v3_match(std::string_view text, std::size_t& from);

  // Note [Runs of one class]: a pattern that is one Oniguruma class with `+` or {1,n} matches
  // maximal runs of at most run_max_ characters of that class (no PCRE2, no delta check).
  template <class F>
  void class_runs(std::string_view text, F&& on_match) const {
    if (run_space_prefix_) {
      spaced_runs_outside(text, on_match);
      return;
    }
    const CodePointSet& set = *run_class_;
    for (std::size_t i = 0; i < text.size();) {
      const std::size_t next = set.find_in(text.substr(i));  // skips ASCII and foreign lead bytes quickly
      if (next == std::string_view::npos) return;
      i += next;
      const std::size_t start = i;
      std::size_t count = 0, len;
      while (i < text.size() && count < run_max_ && set.contains(decode_at(text, i, &len))) {
        i += len;
        ++count;
      }
      on_match(start, i);
    }
  }
  // BLOOM's " ?[^C]+" (C holds the space; run_class_ is C): an optional space and a maximal run of
  // characters outside C, the space taken only when such a character follows it.
  template <class F>
  void spaced_runs_outside(std::string_view text, F&& on_match) const {
    const CodePointSet& stop = *run_class_;
    const std::size_t n = text.size();
    for (std::size_t i = 0; i < n;) {
      const std::size_t start = i;
      std::size_t len;
      if (stop.contains(decode_at(text, i, &len))) {
        std::size_t next_len;
        if (text[i] != ' ' || i + 1 == n || stop.contains(decode_at(text, i + 1, &next_len))) {
          i += len;  // no match starts here
          continue;
        }
        i += 1;  // the optional space
      }
      while (i < n && !stop.contains(decode_at(text, i, &len))) i += len;
      on_match(start, i);
    }
  }
  std::shared_ptr<const CodePointSet> run_class_;
  std::size_t run_max_ = 0;
  bool run_space_prefix_ = false;

  std::shared_ptr<const Compiled> native_, exact_;
  std::shared_ptr<const CodePointSet> delta_;
  Fast fast_ = Fast::kNone;  // the pattern is one of those below
};

/// The pre-tokenizer pattern of GPT-2 (ByteLevel's `use_regex`), as `tokenizers` writes it.
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
/// The `Split` pattern of Llama-3 (as in its tokenizer.json) and of Qwen2 (single digits).
inline constexpr std::string_view kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr std::string_view kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

/// The `Split` pattern of GPT-4o's o200k encoding as Hugging Face conversions write it (cased
/// words, contractions after a word, up to three digits) and of Mistral's Tekken (no
/// contractions, single digits).
inline constexpr std::string_view kGpt4oPattern =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr std::string_view kTekkenPattern =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

/// BLOOM's `Split` pattern: an optional space and a run of anything but whitespace, brackets, '|'
/// and the sentence punctuation of several scripts (a nested class).
inline constexpr std::string_view kBloomPattern = " ?[^(\\s|[.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c])]+";
/// The third `Split` pattern of DeepSeek-V3 (after splits of \p{N}{1,3} and of kana and CJK
/// ideographs): ASCII punctuation before ASCII letters, words with marks, punctuation and symbols.
/// Unlike the others it does not match everywhere (digits and controls alone are left out).
inline constexpr std::string_view kDeepSeekV3Pattern =
    R"re([!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

/// The classes that Note [Common patterns on every code point] reads for `c`: bit 0 \p{L}, 1 \p{N},
/// 2 \s, 3 Lu|Lt|Lm|Lo|M, 4 Ll|Lm|Lo|M, 6 M, 7 P|S (tests).
std::uint8_t word_match_classes(char32_t c);

/// Matches of an Oniguruma `pattern` in `text` as [begin, end) byte ranges
/// (tests of the translation). `exact` forces the pattern with explicit tables.
std::vector<std::pair<std::size_t, std::size_t>> regex_matches(const std::string& pattern, std::string_view text,
                                                               bool exact = false);

}  // namespace modalities::plugins::hf_tokenizer
