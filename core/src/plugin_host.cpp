// Finding, gating and loading plugin .so files.
//
// Note [Plugin lifetime]
// A loaded plugin is never unloaded. Objects it built (and their vtables),
// std::function targets in the registry and exception types thrown from it
// may live until the end of the process; unloading would leave them dangling.
// The libraries are kept in a process-wide list that is intentionally leaked.
//
// Note [ABI gate before dlopen]
// dlopen runs a library's static initialisers, so by the time a symbol can
// be looked up, plugin code has already run. The descriptor therefore lives
// in its own ELF section and is read from the file with plain I/O: a plugin
// built for another SDK ABI, LibTorch, compiler or C++ ABI is refused without
// executing any of its code. Parsing is bounds-checked against the file size
// because the file may be anything (empty, random bytes, truncated).
#include <modalities/core/registry.h>
#include <modalities/sdk/plugin.h>

#include <fmt/format.h>
#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>

#include <elf.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

namespace modalities::core {

namespace fs = std::filesystem;

namespace {

std::vector<boost::dll::shared_library>& resident_libraries() {
  static auto* libs = new std::vector<boost::dll::shared_library>();  // leaked on purpose
  return *libs;
}

std::string field(const char* chars, std::size_t size) { return std::string(chars, strnlen(chars, size)); }

struct DescriptorRead {
  std::optional<modalities_plugin_descriptor> descriptor;
  std::string error;
};

// Bounded reads from a file whose content is untrusted: every (offset, length)
// pair is checked against the file size without overflow before it is read.
class UntrustedFile {
 public:
  explicit UntrustedFile(const fs::path& file) : in_(file, std::ios::binary) {
    if (in_) {
      in_.seekg(0, std::ios::end);
      size_ = static_cast<std::uint64_t>(in_.tellg());
    }
  }
  bool is_open() const { return static_cast<bool>(in_); }
  std::uint64_t size() const { return size_; }
  bool within(std::uint64_t offset, std::uint64_t length) const { return offset <= size_ && length <= size_ - offset; }
  // Reads [offset, offset + length); false when out of bounds or on I/O errors.
  bool read(std::uint64_t offset, std::uint64_t length, void* out) {
    if (!within(offset, length)) return false;
    in_.seekg(static_cast<std::streamoff>(offset));
    in_.read(static_cast<char*>(out), static_cast<std::streamsize>(length));
    return static_cast<bool>(in_);
  }

