// Pickle subset and .pbin header (see formats/packed_data.h, layouts in docs/data.md).
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/packed_data.h>

#include <fmt/core.h>

#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string_view>
#include <unordered_map>

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

namespace {

// A value on the stack of the restricted unpickler below. Tuples hold integers only and lists hold
// (offset, length) pairs only, checked when they are built, so nothing nests and no input can
// make the reader recurse or allocate more than a small multiple of its size.
struct PickleValue {
  enum class Kind { kInt, kBool, kTuple, kList, kMark };
  Kind kind = Kind::kInt;
  __int128 integer = 0;
  std::vector<__int128> tuple;
  std::shared_ptr<std::vector<SignedIndexEntry>> list;  // shared: the memo may hold the same list
};

// Pickle's unframing, as Python's reference unpickler (pickle._Unframer) defines it: a FRAME
// opcode may only start when the previous frame is used up, its length must fit in the data, and
// no opcode or argument may cross the end of a frame.
class PickleReader {
 public:
  PickleReader(std::span<const std::byte> bytes, const std::string& what) : b_(bytes), what_(what) {}

  std::size_t pos() const { return pos_; }
  bool at_end() const { return pos_ == b_.size(); }

  Error fail(std::size_t at, const std::string& msg) const {
    return Error(fmt::format("{}: corrupt or unsupported index pickle at byte {}: {}", what_, at, msg));
  }

  void frame(std::size_t op_pos) {
    if (pos_ < frame_end_)
      throw fail(op_pos, fmt::format("FRAME inside a frame that still has {} bytes", frame_end_ - pos_));
    const std::uint64_t n = le(8);
    if (n > b_.size() - pos_)
      throw fail(op_pos, fmt::format("FRAME of {} bytes, but only {} bytes follow", n, b_.size() - pos_));
    frame_end_ = pos_ + static_cast<std::size_t>(n);
  }

  const std::byte* take(std::size_t n) {
    if (pos_ < frame_end_ && n > frame_end_ - pos_)
      throw fail(pos_, fmt::format("{} bytes wanted, but the frame ends after {}", n, frame_end_ - pos_));
    if (n > b_.size() - pos_) throw fail(pos_, "truncated");
    const std::byte* p = b_.data() + pos_;
    pos_ += n;
    return p;
  }
  std::uint8_t u8() { return static_cast<std::uint8_t>(*take(1)); }
  std::uint64_t le(std::size_t n) {
    const std::byte* p = take(n);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(static_cast<std::uint8_t>(p[i])) << (8 * i);
    return v;
  }
  // A protocol-0 text argument: the bytes up to the next '\n' (consumed, not returned).
  std::string_view line() {
    const std::size_t start = pos_;
    for (;;) {
      if (static_cast<char>(*take(1)) == '\n')
        return {reinterpret_cast<const char*>(b_.data() + start), pos_ - start - 1};
      if (pos_ - start > 64) throw fail(start, "text argument longer than 64 bytes");
    }
  }

 private:
  std::span<const std::byte> b_;
  const std::string& what_;
  std::size_t pos_ = 0, frame_end_ = 0;
};

// Decimal integer of the protocol-0 INT / LONG opcodes (optional sign, LONG's optional 'L').
std::optional<__int128> parse_decimal(std::string_view s, bool long_suffix) {
  if (long_suffix && !s.empty() && s.back() == 'L') s.remove_suffix(1);
  bool negative = false;
  if (!s.empty() && (s[0] == '-' || s[0] == '+')) {
    negative = s[0] == '-';
    s.remove_prefix(1);
  }
  if (s.empty() || s.size() > 30) return std::nullopt;
  __int128 v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  return negative ? -v : v;
}

}  // namespace

