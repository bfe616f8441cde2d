#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/packed_writer.h>

#include <bit>
#include <cstring>

namespace modalities::formats {

namespace {
static_assert(std::endian::native == std::endian::little, "the .pbin header is little-endian");
}  // namespace

PackedWriter::PackedWriter(const std::filesystem::path& path, std::uint32_t token_size)
    : out_(path), token_size_(token_size) {
  if (token_size != 1 && token_size != 2 && token_size != 4)
    throw Error(fmt::format("cannot write '{}': token size {} is not 1, 2 or 4", path.string(), token_size));
  std::byte header[kPackedHeaderSize] = {};
  std::memcpy(header + 8, &token_size, 4);  // data_len (bytes 0-7) is patched by commit()
  out_.write(header);
}

void PackedWriter::add_document(std::span<const std::byte> bytes) {
  const std::uint64_t len = bytes.size();
  append(bytes, std::span(&len, 1));
}

void PackedWriter::append(std::span<const std::byte> bytes, std::span<const std::uint64_t> doc_lengths) {
  std::uint64_t offset = data_len_;
  for (const std::uint64_t len : doc_lengths) {
    index_.emplace_back(offset, len);
    offset += len;
  }
  MODALITIES_CHECK(offset - data_len_ == bytes.size(),
                   "cannot write '{}': document lengths sum to {} but {} bytes given", out_.path().string(),
                   offset - data_len_, bytes.size());
  out_.write(bytes);
  data_len_ += bytes.size();
}

void PackedWriter::append_block(std::span<const std::byte> bytes, std::span<const IndexEntry> block_index) {
  for (const auto& [off, len] : block_index) index_.emplace_back(data_len_ + off, len);
  out_.write(bytes);
  data_len_ += bytes.size();
}

void PackedWriter::commit() {
  out_.write(pickle_index(index_));
  out_.write_at(0, std::as_bytes(std::span(&data_len_, 1)));
  out_.commit();
}

}  // namespace modalities::formats
