// Non-template helpers of the schema machinery: did-you-mean matching and
// number/list formatting shared by every plugin's messages.
#include <modalities/sdk/registrar.h>
#include <modalities/sdk/schema.h>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>

namespace modalities {

namespace {
// Optimal string alignment distance (Levenshtein plus adjacent transpositions),
// case-insensitive: typos such as "lerning_rate" or "vocab_szie" stay close.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<std::size_t>> d(n + 1, std::vector<std::size_t>(m + 1));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = j;
  auto lower = [](char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); };
  for (std::size_t i = 1; i <= n; ++i) {
    for (std::size_t j = 1; j <= m; ++j) {
      const std::size_t cost = lower(a[i - 1]) == lower(b[j - 1]) ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && lower(a[i - 1]) == lower(b[j - 2]) && lower(a[i - 2]) == lower(b[j - 1]))
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}
}  // namespace

std::string closest_match(std::string_view word, std::span<const std::string> candidates) {
  std::string best;
  std::size_t best_distance = std::max<std::size_t>(2, word.size() / 3) + 1;
  for (const auto& c : candidates) {
    const std::size_t dist = edit_distance(word, c);
    // A candidate that contains the word (or vice versa) is also a plausible intent.
    const bool contains = word.size() >= 3 && (c.find(word) != std::string::npos || word.find(c) != std::string::npos);
    const std::size_t score = contains ? std::min<std::size_t>(dist, 1) : dist;
    if (score < best_distance) {
      best_distance = score;
      best = c;
    }
  }
  return best;
}

std::string quoted_list(std::span<const std::string> items) {
  std::string s;
  for (std::size_t i = 0; i < items.size(); ++i) s += (i ? ", '" : "'") + items[i] + "'";
  return s;
}

std::string format_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  std::string s = fmt::format("{}", x);
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

std::string toml_quote(std::string_view s, bool escape_interpolation) {
  std::string out = "\"";
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      case '$': out += (escape_interpolation && i + 1 < s.size() && s[i + 1] == '{') ? "\\\\$" : "$"; break;
      default:
        // TOML forbids raw control characters (U+0000..U+001F but tab, and U+007F) in strings.
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F) out += fmt::format("\\u{:04X}", static_cast<int>(c));
        else out += c;
    }
  }
  return out + "\"";
}

BuildContext::~BuildContext() = default;

const Value& BuildContext::config() const {
  static const Value none;
  return none;
}

Value BuildContext::build(std::string_view component_key, std::string_view variant_key, Value) {
  throw Error(
      fmt::format("{}: this host cannot build {}/{} from inside a factory", path(), component_key, variant_key));
}
Registrar::~Registrar() = default;

}  // namespace modalities