 private:
  std::ifstream in_;
  std::uint64_t size_ = 0;
};

DescriptorRead read_descriptor(const fs::path& file) {
  UntrustedFile f(file);
  if (!f.is_open()) return {std::nullopt, fmt::format("cannot open for reading: {}", std::strerror(errno))};
  if (f.size() == 0) return {std::nullopt, "file is empty, not a shared library"};
  Elf64_Ehdr eh;
  if (!f.read(0, sizeof eh, &eh) || std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0)
    return {std::nullopt, "not an ELF file (bad magic number)"};
  if (eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_ident[EI_DATA] != ELFDATA2LSB)
    return {std::nullopt, "not a 64-bit little-endian ELF file"};
  if (eh.e_type != ET_DYN) return {std::nullopt, "ELF file is not a shared library"};
  if (eh.e_machine != EM_X86_64 && eh.e_machine != EM_AARCH64)
    return {std::nullopt, fmt::format("ELF file is for another machine type ({})", eh.e_machine)};
  std::vector<Elf64_Shdr> sections(eh.e_shnum);
  if (eh.e_shnum == 0 || eh.e_shentsize != sizeof(Elf64_Shdr) || eh.e_shstrndx >= eh.e_shnum ||
      !f.read(eh.e_shoff, sections.size() * sizeof(Elf64_Shdr), sections.data()))
    return {std::nullopt, "ELF section table is missing or truncated"};
  const Elf64_Shdr& names_header = sections[eh.e_shstrndx];
  std::string names(f.within(names_header.sh_offset, names_header.sh_size) ? names_header.sh_size : 0, '\0');
  if (names.empty() || !f.read(names_header.sh_offset, names.size(), names.data()))
    return {std::nullopt, "ELF section names are truncated"};
  for (const Elf64_Shdr& sh : sections) {
    if (sh.sh_name >= names.size() ||
        field(names.data() + sh.sh_name, names.size() - sh.sh_name) != MODALITIES_PLUGIN_SECTION)
      continue;
    modalities_plugin_descriptor d;
    if (sh.sh_size < sizeof d || !f.within(sh.sh_offset, sh.sh_size) || !f.read(sh.sh_offset, sizeof d, &d))
      return {std::nullopt, "plugin descriptor section is truncated"};
    if (field(d.magic, sizeof d.magic) != MODALITIES_PLUGIN_MAGIC)
      return {std::nullopt, "plugin descriptor has a bad magic"};
    return {d, {}};
  }
  return {std::nullopt, "not a Modalities plugin (no " MODALITIES_PLUGIN_SECTION
                        " section; was it declared with MODALITIES_PLUGIN?)"};
}

struct Fingerprint {
  std::uint32_t abi;
  std::string torch, compiler;
  std::uint32_t cxx11_abi, cuda;
  std::string str() const {
    return fmt::format("SDK ABI {}, torch {}, {}, cxx11abi={}, cuda={}", abi, torch, compiler, cxx11_abi,
                       cuda ? "on" : "off");
  }
  bool operator==(const Fingerprint&) const = default;
};

Fingerprint host_print() {
  return {MODALITIES_PLUGIN_ABI_VERSION, MODALITIES_SDK_TORCH_VERSION, MODALITIES_COMPILER_ID, MODALITIES_CXX11_ABI,
          MODALITIES_SDK_WITH_CUDA};
}

bool looks_like_plugin_file(const fs::path& p) {
  const std::string name = p.filename().string();
  return name.size() > 3 && name.ends_with(".so");
}

}  // namespace

std::string host_fingerprint() { return host_print().str(); }

std::optional<PluginProblem> PluginHost::load_file(const fs::path& file) {
  std::error_code ec;
  const fs::path canonical = fs::weakly_canonical(file, ec);
  const fs::path key = ec ? file : canonical;
  if (std::find(loaded_.begin(), loaded_.end(), key) != loaded_.end()) return std::nullopt;
  if (!fs::exists(file, ec)) return PluginProblem{file, "file does not exist (or is a dangling link)"};
  if (fs::is_directory(file, ec)) return PluginProblem{file, "is a directory, not a plugin file"};

  DescriptorRead read = read_descriptor(file);
  if (!read.descriptor) return PluginProblem{file, read.error};
  const modalities_plugin_descriptor& d = *read.descriptor;
  if (d.layout != MODALITIES_DESCRIPTOR_LAYOUT)
    return PluginProblem{file, fmt::format("plugin descriptor layout {} is not supported (host reads layout {})",
                                           d.layout, MODALITIES_DESCRIPTOR_LAYOUT)};
  const Fingerprint plugin{d.abi_version, field(d.torch_version, sizeof d.torch_version),
                           field(d.compiler, sizeof d.compiler), d.cxx11_abi, d.with_cuda};
  if (!(plugin == host_print()))
    return PluginProblem{file, fmt::format("plugin was built for {}; host has {}. Rebuild the plugin against this SDK.",
                                           plugin.str(), host_print().str())};
  const std::string name = field(d.name, sizeof d.name);
  const std::string version = field(d.version, sizeof d.version);

  boost::dll::shared_library lib;
  try {
    lib.load(file, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
  } catch (const std::exception& e) {
    return PluginProblem{file, fmt::format("cannot load shared library: {}", e.what())};
  }
  const std::string symbol = fmt::format("modalities_plugin_{}_register", name);
  if (!lib.has(symbol))
    return PluginProblem{file,
                         fmt::format("descriptor names plugin '{}' but the library does not export {}", name, symbol)};
  auto* fn = lib.get<int(void*, char*, std::size_t)>(symbol);
  resident_libraries().push_back(std::move(lib));  // See Note [Plugin lifetime]

  PluginInfo info{name, version, file, {}, {}};
  std::optional<std::string> failure = registry_.register_plugin(std::move(info), [&](Registrar& r) {
    std::array<char, 4096> error{};
    if (fn(&r, error.data(), error.size()) != 0) throw Error(error.data());
  });
  if (failure) return PluginProblem{file, *failure};
  loaded_.push_back(key);
  return std::nullopt;
}

std::vector<PluginProblem> PluginHost::load_path(const fs::path& path) {
  std::vector<PluginProblem> problems;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    problems.push_back({path, "plugin path does not exist"});
    return problems;
  }
  if (!fs::is_directory(path, ec)) {
    if (auto p = load_file(path)) problems.push_back(*p);
    return problems;
  }
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(path, fs::directory_options::skip_permission_denied, ec))
    if (looks_like_plugin_file(entry.path())) files.push_back(entry.path());
  if (ec) problems.push_back({path, fmt::format("cannot list directory: {}", ec.message())});
  std::sort(files.begin(), files.end());
  for (const auto& f : files)
    if (auto p = load_file(f)) problems.push_back(*p);
  return problems;
}

fs::path PluginHost::bundled_plugin_dir() {
  std::error_code ec;
  const fs::path exe = boost::dll::program_location(ec);
  if (ec) return {};
  return exe.parent_path().parent_path() / "lib" / "modalities" / "plugins";
}

std::vector<fs::path> PluginHost::search_path(const std::vector<fs::path>& extra) {
  std::vector<fs::path> out;
  if (const fs::path bundled = bundled_plugin_dir(); !bundled.empty()) {
    std::error_code ec;
    if (fs::is_directory(bundled, ec)) out.push_back(bundled);
  }
  if (const char* env = std::getenv("MODALITIES_PLUGIN_PATH"); env != nullptr) {
    std::string_view rest(env);
    while (!rest.empty()) {
      const auto colon = rest.find(':');
      const std::string_view item = rest.substr(0, colon);
      if (!item.empty()) out.emplace_back(std::string(item));
      if (colon == std::string_view::npos) break;
      rest.remove_prefix(colon + 1);
    }
  }
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

}  // namespace modalities::core
