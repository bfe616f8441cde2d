// UTF-8 encoding and decoding of one code point, shared by the host (Jinja strings, the YAML
// importer) and plugins (the Hugging Face tokenizer's normalizers). Header-only and dependency-free.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>

namespace modalities {

/// Appends the UTF-8 bytes of `cp` (a Unicode scalar value; not checked) to `out`.
inline void append_utf8(std::string& out, char32_t cp) {
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

/// The code point of the UTF-8 sequence at s[i], advancing i past it. The length comes from the
/// lead byte; a sequence cut short by the end of `s` takes what is left. Not validated: check the
/// text first (simdjson::validate_utf8) where it can be malformed.
inline char32_t next_utf8(std::string_view s, std::size_t& i) {
  const auto b = [&](std::size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(s[i + k])); };
  const char32_t c0 = b(0);
  const std::size_t n = std::min<std::size_t>(c0 >= 0xF0 ? 4 : c0 >= 0xE0 ? 3 : c0 >= 0xC0 ? 2 : 1, s.size() - i);
  char32_t cp = c0;
  if (n == 2) cp = ((c0 & 0x1Fu) << 6) | (b(1) & 0x3Fu);
  else if (n == 3) cp = ((c0 & 0x0Fu) << 12) | ((b(1) & 0x3Fu) << 6) | (b(2) & 0x3Fu);
  else if (n == 4) cp = ((c0 & 0x07u) << 18) | ((b(1) & 0x3Fu) << 12) | ((b(2) & 0x3Fu) << 6) | (b(3) & 0x3Fu);
  i += n;
  return cp;
}

}  // namespace modalities
