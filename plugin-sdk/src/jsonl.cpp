// Line splitting, JSON validation and jq paths for the data tools.
//
// Validation uses simdjson (GB/s). simdjson is stricter than Python's
// json.loads in four places that real corpora hit: NaN/Infinity literals,
// integers beyond 64 bits, numbers that overflow a double (Python reads inf)
// and lone UTF-16 surrogate escapes. A line simdjson rejects therefore gets a
// second opinion from python_json_valid() below, a small hand-written
// recursive-descent check of exactly json.loads' grammar, so that the set of
// accepted lines (and hence every .idx byte) matches Modalities.
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/jsonl.h>

#include <fmt/format.h>
#include <simdjson.h>

#include <algorithm>
#include <charconv>
#include <cstring>

namespace modalities::formats {

std::vector<IndexEntry> split_lines(std::string_view text) {
  std::vector<IndexEntry> lines;
  std::size_t p = 0;
  const std::size_t n = text.size();
  while (true) {
    const void* hit = p < n ? std::memchr(text.data() + p, '\n', n - p) : nullptr;
    if (hit == nullptr) {
      lines.emplace_back(p, n - p);
      break;
    }
    const std::size_t q = static_cast<const char*>(hit) - text.data();
    lines.emplace_back(p, q - p);
    if (q + 1 == n) break;
    p = q + 1;
  }
  return lines;
}

std::filesystem::path default_index_path(const std::filesystem::path& src) {
  return src.parent_path() / (src.stem().string() + ".idx");
}

// --- jq paths -------------------------------------------------------------------

namespace {

// simdjson copies the text into its padded buffer with memcpy, which must not receive a null
// pointer even for zero bytes (an empty line of an empty mapping has data() == nullptr).
const char* non_null(std::string_view s) { return s.data() != nullptr ? s.data() : ""; }

[[noreturn]] void bad_jq(std::string_view program, std::string_view why) {
  throw Error(
      fmt::format("unsupported jq_pattern '{}': {}. Supported: a path of keys and array indices such as "
                  "., .text, .a.b, .[\"some key\"], .messages[0].content",
                  program, why));
}

bool is_ident_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_'; }

// Parses a JSON-style double-quoted string starting at s[i] == '"'; only the
// escapes \" and \\ are needed for keys.
std::string parse_quoted(std::string_view program, std::string_view s, std::size_t& i) {
  std::string out;
  ++i;
  while (i < s.size() && s[i] != '"') {
    if (s[i] == '\\') {
      if (i + 1 >= s.size()) break;
      const char e = s[i + 1];
      if (e != '"' && e != '\\') bad_jq(program, "only \\\" and \\\\ escapes are supported in quoted keys");
      out.push_back(e);
      i += 2;
    } else {
      out.push_back(s[i++]);
    }
  }
  if (i >= s.size()) bad_jq(program, "unterminated quoted key");
  ++i;  // closing quote
  return out;
}

}  // namespace

JqPath JqPath::parse(std::string_view program) {
  JqPath path;
  path.program_ = std::string(program);
  std::string_view s = program;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  if (s.empty() || s[0] != '.') bad_jq(program, "it must start with '.'");
  std::size_t i = 0;
  if (s == ".") return path;  // the identity: the line itself must be a JSON string
  while (i < s.size()) {
    if (s[i] == '.') {
      ++i;
      if (i < s.size() && s[i] == '"') {
        path.steps_.push_back({parse_quoted(program, s, i), std::nullopt});
      } else if (i < s.size() && s[i] == '[') {
        continue;  // ".[...]" handled by the bracket branch
      } else {
        const std::size_t start = i;
        while (i < s.size() && is_ident_char(s[i])) ++i;
        if (i == start || std::isdigit(static_cast<unsigned char>(s[start])))
          bad_jq(program, fmt::format("expected a key name at position {}", start));
        path.steps_.push_back({std::string(s.substr(start, i - start)), std::nullopt});
      }
    } else if (s[i] == '[') {
      ++i;
      if (i < s.size() && s[i] == '"') {
        std::string key = parse_quoted(program, s, i);
        if (i >= s.size() || s[i] != ']') bad_jq(program, "expected ']' after a quoted key");
        ++i;
        path.steps_.push_back({std::move(key), std::nullopt});
      } else {
        const std::size_t start = i;
        if (i < s.size() && s[i] == '-') ++i;
        while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
        std::int64_t index = 0;
        const auto [ptr, ec] = std::from_chars(s.data() + start, s.data() + i, index);
        if (ec != std::errc() || ptr != s.data() + i || i >= s.size() || s[i] != ']')
          bad_jq(
              program,
              "brackets must hold an integer index or a quoted key (slices, iterators and filters are not supported)");
        ++i;
        path.steps_.push_back({std::string(), index});
      }
    } else {
      bad_jq(program,
             fmt::format("unexpected '{}' at position {} (pipes, functions and operators are not supported)", s[i], i));
    }
  }
  return path;
}

// --- Python json.loads acceptance ---------------------------------------------

namespace {

// UTF-8 as Python decodes it with errors="surrogatepass": well-formed
// sequences plus encoded surrogates (ED A0..BF xx).
bool utf8_valid_surrogatepass(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len = 0;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (i + len > n) return false;
    if (p[i + 1] < lo || p[i + 1] > hi) return false;
    for (int k = 2; k < len; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return false;
    i += len;
  }
  return true;
}

class PythonJsonChecker {
 public:
  explicit PythonJsonChecker(std::string_view s) : s_(s) {}

