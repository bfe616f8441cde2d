// Loader and encoder for Hugging Face `tokenizer.json` files of the byte-level
// BPE family (GPT-2, Llama-3, Qwen2, ...), reproducing the ids of the
// `tokenizers` library (Rust core, as used by transformers and Modalities).
//
// Note [Why the BPE core is hand-written]
// There is no maintained C++ port of `tokenizers`, and the ids must be
// identical to it, including its less obvious rules: leftmost-longest
// added-token matching with single_word/lstrip/rstrip, Oniguruma regex
// semantics (Unicode \s, \w, empty-match stepping), split behaviours,
// ignore_merges, byte_fallback, unk fusing and the merge order (lowest rank
// first, leftmost on ties). Speed matters as much (packing tokenizes whole
// corpora): we keep no offsets or alignments, run BPE directly on raw bytes
// when the pipeline is byte-level, merge with a flat pair table and cache
// words per thread. Regexes go to PCRE2 (JIT), Unicode normalization to
// utf8proc and JSON to simdjson; only the tokenizer logic is ours.
#include "tokenizer_json.h"

#include <modalities/sdk/error.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <absl/container/flat_hash_map.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pcre2.h>
#include <simdjson.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <queue>

namespace modalities::plugins::hf_tokenizer {
namespace {

namespace dom = simdjson::dom;

// ---------------------------------------------------------------------------
// UTF-8 and Unicode helpers

// Debian's Abseil has its own string_view type for heterogeneous lookups.
inline absl::string_view key(std::string_view s) { return absl::string_view(s.data(), s.size()); }

inline std::size_t utf8_len(unsigned char lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}

// Code point at s[i] of valid UTF-8; sets *len to its byte length.
inline char32_t decode_at(std::string_view s, std::size_t i, std::size_t* len) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  const std::size_t n = utf8_len(b0);
  *len = n;
  if (n == 1) return b0;
  char32_t cp = b0 & (n == 2 ? 0x1F : n == 3 ? 0x0F : 0x07);
  for (std::size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

// Start of the last code point of non-empty valid UTF-8 `s`.
inline std::size_t last_char_start(std::string_view s) {
  std::size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Unicode White_Space: what `\s` means in Rust's regex and in Oniguruma.
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Rust `char::is_numeric`: general categories Nd, Nl, No.
bool is_numeric(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_NO;
}

// The GPT-2 byte <-> printable character table (bytes_to_unicode).
struct ByteLevelAlphabet {
  std::array<char32_t, 256> byte_to_cp{};
  std::array<std::string, 256> byte_to_utf8{};
  std::array<int, 324> cp_to_byte{};
  ByteLevelAlphabet() {
    cp_to_byte.fill(-1);
    std::array<bool, 256> direct{};
    for (int b = 0; b < 256; ++b) direct[b] = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      byte_to_cp[b] = direct[b] ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      cp_to_byte[byte_to_cp[b]] = b;
      append_utf8(byte_to_utf8[b], byte_to_cp[b]);
    }
  }
  // Raw bytes of a byte-level string, or nullopt if a character is outside the alphabet.
  std::optional<std::string> to_bytes(std::string_view s) const {
    std::string out;
    out.reserve(s.size());
    for (std::size_t i = 0; i < s.size();) {
      std::size_t len;
      const char32_t cp = decode_at(s, i, &len);
      if (cp >= cp_to_byte.size() || cp_to_byte[cp] < 0) return std::nullopt;
      out += static_cast<char>(cp_to_byte[cp]);
      i += len;
    }
    return out;
  }
};

const ByteLevelAlphabet& alphabet() {
  static const ByteLevelAlphabet a;
  return a;
}

// Note [Normalization fast path]
// Running utf8proc on every segment dominates NFC pipelines, while most text is
// already normalized. A segment is left alone when every character is known to
// be unchanged by the form and unable to interact with its neighbours: for BMP
// characters a per-form table computed once with utf8proc (NF(c) == c, combining
// class 0, not the second element of any composition, not a Hangul jamo), for
// astral ones the property check (no decomposition at all, class 0, not a
// second element). Anything else takes the full utf8proc path.
constexpr utf8proc_uint16_t kNoIndex = 0xFFFF;

bool is_hangul_jamo(char32_t c) {
  return (c >= 0x1100 && c <= 0x11FF) || (c >= 0xA960 && c <= 0xA97F) || (c >= 0xD7B0 && c <= 0xD7FF);
}

bool stable_by_properties(char32_t c, bool compose) {
  const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(c));
  if (p->combining_class != 0 || p->decomp_seqindex != kNoIndex || is_hangul_jamo(c)) return false;
  return !(compose && p->comb_index != kNoIndex && p->comb_index >= 0x8000);
}

class StableTable {
 public:
  explicit StableTable(int options) : bits_(0x10000, false) {
    const bool compose = (options & UTF8PROC_COMPOSE) != 0;
    for (char32_t c = 0x80; c < 0x10000; ++c) {
      if (c >= 0xD800 && c <= 0xDFFF) continue;
      const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(c));
      if (p->combining_class != 0 || is_hangul_jamo(c)) continue;
      if (compose && p->comb_index != kNoIndex && p->comb_index >= 0x8000) continue;
      std::string one;
      append_utf8(one, c);
      utf8proc_uint8_t* dst = nullptr;
      const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(one.data()),
                                              static_cast<utf8proc_ssize_t>(one.size()), &dst,
                                              static_cast<utf8proc_option_t>(options));
      if (n >= 0 && std::string_view(reinterpret_cast<const char*>(dst), static_cast<std::size_t>(n)) == one)
        bits_[c] = true;
      std::free(dst);
    }
  }
  bool stable(char32_t c) const { return bits_[c]; }

 private:
  std::vector<bool> bits_;
};

