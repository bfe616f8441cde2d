// Oniguruma (Ruby syntax, as `tokenizers` compiles pre-tokenizer and
// normalizer patterns) -> PCRE2.
//
// Note [Two compiled patterns]
// PCRE2 is fast, but its Unicode tables are its own version (Debian 12:
// Unicode 14), while the Oniguruma inside `tokenizers` knows a newer one: a
// class such as [\p{P}\p{S}] would classify new emoji differently and a
// document would silently get other ids. Spelling every class out as explicit
// code-point ranges from Oniguruma's tables (unicode_tables.inc) is exact but
// makes PCRE2's JIT about 9 times slower. So each pattern is compiled twice:
// `native` keeps PCRE2's property lookups, `exact` uses the explicit ranges.
// When the pattern is built, the code points on which PCRE2's tables and
// Oniguruma's disagree for the classes the pattern uses are computed (the
// "delta", typically code points assigned after Unicode 14); a text that
// contains none of them matches identically with the native pattern, any
// other text runs the exact one. The delta is computed against the PCRE2
// actually linked, so a different PCRE2 version stays exact.
#include "onig_regex.h"

#include <modalities/sdk/error.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>

#include <array>
#include <cctype>
#include <functional>
#include <map>
#include <mutex>
#include <optional>

namespace modalities::plugins::hf_tokenizer {

struct Regex::Compiled {
  std::string pattern;
  std::shared_ptr<pcre2_code> code;
  bool jit = false;
};

namespace {

// Oniguruma's \s (Unicode White_Space) and \w written with PCRE2 items; the
// delta (Note [Two compiled patterns]) covers where these differ from Oniguruma.
constexpr std::string_view kSpaceItems =
    "\\x{09}-\\x{0D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";
constexpr std::string_view kWordItems = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{B2}\\x{B3}\\x{B9}\\x{BC}-\\x{BE}";

// `[first-last]` items of a set, without surrogates (PCRE2 refuses them in UTF mode).
std::string range_items(const CodePointSet& set) {
  std::string out;
  auto add = [&](char32_t a, char32_t b) {
    if (b < a) return;
    out += a == b
               ? fmt::format("\\x{{{:X}}}", static_cast<std::uint32_t>(a))
               : fmt::format("\\x{{{:X}}}-\\x{{{:X}}}", static_cast<std::uint32_t>(a), static_cast<std::uint32_t>(b));
  };
  for (const auto& [a, b] : set.ranges()) {
    if (b < 0xD800 || a > 0xDFFF) {
      add(a, b);
    } else {
      if (a < 0xD800) add(a, 0xD7FF);
      if (b > 0xDFFF) add(0xE000, b);
    }
  }
  return out;
}

// A class item in both spellings (text that goes inside a PCRE2 [...]).
struct Item {
  std::string native, exact;
};

struct ClassNode {
  bool negated = false;
  std::vector<Item> items;
  std::vector<ClassNode> nested;
  std::vector<ClassNode> and_parts;  // set: the class is the intersection of these
};

std::string literal_item(char32_t c) {
  if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
    return std::string(1, static_cast<char>(c));
  return fmt::format("\\x{{{:X}}}", static_cast<std::uint32_t>(c));
}

class Translator {
 public:
  Translator(std::string_view p, std::function<void(std::string_view)> refuse) : p_(p), refuse_(std::move(refuse)) {}

  void run() {
    icase_.push_back(false);
    while (i_ < p_.size()) step();  // unbalanced parentheses are left to PCRE2's error
  }
  std::string native, exact;
  std::vector<std::pair<std::string, const CodePointSet*>> checked;  // native item -> Oniguruma's set

 private:
  void emit(std::string_view n, std::string_view e) {
    native += n;
    exact += e;
  }
  void emit(std::string_view both) { emit(both, both); }

  const CodePointSet& table(std::string_view name) {
    const CodePointSet* s = oniguruma_class(name);
    if (s == nullptr) refuse_(fmt::format("'{}' (no Unicode table for it)", name));
    return *s;
  }

  struct Escape {
    Item item;  // the positive class
    bool negated = false;
    const CodePointSet* set = nullptr;  // Oniguruma's positive class
  };

