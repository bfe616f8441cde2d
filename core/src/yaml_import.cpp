// Modalities' YAML configs as our config tree (`modalities config import`; docs/configs.md,
// "Importing Modalities YAML configs"). Component keys, variant keys, field names, `${...}`
// interpolations and resolvers are the same on both sides, so the conversion is structural: the
// YAML tree becomes a TOML tree in document order. Scalars get the types OmegaConf's loader gives
// them (PyYAML's YAML 1.1 safe resolvers with OmegaConf's float rule), quoted scalars stay
// strings, YAML nulls become "${null:}" (TOML has no null), anchors and aliases are expanded.
#include <modalities/core/yaml_import.h>

#include <modalities/core/config_tree.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/utf8.h>

#include <fmt/format.h>
#include <simdjson.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace modalities::core {
namespace {

namespace fs = std::filesystem;

// PyYAML's SafeLoader implicit resolvers (YAML 1.1) for plain scalars, with OmegaConf's float
// regex (it also takes "1e-5", which PyYAML alone reads as a string).
const std::regex kNull(R"(^(?:~|null|Null|NULL|)$)");
const std::regex kBool(R"(^(?:yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF)$)");
const std::regex kInt(
    R"(^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+|[-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+)$)");
const std::regex kFloat(
    R"(^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+|\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$)");

std::string strip_underscores(std::string s) {
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  return s;
}

// std::regex matches recursively: a plain scalar of ~27,000 digits overflowed the stack. Longer
// scalars than this are typed by the hand-written checks below (only numbers can be that long).
constexpr std::size_t kRegexLimit = 256;
// Bounds of the expanded document: aliases repeated inside aliases ("billion laughs") expand
// exponentially, and nesting deeper than this is no config. Modalities' largest example configs
// have a few hundred values; 100,000 keeps the refusal of a blown-up document within a second
// even under the sanitizers (1,000,000 took over 30 s in the fuzzing build).
constexpr std::size_t kMaxNodes = 100'000;
constexpr std::size_t kMaxDepth = 256;

constexpr std::string_view kTagPrefix = "tag:yaml.org,2002:";

[[noreturn]] void unreadable(const SourceLocation& where, const std::string& s, std::string_view as) {
  throw Error(fmt::format("{}: '{}' cannot be read as {} (PyYAML refuses it too)", where.str(),
                          s.size() > 80 ? s.substr(0, 80) + "..." : s, as));
}

// PyYAML's int constructor: underscores dropped, a sign, then 0b (binary), 0x (hex), 0 (octal),
// a sexagesimal a:b:c (base 60), or decimal. Fits 64 bits or is an error (OmegaConf keeps Python's
// big integers; TOML cannot).
using U128 = unsigned __int128;

std::int64_t yaml_int(const std::string& s, const SourceLocation& where) {
  std::string t = strip_underscores(s);
  bool negative = false;
  if (!t.empty() && (t[0] == '+' || t[0] == '-')) {
    negative = t[0] == '-';
    t.erase(0, 1);
  }
  U128 magnitude = 0;
  const U128 limit = negative ? (U128{1} << 63) : (U128{1} << 63) - 1;
  const auto too_big = [&] {
    throw Error(fmt::format("{}: the integer {} does not fit 64 bits", where.str(),
                            s.size() > 80 ? s.substr(0, 80) + "..." : s));
  };
  if (t.find(':') != std::string::npos) {  // sexagesimal: 1:30 is 90
    std::size_t start = 0;
    while (start <= t.size()) {
      const std::size_t end = std::min(t.find(':', start), t.size());
      const std::string part = t.substr(start, end - start);
      if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos) unreadable(where, s, "an integer");
      std::uint64_t v = 0;
      if (std::from_chars(part.data(), part.data() + part.size(), v).ec != std::errc() || v > limit) too_big();
      magnitude = magnitude * 60 + v;
      if (magnitude > limit) too_big();
      start = end + 1;
    }
  } else {
    int base = 10;
    if (t.size() > 1 && t[0] == '0' && (t[1] == 'x' || t[1] == 'b')) {
      base = t[1] == 'x' ? 16 : 2;
      t.erase(0, 2);
    } else if (t.size() > 1 && t[0] == '0') {
      base = 8;
      t.erase(0, 1);
    }
    if (t.empty()) unreadable(where, s, "an integer");
    for (const char c : t) {
      const int digit = std::isdigit(static_cast<unsigned char>(c)) ? c - '0'
                        : std::isxdigit(static_cast<unsigned char>(c))
                            ? std::tolower(static_cast<unsigned char>(c)) - 'a' + 10
                            : 99;
      if (digit >= base) unreadable(where, s, "an integer");
      magnitude = magnitude * static_cast<unsigned>(base) + static_cast<unsigned>(digit);
      if (magnitude > limit) too_big();
    }
  }
  if (negative) return magnitude == (U128{1} << 63) ? INT64_MIN : -static_cast<std::int64_t>(magnitude);
  return static_cast<std::int64_t>(magnitude);
}