const StableTable& stable_table(int options) {
  static const StableTable nfc(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
  static const StableTable nfd(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
  static const StableTable nfkc(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
  static const StableTable nfkd(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  if (options & UTF8PROC_COMPAT) return (options & UTF8PROC_COMPOSE) ? nfkc : nfkd;
  return (options & UTF8PROC_COMPOSE) ? nfc : nfd;
}

// Whether `c` is unchanged by the form and cannot interact with its neighbours.
bool is_stable(char32_t c, int options, const StableTable*& table) {
  if (c >= 0x10000) return stable_by_properties(c, (options & UTF8PROC_COMPOSE) != 0);
  if (table == nullptr) table = &stable_table(options);
  return table->stable(c);
}

std::string utf8proc_normalize(std::string_view s, int options) {
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          static_cast<utf8proc_ssize_t>(s.size()), &dst,
                                          static_cast<utf8proc_option_t>(options));
  if (n < 0) throw Error(fmt::format("Unicode normalization failed: {}", utf8proc_errmsg(n)));
  std::string out(reinterpret_cast<const char*>(dst), static_cast<std::size_t>(n));
  std::free(dst);
  return out;
}

// Normalizes `s` into `out` and returns true, or returns false (leaving `out`
// alone) when `s` is already normalized. A boundary before a stable character
// is a safe split point, so only the regions around unstable characters (from
// the last stable character before them to the next stable one) go through
// utf8proc. See Note [Normalization fast path].
bool normalize_form(std::string_view s, int options, std::string& out) {
  const StableTable* table = nullptr;
  std::size_t copied = 0, last_stable = 0;
  bool changed = false;
  for (std::size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      last_stable = i++;
      continue;
    }
    std::size_t len;
    const char32_t c = decode_at(s, i, &len);
    if (is_stable(c, options, table)) {
      last_stable = i;
      i += len;
      continue;
    }
    const std::size_t region = std::max(copied, last_stable);
    std::size_t j = i + len;
    while (j < s.size()) {
      if (static_cast<unsigned char>(s[j]) < 0x80) break;
      std::size_t l;
      if (is_stable(decode_at(s, j, &l), options, table)) break;
      j += l;
    }
    const std::string normalized = utf8proc_normalize(s.substr(region, j - region), options);
    if (!changed && normalized == s.substr(region, j - region)) {
      i = j;  // this region happened to be normalized already; nothing to copy yet
      continue;
    }
    if (!changed) {
      out.clear();
      changed = true;
    }
    out.append(s, copied, region - copied);
    out += normalized;
    copied = j;
    i = j;
  }
  if (changed) out.append(s, copied, std::string_view::npos);
  return changed;
}

// ---------------------------------------------------------------------------
// Errors and JSON access

[[noreturn]] void fail(const std::filesystem::path& file, std::string_view where, std::string_view what) {
  throw Error(fmt::format("{}: {}: {}", file.string(), where, what));
}

struct Json {
  const std::filesystem::path& file;

  dom::element member(dom::element obj, std::string_view key, std::string_view where) const {
    dom::element v;
    if (obj.type() != dom::element_type::OBJECT) fail(file, where, "expected an object");
    if (obj.at_key(key).get(v) != simdjson::SUCCESS) fail(file, fmt::format("{}.{}", where, key), "missing");
    return v;
  }
  std::optional<dom::element> optional_member(dom::element obj, std::string_view key) const {
    dom::element v;
    if (obj.type() != dom::element_type::OBJECT || obj.at_key(key).get(v) != simdjson::SUCCESS || v.is_null())
      return std::nullopt;
    return v;
  }
  std::string string(dom::element v, std::string_view where) const {
    std::string_view s;
    if (v.get_string().get(s) != simdjson::SUCCESS) fail(file, where, "expected a string");
    return std::string(s);
  }
  bool boolean(dom::element v, std::string_view where) const {
    bool b;
    if (v.get_bool().get(b) != simdjson::SUCCESS) fail(file, where, "expected true or false");
    return b;
  }
  std::int64_t integer(dom::element v, std::string_view where) const {
    std::int64_t i;
    if (v.get_int64().get(i) != simdjson::SUCCESS) {
      std::uint64_t u;
      if (v.get_uint64().get(u) == simdjson::SUCCESS) fail(file, where, "integer too large");
      fail(file, where, "expected an integer");
    }
    return i;
  }
  dom::array array(dom::element v, std::string_view where) const {
    dom::array a;
    if (v.get_array().get(a) != simdjson::SUCCESS) fail(file, where, "expected an array");
    return a;
  }
  dom::object object(dom::element v, std::string_view where) const {
    dom::object o;
    if (v.get_object().get(o) != simdjson::SUCCESS) fail(file, where, "expected an object");
    return o;
  }
  bool flag(dom::element obj, std::string_view key, bool fallback, std::string_view where) const {
    auto v = optional_member(obj, key);
    return v ? boolean(*v, fmt::format("{}.{}", where, key)) : fallback;
  }
  std::string type_of(dom::element obj, std::string_view where) const {
    return string(member(obj, "type", where), fmt::format("{}.type", where));
  }
};

[[noreturn]] void unsupported(const std::filesystem::path& file, std::string_view where, std::string_view kind,
                              std::string_view type, std::string_view supported) {
  fail(file, where,
       fmt::format("{} '{}' is not supported by tokenizer/pretrained_hf_tokenizer (supported: {})", kind, type,
                   supported));
}

// ---------------------------------------------------------------------------
// Regexes: Oniguruma (Ruby syntax, as `tokenizers` compiles them) -> PCRE2

constexpr std::string_view kSpaceItems =
    "\\x{09}-\\x{0D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";
// Oniguruma's Unicode \w: Alphabetic, marks, decimal digits, connectors, plus the
// Latin-1 digits-like characters ² ³ ¹ ¼ ½ ¾ (checked against `tokenizers` on
// every code point, see regex_classes.json in the tests).
constexpr std::string_view kWordItems = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{B2}\\x{B3}\\x{B9}\\x{BC}-\\x{BE}";

// Rewrites the Oniguruma constructs whose PCRE2 meaning differs: \s (Unicode
// White_Space), \w (see kWordItems), \d (Nd), \h (hex
// digit), \uHHHH, and (?m) (dot-all in Ruby). Set operations and nested
// classes have no PCRE2 equivalent and are refused.
std::string translate_pattern(std::string_view p, const std::function<void(std::string_view)>& refuse) {
  std::string out;
  out.reserve(p.size() * 2);
  bool in_class = false;
  std::size_t class_start = 0;  // index just after "[" or "[^"
  for (std::size_t i = 0; i < p.size();) {
    const char c = p[i];
    if (c == '\\') {
      if (i + 1 >= p.size()) refuse("trailing backslash");
      const char d = p[i + 1];
      auto cls = [&](std::string_view items, bool negated) {
        if (in_class) {
          if (negated) refuse(fmt::format("'\\{}' inside a character class", d));
          out += items;
        } else {
          out += negated ? "[^" : "[";
          out += items;
          out += ']';
        }
      };
      switch (d) {
        case 's': cls(kSpaceItems, false); break;
        case 'S': cls(kSpaceItems, true); break;
        case 'w': cls(kWordItems, false); break;
        case 'W': cls(kWordItems, true); break;
        case 'h': cls("0-9a-fA-F", false); break;
        case 'H': cls("0-9a-fA-F", true); break;
        case 'd': out += "\\p{Nd}"; break;
        case 'D': out += "\\P{Nd}"; break;
        case 'u': {
          if (i + 6 > p.size()) refuse("'\\u' needs four hex digits");
          out += "\\x{";
          out += p.substr(i + 2, 4);
          out += '}';
          i += 6;
          continue;
        }
        default: out += c; out += d; break;
      }
      i += 2;
      continue;
    }
    if (in_class) {
      if (c == '[') {
        if (i + 1 < p.size() && p[i + 1] == ':') {
          const std::size_t end = p.find(":]", i + 2);
          if (end == std::string_view::npos) refuse("unterminated POSIX class");
          out += p.substr(i, end + 2 - i);
          i = end + 2;
          continue;
        }
        refuse("nested character class");
      }
      if (c == '&' && i + 1 < p.size() && p[i + 1] == '&') refuse("character class intersection '&&'");
      if (c == ']' && i != class_start) in_class = false;
      out += c;
      ++i;
      continue;
    }
    if (c == '[') {
      in_class = true;
      out += c;
      ++i;
      if (i < p.size() && p[i] == '^') out += p[i++];
      class_start = i;
      continue;
    }
    if (c == '(' && i + 1 < p.size() && p[i + 1] == '?') {
      // Inline options (?imx-imx) or (?imx-imx:...): Ruby's m is PCRE2's s.
      std::size_t j = i + 2;
      while (j < p.size() && (p[j] == 'i' || p[j] == 'm' || p[j] == 'x' || p[j] == '-')) ++j;
      if (j > i + 2 && j < p.size() && (p[j] == ':' || p[j] == ')')) {
        out += "(?";
        for (std::size_t k = i + 2; k < j; ++k) out += p[k] == 'm' ? 's' : p[k];
        i = j;
        continue;
      }
    }
    out += c;
    ++i;
  }
  if (in_class) refuse("unterminated character class");
  return out;
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

class Regex {
 public:
  Regex() = default;
  Regex(const std::string& onig_pattern, const std::filesystem::path& file, std::string_view where) {
    const std::string pattern = translate_pattern(onig_pattern, [&](std::string_view why) {
      fail(file, where, fmt::format("regex '{}' uses {}, which is not supported", onig_pattern, why));
    });
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
      fail(file, where,
           fmt::format("regex '{}' does not compile (as PCRE2 '{}'): {} at offset {}", onig_pattern, pattern,
                       reinterpret_cast<const char*>(msg), offset));
    }
    jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
    code_ = std::shared_ptr<pcre2_code>(code, pcre2_code_free);
    properties_ = pattern.find("\\p") != std::string::npos || pattern.find("\\P") != std::string::npos;
  }
  explicit operator bool() const { return static_cast<bool>(code_); }
  // Whether the pattern uses Unicode property classes (\p{..}, \P{..}), whose result depends on
  // the Unicode version of PCRE2's tables.
  bool uses_properties() const { return properties_; }

  // Leftmost match starting at or after `from`, as [start, end).
  bool search(std::string_view text, std::size_t from, std::size_t* start, std::size_t* end) const {
    PcreThreadState& st = pcre_state();
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    const int rc = jit_ ? pcre2_jit_match(code_.get(), subject, text.size(), from, 0, st.data, st.context)
                        : pcre2_match(code_.get(), subject, text.size(), from, PCRE2_NO_UTF_CHECK, st.data, st.context);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      throw Error(fmt::format("pre-tokenizer regex failed on a text of {} bytes: {}", text.size(),
                              reinterpret_cast<const char*>(msg)));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
    *start = ov[0];
    *end = ov[1];
    return true;
  }

  // All matches with the iteration rules of the `onig` crate's find_iter:
  // after an empty match the search moves on by one character, and an empty
  // match found right after a non-empty one is skipped.
  template <class F>
  void for_each_match(std::string_view text, F&& on_match) const {
    std::size_t last_end = 0;
    bool skip_next_empty = false;
    while (last_end <= text.size()) {
      std::size_t s, e;
      if (!search(text, last_end, &s, &e)) break;
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

 private:
  std::shared_ptr<pcre2_code> code_;
  bool jit_ = false;
  bool properties_ = false;
};

constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---------------------------------------------------------------------------
// Added-token matching: a byte trie giving the longest token at a position.

class Trie {
 public:
  void clear() {
    nodes_.assign(1, Node{});
    first_.fill(false);
  }
  void insert(std::string_view s, std::int32_t value) {
    if (nodes_.empty()) clear();
    std::uint32_t n = 0;
    for (char ch : s) {
      const auto b = static_cast<unsigned char>(ch);
      auto& next = nodes_[n].next;
      auto it = std::find_if(next.begin(), next.end(), [b](const auto& e) { return e.first == b; });
      if (it == next.end()) {
        nodes_.push_back(Node{});
        nodes_[n].next.emplace_back(b, static_cast<std::uint32_t>(nodes_.size() - 1));
        n = static_cast<std::uint32_t>(nodes_.size() - 1);
      } else {
        n = it->second;
      }
    }
    nodes_[n].value = value;
    first_[static_cast<unsigned char>(s[0])] = true;
  }
  bool empty() const { return nodes_.size() <= 1; }
  bool can_start(unsigned char b) const { return first_[b]; }
  // Longest token starting at `pos`: its length and value, or length 0.
  std::size_t longest(std::string_view text, std::size_t pos, std::int32_t* value) const {
    std::uint32_t n = 0;
    std::size_t best = 0;
    for (std::size_t i = pos; i < text.size(); ++i) {
      const auto b = static_cast<unsigned char>(text[i]);
      const auto& next = nodes_[n].next;
      auto it = std::find_if(next.begin(), next.end(), [b](const auto& e) { return e.first == b; });
      if (it == next.end()) break;
      n = it->second;
      if (nodes_[n].value >= 0) {
        best = i + 1 - pos;
        *value = nodes_[n].value;
      }
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, std::uint32_t>> next;
    std::int32_t value = -1;
  };
  std::vector<Node> nodes_;
  std::array<bool, 256> first_{};
};

// Rust regex `\w` (Unicode word character) for single_word tokens.
bool is_rust_word_char(char32_t c) {
  static const Regex word("[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}]", "<built-in>", "word class");
  std::string s;
  append_utf8(s, c);
  std::size_t a, b;
  return word.search(s, 0, &a, &b);
}

// ---------------------------------------------------------------------------
// Pre-tokenizer split behaviours (SplitDelimiterBehavior), streaming.

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

template <class Emit>
class Combiner {
 public:
  Combiner(Behavior b, Emit& emit) : b_(b), emit_(emit) {}
  void push(std::size_t s, std::size_t e, bool is_match) {
    switch (b_) {
      case Behavior::kIsolated: out(s, e); break;
      case Behavior::kRemoved:
        if (!is_match) out(s, e);
        break;
      case Behavior::kContiguous:
        if (pending_ && is_match == prev_match_) {
          pe_ = e;
        } else {
          flush();
          start_pending(s, e);
        }
        prev_match_ = is_match;
        break;
      case Behavior::kMergedWithPrevious:
        if (pending_ && is_match && !prev_match_) {
          pe_ = e;
        } else {
          flush();
          start_pending(s, e);
        }
        prev_match_ = is_match;
        break;
      case Behavior::kMergedWithNext:
        // A match joins the segment right after it when that one is not a match.
        if (pending_) {
          if (!is_match) {
            out(ps_, e);
            pending_ = false;
            return;
          }
          flush();
        }
        if (is_match) start_pending(s, e);
        else out(s, e);
        break;
    }
  }
  void finish() { flush(); }

 private:
  void out(std::size_t s, std::size_t e) {
    if (e > s) emit_(s, e);
  }
  void start_pending(std::size_t s, std::size_t e) {
    pending_ = true;
    ps_ = s;
    pe_ = e;
  }
  void flush() {
    if (pending_) out(ps_, pe_);
    pending_ = false;
  }
  Behavior b_;
  Emit& emit_;
  bool pending_ = false;
  bool prev_match_ = false;
  std::size_t ps_ = 0, pe_ = 0;
};

struct SplitStage {
  enum class Kind { kRegex, kLiteral, kDigits } kind = Kind::kRegex;
  Regex regex;
  std::string literal;
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;

  // Segments covering `text`, each flagged as a match or not (Pattern::find_matches).
  template <class F>
  void segments(std::string_view text, F&& seg) const {
    if (kind == Kind::kDigits) {
      std::size_t last = 0;
      for (std::size_t i = 0; i < text.size();) {
        std::size_t len;
        const char32_t c = decode_at(text, i, &len);
        if (is_numeric(c)) {
          if (last < i) seg(last, i, false);
          seg(i, i + len, true);
          last = i + len;
        }
        i += len;
      }
      if (last < text.size()) seg(last, text.size(), false);
      return;
    }
    std::size_t prev = 0;
    auto on_match = [&](std::size_t s, std::size_t e) {
      if (prev != s) seg(prev, s, invert);
      seg(s, e, !invert);
      prev = e;
    };
    if (kind == Kind::kRegex) {
      regex.for_each_match(text, on_match);
    } else {
      for (std::size_t pos = text.find(literal); pos != std::string_view::npos;
           pos = text.find(literal, pos + literal.size()))
        on_match(pos, pos + literal.size());
    }
    if (prev != text.size()) seg(prev, text.size(), invert);
  }
};

// ---------------------------------------------------------------------------
// Per-thread word cache. Note [Word cache]: keyed by the model input of one
// pre-token; bounded per thread and per tokenizer instance (cleared when
// full), so concurrent tokenize() calls never share mutable state.

constexpr std::size_t kCacheCapacity = 1 << 15;
constexpr std::size_t kCacheMaxWordBytes = 256;

struct WordCache {
  std::uint64_t owner = 0;
  absl::flat_hash_map<std::string, std::vector<std::int32_t>> words;
};

WordCache& word_cache(std::uint64_t owner) {
  thread_local std::array<WordCache, 4> slots;
  thread_local std::size_t next = 0;
  for (auto& s : slots)
    if (s.owner == owner) return s;
  WordCache& s = slots[next++ % slots.size()];
  s.owner = owner;
  s.words.clear();
  return s;
}

std::atomic<std::uint64_t> g_next_instance{1};

}  // namespace

// ---------------------------------------------------------------------------

struct TokenizerJson::Impl {
  std::filesystem::path file;
  std::uint64_t instance_id = g_next_instance.fetch_add(1);

  // Normalizer: utf8proc option sets applied in order.
  std::vector<int> normalizers;

  // Pre-tokenizer: split stages, then (optionally, always last) ByteLevel.
  std::vector<SplitStage> stages;
  bool byte_level = false;
  bool byte_level_prefix_space = false;
  bool byte_level_use_regex = true;
  bool byte_level_top_level = false;
  Regex gpt2_regex;
  // Note [Unicode version]: set when a pre-tokenizer regex uses Unicode property classes.
  bool property_classes = false;
  bool only_gpt2_classes = false;  // ... and the only such regex is ByteLevel's (\p{L}, \p{N}, \s)

  // BPE model.
  absl::flat_hash_map<std::string, std::int32_t> vocab;
  std::vector<std::string> vocab_r;  // id -> token ("" when absent)
  std::vector<bool> vocab_r_present;
  absl::flat_hash_map<std::uint64_t, std::uint64_t> merges;  // (a << 32 | b) -> (rank << 32 | new id)
  std::optional<std::string> unk_token;
  std::string subword_prefix, word_suffix;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  std::array<std::int32_t, 256> byte_ids{};  // byte-level mode: id of each byte's character
  bool byte_fast = false;                    // every byte character is in the vocabulary, no prefix/suffix
  absl::flat_hash_map<std::string, std::int32_t> raw_vocab;  // byte-level mode + ignore_merges: raw bytes -> id

  // Added vocabulary.
  std::vector<std::pair<std::int64_t, AddedToken>> added;
  absl::flat_hash_map<std::string, std::size_t> added_by_content;  // -> index in `added`
  absl::flat_hash_map<std::int64_t, std::size_t> added_by_id;
  Trie raw_trie, normalized_trie;
  std::vector<std::string> normalized_patterns;  // normalized content per `added` index

  // Decoder.
  bool decoder_byte_level = false;

  // ---- loading ----
  void load(std::vector<std::int64_t>& prefix, std::vector<std::int64_t>& suffix, std::vector<std::string>& warnings);
  void parse_normalizer(const Json& j, dom::element el, const std::string& where);
  void parse_pre_tokenizer(const Json& j, dom::element el, const std::string& where, bool top_level);
  void parse_model(const Json& j, dom::element el);
  void parse_post_processor(const Json& j, dom::element el, const std::string& where,
                            std::vector<std::int64_t>& prefix, std::vector<std::int64_t>& suffix);
  void parse_decoder(const Json& j, dom::element el, const std::string& where);
  void finish_model();
  std::size_t add_tokens(std::span<const AddedToken> tokens);
  void rebuild_tries();

  // ---- encoding ----
  bool normalize(std::string_view in, std::string& out) const;
  void encode(std::string_view text, std::vector<std::int64_t>& out) const;
  void check_unicode_version(std::string_view text) const;
  void encode_normalizable(std::string_view segment, std::vector<std::int64_t>& out) const;
  template <class F>
  void split_added(std::string_view sentence, const Trie& trie, F&& on_split) const;
  void pre_tokenize(std::string_view piece, std::size_t stage, std::vector<std::int64_t>& out) const;
  void byte_level_stage(std::string_view piece, std::vector<std::int64_t>& out) const;
  void model(std::string_view word, std::vector<std::int64_t>& out) const;
  void tokenize_word(std::string_view word, std::vector<std::int32_t>& ids) const;
  void initial_symbols(std::string_view chars, std::vector<std::int32_t>& syms) const;
  void merge(std::vector<std::int32_t>& syms) const;
  void merge_heap(std::vector<std::int32_t>& syms) const;
  std::optional<std::int32_t> vocab_id(std::string_view s) const {
    auto it = vocab.find(key(s));
    if (it == vocab.end()) return std::nullopt;
    return it->second;
  }
};

// ---------------------------------------------------------------------------
// Loading

namespace {

// The `truncation` and `padding` blocks of tokenizer.json: transformers sets its own per call, so
// their values do not matter here, but `tokenizers` refuses a file whose blocks do not have its
// shape (serde: required fields, enum spellings, unsigned integers; extra keys are ignored), and
// so do we.
void check_padding_and_truncation(const Json& j, dom::element root) {
  const auto unsigned_at = [&](dom::element obj, std::string_view key, std::string_view where, std::uint64_t max) {
    const dom::element v = j.member(obj, key, where);
    std::uint64_t u = 0;
    if (v.type() == dom::element_type::DOUBLE || v.get_uint64().get(u) != simdjson::SUCCESS || u > max)
      fail(j.file, fmt::format("{}.{}", where, key),
           fmt::format("expected an unsigned integer{}", max < UINT64_MAX ? " below 2^32" : ""));
  };
  const auto one_of = [&](dom::element v, std::string_view where, std::initializer_list<std::string_view> allowed) {
    std::string_view s;
    if (v.get_string().get(s) != simdjson::SUCCESS ||
        std::find(allowed.begin(), allowed.end(), s) == allowed.end())
      fail(j.file, where, fmt::format("expected one of {}", fmt::join(allowed, ", ")));
  };
  if (auto t = j.optional_member(root, "truncation")) {
    if (t->type() != dom::element_type::OBJECT) fail(j.file, "truncation", "expected null or an object");
    unsigned_at(*t, "max_length", "truncation", UINT64_MAX);
    unsigned_at(*t, "stride", "truncation", UINT64_MAX);
    one_of(j.member(*t, "strategy", "truncation"), "truncation.strategy", {"LongestFirst", "OnlyFirst", "OnlySecond"});
    if (dom::element d; t->at_key("direction").get(d) == simdjson::SUCCESS)
      one_of(d, "truncation.direction", {"Left", "Right"});
  }
  if (auto p = j.optional_member(root, "padding")) {
    if (p->type() != dom::element_type::OBJECT) fail(j.file, "padding", "expected null or an object");
    const dom::element strategy = j.member(*p, "strategy", "padding");
    if (strategy.type() == dom::element_type::STRING) {
      one_of(strategy, "padding.strategy", {"BatchLongest"});
    } else {
      dom::object o;
      if (strategy.get_object().get(o) != simdjson::SUCCESS || o.size() != 1)
        fail(j.file, "padding.strategy", "expected \"BatchLongest\" or {\"Fixed\": <length>}");
      if (dom::element fixed; o.at_key("Fixed").get(fixed) == simdjson::SUCCESS)
        unsigned_at(strategy, "Fixed", "padding.strategy", UINT64_MAX);
      else if (dom::element bl; o.at_key("BatchLongest").get(bl) != simdjson::SUCCESS || !bl.is_null())
        fail(j.file, "padding.strategy", "expected \"BatchLongest\" or {\"Fixed\": <length>}");
    }
    one_of(j.member(*p, "direction", "padding"), "padding.direction", {"Left", "Right"});
    unsigned_at(*p, "pad_id", "padding", UINT32_MAX);
    unsigned_at(*p, "pad_type_id", "padding", UINT32_MAX);
    j.string(j.member(*p, "pad_token", "padding"), "padding.pad_token");
    if (auto m = j.optional_member(*p, "pad_to_multiple_of")) unsigned_at(*p, "pad_to_multiple_of", "padding", UINT64_MAX);
  }
}

}  // namespace

void TokenizerJson::Impl::load(std::vector<std::int64_t>& prefix, std::vector<std::int64_t>& suffix,
                               std::vector<std::string>& warnings) {
  dom::parser parser;
  dom::element root;
  if (auto err = parser.load(file.string()).get(root); err != simdjson::SUCCESS) {
    if (err == simdjson::IO_ERROR) fail(file, "tokenizer.json", "cannot be read");
    fail(file, "tokenizer.json", fmt::format("malformed JSON ({})", simdjson::error_message(err)));
  }
  const Json j{file};
  if (root.type() != dom::element_type::OBJECT) fail(file, "tokenizer.json", "expected a JSON object at the top level");
  if (auto v = j.optional_member(root, "version"); v && j.string(*v, "version") != "1.0")
    fail(file, "version", fmt::format("unknown tokenizer version '{}' (expected \"1.0\")", j.string(*v, "version")));

  parse_model(j, j.member(root, "model", "tokenizer.json"));
  check_padding_and_truncation(j, root);
  if (auto n = j.optional_member(root, "normalizer")) parse_normalizer(j, *n, "normalizer");
  if (auto p = j.optional_member(root, "pre_tokenizer")) parse_pre_tokenizer(j, *p, "pre_tokenizer", true);
  finish_model();
  if (auto d = j.optional_member(root, "decoder")) parse_decoder(j, *d, "decoder");

  // Added tokens: the library re-adds them in file order; ids come from add_tokens.
  std::vector<AddedToken> tokens;
  std::vector<std::int64_t> file_ids;
  if (auto a = j.optional_member(root, "added_tokens")) {
    std::size_t k = 0;
    for (dom::element t : j.array(*a, "added_tokens")) {
      const std::string w = fmt::format("added_tokens[{}]", k++);
      AddedToken tok;
      tok.content = j.string(j.member(t, "content", w), w + ".content");
      tok.single_word = j.flag(t, "single_word", false, w);
      tok.lstrip = j.flag(t, "lstrip", false, w);
      tok.rstrip = j.flag(t, "rstrip", false, w);
      tok.normalized = j.flag(t, "normalized", true, w);
      tok.special = j.flag(t, "special", false, w);
      file_ids.push_back(j.integer(j.member(t, "id", w), w + ".id"));
      tokens.push_back(std::move(tok));
    }
  }
  add_tokens(tokens);
  for (std::size_t k = 0; k < tokens.size(); ++k) {
    auto it = added_by_content.find(tokens[k].content);
    if (it != added_by_content.end() && added[it->second].first != file_ids[k])
      warnings.push_back(fmt::format("{}: added token '{}' has id {} in the file but gets id {} (as in `tokenizers`)",
                                     file.string(), tokens[k].content, file_ids[k], added[it->second].first));
  }

  if (auto p = j.optional_member(root, "post_processor")) parse_post_processor(j, *p, "post_processor", prefix, suffix);
}

void TokenizerJson::Impl::parse_normalizer(const Json& j, dom::element el, const std::string& where) {
  const std::string type = j.type_of(el, where);
  if (type == "NFC") normalizers.push_back(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
  else if (type == "NFD") normalizers.push_back(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
  else if (type == "NFKC") normalizers.push_back(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
  else if (type == "NFKD") normalizers.push_back(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  else if (type == "Sequence") {
    std::size_t k = 0;
    for (dom::element n : j.array(j.member(el, "normalizers", where), where + ".normalizers"))
      parse_normalizer(j, n, fmt::format("{}.normalizers[{}]", where, k++));
  } else {
    unsupported(file, where, "normalizer", type, "NFC, NFD, NFKC, NFKD and a Sequence of them");
  }
}

void TokenizerJson::Impl::parse_pre_tokenizer(const Json& j, dom::element el, const std::string& where,
                                              bool top_level) {
  const std::string type = j.type_of(el, where);
  if (byte_level)
    fail(file, where, fmt::format("pre-tokenizer '{}' after ByteLevel is not supported (ByteLevel must come last)", type));
  if (type == "Sequence") {
    std::size_t k = 0;
    for (dom::element p : j.array(j.member(el, "pretokenizers", where), where + ".pretokenizers"))
      parse_pre_tokenizer(j, p, fmt::format("{}.pretokenizers[{}]", where, k++), false);
  } else if (type == "ByteLevel") {
    byte_level = true;
    byte_level_prefix_space = j.flag(el, "add_prefix_space", true, where);
    byte_level_use_regex = j.flag(el, "use_regex", true, where);
    byte_level_top_level = top_level;
    if (byte_level_use_regex) gpt2_regex = Regex(std::string(kGpt2Pattern), file, where);
  } else if (type == "Split") {
    SplitStage s;
    const dom::element pattern = j.member(el, "pattern", where);
    if (auto r = j.optional_member(pattern, "Regex")) {
      s.kind = SplitStage::Kind::kRegex;
      s.regex = Regex(j.string(*r, where + ".pattern.Regex"), file, where + ".pattern.Regex");
    } else if (auto l = j.optional_member(pattern, "String")) {
      s.kind = SplitStage::Kind::kLiteral;
      s.literal = j.string(*l, where + ".pattern.String");
      if (s.literal.empty()) fail(file, where + ".pattern.String", "an empty split string is not supported");
    } else {
      fail(file, where + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    }
    const std::string behavior = j.string(j.member(el, "behavior", where), where + ".behavior");
    if (behavior == "Removed") s.behavior = Behavior::kRemoved;
    else if (behavior == "Isolated") s.behavior = Behavior::kIsolated;
    else if (behavior == "MergedWithPrevious") s.behavior = Behavior::kMergedWithPrevious;
    else if (behavior == "MergedWithNext") s.behavior = Behavior::kMergedWithNext;
    else if (behavior == "Contiguous") s.behavior = Behavior::kContiguous;
    else fail(file, where + ".behavior", fmt::format("unknown split behavior '{}'", behavior));
    s.invert = j.flag(el, "invert", false, where);
    stages.push_back(std::move(s));
  } else if (type == "Digits") {
    SplitStage s;
    s.kind = SplitStage::Kind::kDigits;
    s.behavior = j.flag(el, "individual_digits", false, where) ? Behavior::kIsolated : Behavior::kContiguous;
    stages.push_back(std::move(s));
  } else {
    unsupported(file, where, "pre-tokenizer", type, "ByteLevel, Split, Digits and a Sequence of them");
  }
}

void TokenizerJson::Impl::parse_model(const Json& j, dom::element el) {
  std::string type;
  if (auto t = j.optional_member(el, "type")) type = j.string(*t, "model.type");
  else if (j.optional_member(el, "merges")) type = "BPE";  // old serialisation without "type"
  else fail(file, "model", "has no 'type' (and no 'merges', so it is not a BPE model)");
  if (type != "BPE")
    unsupported(file, "model.type", "model", type, "BPE (byte-level BPE as in GPT-2, Llama-3, Qwen2)");

  if (auto d = j.optional_member(el, "dropout")) {
    double p = 0;
    if (d->get_double().get(p) != simdjson::SUCCESS) fail(file, "model.dropout", "expected a number or null");
    if (p != 0.0) fail(file, "model.dropout", fmt::format("BPE dropout {} is not supported (must be null)", p));
  }
  if (auto u = j.optional_member(el, "unk_token")) unk_token = j.string(*u, "model.unk_token");
  if (auto p = j.optional_member(el, "continuing_subword_prefix")) subword_prefix = j.string(*p, "model.continuing_subword_prefix");
  if (auto s = j.optional_member(el, "end_of_word_suffix")) word_suffix = j.string(*s, "model.end_of_word_suffix");
  fuse_unk = j.flag(el, "fuse_unk", false, "model");
  byte_fallback = j.flag(el, "byte_fallback", false, "model");
  ignore_merges = j.flag(el, "ignore_merges", false, "model");

  std::int64_t max_id = -1;
  for (auto field : j.object(j.member(el, "vocab", "model"), "model.vocab")) {
    const std::int64_t id = j.integer(field.value, fmt::format("model.vocab[\"{}\"]", field.key));
    if (id < 0 || id >= (1 << 26)) fail(file, fmt::format("model.vocab[\"{}\"]", field.key), fmt::format("id {} out of range [0, 2^26)", id));
    vocab.insert_or_assign(std::string(field.key), static_cast<std::int32_t>(id));
    max_id = std::max(max_id, id);
  }
  vocab_r.assign(static_cast<std::size_t>(max_id + 1), std::string());
  vocab_r_present.assign(static_cast<std::size_t>(max_id + 1), false);
  for (const auto& [token, id] : vocab) {
    vocab_r[id] = token;
    vocab_r_present[id] = true;
  }

  // Merges: ["a b", ...] (legacy) or [["a", "b"], ...]; a later duplicate pair wins, as in the library.
  std::size_t rank = 0;
  std::string merged;
  for (dom::element m : j.array(j.member(el, "merges", "model"), "model.merges")) {
    const std::string w = fmt::format("model.merges[{}]", rank);
    std::string a, b;
    if (m.is_string()) {
      const std::string line = j.string(m, w);
      if (line.starts_with("#version")) continue;
      const std::size_t sp = line.find(' ');
      if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos)
        fail(file, w, fmt::format("merge '{}' is not two tokens separated by one space", line));
      a = line.substr(0, sp);
      b = line.substr(sp + 1);
    } else {
      dom::array pair = j.array(m, w);
      if (pair.size() != 2) fail(file, w, "expected a pair of strings");
      a = j.string(pair.at(0).value_unsafe(), w + "[0]");
      b = j.string(pair.at(1).value_unsafe(), w + "[1]");
    }
    const auto ia = vocab_id(a), ib = vocab_id(b);
    if (!ia) fail(file, w, fmt::format("merge token '{}' is not in the vocabulary", a));
    if (!ib) fail(file, w, fmt::format("merge token '{}' is not in the vocabulary", b));
    if (b.size() < subword_prefix.size()) fail(file, w, fmt::format("merge token '{}' lacks the subword prefix", b));
    merged = a;
    merged.append(b, subword_prefix.size());
    const auto in = vocab_id(merged);
    if (!in) fail(file, w, fmt::format("merged token '{}' is not in the vocabulary", merged));
    merges.insert_or_assign((static_cast<std::uint64_t>(*ia) << 32) | static_cast<std::uint32_t>(*ib),
                            (static_cast<std::uint64_t>(rank) << 32) | static_cast<std::uint32_t>(*in));
    ++rank;
  }
  if (unk_token && !vocab.contains(*unk_token))
    fail(file, "model.unk_token", fmt::format("unk token '{}' is not in the vocabulary", *unk_token));
}

void TokenizerJson::Impl::finish_model() {
  bool split_properties = false;
  for (const SplitStage& st : stages) split_properties = split_properties || st.regex.uses_properties();
  const bool gpt2_properties = byte_level && byte_level_use_regex;
  property_classes = split_properties || gpt2_properties;
  only_gpt2_classes = gpt2_properties && !split_properties;
  if (!byte_level) return;
  const auto& abc = alphabet();
  byte_fast = subword_prefix.empty() && word_suffix.empty();
  for (int b = 0; b < 256; ++b) {
    const auto id = vocab_id(abc.byte_to_utf8[b]);
    byte_ids[b] = id ? *id : -1;
    if (!id) byte_fast = false;
  }
  if (ignore_merges)
    for (const auto& [token, id] : vocab)
      if (auto raw = abc.to_bytes(token)) raw_vocab.emplace(std::move(*raw), id);
}

void TokenizerJson::Impl::parse_post_processor(const Json& j, dom::element el, const std::string& where,
                                               std::vector<std::int64_t>& prefix, std::vector<std::int64_t>& suffix) {
  const std::string type = j.type_of(el, where);
  std::vector<std::int64_t> before, after;
  if (type == "ByteLevel") {
    return;  // offsets only
  } else if (type == "Sequence") {
    std::size_t k = 0;
    for (dom::element p : j.array(j.member(el, "processors", where), where + ".processors"))
      parse_post_processor(j, p, fmt::format("{}.processors[{}]", where, k++), prefix, suffix);
    return;
  } else if (type == "TemplateProcessing") {
    const dom::object specials = j.object(j.member(el, "special_tokens", where), where + ".special_tokens");
    bool seen_a = false;
    std::size_t k = 0;
    for (dom::element item : j.array(j.member(el, "single", where), where + ".single")) {
      const std::string w = fmt::format("{}.single[{}]", where, k++);
      if (auto seq = j.optional_member(item, "Sequence")) {
        const std::string id = j.string(j.member(*seq, "id", w), w + ".Sequence.id");
        if (id != "A" || seen_a) fail(file, w, "a single-sequence template must contain sequence A exactly once");
        seen_a = true;
      } else if (auto sp = j.optional_member(item, "SpecialToken")) {
        const std::string name = j.string(j.member(*sp, "id", w), w + ".SpecialToken.id");
        dom::element def;
        if (specials.at_key(name).get(def) != simdjson::SUCCESS)
          fail(file, w, fmt::format("special token '{}' is missing from {}.special_tokens", name, where));
        for (dom::element id : j.array(j.member(def, "ids", where), fmt::format("{}.special_tokens.{}.ids", where, name)))
          (seen_a ? after : before).push_back(j.integer(id, fmt::format("{}.special_tokens.{}.ids", where, name)));
      } else {
        fail(file, w, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
    if (!seen_a) fail(file, where + ".single", "the template has no sequence A");
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    for (const char* key : {"cls", "sep"}) {
      dom::array pair = j.array(j.member(el, key, where), fmt::format("{}.{}", where, key));
      if (pair.size() != 2) fail(file, fmt::format("{}.{}", where, key), "expected [token, id]");
      (std::string_view(key) == "cls" ? before : after)
          .push_back(j.integer(pair.at(1).value_unsafe(), fmt::format("{}.{}[1]", where, key)));
    }
  } else {
    unsupported(file, where, "post-processor", type,
                "ByteLevel, TemplateProcessing, RobertaProcessing, BertProcessing and a Sequence of them");
  }
  prefix.insert(prefix.begin(), before.begin(), before.end());
  suffix.insert(suffix.end(), after.begin(), after.end());
}

void TokenizerJson::Impl::parse_decoder(const Json& j, dom::element el, const std::string& where) {
  const std::string type = j.type_of(el, where);
  if (type == "ByteLevel") {
    decoder_byte_level = true;
  } else if (type == "Sequence") {
    dom::array list = j.array(j.member(el, "decoders", where), where + ".decoders");
    if (list.size() != 1) unsupported(file, where, "decoder sequence of", fmt::format("{} decoders", list.size()), "a single ByteLevel");
    parse_decoder(j, list.at(0).value_unsafe(), where + ".decoders[0]");
  } else {
    unsupported(file, where, "decoder", type, "ByteLevel");
  }
}

std::size_t TokenizerJson::Impl::add_tokens(std::span<const AddedToken> tokens) {
  const auto model_size = static_cast<std::int64_t>(vocab.size());
  std::int64_t next_id = model_size;
  if (!added.empty()) {
    std::int64_t max_id = 0;
    for (const auto& [id, t] : added) max_id = std::max(max_id, id);
    next_id = (max_id >= model_size || model_size == 0) ? max_id + 1 : model_size;
  }
  std::size_t changed = 0;
  for (const AddedToken& t : tokens) {
    if (t.content.empty()) continue;
    if (auto it = added_by_content.find(t.content); it != added_by_content.end()) {
      if (added[it->second].second == t) continue;
    }
    std::int64_t id;
    if (auto it = added_by_content.find(t.content); it != added_by_content.end()) id = added[it->second].first;
    else if (auto v = vocab_id(t.content)) id = *v;
    else id = next_id++;
    if (auto it = added_by_id.find(id); it != added_by_id.end()) {
      added_by_content.erase(added[it->second].second.content);  // the id now names this content
      added[it->second].second = t;
      added_by_content[t.content] = it->second;
    } else {
      added.emplace_back(id, t);
      added_by_id[id] = added.size() - 1;
      added_by_content[t.content] = added.size() - 1;
    }
    ++changed;
  }
  rebuild_tries();
  return changed;
}

void TokenizerJson::Impl::rebuild_tries() {
  raw_trie.clear();
  normalized_trie.clear();
  normalized_patterns.assign(added.size(), std::string());
  // Insert in id order so that, as in the library, the later id wins if two patterns coincide.
  std::vector<std::size_t> order(added.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return added[a].first < added[b].first; });
  for (std::size_t i : order) {
    const AddedToken& t = added[i].second;
    if (t.normalized) {
      if (!normalize(t.content, normalized_patterns[i])) normalized_patterns[i] = t.content;
      if (!normalized_patterns[i].empty()) normalized_trie.insert(normalized_patterns[i], static_cast<std::int32_t>(i));
    } else {
      raw_trie.insert(t.content, static_cast<std::int32_t>(i));
    }
  }
}

// ---------------------------------------------------------------------------
// Encoding

// Applies the normalizers; returns false when `in` is unchanged (then `out` is not written).
bool TokenizerJson::Impl::normalize(std::string_view in, std::string& out) const {
  bool changed = false;
  std::string next;
  for (int options : normalizers) {
    if (normalize_form(changed ? std::string_view(out) : in, options, next)) {
      out.swap(next);
      changed = true;
    }
  }
  return changed;
}

// AddedVocabulary::find_matches: leftmost-longest tokens, then the
// single_word / lstrip / rstrip rules. Calls on_split(begin, end, index)
// for every piece (index < 0 when it is not an added token).
template <class F>
void TokenizerJson::Impl::split_added(std::string_view s, const Trie& trie, F&& on_split) const {
  if (trie.empty()) {
    on_split(0, s.size(), -1);
    return;
  }
  std::size_t start_offset = 0;
  for (std::size_t pos = 0; pos < s.size();) {
    if (!trie.can_start(static_cast<unsigned char>(s[pos]))) {
      ++pos;
      continue;
    }
    std::int32_t index = -1;
    const std::size_t len = trie.longest(s, pos, &index);
    if (len == 0) {
      ++pos;
      continue;
    }
    std::size_t start = pos, stop = pos + len;
    pos = stop;  // the match is consumed even if the rules below discard it
    const AddedToken& t = added[index].second;
    if (t.single_word) {
      std::size_t l;
      const bool start_space = start == 0 || !is_rust_word_char(decode_at(s, last_char_start(s.substr(0, start)), &l));
      const bool stop_space = stop == s.size() || !is_rust_word_char(decode_at(s, stop, &l));
      if (!start_space || !stop_space) continue;
    }
    if (t.lstrip) {
      std::size_t new_start = start;
      while (new_start > 0) {
        std::size_t l;
        const std::size_t p = last_char_start(s.substr(0, new_start));
        if (!is_white_space(decode_at(s, p, &l))) break;
        new_start = p;
      }
      start = std::max(new_start, start_offset);
    }
    if (t.rstrip) {
      while (stop < s.size()) {
        std::size_t l;
        if (!is_white_space(decode_at(s, stop, &l))) break;
        stop += l;
      }
    }
    if (start_offset < start) on_split(start_offset, start, -1);
    on_split(start, stop, index);
    start_offset = stop;
  }
  if (start_offset != s.size()) on_split(start_offset, s.size(), -1);
}

// Note [Unicode version]: PCRE2's tables (Debian 12: PCRE2 10.42, Unicode 14.0) are older than
// those of Hugging Face's tokenizers, so a code point assigned in a later Unicode version (new
// emoji such as U+1FAE8, new scripts) falls outside every \p{..} class here but inside one there:
// a regex like [\p{P}\p{S}] splits such text differently and the document would silently get
// other token ids. Until the tables match, such a document is refused. For ByteLevel's own
// pattern (\p{L}, \p{N}, \s) a code point that utf8proc (Unicode 15.0) knows to be neither a
// letter, a number nor a separator splits exactly as an unassigned one, so that case is allowed.
void TokenizerJson::Impl::check_unicode_version(std::string_view text) const {
  static const Regex unassigned("\\p{Cn}", "<built-in>", "unassigned code points");
  std::size_t from = 0, start = 0, end = 0;
  while (unassigned.search(text, from, &start, &end)) {
    std::size_t len = 0;
    const char32_t cp = decode_at(text, start, &len);
    from = start + len;
    const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
    const bool letter_number_or_separator =
        (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
        (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO) ||
        (cat >= UTF8PROC_CATEGORY_ZS && cat <= UTF8PROC_CATEGORY_ZP);
    if (only_gpt2_classes && cat != UTF8PROC_CATEGORY_CN && !letter_number_or_separator) continue;
    char unicode[24] = "?";
    pcre2_config(PCRE2_CONFIG_UNICODE_VERSION, unicode);
    throw Error(fmt::format(
        "text contains U+{:04X} (at byte {}), which the Unicode {} tables of this build's regex engine do not "
        "assign; Hugging Face's tokenizers know newer Unicode and may split it differently with this tokenizer's "
        "\\p{{..}} pre-tokenizer classes, so the document is refused rather than given different token ids "
        "(remove the character, or set skip_invalid_documents)",
        static_cast<std::uint32_t>(cp), start, unicode));
  }
}

void TokenizerJson::Impl::encode(std::string_view text, std::vector<std::int64_t>& out) const {
  if (!simdjson::validate_utf8(text.data(), text.size())) {
    const std::string fixed = utf8_lossy(text);
    std::size_t bad = 0;
    while (bad < text.size() && text[bad] == fixed[bad]) ++bad;
    throw Error(fmt::format("text is not valid UTF-8 (first bad byte at offset {} of {})", bad, text.size()));
  }
  if (property_classes) check_unicode_version(text);
  split_added(text, raw_trie, [&](std::size_t b, std::size_t e, std::int32_t index) {
    if (index >= 0) out.push_back(added[index].first);
    else if (e > b) encode_normalizable(text.substr(b, e - b), out);
  });
}

void TokenizerJson::Impl::encode_normalizable(std::string_view segment, std::vector<std::int64_t>& out) const {
  std::string normalized;
  std::string_view view = segment;
  if (!normalizers.empty() && normalize(segment, normalized)) view = normalized;
  split_added(view, normalized_trie, [&](std::size_t b, std::size_t e, std::int32_t index) {
    if (index >= 0) out.push_back(added[index].first);
    else if (e > b) pre_tokenize(view.substr(b, e - b), 0, out);
  });
}

void TokenizerJson::Impl::pre_tokenize(std::string_view piece, std::size_t stage, std::vector<std::int64_t>& out) const {
  if (stage == stages.size()) {
    if (byte_level) byte_level_stage(piece, out);
    else model(piece, out);
    return;
  }
  auto emit = [&](std::size_t b, std::size_t e) { pre_tokenize(piece.substr(b, e - b), stage + 1, out); };
  Combiner<decltype(emit)> combiner(stages[stage].behavior, emit);
  stages[stage].segments(piece, [&](std::size_t b, std::size_t e, bool m) { combiner.push(b, e, m); });
  combiner.finish();
}

void TokenizerJson::Impl::byte_level_stage(std::string_view piece, std::vector<std::int64_t>& out) const {
  std::string prefixed;
  std::string_view view = piece;
  if (byte_level_prefix_space && !piece.starts_with(' ')) {
    prefixed.reserve(piece.size() + 1);
    prefixed += ' ';
    prefixed += piece;
    view = prefixed;
  }
  if (!byte_level_use_regex) {
    model(view, out);
    return;
  }
  std::size_t prev = 0;
  gpt2_regex.for_each_match(view, [&](std::size_t s, std::size_t e) {
    if (prev != s) model(view.substr(prev, s - prev), out);
    if (e > s) model(view.substr(s, e - s), out);
    prev = e;
  });
  if (prev < view.size()) model(view.substr(prev), out);
}

void TokenizerJson::Impl::model(std::string_view word, std::vector<std::int64_t>& out) const {
  if (word.empty()) return;
  if (word.size() >= kCacheMaxWordBytes) {
    thread_local std::vector<std::int32_t> ids;
    ids.clear();
    tokenize_word(word, ids);
    out.insert(out.end(), ids.begin(), ids.end());
    return;
  }
  WordCache& cache = word_cache(instance_id);
  if (auto it = cache.words.find(key(word)); it != cache.words.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  std::vector<std::int32_t> ids;
  tokenize_word(word, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cache.words.size() >= kCacheCapacity) cache.words.clear();
  cache.words.emplace(std::string(word), std::move(ids));
}

// One pre-token through the BPE model. In byte-level mode `word` holds raw
// bytes; the vocabulary is keyed by their byte-level characters.
void TokenizerJson::Impl::tokenize_word(std::string_view word, std::vector<std::int32_t>& ids) const {
  if (byte_level) {
    if (ignore_merges) {
      if (auto it = raw_vocab.find(key(word)); it != raw_vocab.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    if (byte_fast) {
      ids.reserve(word.size());
      for (char c : word) ids.push_back(byte_ids[static_cast<unsigned char>(c)]);
    } else {
      std::string chars;
      for (char c : word) chars += alphabet().byte_to_utf8[static_cast<unsigned char>(c)];
      initial_symbols(chars, ids);
    }
  } else {
    if (ignore_merges) {
      if (auto id = vocab_id(word)) {
        ids.push_back(*id);
        return;
      }
    }
    initial_symbols(word, ids);
  }
  merge(ids);
}

// BPE::merge_word before merging: one symbol per character (with the subword
// prefix / word suffix), byte fallback, and unknown-token handling.
void TokenizerJson::Impl::initial_symbols(std::string_view w, std::vector<std::int32_t>& syms) const {
  std::optional<std::int32_t> unk;  // a pending unknown symbol
  std::string s;
  for (std::size_t i = 0; i < w.size();) {
    const std::size_t len = utf8_len(static_cast<unsigned char>(w[i]));
    const bool is_first = i == 0, is_last = i + len >= w.size();
    s.clear();
    if (!is_first) s += subword_prefix;
    s.append(w.substr(i, len));
    if (is_last) s += word_suffix;
    i += len;
    if (auto id = vocab_id(s)) {
      if (unk) syms.push_back(*unk);
      unk.reset();
      syms.push_back(*id);
      continue;
    }
    if (byte_fallback) {
      std::vector<std::int32_t> bytes;
      for (char c : s) {
        auto id = vocab_id(fmt::format("<0x{:02X}>", static_cast<unsigned char>(c)));
        if (!id) {
          bytes.clear();
          break;
        }
        bytes.push_back(*id);
      }
      if (!bytes.empty()) {
        syms.insert(syms.end(), bytes.begin(), bytes.end());  // a pending unk stays pending, as in the library
        continue;
      }
    }
    if (unk_token) {
      const std::int32_t unk_id = *vocab_id(*unk_token);
      if (unk && !fuse_unk) syms.push_back(*unk);
      if (!unk || !fuse_unk) unk = unk_id;
    }
  }
  if (unk) syms.push_back(*unk);
}

// Merges the lowest-ranked adjacent pair, leftmost first, until none is left
// (Word::merge_all without dropout). Short words use a rank array scan; long
// ones a heap over a linked list (same order, fewer rescans).
void TokenizerJson::Impl::merge(std::vector<std::int32_t>& syms) const {
  if (syms.size() < 2) return;
  if (syms.size() > 48) {
    merge_heap(syms);
    return;
  }
  constexpr std::uint64_t kNone = std::numeric_limits<std::uint64_t>::max();
  std::array<std::uint64_t, 48> ranks;  // (rank << 32 | new id) of pair (i, i + 1)
  std::size_t n = syms.size();
  auto lookup = [&](std::int32_t a, std::int32_t b) {
    auto it = merges.find((static_cast<std::uint64_t>(a) << 32) | static_cast<std::uint32_t>(b));
    return it == merges.end() ? kNone : it->second;
  };
  for (std::size_t i = 0; i + 1 < n; ++i) ranks[i] = lookup(syms[i], syms[i + 1]);
  while (n > 1) {
    std::size_t best = 0;
    for (std::size_t i = 1; i + 1 < n; ++i)
      if ((ranks[i] >> 32) < (ranks[best] >> 32)) best = i;
    if (ranks[best] == kNone) break;
    syms[best] = static_cast<std::int32_t>(ranks[best] & 0xFFFFFFFFu);
    for (std::size_t i = best + 1; i + 1 < n; ++i) syms[i] = syms[i + 1];
    for (std::size_t i = best + 1; i + 2 < n; ++i) ranks[i] = ranks[i + 1];
    --n;
    if (best > 0) ranks[best - 1] = lookup(syms[best - 1], syms[best]);
    if (best + 1 < n) ranks[best] = lookup(syms[best], syms[best + 1]);
  }
  syms.resize(n);
}

void TokenizerJson::Impl::merge_heap(std::vector<std::int32_t>& syms) const {
  struct Sym {
    std::int32_t id;
    std::int64_t prev, next;
    bool alive;
  };
  struct Cand {
    std::uint32_t rank;
    std::size_t pos;
    std::int32_t new_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  const std::size_t n = syms.size();
  std::vector<Sym> s(n);
  for (std::size_t i = 0; i < n; ++i)
    s[i] = {syms[i], static_cast<std::int64_t>(i) - 1, i + 1 < n ? static_cast<std::int64_t>(i + 1) : -1, true};
  std::priority_queue<Cand, std::vector<Cand>, std::greater<>> queue;
  auto push = [&](std::size_t pos) {
    if (s[pos].next < 0) return;
    auto it = merges.find((static_cast<std::uint64_t>(s[pos].id) << 32) | static_cast<std::uint32_t>(s[s[pos].next].id));
    if (it != merges.end())
      queue.push({static_cast<std::uint32_t>(it->second >> 32), pos, static_cast<std::int32_t>(it->second & 0xFFFFFFFFu)});
  };
  for (std::size_t i = 0; i + 1 < n; ++i) push(i);
  while (!queue.empty()) {
    const Cand top = queue.top();
    queue.pop();
    Sym& left = s[top.pos];
    if (!left.alive || left.next < 0) continue;
    Sym& right = s[left.next];
    auto it = merges.find((static_cast<std::uint64_t>(left.id) << 32) | static_cast<std::uint32_t>(right.id));
    if (it == merges.end() || static_cast<std::int32_t>(it->second & 0xFFFFFFFFu) != top.new_id) continue;  // stale
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) s[right.next].prev = static_cast<std::int64_t>(top.pos);
    if (left.prev >= 0) push(static_cast<std::size_t>(left.prev));
    push(top.pos);
  }
  syms.clear();
  for (const Sym& x : s)
    if (x.alive) syms.push_back(x.id);
}

// ---------------------------------------------------------------------------

TokenizerJson::TokenizerJson(const std::filesystem::path& file) : impl_(std::make_unique<Impl>()), file_(file) {
  impl_->file = file;
  impl_->load(prefix_, suffix_, warnings_);
}

TokenizerJson::~TokenizerJson() = default;

std::size_t TokenizerJson::add_tokens(std::span<const AddedToken> tokens) { return impl_->add_tokens(tokens); }

bool TokenizerJson::set_top_level_add_prefix_space(bool value) {
  if (!impl_->byte_level || !impl_->byte_level_top_level) return false;
  impl_->byte_level_prefix_space = value;
  return true;
}

bool TokenizerJson::top_level_add_prefix_space() const {
  return impl_->byte_level && impl_->byte_level_top_level && impl_->byte_level_prefix_space;
}

void TokenizerJson::encode_sequence(std::string_view text, std::vector<std::int64_t>& out) const {
  impl_->encode(text, out);
}

std::vector<std::int64_t> TokenizerJson::encode(std::string_view text) const {
  std::vector<std::int64_t> out(prefix_.begin(), prefix_.end());
  out.reserve(text.size() / 3 + prefix_.size() + suffix_.size() + 4);
  impl_->encode(text, out);
  out.insert(out.end(), suffix_.begin(), suffix_.end());
  return out;
}

std::optional<std::string> TokenizerJson::id_to_token(std::int64_t id) const {
  if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end()) return impl_->added[it->second].second.content;
  if (id >= 0 && static_cast<std::size_t>(id) < impl_->vocab_r.size() && impl_->vocab_r_present[id])
    return impl_->vocab_r[id];
  return std::nullopt;
}

std::string TokenizerJson::decode(std::span<const std::int64_t> ids) const {
  std::string out;
  const auto& abc = alphabet();
  for (std::size_t k = 0; k < ids.size(); ++k) {
    const std::int64_t id = ids[k];
    const std::string* token = nullptr;
    if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end()) token = &impl_->added[it->second].second.content;
    else if (id >= 0 && static_cast<std::size_t>(id) < impl_->vocab_r.size() && impl_->vocab_r_present[id])
      token = &impl_->vocab_r[id];
    if (token == nullptr)
      throw Error(fmt::format("decode: id {} (position {}) is not in the vocabulary of {}", id, k, file_.string()));
    if (impl_->decoder_byte_level) {
      if (auto raw = abc.to_bytes(*token)) out += *raw;
      else out += *token;
    } else {
      if (k > 0) out += ' ';
      out += *token;
    }
  }
  return impl_->decoder_byte_level ? utf8_lossy(out) : out;
}

std::optional<std::int64_t> TokenizerJson::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(key(token)); it != impl_->added_by_content.end())
    return impl_->added[it->second].first;
  if (auto id = impl_->vocab_id(token)) return *id;
  return std::nullopt;
}

std::size_t TokenizerJson::model_vocab_size() const { return impl_->vocab.size(); }

std::size_t TokenizerJson::full_vocab_size() const {
  std::size_t n = impl_->vocab.size();
  for (const auto& [id, t] : impl_->added)
    if (!impl_->vocab.contains(t.content)) ++n;
  return n;
}

const std::vector<std::pair<std::int64_t, AddedToken>>& TokenizerJson::added_tokens() const { return impl_->added; }

std::optional<std::string> TokenizerJson::unk_token() const { return impl_->unk_token; }

std::vector<std::pair<std::size_t, std::size_t>> regex_matches(const std::string& pattern, std::string_view text) {
  const Regex re(pattern, "<pattern>", "regex_matches");
  std::vector<std::pair<std::size_t, std::size_t>> out;
  re.for_each_match(text, [&](std::size_t b, std::size_t e) { out.emplace_back(b, e); });
  return out;
}

std::string unicode_normalize(std::string_view text, std::string_view form) {
  int options = UTF8PROC_STABLE;
  if (form == "NFC") options |= UTF8PROC_COMPOSE;
  else if (form == "NFD") options |= UTF8PROC_DECOMPOSE;
  else if (form == "NFKC") options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
  else if (form == "NFKD") options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
  else throw Error(fmt::format("unknown normalization form '{}'", form));
  std::string out;
  return normalize_form(text, options, out) ? out : std::string(text);
}

std::string utf8_lossy(std::string_view in) {
  std::string out;
  out.reserve(in.size());
  const auto* s = reinterpret_cast<const unsigned char*>(in.data());
  const std::size_t n = in.size();
  for (std::size_t i = 0; i < n;) {
    const unsigned char b = s[i];
    if (b < 0x80) {
      out += static_cast<char>(b);
      ++i;
      continue;
    }
    // Well-formed sequences (Unicode Table 3-7); on failure emit U+FFFD for
    // the maximal prefix that could still have become valid.
    std::size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) need = 1;
    else if (b == 0xE0) { need = 2; lo = 0xA0; }
    else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) need = 2;
    else if (b == 0xED) { need = 2; hi = 0x9F; }
    else if (b == 0xF0) { need = 3; lo = 0x90; }
    else if (b >= 0xF1 && b <= 0xF3) need = 3;
    else if (b == 0xF4) { need = 3; hi = 0x8F; }
    if (need == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    std::size_t k = 1;
    for (; k <= need && i + k < n; ++k) {
      const unsigned char c = s[i + k];
      const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
      if (c < l || c > h) break;
    }
    if (k == need + 1) {
      out.append(in.substr(i, need + 1));
      i += need + 1;
    } else {
      out += "\xEF\xBF\xBD";
      i += k;
    }
  }
  return out;
}

}  // namespace modalities::plugins::hf_tokenizer
