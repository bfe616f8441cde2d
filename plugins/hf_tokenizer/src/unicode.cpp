// UTF-8 helpers, code point sets, the per-component Unicode tables and
// normalization. See Note [One Unicode table per component] in unicode.h.
#include "unicode.h"

#include <modalities/sdk/error.h>

#include <fmt/format.h>
#include <utf8proc.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>

namespace modalities::plugins::hf_tokenizer {

std::size_t count_chars(std::string_view s) {
  std::size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

// ---------------------------------------------------------------------------
// CodePointSet

CodePointSet::CodePointSet(std::span<const CodePointRange> ranges) : bmp_(1024, 0) {
  ranges_.reserve(ranges.size());
  for (const auto& r : ranges) ranges_.emplace_back(r.first, r.last);
  *this = from_ranges(std::move(ranges_));
}

CodePointSet CodePointSet::from_ranges(std::vector<std::pair<char32_t, char32_t>> ranges) {
  std::sort(ranges.begin(), ranges.end());
  CodePointSet s;
  for (const auto& [a, b] : ranges) {
    if (b < a) continue;
    if (!s.ranges_.empty() && a <= s.ranges_.back().second + 1)
      s.ranges_.back().second = std::max(s.ranges_.back().second, b);
    else s.ranges_.emplace_back(a, b);
  }
  for (const auto& [a, b] : s.ranges_)
    for (char32_t c = a; c <= std::min<char32_t>(b, 0xFFFF); ++c) s.bmp_[c >> 6] |= std::uint64_t{1} << (c & 63);
  // The code points each UTF-8 lead byte starts: [lo, hi].
  auto intersects = [&](char32_t lo, char32_t hi) {
    return std::any_of(s.ranges_.begin(), s.ranges_.end(),
                       [&](const auto& r) { return r.first <= hi && r.second >= lo; });
  };
  for (unsigned b = 0; b < 256; ++b) {
    bool any = false;
    if (b < 0x80) any = intersects(b, b);
    else if (b >= 0xC2 && b <= 0xDF) any = intersects((b & 0x1F) << 6, ((b & 0x1F) << 6) | 0x3F);
    else if (b >= 0xE0 && b <= 0xEF) any = intersects((b & 0x0F) << 12, ((b & 0x0F) << 12) | 0xFFF);
    else if (b >= 0xF0 && b <= 0xF4) any = intersects((b & 0x07) << 18, ((b & 0x07) << 18) | 0x3FFFF);
    s.lead_[b] = any;
  }
  int lo = -1, hi = -1, members = 0;
  for (int c = 0; c < 0x80; ++c)
    if (s.contains(static_cast<char32_t>(c))) {
      if (lo < 0) lo = c;
      hi = c;
      ++members;
    }
  s.ascii_range_ = members == hi - lo + 1 || members == 0;
  if (members > 0 && s.ascii_range_) {
    s.ascii_lo_ = static_cast<unsigned char>(lo);
    s.ascii_hi_ = static_cast<unsigned char>(hi);
  }
  return s;
}

bool CodePointSet::contains_astral(char32_t c) const {
  auto it = std::upper_bound(ranges_.begin(), ranges_.end(), c,
                             [](char32_t v, const std::pair<char32_t, char32_t>& r) { return v < r.first; });
  return it != ranges_.begin() && c <= std::prev(it)->second;
}

CodePointSet CodePointSet::complement() const {
  std::vector<std::pair<char32_t, char32_t>> out;
  char32_t next = 0;
  for (const auto& [a, b] : ranges_) {
    if (a > next) out.emplace_back(next, a - 1);
    next = b + 1;
  }
  if (next <= 0x10FFFF) out.emplace_back(next, 0x10FFFF);
  return from_ranges(std::move(out));
}

CodePointSet CodePointSet::operator|(const CodePointSet& o) const {
  auto all = ranges_;
  all.insert(all.end(), o.ranges_.begin(), o.ranges_.end());
  return from_ranges(std::move(all));
}

CodePointSet CodePointSet::operator^(const CodePointSet& o) const {
  // Boundary sweep: a code point is in the result when it is in exactly one set.
  std::vector<std::pair<char32_t, int>> events;
  for (const auto* set : {this, &o})
    for (const auto& [a, b] : set->ranges_) {
      events.emplace_back(a, 1);
      events.emplace_back(b + 1, -1);
    }
  std::sort(events.begin(), events.end());
  std::vector<std::pair<char32_t, char32_t>> out;
  int depth = 0;
  for (std::size_t k = 0; k < events.size();) {
    const char32_t at = events[k].first;
    const bool was_in = depth == 1;
    while (k < events.size() && events[k].first == at) depth += events[k++].second;
    const bool is_in = depth == 1;
    if (!was_in && is_in) out.emplace_back(at, 0);
    if (was_in && !is_in) out.back().second = at - 1;
  }
  return from_ranges(std::move(out));
}

std::size_t CodePointSet::find_in(std::string_view s) const {
  // Eight bytes at a time while they are ASCII outside [ascii_lo_, ascii_hi_] (most text, and
  // Regex::pick scans every text): for a byte v < 0x80, v + (0x80 - lo) has its high bit set iff
  // v >= lo, and v + (0x7F - hi) iff v > hi, without carries between bytes.
  constexpr std::uint64_t kOnes = 0x0101010101010101ull, kHigh = 0x8080808080808080ull;
  const std::uint64_t add_lo = kOnes * static_cast<std::uint64_t>(0x80 - ascii_lo_);
  const std::uint64_t add_hi = kOnes * static_cast<std::uint64_t>(0x7F - ascii_hi_);
  const bool empty_range = ascii_lo_ > ascii_hi_;
  const auto skippable = [&](std::uint64_t w) {
    if ((w & kHigh) != 0) return false;
    return empty_range || (((w + add_lo) & ~(w + add_hi)) & kHigh) == 0;
  };
  for (std::size_t i = 0; i < s.size();) {
    if (ascii_range_) {
      std::uint64_t w;
      while (i + 8 <= s.size() && (std::memcpy(&w, s.data() + i, 8), skippable(w))) i += 8;
      if (i == s.size()) break;
    }
    const auto b = static_cast<unsigned char>(s[i]);
    if (!lead_[b]) {  // no code point with this lead byte is in the set
      i += utf8_len(b);
      continue;
    }
    std::size_t len;
    if (contains(decode_at(s, i, &len))) return i;
    i += len;
  }
  return std::string_view::npos;
}

// ---------------------------------------------------------------------------
// The probed tables (unicode_tables.inc, generated; see unicode.h)

namespace tables {
#include "unicode_tables.inc"
}  // namespace tables

namespace {

template <std::size_t N>
CodePointSet set_of(const tables::CodePointRange (&ranges)[N]) {
  std::vector<std::pair<char32_t, char32_t>> v;
  v.reserve(N);
  for (const auto& r : ranges)
    if (r.first <= 0x10FFFF) v.emplace_back(r.first, r.last);
  return CodePointSet::from_ranges(std::move(v));
}

// Oniguruma property names are matched loosely: case, spaces, '-' and '_' do not count.
std::string loose(std::string_view name) {
  std::string out;
  for (char c : name)
    if (c != ' ' && c != '-' && c != '_') out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

struct OnigTables {
  std::map<std::string, CodePointSet, std::less<>> by_name;   // canonical name -> set
  std::map<std::string, std::string, std::less<>> canonical;  // loose alias -> canonical name
  OnigTables() {
    auto add = [&](std::string name, CodePointSet set, std::initializer_list<std::string_view> aliases) {
      canonical[loose(name)] = name;
      for (auto a : aliases) canonical[loose(a)] = name;
      by_name.emplace(std::move(name), std::move(set));
    };
    add("L", set_of(tables::kOnigL), {"Letter"});
    add("Lu", set_of(tables::kOnigLu), {"Uppercase_Letter"});
    add("Ll", set_of(tables::kOnigLl), {"Lowercase_Letter"});
    add("Lt", set_of(tables::kOnigLt), {"Titlecase_Letter"});
    add("Lm", set_of(tables::kOnigLm), {"Modifier_Letter"});
    add("Lo", set_of(tables::kOnigLo), {"Other_Letter"});
    add("M", set_of(tables::kOnigM), {"Mark", "Combining_Mark"});
    add("Mn", set_of(tables::kOnigMn), {"Nonspacing_Mark"});
    add("Mc", set_of(tables::kOnigMc), {"Spacing_Mark"});
    add("Me", set_of(tables::kOnigMe), {"Enclosing_Mark"});
    add("N", set_of(tables::kOnigN), {"Number"});
    add("Nd", set_of(tables::kOnigNd), {"Decimal_Number", "Digit"});
    add("Nl", set_of(tables::kOnigNl), {"Letter_Number"});
    add("No", set_of(tables::kOnigNo), {"Other_Number"});
    add("P", set_of(tables::kOnigP), {"Punctuation", "Punct"});
    add("Pc", set_of(tables::kOnigPc), {"Connector_Punctuation"});
    add("Pd", set_of(tables::kOnigPd), {"Dash_Punctuation"});
    add("Ps", set_of(tables::kOnigPs), {"Open_Punctuation"});
    add("Pe", set_of(tables::kOnigPe), {"Close_Punctuation"});
    add("Pi", set_of(tables::kOnigPi), {"Initial_Punctuation"});
    add("Pf", set_of(tables::kOnigPf), {"Final_Punctuation"});
    add("Po", set_of(tables::kOnigPo), {"Other_Punctuation"});
    add("S", set_of(tables::kOnigS), {"Symbol"});
    add("Sm", set_of(tables::kOnigSm), {"Math_Symbol"});
    add("Sc", set_of(tables::kOnigSc), {"Currency_Symbol"});
    add("Sk", set_of(tables::kOnigSk), {"Modifier_Symbol"});
    add("So", set_of(tables::kOnigSo), {"Other_Symbol"});
    add("Z", set_of(tables::kOnigZ), {"Separator"});
    add("Zs", set_of(tables::kOnigZs), {"Space_Separator"});
    add("Zl", set_of(tables::kOnigZl), {"Line_Separator"});
    add("Zp", set_of(tables::kOnigZp), {"Paragraph_Separator"});
    add("C", set_of(tables::kOnigC), {"Other"});
    add("Cc", set_of(tables::kOnigCc), {"Control", "Cntrl"});
    add("Cf", set_of(tables::kOnigCf), {"Format"});
    add("Co", set_of(tables::kOnigCo), {"Private_Use"});
    add("Cn", set_of(tables::kOnigCn), {"Unassigned"});
    add("Alphabetic", set_of(tables::kOnigAlphabetic), {"Alpha"});
    add("White_Space", set_of(tables::kOnigWhiteSpace), {"WSpace", "Space"});
    add("Han", set_of(tables::kOnigScriptHan), {"Hani"});
    add("Hiragana", set_of(tables::kOnigScriptHiragana), {"Hira"});
    add("Katakana", set_of(tables::kOnigScriptKatakana), {"Kana"});
    add("Hangul", set_of(tables::kOnigScriptHangul), {"Hang"});
    add("Latin", set_of(tables::kOnigScriptLatin), {"Latn"});
    add("Cyrillic", set_of(tables::kOnigScriptCyrillic), {"Cyrl"});
    add("Greek", set_of(tables::kOnigScriptGreek), {"Grek"});
    add("Arabic", set_of(tables::kOnigScriptArabic), {"Arab"});
    add("Hebrew", set_of(tables::kOnigScriptHebrew), {"Hebr"});
    add("Thai", set_of(tables::kOnigScriptThai), {});
    add("Devanagari", set_of(tables::kOnigScriptDevanagari), {"Deva"});
    add("Common", set_of(tables::kOnigScriptCommon), {"Zyyy"});
    // Escapes, not property names (the translator asks for them by these keys).
    by_name.emplace("\\s", set_of(tables::kOnigSpace));
    by_name.emplace("\\w", set_of(tables::kOnigWord));
    by_name.emplace("\\d", set_of(tables::kOnigDigit));
    by_name.emplace("\\h", set_of(tables::kOnigHexDigit));
  }
};

const OnigTables& onig() {
  static const OnigTables t;
  return t;
}

}  // namespace

const CodePointSet* oniguruma_class(std::string_view name) {
  const auto& t = onig();
  auto it = t.by_name.find(name);
  return it == t.by_name.end() ? nullptr : &it->second;
}

std::string oniguruma_property_name(std::string_view name) {
  const auto& t = onig();
  auto it = t.canonical.find(loose(name));
  return it == t.canonical.end() ? std::string() : it->second;
}

#define MODALITIES_TABLE(function, table)                \
  const CodePointSet& function() {                       \
    static const CodePointSet s = set_of(tables::table); \
    return s;                                            \
  }
MODALITIES_TABLE(rust_numeric, kRustIsNumeric)
MODALITIES_TABLE(rust_whitespace, kRustIsWhitespace)
MODALITIES_TABLE(bert_punctuation, kHfPunctuation)
MODALITIES_TABLE(bert_removed, kBertCleanTextRemove)
MODALITIES_TABLE(bert_to_space, kBertCleanTextToSpace)
MODALITIES_TABLE(bert_nonspacing_marks, kBertStripAccentsRemove)
MODALITIES_TABLE(strip_accents_marks, kStripAccentsRemove)
MODALITIES_TABLE(whitespace_pretokenizer_word, kRustRegexWord)
MODALITIES_TABLE(whitespace_pretokenizer_space, kRustRegexSpace)
MODALITIES_TABLE(hf_normalization_unknown, kHfNormalizationUnknown)
#undef MODALITIES_TABLE

// Nmt (tokenizers' normalizers::unicode::Nmt): fixed lists in its source, not Unicode data.
const CodePointSet& nmt_removed() {
  static const CodePointSet s =
      CodePointSet::from_ranges({{0x01, 0x08}, {0x0B, 0x0B}, {0x0E, 0x1F}, {0x7F, 0x7F}, {0x8F, 0x8F}, {0x9F, 0x9F}});
  return s;
}

const CodePointSet& nmt_to_space() {
  static const CodePointSet s = CodePointSet::from_ranges({{0x09, 0x0A},
                                                           {0x0C, 0x0D},
                                                           {0x1680, 0x1680},
                                                           {0x200B, 0x200F},
                                                           {0x2028, 0x2029},
                                                           {0x2581, 0x2581},
                                                           {0xFEFF, 0xFEFF},
                                                           {0xFFFD, 0xFFFD}});
  return s;
}

const CodePointSet& lowercase_changes() {
  static const CodePointSet* mapped = [] {
    std::vector<std::pair<char32_t, char32_t>> r;
    for (const auto& e : tables::kRustLowercase) r.emplace_back(e.cp, e.cp);
    return new CodePointSet(CodePointSet::from_ranges(std::move(r)));
  }();
  return *mapped;
}

void append_lowercase(std::string& out, char32_t c) {
  static const auto* table = [] {
    auto* m = new std::vector<std::pair<char32_t, std::array<char32_t, 3>>>();
    for (const auto& e : tables::kRustLowercase) m->push_back({e.cp, {e.lower[0], e.lower[1], e.lower[2]}});
    return m;
  }();
  const CodePointSet* mapped = &lowercase_changes();
  if (!mapped->contains(c)) {
    append_utf8(out, c);
    return;
  }
  auto it = std::lower_bound(table->begin(), table->end(), c, [](const auto& e, char32_t v) { return e.first < v; });
  for (char32_t l : it->second)
    if (l != 0) append_utf8(out, l);
}

// ---------------------------------------------------------------------------
// Normalization

int normalization_form_options(std::string_view form) {
  int options = UTF8PROC_STABLE;
  if (form == "NFC") options |= UTF8PROC_COMPOSE;
  else if (form == "NFD") options |= UTF8PROC_DECOMPOSE;
  else if (form == "NFKC") options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
  else if (form == "NFKD") options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
  else throw Error(fmt::format("unknown normalization form '{}'", form));
  return options;
}

namespace {

// Note [Normalization fast path]
// Running utf8proc on every segment dominates NFC pipelines, while most text is
// already normalized. A segment is left alone when every character is known to
// be unchanged by the form and unable to interact with its neighbours: for BMP
// characters a per-form table computed once with utf8proc (NF(c) == c, combining
// class 0, not the second element of any composition, not a Hangul jamo; the same
// byte marks the code points tokenizers does not know, and the marks of Note [Marks
// in order], whose combining class is kept beside it), for astral ones the
// property check (no decomposition at all, class 0, not a second element).
// Anything else takes the full utf8proc path.
constexpr utf8proc_uint16_t kNoIndex = 0xFFFF;

bool is_hangul_jamo(char32_t c) {
  return (c >= 0x1100 && c <= 0x11FF) || (c >= 0xA960 && c <= 0xA97F) || (c >= 0xD7B0 && c <= 0xD7FF);
}

bool stable_by_properties(char32_t c, bool compose) {
  const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(c));
  if (p->combining_class != 0 || p->decomp_seqindex != kNoIndex || is_hangul_jamo(c)) return false;
  return !(compose && p->comb_index != kNoIndex && p->comb_index >= 0x8000);
}

// Note [Marks in order]
// A combining mark that the form leaves unchanged and that is in no composition (neither first nor
// second element) changes nothing but the order of marks: canonical ordering sorts each run of
// non-starters by combining class, stably. So a run of such marks whose classes do not decrease is
// already in order and left alone (Thai tone marks, Hebrew points, Arabic harakat, Devanagari
// signs). A mark out of order starts a utf8proc region at the stable character before the run,
// which takes the whole run of marks and unstable characters after it.

// What a character is to the fast path of one form.
enum class Stability : std::uint8_t {
  kUnstable,  // may change or interact with its neighbours: goes through utf8proc
  kStable,    // unchanged, and a boundary before it is safe
  kInert,     // unknown to tokenizers' tables (hf_normalization_unknown): left alone, a boundary after it
  kMark,      // combining class > 0, unchanged, in no composition: unstable only by its order (Note [Marks in order])
};

// One byte per BMP code point and form (64 KiB each, computed once with utf8proc), so the scan
// classifies a character with one load; and the combining class of the kMark ones (64 KiB more).
class StableTable {
 public:
  explicit StableTable(int options)
      : compose_((options & UTF8PROC_COMPOSE) != 0), cls_(0x10000, Stability::kUnstable), ccc_(0x10000, 0) {
    const CodePointSet& unknown = hf_normalization_unknown();
    for (char32_t c = 0; c < 0x80; ++c) cls_[c] = Stability::kStable;
    for (char32_t c = 0x80; c < 0x10000; ++c) {
      if (c >= 0xD800 && c <= 0xDFFF) continue;
      if (unknown.contains(c)) {
        cls_[c] = Stability::kInert;
        continue;
      }
      const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(c));
      if (is_hangul_jamo(c)) continue;
      const bool mark = p->combining_class != 0;
      if (mark && p->comb_index != kNoIndex) continue;  // first or second of a composition
      if (!mark && compose_ && p->comb_index != kNoIndex && p->comb_index >= 0x8000) continue;
      std::string one;
      append_utf8(one, c);
      utf8proc_uint8_t* dst = nullptr;
      const utf8proc_ssize_t n =
          utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(one.data()), static_cast<utf8proc_ssize_t>(one.size()),
                       &dst, static_cast<utf8proc_option_t>(options));
      if (n >= 0 && std::string_view(reinterpret_cast<const char*>(dst), static_cast<std::size_t>(n)) == one) {
        cls_[c] = mark ? Stability::kMark : Stability::kStable;
        ccc_[c] = static_cast<std::uint8_t>(p->combining_class);
      }
      std::free(dst);
    }
  }
  Stability of(char32_t c) const {
    if (c < 0x10000) return cls_[c];
    if (hf_normalization_unknown().contains(c)) return Stability::kInert;
    return stable_by_properties(c, compose_) ? Stability::kStable : Stability::kUnstable;
  }
  /// The combining class of a kMark character.
  std::uint8_t ccc(char32_t c) const { return ccc_[c]; }

 private:
  bool compose_;
  std::vector<Stability> cls_;
  std::vector<std::uint8_t> ccc_;
};

const StableTable& stable_table(int options) {
  static const StableTable nfc(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
  static const StableTable nfd(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
  static const StableTable nfkc(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
  static const StableTable nfkd(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  if (options & UTF8PROC_COMPAT) return (options & UTF8PROC_COMPOSE) ? nfkc : nfkd;
  return (options & UTF8PROC_COMPOSE) ? nfc : nfd;
}

std::string utf8proc_normalize(std::string_view s, int options) {
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()), &dst,
                   static_cast<utf8proc_option_t>(options));
  if (n < 0) throw Error(fmt::format("Unicode normalization failed: {}", utf8proc_errmsg(n)));
  std::string out(reinterpret_cast<const char*>(dst), static_cast<std::size_t>(n));
  std::free(dst);
  return out;
}

// Note [Memo of normalized regions]
// A utf8proc_map call costs about 1500 instructions (it allocates, decomposes into a buffer,
// reorders, composes and re-encodes), and the regions normalize_form hands to it are short and
// recur: a no-break space or a fullwidth letter after the same letter, a nukta after the same
// consonant. So each thread keeps, in each of 1024 hash buckets, the last short region normalized
// there with its form and result, compared byte for byte before use: the memo of a pure function.
// On the benchmark corpus the unigram pipeline with NFKC ran 10% fewer instructions, 4% faster.
struct RegionMemo {
  static constexpr std::size_t kEntries = 1024, kMaxIn = 24, kMaxOut = 64;
  struct Entry {
    int options = 0;
    std::uint8_t in_len = 0, out_len = 0;  // in_len 0: empty (regions are never empty)
    char in[kMaxIn];
    char out[kMaxOut];
  };
  std::unique_ptr<Entry[]> entries = std::make_unique<Entry[]>(kEntries);
  std::string spill;  // a result that does not fit an entry
};

// utf8proc_normalize(region, options), valid until the thread's next call.
std::string_view normalized_region(std::string_view region, int options) {
  thread_local RegionMemo memo;
  if (region.empty() || region.size() > RegionMemo::kMaxIn) return memo.spill = utf8proc_normalize(region, options);
  const std::size_t h = std::hash<std::string_view>{}(region);  // (the forms of a region share a bucket)
  RegionMemo::Entry& e = memo.entries[(h ^ (h >> 17)) % RegionMemo::kEntries];
  if (e.in_len == region.size() && e.options == options && std::memcmp(e.in, region.data(), region.size()) == 0)
    return {e.out, e.out_len};
  memo.spill = utf8proc_normalize(region, options);
  if (memo.spill.size() > RegionMemo::kMaxOut) return memo.spill;
  e.options = options;
  e.in_len = static_cast<std::uint8_t>(region.size());
  e.out_len = static_cast<std::uint8_t>(memo.spill.size());
  std::memcpy(e.in, region.data(), region.size());
  std::memcpy(e.out, memo.spill.data(), memo.spill.size());
  return {e.out, e.out_len};
}

// Normalizes `s` into `out` and returns true, or returns false (leaving `out`
// alone) when `s` is already normalized. A boundary before a stable character
// is a safe split point, so only the regions around unstable characters (from
// the last stable character before them to the next stable one) go through
// utf8proc. Code points that tokenizers' normalization tables do not know are
// starters without mappings there, so they end a region and are copied as
// they are. See Note [Normalization fast path].
}  // namespace

bool form_stable(char32_t c, int options) { return c < 0x10000 && stable_table(options).of(c) == Stability::kStable; }

namespace {

void require_known_utf8proc() {
  // kHfNormalizationUnknown and the stability tables were checked against utf8proc 2.8 (Unicode 15),
  // whose property encoding this file also reads; another version could normalize differently.
  static const bool known_utf8proc = std::string_view(utf8proc_version()) == "2.8.0";
  if (!known_utf8proc)
    throw Error(
        fmt::format("Unicode normalization: this build links utf8proc {}, but the normalizers were checked "
                    "against utf8proc 2.8.0 only (Debian 12's); rebuild with it rather than risk other ids",
                    utf8proc_version()));
}

}  // namespace

std::size_t canonical_decomposition(char32_t c, std::array<char32_t, 8>& out, std::array<bool, 8>& starter) {
  require_known_utf8proc();
  if (hf_normalization_unknown().contains(c)) {
    out[0] = c;
    starter[0] = true;
    return 1;
  }
  static const auto nfd = static_cast<utf8proc_option_t>(normalization_form_options("NFD"));
  utf8proc_int32_t buf[8];
  const utf8proc_ssize_t n = utf8proc_decompose_char(static_cast<utf8proc_int32_t>(c), buf, 8, nfd, nullptr);
  if (n <= 0 || n > 8) return 0;
  for (utf8proc_ssize_t i = 0; i < n; ++i) {
    out[i] = static_cast<char32_t>(buf[i]);
    starter[i] = utf8proc_get_property(buf[i])->combining_class == 0;
  }
  return static_cast<std::size_t>(n);
}

bool nfd_inert_starter(char32_t c) {
  static const BmpBits bmp = BmpBits::where(0, [](char32_t d) {
    std::array<char32_t, 8> parts;
    std::array<bool, 8> starter;
    return canonical_decomposition(d, parts, starter) == 1 && parts[0] == d && starter[0];
  });
  if (c < 0x10000) return bmp.contains(c);
  std::array<char32_t, 8> parts;
  std::array<bool, 8> starter;
  return canonical_decomposition(c, parts, starter) == 1 && parts[0] == c && starter[0];
}

bool normalize_form(std::string_view s, int options, std::string& out) {
  require_known_utf8proc();
  const StableTable& table = stable_table(options);
  const std::size_t n = s.size();
  std::size_t copied = 0, last_stable = 0;
  std::uint8_t last_ccc = 0;  // of the character before `i` when it is a kMark passed in order, else 0
  bool changed = false;
  for (std::size_t i = 0; i < n;) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {  // a run of ASCII: all stable
      while (i + 1 < n && static_cast<unsigned char>(s[i + 1]) < 0x80) ++i;
      last_stable = i++;
      last_ccc = 0;
      continue;
    }
    std::size_t len;
    const char32_t c = decode_at(s, i, &len);
    const Stability st = table.of(c);
    if (st == Stability::kInert) {  // never part of a utf8proc region
      last_stable = i + len;
      last_ccc = 0;
      i += len;
      continue;
    }
    if (st == Stability::kStable) {
      last_stable = i;
      last_ccc = 0;
      i += len;
      continue;
    }
    if (st == Stability::kMark && table.ccc(c) >= last_ccc) {  // Note [Marks in order]
      last_ccc = table.ccc(c);
      i += len;
      continue;
    }
    // A region from the last stable character (before any marks passed in order) through the
    // unstable characters and marks after `i`; the character after it is stable, inert or ASCII.
    const std::size_t region = std::max(copied, last_stable);
    last_ccc = 0;
    std::size_t j = i + len;
    while (j < n && static_cast<unsigned char>(s[j]) >= 0x80) {
      std::size_t l;
      const Stability next = table.of(decode_at(s, j, &l));
      if (next != Stability::kUnstable && next != Stability::kMark) break;
      j += l;
    }
    const std::string_view normalized = normalized_region(s.substr(region, j - region), options);
    if (!changed && normalized == s.substr(region, j - region)) {
      i = j;  // this region happened to be normalized already; nothing to copy yet
      continue;
    }
    if (!changed) {
      out.clear();
      out.reserve(n + n / 8);
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
    else if (b == 0xE0) {
      need = 2;
      lo = 0xA0;
    } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) need = 2;
    else if (b == 0xED) {
      need = 2;
      hi = 0x9F;
    } else if (b == 0xF0) {
      need = 3;
      lo = 0x90;
    } else if (b >= 0xF1 && b <= 0xF3) need = 3;
    else if (b == 0xF4) {
      need = 3;
      hi = 0x8F;
    }
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

// ---- SentencePiece charsmaps ---------------------------------------------
// The trie layout is darts-clone's (as SentencePiece writes it and spm_precompiled reads it): a
// unit is a u32 with the label in bits 0-7 (bit 31 marks a leaf unit), has_leaf in bit 8, and an
// offset in bits 10-31 scaled by 2^8 when bit 9 is set; a leaf unit's low 31 bits are its value,
// here an offset into the pool.

namespace {

// Note [Lone grapheme clusters]
// A character of grapheme break class Other, LV or LVT (a Hangul syllable) is a cluster of its own
// between neighbours that are ASCII or of these classes too: utf8proc 2.8 (Unicode 15.0 rules,
// what the slow path asks) breaks between any two of them (the Hangul rules join syllables only to
// L, V and T jamo; GB9-9b need an Extend, ZWJ, SpacingMark or Prepend; GB11-13 an emoji, ZWJ or
// regional indicator), and its state after such a character is the character's class, which state
// 0 recomputes from it. Most non-ASCII text (CJK, Cyrillic, Korean, precomposed Latin) is such
// characters, so the normalizer maps them one by one without asking utf8proc where clusters end.
// Unassigned code points are left out (the slow path checks them, see normalize).
bool lone_other(char32_t c) {
  static const BmpBits bmp = BmpBits::where(0x80, [](char32_t d) {
    const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(d));
    const bool own_cluster = p->boundclass == UTF8PROC_BOUNDCLASS_OTHER || p->boundclass == UTF8PROC_BOUNDCLASS_LV ||
                             p->boundclass == UTF8PROC_BOUNDCLASS_LVT;
    return own_cluster && p->category != UTF8PROC_CATEGORY_CN && p->category != UTF8PROC_CATEGORY_CS;
  });
  return bmp.contains(c);
}

}  // namespace

bool lone_grapheme(char32_t c) { return c < 0x80 ? c != '\r' && c != '\n' : lone_other(c); }

PrecompiledCharsmap::PrecompiledCharsmap(std::string blob, const std::string& where) {
  if (blob.empty()) return;  // tokenizers: an empty charsmap changes nothing
  const auto bad = [&](const std::string& what) {
    return Error(fmt::format("{}: malformed precompiled_charsmap: {}", where, what));
  };
  if (blob.size() < 4) throw bad("shorter than its 4-byte header");
  std::uint32_t trie_bytes = 0;
  for (int i = 3; i >= 0; --i)
    trie_bytes = (trie_bytes << 8) | static_cast<unsigned char>(blob[static_cast<std::size_t>(i)]);
  if (trie_bytes % 4 != 0 || trie_bytes > blob.size() - 4)
    throw bad(fmt::format("trie size {} does not fit", trie_bytes));
  units_.resize(trie_bytes / 4);
  for (std::size_t u = 0; u < units_.size(); ++u) {
    std::uint32_t v = 0;
    for (int i = 3; i >= 0; --i)
      v = (v << 8) | static_cast<unsigned char>(blob[4 + u * 4 + static_cast<std::size_t>(i)]);
    units_[u] = v;
  }
  pool_ = blob.substr(4 + trie_bytes);
  if (units_.empty()) throw bad("empty trie");
  for (std::size_t b = 0; b < ascii_.size(); ++b) {
    const char ch = static_cast<char>(b);
    if (auto r = transform(std::string_view(&ch, 1))) ascii_[b] = std::string(*r);
  }
  simple_ = BmpBits::where(0, [](char32_t c) { return c < 0x80 || lone_other(c); });
  same_ = BmpBits::where(0, [&](char32_t c) {
    if (c == '\r' || c == '\n' || (c >= 0x80 && !lone_other(c))) return false;
    std::string one;
    append_utf8(one, c);
    const std::optional<std::string_view> r = transform(one);
    return !r || *r == one;
  });
}

std::optional<std::string_view> PrecompiledCharsmap::transform(std::string_view chunk) const {
  const auto offset = [](std::uint32_t unit) -> std::size_t { return (unit >> 10) << ((unit & (1u << 9)) >> 6); };
  std::size_t pos = 0;
  pos ^= offset(units_[0]);
  for (const char ch : chunk) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == 0) break;
    pos ^= c;
    if (pos >= units_.size()) return std::nullopt;
    const std::uint32_t unit = units_[pos];
    if ((unit & ((1u << 31) | 0xFFu)) != c) return std::nullopt;  // label
    pos ^= offset(unit);
    if (pos >= units_.size()) return std::nullopt;
    if ((unit >> 8) & 1u) {  // has a leaf: the first (shortest) match is the result
      const std::size_t at = units_[pos] & ((1u << 31) - 1);
      if (at > pool_.size()) return std::nullopt;
      const std::size_t end = pool_.find('\0', at);
      return std::string_view(pool_).substr(at, (end == std::string::npos ? pool_.size() : end) - at);
    }
  }
  return std::nullopt;
}

