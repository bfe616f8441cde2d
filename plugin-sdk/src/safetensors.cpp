// The `.safetensors` reader and writer (see formats/safetensors.h). The header
// is parsed with simdjson; the data is read with pread straight into each
// tensor's own storage (one copy, no mapping to outlive). Writing goes through
// AtomicFile, so an interrupted write never replaces a good file.
#include <modalities/sdk/atomic_file.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/jsonl.h>
#include <modalities/sdk/formats/safetensors.h>

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <simdjson.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <optional>
#include <tuple>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts are not supported");

namespace modalities::formats {

namespace {

// Same limit as the reference (Rust) implementation: a larger header is a corrupt file.
constexpr std::uint64_t kMaxHeaderSize = 100'000'000;

struct DtypeName {
  std::string_view name;
  c10::ScalarType type;
};

constexpr std::array<DtypeName, 15> kDtypes{{
    {"F64", c10::ScalarType::Double},
    {"F32", c10::ScalarType::Float},
    {"F16", c10::ScalarType::Half},
    {"BF16", c10::ScalarType::BFloat16},
    {"I64", c10::ScalarType::Long},
    {"I32", c10::ScalarType::Int},
    {"I16", c10::ScalarType::Short},
    {"I8", c10::ScalarType::Char},
    {"U64", c10::ScalarType::UInt64},
    {"U32", c10::ScalarType::UInt32},
    {"U16", c10::ScalarType::UInt16},
    {"U8", c10::ScalarType::Byte},
    {"BOOL", c10::ScalarType::Bool},
    {"F8_E4M3", c10::ScalarType::Float8_e4m3fn},
    {"F8_E5M2", c10::ScalarType::Float8_e5m2},
}};

// An open file descriptor, closed on scope exit.
class Fd {
 public:
  explicit Fd(const std::filesystem::path& path) : fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (fd_ < 0)
      throw Error(fmt::format("cannot open the safetensors file '{}': {}", path.string(), std::strerror(errno)));
  }
  ~Fd() { ::close(fd_); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Reads exactly `size` bytes at `offset`; false on a short read (truncated file).
void read_exactly(int fd, const std::filesystem::path& path, std::uint64_t offset, void* out, std::uint64_t size) {
  auto* p = static_cast<char*>(out);
  std::uint64_t done = 0;
  while (done < size) {
    const std::uint64_t chunk = std::min<std::uint64_t>(size - done, std::uint64_t{1} << 30);
    const ssize_t n = ::pread(fd, p + done, chunk, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(fmt::format("cannot read the safetensors file '{}': {}", path.string(), std::strerror(errno)));
    }
    if (n == 0)
      throw Error(fmt::format("the safetensors file '{}' is truncated: expected {} bytes at offset {}, got {}",
                              path.string(), size, offset, done));
    done += static_cast<std::uint64_t>(n);
  }
}

std::optional<c10::ScalarType> dtype_from_name(std::string_view name) {
  for (const auto& d : kDtypes)
    if (d.name == name) return d.type;
  return std::nullopt;
}

SafetensorsHeader parse_header(int fd, const std::filesystem::path& path) {
  const std::string file = path.string();
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    throw Error(fmt::format("cannot stat the safetensors file '{}': {}", file, std::strerror(errno)));
  const auto file_size = static_cast<std::uint64_t>(st.st_size);
  if (file_size < 8)
    throw Error(fmt::format("the safetensors file '{}' is truncated: {} bytes, fewer than the 8-byte header length",
                            file, file_size));
  std::array<unsigned char, 8> len_bytes{};
  read_exactly(fd, path, 0, len_bytes.data(), 8);
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[static_cast<std::size_t>(i)];
  if (header_len > kMaxHeaderSize)
    throw Error(fmt::format("the safetensors file '{}' is corrupt: header length {} exceeds the {} byte limit", file,
                            header_len, kMaxHeaderSize));
  if (header_len > file_size - 8)
    throw Error(
        fmt::format("the safetensors file '{}' is truncated: the header claims {} bytes, the file has {} after "
                    "the length field",
                    file, header_len, file_size - 8));

  simdjson::padded_string json(static_cast<std::size_t>(header_len));
  read_exactly(fd, path, 8, json.data(), header_len);
  simdjson::dom::parser parser;
  simdjson::dom::element root;
  if (auto err = parser.parse(json).get(root))
    throw Error(
        fmt::format("the safetensors file '{}' has a corrupt JSON header: {}", file, simdjson::error_message(err)));
  simdjson::dom::object object;
  if (root.get_object().get(object))
    throw Error(fmt::format("the safetensors file '{}' has a corrupt header: expected a JSON object", file));

  SafetensorsHeader header;
  header.data_offset = 8 + header_len;
  header.data_size = file_size - header.data_offset;
  bool seen_metadata = false;
  for (auto field : object) {
    const std::string key(field.key);
    if (key == "__metadata__") {
      if (seen_metadata) throw Error(fmt::format("the safetensors file '{}' has two __metadata__ entries", file));
      seen_metadata = true;
      simdjson::dom::object meta;
      if (field.value.get_object().get(meta))
        throw Error(fmt::format("the safetensors file '{}': __metadata__ must be an object of strings", file));
      for (auto m : meta) {
        std::string_view value;
        if (m.value.get_string().get(value))
          throw Error(fmt::format("the safetensors file '{}': __metadata__ entry '{}' is not a string", file, m.key));
        header.metadata[std::string(m.key)] = std::string(value);
      }
      continue;
    }
    const auto bad = [&](std::string_view what) {
      return Error(fmt::format("the safetensors file '{}' has a corrupt entry for tensor '{}': {}", file, key, what));
    };
    if (header.tensors.count(key) != 0) throw bad("the name occurs twice");
    simdjson::dom::object info;
    if (field.value.get_object().get(info)) throw bad("expected an object with dtype, shape and data_offsets");
    SafetensorsEntry entry;
    std::string_view dtype;
    if (info["dtype"].get_string().get(dtype)) throw bad("missing or non-string 'dtype'");
    entry.dtype = std::string(dtype);
    const auto type = dtype_from_name(dtype);
    if (!type) {
      std::string known;
      for (const auto& d : kDtypes) known += fmt::format("{}{}", known.empty() ? "" : ", ", d.name);
      throw bad(fmt::format("unknown dtype '{}' (supported: {})", dtype, known));
    }
    entry.scalar_type = *type;
    simdjson::dom::array shape;
    if (info["shape"].get_array().get(shape)) throw bad("missing or non-array 'shape'");
    std::uint64_t numel = 1;
    for (auto d : shape) {
      std::int64_t v = 0;
      if (d.get_int64().get(v) || v < 0) throw bad("'shape' must hold non-negative integers");
      entry.shape.push_back(v);
      if (v != 0 && numel > (std::uint64_t{1} << 62) / static_cast<std::uint64_t>(v)) throw bad("'shape' is too large");
      numel *= static_cast<std::uint64_t>(v);
    }
    simdjson::dom::array offsets;
    if (info["data_offsets"].get_array().get(offsets) || offsets.size() != 2)
      throw bad("missing 'data_offsets' (expected [begin, end])");
    if (offsets.at(0).get_uint64().get(entry.begin) || offsets.at(1).get_uint64().get(entry.end))
      throw bad("'data_offsets' must be non-negative integers");
    if (entry.begin > entry.end)
      throw bad(fmt::format("data_offsets [{}, {}] end before they begin", entry.begin, entry.end));
    if (entry.end > header.data_size)
      throw bad(fmt::format("data_offsets [{}, {}] lie beyond the {} bytes of data (truncated file?)", entry.begin,
                            entry.end, header.data_size));
    const std::uint64_t expected = numel * c10::elementSize(entry.scalar_type);
    if (entry.end - entry.begin != expected)
      throw bad(fmt::format("data_offsets [{}, {}] span {} bytes, but {} of shape [{}] needs {}", entry.begin,
                            entry.end, entry.end - entry.begin, entry.dtype, fmt::join(entry.shape, ","), expected));
    header.tensors.emplace(key, std::move(entry));
  }

  // The format lays the tensors end to end from the first data byte to the last, as Python's
  // safetensors checks ("not fully covered"): no overlap, no gap, nothing left over. A header length
  // one too small (pointing into the header's padding) parses and would shift every tensor by a
  // byte; it leaves the data one byte longer than the tensors cover, and is refused here.
  std::vector<std::tuple<std::uint64_t, std::uint64_t, const std::string*>> by_begin;
  for (const auto& [name, e] : header.tensors) by_begin.emplace_back(e.begin, e.end, &name);
  std::sort(by_begin.begin(), by_begin.end());
  std::uint64_t covered = 0;
  const std::string* previous = nullptr;
  for (const auto& [begin, end, name] : by_begin) {
    if (begin < covered)
      throw Error(
          fmt::format("the safetensors file '{}' is corrupt: tensors '{}' and '{}' overlap", file, *previous, *name));
    if (begin > covered)
      throw Error(
          fmt::format("the safetensors file '{}' is corrupt: data bytes [{}, {}) before tensor '{}' belong to "
                      "no tensor (the format lays tensors end to end)",
                      file, covered, begin, *name));
    covered = end;
    previous = name;
  }
  if (covered != header.data_size)
    throw Error(
        fmt::format("the safetensors file '{}' is corrupt: the tensors cover {} of its {} data bytes (not "
                    "fully covered: a wrong header length or trailing bytes)",
                    file, covered, header.data_size));
  return header;
}

}  // namespace

std::string_view safetensors_dtype_name(c10::ScalarType type) {
  for (const auto& d : kDtypes)
    if (d.type == type) return d.name;
  throw Error(fmt::format("safetensors has no dtype for {}", c10::toString(type)));
}

SafetensorsHeader read_safetensors_header(const std::filesystem::path& path) {
  Fd fd(path);
  return parse_header(fd.get(), path);
}

std::map<std::string, std::string> read_safetensors_metadata(const std::filesystem::path& path) {
  return read_safetensors_header(path).metadata;
}

StateDict read_safetensors(const std::filesystem::path& path) {
  return read_safetensors(path, [](const std::string&) { return true; });
}

StateDict read_safetensors(const std::filesystem::path& path, const std::function<bool(const std::string&)>& select) {
  Fd fd(path);
  const SafetensorsHeader header = parse_header(fd.get(), path);
  StateDict out;
  for (const auto& [name, e] : header.tensors) {
    if (!select(name)) continue;
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.scalar_type).device(at::kCPU));
    if (e.end > e.begin) read_exactly(fd.get(), path, header.data_offset + e.begin, t.data_ptr(), e.end - e.begin);
    out.emplace(name, std::move(t));
  }
  return out;
}