  // A class escape (\s, \w, \d, \h, \p{..}, and their negations), or nullopt.
  std::optional<Escape> class_escape() {
    const char d = p_[i_ + 1];
    const bool upper = d >= 'A' && d <= 'Z';
    auto simple = [&](std::string_view name, std::string native_items, bool check) {
      const CodePointSet& s = table(name);
      if (check) checked.emplace_back(native_items, &s);
      i_ += 2;
      return Escape{Item{std::move(native_items), range_items(s)}, upper, &s};
    };
    switch (d) {
      case 's':
      case 'S': return simple("\\s", std::string(kSpaceItems), true);
      case 'w':
      case 'W': return simple("\\w", std::string(kWordItems), true);
      case 'd':
      case 'D': return simple("\\d", "\\p{Nd}", true);
      case 'h':
      case 'H': return simple("\\h", "0-9a-fA-F", false);
      case 'p':
      case 'P': {
        if (i_ + 2 >= p_.size() || p_[i_ + 2] != '{') refuse_("'\\p' without '{name}'");
        const std::size_t close = p_.find('}', i_ + 3);
        if (close == std::string_view::npos) refuse_("unterminated '\\p{'");
        std::string_view raw = p_.substr(i_ + 3, close - i_ - 3);
        bool negated = upper;
        if (!raw.empty() && raw[0] == '^') {
          negated = !negated;
          raw.remove_prefix(1);
        }
        const std::string name = oniguruma_property_name(raw);
        if (name.empty()) refuse_(fmt::format("the Unicode property '\\p{{{}}}' (not known)", raw));
        if (icase_.back() && (name == "Lu" || name == "Ll" || name == "Lt" || name == "LC"))
          refuse_(fmt::format("'\\p{{{}}}' inside a case-insensitive group", raw));
        const CodePointSet& s = table(name);
        std::string item = fmt::format("\\p{{{}}}", name);
        checked.emplace_back(item, &s);
        i_ = close + 1;
        return Escape{Item{item, range_items(s)}, negated, &s};
      }
      default: return std::nullopt;
    }
  }

