// Pickle subset and .pbin header (see formats/packed_data.h, spec data.md §2, §4).
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/packed_data.h>

#include <fmt/core.h>

#include <cstring>
#include <fstream>

namespace modalities::formats {

namespace {

void put_u64(std::string& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// BININT1 / BININT2 / BININT / LONG1, exactly as CPython's save_long chooses.
void put_int(std::string& frame, std::uint64_t v) {
  if (v <= 0xff) {
    frame.push_back('\x4b');
    frame.push_back(static_cast<char>(v));
  } else if (v <= 0xffff) {
    frame.push_back('\x4d');
    frame.push_back(static_cast<char>(v & 0xff));
    frame.push_back(static_cast<char>(v >> 8));
  } else if (v <= 0x7fffffffULL) {
    frame.push_back('\x4a');
    for (int i = 0; i < 4; ++i) frame.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  } else {
    // n = bit_length div 8 + 1 bytes of little-endian two's complement (keeps a zero sign byte).
    int bits = 64 - __builtin_clzll(v);
    const int n = bits / 8 + 1;
    frame.push_back('\x8a');
    frame.push_back(static_cast<char>(n));
    for (int i = 0; i < n; ++i) frame.push_back(i < 8 ? static_cast<char>((v >> (8 * i)) & 0xff) : '\0');
  }
}

constexpr std::size_t kFrameTarget = 64 * 1024;

}  // namespace

std::string pickle_index(std::span<const IndexEntry> entries) {
  std::string out = "\x80\x04";
  std::string frame;
  auto flush = [&] {
    if (frame.size() >= 4) {
      out.push_back('\x95');
      put_u64(out, frame.size());
    }
    out += frame;
    frame.clear();
  };
  auto boundary = [&] {
    if (frame.size() >= kFrameTarget) flush();
  };
  frame += "\x5d\x94";  // EMPTY_LIST, MEMOIZE
  auto tuple = [&](const IndexEntry& e) {
    boundary();
    put_int(frame, e.first);
    boundary();
    put_int(frame, e.second);
    frame += "\x86\x94";  // TUPLE2, MEMOIZE
  };
  if (entries.size() == 1) {
    tuple(entries[0]);
    frame.push_back('\x61');  // APPEND
  } else if (entries.size() >= 2) {
    for (std::size_t start = 0; start < entries.size(); start += 1000) {
      frame.push_back('\x28');  // MARK
      const std::size_t end = std::min(entries.size(), start + 1000);
      for (std::size_t i = start; i < end; ++i) tuple(entries[i]);
      frame.push_back('\x65');  // APPENDS
    }
  }
  frame.push_back('\x2e');  // STOP
  flush();
  return out;
}

std::vector<IndexEntry> unpickle_index(std::span<const std::byte> bytes, const std::string& what) {
  std::vector<IndexEntry> out;
  std::vector<std::uint64_t> ints;       // integers awaiting TUPLE2
  std::vector<std::size_t> marks;        // positions in `pending` at MARK
  std::vector<IndexEntry> pending;       // tuples since the last APPEND(S)
  bool have_list = false, stopped = false;
  std::size_t pos = 0;
  auto fail = [&](const std::string& msg) -> Error {
    return Error(fmt::format("{}: unsupported or corrupt index pickle at byte {}: {}", what, pos, msg));
  };
  auto need = [&](std::size_t n) {
    if (pos + n > bytes.size()) throw fail("truncated");
  };
  auto u8 = [&] { need(1); return static_cast<std::uint8_t>(bytes[pos++]); };
  auto le = [&](std::size_t n) {
    need(n);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(static_cast<std::uint8_t>(bytes[pos + i])) << (8 * i);
    pos += n;
    return v;
  };
  while (!stopped) {
    const std::size_t op_pos = pos;
    const std::uint8_t op = u8();
    switch (op) {
      case 0x80: {  // PROTO
        const auto v = u8();
        if (v < 2 || v > 5) throw fail(fmt::format("pickle protocol {} (expected 2-5)", v));
        break;
      }
      case 0x95: le(8); break;                    // FRAME: length marker only
      case 0x5d: have_list = true; break;         // EMPTY_LIST
      case 0x94: break;                           // MEMOIZE
      case 0x71: le(1); break;                    // BINPUT
      case 0x72: le(4); break;                    // LONG_BINPUT
      case 0x28: marks.push_back(pending.size()); break;  // MARK
      case 0x4b: ints.push_back(le(1)); break;    // BININT1
      case 0x4d: ints.push_back(le(2)); break;    // BININT2
      case 0x4a: {                                // BININT (signed)
        const auto v = static_cast<std::int32_t>(static_cast<std::uint32_t>(le(4)));
        if (v < 0) throw fail("negative offset or length");
        ints.push_back(static_cast<std::uint64_t>(v));
        break;
      }
      case 0x8a: {  // LONG1
        const std::size_t n = u8();
        need(n);
        if (n > 9 || (n == 9 && bytes[pos + 8] != std::byte{0})) throw fail("integer wider than 64 bits");
        if (n > 0 && (static_cast<std::uint8_t>(bytes[pos + n - 1]) & 0x80)) throw fail("negative offset or length");
        ints.push_back(le(std::min<std::size_t>(n, 8)));
        if (n == 9) ++pos;
        break;
      }
      case 0x86:  // TUPLE2
      case 0x74: {  // TUPLE (after MARK, exactly two ints)
        if (op == 0x74) {
          if (marks.empty()) throw fail("TUPLE without MARK");
          marks.pop_back();
        }
        if (ints.size() < 2) throw fail("tuple without two integers");
        pending.emplace_back(ints[ints.size() - 2], ints.back());
        ints.resize(ints.size() - 2);
        break;
      }
      case 0x61:  // APPEND
        if (!have_list || pending.empty()) throw fail("APPEND without a list item");
        out.push_back(pending.back());
        pending.pop_back();
        break;
      case 0x65: {  // APPENDS
        if (!have_list || marks.empty()) throw fail("APPENDS without MARK");
        const std::size_t from = marks.back();
        marks.pop_back();
        out.insert(out.end(), pending.begin() + static_cast<std::ptrdiff_t>(from), pending.end());
        pending.resize(from);
        break;
      }
      case 0x2e: stopped = true; break;  // STOP
      default: pos = op_pos; throw fail(fmt::format("opcode 0x{:02x} is not allowed in an index", op));
    }
  }
  if (!have_list || !pending.empty() || !ints.empty()) throw fail("pickle is not a list of (offset, length) tuples");
  return out;
}

namespace {
std::vector<std::byte> read_all(const std::filesystem::path& file, std::uint64_t offset = 0) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open for reading: {}", file.string(), std::strerror(errno)));
  in.seekg(0, std::ios::end);
  const auto size = static_cast<std::uint64_t>(in.tellg());
  if (offset > size) throw Error(fmt::format("{}: file is truncated", file.string()));
  std::vector<std::byte> bytes(size - offset);
  in.seekg(static_cast<std::streamoff>(offset));
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!in) throw Error(fmt::format("{}: read error", file.string()));
  return bytes;
}
}  // namespace

