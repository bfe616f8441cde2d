// Crash-safe file output: everything is written to a temporary file next to
// the destination and renamed over it only by commit(). A failed or abandoned
// write (exception, disk full, SIGKILL) never leaves a partial file under the
// final name, and an existing file there stays intact until the rename.
// Used by the data tools (.idx, .pbin) and checkpointing.
#pragma once

#include <modalities/sdk/export.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace modalities {

/// A buffered, write-only file that appears under `path` only on commit().
///
/// \code
///   AtomicFile out(dst);                 // creates parent directories
///   out.write(header);
///   out.write(data);
///   out.write_at(0, patched_header);     // random-access patch of written bytes
///   out.commit();                        // fsync, rename over dst, fsync directory
/// \endcode
///
/// Destroying an uncommitted AtomicFile removes the temporary file.
/// Errors (permissions, ENOSPC, ...) throw modalities::Error naming `path`.
/// Not thread-safe. Since: SDK 0.1.
class MODALITIES_SDK_API AtomicFile {
 public:
  explicit AtomicFile(std::filesystem::path path, std::size_t buffer_bytes = std::size_t{8} << 20);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  void write(std::span<const std::byte> bytes);
  void write(std::string_view bytes) { write(std::as_bytes(std::span(bytes.data(), bytes.size()))); }
  /// Overwrites already written bytes at `offset` (offset + size <= size()).
  void write_at(std::uint64_t offset, std::span<const std::byte> bytes);
  /// Bytes written so far.
  std::uint64_t size() const { return size_; }
  /// Flushes, syncs and renames the temporary file to the final path.
  void commit();

  const std::filesystem::path& path() const { return path_; }
  const std::filesystem::path& temp_path() const { return temp_; }

 private:
  void flush_buffer();
  [[noreturn]] void fail(std::string_view what, int err);

  std::filesystem::path path_;
  std::filesystem::path temp_;
  int fd_ = -1;
  std::vector<std::byte> buffer_;
  std::size_t buffered_ = 0;
  std::uint64_t size_ = 0;
  bool committed_ = false;
};

/// Writes `bytes` to `path` atomically (AtomicFile in one call).
MODALITIES_SDK_API void write_file_atomically(const std::filesystem::path& path, std::string_view bytes);

}  // namespace modalities