  bool check(std::string* why) {
    skip_ws();
    if (!value(0)) return fail(why);
    skip_ws();
    if (i_ != s_.size()) {
      err_ = "extra data after the JSON value";
      return fail(why);
    }
    return true;
  }

  bool has_lone_surrogate() const { return lone_surrogate_; }

 private:
  static constexpr int kMaxDepth = 990;  // Python's default recursion limit is 1000 frames

  bool fail(std::string* why) const {
    if (why) *why = fmt::format("{} at byte {}", err_.empty() ? "invalid JSON" : err_, i_);
    return false;
  }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool literal(std::string_view word) {
    if (s_.substr(i_, word.size()) != word) return false;
    i_ += word.size();
    return true;
  }
  bool digits() {
    const std::size_t start = i_;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
    return i_ > start;
  }
  bool number() {
    if (i_ < s_.size() && s_[i_] == '-') {
      ++i_;
      if (literal("Infinity")) return true;
    }
    if (i_ >= s_.size()) return false;
    if (s_[i_] == '0') {
      ++i_;
    } else if (!digits()) {
      return false;
    }
    // Python's NUMBER_RE: fraction and exponent are optional and only consumed when complete.
    if (i_ + 1 < s_.size() && s_[i_] == '.' && std::isdigit(static_cast<unsigned char>(s_[i_ + 1]))) {
      ++i_;
      digits();
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      std::size_t j = i_ + 1;
      if (j < s_.size() && (s_[j] == '+' || s_[j] == '-')) ++j;
      if (j < s_.size() && std::isdigit(static_cast<unsigned char>(s_[j]))) {
        i_ = j;
        digits();
      }
    }
    return true;
  }
  static int hex4(std::string_view h) {
    int v = 0;
    for (char c : h) {
      v <<= 4;
      if (c >= '0' && c <= '9') v |= c - '0';
      else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
      else return -1;
    }
    return v;
  }
  bool string() {
    ++i_;  // opening quote
    while (i_ < s_.size()) {
      const auto c = static_cast<unsigned char>(s_[i_]);
      if (c == '"') {
        ++i_;
        return true;
      }
      if (c < 0x20) {
        err_ = "raw control character inside a string";
        return false;
      }
      if (c == '\\') {
        if (i_ + 1 >= s_.size()) break;
        const char e = s_[i_ + 1];
        if (e == 'u') {
          if (i_ + 6 > s_.size()) {
            err_ = "truncated \\u escape";
            return false;
          }
          const int v = hex4(s_.substr(i_ + 2, 4));
          if (v < 0) {
            err_ = "invalid \\u escape";
            return false;
          }
          i_ += 6;
          if (v >= 0xD800 && v <= 0xDBFF) {  // high surrogate: paired if a low one follows
            const int w =
                (i_ + 6 <= s_.size() && s_[i_] == '\\' && s_[i_ + 1] == 'u') ? hex4(s_.substr(i_ + 2, 4)) : -1;
            if (w >= 0xDC00 && w <= 0xDFFF) i_ += 6;
            else lone_surrogate_ = true;
          } else if (v >= 0xDC00 && v <= 0xDFFF) {
            lone_surrogate_ = true;
          }
          continue;
        }
        if (std::strchr("\"\\/bfnrt", e) == nullptr || e == '\0') {
          err_ = "invalid escape";
          return false;
        }
        i_ += 2;
        continue;
      }
      ++i_;
    }
    err_ = "unterminated string";
    return false;
  }
  bool value(int depth) {
    if (depth > kMaxDepth) {
      err_ = "nesting too deep";
      return false;
    }
    if (i_ >= s_.size()) {
      err_ = "expected a value";
      return false;
    }
    switch (s_[i_]) {
      case '"': return string();
      case '{': {
        ++i_;
        skip_ws();
        if (i_ < s_.size() && s_[i_] == '}') {
          ++i_;
          return true;
        }
        while (true) {
          skip_ws();
          if (i_ >= s_.size() || s_[i_] != '"') {
            err_ = "expected a property name in double quotes";
            return false;
          }
          if (!string()) return false;
          skip_ws();
          if (i_ >= s_.size() || s_[i_] != ':') {
            err_ = "expected ':'";
            return false;
          }
          ++i_;
          skip_ws();
          if (!value(depth + 1)) return false;
          skip_ws();
          if (i_ < s_.size() && s_[i_] == ',') {
            ++i_;
            continue;
          }
          if (i_ < s_.size() && s_[i_] == '}') {
            ++i_;
            return true;
          }
          err_ = "expected ',' or '}'";
          return false;
        }
      }
      case '[': {
        ++i_;
        skip_ws();
        if (i_ < s_.size() && s_[i_] == ']') {
          ++i_;
          return true;
        }
        while (true) {
          skip_ws();
          if (!value(depth + 1)) return false;
          skip_ws();
          if (i_ < s_.size() && s_[i_] == ',') {
            ++i_;
            continue;
          }
          if (i_ < s_.size() && s_[i_] == ']') {
            ++i_;
            return true;
          }
          err_ = "expected ',' or ']'";
          return false;
        }
      }
      default:
        if (literal("true") || literal("false") || literal("null") || literal("NaN") || literal("Infinity"))
          return true;
        if (s_[i_] == '-' || std::isdigit(static_cast<unsigned char>(s_[i_]))) {
          if (number()) return true;
        }
        err_ = "expected a value";
        return false;
    }
  }

