#include <modalities/core/data/mapped_file.h>
#include <modalities/sdk/error.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace modalities::core::data {

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) throw Error(fmt::format("'{}' does not exist", path.string()));
    throw Error(fmt::format("cannot open '{}': {}", path.string(), std::strerror(err)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(fmt::format("'{}' is not a regular file", path.string()));
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    data_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (data_ == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      data_ = nullptr;
      throw Error(fmt::format("cannot map '{}' into memory: {}", path.string(), std::strerror(err)));
    }
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

void MappedFile::advise_sequential() const {
  if (data_ != nullptr) ::madvise(data_, size_, MADV_SEQUENTIAL);
}

FileExistencePolicy parse_file_existence_policy(std::string_view text) {
  if (text == "skip") return FileExistencePolicy::kSkip;
  if (text == "error") return FileExistencePolicy::kError;
  if (text == "override") return FileExistencePolicy::kOverride;
  throw Error(fmt::format("--file_existence_policy must be one of skip, error, override (got '{}')", text));
}

bool check_output_path(const std::filesystem::path& target, FileExistencePolicy policy) {
  std::error_code ec;
  if (!std::filesystem::exists(target, ec)) return true;
  switch (policy) {
    case FileExistencePolicy::kSkip: return false;
    case FileExistencePolicy::kError:
      throw Error(fmt::format("'{}' already exists (use --file_existence_policy override to replace it, or skip)",
                              target.string()));
    case FileExistencePolicy::kOverride:
      if (std::filesystem::is_directory(target)) throw Error(fmt::format("'{}' is a directory", target.string()));
      return true;
  }
  return true;
}

}  // namespace modalities::core::data