  // A single character written literally or as an escape; nullopt if the escape is not a character.
  std::optional<char32_t> literal_char() {
    const char c = p_[i_];
    if (c != '\\') {
      std::size_t len;
      const char32_t cp = decode_at(p_, i_, &len);
      i_ += len;
      return cp;
    }
    if (i_ + 1 >= p_.size()) refuse_("a trailing backslash");
    const char d = p_[i_ + 1];
    auto hex = [&](std::size_t from, std::size_t n) -> char32_t {
      const std::string digits(p_.substr(from, n));
      if (digits.empty() || digits.size() > 8 ||
          digits.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
        refuse_(fmt::format("the escape '{}'", p_.substr(i_, from + n - i_)));
      return static_cast<char32_t>(std::stoul(digits, nullptr, 16));
    };
    switch (d) {
      case 'n': i_ += 2; return U'\n';
      case 'r': i_ += 2; return U'\r';
      case 't': i_ += 2; return U'\t';
      case 'f': i_ += 2; return U'\f';
      case 'v': i_ += 2; return U'\v';
      case 'a': i_ += 2; return U'\a';
      case 'e': i_ += 2; return U'\x1B';
      case 'u': {
        const char32_t v = hex(i_ + 2, 4);
        i_ += 6;
        return v;
      }
      case 'x': {
        if (i_ + 2 < p_.size() && p_[i_ + 2] == '{') {
          const std::size_t close = p_.find('}', i_ + 3);
          if (close == std::string_view::npos) refuse_("unterminated '\\x{'");
          const char32_t v = hex(i_ + 3, close - i_ - 3);
          i_ = close + 1;
          return v;
        }
        std::size_t n = 0;
        while (n < 2 && i_ + 2 + n < p_.size() && std::isxdigit(static_cast<unsigned char>(p_[i_ + 2 + n]))) ++n;
        const char32_t v = hex(i_ + 2, n);
        i_ += 2 + n;
        return v;
      }
      default:
        if ((d >= 'a' && d <= 'z') || (d >= 'A' && d <= 'Z') || (d >= '0' && d <= '9')) return std::nullopt;
        std::size_t len;
        const char32_t cp = decode_at(p_, i_ + 1, &len);
        i_ += 1 + len;
        return cp;
    }
  }

  ClassNode parse_class() {
    ClassNode node;
    ++i_;  // '['
    if (i_ < p_.size() && p_[i_] == '^') {
      node.negated = true;
      ++i_;
    }
    ClassNode part;  // the union being read (the whole class unless '&&' appears)
    bool first = true;
    while (true) {
      if (i_ >= p_.size()) refuse_("an unterminated character class");
      const char c = p_[i_];
      if (c == ']' && !first) {
        ++i_;
        break;
      }
      first = false;
      if (c == '[') {
        if (i_ + 1 < p_.size() && p_[i_ + 1] == ':') refuse_("a POSIX bracket class like [:alpha:]");
        part.nested.push_back(parse_class());
        continue;
      }
      if (c == '&' && i_ + 1 < p_.size() && p_[i_ + 1] == '&') {
        i_ += 2;
        node.and_parts.push_back(std::move(part));
        part = ClassNode{};
        continue;
      }
      if (c == '\\' && i_ + 1 < p_.size()) {
        if (auto esc = class_escape()) {
          if (!esc->negated) {
            part.items.push_back(std::move(esc->item));
          } else {
            // A negated escape inside a class: PCRE2's \P{..} natively, explicit ranges otherwise.
            const std::string complement = range_items(esc->set->complement());
            const bool property = esc->item.native.starts_with("\\p{");
            part.items.push_back(Item{property ? "\\P" + esc->item.native.substr(2) : complement, complement});
          }
          continue;
        }
      }
      const auto lo = literal_char();
      if (!lo) refuse_(fmt::format("the escape '{}' inside a character class", p_.substr(i_, 2)));
      std::string text = literal_item(*lo);
      if (i_ + 1 < p_.size() && p_[i_] == '-' && p_[i_ + 1] != ']') {
        ++i_;
        const auto hi = literal_char();
        if (!hi) refuse_("a range ending in a class escape");
        if (*hi < *lo) refuse_("a character range out of order");
        text += "-" + literal_item(*hi);
      }
      part.items.push_back(Item{text, text});
    }
    if (!node.and_parts.empty()) node.and_parts.push_back(std::move(part));
    else {
      node.items = std::move(part.items);
      node.nested = std::move(part.nested);
    }
    return node;
  }

  // Union members of `node` that are themselves plain unions are merged into it.
  static void flatten(ClassNode& node) {
    std::vector<ClassNode> keep;
    for (ClassNode& n : node.nested) {
      flatten(n);
      if (!n.negated && n.and_parts.empty()) {
        node.items.insert(node.items.end(), n.items.begin(), n.items.end());
        for (ClassNode& m : n.nested) keep.push_back(std::move(m));
      } else {
        keep.push_back(std::move(n));
      }
    }
    node.nested = std::move(keep);
    for (ClassNode& p : node.and_parts) flatten(p);
  }

  // PCRE2 text that matches exactly one character of the class, as one atom (a quantifier after
  // it applies to all of it).
  static std::string render(const ClassNode& node, bool exact) {
    auto items_of = [&](const ClassNode& n) {
      std::string s;
      for (const Item& it : n.items) s += exact ? it.exact : it.native;
      return s;
    };
    if (!node.and_parts.empty()) {
      std::string all;
      for (const ClassNode& part : node.and_parts) all += "(?=" + render(part, exact) + ")";
      return node.negated ? "(?:(?!" + all + ")(?s:.))" : "(?:" + all + "(?s:.))";
    }
    if (node.nested.empty()) return (node.negated ? "[^" : "[") + items_of(node) + "]";
    std::string alt = "(?:";
    bool any = false;
    if (!node.items.empty()) {
      alt += "[" + items_of(node) + "]";
      any = true;
    }
    for (const ClassNode& n : node.nested) {
      alt += (any ? "|" : "") + render(n, exact);
      any = true;
    }
    alt += ")";
    return node.negated ? "(?:(?!" + alt + ")(?s:.))" : alt;
  }

  void step() {
    const char c = p_[i_];
    if (c == '[') {
      ClassNode node = parse_class();
      flatten(node);
      emit(render(node, false), render(node, true));
      return;
    }
    if (c == '\\') {
      if (i_ + 1 >= p_.size()) refuse_("a trailing backslash");
      const char d = p_[i_ + 1];
      if (d == 'b' || d == 'B') {
        // Word boundary with Oniguruma's \w.
        const CodePointSet& w = table("\\w");
        checked.emplace_back(std::string(kWordItems), &w);
        auto boundary = [&](const std::string& word) {
          const std::string at = "(?:(?<=[" + word + "])(?![" + word + "])|(?<![" + word + "])(?=[" + word + "]))";
          return d == 'b' ? at : "(?!" + at + ")";
        };
        emit(boundary(std::string(kWordItems)), boundary(range_items(w)));
        i_ += 2;
        return;
      }
      if (auto esc = class_escape()) {
        const char* open = esc->negated ? "[^" : "[";
        emit(open + esc->item.native + "]", open + esc->item.exact + "]");
        return;
      }
      if (auto ch = literal_char()) {
        emit(literal_item(*ch));
        return;
      }
      emit(p_.substr(i_, 2));  // \A, \z, \Z, \G, back references, ...
      i_ += 2;
      return;
    }
    if (c == '(') {
      if (i_ + 1 < p_.size() && p_[i_ + 1] == '?') {
        // Inline options (?imx-imx) or (?imx-imx:...): Ruby's m is PCRE2's s.
        std::size_t j = i_ + 2;
        bool on = true, icase = icase_.back();
        std::string flags;
        while (j < p_.size() && (p_[j] == 'i' || p_[j] == 'm' || p_[j] == 'x' || p_[j] == '-')) {
          if (p_[j] == '-') on = false;
          if (p_[j] == 'i') icase = on;
          flags += p_[j] == 'm' ? 's' : p_[j];
          ++j;
        }
        if (j > i_ + 2 && j < p_.size() && (p_[j] == ':' || p_[j] == ')')) {
          emit("(?" + flags + p_[j]);
          if (p_[j] == ':') icase_.push_back(icase);
          else icase_.back() = icase;
          i_ = j + 1;
          return;
        }
      }
      icase_.push_back(icase_.back());
      emit("(");
      ++i_;
      return;
    }
    if (c == ')') {
      if (icase_.size() > 1) icase_.pop_back();
      emit(")");
      ++i_;
      return;
    }
    std::size_t len;
    decode_at(p_, i_, &len);
    emit(p_.substr(i_, len));
    i_ += len;
  }

  std::string_view p_;
  std::size_t i_ = 0;
  std::function<void(std::string_view)> refuse_;
  std::vector<bool> icase_;
};

std::shared_ptr<const Regex::Compiled> compile(const std::string& pattern,
                                               const std::function<void(std::string)>& error) {
  pcre2_compile_context* cc = pcre2_compile_context_create(nullptr);
  pcre2_set_newline(cc, PCRE2_NEWLINE_LF);
  int err = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &offset, cc);
  pcre2_compile_context_free(cc);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    error(fmt::format("{} at offset {}", reinterpret_cast<const char*>(msg), offset));
  }
  auto c = std::make_shared<Regex::Compiled>();
  c->pattern = pattern;
  c->jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  c->code = std::shared_ptr<pcre2_code>(code, pcre2_code_free);
  return c;
}

// Per-thread PCRE2 matching state (match data and a JIT stack that can grow).
struct PcreThreadState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(64 * 1024, 16 * 1024 * 1024, nullptr);
  PcreThreadState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~PcreThreadState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

PcreThreadState& pcre_state() {
  thread_local PcreThreadState state;
  return state;
}

// The code points PCRE2 puts in the class `[items]`, found by matching `[items]+` over a string
// of every code point (surrogates excluded). Cached per item text for the process.
const CodePointSet& pcre2_class(const std::string& items) {
  static std::mutex mutex;
  static std::map<std::string, CodePointSet> cache;
  std::lock_guard lock(mutex);
  if (auto it = cache.find(items); it != cache.end()) return it->second;
  static const std::string all = [] {
    std::string s;
    s.reserve(4 * 0x110000);
    for (char32_t c = 0; c < 0x110000; ++c)
      if (c < 0xD800 || c > 0xDFFF) append_utf8(s, c);
    return s;
  }();
  const auto re = compile("[" + items + "]+", [&](const std::string& why) {
    throw Error(fmt::format("internal: class '{}' does not compile: {}", items, why));
  });
  std::vector<std::pair<char32_t, char32_t>> ranges;
  pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
  for (std::size_t from = 0; from < all.size();) {
    const int rc = pcre2_match(re->code.get(), reinterpret_cast<PCRE2_SPTR>(all.data()), all.size(), from,
                               PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc < 0) break;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    std::size_t len;
    const char32_t first = decode_at(all, ov[0], &len);
    const char32_t last = decode_at(all, last_char_start(std::string_view(all).substr(0, ov[1])), &len);
    ranges.emplace_back(first, last);
    from = ov[1];
  }
  pcre2_match_data_free(md);
  return cache.emplace(items, CodePointSet::from_ranges(std::move(ranges))).first->second;
}

}  // namespace

