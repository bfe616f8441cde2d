// A temporary directory for tests, created empty and removed again (with what it holds) when the
// test ends: the one every test suite uses (core, CLI, loader, distributed and plugin tests). The
// loader tests fill theirs with broken files (written at test time) and symlinks to the fixture
// .so files built by CMake; the CLI tests write small TOML configs into theirs.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace modalities::testing {

class ScratchDir {
 public:
  ScratchDir() {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("modalities_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

  std::filesystem::path write(std::string_view name, std::string_view bytes) const {
    const std::filesystem::path p = path_ / name;
    std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }
  std::filesystem::path link(std::string_view name, const std::filesystem::path& target) const {
    const std::filesystem::path p = path_ / name;
    std::filesystem::create_symlink(target, p);
    return p;
  }
  std::filesystem::path mkdir(std::string_view name) const {
    const std::filesystem::path p = path_ / name;
    std::filesystem::create_directory(p);
    return p;
  }

 private:
  std::filesystem::path path_;
};

}  // namespace modalities::testing
