// Writes a Modalities `.pbin` (docs/data.md, "Packed file") the way every Modalities
// writer lays it out: 12-byte header, token data, pickled (offset, length)
// index with data-relative offsets; data_len is patched in at the end. The
// file goes through AtomicFile, so it appears under its name only once
// commit() succeeds. Used by packing, merge, shuffle and chunking.
#pragma once

#include <modalities/sdk/atomic_file.h>
#include <modalities/sdk/export.h>
#include <modalities/sdk/formats/packed_data.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

namespace modalities::formats {

/// \code
///   PackedWriter out(dst, /*token_size=*/2);
///   out.add_document(doc_bytes);                  // one document
///   out.append(batch_bytes, batch_doc_lengths);   // several contiguous documents
///   out.commit();                                 // index, data_len, rename
/// \endcode
/// Errors throw modalities::Error naming the file. Not thread-safe. Since: SDK 0.1.
class MODALITIES_SDK_API PackedWriter {
 public:
  PackedWriter(const std::filesystem::path& path, std::uint32_t token_size);

  /// One document (its bytes: tokens x token_size).
  void add_document(std::span<const std::byte> bytes);
  /// Contiguous documents whose byte lengths sum to bytes.size().
  void append(std::span<const std::byte> bytes, std::span<const std::uint64_t> doc_lengths);
  /// A raw data block with its own index (offsets relative to the block),
  /// e.g. a whole input's data section when merging.
  void append_block(std::span<const std::byte> bytes, std::span<const IndexEntry> block_index);

  std::uint64_t data_len() const { return data_len_; }
  std::uint64_t num_documents() const { return index_.size(); }
  /// Bytes written so far (header included).
  std::uint64_t size() const { return out_.size(); }
  /// Writes the index, patches data_len and renames the file into place.
  void commit();

 private:
  AtomicFile out_;
  std::uint32_t token_size_;
  std::uint64_t data_len_ = 0;
  std::vector<IndexEntry> index_;
};

}  // namespace modalities::formats