Regex::Regex(const std::string& onig_pattern, const std::filesystem::path& file, std::string_view where) {
  Translator t(onig_pattern, [&](std::string_view why) {
    throw Error(
        fmt::format("{}: {}: regex '{}' uses {}, which is not supported", file.string(), where, onig_pattern, why));
  });
  t.run();
  auto error = [&](const std::string& pattern) {
    return [&, pattern](const std::string& why) {
      throw Error(fmt::format("{}: {}: regex '{}' does not compile (as PCRE2 '{}'): {}", file.string(), where,
                              onig_pattern, pattern.size() > 300 ? pattern.substr(0, 300) + "..." : pattern, why));
    };
  };
  native_ = compile(t.native, error(t.native));
  exact_ = t.exact == t.native ? native_ : compile(t.exact, error(t.exact));
  CodePointSet delta;
  for (const auto& [items, onig] : t.checked) delta = delta | (pcre2_class(items) ^ *onig);
  delta_ = std::make_shared<const CodePointSet>(std::move(delta));
  fast_ = onig_pattern == kGpt2Pattern         ? Fast::kGpt2
          : onig_pattern == kLlama3Pattern     ? Fast::kLlama3
          : onig_pattern == kQwen2Pattern      ? Fast::kQwen2
          : onig_pattern == kGpt4oPattern      ? Fast::kGpt4o
          : onig_pattern == kTekkenPattern     ? Fast::kTekken
          : onig_pattern == kDeepSeekV3Pattern ? Fast::kDeepSeekV3
                                               : Fast::kNone;
  // Note [Runs of one class]
  // A pattern that is a single class repeated (DeepSeek-V3's first two splits: numbers in threes,
  // runs of kana and CJK ideographs; BLOOM's split, an optional space and then a run outside a
  // class) matches runs of that class: with Oniguruma's own table for the
  // class, scanning the text gives exactly its matches, which is cheaper than asking PCRE2 for each
  // and checking every text for the code points whose class differs between the two libraries.
  constexpr std::size_t kUnbounded = std::string_view::npos;
  if (onig_pattern == R"(\p{N}{1,3})" || onig_pattern == R"(\p{N})" || onig_pattern == R"(\p{N}+)") {
    run_class_ = std::make_shared<const CodePointSet>(*oniguruma_class("N"));
    run_max_ = onig_pattern.ends_with("{1,3}") ? 3 : onig_pattern.ends_with("+") ? kUnbounded : 1;
  } else if (onig_pattern == "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+") {
    run_class_ = std::make_shared<const CodePointSet>(
        CodePointSet::from_ranges({{0x4E00, 0x9FA5}, {0x3040, 0x309F}, {0x30A0, 0x30FF}}));
    run_max_ = kUnbounded;
  } else if (onig_pattern == kBloomPattern) {  // C = \s, '(', '|', ')' and the nested class
    CodePointSet stop = *oniguruma_class("\\s");
    for (const char32_t c : {U'(', U'|', U')', U'.', U',', U'!', U'?', U'\u2026', U'\u3002', U'\uff0c', U'\u3001',
                             U'\u0964', U'\u06d4', U'\u060c'})
      stop = stop | CodePointSet::from_ranges({{c, c}});
    run_class_ = std::make_shared<const CodePointSet>(std::move(stop));
    run_max_ = kUnbounded;
    run_space_prefix_ = true;
  }
}

