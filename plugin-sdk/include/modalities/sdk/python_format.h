// How Python spells the numbers and strings that Modalities prints: repr(float),
// round(x, n) and json.dumps. The training log line (result_line in
// interfaces/batch.h) and the results subscribers' JSONL file must match
// Modalities' byte for byte, and no C++ JSON or formatting library follows these
// rules (JSON libraries print NaN as null, use other separators and exponent
// thresholds), so they are written out here. Checked against ~2,700 values
// produced by Python (plugins/subscribers/tests/data/python_format.tsv).
#pragma once

#include <modalities/sdk/error.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace modalities::py {

/// Python's repr(float) (also str(float)): the shortest digits that round-trip,
/// fixed notation for decimal exponents -4 <= e < 16 (always with a fraction,
/// "3.0"), otherwise "1.5e-05" / "1e+16". NaN and infinities as "nan", "inf".
inline std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  // std::to_chars without a precision gives the shortest round-trip digits,
  // the same digits as Python's repr (both pick the nearest shortest string).
  const auto res = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string_view s(buf, static_cast<std::size_t>(res.ptr - buf));  // "-1.2345e-05"
  std::string sign;
  if (!s.empty() && s.front() == '-') {
    sign = "-";
    s.remove_prefix(1);
  }
  const auto e = s.find('e');
  std::string digits;
  for (char c : s.substr(0, e))
    if (c != '.') digits += c;
  const int exp10 = std::atoi(std::string(s.substr(e + 1)).c_str());
  const int decpt = exp10 + 1;  // value = 0.<digits> * 10^decpt
  const int n = static_cast<int>(digits.size());
  std::string out;
  if (decpt <= -4 || decpt > 16) {
    out = digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exp10 < 0 ? '-' : '+', std::abs(exp10));
  } else if (decpt <= 0) {
    out = "0." + std::string(static_cast<std::size_t>(-decpt), '0') + digits;
  } else if (decpt >= n) {
    out = digits + std::string(static_cast<std::size_t>(decpt - n), '0') + ".0";
  } else {
    out = digits.substr(0, static_cast<std::size_t>(decpt)) + "." + digits.substr(static_cast<std::size_t>(decpt));
  }
  return sign + out;
}

/// printf into a std::string (glibc rounds the exact binary value, ties to even).
template <class... A>
std::string printf_string(const char* format, A... args) {
  const int len = std::snprintf(nullptr, 0, format, args...);
  std::string s(static_cast<std::size_t>(len) + 1, '\0');
  std::snprintf(s.data(), s.size(), format, args...);
  s.resize(static_cast<std::size_t>(len));
  return s;
}

/// Python's round(x, ndigits) for a float: the decimal nearest to the exact
/// binary value of x, ties to even (round(2.675, 2) == 2.67 because 2.675 is
/// stored as 2.67499999...; round(0.125, 2) == 0.12), converted back to float.
inline double round(double x, int ndigits) {
  if (!std::isfinite(x) || x == 0.0) return x;
  if (ndigits > 330) return x;  // beyond double precision, as Python
  if (ndigits >= 0) return std::strtod(printf_string("%.*f", ndigits, x).c_str(), nullptr);
  // Negative ndigits round to a multiple of 10^-ndigits: that many
  // significant digits of the %e form, or 0 / +-10^-ndigits below that.
  // 18 significant digits never carry into the next power of ten for a double.
  const std::string sci = printf_string("%.17e", x);
  const int exp10 = std::atoi(sci.c_str() + sci.find('e') + 1);
  const int significant = exp10 + 1 + ndigits;
  if (significant >= 1) return std::strtod(printf_string("%.*e", significant - 1, x).c_str(), nullptr);
  const double unit = std::strtod(fmt::format("1e{}", -ndigits).c_str(), nullptr);
  const double half = std::strtod(fmt::format("5e{}", -ndigits - 1).c_str(), nullptr);
  const double magnitude = std::fabs(x) > half ? unit : 0.0;  // an exact tie goes to the even 0
  return std::copysign(magnitude, x);
}

