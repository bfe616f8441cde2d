// Read-only, memory-mapped access to a Modalities `.pbin` file (docs/data.md,
// "Packed file (.pbin)"): the checked header, O(1) token access into the data section and,
// on first use, the document index (with detection of the legacy format whose
// offsets are absolute file positions). Shared by the dataset plugins and the
// data tools, so it deliberately depends on nothing but the standard library.
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/formats/packed_data.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

namespace modalities::formats {

/// A `.pbin` file mapped into memory (PROT_READ, MAP_PRIVATE).
///
/// `open()` checks the header (token size 1, 2 or 4; data section inside the
/// file; data_len a multiple of the token size) and throws modalities::Error
/// naming the file and the problem otherwise, including for empty or
/// truncated files. The index segment is only parsed when `index()`,
/// `legacy()`, `num_documents()` or `document()` is first called, so
/// continuous (index-free) readers also accept files whose index is legacy or
/// even damaged.
///
/// \code
///   PackedFile f("data/sample/train.pbin");
///   std::vector<std::int64_t> sample(257);
///   f.copy_tokens(642 * 256, sample.size(), sample.data());
///   const auto [offset, length] = f.index()[3];  // bytes, data-section relative
/// \endcode
///
/// Thread safety: after `open()`, every const member may be called from any
/// number of threads (the lazy index load is synchronised).
/// Ownership: the mapping lives as long as the object; spans and pointers
/// returned by `data()` / `index_bytes()` must not outlive it. Movable, not
/// copyable. Since: SDK 0.1.
class MODALITIES_SDK_API PackedFile {
 public:
  PackedFile();
  explicit PackedFile(const std::filesystem::path& path);
  ~PackedFile();
  PackedFile(PackedFile&&) noexcept;
  PackedFile& operator=(PackedFile&&) noexcept;
  PackedFile(const PackedFile&) = delete;
  PackedFile& operator=(const PackedFile&) = delete;

  /// Maps `path` and validates its header; replaces any file opened before.
  void open(const std::filesystem::path& path);
  void close() noexcept;
  bool is_open() const noexcept { return state_ != nullptr; }

  const std::filesystem::path& path() const;
  const PackedHeader& header() const;
  std::uint32_t token_size() const { return header().token_size; }
  std::uint64_t num_tokens() const { return header().num_tokens(); }

  /// Token i (0-based within the data section). Throws when i >= num_tokens().
  std::uint64_t token(std::uint64_t i) const;

  /// Copies tokens [first, first + count) widened to int64 into `out`
  /// (which must hold `count` values). Throws when the range leaves the data.
  void copy_tokens(std::uint64_t first, std::uint64_t count, std::int64_t* out) const;
  std::vector<std::int64_t> tokens(std::uint64_t first, std::uint64_t count) const;

  /// The raw data section (data_len bytes, little-endian tokens).
  std::span<const std::byte> data() const;
  /// The raw index segment: bytes [12 + data_len, EOF).
  std::span<const std::byte> index_bytes() const;

  /// Document index as (offset, length) in bytes relative to the data section.
  /// Legacy files (offset[0] == 12 and last end == 12 + data_len) are converted.
  /// Each entry is checked to lie inside the data section and to be a multiple
  /// of the token size; an error names the document number.
  const std::vector<IndexEntry>& index() const;
  /// True when the index used absolute file offsets (pre-2024-06 writers).
  bool legacy() const;
  std::uint64_t num_documents() const { return index().size(); }
  /// Tokens of document k widened to int64.
  std::vector<std::int64_t> document(std::uint64_t k) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
  const State& state() const;
};

}  // namespace modalities::formats