  std::string_view s_;
  std::size_t i_ = 0;
  std::string err_;
  bool lone_surrogate_ = false;
};

std::string_view strip_bom(std::string_view line) {
  if (line.size() >= 3 && static_cast<unsigned char>(line[0]) == 0xEF && static_cast<unsigned char>(line[1]) == 0xBB &&
      static_cast<unsigned char>(line[2]) == 0xBF)
    line.remove_prefix(3);
  return line;
}

// Replaces every number and NaN/Infinity literal outside strings by `0` so that
// simdjson can navigate a line Python accepts (the selected field must be a
// string anyway, so the values of other fields do not matter).
std::string neutralise_numbers(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  std::size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (c == '"') {
      const std::size_t start = i++;
      while (i < s.size() && s[i] != '"') i += s[i] == '\\' ? 2 : 1;
      ++i;
      out.append(s.substr(start, std::min(i, s.size()) - start));
    } else if (c == '-' || std::isdigit(static_cast<unsigned char>(c)) || c == 'N' || c == 'I') {
      while (i < s.size() && std::strchr(",]} \t\r\n", s[i]) == nullptr) ++i;
      out.push_back('0');
    } else {
      out.push_back(c);
      ++i;
    }
  }
  return out;
}

}  // namespace

// --- JsonLineParser ---------------------------------------------------------------

struct JsonLineParser::Impl {
  simdjson::dom::parser parser;
  std::string scratch;
  std::string result;  // the selected text when it had to be copied
};

JsonLineParser::JsonLineParser() : impl_(std::make_unique<Impl>()) {}
JsonLineParser::~JsonLineParser() = default;

bool JsonLineParser::valid(std::string_view line, std::string* why) {
  line = strip_bom(line);
  simdjson::dom::element doc;
  const auto err = impl_->parser.parse(non_null(line), line.size(), true).get(doc);
  if (!err) return true;
  if (!utf8_valid_surrogatepass(line)) {
    if (why) *why = "invalid UTF-8";
    return false;
  }
  PythonJsonChecker checker(line);
  if (checker.check(why)) return true;
  if (why && err == simdjson::EMPTY) *why = "empty line (no JSON value)";
  return false;
}