Regex Regex::with_exact_tables() const {
  Regex r = *this;
  r.native_ = r.exact_;
  return r;
}

Regex Regex::without_hand_written_matchers() const {
  Regex r = *this;
  r.fast_ = Fast::kNone;
  r.run_class_.reset();
  return r;
}

// Note [Common patterns on every code point]
// The pre-tokenizer patterns of GPT-2 (ByteLevel's regex), Llama-3, Qwen2, GPT-4o and Tekken
// match at every position (each character is \s, a letter, a number or none of these, and some
// alternative starts with each), so the matches tile the text and each ends where a few
// character classes say. Asking PCRE2 for each token (and first scanning every text for the code
// points where PCRE2's Unicode tables differ from Oniguruma's) is most of the time of byte-level
// BPE on cached words, so word_match reads the classes itself from one table built from
// Oniguruma's own sets, and PCRE2 is not used for these patterns. Each branch below is one
// alternative of the pattern, in the pattern's order, with its backtracking spelled out:
//   * \s+(?!\S) gives the run of spaces less its last character when a non-space follows;
//   * \s*[\r\n]+ ends after the last line break of the run of spaces;
//   * GPT-4o's [U]*[W]+ (U = Lu Lt Lm Lo M, W = Ll Lm Lo M, which overlap) takes the whole run of
//     U, then a run of W after it; when no W follows, U* gives back characters until the last one
//     that is also in W, which W+ then matches (no such character: the alternative fails);
//   * the optional [^\r\n\p{L}\p{N}] before a word is tried first, then the word at the character
//     itself (a mark is both);
//   * case-insensitive contractions also match "ſ" for "s" (its only non-ASCII case fold).
// Checked against PCRE2 on every string of up to 4 characters over an alphabet of representatives
// of every class combination, on the corpora and on a text of every code point
// (WordMatchersGiveThePcreMatches); the table against the sets on every code point.
// DeepSeek-V3's third pattern does not match everywhere (a digit or a control that no alternative
// takes is skipped, as a search skips it); deepseek_v3_match reads the same classes.