std::vector<IndexEntry> read_raw_index(const std::filesystem::path& idx_file) {
  const auto bytes = read_all(idx_file);
  if (bytes.empty()) throw Error(fmt::format("{}: index file is empty", idx_file.string()));
  return unpickle_index(bytes, idx_file.string());
}

PackedHeader read_packed_header(const std::filesystem::path& pbin_file) {
  std::ifstream in(pbin_file, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open for reading: {}", pbin_file.string(), std::strerror(errno)));
  in.seekg(0, std::ios::end);
  PackedHeader h;
  h.file_size = static_cast<std::uint64_t>(in.tellg());
  if (h.file_size < kPackedHeaderSize)
    throw Error(fmt::format("{}: {} bytes is too short for a .pbin file (12-byte header expected)", pbin_file.string(),
                            h.file_size));
  in.seekg(0);
  unsigned char hdr[kPackedHeaderSize];
  in.read(reinterpret_cast<char*>(hdr), kPackedHeaderSize);
  for (int i = 0; i < 8; ++i) h.data_len |= static_cast<std::uint64_t>(hdr[i]) << (8 * i);
  for (int i = 0; i < 4; ++i) h.token_size |= static_cast<std::uint32_t>(hdr[8 + i]) << (8 * i);
  if (h.token_size != 1 && h.token_size != 2 && h.token_size != 4)
    throw Error(fmt::format("{}: token size {} in the header is not 1, 2 or 4 (not a .pbin file?)", pbin_file.string(),
                            h.token_size));
  if (h.data_len > h.file_size - kPackedHeaderSize)
    throw Error(fmt::format("{}: header says {} data bytes but the file holds only {} (truncated?)", pbin_file.string(),
                            h.data_len, h.file_size - kPackedHeaderSize));
  if (h.data_len % h.token_size != 0)
    throw Error(fmt::format("{}: data length {} is not a multiple of the token size {}", pbin_file.string(), h.data_len,
                            h.token_size));
  return h;
}

}  // namespace modalities::formats
