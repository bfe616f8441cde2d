// The tiny worked example of the data formats (see shared_fixtures.h), kept as bytes in the source
// so that tests needing a small valid .jsonl/.idx/.pbin do not depend on ../shared.
#include <modalities/testing/shared_fixtures.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>

#include <unistd.h>

namespace modalities::testing {
namespace {

std::string from_hex(std::string_view hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  return out;
}

// Header (data_len 10 as u64 LE, token_size 2 as u32 LE), the tokens 15496 50256 10603 0 50256 as
// u16 LE, then the index [(0, 4), (4, 6)] pickled with protocol 4 (spec data.md §2.1).
constexpr std::string_view kTinyPbinHex =
    "0a0000000000000002000000883c50c46b29000050c4"
    "80049511000000000000005d94284b004b0486944b044b068694652e";
// The raw index [(0, 17), (18, 18)] of tiny.jsonl, pickled the same way.
constexpr std::string_view kTinyIdxHex = "80049511000000000000005d94284b004b1186944b124b128694652e";
constexpr std::string_view kTinyJsonl = "{\"text\": \"Hello\"}\n{\"text\": \"World!\"}\n";

void write(const std::filesystem::path& file, const std::string& bytes) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

const std::filesystem::path& tiny_example_dir() {
  static const std::filesystem::path dir = [] {
    std::error_code ec;
    const auto d = std::filesystem::temp_directory_path(ec) / ("modalities_tiny_example_" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    write(d / "tiny.jsonl", std::string(kTinyJsonl));
    write(d / "tiny.idx", from_hex(kTinyIdxHex));
    write(d / "tiny.pbin", from_hex(kTinyPbinHex));
    static const pid_t creator = ::getpid();
    std::atexit([] {  // only the process that wrote it (forked ranks exit too)
      std::error_code e;
      if (::getpid() == creator) std::filesystem::remove_all(tiny_example_dir(), e);
    });
    return d;
  }();
  return dir;
}

}  // namespace modalities::testing