namespace {

// kAtEnd is never in the table: the reader returns it past the end of the text.
enum : std::uint8_t { kInL = 1, kInN = 2, kInSpace = 4, kInU = 8, kInW = 16, kAtEnd = 32, kInM = 64, kInPS = 128 };

// The classes of every code point (bits kInL ... kInPS, from Oniguruma's sets), as a two-stage
// table: blocks of 256 code points, each block stored once (most of Unicode is a few distinct
// blocks), so that a lookup is two loads.
struct WordClassTable {
  std::vector<std::uint16_t> block_of = std::vector<std::uint16_t>(0x110000 >> 8);
  std::vector<std::uint8_t> blocks;
  std::uint8_t operator()(char32_t c) const { return blocks[std::size_t{block_of[c >> 8]} << 8 | (c & 0xFF)]; }
};

const WordClassTable& word_class_table() {
  static const WordClassTable table = [] {
    const CodePointSet upper = *oniguruma_class("Lu") | *oniguruma_class("Lt") | *oniguruma_class("Lm") |
                               *oniguruma_class("Lo") | *oniguruma_class("M");
    const CodePointSet lower =
        *oniguruma_class("Ll") | *oniguruma_class("Lm") | *oniguruma_class("Lo") | *oniguruma_class("M");
    const CodePointSet punct_or_symbol = *oniguruma_class("P") | *oniguruma_class("S");
    const std::pair<const CodePointSet*, std::uint8_t> sets[] = {{oniguruma_class("L"), kInL},
                                                                 {oniguruma_class("N"), kInN},
                                                                 {oniguruma_class("\\s"), kInSpace},
                                                                 {&upper, kInU},
                                                                 {&lower, kInW},
                                                                 {oniguruma_class("M"), kInM},
                                                                 {&punct_or_symbol, kInPS}};
    std::vector<std::uint8_t> all(0x110000, 0);  // set by range, not by a lookup per code point
    for (const auto& [set, bit] : sets)
      for (const auto& [first, last] : set->ranges())
        for (char32_t c = first; c <= last; ++c) all[c] |= bit;
    WordClassTable t;
    std::map<std::array<std::uint8_t, 256>, std::uint16_t> seen;
    for (char32_t hi = 0; hi < (0x110000 >> 8); ++hi) {
      std::array<std::uint8_t, 256> block{};
      std::copy_n(all.begin() + (hi << 8), 256, block.begin());
      auto [it, added] = seen.emplace(block, static_cast<std::uint16_t>(seen.size()));
      if (added) t.blocks.insert(t.blocks.end(), block.begin(), block.end());
      t.block_of[hi] = it->second;
    }
    return t;
  }();
  return table;
}

// The classes of the code point at text[i] (kAtEnd past the end) and its length.
struct ClassReader {
  explicit ClassReader(std::string_view text) : s(text.data()), n(text.size()) {
    const WordClassTable& t = word_class_table();
    blocks = t.blocks.data();
    block_of = t.block_of.data();
  }
  struct At {
    std::uint8_t classes, len;
  };
  [[gnu::always_inline]] At at(std::size_t i) const {
    if (i >= n) return {kAtEnd, 0};
    const auto b0 = static_cast<unsigned char>(s[i]);
    if (b0 < 0x80) return {blocks[b0], 1};  // block 0 is stored first
    auto cont = [&](std::size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(s[i + k]) & 0x3F); };
    char32_t c;
    std::uint8_t len;
    if (b0 < 0xE0) {
      c = (b0 & 0x1F) << 6 | cont(1);
      len = 2;
    } else if (b0 < 0xF0) {
      c = (b0 & 0x0F) << 12 | cont(1) << 6 | cont(2);
      len = 3;
    } else {
      c = (b0 & 0x07) << 18 | cont(1) << 12 | cont(2) << 6 | cont(3);
      len = 4;
    }
    return {blocks[std::size_t{block_of[c >> 8]} << 8 | (c & 0xFF)], len};
  }
  [[gnu::always_inline]] std::uint8_t operator()(std::size_t i, std::size_t* len) const {
    const At a = at(i);
    *len = a.len;
    return a.classes;
  }
  // The end of the run from `i` of code points whose classes satisfy `in` (false for kAtEnd).
  template <class In>
  [[gnu::always_inline]] std::size_t run(std::size_t i, In&& in) const {
    for (At a = at(i); in(a.classes); a = at(i)) i += a.len;
    return i;
  }
  [[gnu::always_inline]] std::size_t run_of(std::size_t i, std::uint8_t k) const {
    return run(i, [k](std::uint8_t b) { return (b & k) != 0; });
  }
  // \s+(?!\S)|\s+ at `from`, after \s*[\r\n]+ when `breaks`.
  [[gnu::always_inline]] std::size_t spaces(std::size_t from, bool breaks) const {
    const std::size_t end = run_of(from, kInSpace);
    // Every other class was taken by an alternative before; a match must move on.
    if (end == from) throw Error("internal: a hand-written pre-tokenizer matcher reached a character of no class");
    if (breaks)
      for (std::size_t i = end; i > from; --i)
        if (s[i - 1] == '\r' || s[i - 1] == '\n') return i;
    if (end == n) return end;
    const std::size_t last = last_char_start(std::string_view(s, end));
    return last == from ? end : last;
  }