namespace {

// The line with every lone UTF-16 surrogate escape (a \\uD800-\\uDFFF not forming a pair)
// replaced by the escape `replacement` ("\\ufffd"). The line is valid JSON (checked before).
std::string replace_lone_surrogates(std::string_view line, std::string_view replacement) {
  const auto hex4 = [&](std::size_t i) -> int {
    if (i + 6 > line.size() || line[i] != '\\' || line[i + 1] != 'u') return -1;
    int v = 0;
    for (std::size_t k = i + 2; k < i + 6; ++k) {
      const char c = line[k];
      const int d = c >= '0' && c <= '9'   ? c - '0'
                    : c >= 'a' && c <= 'f' ? c - 'a' + 10
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                           : -1;
      if (d < 0) return -1;
      v = v * 16 + d;
    }
    return v;
  };
  std::string out;
  out.reserve(line.size());
  bool in_string = false;
  for (std::size_t i = 0; i < line.size();) {
    const char c = line[i];
    if (!in_string) {
      if (c == '"') in_string = true;
      out.push_back(c);
      ++i;
    } else if (c == '"') {
      in_string = false;
      out.push_back(c);
      ++i;
    } else if (c != '\\') {
      out.push_back(c);
      ++i;
    } else if (const int v = hex4(i); v >= 0xD800 && v <= 0xDFFF) {
      const int low = v <= 0xDBFF ? hex4(i + 6) : -1;
      if (low >= 0xDC00 && low <= 0xDFFF) {  // a pair: kept
        out.append(line.substr(i, 12));
        i += 12;
      } else {
        out.append(replacement);
        i += 6;
      }
    } else {
      out.append(line.substr(i, 2));
      i += 2;
    }
  }
  return out;
}

// The string `path` selects in `doc` (jq semantics for a path of keys and indices).
std::string_view select_string(const simdjson::dom::element& doc, const JqPath& path) {
  simdjson::dom::element cur = doc;
  for (const auto& step : path.steps()) {
    if (cur.is_null()) break;  // jq: null.key -> null
    if (step.index) {
      simdjson::dom::array arr;
      if (cur.get_array().get(arr))
        throw Error(fmt::format("{} cannot index {} with [{}]", path.program(),
                                cur.is_object() ? "an object" : "a non-array value", *step.index));
      const std::int64_t n = static_cast<std::int64_t>(arr.size());
      const std::int64_t k = *step.index < 0 ? *step.index + n : *step.index;
      if (k < 0 || k >= n) {
        throw Error(fmt::format("{} selects null (index {} is outside an array of {} elements)", path.program(),
                                *step.index, n));
      }
      cur = arr.at(static_cast<std::size_t>(k)).value_unsafe();
    } else {
      simdjson::dom::object obj;
      if (cur.get_object().get(obj))
        throw Error(fmt::format("{} cannot index {} with \"{}\"", path.program(),
                                cur.is_array() ? "an array" : "a non-object value", step.key));
      simdjson::dom::element next;
      if (obj.at_key(step.key).get(next))
        throw Error(fmt::format("{} selects null (the key \"{}\" is missing)", path.program(), step.key));
      cur = next;
    }
  }
  if (cur.is_null()) throw Error(fmt::format("{} selects null", path.program()));
  std::string_view text;
  if (cur.get_string().get(text)) {
    const char* type = cur.is_object()  ? "an object"
                       : cur.is_array() ? "an array"
                       : cur.is_bool()  ? "a boolean"
                                        : "a number";
    throw Error(fmt::format("{} selects {}, not a string", path.program(), type));
  }
  return text;
}

}  // namespace

std::string_view JsonLineParser::extract_string(std::string_view line, const JqPath& path) {
  line = strip_bom(line);
  simdjson::dom::element doc;
  auto err = impl_->parser.parse(non_null(line), line.size(), true).get(doc);
  if (!err) return select_string(doc, path);
  std::string why;
  if (!utf8_valid_surrogatepass(line)) throw Error("invalid UTF-8");
  PythonJsonChecker checker(line);
  if (!checker.check(&why)) throw Error(fmt::format("invalid JSON ({})", why));
  if (!checker.has_lone_surrogate()) {
    impl_->scratch = neutralise_numbers(line);
    if (auto e = impl_->parser.parse(impl_->scratch.data(), impl_->scratch.size(), true).get(doc))
      throw Error(fmt::format("cannot read the line ({})", simdjson::error_message(e)));
    return select_string(doc, path);
  }
  // Python accepts lone surrogates in any string; only the selected text must be encodable.
  // Read the line twice, the lone surrogates replaced by two different characters: the selected
  // text differs between the two exactly when it holds one.
  std::string texts[2];
  const std::string_view replacements[2] = {"\\ufffd", "\\ufffe"};
  for (int k = 0; k < 2; ++k) {
    impl_->scratch = neutralise_numbers(replace_lone_surrogates(line, replacements[k]));
    if (auto e = impl_->parser.parse(impl_->scratch.data(), impl_->scratch.size(), true).get(doc))
      throw Error(fmt::format("cannot read the line ({})", simdjson::error_message(e)));
    texts[k] = std::string(select_string(doc, path));
  }
  if (texts[0] != texts[1])
    throw Error(
        fmt::format("the text selected by {} contains a lone UTF-16 surrogate escape (\\ud800-\\udfff), "
                    "which no tokenizer can encode",
                    path.program()));
  impl_->result = std::move(texts[0]);
  return impl_->result;
}

std::string json_quote(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) out += fmt::format("\\u{:04x}", c);
        else out.push_back(ch);
    }
  }
  out.push_back('"');
  return out;
}

}  // namespace modalities::formats
