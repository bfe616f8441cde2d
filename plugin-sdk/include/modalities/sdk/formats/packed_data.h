// Modalities' on-disk data formats (spec data.md §2-§4), shared by the data
// tools and every plugin that reads them:
//   * the pickled (offset, length) index used by `.idx` files and by the
//     index segment of `.pbin` files (exact CPython protocol-4 bytes), and
//   * the `.pbin` header: u64 data_len, u32 token_size, data, pickled index.
// Hand-written because the bytes must match CPython's pickler exactly and
// must never execute pickle content (only the opcodes of spec §2.2 are read).
#pragma once

#include <modalities/sdk/export.h>

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace modalities::formats {

using IndexEntry = std::pair<std::uint64_t, std::uint64_t>;  // (offset, length) in bytes

/// pickle.dumps(list_of_2_tuples) byte-for-byte as CPython 3.10-3.13 writes it (protocol 4).
MODALITIES_SDK_API std::string pickle_index(std::span<const IndexEntry> entries);

/// Reads a pickled list of (int, int) tuples. Throws modalities::Error naming
/// `what` (a file name) and the byte offset on anything unsupported or malformed.
MODALITIES_SDK_API std::vector<IndexEntry> unpickle_index(std::span<const std::byte> bytes, const std::string& what);

/// Reads a raw JSONL index file (`.idx`).
MODALITIES_SDK_API std::vector<IndexEntry> read_raw_index(const std::filesystem::path& idx_file);

struct PackedHeader {
  std::uint64_t data_len = 0;    // bytes of token data
  std::uint32_t token_size = 0;  // 1, 2 or 4
  std::uint64_t file_size = 0;
  std::uint64_t num_tokens() const { return data_len / token_size; }
};

inline constexpr std::uint64_t kPackedHeaderSize = 12;

/// Reads and checks the header of a `.pbin` file: token size in {1, 2, 4},
/// data section within the file, data_len a multiple of token_size.
MODALITIES_SDK_API PackedHeader read_packed_header(const std::filesystem::path& pbin_file);

}  // namespace modalities::formats