  const char* s;
  std::size_t n;
  const std::uint8_t* blocks;
  const std::uint16_t* block_of;
};

}  // namespace

std::uint8_t word_match_classes(char32_t c) { return word_class_table()(c); }

std::size_t Regex::word_match(Fast pattern, std::string_view text, std::size_t from) {
  const std::size_t n = text.size();
  const ClassReader classes(text);
  std::size_t len0, len;
  const std::uint8_t b0 = classes(from, &len0);
  const std::uint8_t b1 = classes(from + len0, &len);
  const char c = text[from];
  auto other = [](std::uint8_t b) { return (b & (kInL | kInN | kInSpace | kAtEnd)) == 0; };  // [^\s\p{L}\p{N}]
  auto run = [&](std::size_t i, auto&& in) { return classes.run(i, in); };
  auto run_of = [&](std::size_t i, std::uint8_t k) { return classes.run_of(i, k); };
  auto numbers = [&](std::size_t most) {  // \p{N}{1,most}
    std::size_t i = from;
    for (std::size_t count = 0; count < most && (classes(i, &len) & kInN) != 0; ++count) i += len;
    return i;
  };
  auto line_breaks = [&](std::size_t i, bool slash) {  // [\r\n]* or [\r\n/]*
    while (i < n && (text[i] == '\r' || text[i] == '\n' || (slash && text[i] == '/'))) ++i;
    return i;
  };
  // 's|'t|'re|'ve|'m|'ll|'d at `i`, case-insensitive or not: its end, or `i` when there is none.
  auto contraction = [&](std::size_t i, bool caseless) {
    auto letter = [&](std::size_t j, std::size_t* l) -> char {  // lower-cased ASCII letter, 's' for "ſ"
      if (j >= n) return 0;
      const auto x = static_cast<unsigned char>(text[j]);
      *l = 1;
      if (x < 0x80) return caseless && x >= 'A' && x <= 'Z' ? static_cast<char>(x + 32) : static_cast<char>(x);
      *l = 2;
      return caseless && x == 0xC5 && j + 1 < n && static_cast<unsigned char>(text[j + 1]) == 0xBF ? 's' : 0;
    };
    if (i >= n || text[i] != '\'') return i;
    std::size_t l1, l2;
    const char x = letter(i + 1, &l1);
    if (x == 's' || x == 't' || x == 'm' || x == 'd') return i + 1 + l1;
    if (x == 'r' || x == 'v' || x == 'l') {
      const char y = letter(i + 1 + l1, &l2);
      if ((x != 'l' && y == 'e') || (x == 'l' && y == 'l')) return i + 1 + l1 + l2;
    }
    return i;
  };
  auto spaces = [&](bool breaks) { return classes.spaces(from, breaks); };  // after \s*[\r\n]+ for all but GPT-2

  if (pattern == Fast::kGpt2) {
    if (c == '\'')
      if (const std::size_t e = contraction(from, false); e != from) return e;
    if (c == ' ') {  //  ?\p{L}+ |  ?\p{N}+ |  ?[^\s\p{L}\p{N}]+
      if (b1 & kInL) return run_of(from + 1, kInL);
      if (b1 & kInN) return run_of(from + 1, kInN);
      if (other(b1)) return run(from + 1, other);
    }
    if (b0 & kInL) return run_of(from, kInL);
    if (b0 & kInN) return run_of(from, kInN);
    if (other(b0)) return run(from, other);
    return spaces(false);
  }

  const bool before_word = (b0 & (kInL | kInN)) == 0 && c != '\r' && c != '\n';  // [^\r\n\p{L}\p{N}]
  if (pattern == Fast::kLlama3 || pattern == Fast::kQwen2) {
    if (c == '\'')
      if (const std::size_t e = contraction(from, true); e != from) return e;
    if (b0 & kInL) return run_of(from, kInL);                         // \p{L}+
    if (b0 & kInN) return numbers(pattern == Fast::kLlama3 ? 3 : 1);  // \p{N}{1,3} | \p{N}
    if (before_word && (b1 & kInL)) return run_of(from + len0, kInL);
  } else {  // GPT-4o, Tekken
    auto tail = [&](std::size_t e) { return pattern == Fast::kGpt4o ? contraction(e, true) : e; };
    auto upper_then_lower = [&](std::size_t p) -> std::size_t {  // [U]*[W]+: its end, or 0
      std::size_t i = p, last_lower = 0;
      std::uint8_t b;
      while (((b = classes(i, &len)) & kInU) != 0) {
        i += len;
        if (b & kInW) last_lower = i;
      }
      return (b & kInW) != 0 ? run_of(i, kInW) : last_lower;
    };
    auto upper_and_lower = [&](std::size_t p) -> std::size_t {  // [U]+[W]*: its end, or 0
      if ((classes(p, &len) & kInU) == 0) return 0;
      return run_of(run_of(p, kInU), kInW);
    };
    std::size_t e = 0;
    if ((before_word && (e = upper_then_lower(from + len0)) != 0) || (e = upper_then_lower(from)) != 0 ||
        (before_word && (e = upper_and_lower(from + len0)) != 0) || (e = upper_and_lower(from)) != 0)
      return tail(e);
    if (b0 & kInN) return numbers(pattern == Fast::kGpt4o ? 3 : 1);
  }
  //  ?[^\s\p{L}\p{N}]+[\r\n]*  (GPT-4o and Tekken: [\r\n/]*)
  const bool slash = pattern == Fast::kGpt4o || pattern == Fast::kTekken;
  if (other(b0)) return line_breaks(run(from, other), slash);
  if (c == ' ' && other(b1)) return line_breaks(run(from + 1, other), slash);
  return spaces(true);
}