// PyYAML's float constructor: underscores dropped, .inf / .nan, sexagesimal a:b.c, else Python's
// float() (1e999 is inf, 1e-999 is 0).
double yaml_float(const std::string& s, const SourceLocation& where) {
  std::string t = strip_underscores(s);
  std::string lower = t;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  const bool negative = !t.empty() && t[0] == '-';
  const std::string body = !t.empty() && (t[0] == '-' || t[0] == '+') ? lower.substr(1) : lower;
  if (body == ".inf") return negative ? -HUGE_VAL : HUGE_VAL;
  if (body == ".nan") return std::nan("");
  if (body.find(':') != std::string::npos) {  // sexagesimal: 1:30.5 is 90.5
    double value = 0;
    std::size_t start = 0;
    while (true) {
      const std::size_t end = body.find(':', start);
      const std::string part = body.substr(start, end == std::string::npos ? std::string::npos : end - start);
      char* stop = nullptr;
      const double v = std::strtod(part.c_str(), &stop);
      if (part.empty() || *stop != '\0') unreadable(where, s, "a float");
      value = value * 60 + v;
      if (end == std::string::npos) break;
      start = end + 1;
    }
    return negative ? -value : value;
  }
  // Python's float() syntax: strtod's, without its hexadecimal, inf and nan spellings.
  if (t.empty() || lower.find_first_of("xn") != std::string::npos || lower.find("inf") != std::string::npos)
    unreadable(where, s, "a float");
  char* stop = nullptr;
  const double v = std::strtod(t.c_str(), &stop);
  if (*stop != '\0') unreadable(where, s, "a float");
  return v;
}

bool yaml_bool(const std::string& s) {
  const char c = static_cast<char>(std::tolower(static_cast<unsigned char>(s[0])));
  return c == 'y' || c == 't' || (c == 'o' && (s[1] == 'n' || s[1] == 'N'));
}

// A plain scalar far beyond the resolvers' regexes: a decimal integer or float written out long, or
// a string.
ConfigNode long_plain_scalar(const std::string& s, const SourceLocation& where) {
  std::size_t i = (s[0] == '-' || s[0] == '+') ? 1 : 0;
  const auto digits = [&] {
    const std::size_t from = i;
    while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '_')) ++i;
    return i - from;
  };
  if (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])) && digits() > 0) {
    if (i == s.size()) return ConfigNode(yaml_int(s, where), where);
    if (s[i] == '.') {
      ++i;
      digits();
      if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
        ++i;
        if (i < s.size() && (s[i] == '-' || s[i] == '+')) ++i;
        const std::size_t from = i;
        while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
        if (i == from) return ConfigNode(s, where);
      }
      if (i == s.size()) return ConfigNode(yaml_float(s, where), where);
    }
  }
  return ConfigNode(s, where);
}

ConfigNode scalar(const YAML::Node& n, const SourceLocation& where) {
  const std::string& s = n.Scalar();
  const std::string& tag = n.Tag();
  if (tag != "?") {  // quoted ("!") or an explicit tag: !!str, !!int, !!float, !!bool, !!null
    const std::string_view name = std::string_view(tag).starts_with(kTagPrefix)
                                      ? std::string_view(tag).substr(kTagPrefix.size())
                                      : std::string_view();
    if (tag == "!" || name == "str") return ConfigNode(s, where);
    if (name == "int") return ConfigNode(yaml_int(s, where), where);
    if (name == "float") return ConfigNode(yaml_float(s, where), where);
    if (name == "null") {
      if (s.size() > kRegexLimit || !std::regex_match(s, kNull)) unreadable(where, s, "!!null");
      return ConfigNode(std::monostate{}, where);
    }
    if (name == "bool") {
      if (s.size() > kRegexLimit || !std::regex_match(s, kBool)) unreadable(where, s, "!!bool");
      return ConfigNode(yaml_bool(s), where);
    }
    throw Error(
        fmt::format("{}: the YAML tag '{}' is not supported (OmegaConf's loader reads !!str, !!int, !!float, "
                    "!!bool and !!null)",
                    where.str(), tag));
  }
  if (s.size() > kRegexLimit) return long_plain_scalar(s, where);
  if (std::regex_match(s, kNull)) return ConfigNode(std::monostate{}, where);
  if (std::regex_match(s, kBool)) return ConfigNode(yaml_bool(s), where);
  if (std::regex_match(s, kInt)) return ConfigNode(yaml_int(s, where), where);
  if (std::regex_match(s, kFloat)) return ConfigNode(yaml_float(s, where), where);
  return ConfigNode(s, where);
}