std::vector<SignedIndexEntry> unpickle_signed_index(std::span<const std::byte> bytes, const std::string& what) {
  using Kind = PickleValue::Kind;
  PickleReader r(bytes, what);
  std::vector<PickleValue> stack;
  std::vector<std::size_t> marks;  // stack sizes at MARK
  std::unordered_map<std::uint64_t, PickleValue> memo;
  std::size_t op_pos = 0;
  auto fail = [&](const std::string& msg) { return r.fail(op_pos, msg); };
  auto pop = [&] {
    if (stack.size() <= (marks.empty() ? 0 : marks.back())) throw fail("stack underflow");
    PickleValue v = std::move(stack.back());
    stack.pop_back();
    return v;
  };
  auto pop_mark = [&] {
    if (marks.empty()) throw fail("no MARK to pop to");
    std::vector<PickleValue> items(std::make_move_iterator(stack.begin() + static_cast<std::ptrdiff_t>(marks.back())),
                                   std::make_move_iterator(stack.end()));
    stack.resize(marks.back());
    marks.pop_back();
    return items;
  };
  auto push_int = [&](__int128 v) { stack.push_back({Kind::kInt, v, {}, nullptr}); };
  auto push_tuple = [&](std::vector<PickleValue> items) {
    PickleValue t{Kind::kTuple, 0, {}, nullptr};
    for (const PickleValue& v : items) {
      if (v.kind != Kind::kInt)
        throw fail(v.kind == Kind::kBool ? "a boolean inside a tuple (expected integers)"
                                         : "a tuple holds something other than integers");
      t.tuple.push_back(v.integer);
    }
    stack.push_back(std::move(t));
  };
  auto append = [&](std::vector<SignedIndexEntry>& list, const PickleValue& v) {
    if (v.kind != Kind::kTuple || v.tuple.size() != 2) throw fail("a list item is not an (offset, length) pair");
    constexpr __int128 kMax = std::numeric_limits<std::int64_t>::max();
    if (v.tuple[0] < -kMax || v.tuple[0] > kMax || v.tuple[1] < 0 || v.tuple[1] > kMax)
      throw fail("offset or length out of range (negative length, or wider than 63 bits)");
    list.emplace_back(static_cast<std::int64_t>(v.tuple[0]), static_cast<std::int64_t>(v.tuple[1]));
  };
  auto list_below = [&](std::size_t depth) -> std::vector<SignedIndexEntry>& {
    if (stack.size() < depth + 1 || stack[stack.size() - 1 - depth].kind != Kind::kList)
      throw fail("APPEND(S) without a list to append to");
    return *stack[stack.size() - 1 - depth].list;
  };
  auto put = [&](std::uint64_t key) {
    if (stack.empty()) throw fail("memo store of an empty stack");
    if (stack.back().kind == Kind::kMark) throw fail("memo store of a MARK");
    memo[key] = stack.back();
  };
  auto get = [&](std::uint64_t key) {
    auto it = memo.find(key);
    if (it == memo.end()) throw fail(fmt::format("memo key {} was never stored", key));
    stack.push_back(it->second);
  };
  auto text_uint = [&](std::string_view s) {
    const auto v = parse_decimal(s, false);
    if (!v || *v < 0) throw fail("bad memo key");
    return static_cast<std::uint64_t>(*v);
  };
  for (;;) {
    op_pos = r.pos();
    const std::uint8_t op = r.u8();
    switch (op) {
      case 0x80: {  // PROTO
        const std::uint8_t v = r.u8();
        if (v > 5) throw fail(fmt::format("pickle protocol {} (expected 0-5)", v));
        break;
      }
      case 0x95: r.frame(op_pos); break;                // FRAME
      case 0x28: marks.push_back(stack.size()); break;  // MARK
      case 0x5d: stack.push_back({Kind::kList, 0, {}, std::make_shared<std::vector<SignedIndexEntry>>()}); break;
      case 0x6c: {  // LIST (protocol 0): the items since MARK
        auto items = pop_mark();
        auto list = std::make_shared<std::vector<SignedIndexEntry>>();
        for (const PickleValue& v : items) append(*list, v);
        stack.push_back({Kind::kList, 0, {}, std::move(list)});
        break;
      }
      case 0x61: {  // APPEND
        PickleValue v = pop();
        append(list_below(0), v);
        break;
      }
      case 0x65: {  // APPENDS
        auto items = pop_mark();
        auto& list = list_below(0);
        for (const PickleValue& v : items) append(list, v);
        break;
      }
      case 0x29: push_tuple({}); break;          // EMPTY_TUPLE
      case 0x74: push_tuple(pop_mark()); break;  // TUPLE
      case 0x85:                                 // TUPLE1
      case 0x86:                                 // TUPLE2
      case 0x87: {                               // TUPLE3
        std::vector<PickleValue> items(op - 0x84);
        for (auto it = items.rbegin(); it != items.rend(); ++it) *it = pop();
        push_tuple(std::move(items));
        break;
      }
      case 0x4b: push_int(r.le(1)); break;                                                         // BININT1
      case 0x4d: push_int(r.le(2)); break;                                                         // BININT2
      case 0x4a: push_int(static_cast<std::int32_t>(static_cast<std::uint32_t>(r.le(4)))); break;  // BININT
      case 0x8a:                                                                                   // LONG1
      case 0x8b: {                                                                                 // LONG4
        const std::uint64_t n = op == 0x8a ? r.u8() : r.le(4);
        if (n > 15) throw fail(fmt::format("integer of {} bytes is too large for an offset", n));
        const std::byte* p = r.take(static_cast<std::size_t>(n));
        unsigned __int128 u = 0;
        for (std::size_t i = 0; i < n; ++i)
          u |= static_cast<unsigned __int128>(static_cast<std::uint8_t>(p[i])) << (8 * i);
        __int128 v = static_cast<__int128>(u);
        if (n > 0 && (static_cast<std::uint8_t>(p[n - 1]) & 0x80)) v -= static_cast<__int128>(1) << (8 * n);
        push_int(v);
        break;
      }
      case 0x49: {  // INT (protocol 0 text); "I00" / "I01" are False / True
        const std::string_view s = r.line();
        if (s == "00" || s == "01") {
          stack.push_back({Kind::kBool, s == "01", {}, nullptr});
          break;
        }
        const auto v = parse_decimal(s, false);
        if (!v) throw fail("bad INT text");
        push_int(*v);
        break;
      }
      case 0x4c: {  // LONG (protocol 0 text)
        const auto v = parse_decimal(r.line(), true);
        if (!v) throw fail("bad LONG text");
        push_int(*v);
        break;
      }
      case 0x88:
      case 0x89: stack.push_back({Kind::kBool, op == 0x88, {}, nullptr}); break;  // NEWTRUE / NEWFALSE
      case 0x94: put(memo.size()); break;                                         // MEMOIZE
      case 0x70: put(text_uint(r.line())); break;                                 // PUT
      case 0x71: put(r.le(1)); break;                                             // BINPUT
      case 0x72: put(r.le(4)); break;                                             // LONG_BINPUT
      case 0x67: get(text_uint(r.line())); break;                                 // GET
      case 0x68: get(r.le(1)); break;                                             // BINGET
      case 0x6a: get(r.le(4)); break;                                             // LONG_BINGET
      case 0x30: pop(); break;                                                    // POP
      case 0x31: pop_mark(); break;                                               // POP_MARK
      case 0x32: {                                                                // DUP
        if (stack.empty() || stack.back().kind == Kind::kMark) throw fail("DUP of an empty stack");
        stack.push_back(stack.back());
        break;
      }
      case 0x2e: {  // STOP
        PickleValue v = pop();
        if (v.kind != Kind::kList) throw fail("the pickle is not a list of (offset, length) tuples");
        if (!stack.empty() || !marks.empty())
          throw fail(fmt::format("{} values and {} MARKs left on the stack at STOP", stack.size(), marks.size()));
        if (!r.at_end()) throw fail(fmt::format("{} bytes after STOP", bytes.size() - r.pos()));
        return std::move(*v.list);
      }
      default:
        throw fail(
            fmt::format("opcode 0x{:02x} is not allowed in an index (only the data opcodes that build a "
                        "list of integer pairs are read; nothing is executed)",
                        op));
    }
  }
}