// DeepSeek-V3's third split (kDeepSeekV3Pattern), searching from `from`; see Note [Common patterns
// on every code point]. Its alternatives in order: ASCII punctuation before ASCII letters, a word
// of letters and marks (after one character that is none of \r \n \p{L} \p{P} \p{S}), punctuation
// and symbols (after an optional space) with the line breaks after them, and the space rules.
std::size_t Regex::deepseek_v3_match(std::string_view text, std::size_t& from) {
  constexpr std::string_view kLiteralPunct = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";  // the pattern's first class
  const std::size_t n = text.size();
  const ClassReader classes(text);
  auto ascii_letter = [&](std::size_t i) { return i < n && ((text[i] | 0x20) >= 'a' && (text[i] | 0x20) <= 'z'); };
  auto line_breaks = [&](std::size_t i) {
    while (i < n && (text[i] == '\r' || text[i] == '\n')) ++i;
    return i;
  };
  for (std::size_t at = from; at < n;) {
    std::size_t len0, len1;
    const std::uint8_t b0 = classes(at, &len0);
    const std::uint8_t b1 = classes(at + len0, &len1);
    const char c = text[at];
    std::size_t end = 0;
    if (kLiteralPunct.find(c) != std::string_view::npos && ascii_letter(at + 1)) {  // [punct][A-Za-z]+
      end = at + 1;
      while (ascii_letter(end)) ++end;
    } else if ((b0 & (kInL | kInPS)) == 0 && c != '\r' && c != '\n' && (b1 & (kInL | kInM)) != 0) {
      end = classes.run_of(at + len0, kInL | kInM);  // [^\r\n\p{L}\p{P}\p{S}][\p{L}\p{M}]+
    } else if ((b0 & (kInL | kInM)) != 0) {
      end = classes.run_of(at, kInL | kInM);  // [\p{L}\p{M}]+
    } else if ((b0 & kInPS) != 0) {           //  ?[\p{P}\p{S}]+[\r\n]*
      end = line_breaks(classes.run_of(at, kInPS));
    } else if (c == ' ' && (b1 & kInPS) != 0) {
      end = line_breaks(classes.run_of(at + 1, kInPS));
    } else if ((b0 & kInSpace) != 0) {
      end = classes.spaces(at, true);
    } else {
      at += len0;  // no alternative matches here
      continue;
    }
    from = at;
    return end;
  }
  return std::string_view::npos;
}

const std::string& Regex::native_pattern() const { return native_->pattern; }
const std::string& Regex::exact_pattern() const { return exact_->pattern; }

bool Regex::search(const Compiled& c, std::string_view text, std::size_t from, std::size_t* start, std::size_t* end) {
  PcreThreadState& st = pcre_state();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const int rc = c.jit ? pcre2_jit_match(c.code.get(), subject, text.size(), from, 0, st.data, st.context)
                       : pcre2_match(c.code.get(), subject, text.size(), from, PCRE2_NO_UTF_CHECK, st.data, st.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    throw Error(fmt::format("regex failed on a text of {} bytes: {}", text.size(), reinterpret_cast<const char*>(msg)));
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
  *start = ov[0];
  *end = ov[1];
  return true;
}

std::vector<std::pair<std::size_t, std::size_t>> regex_matches(const std::string& pattern, std::string_view text,
                                                               bool exact) {
  Regex re(pattern, "<pattern>", "regex_matches");
  std::vector<std::pair<std::size_t, std::size_t>> out;
  (exact ? re.with_exact_tables() : re).for_each_match(text, [&](std::size_t b, std::size_t e) {
    out.emplace_back(b, e);
  });
  return out;
}

}  // namespace modalities::plugins::hf_tokenizer
