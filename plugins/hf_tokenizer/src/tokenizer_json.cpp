// Loader and encoder for Hugging Face `tokenizer.json` files, reproducing the
// ids of the `tokenizers` library (Rust core, as used by transformers and
// Modalities): byte-level BPE (GPT-2, Llama-3, Qwen2, ...), SentencePiece-style
// BPE with byte fallback (Llama-2, Mistral, Gemma), Unigram (T5) and WordPiece
// (BERT), with their normalizers, pre-tokenizers, post-processors and decoders.
//
// Note [Why the tokenizer core is hand-written]
// There is no maintained C++ port of `tokenizers`, and the ids must be
// identical to it, including its less obvious rules: leftmost-longest
// added-token matching with single_word/lstrip/rstrip, Oniguruma regex
// semantics (Unicode \s, \w, empty-match stepping), split behaviours,
// Metaspace's prepend schemes, ignore_merges, byte_fallback, unk fusing, the
// merge order (lowest rank first, leftmost on ties) and Unigram's Viterbi
// tie-breaking. Speed matters as much (packing tokenizes whole corpora): we
// keep no offsets or alignments, run BPE directly on raw bytes when the
// pipeline is byte-level, merge with a flat pair table and cache words per
// thread. Regexes go to PCRE2 (JIT, onig_regex.cpp), Unicode normalization to
// utf8proc and JSON to simdjson; Unicode classes come from tables probed from
// `tokenizers` itself (unicode.h); only the tokenizer logic is ours.
#include "tokenizer_json.h"

#include "onig_regex.h"
#include "unicode.h"

#include <modalities/sdk/error.h>

#include <absl/container/flat_hash_map.h>
#include <absl/hash/hash.h>
#include <absl/strings/escaping.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <simdjson.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <type_traits>

namespace modalities::plugins::hf_tokenizer {
namespace {

namespace dom = simdjson::dom;

// Debian's Abseil has its own string_view type for heterogeneous lookups.
inline absl::string_view key(std::string_view s) { return absl::string_view(s.data(), s.size()); }

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
// Added-token matching: a byte trie giving the longest token at a position.

class Trie {
 public:
  void clear() {
    nodes_.assign(1, Node{});
    first_.fill(false);
    starts_.clear();
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
    const auto first = static_cast<unsigned char>(s[0]);
    if (!first_[first]) starts_.push_back(first);
    first_[first] = true;
  }
  bool empty() const { return nodes_.size() <= 1; }
  // Finds the positions in one text where a token may start. Added tokens of real tokenizers begin
  // with one to four distinct bytes ('<', '[', ...), so the text is searched for each with memchr
  // (the next hit of each byte is kept until passed) instead of testing every byte.
  class StartFinder {
   public:
    static constexpr std::size_t kMaxBytes = 4;
    StartFinder(const Trie& trie, std::string_view text) : trie_(trie), text_(text) {
      if (trie.starts_.size() <= kMaxBytes)
        for (std::size_t k = 0; k < trie.starts_.size(); ++k) search(k, 0);
    }
    // The first position from `pos` on whose byte starts a token, or npos.
    std::size_t find(std::size_t pos) {
      const std::size_t n = trie_.starts_.size();
      if (n > kMaxBytes) {
        while (pos < text_.size() && !trie_.first_[static_cast<unsigned char>(text_[pos])]) ++pos;
        return pos < text_.size() ? pos : std::string_view::npos;
      }
      std::size_t best = std::string_view::npos;
      for (std::size_t k = 0; k < n; ++k) {
        if (next_[k] < pos) search(k, pos);
        best = std::min(best, next_[k]);
      }
      return best;
    }

   private:
    void search(std::size_t k, std::size_t pos) {
      const void* hit =
          pos < text_.size() ? std::memchr(text_.data() + pos, trie_.starts_[k], text_.size() - pos) : nullptr;
      next_[k] = hit == nullptr ? std::string_view::npos
                                : static_cast<std::size_t>(static_cast<const char*>(hit) - text_.data());
    }

    const Trie& trie_;
    std::string_view text_;
    std::array<std::size_t, kMaxBytes> next_{};
  };
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
  std::vector<unsigned char> starts_;  // the distinct bytes of first_, in insertion order
};

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

// ---------------------------------------------------------------------------
// Per-thread word cache. Note [Word cache]: keyed by the model input of one
// pre-token, per thread and per tokenizer instance, so concurrent tokenize()
// calls never share mutable state. Short words (nearly all of them) live in a
// direct-mapped table of two-cache-line slots holding the word's bytes and ids
// inline: a hit costs one hash and one memory access, and a frequent word that
// was overwritten comes back on its next miss (no clearing, no allocation).
// Longer words, and short ones with more ids than a slot holds (a CJK run with a
// small vocabulary), go to a bounded map that takes no new words once full and
// is emptied after four full maps' worth of misses. Like `tokenizers`, words of
// 256 bytes or more are not cached.

// Words (or chunks) too long for a slot, under 256 bytes, with their ids. Like `tokenizers`' cache,
// it takes no new entries once full (on text whose long words never recur, inserting every one
// cost 9-27%). Unlike it, it is emptied after four full maps' worth of misses, so that the long
// words of later text get in; and if by then fewer than one lookup in 16 since it was last emptied
// was a hit, it rests instead: no lookups and no entries for the next 16 maps' worth of long words
// (with a full map of such text, the lookups alone cost 4-8%). Hits and misses give the same ids.
class LongCache {
 public:
  static constexpr std::size_t kCapacity = 1 << 12;
  static constexpr std::size_t kMaxBytes = 256;

  const std::vector<std::int32_t>* find(std::string_view k) {
    if (resting_ > 0) {
      if (--resting_ == 0) clear();
      return nullptr;
    }
    if (map_.empty()) return nullptr;
    ++lookups_;
    const auto it = map_.find(key(k));
    if (it == map_.end()) return nullptr;
    ++hits_;
    return &it->second;
  }
  // After a miss: keeps `k` (of under kMaxBytes) and its ids if there is room.
  template <class Id>
  void offer(std::string_view k, const Id* ids, std::size_t n) {
    if (resting_ > 0) return;
    if (map_.size() >= kCapacity) {
      if (++misses_when_full_ < 4 * kCapacity) return;
      const bool useful = hits_ * 16 >= lookups_;
      clear();
      if (!useful) {
        resting_ = 16 * kCapacity;
        return;
      }
    }
    map_.emplace(std::string(k), std::vector<std::int32_t>(ids, ids + n));
  }
  void clear() {
    map_.clear();
    misses_when_full_ = lookups_ = hits_ = 0;
    resting_ = 0;
  }

 private:
  absl::flat_hash_map<std::string, std::vector<std::int32_t>> map_;
  std::size_t misses_when_full_ = 0, lookups_ = 0, hits_ = 0, resting_ = 0;
};

struct WordCache {
  static constexpr std::size_t kSlots = 1 << 15;  // 4 MiB per thread and tokenizer
  static constexpr std::size_t kMaxWord = 54;
  static constexpr std::size_t kMaxIds = 16;
  struct alignas(64) Slot {
    std::uint64_t hash;
    std::uint8_t len;  // 0: empty (words are never empty); | kAtOrigin for a chunk encoded at the text's origin
    std::uint8_t n;
    char word[kMaxWord];
    std::int32_t ids[kMaxIds];

    static constexpr std::uint8_t kAtOrigin = 0x80;  // (kMaxWord < 0x80)

    // Whether this slot holds `w` (of at most kMaxWord bytes) under hash `h` (and origin flag).
    bool holds(std::uint64_t h, std::string_view w, std::uint8_t origin = 0) const;
    // Keeps `w` and its n <= kMaxIds ids.
    template <class Id>
    void keep(std::uint64_t h, std::string_view w, const Id* word_ids, std::size_t count, std::uint8_t origin = 0) {
      hash = h;
      len = static_cast<std::uint8_t>(w.size() | origin);
      n = static_cast<std::uint8_t>(count);
      std::memcpy(word, w.data(), w.size());
      for (std::size_t k = 0; k < count; ++k) ids[k] = static_cast<std::int32_t>(word_ids[k]);
    }
  };
  static_assert(sizeof(Slot) == 128);
  static constexpr std::size_t kChunkSlots = 1 << 13;  // 1 MiB, only for pipelines of Note [Cached chunks]

