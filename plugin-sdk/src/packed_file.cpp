// Memory-mapped `.pbin` reader (see formats/packed_file.h; layout: docs/data.md).
// POSIX mmap rather than a library: the mapping is the whole point (O(1)
// random access into multi-GB files without reading them), and it is 20 lines.
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/packed_file.h>

#include <fmt/core.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <exception>
#include <mutex>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace modalities::formats {

struct PackedFile::State {
  std::filesystem::path path;
  std::string name;  // path as a string, for messages
  const std::byte* base = nullptr;
  std::size_t mapped = 0;
  PackedHeader header;

  std::once_flag index_once;
  std::vector<IndexEntry> index;
  bool legacy = false;

  ~State() {
    if (base != nullptr) ::munmap(const_cast<std::byte*>(base), mapped);
  }
  const std::byte* data() const { return base + kPackedHeaderSize; }
};

namespace {

std::uint64_t read_le(const std::byte* p, std::size_t n) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(std::to_integer<std::uint8_t>(p[i])) << (8 * i);
  return v;
}

// Widens `count` little-endian tokens of width W starting at `src` into int64.
template <typename T>
void widen(const std::byte* src, std::uint64_t count, std::int64_t* out) {
  for (std::uint64_t i = 0; i < count; ++i) {
    T v;
    std::memcpy(&v, src + i * sizeof(T), sizeof(T));
    if constexpr (std::endian::native != std::endian::little)
      v = static_cast<T>(read_le(src + i * sizeof(T), sizeof(T)));
    out[i] = static_cast<std::int64_t>(v);
  }
}

}  // namespace

PackedFile::PackedFile() = default;
PackedFile::PackedFile(const std::filesystem::path& path) { open(path); }
PackedFile::~PackedFile() = default;
PackedFile::PackedFile(PackedFile&&) noexcept = default;
PackedFile& PackedFile::operator=(PackedFile&&) noexcept = default;

void PackedFile::close() noexcept { state_.reset(); }

void PackedFile::open(const std::filesystem::path& path) {
  auto s = std::make_unique<State>();
  s->path = path;
  s->name = path.string();
  const int fd = ::open(s->name.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("{}: cannot open .pbin file: {}", s->name, std::strerror(errno)));
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error(fmt::format("{}: cannot stat: {}", s->name, std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) throw Error(fmt::format("{}: not a regular file", s->name));
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size < kPackedHeaderSize)
    throw Error(fmt::format("{}: {} bytes is too short for a .pbin file (12-byte header expected; empty or truncated?)",
                            s->name, size));
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED)
    throw Error(fmt::format("{}: cannot memory-map {} bytes: {}", s->name, size, std::strerror(errno)));
  s->base = static_cast<const std::byte*>(p);
  s->mapped = size;

  PackedHeader& h = s->header;
  h.file_size = size;
  h.data_len = read_le(s->base, 8);
  h.token_size = static_cast<std::uint32_t>(read_le(s->base + 8, 4));
  if (h.token_size != 1 && h.token_size != 2 && h.token_size != 4)
    throw Error(
        fmt::format("{}: token size {} in the header is not 1, 2 or 4 (not a .pbin file?)", s->name, h.token_size));
  if (h.data_len > size - kPackedHeaderSize)
    throw Error(fmt::format("{}: header says {} data bytes but the file holds only {} after the header (truncated?)",
                            s->name, h.data_len, size - kPackedHeaderSize));
  if (h.data_len % h.token_size != 0)
    throw Error(
        fmt::format("{}: data length {} is not a multiple of the token size {}", s->name, h.data_len, h.token_size));
  state_ = std::move(s);
}

const PackedFile::State& PackedFile::state() const {
  if (!state_) throw Error("PackedFile: no file is open");
  return *state_;
}

const std::filesystem::path& PackedFile::path() const { return state().path; }
const PackedHeader& PackedFile::header() const { return state().header; }

std::uint64_t PackedFile::token(std::uint64_t i) const {
  const State& s = state();
  if (i >= s.header.num_tokens())
    throw Error(
        fmt::format("{}: token {} is out of range (the file holds {} tokens)", s.name, i, s.header.num_tokens()));
  return read_le(s.data() + i * s.header.token_size, s.header.token_size);
}

