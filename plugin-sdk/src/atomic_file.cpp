#include <modalities/sdk/atomic_file.h>
#include <modalities/sdk/error.h>

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>

namespace modalities {

namespace {

// Unique within the process (counter) and across processes (pid + random).
std::filesystem::path temp_name_for(const std::filesystem::path& path) {
  static std::atomic<unsigned> counter{0};
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return path.parent_path() /
         fmt::format(".{}.tmp-{}-{}-{:x}", path.filename().string(), ::getpid(), counter++, rng() & 0xffffff);
}

// Writes all `n` bytes at the file position; 0 or the errno of the failed write.
int write_fully(int fd, const std::byte* p, std::size_t n) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t k = ::write(fd, p + done, n - done);
    if (k < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    done += static_cast<std::size_t>(k);
  }
  return 0;
}

// Note [Early write-back]: the bytes just written at `offset` are handed to the disk now, without
// waiting for them. Otherwise the kernel keeps them dirty until commit's fsync, which then waits
// for all of them at once (50 ms for a 180 MB .pbin on the development machine, more than all its
// write calls took together); started early, the disk writes while the caller computes the next
// bytes, and the fsync waits 2 ms. A hint only: an error here shows again at fsync.
void start_write_back([[maybe_unused]] int fd, [[maybe_unused]] std::uint64_t offset, [[maybe_unused]] std::size_t n) {
#ifdef __linux__
  ::sync_file_range(fd, static_cast<off_t>(offset), static_cast<off_t>(n), SYNC_FILE_RANGE_WRITE);
#endif
}

}  // namespace

AtomicFile::AtomicFile(std::filesystem::path path, std::size_t buffer_bytes) : path_(std::move(path)) {
  if (path_.filename().empty()) throw Error(fmt::format("cannot write '{}': not a file name", path_.string()));
  if (std::filesystem::is_directory(path_))
    throw Error(fmt::format("cannot write '{}': it is a directory", path_.string()));
  const std::filesystem::path parent = path_.parent_path().empty() ? "." : path_.parent_path();
  std::error_code ec;
  std::filesystem::create_directories(parent, ec);
  if (ec)
    throw Error(
        fmt::format("cannot create the directory '{}' for '{}': {}", parent.string(), path_.string(), ec.message()));
  temp_ = temp_name_for(path_.parent_path().empty() ? std::filesystem::path(".") / path_ : path_);
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd_ < 0) fail("cannot create a temporary file in its directory", errno);
  buffer_.resize(std::max<std::size_t>(buffer_bytes, 4096));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
}

void AtomicFile::fail(std::string_view what, int err) {
  throw Error(fmt::format("cannot write '{}': {}: {}", path_.string(), what, std::strerror(err)));
}

void AtomicFile::flush_buffer() {
  if (buffered_ == 0) return;
  if (const int err = write_fully(fd_, buffer_.data(), buffered_)) fail("write failed", err);
  start_write_back(fd_, size_ - buffered_, buffered_);
  buffered_ = 0;
}

void AtomicFile::write(std::span<const std::byte> bytes) {
  if (committed_) throw Error(fmt::format("cannot write '{}': already committed", path_.string()));
  if (bytes.size() >= buffer_.size()) {  // large blocks bypass the buffer
    flush_buffer();
    if (const int err = write_fully(fd_, bytes.data(), bytes.size())) fail("write failed", err);
    start_write_back(fd_, size_, bytes.size());
    size_ += bytes.size();
    return;
  }
  if (buffered_ + bytes.size() > buffer_.size()) flush_buffer();
  std::memcpy(buffer_.data() + buffered_, bytes.data(), bytes.size());
  buffered_ += bytes.size();
  size_ += bytes.size();
}

void AtomicFile::write_at(std::uint64_t offset, std::span<const std::byte> bytes) {
  if (offset + bytes.size() > size_)
    throw Error(fmt::format("cannot write '{}': patch at byte {} of {} bytes lies beyond the {} bytes written",
                            path_.string(), offset, bytes.size(), size_));
  flush_buffer();
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::pwrite(fd_, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("write failed", errno);
    }
    done += static_cast<std::size_t>(n);
  }
}

void AtomicFile::commit() {
  if (committed_) return;
  flush_buffer();
  if (::fsync(fd_) != 0) fail("fsync failed", errno);
  if (::close(fd_) != 0) {
    fd_ = -1;
    fail("close failed", errno);
  }
  fd_ = -1;
  if (::rename(temp_.c_str(), path_.c_str()) != 0) fail("cannot rename the temporary file over it", errno);
  committed_ = true;
  // Make the rename itself durable.
  const std::filesystem::path parent = path_.parent_path().empty() ? "." : path_.parent_path();
  const int dfd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void write_file_atomically(const std::filesystem::path& path, std::string_view bytes) {
  AtomicFile f(path);
  f.write(bytes);
  f.commit();
}

}  // namespace modalities