bool PrecompiledCharsmap::normalize(std::string_view in, std::string& out, bool* first_removed) const {
  if (units_.empty() || in.empty()) return false;
  std::string result;
  result.reserve(in.size() + 8);
  bool first_cluster = true;
  const auto emit = [&](std::size_t b, std::size_t e) {
    const std::size_t before = result.size();
    const std::string_view g = in.substr(b, e - b);
    bool done = false;
    if (g.size() < 6) {
      if (auto n = transform(g)) {
        result += *n;
        done = true;
      } else if (std::size_t len; (void)decode_at(g, 0, &len), len == g.size()) {
        result += g;  // one character without an entry: the loop below would look it up again
        done = true;
      }
    }
    if (!done) {
      for (std::size_t i = 0; i < g.size();) {
        std::size_t len;
        (void)decode_at(g, i, &len);
        const std::string_view part = g.substr(i, len);
        if (auto n = transform(part)) result += *n;
        else result += part;
        i += len;
      }
    }
    if (first_cluster && result.size() == before && first_removed != nullptr) *first_removed = true;
    first_cluster = false;
  };
  utf8proc_int32_t state = 0;
  std::size_t start = 0, prev_at = 0, prev_len = 0;
  char32_t prev = 0;
  const auto ascii = [&](std::size_t k) { return k >= in.size() || static_cast<unsigned char>(in[k]) < 0x80; };
  const auto simple_at = [&](std::size_t k) {
    std::size_t l;
    return simple_.contains(decode_at(in, k, &l));
  };
  bool prev_simple = false;  // the character before `i` is ASCII or lone_other
  for (std::size_t i = 0; i < in.size();) {
    if (fast_ && i > 0 && prev_simple) {
      // Note [Lone grapheme clusters]: a run of characters that are clusters of their own and map
      // to themselves is copied at once (each character decoded once: it is the next one first).
      std::size_t j = i, len;
      // ASCII characters that map to themselves and are followed by ASCII, byte by byte first.
      while (j + 1 < in.size() && static_cast<unsigned char>(in[j + 1]) < 0x80 &&
             static_cast<unsigned char>(in[j]) < 0x80 && same_.contains(static_cast<unsigned char>(in[j])))
        ++j;
      if (j > i) {
        prev = static_cast<unsigned char>(in[j - 1]);
        prev_at = j - 1;
        prev_len = 1;
      }
      char32_t c = decode_at(in, j, &len);
      while (same_.contains(c)) {
        const std::size_t next = j + len;
        std::size_t next_len = 0;
        char32_t d = 0;
        if (next < in.size() && !simple_.contains(d = decode_at(in, next, &next_len))) break;
        prev = c;
        prev_at = j;
        prev_len = len;
        j = next;
        if (j == in.size()) break;
        c = d;
        len = next_len;
      }
      if (j > i) {
        if (start < i) emit(start, i);
        result.append(in, i, j - i);
        first_cluster = false;
        state = 0;
        start = i = j;
        continue;
      }
    }
    // Note [Precompiled on ASCII]: an ASCII character between ASCII neighbours is a grapheme cluster
    // of its own (unless it is half of "\r\n"), so it becomes its one-byte replacement; the
    // grapheme state after it is that of any ASCII character, which state 0 recomputes from it.
    if (fast_ && i > 0 && ascii(i - 1) && ascii(i) && ascii(i + 1) && !(in[i] == '\n' && in[i - 1] == '\r') &&
        !(in[i] == '\r' && i + 1 < in.size() && in[i + 1] == '\n')) {
      if (start < i) emit(start, i);
      const auto b = static_cast<std::size_t>(in[i]);
      if (ascii_[b]) result += *ascii_[b];
      else result += in[i];
      first_cluster = false;
      state = 0;
      prev_simple = true;
      prev = static_cast<char32_t>(in[i]);
      prev_at = i;
      prev_len = 1;
      start = ++i;
      continue;
    }
    std::size_t len;
    const char32_t c = decode_at(in, i, &len);
    if (fast_ && i > 0 && prev_simple && c >= 0x80 && simple_.contains(c) &&
        (i + len == in.size() || simple_at(i + len))) {
      if (start < i) emit(start, i);  // Note [Lone grapheme clusters]
      emit(i, i + len);
      state = 0;
      prev = c;
      prev_at = i;
      prev_len = len;
      start = i += len;
      continue;
    }
    prev_simple = simple_.contains(c);
    if (i > 0) {
      // Unicode 15.1+ may give a code point unassigned in 15.0 a property that joins it to the
      // cluster before (a new combining mark): with a mapped character before it in under 6 bytes,
      // tokenizers would then replace the pair by the character's entry alone.
      if (prev_len + len < 6 && utf8proc_category(static_cast<utf8proc_int32_t>(c)) == UTF8PROC_CATEGORY_CN &&
          transform(in.substr(prev_at, prev_len)))
        throw Error(fmt::format(
            "the Precompiled normalizer cannot decide U+{:04X} after U+{:04X}: U+{:04X} is not in "
            "Unicode 15.0 (utf8proc), so whether it extends the grapheme cluster before it (and "
            "how tokenizers normalizes the pair) is unknown here",
            static_cast<std::uint32_t>(c), static_cast<std::uint32_t>(prev), static_cast<std::uint32_t>(c)));
      if (utf8proc_grapheme_break_stateful(static_cast<utf8proc_int32_t>(prev), static_cast<utf8proc_int32_t>(c),
                                           &state)) {
        emit(start, i);
        start = i;
      }
    }
    prev = c;
    prev_at = i;
    prev_len = len;
    i += len;
  }
  if (start < in.size()) emit(start, in.size());
  if (result == in) return false;
  out = std::move(result);
  return true;
}

}  // namespace modalities::plugins::hf_tokenizer