class Converter {
 public:
  explicit Converter(std::shared_ptr<const std::string> file) : file_(std::move(file)) {}

  ConfigNode convert(const YAML::Node& n) {
    const std::string& file = *file_;
    const SourceLocation where{file_, static_cast<std::uint32_t>(n.Mark().line + 1),
                               static_cast<std::uint32_t>(n.Mark().column + 1)};
    if (++nodes_ > kMaxNodes)
      throw Error(
          fmt::format("{}: the document expands to more than {} values (aliases repeated inside aliases?); "
                      "no config is that large",
                      where.str(), kMaxNodes));
    for (const YAML::Node& a : ancestors_)
      if (a.is(n))
        throw Error(
            fmt::format("{}: an alias refers to a node that contains it (a recursive anchor); it cannot be "
                        "expanded",
                        where.str()));
    if (ancestors_.size() >= kMaxDepth)
      throw Error(fmt::format("{}: nested more than {} levels deep", where.str(), kMaxDepth));
    switch (n.Type()) {
      case YAML::NodeType::Null: return ConfigNode(std::monostate{}, where);
      case YAML::NodeType::Scalar: return scalar(n, where);
      case YAML::NodeType::Sequence: {
        ancestors_.push_back(n);
        ConfigNode::Array a;
        for (const auto& item : n) a.push_back(convert(item));
        ancestors_.pop_back();
        return ConfigNode(std::move(a), where);
      }
      case YAML::NodeType::Map: {
        ancestors_.push_back(n);
        ConfigNode::Table t;
        std::unordered_set<std::string> keys;
        for (const auto& kv : n) {
          if (!kv.first.IsScalar())
            throw Error(fmt::format("{}:{}: a mapping key that is not a scalar cannot become a TOML key", file,
                                    kv.first.Mark().line + 1));
          const std::string key = kv.first.Scalar();
          if (key == "<<")
            throw Error(fmt::format("{}:{}: YAML merge keys (<<) are not supported; write the entries out", file,
                                    kv.first.Mark().line + 1));
          // A set, not a scan of the table: a mapping of 100,000 keys would take quadratic time.
          if (!keys.insert(key).second)
            throw Error(fmt::format("{}:{}: duplicate key '{}'", file, kv.first.Mark().line + 1, key));
          t.emplace_back(key, convert(kv.second));
        }
        ancestors_.pop_back();
        return ConfigNode(std::move(t), where);
      }
      default: throw Error(fmt::format("{}:{}: undefined YAML node", file, n.Mark().line + 1));
    }
  }

 private:
  std::shared_ptr<const std::string> file_;
  std::vector<YAML::Node> ancestors_;
  std::size_t nodes_ = 0;
};

// The file's text with every YAML line break as "\n": yaml-cpp knows only LF and CRLF, PyYAML also
// a lone CR, NEL (U+0085), LS (U+2028) and PS (U+2029).
std::string read_with_line_feeds(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot read the file", path));
  const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string out;
  out.reserve(raw.size());
  for (std::size_t i = 0; i < raw.size(); ++i) {
    const char c = raw[i];
    if (c == '\r') {
      out.push_back('\n');
      if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
    } else if (c == '\xc2' && i + 1 < raw.size() && raw[i + 1] == '\x85') {
      out.push_back('\n');
      ++i;
    } else if (c == '\xe2' && i + 2 < raw.size() && raw[i + 1] == '\x80' &&
               (raw[i + 2] == '\xa8' || raw[i + 2] == '\xa9')) {
      out.push_back('\n');
      i += 2;
    } else {
      out.push_back(c);
    }
  }
  return out;
}

}  // namespace

std::string read_yaml_file(const std::string& path) { return read_with_line_feeds(path); }

