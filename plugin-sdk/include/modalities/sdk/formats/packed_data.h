// Modalities' on-disk data formats (docs/data.md), shared by the data
// tools and every plugin that reads them:
//   * the pickled (offset, length) index used by `.idx` files and by the
//     index segment of `.pbin` files (exact CPython protocol-4 bytes), and
//   * the `.pbin` header: u64 data_len, u32 token_size, data, pickled index.
// Hand-written because the bytes must match CPython's pickler exactly and
// must never execute pickle content (only the opcodes of docs/data.md are read).
#pragma once

#include <modalities/sdk/export.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace modalities::formats {

using IndexEntry = std::pair<std::uint64_t, std::uint64_t>;  // (offset, length) in bytes

/// pickle.dumps(list_of_2_tuples) byte-for-byte as CPython 3.10-3.13 writes it (protocol 4).
MODALITIES_SDK_API std::string pickle_index(std::span<const IndexEntry> entries);

/// Reads a pickled list of (int, int) tuples. Accepts the data opcodes of pickle protocols 0-5
/// that can build such a list (never GLOBAL, REDUCE or anything else that runs code), FRAME only
/// at a frame boundary with its length checked, and nothing after STOP. Throws modalities::Error
/// naming `what` (a file name) and the byte offset on anything unsupported or malformed, and on
/// negative offsets or lengths.
MODALITIES_SDK_API std::vector<IndexEntry> unpickle_index(std::span<const std::byte> bytes, const std::string& what);

/// (offset, length) with a signed offset: the index of a `.pbin` merged by Modalities holds
/// negative offsets (see PackedFile::index()).
using SignedIndexEntry = std::pair<std::int64_t, std::int64_t>;
/// unpickle_index, keeping negative offsets (lengths are still checked to be non-negative).
MODALITIES_SDK_API std::vector<SignedIndexEntry> unpickle_signed_index(std::span<const std::byte> bytes,
                                                                       const std::string& what);

/// Reads a raw JSONL index file (`.idx`) and checks that its entries are in order, each starting
/// after the newline that ends the previous one (gaps are lines dropped as faulty).
MODALITIES_SDK_API std::vector<IndexEntry> read_raw_index(const std::filesystem::path& idx_file);

/// Checks that every entry of a raw index lies inside its JSONL file of `jsonl_size` bytes.
MODALITIES_SDK_API void check_raw_index_fits(std::span<const IndexEntry> entries, std::uint64_t jsonl_size,
                                             const std::filesystem::path& idx_file,
                                             const std::filesystem::path& jsonl_file);

/// Why `entry` is not a whole line of `jsonl` (it must start at the file start or after a '\n'
/// and end at a '\n' or the end of the file), or nullopt when it is one.
MODALITIES_SDK_API std::optional<std::string> raw_index_entry_mismatch(std::string_view jsonl, const IndexEntry& entry);

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