void PackedFile::copy_tokens(std::uint64_t first, std::uint64_t count, std::int64_t* out) const {
  const State& s = state();
  const std::uint64_t n = s.header.num_tokens();
  if (first > n || count > n - first)
    throw Error(fmt::format("{}: tokens [{}, {}) are out of range (the file holds {} tokens)", s.name, first,
                            first + count, n));
  const std::byte* src = s.data() + first * s.header.token_size;
  switch (s.header.token_size) {
    case 1: widen<std::uint8_t>(src, count, out); break;
    case 2: widen<std::uint16_t>(src, count, out); break;
    default: widen<std::uint32_t>(src, count, out); break;
  }
}

std::vector<std::int64_t> PackedFile::tokens(std::uint64_t first, std::uint64_t count) const {
  std::vector<std::int64_t> out(count);
  copy_tokens(first, count, out.data());
  return out;
}

std::span<const std::byte> PackedFile::data() const {
  const State& s = state();
  return {s.data(), static_cast<std::size_t>(s.header.data_len)};
}

std::span<const std::byte> PackedFile::index_bytes() const {
  const State& s = state();
  const std::uint64_t start = kPackedHeaderSize + s.header.data_len;
  return {s.base + start, static_cast<std::size_t>(s.mapped - start)};
}

const std::vector<IndexEntry>& PackedFile::index() const {
  const State& cs = state();
  auto& s = const_cast<State&>(cs);  // the lazily filled members are guarded by index_once
  std::call_once(s.index_once, [&] {
    const auto bytes = index_bytes();
    if (bytes.empty())
      throw Error(fmt::format("{}: the file has no index segment after its {} data bytes (truncated?)", s.name,
                              s.header.data_len));
    const std::vector<SignedIndexEntry> raw = unpickle_signed_index(bytes, s.name + " (index segment)");
    const auto data_len = static_cast<std::int64_t>(s.header.data_len);
    const auto header = static_cast<std::int64_t>(kPackedHeaderSize);
    // Legacy writers stored absolute file positions: the first document at 12, the last ending at
    // 12 + data_len.
    const bool legacy =
        !raw.empty() && raw.front().first == header && raw.back().first + raw.back().second == header + data_len;
    // Every writer lays the documents out back to back, so the index must tile the data section
    // exactly: a lost, duplicated or shifted entry (a flipped byte) is an error, never a silently
    // missing document. One exception is accepted and corrected: Modalities' merge_packed_data
    // shifts the entries of its k-th input by the data lengths before it minus 12 per input (a
    // leftover of the legacy format), so in its files each input's run of entries starts 12 bytes
    // before the previous run ends; such offsets (negative ones included) are put right here.
    const std::int64_t ts = s.header.token_size;
    std::vector<IndexEntry> index;
    index.reserve(raw.size());
    std::int64_t end = 0, shift = legacy ? -header : 0;
    for (std::size_t k = 0; k < raw.size(); ++k) {
      const auto [stored, length] = raw[k];
      if (stored > data_len + header || stored < -header * static_cast<std::int64_t>(k + 1))
        throw Error(fmt::format("{}: document {}: stored offset {} lies outside the data section of {} bytes", s.name,
                                k, stored, data_len));
      if (k > 0 && stored + shift != end && stored + shift + header == end) shift += header;  // a merge boundary
      const std::int64_t offset = stored + shift;
      if (offset != end)
        throw Error(
            fmt::format("{}: document {}: stored offset {} does not continue the documents before it, "
                        "which end at byte {} of the data section (corrupt index?)",
                        s.name, k, stored, end));
      if (length > data_len - offset)
        throw Error(fmt::format("{}: document {}: bytes [{}, {}) lie outside the data section of {} bytes", s.name, k,
                                offset, offset + length, data_len));
      if (offset % ts != 0 || length % ts != 0)
        throw Error(fmt::format("{}: document {}: offset {} / length {} are not multiples of the token size {}", s.name,
                                k, offset, length, ts));
      index.emplace_back(static_cast<std::uint64_t>(offset), static_cast<std::uint64_t>(length));
      end = offset + length;
    }
    if (end != data_len)
      throw Error(
          fmt::format("{}: the index's {} documents cover {} of the {} data bytes (corrupt or truncated "
                      "index?)",
                      s.name, index.size(), end, data_len));
    s.index = std::move(index);
    s.legacy = legacy;
  });
  return s.index;
}

bool PackedFile::legacy() const {
  (void)index();
  return state().legacy;
}

std::vector<std::int64_t> PackedFile::document(std::uint64_t k) const {
  const auto& idx = index();
  if (k >= idx.size())
    throw Error(
        fmt::format("{}: document {} is out of range (the file holds {} documents)", state().name, k, idx.size()));
  const std::uint32_t ts = token_size();
  return tokens(idx[k].first / ts, idx[k].second / ts);
}

}  // namespace modalities::formats