  std::uint64_t owner = 0;
  std::unique_ptr<Slot[]> slots;
  std::unique_ptr<Slot[]> chunks;  // Note [Cached chunks]: raw chunks (made on first use)
  LongCache long_words;
  LongCache long_chunks;  // Note [Cached chunks]: chunks too long for a slot
  std::vector<std::int32_t> scratch;
};

// Unaligned loads of 8 and 4 bytes (for same_short and slot_hash).
inline std::uint64_t load8(const char* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline std::uint64_t load4(const char* p) {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Whether the n <= kMaxWord bytes at a and b are equal: 8-byte loads (the last one overlapping) instead
// of a libc call for every cached word.
inline bool same_short(const char* a, const char* b, std::size_t n) {
  if (n >= 8) {
    for (std::size_t i = 0; i + 8 < n; i += 8)
      if (load8(a + i) != load8(b + i)) return false;
    return load8(a + n - 8) == load8(b + n - 8);
  }
  if (n >= 4) return load4(a) == load4(b) && load4(a + n - 4) == load4(b + n - 4);
  for (std::size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// The hash of a word of at most kMaxWord bytes for the slot tables: 8-byte loads (the last one
// overlapping, short words from two overlapping 4-byte or three single bytes) mixed by 64x64->128
// bit multiplications, as wyhash does. absl::Hash took 9% of Llama-2's encoding time on text with
// fewer repeats. Slots are picked by the low bits and then compared by the whole hash and the bytes.
inline std::uint64_t slot_hash(std::string_view w) {
  constexpr std::uint64_t kA = 0xa0761d6478bd642full, kB = 0xe7037ed1a0b428dbull;
  const auto mix = [](std::uint64_t a, std::uint64_t b) {
    const unsigned __int128 r = static_cast<unsigned __int128>(a) * b;
    return static_cast<std::uint64_t>(r) ^ static_cast<std::uint64_t>(r >> 64);
  };
  const char* p = w.data();
  const std::size_t n = w.size();
  std::uint64_t h = kA ^ n;
  if (n >= 8) {
    for (std::size_t i = 0; i + 8 < n; i += 8) h = mix(h ^ load8(p + i), kB);
    return mix(h ^ load8(p + n - 8), kB ^ n);
  }
  std::uint64_t v;
  if (n >= 4) v = load4(p) | (load4(p + n - 4) << 32);
  else if (n > 0)
    v = static_cast<unsigned char>(p[0]) | (static_cast<std::uint64_t>(static_cast<unsigned char>(p[n / 2])) << 8) |
        (static_cast<std::uint64_t>(static_cast<unsigned char>(p[n - 1])) << 16);
  else v = 0;
  return mix(h ^ v, kB ^ n);
}

inline bool WordCache::Slot::holds(std::uint64_t h, std::string_view w, std::uint8_t origin) const {
  return hash == h && len == (w.size() | origin) && same_short(word, w.data(), w.size());
}

WordCache& word_cache(std::uint64_t owner) {
  thread_local std::array<WordCache, 4> caches;
  thread_local std::size_t next = 0;
  for (auto& c : caches)
    if (c.owner == owner) return c;
  WordCache& c = caches[next++ % caches.size()];
  c.owner = owner;
  if (!c.slots) c.slots = std::make_unique<WordCache::Slot[]>(WordCache::kSlots);
  std::memset(static_cast<void*>(c.slots.get()), 0, sizeof(WordCache::Slot) * WordCache::kSlots);
  if (c.chunks) std::memset(static_cast<void*>(c.chunks.get()), 0, sizeof(WordCache::Slot) * WordCache::kChunkSlots);
  c.long_words.clear();
  c.long_chunks.clear();
  return c;
}

// Where encoding writes its ids, with the calling thread's word cache (looked up once per text).
struct Sink {
  std::vector<std::int64_t>& ids;
  WordCache& cache;
};

std::atomic<std::uint64_t> g_next_instance{1};

// Rust regex `\w` (single_word added tokens; the same class as the Whitespace pre-tokenizer's).
bool is_rust_word_char(char32_t c) { return whitespace_pretokenizer_word().contains(c); }

// ---------------------------------------------------------------------------
// Normalizers (each a string -> string step; `tokenizers` tracks alignments,
// which only offsets need)

struct NormalizerStep {
  enum class Kind {
    kForm,
    kPrepend,
    kReplace,
    kStrip,
    kLowercase,
    kStripAccents,
    kBert,
    kNmt,
    kPrecompiled
  } kind = Kind::kForm;
  std::shared_ptr<const PrecompiledCharsmap> charsmap;  // kPrecompiled
  int options = 0;                                      // kForm: utf8proc options
  std::string text;                                     // kPrepend: prefix; kReplace: replacement
  std::string literal;                                  // kReplace with a String pattern
  Regex regex;                                          // kReplace with a Regex pattern
  std::string regex_source;                             // ... as written
  bool left = false, right = false;                     // kStrip
  bool clean_text = true, chinese = true, strip_accents = false, lowercase = true;  // kBert
  std::optional<bool> strip_accents_given;                                          // kBert: null follows lowercase
  std::shared_ptr<const struct CharTable> bert_table;  // kBert: Note [One-pass BertNormalizer]

  // Applies the step to `in`; returns false (leaving `out` alone) when nothing changes. Sets
  // *start_removed when the first character was deleted (the result then starts at a later
  // original offset, which Metaspace's "first" scheme looks at).
  bool apply(std::string_view in, std::string& out, bool* start_removed) const;
};

bool is_bert_chinese(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

// Rebuilds `in` character by character; `map` appends what a character becomes.
template <class F>
bool map_chars(std::string_view in, std::string& out, F&& map, bool* first_removed = nullptr) {
  std::string result;
  result.reserve(in.size() + 8);
  for (std::size_t i = 0; i < in.size();) {
    std::size_t len;
    const char32_t c = decode_at(in, i, &len);
    map(c, in.substr(i, len), result);
    if (i == 0 && result.empty() && first_removed != nullptr) *first_removed = true;
    i += len;
  }
  if (result == in) return false;
  out = std::move(result);
  return true;
}

bool is_ascii(std::string_view s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  return true;
}

// Lowercase, StripAccents and BertNormalizer on ASCII text, in one pass (the common case; the
// general paths below give the same result).
bool ascii_fast_path(const NormalizerStep& n, std::string_view in, std::string& out, bool* start_removed) {
  using K = NormalizerStep::Kind;
  if (n.kind == K::kStripAccents) return false;  // ASCII has no marks
  std::string r;
  r.reserve(in.size());
  bool changed = false;
  for (std::size_t i = 0; i < in.size(); ++i) {
    char c = in[i];
    if (n.kind == K::kBert && n.clean_text) {
      const auto b = static_cast<unsigned char>(c);
      if (b == '\t' || b == '\n' || b == '\r') {
        c = ' ';
      } else if (b < 0x20 || b == 0x7F) {  // controls (and NUL) are removed
        if (i == 0) *start_removed = true;
        changed = true;
        continue;
      }
    }
    if ((n.kind == K::kLowercase || (n.kind == K::kBert && n.lowercase)) && c >= 'A' && c <= 'Z')
      c = static_cast<char>(c + 32);
    changed = changed || c != in[i];
    r += c;
  }
  if (!changed) return false;
  out = std::move(r);
  return true;
}

// Note [One-pass BertNormalizer]
// `tokenizers` runs BertNormalizer as four passes over the text: clean-up, spaces around CJK
// ideographs, NFD followed by removing nonspacing marks, lowercase. All but NFD work character by
// character, and NFD is each character's canonical decomposition followed by reordering runs of
// non-starters; once the marks are removed, the order of what is left can only change if a
// non-starter is kept. So one pass per character gives the same text, except when a kept
// character is a non-starter: then it gives up (std::nullopt) and the four passes run. The start
// counts as removed (for Metaspace) as the passes report it: when the clean-up removes the first
// character or the accent stripping the first code point of its decomposition.
//
// What the pass makes of a BMP character depends on that character alone once it is not the first,
// so it is computed once per normalizer (by the pass itself, bert_char_table) and looked up.

// Per BMP code point, the text a character-by-character pass makes of it: (offset in `pool` << 8)
// | length, or kNotTabulated (the pass gives up on it, or the text is long).
struct CharTable {
  static constexpr std::uint32_t kNotTabulated = 0xFF;
  std::vector<std::uint32_t> mapped;
  std::string pool;
  bool lookup(char32_t c, std::string& r) const {  // false when `c` is not in the table (or it is empty)
    if (c >= 0x10000 || mapped.empty()) return false;
    const std::uint32_t m = mapped[c];
    if (m == kNotTabulated) return false;
    r.append(pool, m >> 8, m & 0xFF);
    return true;
  }
};

// The table of `pass` (a one-pass normalizer: text in, false / true with the new text in `out` /
// std::nullopt when it gives up) on each BMP code point from `from` on that `skip` does not exclude.
template <class Pass, class Skip>
CharTable tabulate(char32_t from, Pass&& pass, Skip&& skip) {
  CharTable t;
  t.mapped.assign(0x10000, CharTable::kNotTabulated);
  std::string one, text;
  for (char32_t c = from; c < 0x10000; ++c) {
    if ((c >= 0xD800 && c <= 0xDFFF) || skip(c)) continue;
    one.clear();
    append_utf8(one, c);
    const std::optional<bool> changed = pass(std::string_view(one), text);
    if (!changed) continue;
    const std::string_view result = *changed ? std::string_view(text) : std::string_view(one);
    if (result.size() >= CharTable::kNotTabulated) continue;
    t.mapped[c] = static_cast<std::uint32_t>(t.pool.size() << 8) | static_cast<std::uint32_t>(result.size());
    t.pool += result;
  }
  return t;
}

std::optional<bool> bert_one_pass(const NormalizerStep& n, std::string_view in, std::string& out, bool* start_removed) {
  const CharTable* table = n.bert_table.get();
  const CodePointSet& removed = bert_removed();
  const CodePointSet& space = bert_to_space();
  const CodePointSet& marks = bert_nonspacing_marks();
  std::string r;
  r.reserve(in.size() + 16);
  auto emit = [&](char32_t d) {
    if (d < 0x80) r += static_cast<char>(n.lowercase && d >= 'A' && d <= 'Z' ? d + 32 : d);
    else if (n.lowercase) append_lowercase(r, d);
    else append_utf8(r, d);
  };
  std::array<char32_t, 8> parts;
  std::array<bool, 8> starter;
  bool first_removed = false;
  for (std::size_t i = 0; i < in.size();) {
    std::size_t len;
    char32_t c = decode_at(in, i, &len);
    const bool first = i == 0;
    i += len;
    if (!first && table != nullptr && table->lookup(c, r)) continue;
    if (n.clean_text) {
      if (removed.contains(c)) {
        first_removed = first_removed || first;
        continue;
      }
      if (space.contains(c)) c = ' ';
    }
    const bool pad = n.chinese && is_bert_chinese(c);
    if (pad) r += ' ';
    if (!n.strip_accents || c < 0x80) {
      emit(c);
    } else {
      const std::size_t k = canonical_decomposition(c, parts, starter);
      if (k == 0) return std::nullopt;
      for (std::size_t j = 0; j < k; ++j) {
        if (marks.contains(parts[j])) {
          first_removed = first_removed || (first && j == 0 && !pad);
          continue;
        }
        if (!starter[j]) return std::nullopt;
        emit(parts[j]);
      }
    }
    if (pad) r += ' ';
  }
  if (first_removed) *start_removed = true;
  if (r == in) return false;
  out = std::move(r);
  return true;
}

std::shared_ptr<const CharTable> bert_char_table(const NormalizerStep& n) {
  NormalizerStep plain = n;
  plain.bert_table = nullptr;
  bool removed = false;
  return std::make_shared<const CharTable>(tabulate(
      0, [&](std::string_view one, std::string& out) { return bert_one_pass(plain, one, out, &removed); },
      [](char32_t) { return false; }));
}

// Note [Fused character maps]
// StripAccents, Lowercase and Nmt change a text one character at a time, so a run of them in a
// Sequence is the same as passing each character through all of them in turn: one pass instead
// of one pass (and one new string) per step. An NFD right before such a run joins it as in Note
// [One-pass BertNormalizer]: each character's canonical decomposition goes through the maps,
// which is NFD's result unless a non-starter (which NFD may reorder) comes out of the maps; then
// the pass gives up and the steps run one by one. The start counts as removed exactly when one
// of the steps, run alone, would remove the first character it sees. What the steps make of a BMP
// character depends on that character alone, so the pass computes it once per tokenizer and then
// looks it up wherever every step has already seen a character (FusedMaps).
bool is_fusable_map(const NormalizerStep& n) {
  using K = NormalizerStep::Kind;
  return n.kind == K::kStripAccents || n.kind == K::kLowercase || n.kind == K::kNmt;
}
bool is_nfd(const NormalizerStep& n) {
  return n.kind == NormalizerStep::Kind::kForm && n.options == normalization_form_options("NFD");
}

// A non-ASCII `c` that comes out of every step of `steps` as it is (and, after an NFD, is its own
// decomposition and a starter): the characters the pass copies without looking further.
bool keeps_unchanged(std::span<const NormalizerStep> steps, char32_t c) {
  using K = NormalizerStep::Kind;
  for (const NormalizerStep& m : steps) {
    if (is_nfd(m)) {
      if (!nfd_inert_starter(c)) return false;
    } else if (m.kind == K::kStripAccents ? strip_accents_marks().contains(c)
               : m.kind == K::kNmt        ? nmt_removed().contains(c) || nmt_to_space().contains(c)
                                          : lowercase_changes().contains(c)) {
      return false;
    }
  }
  return true;
}

// What the maps of `steps` make of each ASCII character (they map ASCII to ASCII): the byte, or
// kRemovedAscii; and keeps_unchanged for each BMP character, one bit each (computed once per
// tokenizer, so the pass looks a character up with one load).
constexpr std::uint8_t kRemovedAscii = 0x80;
struct FusedMaps {
  std::array<std::uint8_t, 128> ascii{};
  BmpBits keeps;  // keeps_unchanged of each BMP character
  // What the steps make of each BMP character that is not kept once every step has seen one.
  CharTable chars;
};
std::optional<bool> fused_one_pass(std::span<const NormalizerStep> steps, const FusedMaps& tables, std::string_view in,
                                   std::string& out, bool* start_removed);
FusedMaps fused_maps(std::span<const NormalizerStep> steps) {
  using K = NormalizerStep::Kind;
  FusedMaps t;
  for (char32_t b = 0; b < 128; ++b) {
    char32_t c = b;
    for (const NormalizerStep& m : steps) {
      if (m.kind == K::kLowercase && c >= 'A' && c <= 'Z') c += 32;
      if ((m.kind == K::kNmt && nmt_removed().contains(c)) ||
          (m.kind == K::kStripAccents && strip_accents_marks().contains(c))) {
        c = kRemovedAscii;
        break;
      }
      if (m.kind == K::kNmt && nmt_to_space().contains(c)) c = ' ';
    }
    t.ascii[b] = static_cast<std::uint8_t>(c);
  }
  if (!std::ranges::all_of(steps, [](const NormalizerStep& m) { return is_fusable_map(m) || is_nfd(m); })) return t;
  t.keeps = BmpBits::where(0x80, [&](char32_t c) { return keeps_unchanged(steps, c); });
  // The others through the pass itself (`chars` is still empty, so it computes each).
  bool removed = false;
  CharTable chars = tabulate(
      0x80, [&](std::string_view one, std::string& out) { return fused_one_pass(steps, t, one, out, &removed); },
      [&](char32_t c) { return t.keeps.contains(c); });
  t.chars = std::move(chars);
  return t;
}

std::optional<bool> fused_one_pass(std::span<const NormalizerStep> steps, const FusedMaps& tables, std::string_view in,
                                   std::string& out, bool* start_removed) {
  const std::array<std::uint8_t, 128>& ascii = tables.ascii;
  using K = NormalizerStep::Kind;
  const bool nfd = is_nfd(steps.front());
  const std::span<const NormalizerStep> maps = steps.subspan(nfd ? 1 : 0);
  if (maps.empty() || !std::ranges::all_of(maps, is_fusable_map)) return std::nullopt;
  // Steps that have seen a character: always a prefix of `maps`, since a step sees one only after
  // every step before it passed one on.
  std::size_t all_received = 0;
  bool first_removed = false;
  std::string r;
  std::string lowered;
  // Passes `c` into maps[s..]; returns whether anything came out of the last map.
  auto feed = [&](auto& self, char32_t c, std::size_t s) -> bool {
    for (; s < maps.size(); ++s) {
      if (s == all_received) {  // the first character this step sees
        ++all_received;
        const bool removes = (maps[s].kind == K::kStripAccents && strip_accents_marks().contains(c)) ||
                             (maps[s].kind == K::kNmt && nmt_removed().contains(c));
        if (removes) first_removed = true;
      }
      switch (maps[s].kind) {
        case K::kStripAccents:
          if (c >= 0x80 && strip_accents_marks().contains(c)) return false;
          break;
        case K::kNmt:
          if (nmt_removed().contains(c)) return false;
          if (nmt_to_space().contains(c)) c = ' ';
          break;
        case K::kLowercase:
          if (c < 0x80) {
            if (c >= 'A' && c <= 'Z') c += 32;
          } else {
            lowered.clear();
            append_lowercase(lowered, c);
            std::size_t len;
            const char32_t d = decode_at(lowered, 0, &len);
            if (len != lowered.size()) {  // several characters (U+0130 becomes "i\u0307")
              const std::string pieces = lowered;
              bool any = false;
              for (std::size_t i = 0; i < pieces.size(); i += len)
                any = self(self, decode_at(pieces, i, &len), s + 1) || any;
              return any;
            }
            c = d;
          }
          break;
        default: break;
      }
    }
    if (c < 0x80) r += static_cast<char>(c);
    else append_utf8(r, c);
    return true;
  };
  // Copy on the first change: the characters that every step keeps as they are (most text, for
  // Nmt or StripAccents) are skipped until one is not. Such a character reaches every step.
  auto keeps = [&](char32_t c) {  // non-ASCII `c` comes out of every step as it is
    if (c < 0x10000) return tables.keeps.contains(c);
    return keeps_unchanged(steps, c);
  };
  std::size_t i = 0;
  while (i < in.size()) {
    const auto b = static_cast<unsigned char>(in[i]);
    if (b < 0x80) {
      if (ascii[b] != b) break;
      ++i;
      continue;
    }
    std::size_t len;
    if (!keeps(decode_at(in, i, &len))) break;
    i += len;
  }
  if (i == in.size()) return false;
  r.reserve(in.size() + 16);
  if (i > 0) {
    all_received = maps.size();
    r.assign(in.substr(0, i));
  }
  std::array<char32_t, 8> parts;
  std::array<bool, 8> starter;
  while (i < in.size()) {
    if (static_cast<unsigned char>(in[i]) < 0x80 && all_received == maps.size()) {
      // The common case: a run of ASCII through the table.
      std::size_t j = i;
      while (j < in.size() && static_cast<unsigned char>(in[j]) < 0x80) ++j;
      const std::size_t at = r.size();
      r.resize(at + (j - i));
      char* w = r.data() + at;
      for (; i < j; ++i) {
        const std::uint8_t o = ascii[static_cast<unsigned char>(in[i])];
        if (o != kRemovedAscii) *w++ = static_cast<char>(o);
      }
      r.resize(static_cast<std::size_t>(w - r.data()));
      continue;
    }
    std::size_t j = i, len;  // a run of non-ASCII characters that every step keeps, copied at once
    while (j < in.size() && static_cast<unsigned char>(in[j]) >= 0x80 && keeps(decode_at(in, j, &len))) j += len;
    if (j > i) {
      all_received = maps.size();
      r.append(in, i, j - i);
      i = j;
      continue;
    }
    const char32_t c = decode_at(in, i, &len);
    if (c >= 0x80 && all_received == maps.size() && tables.chars.lookup(c, r)) {
      i += len;  // computed once, by fused_maps
      continue;
    }
    i += len;
    if (!nfd || c < 0x80 || nfd_inert_starter(c)) {
      feed(feed, c, 0);
      continue;
    }
    const std::size_t k = canonical_decomposition(c, parts, starter);
    if (k == 0) return std::nullopt;
    for (std::size_t j = 0; j < k; ++j)
      if (feed(feed, parts[j], 0) && !starter[j]) return std::nullopt;
  }
  if (first_removed) *start_removed = true;
  if (r == in) return false;
  out = std::move(r);
  return true;
}

// The steps one after the other (what `tokenizers` does).
bool run_steps(std::span<const NormalizerStep> steps, std::string_view in, std::string& out, bool* start_removed) {
  bool changed = false;
  std::string next;
  for (const NormalizerStep& n : steps) {
    if (n.apply(changed ? std::string_view(out) : in, next, start_removed)) {
      out.swap(next);
      changed = true;
    }
  }
  return changed;
}

// BertNormalizer as `tokenizers` runs it: four passes over the text.
bool bert_four_passes(const NormalizerStep& n, std::string_view in, std::string& out, bool* start_removed) {
  std::string cur(in);
  bool changed = false;
  std::string next;
  if (n.clean_text) {
    const CodePointSet& removed = bert_removed();
    const CodePointSet& space = bert_to_space();
    if (map_chars(
            cur, next,
            [&](char32_t c, std::string_view raw, std::string& r) {
              if (removed.contains(c)) return;
              if (space.contains(c)) r += ' ';
              else r += raw;
            },
            start_removed)) {
      cur.swap(next);
      changed = true;
    }
  }
  if (n.chinese && map_chars(cur, next, [](char32_t c, std::string_view raw, std::string& r) {
        if (is_bert_chinese(c)) {
          r += ' ';
          r += raw;
          r += ' ';
        } else {
          r += raw;
        }
      })) {
    cur.swap(next);
    changed = true;
  }
  if (n.strip_accents) {
    std::string nfd;
    const bool decomposed = normalize_form(cur, normalization_form_options("NFD"), nfd);
    const CodePointSet& marks = bert_nonspacing_marks();
    std::string_view src = decomposed ? std::string_view(nfd) : std::string_view(cur);
    if (map_chars(
            src, next,
            [&](char32_t c, std::string_view raw, std::string& r) {
              if (!marks.contains(c)) r += raw;
            },
            start_removed)) {
      cur.swap(next);
      changed = true;
    } else if (decomposed) {
      cur.swap(nfd);
      changed = true;
    }
  }
  if (n.lowercase && map_chars(cur, next, [](char32_t c, std::string_view, std::string& r) {
        if (c < 0x80) r += static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c);
        else append_lowercase(r, c);
      })) {
    cur.swap(next);
    changed = true;
  }
  if (!changed) return false;
  out = std::move(cur);
  return true;
}

// Note [Replace by hand]
// Replace with a one-byte String pattern (Gemma, Llama-2, Mistral: " " by U+2581) or with the Regex
// " {2,}" (T5 and other SentencePiece exports: runs of spaces by one) in one pass over the bytes into
// a buffer of the largest possible size; a one-byte pattern by a replacement of up to 8 bytes is
// found 8 bytes at a time (a word with no match is stored at once, one with a match stored up to it,
// then the replacement). A search and two appends per match made Replace a third of Gemma's
// encoding time; the byte loop still a quarter of Llama-2's on text with fewer repeats. Matches are
// what the general path finds: each byte equal to `b` (min_run 1), or each maximal run of at least
// two of them (" {2,}" is greedy and its matches never overlap).
bool replace_byte_runs(std::string_view in, char b, std::size_t min_run, std::string_view with, std::string& out,
                       bool* start_removed) {
  const char* p = in.data();
  const std::size_t n = in.size();
  // The first match, before anything is allocated (most texts have no run of two spaces); from
  // there on something is replaced.
  std::size_t i = 0;
  if (min_run == 1) {
    const void* hit = std::memchr(p, b, n);
    if (hit == nullptr) return false;
    i = static_cast<std::size_t>(static_cast<const char*>(hit) - p);
  } else {  // (a byte loop: a memchr call per single space costs more on short chunks)
    while (i + 1 < n && (p[i] != b || p[i + 1] != b)) ++i;
    if (i + 1 >= n) return false;
  }
  if (i == 0 && with.empty()) *start_removed = true;  // (later matches are not at the start)
  std::string r;
  // Each match of k >= 1 bytes becomes with.size() <= k * with.size() bytes; 16 bytes of room for
  // the 8-byte stores below.
  r.resize(n * std::max<std::size_t>(1, with.size()) + 16);
  char* o = r.data();
  std::memcpy(o, p, i);
  o += i;
  if (min_run == 1 && with.size() <= 8 && std::endian::native == std::endian::little) {
    // Eight bytes at a time: the word is stored whole and the output moves on to its first match,
    // which gets the replacement (one store), so the work is per match rather than per byte.
    constexpr std::uint64_t kLow7 = 0x7F7F7F7F7F7F7F7Full;
    const std::uint64_t pattern = 0x0101010101010101ull * static_cast<unsigned char>(b);
    std::uint64_t replacement = 0;
    std::memcpy(&replacement, with.data(), with.size());
    while (i + 8 <= n) {
      std::uint64_t x;
      std::memcpy(&x, p + i, 8);
      const std::uint64_t t = x ^ pattern;
      const std::uint64_t zero_bytes = ~(((t & kLow7) + kLow7) | t | kLow7);  // 0x80 where x has `b`
      std::memcpy(o, &x, 8);
      if (zero_bytes == 0) {
        o += 8;
        i += 8;
        continue;
      }
      const auto k = static_cast<std::size_t>(std::countr_zero(zero_bytes) / 8);
      o += k;
      std::memcpy(o, &replacement, 8);
      o += with.size();
      i += k + 1;
    }
  }
  while (i < n) {
    if (p[i] != b) {
      *o++ = p[i++];
      continue;
    }
    std::size_t j = i + 1;
    if (min_run > 1) {
      while (j < n && p[j] == b) ++j;
      if (j - i < min_run) {
        std::memcpy(o, p + i, j - i);
        o += j - i;
        i = j;
        continue;
      }
    }
    std::memcpy(o, with.data(), with.size());
    o += with.size();
    i = j;
  }
  r.resize(static_cast<std::size_t>(o - r.data()));
  out = std::move(r);
  return true;
}

bool NormalizerStep::apply(std::string_view in, std::string& out, bool* start_removed) const {
  if ((kind == Kind::kLowercase || kind == Kind::kStripAccents || kind == Kind::kBert) && is_ascii(in))
    return ascii_fast_path(*this, in, out, start_removed);
  switch (kind) {
    case Kind::kForm: return normalize_form(in, options, out);
    case Kind::kPrepend:
      if (in.empty()) return false;
      out = text;
      out += in;
      return true;
    case Kind::kReplace: {
      if (literal.size() == 1) return replace_byte_runs(in, literal[0], 1, text, out, start_removed);
      if (regex_source == " {2,}") return replace_byte_runs(in, ' ', 2, text, out, start_removed);
      std::string result;
      std::size_t prev = 0;
      bool any = false;
      auto on_match = [&](std::size_t s, std::size_t e) {
        result.append(in, prev, s - prev);
        result += text;
        prev = e;
        any = true;
        if (s == 0 && e > 0 && text.empty()) *start_removed = true;
      };
      if (regex) {
        regex.for_each_match(in, on_match);
      } else if (!literal.empty()) {
        for (std::size_t pos = in.find(literal); pos != std::string_view::npos;
             pos = in.find(literal, pos + literal.size()))
          on_match(pos, pos + literal.size());
      }
      if (!any) return false;
      result.append(in, prev, std::string_view::npos);
      out = std::move(result);
      return true;
    }
    case Kind::kStrip: {
      const CodePointSet& ws = rust_whitespace();
      std::size_t b = 0, e = in.size();
      while (left && b < e) {
        std::size_t len;
        if (!ws.contains(decode_at(in, b, &len))) break;
        b += len;
      }
      while (right && e > b) {
        std::size_t len;
        const std::size_t p = last_char_start(in.substr(0, e));
        if (!ws.contains(decode_at(in, p, &len))) break;
        e = p;
      }
      if (b == 0 && e == in.size()) return false;
      if (b > 0) *start_removed = true;
      out = std::string(in.substr(b, e - b));
      return true;
    }
    case Kind::kLowercase:
      return map_chars(in, out, [](char32_t c, std::string_view raw, std::string& r) {
        if (c < 0x80) r += static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c);
        else append_lowercase(r, c);
        (void)raw;
      });
    case Kind::kStripAccents: {
      const CodePointSet& marks = strip_accents_marks();
      return map_chars(
          in, out,
          [&](char32_t c, std::string_view raw, std::string& r) {
            if (!marks.contains(c)) r += raw;
          },
          start_removed);
    }
    case Kind::kPrecompiled: return charsmap->normalize(in, out, start_removed);
    case Kind::kNmt: {
      const CodePointSet& removed = nmt_removed();
      const CodePointSet& space = nmt_to_space();
      return map_chars(
          in, out,
          [&](char32_t c, std::string_view raw, std::string& r) {
            if (removed.contains(c)) return;
            if (space.contains(c)) r += ' ';
            else r += raw;
          },
          start_removed);
    }
    case Kind::kBert: {
      bool one_pass_start_removed = false;
      if (auto changed = bert_one_pass(*this, in, out, &one_pass_start_removed)) {
        if (one_pass_start_removed) *start_removed = true;
        return *changed;
      }
      return bert_four_passes(*this, in, out, start_removed);
    }
  }
  return false;
}

// ---------------------------------------------------------------------------
// Pre-tokenizer stages

enum class PrependScheme { kAlways, kFirst, kNever };

struct Stage {
  enum class Kind { kRegex, kLiteral, kChars, kWhitespace, kMetaspace } kind = Kind::kRegex;
  Regex regex;
  std::string literal;
  const CodePointSet* chars = nullptr;  // kChars: each character in the set is a match
  char32_t delimiter = 0;               // kChars with a single delimiter character (chars == nullptr)
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  // kMetaspace
  std::string replacement;
  PrependScheme prepend = PrependScheme::kAlways;
  bool split = true;

  // Segments covering `text`, each flagged as a match or not (Pattern::find_matches).
  template <class F>
  void segments(std::string_view text, F&& seg) const {
    if (kind == Kind::kChars) {
      std::size_t last = 0;
      for (std::size_t i = 0; i < text.size();) {
        std::size_t len;
        const char32_t c = decode_at(text, i, &len);
        if (chars != nullptr ? chars->contains(c) : c == delimiter) {
          if (last < i) seg(last, i, false);
          seg(i, i + len, true);
          last = i + len;
        }
        i += len;
      }
      if (last < text.size()) seg(last, text.size(), false);
      return;
    }
    if (kind == Kind::kWhitespace) {
      // \w+|[^\w\s]+ with the pieces kept and the spaces dropped.
      const CodePointSet& word = whitespace_pretokenizer_word();
      const CodePointSet& space = whitespace_pretokenizer_space();
      std::size_t i = 0;
      int run = -1;  // 0: word run, 1: other run
      std::size_t run_start = 0;
      while (i < text.size()) {
        std::size_t len;
        const char32_t c = decode_at(text, i, &len);
        const int cls = word.contains(c) ? 0 : space.contains(c) ? 2 : 1;
        if (cls != run) {  // runs of word or other characters are kept, spaces are the (removed) matches
          if (run == 0 || run == 1) seg(run_start, i, false);
          else if (i > run_start) seg(run_start, i, true);
          run = cls;
          run_start = i;
        }
        i += len;
      }
      if (run == 0 || run == 1) seg(run_start, text.size(), false);
      else if (text.size() > run_start) seg(run_start, text.size(), true);
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

// One stage on `piece`: calls emit(begin, end) for each piece it leaves (what `tokenizers`' split
// with the stage's behaviour gives).
template <class Emit>
void split_one_stage(const Stage& st, std::string_view piece, Emit&& emit) {
  Combiner<std::remove_reference_t<Emit>> combiner(st.behavior, emit);
  st.segments(piece, [&](std::size_t b, std::size_t e, bool m) { combiner.push(b, e, m); });
  combiner.finish();
}

// Note [One pass for character splits]
// WhitespaceSplit, Punctuation, Digits, CharDelimiterSplit and BertPreTokenizer cut a piece at the
// characters of one class, which they remove (Removed), keep alone (Isolated) or keep in runs
// (Contiguous). Whether such a stage cuts between two neighbours depends on those two characters
// alone (Isolated: either is in the class; Contiguous: exactly one is), and a removed character
// always cuts. So a run of these stages in a Sequence leaves the pieces of one pass that cuts
// wherever any of them would and drops what any Removed stage matches, instead of one pass (and
// one call per piece) per stage. Checked against the stages one by one on every code point.
struct CharSplitRun {
  std::size_t end = 0;                                      // the stage after the run
  std::array<std::uint32_t, 128> ascii{};                   // bit k: stage k of the run matches the ASCII character
  std::uint32_t removed = 0, isolated = 0, contiguous = 0;  // stages by behaviour
  std::vector<const Stage*> stages;
};

bool is_char_split(const Stage& s) {
  return s.kind == Stage::Kind::kChars &&
         (s.behavior == Behavior::kRemoved || s.behavior == Behavior::kIsolated || s.behavior == Behavior::kContiguous);
}

bool stage_matches(const Stage& s, char32_t c) { return s.chars != nullptr ? s.chars->contains(c) : c == s.delimiter; }

CharSplitRun char_split_run(std::span<const Stage> stages, std::size_t begin) {
  CharSplitRun r;
  r.end = begin;
  while (r.end < stages.size() && is_char_split(stages[r.end]) && r.end - begin < 32) {
    const Stage& s = stages[r.end];
    const std::uint32_t bit = std::uint32_t{1} << (r.end - begin);
    if (s.behavior == Behavior::kRemoved) r.removed |= bit;
    if (s.behavior == Behavior::kIsolated) r.isolated |= bit;
    if (s.behavior == Behavior::kContiguous) r.contiguous |= bit;
    for (char32_t c = 0; c < 128; ++c)
      if (stage_matches(s, c)) r.ascii[c] |= bit;
    r.stages.push_back(&s);
    ++r.end;
  }
  return r;
}

template <class Emit>
void split_chars_one_pass(const CharSplitRun& run, std::string_view piece, Emit&& emit) {
  constexpr std::size_t kNone = std::string_view::npos;
  std::size_t start = kNone;
  std::uint32_t prev = 0;
  for (std::size_t i = 0; i < piece.size();) {
    const auto b = static_cast<unsigned char>(piece[i]);
    std::size_t len = 1;
    std::uint32_t m;
    if (b < 0x80) {
      m = run.ascii[b];
    } else {
      const char32_t c = decode_at(piece, i, &len);
      m = 0;
      for (std::size_t k = 0; k < run.stages.size(); ++k)
        if (stage_matches(*run.stages[k], c)) m |= std::uint32_t{1} << k;
    }
    if (m & run.removed) {
      if (start != kNone) emit(start, i);
      start = kNone;
    } else if (start == kNone) {
      start = i;
    } else if (((m | prev) & run.isolated) != 0 || ((m ^ prev) & run.contiguous) != 0) {
      emit(start, i);
      start = i;
    }
    prev = m;
    i += len;
  }
  if (start != kNone) emit(start, piece.size());
}

// Metaspace: spaces become the replacement, which the scheme prepends unless the text starts
// with it; with split, the text is cut before every replacement. Calls emit(word, first) for
// each word in order (`first`: it starts the text).
template <class Emit>
void metaspace_by_replacing(const Stage& st, std::string_view piece, bool at_origin, Emit&& emit) {
  std::string replaced;
  replaced.reserve(piece.size() + piece.size() / 4 + 8);
  for (std::size_t at = 0; at < piece.size();) {  // chunk by chunk between spaces
    const std::size_t space = std::min(piece.find(' ', at), piece.size());
    replaced.append(piece, at, space - at);
    if (space < piece.size()) replaced += st.replacement;
    at = space + 1;
  }
  const bool starts = replaced.starts_with(st.replacement);
  if (!starts && (st.prepend == PrependScheme::kAlways || (st.prepend == PrependScheme::kFirst && at_origin)))
    replaced.insert(0, st.replacement);
  if (!st.split) {
    emit(std::string_view(replaced), true);
    return;
  }
  const std::string_view view = replaced;
  auto out = [&](std::size_t b, std::size_t e) { emit(view.substr(b, e - b), b == 0); };
  Combiner<decltype(out)> combiner(Behavior::kMergedWithNext, out);
  std::size_t prev = 0;
  for (std::size_t pos = view.find(st.replacement); pos != std::string_view::npos;
       pos = view.find(st.replacement, pos + st.replacement.size())) {
    if (prev != pos) combiner.push(prev, pos, false);
    combiner.push(pos, pos + st.replacement.size(), true);
    prev = pos + st.replacement.size();
  }
  if (prev != view.size()) combiner.push(prev, view.size(), false);
  combiner.finish();
}

// Note [Metaspace without a copy]
// With split and a replacement of one character other than the space, the words are the text cut
// before each space and each replacement character already in it (UTF-8 cannot match a character
// inside another), each starting with a replacement: a word that starts with a space gets it in
// place of the space, the first one if the scheme prepends it, the others start with it already.
// So only words that start with a space are copied (into one buffer), not the whole text.
bool metaspace_in_place(const Stage& st) {
  std::size_t len = 0;
  return st.split && !st.replacement.empty() && st.replacement != " " &&
         (decode_at(st.replacement, 0, &len), len == st.replacement.size());
}

template <class Emit>
void metaspace_in_place(const Stage& st, std::string_view piece, bool at_origin, Emit&& emit) {
  const std::string_view r = st.replacement;
  const auto boundary = [&](std::size_t i) -> std::size_t {  // length of a space or `r` at i, else 0
    if (piece[i] == ' ') return 1;
    return piece[i] == r[0] && piece.compare(i, r.size(), r) == 0 ? r.size() : 0;
  };
  const bool prepend = st.prepend == PrependScheme::kAlways || (st.prepend == PrependScheme::kFirst && at_origin);
  std::string word;
  std::size_t b = 0, from = boundary(0);
  while (true) {
    std::size_t e = from;
    while (e < piece.size() && boundary(e) == 0) ++e;
    if (piece[b] == ' ' || (b == 0 && from == 0 && prepend)) {
      word.assign(r);
      word.append(piece, piece[b] == ' ' ? b + 1 : b, e - (piece[b] == ' ' ? b + 1 : b));
      emit(std::string_view(word), b == 0);
    } else {
      emit(piece.substr(b, e - b), b == 0);
    }
    if (e == piece.size()) return;
    b = e;
    from = e + boundary(e);
  }
}

// Note [Unigram scores are parsed as serde_json parses them]
// `tokenizers` reads tokenizer.json with serde_json without its float_roundtrip
// feature: a number's decimal digits are collected into a u64 (digits beyond
// its range are dropped), converted to f64 and multiplied or divided once by a
// power of ten, which is one rounding more than a correct parse and can be one
// ulp away (about 10% of the scores of a typical Unigram vocabulary). Viterbi
// sums those scores, so a correctly rounded parse could pick another path on a
// near-tie; we reproduce serde_json's arithmetic on the number's text instead.
double serde_json_f64(std::string_view t, const std::filesystem::path& file, const std::string& where) {
  static const std::array<double, 309> kPow10 = [] {
    std::array<double, 309> p{};
    for (int i = 0; i < 309; ++i) p[i] = std::strtod(fmt::format("1e{}", i).c_str(), nullptr);
    return p;
  }();
  std::size_t i = 0;
  const bool positive = !(i < t.size() && t[i] == '-');
  if (!positive) ++i;
  auto digit = [&](std::size_t k) { return k < t.size() && t[k] >= '0' && t[k] <= '9'; };
  if (!digit(i)) fail(file, where, fmt::format("'{}' is not a number", t));
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  auto overflows = [](std::uint64_t a, std::uint64_t d) { return a >= kMax / 10 && (a > kMax / 10 || d > kMax % 10); };
  std::uint64_t significand = 0;
  std::int64_t exponent = 0;
  bool is_integer = true;
  for (; digit(i); ++i) {  // integer part: digits beyond u64 only raise the exponent
    const std::uint64_t d = static_cast<std::uint64_t>(t[i] - '0');
    if (overflows(significand, d)) {
      is_integer = false;
      for (; digit(i); ++i) ++exponent;
      break;
    }
    significand = significand * 10 + d;
  }
  if (i < t.size() && t[i] == '.') {
    is_integer = false;
    ++i;
    bool dropped = false;
    for (; digit(i); ++i) {
      const std::uint64_t d = static_cast<std::uint64_t>(t[i] - '0');
      if (dropped || overflows(significand, d)) {
        dropped = true;  // further digits are ignored
        continue;
      }
      significand = significand * 10 + d;
      --exponent;
    }
  }
  if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    is_integer = false;
    ++i;
    bool negative_exp = false;
    if (i < t.size() && (t[i] == '+' || t[i] == '-')) negative_exp = t[i++] == '-';
    std::int64_t e = 0;
    for (; digit(i); ++i) e = std::min<std::int64_t>(e * 10 + (t[i] - '0'), 1LL << 40);
    exponent += negative_exp ? -e : e;
  }
  if (is_integer) return positive ? static_cast<double>(significand) : -static_cast<double>(significand);
  double f = static_cast<double>(significand);
  while (true) {
    const std::int64_t a = exponent < 0 ? -exponent : exponent;
    if (a <= 308) {
      if (exponent >= 0) f *= kPow10[static_cast<std::size_t>(a)];
      else f /= kPow10[static_cast<std::size_t>(a)];
      break;
    }
    if (f == 0.0) break;
    if (exponent >= 0) fail(file, where, fmt::format("number '{}' is out of range", t));
    f /= 1e308;
    exponent += 308;
  }
  if (std::isinf(f)) fail(file, where, fmt::format("number '{}' is out of range", t));
  return positive ? f : -f;
}

// The texts of the Unigram scores (model.vocab[*][1]), read with simdjson's on-demand parser,
// which keeps a number's text.
std::vector<std::string> unigram_score_texts(const std::filesystem::path& file) {
  simdjson::padded_string json;
  if (simdjson::padded_string::load(file.string()).get(json) != simdjson::SUCCESS)
    fail(file, "tokenizer.json", "cannot be read");
  simdjson::ondemand::parser parser;
  std::vector<std::string> out;
  auto doc = parser.iterate(json);
  simdjson::ondemand::array vocab;
  if (doc["model"]["vocab"].get_array().get(vocab) != simdjson::SUCCESS) fail(file, "model.vocab", "expected an array");
  for (auto pair : vocab) {
    simdjson::ondemand::array entry;
    if (pair.get_array().get(entry) != simdjson::SUCCESS) fail(file, "model.vocab", "expected [piece, score] pairs");
    std::size_t k = 0;
    for (auto e : entry) {
      if (k++ != 1) continue;
      std::string_view raw;
      if (e.raw_json_token().get(raw) != simdjson::SUCCESS) fail(file, "model.vocab", "unreadable score");
      while (!raw.empty() && (raw.back() == ' ' || raw.back() == '\n' || raw.back() == '\r' || raw.back() == '\t'))
        raw.remove_suffix(1);
      out.emplace_back(raw);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// Unigram: a byte trie for the common-prefix search over the pieces.

class PrefixTrie {
 public:
  PrefixTrie() : building_(1) {}
  void insert(std::string_view s, std::int32_t id) {
    std::uint32_t n = 0;
    for (char ch : s) {
      const auto b = static_cast<unsigned char>(ch);
      auto& next = building_[n].next;
      auto it =
          std::lower_bound(next.begin(), next.end(), b, [](const auto& e, unsigned char v) { return e.first < v; });
      if (it == next.end() || it->first != b) {
        const auto child = static_cast<std::uint32_t>(building_.size());
        it = next.insert(it, {b, child});
        building_.emplace_back();
        n = child;
      } else {
        n = it->second;
      }
    }
    building_[n].id = id;
  }
  // Lays the trie out flat for prefixes(): per node its id and a run of (byte, child) edges in one
  // array, so a step reads two contiguous places instead of chasing a vector per node.
  void freeze() {
    nodes_.clear();
    edges_.clear();
    for (const Building& b : building_) {
      nodes_.push_back({static_cast<std::uint32_t>(edges_.size()), static_cast<std::uint32_t>(b.next.size()), b.id});
      for (const auto& [byte, child] : b.next) edges_.push_back({byte, child});
    }
    root_.fill(0);
    for (const auto& [byte, child] : building_[0].next) root_[byte] = child;
    building_.clear();
    building_.shrink_to_fit();
  }
  // Calls f(length, id) for every piece that is a prefix of text[pos..], shortest first.
  template <class F>
  void prefixes(std::string_view text, std::size_t pos, F&& f) const {
    if (pos >= text.size()) return;
    std::uint32_t n = root_[static_cast<unsigned char>(text[pos])];  // the root's children by byte
    if (n == 0) return;
    if (nodes_[n].id >= 0) f(1, nodes_[n].id);
    for (std::size_t i = pos + 1; i < text.size(); ++i) {
      const auto b = static_cast<unsigned char>(text[i]);
      const Node& node = nodes_[n];
      const Edge* first = edges_.data() + node.first_edge;
      const Edge* last = first + node.edges;
      const Edge* it = std::lower_bound(first, last, b, [](const Edge& e, unsigned char v) { return e.byte < v; });
      if (it == last || it->byte != b) return;
      n = it->child;
      if (nodes_[n].id >= 0) f(i + 1 - pos, nodes_[n].id);
    }
  }

 private:
  struct Building {
    std::vector<std::pair<unsigned char, std::uint32_t>> next;
    std::int32_t id = -1;
  };
  struct Node {
    std::uint32_t first_edge, edges;
    std::int32_t id;
  };
  struct Edge {
    unsigned char byte;
    std::uint32_t child;
  };
  std::vector<Building> building_;
  std::vector<Node> nodes_ = {{0, 0, -1}};
  std::vector<Edge> edges_;
  std::array<std::uint32_t, 256> root_{};  // 0: no piece starts with the byte (node 0 is the root)
};

// ---------------------------------------------------------------------------
// Decoders: each maps the list of token strings to a new list; the result is
// the concatenation (Decoder::decode = decode_chain + join).

struct DecoderStep {
  enum class Kind { kByteLevel, kByteFallback, kFuse, kStrip, kReplace, kMetaspace, kWordPiece, kBpe } kind;
  std::string content;              // kStrip: the character; kReplace: replacement; kMetaspace: replacement
  std::string literal;              // kReplace with a String pattern
  Regex regex;                      // kReplace with a Regex pattern
  std::size_t start = 0, stop = 0;  // kStrip
  PrependScheme prepend = PrependScheme::kAlways;  // kMetaspace
  std::string prefix;                              // kWordPiece prefix, kBpe suffix
  bool cleanup = true;                             // kWordPiece
};

}  // namespace

// ---------------------------------------------------------------------------

struct TokenizerJson::Impl {
  std::filesystem::path file;
  std::uint64_t instance_id = g_next_instance.fetch_add(1);

  std::vector<NormalizerStep> normalizers;
  // [begin, end) ranges of `normalizers`: single steps and runs of Note [Fused character maps].
  std::vector<std::pair<std::size_t, std::size_t>> normalizer_plan;
  bool fused_characters = true;         // false: the runs go step by step (tests)
  std::vector<FusedMaps> fused_tables;  // per entry of normalizer_plan
  void plan_normalizers();
  bool top_level_bert = false;  // the normalizer is one BertNormalizer (not in a Sequence)

  // Pre-tokenizer: stages, then (optionally, always last) ByteLevel.
  std::vector<Stage> stages;
  std::vector<Stage> post_stages;        // Note [Pre-tokenizers after ByteLevel]
  std::vector<CharSplitRun> split_runs;  // per stage: the run of Note [One pass for character splits] it starts
  bool fused_splits = true;              // false: stage by stage (tests)
  bool byte_level = false;
  bool byte_level_prefix_space = false;
  bool byte_level_use_regex = true;
  bool byte_level_top_level = false;
  Regex gpt2_regex;

  // Model.
  enum class ModelKind { kBpe, kUnigram, kWordPiece, kWordLevel } model_kind = ModelKind::kBpe;
  absl::flat_hash_map<std::string, std::int32_t> vocab;
  std::vector<std::string> vocab_r;  // id -> token ("" when absent)
  std::vector<bool> vocab_r_present;
  absl::flat_hash_map<std::uint64_t, std::uint64_t> merges;  // BPE: (a << 32 | b) -> (rank << 32 | new id)
  std::optional<std::string> unk_token;
  std::string subword_prefix, word_suffix;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  std::array<std::int32_t, 256> byte_ids{};  // byte-level mode: id of each byte's character
  bool byte_fast = false;                    // every byte character is in the vocabulary, no prefix/suffix
  absl::flat_hash_map<std::string, std::int32_t> raw_vocab;  // byte-level mode + ignore_merges: raw bytes -> id
  std::array<std::int32_t, 256> fallback_ids{};              // byte_fallback: id of <0xNN>, or -1
  // BPE without subword prefix or word suffix: the id of each one-character token (-1: none), so
  // initial_symbols looks characters up without building strings.
  bool char_ids_ready = false;
  std::vector<std::int32_t> bmp_char_ids;
  absl::flat_hash_map<char32_t, std::int32_t> astral_char_ids;
  // Unigram
  std::vector<double> scores;
  double unk_score = 0;
  std::optional<std::int32_t> unk_id;
  PrefixTrie pieces;
  // WordPiece
  std::size_t max_input_chars_per_word = 100;
  // BPE without a pre-tokenizer (SentencePiece style): words may be split before "▁"; see
  // Note [Splitting SentencePiece-style words]. False when that is not safe.
  bool split_at_mark = false;
  // Note [Cached chunks]
  bool chunk_cuts = false;  // the pipeline allows them
  BmpBits chunk_neutral;    // the neutral non-ASCII characters
  bool chunking = true;     // false: whole segments (tests)
  void plan_chunks();
  void encode_chunked(std::string_view segment, bool at_origin, Sink& out) const;
  void cached_chunk(std::string_view chunk, bool at_origin, Sink& out) const;

  // Added vocabulary.
  std::vector<std::pair<std::int64_t, AddedToken>> added;
  absl::flat_hash_map<std::string, std::size_t> added_by_content;  // -> index in `added`
  absl::flat_hash_map<std::int64_t, std::size_t> added_by_id;
  Trie raw_trie, normalized_trie;
  std::vector<std::string> normalized_patterns;  // normalized content per `added` index

  // Decoder (empty with has_decoder: tokens joined by spaces).
  bool has_decoder = false;
  std::vector<DecoderStep> decoders;

  // ---- loading ----
  void load(std::vector<std::int64_t>& prefix, std::vector<std::int64_t>& suffix, std::vector<std::string>& warnings);
  void parse_normalizer(const Json& j, dom::element el, const std::string& where);
  void parse_pre_tokenizer(const Json& j, dom::element el, const std::string& where, bool top_level);
  void parse_model(const Json& j, dom::element el);
  void parse_vocab_map(const Json& j, dom::element el);
  void parse_post_processor(const Json& j, dom::element el, const std::string& where, std::vector<std::int64_t>& prefix,
                            std::vector<std::int64_t>& suffix);
  void parse_decoder(const Json& j, dom::element el, const std::string& where);
  Regex parse_pattern(const Json& j, dom::element pattern, const std::string& where, std::string& literal,
                      bool allow_empty);
  void finish_model();
  void find_split_character();
  std::size_t add_tokens(std::span<const AddedToken> tokens);
  void rebuild_tries();

  // ---- encoding ----
  bool normalize(std::string_view in, std::string& out, bool* start_removed) const;
  void encode(std::string_view text, std::vector<std::int64_t>& out) const;
  void encode_normalizable(std::string_view segment, bool at_origin, Sink& out) const;
  template <class F>
  void split_added(std::string_view sentence, const Trie& trie, F&& on_split) const;
  void pre_tokenize(std::string_view piece, std::size_t stage, bool at_origin, Sink& out) const;
  void byte_level_stage(std::string_view piece, Sink& out) const;
  void after_byte_level(std::string_view raw, Sink& out) const;
  void post_split(std::string_view raw, std::string_view mapped, const std::vector<std::uint32_t>& at, std::size_t b,
                  std::size_t e, std::size_t stage, Sink& out) const;
  void model(std::string_view word, Sink& out) const;
  void model_piece(std::string_view word, Sink& out) const;
  void tokenize_word(std::string_view word, std::vector<std::int32_t>& ids) const;
  void initial_symbols(std::string_view chars, std::vector<std::int32_t>& syms) const;
  void merge(std::vector<std::int32_t>& syms) const;
  void merge_heap(std::vector<std::int32_t>& syms) const;
  void unigram(std::string_view word, std::vector<std::int32_t>& ids) const;
  void wordpiece(std::string_view word, std::vector<std::int32_t>& ids) const;
  std::optional<std::int32_t> vocab_id(std::string_view s) const {
    auto it = vocab.find(key(s));
    if (it == vocab.end()) return std::nullopt;
    return it->second;
  }
  std::int32_t required_unk(std::string_view model_name) const {
    if (unk_token)
      if (auto id = vocab_id(*unk_token)) return *id;
    throw Error(fmt::format("{}: the {} model needs its unknown token for this text, but it has none in its vocabulary",
                            file.string(), model_name));
  }

  // ---- decoding ----
  std::string decode_tokens(std::vector<std::string> tokens) const;
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
    if (v.get_string().get(s) != simdjson::SUCCESS || std::find(allowed.begin(), allowed.end(), s) == allowed.end())
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
    if (auto m = j.optional_member(*p, "pad_to_multiple_of"))
      unsigned_at(*p, "pad_to_multiple_of", "padding", UINT64_MAX);
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
  plan_normalizers();
  if (auto p = j.optional_member(root, "pre_tokenizer")) parse_pre_tokenizer(j, *p, "pre_tokenizer", true);
  for (std::size_t k = 0; k <= stages.size(); ++k) split_runs.push_back(char_split_run(stages, k));
  finish_model();
  if (auto d = j.optional_member(root, "decoder")) {
    has_decoder = true;
    parse_decoder(j, *d, "decoder");
  }

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

// A `pattern` object: {"String": "..."} (returned in `literal`) or {"Regex": "..."}.
Regex TokenizerJson::Impl::parse_pattern(const Json& j, dom::element pattern, const std::string& where,
                                         std::string& literal, bool allow_empty) {
  if (auto r = j.optional_member(pattern, "Regex"))
    return Regex(j.string(*r, where + ".Regex"), file, where + ".Regex");
  if (auto l = j.optional_member(pattern, "String")) {
    literal = j.string(*l, where + ".String");
    if (literal.empty() && !allow_empty) fail(file, where + ".String", "an empty pattern is not supported");
    return Regex();
  }
  fail(file, where, "expected {\"Regex\": ...} or {\"String\": ...}");
}

void TokenizerJson::Impl::parse_normalizer(const Json& j, dom::element el, const std::string& where) {
  const std::string type = j.type_of(el, where);
  NormalizerStep n;
  using K = NormalizerStep::Kind;
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    n.kind = K::kForm;
    n.options = normalization_form_options(type);
  } else if (type == "Sequence") {
    std::size_t k = 0;
    for (dom::element e : j.array(j.member(el, "normalizers", where), where + ".normalizers"))
      parse_normalizer(j, e, fmt::format("{}.normalizers[{}]", where, k++));
    return;
  } else if (type == "Prepend") {
    n.kind = K::kPrepend;
    n.text = j.string(j.member(el, "prepend", where), where + ".prepend");
  } else if (type == "Replace") {
    n.kind = K::kReplace;
    n.regex = parse_pattern(j, j.member(el, "pattern", where), where + ".pattern", n.literal, true);
    if (auto r = j.optional_member(j.member(el, "pattern", where), "Regex"))
      n.regex_source = j.string(*r, where + ".pattern.Regex");
    n.text = j.string(j.member(el, "content", where), where + ".content");
  } else if (type == "Strip") {
    n.kind = K::kStrip;
    n.left = j.flag(el, "strip_left", true, where);
    n.right = j.flag(el, "strip_right", true, where);
  } else if (type == "Lowercase") {
    n.kind = K::kLowercase;
  } else if (type == "StripAccents") {
    n.kind = K::kStripAccents;
  } else if (type == "Nmt") {
    n.kind = K::kNmt;
  } else if (type == "Precompiled") {
    n.kind = K::kPrecompiled;
    std::string blob;
    if (auto m = j.optional_member(el, "precompiled_charsmap")) {
      const std::string b64 = j.string(*m, where + ".precompiled_charsmap");
      if (!absl::Base64Unescape(b64, &blob)) fail(file, where + ".precompiled_charsmap", "not valid base64");
    }
    n.charsmap =
        std::make_shared<const PrecompiledCharsmap>(std::move(blob), fmt::format("{}: {}", file.string(), where));
  } else if (type == "BertNormalizer") {
    n.kind = K::kBert;
    n.clean_text = j.flag(el, "clean_text", true, where);
    n.chinese = j.flag(el, "handle_chinese_chars", true, where);
    n.lowercase = j.flag(el, "lowercase", true, where);
    if (auto v = j.optional_member(el, "strip_accents"))
      n.strip_accents_given = j.boolean(*v, where + ".strip_accents");
    n.strip_accents = n.strip_accents_given.value_or(n.lowercase);
    n.bert_table = bert_char_table(n);
    top_level_bert = where == "normalizer";
  } else {
    unsupported(file, where, "normalizer", type,
                "NFC, NFD, NFKC, NFKD, Prepend, Replace, Strip, Lowercase, StripAccents, Nmt, BertNormalizer, "
                "Precompiled and a Sequence of them");
  }
  normalizers.push_back(std::move(n));
}

static Behavior parse_behavior(const Json& j, dom::element el, const std::string& where, Behavior fallback) {
  auto v = j.optional_member(el, "behavior");
  if (!v) return fallback;
  const std::string b = j.string(*v, where + ".behavior");
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  fail(j.file, where + ".behavior", fmt::format("unknown split behavior '{}'", b));
}

void TokenizerJson::Impl::parse_pre_tokenizer(const Json& j, dom::element el, const std::string& where,
                                              bool top_level) {
  const std::string type = j.type_of(el, where);
  // Note [Pre-tokenizers after ByteLevel]: those after it split the byte-level characters.
  std::vector<Stage>& target = byte_level ? post_stages : stages;
  if (byte_level && (type == "ByteLevel" || type == "Metaspace"))
    fail(file, where, fmt::format("pre-tokenizer '{}' after ByteLevel is not supported", type));
  Stage s;
  if (type == "Sequence") {
    std::size_t k = 0;
    for (dom::element p : j.array(j.member(el, "pretokenizers", where), where + ".pretokenizers"))
      parse_pre_tokenizer(j, p, fmt::format("{}.pretokenizers[{}]", where, k++), false);
    return;
  } else if (type == "ByteLevel") {
    byte_level = true;
    byte_level_prefix_space = j.flag(el, "add_prefix_space", true, where);
    byte_level_use_regex = j.flag(el, "use_regex", true, where);
    byte_level_top_level = top_level;
    if (byte_level_use_regex) gpt2_regex = Regex(std::string(kGpt2Pattern), file, where);
    return;
  } else if (type == "Split") {
    std::string literal;
    s.regex = parse_pattern(j, j.member(el, "pattern", where), where + ".pattern", literal, false);
    s.kind = s.regex ? Stage::Kind::kRegex : Stage::Kind::kLiteral;
    s.literal = std::move(literal);
    if (!j.optional_member(el, "behavior")) fail(file, where + ".behavior", "missing");
    s.behavior = parse_behavior(j, el, where, Behavior::kIsolated);
    s.invert = j.flag(el, "invert", false, where);
  } else if (type == "Digits") {
    s.kind = Stage::Kind::kChars;
    s.chars = &rust_numeric();
    s.behavior = j.flag(el, "individual_digits", false, where) ? Behavior::kIsolated : Behavior::kContiguous;
  } else if (type == "WhitespaceSplit") {
    s.kind = Stage::Kind::kChars;
    s.chars = &rust_whitespace();
    s.behavior = Behavior::kRemoved;
  } else if (type == "Punctuation") {
    s.kind = Stage::Kind::kChars;
    s.chars = &bert_punctuation();
    s.behavior = parse_behavior(j, el, where, Behavior::kIsolated);
  } else if (type == "BertPreTokenizer") {
    s.kind = Stage::Kind::kChars;
    s.chars = &rust_whitespace();
    s.behavior = Behavior::kRemoved;
    target.push_back(std::move(s));
    s = Stage{};
    s.kind = Stage::Kind::kChars;
    s.chars = &bert_punctuation();
    s.behavior = Behavior::kIsolated;
  } else if (type == "CharDelimiterSplit") {
    const std::string d = j.string(j.member(el, "delimiter", where), where + ".delimiter");
    std::size_t len = 0;
    if (d.empty() || (s.delimiter = decode_at(d, 0, &len), len != d.size()))
      fail(file, where + ".delimiter", "expected a single character");
    s.kind = Stage::Kind::kChars;
    s.behavior = Behavior::kRemoved;
  } else if (type == "Whitespace") {
    s.kind = Stage::Kind::kWhitespace;
    s.behavior = Behavior::kRemoved;
  } else if (type == "Metaspace") {
    s.kind = Stage::Kind::kMetaspace;
    s.replacement = j.string(j.member(el, "replacement", where), where + ".replacement");
    std::size_t len = 0;
    if (s.replacement.empty() || (decode_at(s.replacement, 0, &len), len != s.replacement.size()))
      fail(file, where + ".replacement", "expected a single character");
    s.split = j.flag(el, "split", true, where);
    if (auto scheme = j.optional_member(el, "prepend_scheme")) {
      const std::string v = j.string(*scheme, where + ".prepend_scheme");
      if (v == "always") s.prepend = PrependScheme::kAlways;
      else if (v == "first") s.prepend = PrependScheme::kFirst;
      else if (v == "never") s.prepend = PrependScheme::kNever;
      else
        fail(file, where + ".prepend_scheme", fmt::format("expected \"always\", \"first\" or \"never\", got '{}'", v));
    } else {
      // Files from before prepend_scheme: add_prefix_space decides (true = always).
      s.prepend = j.flag(el, "add_prefix_space", true, where) ? PrependScheme::kAlways : PrependScheme::kNever;
    }
  } else {
    unsupported(file, where, "pre-tokenizer", type,
                "ByteLevel, Split, Digits, WhitespaceSplit, Whitespace, Punctuation, BertPreTokenizer, "
                "CharDelimiterSplit, Metaspace and a Sequence of them");
  }
  target.push_back(std::move(s));
}

void TokenizerJson::Impl::parse_vocab_map(const Json& j, dom::element el) {
  std::int64_t max_id = -1;
  for (auto field : j.object(j.member(el, "vocab", "model"), "model.vocab")) {
    const std::int64_t id = j.integer(field.value, fmt::format("model.vocab[\"{}\"]", field.key));
    if (id < 0 || id >= (1 << 26))
      fail(file, fmt::format("model.vocab[\"{}\"]", field.key), fmt::format("id {} out of range [0, 2^26)", id));
    vocab.insert_or_assign(std::string(field.key), static_cast<std::int32_t>(id));
    max_id = std::max(max_id, id);
  }
  vocab_r.assign(static_cast<std::size_t>(max_id + 1), std::string());
  vocab_r_present.assign(static_cast<std::size_t>(max_id + 1), false);
  for (const auto& [token, id] : vocab) {
    vocab_r[id] = token;
    vocab_r_present[id] = true;
  }
}

void TokenizerJson::Impl::parse_model(const Json& j, dom::element el) {
  std::string type;
  // Older serialisations (the real t5-small file) have no "type": `tokenizers` then takes the first
  // model its fields deserialise as, trying BPE, WordPiece, WordLevel and Unigram in turn.
  if (auto t = j.optional_member(el, "type")) {
    type = j.string(*t, "model.type");
  } else if (j.optional_member(el, "merges")) {
    type = "BPE";
  } else if (auto v = j.optional_member(el, "vocab"); v && v->is_array()) {
    type = "Unigram";  // a list of [piece, score]
  } else if (v && v->is_object() && j.optional_member(el, "continuing_subword_prefix") &&
             j.optional_member(el, "max_input_chars_per_word")) {
    type = "WordPiece";
  } else if (v && v->is_object() && j.optional_member(el, "unk_token")) {
    type = "WordLevel";
  } else {
    fail(file, "model",
         "has no 'type', and its fields fit none of BPE (merges), Unigram (a vocab list), WordPiece "
         "and WordLevel (a vocab map with unk_token)");
  }

  if (type == "WordPiece" || type == "WordLevel") {
    model_kind = type == "WordPiece" ? ModelKind::kWordPiece : ModelKind::kWordLevel;
    parse_vocab_map(j, el);
    unk_token = j.string(j.member(el, "unk_token", "model"), "model.unk_token");
    if (model_kind == ModelKind::kWordPiece) {
      subword_prefix = j.string(j.member(el, "continuing_subword_prefix", "model"), "model.continuing_subword_prefix");
      const std::int64_t m =
          j.integer(j.member(el, "max_input_chars_per_word", "model"), "model.max_input_chars_per_word");
      if (m < 0) fail(file, "model.max_input_chars_per_word", "expected a non-negative integer");
      max_input_chars_per_word = static_cast<std::size_t>(m);
    }
    return;
  }
  if (type == "Unigram") {
    model_kind = ModelKind::kUnigram;
    byte_fallback = j.flag(el, "byte_fallback", false, "model");
    std::int32_t id = 0;
    double min_score = std::numeric_limits<double>::infinity();
    const std::vector<std::string> score_texts = unigram_score_texts(file);
    for (dom::element e : j.array(j.member(el, "vocab", "model"), "model.vocab")) {
      const std::string w = fmt::format("model.vocab[{}]", id);
      dom::array pair = j.array(e, w);
      if (pair.size() != 2) fail(file, w, "expected [piece, score]");
      const std::string piece = j.string(pair.at(0).value_unsafe(), w + "[0]");
      if (!pair.at(1).value_unsafe().is_number()) fail(file, w + "[1]", "expected a number");
      if (static_cast<std::size_t>(id) >= score_texts.size()) fail(file, w, "unreadable score");
      const double score = serde_json_f64(score_texts[static_cast<std::size_t>(id)], file, w + "[1]");
      vocab.insert_or_assign(piece, id);
      vocab_r.push_back(piece);
      vocab_r_present.push_back(true);
      scores.push_back(score);
      min_score = std::min(min_score, score);
      pieces.insert(piece, id);
      ++id;
    }
    if (auto u = j.optional_member(el, "unk_id")) {
      const std::int64_t v = j.integer(*u, "model.unk_id");
      if (v < 0 || v >= id)
        fail(file, "model.unk_id", fmt::format("{} is not a piece index (vocabulary of {})", v, id));
      unk_id = static_cast<std::int32_t>(v);
      unk_token = vocab_r[v];
    }
    unk_score = min_score - 10.0;  // tokenizers' K_UNK_PENALTY
    pieces.freeze();
    return;
  }
  if (type != "BPE") unsupported(file, "model.type", "model", type, "BPE, Unigram, WordPiece and WordLevel");

  if (auto d = j.optional_member(el, "dropout")) {
    double p = 0;
    if (d->get_double().get(p) != simdjson::SUCCESS) fail(file, "model.dropout", "expected a number or null");
    if (p != 0.0) fail(file, "model.dropout", fmt::format("BPE dropout {} is not supported (must be null)", p));
  }
  if (auto u = j.optional_member(el, "unk_token")) unk_token = j.string(*u, "model.unk_token");
  if (auto p = j.optional_member(el, "continuing_subword_prefix"))
    subword_prefix = j.string(*p, "model.continuing_subword_prefix");
  if (auto s = j.optional_member(el, "end_of_word_suffix")) word_suffix = j.string(*s, "model.end_of_word_suffix");
  fuse_unk = j.flag(el, "fuse_unk", false, "model");
  byte_fallback = j.flag(el, "byte_fallback", false, "model");
  ignore_merges = j.flag(el, "ignore_merges", false, "model");
  parse_vocab_map(j, el);

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

// Note [Splitting SentencePiece-style words]
// Without a splitting pre-tokenizer (Llama-2, Mistral, Gemma) the BPE model gets a whole
// segment as one word, which `tokenizers` merges in one piece and which no word
// cache can reuse. A merge across the position before a "▁" that follows a
// non-"▁" character would create a token with "▁" right after another
// character; if the vocabulary has no such token (and "▁" itself is a token, so
// an unknown run cannot continue past it), no merge ever crosses there, the
// merges on each side happen in the same relative order, and splitting the word
// at those positions gives the same ids while each piece is cached like a word.
void TokenizerJson::Impl::find_split_character() {
  const std::string mark = "\xE2\x96\x81";  // U+2581
  if (model_kind != ModelKind::kBpe || byte_level || !subword_prefix.empty() || !word_suffix.empty() ||
      !vocab.contains(mark))
    return;
  for (const auto& [token, id] : vocab)
    for (std::size_t pos = token.find(mark, 1); pos != std::string::npos; pos = token.find(mark, pos + 1))
      if (token.compare(last_char_start(std::string_view(token).substr(0, pos)), mark.size(), mark) != 0) return;
  split_at_mark = true;  // model() looks for exactly these three bytes
}

void TokenizerJson::Impl::finish_model() {
  find_split_character();
  fallback_ids.fill(-1);
  for (int b = 0; b < 256; ++b)
    if (auto id = vocab_id(fmt::format("<0x{:02X}>", b))) fallback_ids[b] = *id;
  // Single characters by code point, for initial_symbols without prefix or suffix.
  char_ids_ready = model_kind == ModelKind::kBpe && subword_prefix.empty() && word_suffix.empty();
  if (char_ids_ready) {
    bmp_char_ids.assign(0x10000, -1);
    for (const auto& [token, id] : vocab) {
      if (token.empty() || utf8_len(static_cast<unsigned char>(token[0])) != token.size()) continue;
      std::size_t len;
      const char32_t c = decode_at(token, 0, &len);
      if (c < 0x10000) bmp_char_ids[c] = id;
      else astral_char_ids.emplace(c, id);
    }
  }
  if (!byte_level) return;
  const auto& abc = alphabet();
  byte_fast = model_kind == ModelKind::kBpe && subword_prefix.empty() && word_suffix.empty();
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
        for (dom::element id :
             j.array(j.member(def, "ids", where), fmt::format("{}.special_tokens.{}.ids", where, name)))
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
  DecoderStep d{};
  using K = DecoderStep::Kind;
  if (type == "Sequence") {
    std::size_t k = 0;
    for (dom::element e : j.array(j.member(el, "decoders", where), where + ".decoders"))
      parse_decoder(j, e, fmt::format("{}.decoders[{}]", where, k++));
    return;
  } else if (type == "ByteLevel") {
    d.kind = K::kByteLevel;
  } else if (type == "ByteFallback") {
    d.kind = K::kByteFallback;
  } else if (type == "Fuse") {
    d.kind = K::kFuse;
  } else if (type == "Strip") {
    d.kind = K::kStrip;
    d.content = j.string(j.member(el, "content", where), where + ".content");
    std::size_t len = 0;
    if (d.content.empty() || (decode_at(d.content, 0, &len), len != d.content.size()))
      fail(file, where + ".content", "expected a single character");
    const std::int64_t start = j.integer(j.member(el, "start", where), where + ".start");
    const std::int64_t stop = j.integer(j.member(el, "stop", where), where + ".stop");
    if (start < 0 || stop < 0) fail(file, where, "start and stop must be non-negative");
    d.start = static_cast<std::size_t>(start);
    d.stop = static_cast<std::size_t>(stop);
  } else if (type == "Replace") {
    d.kind = K::kReplace;
    d.regex = parse_pattern(j, j.member(el, "pattern", where), where + ".pattern", d.literal, true);
    d.content = j.string(j.member(el, "content", where), where + ".content");
  } else if (type == "Metaspace") {
    d.kind = K::kMetaspace;
    d.content = j.string(j.member(el, "replacement", where), where + ".replacement");
    if (auto scheme = j.optional_member(el, "prepend_scheme")) {
      const std::string v = j.string(*scheme, where + ".prepend_scheme");
      d.prepend = v == "never" ? PrependScheme::kNever : v == "first" ? PrependScheme::kFirst : PrependScheme::kAlways;
    } else {
      d.prepend = j.flag(el, "add_prefix_space", true, where) ? PrependScheme::kAlways : PrependScheme::kNever;
    }
  } else if (type == "WordPiece") {
    d.kind = K::kWordPiece;
    d.prefix = j.optional_member(el, "prefix") ? j.string(j.member(el, "prefix", where), where + ".prefix") : "##";
    d.cleanup = j.flag(el, "cleanup", true, where);
  } else if (type == "BPEDecoder") {
    d.kind = K::kBpe;
    d.prefix = j.optional_member(el, "suffix") ? j.string(j.member(el, "suffix", where), where + ".suffix") : "</w>";
  } else {
    unsupported(file, where, "decoder", type,
                "ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace, WordPiece, BPEDecoder and a Sequence of "
                "them");
  }
  decoders.push_back(std::move(d));
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
      bool ignored = false;
      if (!normalize(t.content, normalized_patterns[i], &ignored)) normalized_patterns[i] = t.content;
      if (!normalized_patterns[i].empty()) normalized_trie.insert(normalized_patterns[i], static_cast<std::int32_t>(i));
    } else {
      raw_trie.insert(t.content, static_cast<std::int32_t>(i));
    }
  }
  // A new identity, so no thread reuses its cached chunks (Note [Cached chunks]): their ids
  // depend on the added tokens and the normalizer, which are what just changed.
  instance_id = g_next_instance.fetch_add(1);
  plan_chunks();
}

// ---------------------------------------------------------------------------
// Encoding

// Applies the normalizers; returns false when `in` is unchanged (then `out` is not written).
bool TokenizerJson::Impl::normalize(std::string_view in, std::string& out, bool* start_removed) const {
  bool changed = false;
  std::string next;
  const std::span<const NormalizerStep> all(normalizers);
  for (std::size_t k = 0; k < normalizer_plan.size(); ++k) {
    const auto [b, e] = normalizer_plan[k];
    const std::string_view current = changed ? std::string_view(out) : in;
    bool step_changed;
    if (e - b == 1 && !is_fusable_map(all[b])) {
      step_changed = all[b].apply(current, next, start_removed);
    } else {
      bool removed = false;  // Note [Fused character maps]
      std::optional<bool> fused = fused_characters
                                      ? fused_one_pass(all.subspan(b, e - b), fused_tables[k], current, next, &removed)
                                      : std::nullopt;
      if (fused) {
        if (removed) *start_removed = true;
        step_changed = *fused;
      } else {
        step_changed = run_steps(all.subspan(b, e - b), current, next, start_removed);
      }
    }
    if (step_changed) {
      out.swap(next);
      changed = true;
    }
  }
  return changed;
}

void TokenizerJson::Impl::plan_normalizers() {
  normalizer_plan.clear();
  fused_tables.clear();
  for (std::size_t b = 0; b < normalizers.size();) {
    std::size_t e = b + 1;
    if (is_fusable_map(normalizers[b]) || is_nfd(normalizers[b]))
      while (e < normalizers.size() && is_fusable_map(normalizers[e])) ++e;
    normalizer_plan.emplace_back(b, e);  // a lone NFD stays itself; lone maps take the one pass too
    fused_tables.push_back(fused_maps(std::span<const NormalizerStep>(normalizers).subspan(b, e - b)));
    b = e;
  }
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
  Trie::StartFinder starts(trie, s);
  for (std::size_t pos = 0; (pos = starts.find(pos)) != std::string_view::npos;) {
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
        if (!rust_whitespace().contains(decode_at(s, p, &l))) break;
        new_start = p;
      }
      start = std::max(new_start, start_offset);
    }
    if (t.rstrip) {
      while (stop < s.size()) {
        std::size_t l;
        if (!rust_whitespace().contains(decode_at(s, stop, &l))) break;
        stop += l;
      }
    }
    if (start_offset < start) on_split(start_offset, start, -1);
    on_split(start, stop, index);
    start_offset = stop;
  }
  if (start_offset != s.size()) on_split(start_offset, s.size(), -1);
}

// Note [Cached chunks]
// Most of the work for a word is the same every time it occurs: normalizing it, splitting at its
// space, finding its pieces. For pipelines where it is safe, a segment (the text between added
// tokens) is cut before some of its spaces, and each chunk (the first one, then a space and what
// follows up to the next cut: " word") is looked up in a per-thread cache of raw chunks before
// anything else is done; the text's first chunk is cached apart, as it is encoded at the origin.
// A cut is made before a space U+0020 at p when the characters at p-2 and p+2 (where they exist)
// are "neutral", and those at p-1 and p+1 are neutral and not whitespace.
// Neutral (chunk_neutral, per tokenizer): printable ASCII, or a BMP character that every step of
// the normalizer leaves as it is (Nmt, Lowercase, StripAccents, the charsmap: unchanged; each
// normalization form: unchanged, combining class 0, second in no composition) and that is a
// grapheme cluster of its own beside such characters (Note [Lone grapheme clusters]). ASCII
// letters are neutral under Lowercase too: it maps them to letters, one by one. Then the
// segment's ids are the ids of its chunks, each encoded alone (the first one at the segment's
// origin, the others not), because the five characters stay where they are at every step and:
//  - Nmt, Lowercase, StripAccents map one character at a time.
//  - NFC/NFD/NFKC/NFKD: no character around the space is changed, reordered or composed with
//    what is on the other side (the space and its neighbours are starters, second in no
//    composition), so normalizing the two sides apart gives the same text.
//  - Precompiled (only if it maps printable ASCII to itself): p-1, p and p+1 are clusters of
//    their own (their neighbours are neutral), so the clusters on each side are the same.
//  - Strip: the chunk before a cut ends with p-1, not whitespace, so only the segment's last
//    chunk can end with whitespace, as the segment does. Stripping the left side would remove the
//    space that starts a chunk: allowed only when the first pre-tokenizer drops it anyway.
//  - Replace with the regex " {2,}" (T5, SentencePiece exports): the space at a cut stands alone.
//  - The first pre-tokenizer splits at the space: Metaspace with split (the space becomes the
//    replacement, before which it splits; a chunk that starts with it gets nothing prepended
//    under any scheme, since at_origin is false), Whitespace / WhitespaceSplit /
//    BertPreTokenizer, which drop it, or an Isolated Split with one of the patterns of
//    Regex::splits_before_lone_spaces, where a match starts there (Llama-3, Qwen2, GPT-4o,
//    Tekken). Later stages see the same pieces either way; ByteLevel
//    adds its prefix space only to a piece that does not start with one.
//  - No added token matched in normalized text contains a space, so none spans a cut, and none
//    strips the whitespace beside it (rstrip would take the space of the next chunk); the model
//    sees the same words.
// Anything else (Prepend, Bert, other Replace patterns, other first stages) keeps whole
// segments. The family tests run with chunks; CachedChunksChangeNothing compares chunked and
// whole segments on random text around spaces.
void TokenizerJson::Impl::plan_chunks() {
  using K = NormalizerStep::Kind;
  chunk_cuts = false;
  for (std::size_t i = 0; i < added.size(); ++i) {
    const AddedToken& t = added[i].second;
    if (t.normalized && (normalized_patterns[i].find(' ') != std::string::npos || t.lstrip || t.rstrip)) return;
  }
  // What splits at the space first.
  const Stage* s0 = stages.empty() ? nullptr : &stages.front();
  const bool metaspace = s0 != nullptr && s0->kind == Stage::Kind::kMetaspace && s0->split;
  const bool drops_spaces =
      s0 != nullptr && s0->behavior == Behavior::kRemoved &&
      (s0->kind == Stage::Kind::kWhitespace || (s0->kind == Stage::Kind::kChars && s0->chars == &rust_whitespace()));
  // (Not ByteLevel's own regex, GPT-2 and RoBERTa: their one pass over a segment is as fast as
  // cutting it, and on text with fewer repeats the chunks' misses made them 6-8% slower.)
  const bool regex = s0 != nullptr && s0->kind == Stage::Kind::kRegex && s0->behavior == Behavior::kIsolated &&
                     !s0->invert && s0->regex.splits_before_lone_spaces();
  if (!metaspace && !drops_spaces && !regex) return;
  for (const NormalizerStep& n : normalizers) {
    switch (n.kind) {
      case K::kNmt:
      case K::kLowercase:
      case K::kStripAccents:
      case K::kForm: break;
      case K::kPrecompiled:
        if (!n.charsmap->keeps_printable_ascii()) return;
        break;
      case K::kStrip:
        if (n.left && !drops_spaces) return;
        break;
      case K::kReplace:
        if (!n.literal.empty() || n.regex_source != " {2,}") return;
        break;
      default: return;
    }
  }
  chunk_neutral = BmpBits::where(0x80, [&](char32_t c) {
    if (!lone_grapheme(c)) return false;
    for (const NormalizerStep& n : normalizers) {
      const bool kept = n.kind == K::kNmt            ? !nmt_removed().contains(c) && !nmt_to_space().contains(c)
                        : n.kind == K::kLowercase    ? !lowercase_changes().contains(c)
                        : n.kind == K::kStripAccents ? !strip_accents_marks().contains(c)
                        : n.kind == K::kForm         ? form_stable(c, n.options)
                        : n.kind == K::kPrecompiled  ? n.charsmap->keeps(c)
                                                     : true;
      if (!kept) return false;
    }
    return true;
  });
  chunk_cuts = true;
}

void TokenizerJson::Impl::encode_chunked(std::string_view segment, bool at_origin, Sink& out) const {
  const std::size_t n = segment.size();
  const CodePointSet& space = rust_whitespace();
  // Neutral (the characters two away from the space), and also not whitespace (next to it).
  const auto neutral = [&](char32_t c) { return c < 0x80 ? c >= 0x20 && c < 0x7F : chunk_neutral.contains(c); };
  const auto inner = [&](char32_t c) { return c != ' ' && neutral(c) && (c < 0x80 || !space.contains(c)); };
  std::size_t start = 0;
  bool first = true;
  const auto chunk = [&](std::size_t b, std::size_t e) {
    cached_chunk(segment.substr(b, e - b), first && at_origin, out);
    first = false;
  };
  for (std::size_t pos = 1; pos + 1 < n;) {
    const void* hit = std::memchr(segment.data() + pos, ' ', n - 1 - pos);
    if (hit == nullptr) break;
    pos = static_cast<std::size_t>(static_cast<const char*>(hit) - segment.data());
    std::size_t len;
    const std::size_t before = last_char_start(segment.substr(0, pos));
    bool cut = inner(decode_at(segment, before, &len)) &&
               (before == 0 || neutral(decode_at(segment, last_char_start(segment.substr(0, before)), &len)));
    if (cut) {
      const char32_t next = decode_at(segment, pos + 1, &len);
      cut = inner(next) && (pos + 1 + len == n || neutral(decode_at(segment, pos + 1 + len, &len)));
    }
    if (cut) {
      chunk(start, pos);
      start = pos;
    }
    ++pos;
  }
  chunk(start, n);
}

// A chunk: from the cache, or encoded and kept when it fits a slot. The first chunk of the text
// (`at_origin`: Metaspace's "first" scheme and a removed first character depend on it) is kept
// apart from the same bytes elsewhere.
void TokenizerJson::Impl::cached_chunk(std::string_view chunk, bool at_origin, Sink& out) const {
  WordCache& cache = out.cache;
  if (chunk.size() > WordCache::kMaxWord) {
    // Longer chunks (runs of CJK or Thai text) as long words; the text's first one is not kept.
    if (at_origin || chunk.size() >= LongCache::kMaxBytes) {
      encode_normalizable(chunk, at_origin, out);
      return;
    }
    if (const std::vector<std::int32_t>* hit = cache.long_chunks.find(chunk)) {
      out.ids.insert(out.ids.end(), hit->begin(), hit->end());
      return;
    }
    const std::size_t before = out.ids.size();
    encode_normalizable(chunk, false, out);
    cache.long_chunks.offer(chunk, out.ids.data() + before, out.ids.size() - before);
    return;
  }
  if (!cache.chunks) {
    cache.chunks = std::make_unique<WordCache::Slot[]>(WordCache::kChunkSlots);
    std::memset(static_cast<void*>(cache.chunks.get()), 0, sizeof(WordCache::Slot) * WordCache::kChunkSlots);
  }
  const std::uint64_t h = slot_hash(chunk);
  WordCache::Slot& slot = cache.chunks[h & (WordCache::kChunkSlots - 1)];
  const std::uint8_t origin = at_origin ? WordCache::Slot::kAtOrigin : 0;
  if (slot.holds(h, chunk, origin)) {
    // push_back, not insert: a second user of insert of int32 ranges makes the compiler stop
    // inlining it into model_piece's hit path (several percent on every tokenizer).
    for (std::size_t k = 0; k < slot.n; ++k) out.ids.push_back(slot.ids[k]);
    return;
  }
  const std::size_t before = out.ids.size();
  encode_normalizable(chunk, at_origin, out);
  const std::size_t n = out.ids.size() - before;
  if (n <= WordCache::kMaxIds) slot.keep(h, chunk, out.ids.data() + before, n, origin);
}

void TokenizerJson::Impl::encode(std::string_view text, std::vector<std::int64_t>& out) const {
  if (!simdjson::validate_utf8(text.data(), text.size())) {
    const std::string fixed = utf8_lossy(text);
    std::size_t bad = 0;
    while (bad < text.size() && text[bad] == fixed[bad]) ++bad;
    throw Error(fmt::format("text is not valid UTF-8 (first bad byte at offset {} of {})", bad, text.size()));
  }
  Sink sink{out, word_cache(instance_id)};
  split_added(text, raw_trie, [&](std::size_t b, std::size_t e, std::int32_t index) {
    if (index >= 0) out.push_back(added[index].first);
    else if (e > b && chunk_cuts && chunking) encode_chunked(text.substr(b, e - b), b == 0, sink);
    else if (e > b) encode_normalizable(text.substr(b, e - b), b == 0, sink);
  });
}

void TokenizerJson::Impl::encode_normalizable(std::string_view segment, bool at_origin, Sink& out) const {
  std::string normalized;
  std::string_view view = segment;
  bool start_removed = false;
  if (!normalizers.empty() && normalize(segment, normalized, &start_removed)) view = normalized;
  at_origin = at_origin && !start_removed;
  split_added(view, normalized_trie, [&](std::size_t b, std::size_t e, std::int32_t index) {
    if (index >= 0) out.ids.push_back(added[index].first);
    else if (e > b) pre_tokenize(view.substr(b, e - b), 0, at_origin && b == 0, out);
  });
}

// `at_origin`: the piece starts at offset 0 of the original text (Metaspace's "first" scheme).
void TokenizerJson::Impl::pre_tokenize(std::string_view piece, std::size_t stage, bool at_origin, Sink& out) const {
  if (stage == stages.size()) {
    if (byte_level) byte_level_stage(piece, out);
    else model(piece, out);
    return;
  }
  const Stage& st = stages[stage];
  if (st.kind == Stage::Kind::kMetaspace) {
    auto next = [&](std::string_view word, bool first) { pre_tokenize(word, stage + 1, at_origin && first, out); };
    if (fused_splits && !piece.empty() && metaspace_in_place(st))
      metaspace_in_place(st, piece, at_origin, next);  // Note [Metaspace without a copy]
    else metaspace_by_replacing(st, piece, at_origin, next);
    return;
  }
  if (fused_splits && split_runs[stage].end > stage) {  // Note [One pass for character splits]
    const CharSplitRun& run = split_runs[stage];
    split_chars_one_pass(run, piece, [&](std::size_t b, std::size_t e) {
      pre_tokenize(piece.substr(b, e - b), run.end, at_origin && b == 0, out);
    });
    return;
  }
  split_one_stage(st, piece, [&](std::size_t b, std::size_t e) {
    pre_tokenize(piece.substr(b, e - b), stage + 1, at_origin && b == 0, out);
  });
}

void TokenizerJson::Impl::byte_level_stage(std::string_view piece, Sink& out) const {
  std::string prefixed;
  std::string_view view = piece;
  if (byte_level_prefix_space && !piece.starts_with(' ')) {
    prefixed.reserve(piece.size() + 1);
    prefixed += ' ';
    prefixed += piece;
    view = prefixed;
  }
  if (!byte_level_use_regex) {
    after_byte_level(view, out);
    return;
  }
  std::size_t prev = 0;
  gpt2_regex.for_each_match(view, [&](std::size_t s, std::size_t e) {
    if (prev != s) after_byte_level(view.substr(prev, s - prev), out);
    if (e > s) after_byte_level(view.substr(s, e - s), out);
    prev = e;
  });
  if (prev < view.size()) after_byte_level(view.substr(prev), out);
}

// Note [Pre-tokenizers after ByteLevel]
// `tokenizers` runs a pre-tokenizer sequence in order on the pieces' current text, and ByteLevel
// replaces each piece's text by its byte-level characters (one per UTF-8 byte: 'Ġ' for a space, '²'
// for the byte 0xB2, ...). So a stage after it (Falcon: Digits, then a Split of three digits) sees
// those characters: Digits splits off '²', '³', '¹', '¼', '½', '¾' even where they stand for bytes
// inside another character. Such stages run here on the mapped text; each piece they leave is a run
// of whole characters, that is of whole bytes, which go to the model as bytes (it maps them again).
void TokenizerJson::Impl::after_byte_level(std::string_view raw, Sink& out) const {
  if (post_stages.empty() || raw.empty()) {
    model(raw, out);
    return;
  }
  const auto& abc = alphabet();
  std::string mapped;
  std::vector<std::uint32_t> at;  // at[k]: the raw byte that mapped byte k belongs to; at[size] = raw.size()
  mapped.reserve(2 * raw.size());
  at.reserve(2 * raw.size() + 1);
  for (std::size_t i = 0; i < raw.size(); ++i) {
    const std::string& c = abc.byte_to_utf8[static_cast<unsigned char>(raw[i])];
    mapped += c;
    at.insert(at.end(), c.size(), static_cast<std::uint32_t>(i));
  }
  at.push_back(static_cast<std::uint32_t>(raw.size()));
  post_split(raw, mapped, at, 0, mapped.size(), 0, out);
}

void TokenizerJson::Impl::post_split(std::string_view raw, std::string_view mapped,
                                     const std::vector<std::uint32_t>& at, std::size_t b, std::size_t e,
                                     std::size_t stage, Sink& out) const {
  if (stage == post_stages.size()) {
    model(raw.substr(at[b], at[e] - at[b]), out);
    return;
  }
  split_one_stage(post_stages[stage], mapped.substr(b, e - b),
                  [&](std::size_t sb, std::size_t se) { post_split(raw, mapped, at, b + sb, b + se, stage + 1, out); });
}

void TokenizerJson::Impl::model(std::string_view word, Sink& out) const {
  if (word.empty()) return;
  if (split_at_mark) {
    // Note [Splitting SentencePiece-style words]: no merge can cross these boundaries. The mark is
    // always U+2581 (E2 96 81): found by its first byte, without a general substring search.
    const char* p = word.data();
    const std::size_t n = word.size();
    auto next_mark = [&](std::size_t from) -> std::size_t {
      while (from + 3 <= n) {
        const void* hit = std::memchr(p + from, '\xE2', n - from - 2);
        if (hit == nullptr) return std::string_view::npos;
        const auto at = static_cast<std::size_t>(static_cast<const char*>(hit) - p);
        if (p[at + 1] == '\x96' && p[at + 2] == '\x81') return at;
        from = at + 1;
      }
      return std::string_view::npos;
    };
    std::size_t start = 0;
    for (std::size_t pos = next_mark(1); pos != std::string_view::npos; pos = next_mark(pos + 3)) {
      if (pos >= 3 && p[pos - 3] == '\xE2' && p[pos - 2] == '\x96' && p[pos - 1] == '\x81')
        continue;  // inside a run of replacement characters
      model_piece(word.substr(start, pos - start), out);
      start = pos;
    }
    model_piece(word.substr(start), out);
    return;
  }
  model_piece(word, out);
}

void TokenizerJson::Impl::model_piece(std::string_view word, Sink& out) const {
  WordCache& cache = out.cache;
  WordCache::Slot* slot = nullptr;
  std::uint64_t h = 0;
  if (word.size() <= WordCache::kMaxWord) {
    h = slot_hash(word);
    slot = &cache.slots[h & (WordCache::kSlots - 1)];
    if (slot->holds(h, word)) {
      out.ids.insert(out.ids.end(), slot->ids, slot->ids + slot->n);
      return;
    }
  }
  // A word too long for a slot, or whose ids are (a short word of many characters, e.g. CJK
  // with a small vocabulary: `tokenizers` caches every word under 256 bytes).
  const bool cacheable = word.size() < LongCache::kMaxBytes;
  if (cacheable) {
    if (const std::vector<std::int32_t>* hit = cache.long_words.find(word)) {
      out.ids.insert(out.ids.end(), hit->begin(), hit->end());
      return;
    }
  }
  std::vector<std::int32_t>& ids = cache.scratch;
  ids.clear();
  tokenize_word(word, ids);
  out.ids.insert(out.ids.end(), ids.begin(), ids.end());
  if (slot != nullptr && ids.size() <= WordCache::kMaxIds) {
    slot->keep(h, word, ids.data(), ids.size());
  } else if (cacheable) {
    cache.long_words.offer(word, ids.data(), ids.size());
  }
}

// One pre-token through the model. In byte-level mode `word` holds raw bytes;
// the vocabulary is keyed by their byte-level characters.
void TokenizerJson::Impl::tokenize_word(std::string_view word, std::vector<std::int32_t>& ids) const {
  if (byte_level && model_kind == ModelKind::kBpe) {
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
    merge(ids);
    return;
  }
  std::string chars;
  if (byte_level) {
    for (char c : word) chars += alphabet().byte_to_utf8[static_cast<unsigned char>(c)];
    word = chars;
  }
  switch (model_kind) {
    case ModelKind::kBpe:
      if (ignore_merges) {
        if (auto id = vocab_id(word)) {
          ids.push_back(*id);
          return;
        }
      }
      initial_symbols(word, ids);
      merge(ids);
      return;
    case ModelKind::kUnigram: unigram(word, ids); return;
    case ModelKind::kWordPiece: wordpiece(word, ids); return;
    case ModelKind::kWordLevel:
      if (auto id = vocab_id(word)) ids.push_back(*id);
      else ids.push_back(required_unk("WordLevel"));
      return;
  }
}

// BPE::merge_word before merging: one symbol per character (with the subword
// prefix / word suffix), byte fallback, and unknown-token handling.
void TokenizerJson::Impl::initial_symbols(std::string_view w, std::vector<std::int32_t>& syms) const {
  std::optional<std::int32_t> unk;  // a pending unknown symbol
  std::string s;
  for (std::size_t i = 0; i < w.size();) {
    std::size_t len;
    std::optional<std::int32_t> id;
    if (char_ids_ready) {
      const char32_t c = decode_at(w, i, &len);
      std::int32_t found = -1;
      if (c < 0x10000) {
        found = bmp_char_ids[c];
      } else if (auto it = astral_char_ids.find(c); it != astral_char_ids.end()) {
        found = it->second;
      }
      if (found >= 0) id = found;
      else s.assign(w.substr(i, len));  // for byte fallback
    } else {
      len = utf8_len(static_cast<unsigned char>(w[i]));
      const bool is_first = i == 0, is_last = i + len >= w.size();
      s.clear();
      if (!is_first) s += subword_prefix;
      s.append(w.substr(i, len));
      if (is_last) s += word_suffix;
      id = vocab_id(s);
    }
    i += len;
    if (id) {
      if (unk) syms.push_back(*unk);
      unk.reset();
      syms.push_back(*id);
      continue;
    }
    if (byte_fallback) {
      const std::size_t before = syms.size();
      bool all = true;
      for (char c : s) {
        const std::int32_t id = fallback_ids[static_cast<unsigned char>(c)];
        if (id < 0) {
          all = false;
          break;
        }
        syms.push_back(id);
      }
      if (all) continue;  // a pending unk stays pending, as in the library
      syms.resize(before);
    }
    if (unk_token) {
      const std::int32_t unk_id_ = *vocab_id(*unk_token);
      if (unk && !fuse_unk) syms.push_back(*unk);
      if (!unk || !fuse_unk) unk = unk_id_;
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
  // Symbols as a linked list (id -1: merged into its left neighbour); candidates keyed by
  // rank << 32 | position, so the heap pops the lowest rank, leftmost first. A candidate remembers
  // the pair it was made for: while both ids are unchanged it is still valid without a lookup;
  // otherwise it is valid when the pair there now merges into the same id, as in Word::merge_all.
  struct Sym {
    std::int32_t id, prev, next;
  };
  struct Cand {
    std::uint64_t key;
    std::int32_t new_id, left, right;
  };
  auto later = [](const Cand& a, const Cand& b) { return a.key > b.key; };
  thread_local std::vector<Sym> s;  // scratch, reused across words
  thread_local std::vector<Cand> heap;
  if (syms.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    throw Error(fmt::format("a pre-token of {} symbols is too long to merge", syms.size()));
  const auto n = static_cast<std::int32_t>(syms.size());
  s.resize(syms.size());
  for (std::int32_t i = 0; i < n; ++i) s[i] = {syms[i], i - 1, i + 1 < n ? i + 1 : -1};
  auto candidate = [&](std::int32_t pos, Cand& c) {
    const std::int32_t left = s[pos].id, right = s[s[pos].next].id;
    auto it = merges.find((static_cast<std::uint64_t>(left) << 32) | static_cast<std::uint32_t>(right));
    if (it == merges.end()) return false;
    c = {(it->second >> 32) << 32 | static_cast<std::uint32_t>(pos),
         static_cast<std::int32_t>(it->second & 0xFFFFFFFFu), left, right};
    return true;
  };
  heap.clear();
  Cand c;
  for (std::int32_t i = 0; i + 1 < n; ++i)
    if (candidate(i, c)) heap.push_back(c);
  std::make_heap(heap.begin(), heap.end(), later);
  auto push = [&](std::int32_t pos) {
    if (s[pos].next >= 0 && candidate(pos, c)) {
      heap.push_back(c);
      std::push_heap(heap.begin(), heap.end(), later);
    }
  };
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Cand top = heap.back();
    heap.pop_back();
    const auto pos = static_cast<std::int32_t>(top.key & 0xFFFFFFFFu);
    Sym& left = s[pos];
    if (left.id < 0 || left.next < 0) continue;
    Sym& right = s[left.next];
    if (left.id != top.left || right.id != top.right) {
      auto it = merges.find((static_cast<std::uint64_t>(left.id) << 32) | static_cast<std::uint32_t>(right.id));
      if (it == merges.end() || static_cast<std::int32_t>(it->second & 0xFFFFFFFFu) != top.new_id) continue;  // stale
    }
    left.id = top.new_id;
    right.id = -1;
    left.next = right.next;
    if (right.next >= 0) s[right.next].prev = pos;
    if (left.prev >= 0) push(left.prev);
    push(pos);
  }
  syms.clear();
  for (std::int32_t i = 0; i < n; ++i)
    if (s[i].id >= 0) syms.push_back(s[i].id);
  if (n > (1 << 20)) {  // do not keep the buffers of a huge word for the thread's lifetime
    std::vector<Sym>().swap(s);
    std::vector<Cand>().swap(heap);
  }
}

// Unigram::encode (the Viterbi search of `encode_optimized`) and tokenize:
// best path over the pieces that start at each character, an unknown node
// (score min_score - 10) where no single-character piece exists, unknown
// pieces fused, and unmatched strings through byte fallback or the unk id.
void TokenizerJson::Impl::unigram(std::string_view w, std::vector<std::int32_t>& ids) const {
  struct Node {
    std::int32_t id = 0;
    double score = 0;
    std::int64_t starts_at = -1;
  };
  const std::size_t n = w.size();
  thread_local std::vector<Node> best;  // scratch, reused across words
  best.assign(n + 1, Node{});
  for (std::size_t at = 0; at < n;) {
    const double till_here = best[at].score;
    const std::size_t mblen = utf8_len(static_cast<unsigned char>(w[at]));
    bool has_single = false;
    pieces.prefixes(w, at, [&](std::size_t length, std::int32_t id) {
      Node& target = best[at + length];
      const double candidate = scores[static_cast<std::size_t>(id)] + till_here;
      if (target.starts_at < 0 || candidate > target.score) {
        target.score = candidate;
        target.starts_at = static_cast<std::int64_t>(at);
        target.id = id;
      }
      if (length == mblen) has_single = true;
    });
    if (!has_single) {
      Node& target = best[at + mblen];
      const double candidate = unk_score + till_here;
      if (target.starts_at < 0 || candidate > target.score) {
        if (!unk_id)
          throw Error(fmt::format("{}: the Unigram model has no unk_id, but '{}' is not in its pieces", file.string(),
                                  w.substr(at, mblen)));
        target.score = candidate;
        target.starts_at = static_cast<std::int64_t>(at);
        target.id = *unk_id;
      }
    }
    at += mblen;
  }
  // Backtrack; consecutive unknown nodes fuse into one string of their characters. Pieces as
  // (text, id): id < 0 for a run of unknown characters, whose string goes through the vocabulary
  // (and byte fallback) as tokenizers does; a piece's id is its trie id, which is the vocabulary's
  // id of its text (both keep the last of duplicate pieces).
  thread_local std::vector<std::pair<std::string_view, std::int32_t>> strings;
  strings.clear();
  std::size_t unk_end = 0;
  bool in_unk = false;
  for (std::size_t end = n; end > 0;) {
    const Node& node = best[end];
    const auto start = static_cast<std::size_t>(node.starts_at);
    if (unk_id && node.id == *unk_id) {
      if (!in_unk) unk_end = end;
      in_unk = true;
    } else {
      if (in_unk) {
        strings.emplace_back(w.substr(end, unk_end - end), -1);
        in_unk = false;
      }
      strings.emplace_back(std::string_view(), node.id);
    }
    end = start;
  }
  if (in_unk) strings.emplace_back(w.substr(0, unk_end), -1);
  for (std::size_t k = strings.size(); k-- > 0;) {
    const auto [s, piece] = strings[k];
    if (piece >= 0) {
      ids.push_back(piece);
      continue;
    }
    if (auto id = vocab_id(s)) {
      ids.push_back(*id);
      continue;
    }
    if (byte_fallback) {
      const std::size_t before = ids.size();
      bool all = true;
      for (char c : s) {
        const std::int32_t id = fallback_ids[static_cast<unsigned char>(c)];
        if (id < 0) {
          all = false;
          break;
        }
        ids.push_back(id);
      }
      if (all) continue;
      ids.resize(before);
    }
    if (!unk_id) throw Error(fmt::format("{}: the Unigram model has no unk_id for '{}'", file.string(), s));
    ids.push_back(*unk_id);
  }
}

// WordPiece::tokenize: greedy longest-match-first; a word longer than
// max_input_chars_per_word characters, or one that cannot be covered, is one unk.
void TokenizerJson::Impl::wordpiece(std::string_view w, std::vector<std::int32_t>& ids) const {
  if (count_chars(w) > max_input_chars_per_word) {
    ids.push_back(required_unk("WordPiece"));
    return;
  }
  const std::size_t before = ids.size();
  std::string candidate;
  for (std::size_t start = 0; start < w.size();) {
    std::size_t end = w.size();
    std::optional<std::int32_t> found;
    while (start < end) {
      candidate.clear();
      if (start > 0) candidate += subword_prefix;
      candidate.append(w.substr(start, end - start));
      if (auto id = vocab_id(candidate)) {
        found = id;
        break;
      }
      end = last_char_start(w.substr(0, end));
    }
    if (!found) {
      ids.resize(before);
      ids.push_back(required_unk("WordPiece"));
      return;
    }
    ids.push_back(*found);
    start = end;
  }
}

// ---------------------------------------------------------------------------
// Decoding

namespace {

// The WordPiece decoder's clean-up (tokenizers' decoders::wordpiece::cleanup).
std::string wordpiece_cleanup(std::string s) {
  static const std::pair<std::string_view, std::string_view> kRules[] = {
      {" .", "."},   {" ?", "?"},           {" !", "!"},   {" ,", ","},     {" ' ", "'"},   {" n't", "n't"},
      {" 'm", "'m"}, {" do not", " don't"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  for (const auto& [from, to] : kRules) {
    std::string out;
    std::size_t pos = 0;
    for (std::size_t hit = s.find(from); hit != std::string::npos; hit = s.find(from, pos)) {
      out.append(s, pos, hit - pos);
      out += to;
      pos = hit + from.size();
    }
    out.append(s, pos);
    s = std::move(out);
  }
  return s;
}

std::string replace_all(std::string_view in, const std::string& literal, const Regex& regex, const std::string& with) {
  std::string out;
  std::size_t prev = 0;
  auto on_match = [&](std::size_t s, std::size_t e) {
    out.append(in, prev, s - prev);
    out += with;
    prev = e;
  };
  if (regex) {
    regex.for_each_match(in, on_match);
  } else if (!literal.empty()) {
    for (std::size_t pos = in.find(literal); pos != std::string_view::npos;
         pos = in.find(literal, pos + literal.size()))
      on_match(pos, pos + literal.size());
  }
  out.append(in, prev, std::string_view::npos);
  return out;
}

// "<0xNN>" -> NN, as u8::from_str_radix on the two characters after "<0x".
std::optional<unsigned char> byte_token(const std::string& t) {
  if (t.size() != 6 || !t.starts_with("<0x") || t[5] != '>') return std::nullopt;
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const char a = t[3], b = t[4];
  if (a == '+' && digit(b) >= 0) return static_cast<unsigned char>(digit(b));
  if (digit(a) < 0 || digit(b) < 0) return std::nullopt;
  return static_cast<unsigned char>(digit(a) * 16 + digit(b));
}

}  // namespace

std::string TokenizerJson::Impl::decode_tokens(std::vector<std::string> tokens) const {
  using K = DecoderStep::Kind;
  if (!has_decoder) {
    std::string out;
    for (std::size_t k = 0; k < tokens.size(); ++k) {
      if (k > 0) out += ' ';
      out += tokens[k];
    }
    return out;
  }
  const auto& abc = alphabet();
  for (const DecoderStep& d : decoders) {
    std::vector<std::string> next;
    switch (d.kind) {
      case K::kByteLevel: {
        std::string bytes;
        for (const std::string& t : tokens) {
          if (auto raw = abc.to_bytes(t)) bytes += *raw;
          else bytes += t;
        }
        next.push_back(utf8_lossy(bytes));
        break;
      }
      case K::kByteFallback: {
        std::string pending;
        auto flush = [&] {
          if (pending.empty()) return;
          if (simdjson::validate_utf8(pending.data(), pending.size())) next.push_back(pending);
          else
            for (std::size_t k = 0; k < pending.size(); ++k) next.emplace_back("\xEF\xBF\xBD");
          pending.clear();
        };
        for (std::string& t : tokens) {
          if (auto b = byte_token(t)) {
            pending += static_cast<char>(*b);
          } else {
            flush();
            next.push_back(std::move(t));
          }
        }
        flush();
        break;
      }
      case K::kFuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        next.push_back(std::move(all));
        break;
      }
      case K::kStrip: {
        std::size_t clen = 0;
        const char32_t content = decode_at(d.content, 0, &clen);
        for (const std::string& t : tokens) {
          std::vector<std::size_t> starts;  // byte offset of each character
          for (std::size_t i = 0; i < t.size(); i += utf8_len(static_cast<unsigned char>(t[i]))) starts.push_back(i);
          auto char_at = [&](std::size_t k) {
            std::size_t len;
            return decode_at(t, starts[k], &len);
          };
          std::size_t start_cut = 0, stop_cut = starts.size();
          while (start_cut < d.start && start_cut < starts.size() && char_at(start_cut) == content) ++start_cut;
          for (std::size_t k = 0; k < d.stop && stop_cut > 0 && char_at(stop_cut - 1) == content; ++k) --stop_cut;
          // tokenizers indexes chars.len() - i - 1 for i < stop: it panics when stop exceeds a token made of
          // the content character only, and when the cuts cross.
          if (stop_cut < start_cut || (stop_cut == 0 && d.stop > starts.size()))
            throw Error(
                fmt::format("{}: the Strip decoder cannot strip '{}' (tokenizers panics on it)", file.string(), t));
          const std::size_t b = start_cut < starts.size() ? starts[start_cut] : t.size();
          const std::size_t e = stop_cut < starts.size() ? starts[stop_cut] : t.size();
          next.push_back(t.substr(b, e - b));
        }
        break;
      }
      case K::kReplace:
        for (const std::string& t : tokens) next.push_back(replace_all(t, d.literal, d.regex, d.content));
        break;
      case K::kMetaspace:
        for (std::size_t k = 0; k < tokens.size(); ++k) {
          std::string out;
          const std::string& t = tokens[k];
          for (std::size_t pos = 0; pos < t.size();) {
            if (t.compare(pos, d.content.size(), d.content) == 0) {
              if (k != 0 || d.prepend == PrependScheme::kNever) out += ' ';
              pos += d.content.size();
            } else {
              out += t[pos++];
            }
          }
          next.push_back(std::move(out));
        }
        break;
      case K::kWordPiece:
        for (std::size_t k = 0; k < tokens.size(); ++k) {
          std::string t = std::move(tokens[k]);
          if (k != 0) {
            if (t.starts_with(d.prefix)) t.erase(0, d.prefix.size());
            else t.insert(0, " ");
          }
          next.push_back(d.cleanup ? wordpiece_cleanup(std::move(t)) : std::move(t));
        }
        break;
      case K::kBpe:
        for (std::size_t k = 0; k < tokens.size(); ++k)
          next.push_back(replace_all(tokens[k], d.prefix, Regex(), k + 1 == tokens.size() ? "" : " "));
        break;
    }
    tokens = std::move(next);
  }
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
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

void TokenizerJson::set_byte_level_add_prefix_space_everywhere(bool value) {
  if (impl_->byte_level) impl_->byte_level_prefix_space = value;
}

bool TokenizerJson::configure_bert_normalizer(bool lowercase, std::optional<bool> strip_accents, bool chinese) {
  if (!impl_->top_level_bert) return false;
  NormalizerStep& n = impl_->normalizers.front();
  if (n.lowercase == lowercase && n.strip_accents_given == strip_accents && n.chinese == chinese) return true;
  n.lowercase = lowercase;
  n.strip_accents_given = strip_accents;
  n.strip_accents = strip_accents.value_or(lowercase);
  n.chinese = chinese;
  impl_->rebuild_tries();  // normalized added tokens are matched in their normalized form
  return true;
}

bool TokenizerJson::chunked() const { return impl_->chunk_cuts && impl_->chunking; }
void TokenizerJson::set_chunked(bool on) { impl_->chunking = on; }

void TokenizerJson::set_template(std::vector<std::int64_t> prefix, std::vector<std::int64_t> suffix) {
  prefix_ = std::move(prefix);
  suffix_ = std::move(suffix);
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
  if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end())
    return impl_->added[it->second].second.content;
  if (id >= 0 && static_cast<std::size_t>(id) < impl_->vocab_r.size() && impl_->vocab_r_present[id])
    return impl_->vocab_r[id];
  return std::nullopt;
}

std::string TokenizerJson::decode(std::span<const std::int64_t> ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (std::size_t k = 0; k < ids.size(); ++k) {
    auto token = id_to_token(ids[k]);
    if (!token)
      throw Error(fmt::format("decode: id {} (position {}) is not in the vocabulary of {}", ids[k], k, file_.string()));
    tokens.push_back(std::move(*token));
  }
  return impl_->decode_tokens(std::move(tokens));
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

std::string unicode_normalize(std::string_view text, std::string_view form) {
  std::string out;
  return normalize_form(text, normalization_form_options(form), out) ? out : std::string(text);
}

std::string bert_normalize(std::string_view text, bool strip_accents, bool lowercase, bool one_pass,
                           bool* start_removed) {
  NormalizerStep n;
  n.kind = NormalizerStep::Kind::kBert;
  n.strip_accents = strip_accents;
  n.lowercase = lowercase;
  thread_local std::map<std::pair<bool, bool>, std::shared_ptr<const CharTable>> tables;  // tests call this often
  auto& table = tables[{strip_accents, lowercase}];
  if (!table) table = bert_char_table(n);
  n.bert_table = table;
  std::string out;
  *start_removed = false;
  std::optional<bool> changed;
  if (one_pass) changed = bert_one_pass(n, text, out, start_removed);
  if (!changed) changed = bert_four_passes(n, text, out, start_removed);
  return *changed ? out : std::string(text);
}

std::string normalize_steps(std::span<const std::string_view> steps, std::string_view text, bool fused,
                            bool* start_removed, bool* one_pass) {
  using K = NormalizerStep::Kind;
  std::vector<NormalizerStep> list;
  for (std::string_view name : steps) {
    NormalizerStep n;
    if (name == "NFD") n.options = normalization_form_options("NFD");
    else if (name == "StripAccents") n.kind = K::kStripAccents;
    else if (name == "Lowercase") n.kind = K::kLowercase;
    else if (name == "Nmt") n.kind = K::kNmt;
    else throw Error(fmt::format("normalize_steps: unknown step '{}'", name));
    list.push_back(std::move(n));
  }
  std::string out;
  *start_removed = false;
  std::optional<bool> changed;
  if (fused) {
    thread_local std::map<std::string, FusedMaps> tables;  // tests call this millions of times per chain
    std::string name;
    for (std::string_view step : steps) (name += step) += '+';
    auto it = tables.find(name);
    if (it == tables.end()) it = tables.emplace(name, fused_maps(list)).first;
    changed = fused_one_pass(list, it->second, text, out, start_removed);
  }
  if (one_pass != nullptr) *one_pass = changed.has_value();
  if (!changed) changed = run_steps(list, text, out, start_removed);
  return *changed ? out : std::string(text);
}

std::vector<std::pair<std::string, bool>> metaspace_words(std::string_view text, std::string_view replacement,
                                                          std::string_view scheme, bool split, bool at_origin,
                                                          bool in_place) {
  Stage st;
  st.kind = Stage::Kind::kMetaspace;
  st.replacement = std::string(replacement);
  st.prepend = scheme == "always"  ? PrependScheme::kAlways
               : scheme == "first" ? PrependScheme::kFirst
                                   : PrependScheme::kNever;
  st.split = split;
  std::vector<std::pair<std::string, bool>> words;
  auto emit = [&](std::string_view w, bool first) { words.emplace_back(std::string(w), first); };
  if (in_place && !text.empty() && metaspace_in_place(st)) metaspace_in_place(st, text, at_origin, emit);
  else metaspace_by_replacing(st, text, at_origin, emit);
  return words;
}

std::vector<std::string> split_characters(std::span<const std::string_view> stages, std::string_view text,
                                          bool one_pass) {
  std::vector<Stage> list;
  for (std::string_view name : stages) {
    Stage s;
    s.kind = Stage::Kind::kChars;
    if (name == "WhitespaceSplit") {
      s.chars = &rust_whitespace();
      s.behavior = Behavior::kRemoved;
    } else if (name.starts_with("Punctuation")) {
      s.chars = &bert_punctuation();
      s.behavior = name.ends_with("Removed")      ? Behavior::kRemoved
                   : name.ends_with("Contiguous") ? Behavior::kContiguous
                                                  : Behavior::kIsolated;
    } else if (name.starts_with("Digits")) {
      s.chars = &rust_numeric();
      s.behavior = name.ends_with("Individual") ? Behavior::kIsolated : Behavior::kContiguous;
    } else if (name.starts_with("CharDelimiterSplit:")) {
      std::size_t len;
      s.delimiter = decode_at(name, name.find(':') + 1, &len);
      s.behavior = Behavior::kRemoved;
    } else {
      throw Error(fmt::format("split_characters: unknown stage '{}'", name));
    }
    list.push_back(s);
  }
  std::vector<std::string> pieces;
  if (one_pass) {
    const CharSplitRun run = char_split_run(list, 0);
    if (run.end != list.size()) throw Error("split_characters: not one run");
    split_chars_one_pass(run, text, [&](std::size_t b, std::size_t e) { pieces.emplace_back(text.substr(b, e - b)); });
    return pieces;
  }
  auto stage_by_stage = [&](auto& self, std::string_view piece, std::size_t k) -> void {
    if (k == list.size()) {
      pieces.emplace_back(piece);
      return;
    }
    split_one_stage(list[k], piece, [&](std::size_t b, std::size_t e) { self(self, piece.substr(b, e - b), k + 1); });
  };
  stage_by_stage(stage_by_stage, text, 0);
  return pieces;
}

}  // namespace modalities::plugins::hf_tokenizer
