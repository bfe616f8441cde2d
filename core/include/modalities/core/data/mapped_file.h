// A whole file mapped read-only into memory (the JSONL inputs of the data
// tools). Zero-length files map to an empty span.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string_view>

namespace modalities::core::data {

class MappedFile {
 public:
  /// Maps `path`; throws modalities::Error naming the file when it is missing,
  /// not a regular file or unreadable.
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::string_view text() const { return {static_cast<const char*>(data_), size_}; }
  std::size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }
  /// Hints the kernel that the file is read front to back.
  void advise_sequential() const;

 private:
  std::filesystem::path path_;
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

/// What to do when an output file already exists (Modalities' --file_existence_policy).
enum class FileExistencePolicy { kSkip, kError, kOverride };

/// Parses "skip" | "error" | "override"; throws modalities::Error otherwise.
FileExistencePolicy parse_file_existence_policy(std::string_view text);

/// Applies `policy` to `target`. Returns false when the command should do
/// nothing (kSkip and the file exists; a warning is the caller's job). Throws
/// modalities::Error for kError when the file exists. kOverride leaves the
/// existing file in place: outputs are written atomically and replace it only
/// once complete.
bool check_output_path(const std::filesystem::path& target, FileExistencePolicy policy);

}  // namespace modalities::core::data
