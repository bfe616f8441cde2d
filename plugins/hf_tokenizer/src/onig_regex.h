// Oniguruma patterns (as written in tokenizer.json, the syntax `tokenizers`
// compiles with the `onig` crate) run with PCRE2, with Oniguruma's meaning and
// Unicode tables. See Note [Two compiled patterns] in onig_regex.cpp.
#pragma once

#include "unicode.h"

#include <cstddef>
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

  /// This pattern, always matching with the explicit Oniguruma tables (tests).
  Regex with_exact_tables() const;
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

  std::shared_ptr<const Compiled> native_, exact_;
  std::shared_ptr<const CodePointSet> delta_;
};

/// Matches of an Oniguruma `pattern` in `text` as [begin, end) byte ranges
/// (tests of the translation). `exact` forces the pattern with explicit tables.
std::vector<std::pair<std::size_t, std::size_t>> regex_matches(const std::string& pattern, std::string_view text,
                                                               bool exact = false);

}  // namespace modalities::plugins::hf_tokenizer