/// A JSON string literal as json.dumps writes it (ensure_ascii=True): ASCII
/// printable characters as they are, \" \\ \b \f \n \r \t, every other code
/// point as \uXXXX (lowercase hex; surrogate pairs above U+FFFF). Bytes that
/// are not UTF-8 become \ufffd (Python strings cannot hold them).
inline std::string json_string(std::string_view s) {
  std::string out = "\"";
  auto unit = [&out](std::uint32_t u) { out += fmt::format("\\u{:04x}", u); };
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::uint32_t cp = 0;
    std::size_t len = 1;
    if (c < 0x80) cp = c;
    else if ((c & 0xE0) == 0xC0) cp = c & 0x1F, len = 2;
    else if ((c & 0xF0) == 0xE0) cp = c & 0x0F, len = 3;
    else if ((c & 0xF8) == 0xF0) cp = c & 0x07, len = 4;
    else cp = 0xFFFD;
    bool ok = cp != 0xFFFD && i + len <= s.size();
    for (std::size_t k = 1; ok && k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) ok = false;
      else cp = (cp << 6) | (cc & 0x3F);
    }
    if (ok && ((len == 2 && cp < 0x80) || (len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
               (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))))
      ok = false;  // overlong forms, surrogates, out of range
    if (!ok) {
      cp = 0xFFFD;
      len = 1;
    }
    i += len;
    switch (cp) {
      case '"': out += "\\\""; continue;
      case '\\': out += "\\\\"; continue;
      case '\b': out += "\\b"; continue;
      case '\f': out += "\\f"; continue;
      case '\n': out += "\\n"; continue;
      case '\r': out += "\\r"; continue;
      case '\t': out += "\\t"; continue;
      default: break;
    }
    if (cp >= 0x20 && cp <= 0x7E) out += static_cast<char>(cp);
    else if (cp < 0x10000) unit(cp);
    else {
      const std::uint32_t v = cp - 0x10000;
      unit(0xD800 | (v >> 10));
      unit(0xDC00 | (v & 0x3FF));
    }
  }
  return out + "\"";
}

/// A float as json.dumps writes it: repr, but NaN / Infinity / -Infinity.
inline std::string json_float(double x) {
  if (std::isnan(x)) return "NaN";
  if (std::isinf(x)) return x > 0 ? "Infinity" : "-Infinity";
  return float_repr(x);
}

namespace detail {
inline void json_tensor_values(const at::Tensor& t, std::int64_t dim, std::int64_t& offset, std::string& out,
                               const std::vector<std::string>& items) {
  if (dim == t.dim()) {
    out += items[static_cast<std::size_t>(offset++)];
    return;
  }
  out += "[";
  for (std::int64_t i = 0; i < t.size(dim); ++i) {
    if (i > 0) out += ", ";
    json_tensor_values(t, dim + 1, offset, out, items);
  }
  out += "]";
}
}  // namespace detail

/// A tensor as Modalities' JSONL writer stores it: `tensor.item()` for a 0-d
/// tensor, `tensor.tolist()` (nested lists) otherwise, through json.dumps.
/// Floating dtypes give Python floats (the exact value widened to double),
/// integer dtypes ints, bool true/false.
inline std::string json_tensor(const at::Tensor& value) {
  const at::Tensor t = value.detach().to(at::kCPU).contiguous();
  std::vector<std::string> items;
  items.reserve(static_cast<std::size_t>(t.numel()));
  if (t.is_floating_point()) {
    const at::Tensor d = t.to(at::kDouble).contiguous();
    const double* p = d.data_ptr<double>();
    for (std::int64_t i = 0; i < d.numel(); ++i) items.push_back(json_float(p[i]));
  } else if (t.scalar_type() == at::kBool) {
    const at::Tensor b = t.to(at::kBool).contiguous();
    const bool* p = b.data_ptr<bool>();
    for (std::int64_t i = 0; i < b.numel(); ++i) items.push_back(p[i] ? "true" : "false");
  } else if (at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
    if (t.scalar_type() == at::kUInt64) {
      const std::uint64_t* p = t.data_ptr<std::uint64_t>();
      for (std::int64_t i = 0; i < t.numel(); ++i) items.push_back(fmt::format("{}", p[i]));
    } else {
      const at::Tensor l = t.to(at::kLong).contiguous();
      const std::int64_t* p = l.data_ptr<std::int64_t>();
      for (std::int64_t i = 0; i < l.numel(); ++i) items.push_back(fmt::format("{}", p[i]));
    }
  } else {
    throw Error(fmt::format("cannot write a tensor of dtype {} as JSON (Python's json.dumps cannot either)",
                            c10::toString(t.scalar_type())));
  }
  std::string out;
  std::int64_t offset = 0;
  detail::json_tensor_values(t, 0, offset, out, items);
  return out;
}

/// `value.float().mean().item()`: the number Modalities rounds and prints.
inline double mean_as_float(const at::Tensor& value) { return value.detach().to(at::kFloat).mean().item<double>(); }

}  // namespace modalities::py
