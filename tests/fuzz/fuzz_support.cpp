// Scratch files and failure reporting of the fuzz targets (see fuzz_support.h).
#include "fuzz_support.h"

#include "fuzz_targets.h"

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <system_error>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace modalities::fuzz {
namespace {

void abort_with(const std::string& message) {
  std::fprintf(stderr, "modalities fuzz: %s\n", message.c_str());
  std::fflush(stderr);
  std::abort();
}

std::atomic<FailureHandler> g_failure_handler{&abort_with};

// Never destroyed, so the atexit handler below can still use it.
const std::filesystem::path* g_scratch = nullptr;

void remove_scratch() {
  std::error_code ec;
  if (g_scratch != nullptr) std::filesystem::remove_all(*g_scratch, ec);
}

}  // namespace

void set_failure_handler(FailureHandler handler) {
  g_failure_handler.store(handler != nullptr ? handler : &abort_with);
}

void report_failure(const std::string& message) { g_failure_handler.load()(message); }

void expect_names_file(std::string_view target, std::string_view message, std::string_view file_name) {
  if (message.find(file_name) != std::string_view::npos) return;
  report_failure(std::string(target) + ": a rejection does not name the file '" + std::string(file_name) +
                 "': " + std::string(message));
}

const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path& dir = []() -> const std::filesystem::path& {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/modalities-fuzz-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr)
      abort_with("cannot create a scratch folder from '" + templ + "': " + std::strerror(errno));
    g_scratch = new std::filesystem::path(buf.data());
    std::atexit(&remove_scratch);
    return *g_scratch;
  }();
  return dir;
}

void write_file(const std::filesystem::path& file, const std::uint8_t* data, std::size_t size) {
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) abort_with("cannot open '" + file.string() + "' for writing: " + std::strerror(errno));
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) abort_with("cannot write '" + file.string() + "': " + std::strerror(errno));
    done += static_cast<std::size_t>(n);
  }
  if (::close(fd) != 0) abort_with("cannot close '" + file.string() + "': " + std::strerror(errno));
}

}  // namespace modalities::fuzz