void write_safetensors(const std::filesystem::path& path, const StateDict& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string file = path.string();
  struct Item {
    const std::string* name;
    const at::Tensor* tensor;
    std::string_view dtype;
    std::size_t element_size;
    std::uint64_t begin = 0, end = 0;
  };
  std::vector<Item> items;
  items.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    const auto bad = [&, &name = name](std::string_view what) {  // clang < 16 cannot capture a binding implicitly
      return Error(fmt::format("cannot write '{}': tensor '{}' {}", file, name, what));
    };
    if (name == "__metadata__") throw bad("uses the reserved name __metadata__");
    if (!t.defined()) throw bad("is undefined");
    if (t.layout() != at::kStrided) throw bad("is not a dense (strided) tensor");
    if (t.is_quantized()) throw bad("is quantized");
    std::string_view dtype;
    try {
      dtype = safetensors_dtype_name(t.scalar_type());
    } catch (const Error&) {
      throw bad(fmt::format("has dtype {}, which safetensors cannot store", c10::toString(t.scalar_type())));
    }
    items.push_back({&name, &t, dtype, c10::elementSize(t.scalar_type())});
  }
  // Data layout: largest element size first, then by name, so every tensor
  // starts at a multiple of its element size (the data section is 8-aligned).
  std::vector<Item*> layout;
  for (auto& it : items) layout.push_back(&it);
  std::stable_sort(layout.begin(), layout.end(),
                   [](const Item* a, const Item* b) { return a->element_size > b->element_size; });
  std::uint64_t offset = 0;
  for (Item* it : layout) {
    it->begin = offset;
    offset += static_cast<std::uint64_t>(it->tensor->numel()) * it->element_size;
    it->end = offset;
  }

  // Header: "__metadata__" first, then tensors sorted by name (StateDict order).
  std::string json = "{";
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      if (!first) json += ",";
      first = false;
      json += json_quote(k) + ":" + json_quote(v);
    }
    json += "}";
  }
  for (const Item& it : items) {
    if (json.size() > 1) json += ",";
    json += fmt::format("{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}", json_quote(*it.name),
                        it.dtype, fmt::join(it.tensor->sizes(), ","), it.begin, it.end);
  }
  json += "}";
  if (!simdjson::validate_utf8(json.data(), json.size()))
    throw Error(fmt::format("cannot write '{}': a tensor name or metadata entry is not valid UTF-8", file));
  json.append((8 - json.size() % 8) % 8, ' ');

  AtomicFile out(path);
  std::array<std::byte, 8> len{};
  for (int i = 0; i < 8; ++i)
    len[static_cast<std::size_t>(i)] = static_cast<std::byte>((json.size() >> (8 * i)) & 0xff);
  out.write(len);
  out.write(json);
  for (const Item* it : layout) {
    if (it->end == it->begin) continue;
    // One tensor at a time: device and non-contiguous tensors cost one CPU copy each, never the whole dict.
    const at::Tensor cpu = it->tensor->detach().to(at::kCPU).resolve_conj().resolve_neg().contiguous();
    out.write(std::span(static_cast<const std::byte*>(cpu.data_ptr()), it->end - it->begin));
  }
  out.commit();
}

}  // namespace modalities::formats