std::vector<IndexEntry> unpickle_index(std::span<const std::byte> bytes, const std::string& what) {
  const std::vector<SignedIndexEntry> signed_entries = unpickle_signed_index(bytes, what);
  std::vector<IndexEntry> out;
  out.reserve(signed_entries.size());
  for (std::size_t k = 0; k < signed_entries.size(); ++k) {
    const auto [offset, length] = signed_entries[k];
    if (offset < 0) throw Error(fmt::format("{}: entry {} has the negative offset {}", what, k, offset));
    out.emplace_back(static_cast<std::uint64_t>(offset), static_cast<std::uint64_t>(length));
  }
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
  std::vector<IndexEntry> entries = unpickle_index(bytes, idx_file.string());
  // create_raw_index gives the lines of the JSONL their entries in order: each starts after the
  // '\n' that ends the line before it (later, when lines were dropped as faulty). An entry that
  // starts earlier is a corrupt index.
  std::uint64_t next = 0;
  for (std::size_t k = 0; k < entries.size(); ++k) {
    const auto [offset, length] = entries[k];
    if (offset < next)
      throw Error(
          fmt::format("{}: entry {} starts at byte {}, inside or before the line of entry {} (which ends at "
                      "byte {}): the index is corrupt; re-create it with `modalities data create_raw_index`",
                      idx_file.string(), k, offset, k - 1, next - 1));
    if (length >= std::numeric_limits<std::uint64_t>::max() - offset)
      throw Error(fmt::format("{}: entry {} has the impossible length {}", idx_file.string(), k, length));
    next = offset + length + 1;
  }
  return entries;
}

void check_raw_index_fits(std::span<const IndexEntry> entries, std::uint64_t jsonl_size,
                          const std::filesystem::path& idx_file, const std::filesystem::path& jsonl_file) {
  for (std::size_t k = 0; k < entries.size(); ++k)
    if (entries[k].first > jsonl_size || entries[k].second > jsonl_size - entries[k].first)
      throw Error(
          fmt::format("the raw index '{}' does not belong to '{}': entry {} ({}, {}) lies beyond the end of "
                      "the file ({} bytes); re-create it with `modalities data create_raw_index`",
                      idx_file.string(), jsonl_file.string(), k, entries[k].first, entries[k].second, jsonl_size));
}

std::optional<std::string> raw_index_entry_mismatch(std::string_view jsonl, const IndexEntry& entry) {
  const auto [offset, length] = entry;
  if (offset > jsonl.size() || length > jsonl.size() - offset) return "it lies beyond the end of the file";
  if (offset > 0 && jsonl[offset - 1] != '\n') return "it does not start at the beginning of a line";
  if (offset + length < jsonl.size() && jsonl[offset + length] != '\n') return "it does not end at the end of a line";
  return std::nullopt;
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