std::string yaml_config_to_toml(std::string_view yaml_text, const std::string& file) {
  // YAML is Unicode text (PyYAML refuses other bytes); yaml-cpp passes them through into TOML,
  // which would then not load back. The line of the first bad byte is named.
  if (!simdjson::validate_utf8(yaml_text.data(), yaml_text.size())) {
    std::size_t line = 1, begin = 0;
    for (std::size_t end; (end = yaml_text.find('\n', begin)) != std::string_view::npos || begin < yaml_text.size();
         begin = end + 1, ++line) {
      if (end == std::string_view::npos) end = yaml_text.size();
      if (!simdjson::validate_utf8(yaml_text.data() + begin, end - begin)) break;
    }
    throw Error(fmt::format("{}:{}: not UTF-8 text (a YAML config is Unicode; PyYAML refuses it too)", file, line));
  }
  // PyYAML's reader accepts only printable characters: tab, line breaks, U+0020..U+007E, U+0085,
  // U+00A0..U+D7FF, U+E000..U+FFFD and beyond U+FFFF. Others (NUL, DEL, C1 controls) are refused
  // there, and here by line.
  {
    std::size_t line = 1;
    for (std::size_t i = 0; i < yaml_text.size();) {
      const std::size_t at = i;
      const char32_t cp = next_utf8(yaml_text, i);  // valid UTF-8, checked above
      const bool printable = cp == 0x09 || cp == 0x0A || cp == 0x0D || (cp >= 0x20 && cp <= 0x7E) || cp == 0x85 ||
                             (cp >= 0xA0 && cp <= 0xD7FF) || (cp >= 0xE000 && cp <= 0xFFFD) || cp > 0xFFFF;
      if (!printable)
        throw Error(fmt::format("{}:{}: the character U+{:04X} is not allowed in YAML (PyYAML refuses it too)", file,
                                line, static_cast<std::uint32_t>(cp)));
      if (cp == '\n' || (cp == '\r' && (at + 1 == yaml_text.size() || yaml_text[at + 1] != '\n'))) ++line;
    }
  }
  // Documents are counted with yaml-cpp's event parser, at most two: YAML::LoadAll loops forever
  // on a ',' outside a flow collection (yaml-cpp 0.7 returns an empty document for it again and
  // again without consuming it; found by fuzzing, tests/fuzz/corpus/yaml/stray_comma.yaml).
  const std::string yaml(yaml_text);
  YAML::Node doc;
  try {
    struct DocumentStarts final : YAML::EventHandler {
      std::vector<YAML::Mark> starts, first_nodes;  // per document: its start, its first node
      void node(const YAML::Mark& m) {
        if (first_nodes.size() < starts.size()) first_nodes.push_back(m);
      }
      void OnDocumentStart(const YAML::Mark& m) override { starts.push_back(m); }
      void OnDocumentEnd() override {}
      void OnNull(const YAML::Mark& m, YAML::anchor_t) override { node(m); }
      void OnAlias(const YAML::Mark& m, YAML::anchor_t) override { node(m); }
      void OnScalar(const YAML::Mark& m, const std::string&, YAML::anchor_t, const std::string&) override { node(m); }
      void OnSequenceStart(const YAML::Mark& m, const std::string&, YAML::anchor_t,
                           YAML::EmitterStyle::value) override {
        node(m);
      }
      void OnSequenceEnd() override {}
      void OnMapStart(const YAML::Mark& m, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
        node(m);
      }
      void OnMapEnd() override {}
    } counter;
    std::istringstream in(yaml);
    YAML::Parser parser(in);
    for (int k = 0; k < 2 && parser.HandleNextDocument(counter); ++k) {
    }
    if (counter.starts.size() > 1) {
      const YAML::Mark& second = counter.starts[1];
      if (second.pos == counter.starts[0].pos)  // no progress: yaml-cpp's stray-',' loop
        throw Error(
            fmt::format("{}:{}:{}: expected a document, found a ',' outside a flow collection (PyYAML "
                        "refuses it too)",
                        file, second.line + 1, second.column + 1));
      const YAML::Mark& at = counter.first_nodes.size() > 1 ? counter.first_nodes[1] : second;
      throw Error(fmt::format("{}:{}: a second YAML document; a config is one document (OmegaConf refuses more)", file,
                              at.line + 1));
    }
    doc = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    throw Error(fmt::format("{}:{}:{}: {}", file, e.mark.line + 1, e.mark.column + 1, e.msg));
  }
  if (!doc.IsMap())
    throw Error(fmt::format("{}: the document is not a mapping (a config is a mapping of top-level keys)", file));
  const ConfigNode root = Converter(std::make_shared<const std::string>(file)).convert(doc);
  const std::string text =
      fmt::format("# Converted from {} by `modalities config import`.\n\n", fs::path(file).filename().string()) +
      to_toml(root, /*escape_interpolations=*/false);
  try {
    load_toml_string(text, "converted");  // what we write must load back
  } catch (const std::exception& e) {
    throw Error(
        fmt::format("{}: the TOML converted from it does not load back ({}); {}", file, e.what(), kImporterBug));
  }
  return text;
}

}  // namespace modalities::core
