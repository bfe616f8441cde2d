// Loader robustness through core::PluginHost and core::Registry. A bad file in
// a plugin directory (empty, random bytes, truncated, a crafted ELF header, a
// library that is not a plugin, a wrong ABI, a register function that throws
// or registers a variant another plugin owns, an unreadable path) comes back
// as a PluginProblem naming the file and the reason. The host does not crash,
// commits nothing from the bad plugin, and still loads every other plugin.
#include "scratch_dir.h"

#include <modalities/core/registry.h>
#include <modalities/core/session.h>
#include <modalities/sdk/build_info.h>
#include <modalities/sdk/plugin.h>

#include <dlfcn.h>
#include <elf.h>
#include <unistd.h>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <sstream>

namespace modalities::core {
namespace {

namespace fs = std::filesystem;
using modalities::testing::ScratchDir;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsSupersetOf;
using ::testing::Not;
using ::testing::UnorderedElementsAre;

const fs::path kGoodPlugin = MODALITIES_TEST_GOOD_PLUGIN;
const fs::path kOtherPlugin = MODALITIES_TEST_OTHER_PLUGIN;
const fs::path kThrowsPlugin = MODALITIES_TEST_THROWS_PLUGIN;
const fs::path kDupAPlugin = MODALITIES_TEST_DUP_A_PLUGIN;
const fs::path kDupBPlugin = MODALITIES_TEST_DUP_B_PLUGIN;
const fs::path kWrongAbiPlugin = MODALITIES_TEST_WRONG_ABI_PLUGIN;
const fs::path kNoRegisterPlugin = MODALITIES_TEST_NO_REGISTER_PLUGIN;
const fs::path kNotAPlugin = MODALITIES_TEST_NOT_A_PLUGIN;

std::string describe(const std::vector<PluginProblem>& problems) {
  std::string s = "problems:\n";
  for (const auto& p : problems) s += "  " + p.str() + "\n";
  return problems.empty() ? s + "  (none)\n" : s;
}

std::string read_bytes(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> plugin_names(const Registry& registry) {
  std::vector<std::string> names;
  for (const auto& p : registry.plugins()) names.push_back(p->name);
  return names;
}

// A descriptor the host accepts: every fingerprint field equals the host's.
modalities_plugin_descriptor host_descriptor(const char* name) {
  modalities_plugin_descriptor d{};
  std::strncpy(d.magic, MODALITIES_PLUGIN_MAGIC, sizeof d.magic);
  d.layout = MODALITIES_DESCRIPTOR_LAYOUT;
  d.abi_version = MODALITIES_PLUGIN_ABI_VERSION;
  std::strncpy(d.name, name, sizeof d.name - 1);
  std::strncpy(d.version, "0.0.1", sizeof d.version - 1);
  std::strncpy(d.sdk_version, MODALITIES_SDK_VERSION, sizeof d.sdk_version - 1);
  std::strncpy(d.torch_version, MODALITIES_SDK_TORCH_VERSION, sizeof d.torch_version - 1);
  std::strncpy(d.compiler, MODALITIES_COMPILER_ID, sizeof d.compiler - 1);
  d.cxx11_abi = MODALITIES_CXX11_ABI;
  d.with_cuda = MODALITIES_SDK_WITH_CUDA;
  return d;
}

std::string as_bytes(const modalities_plugin_descriptor& d) {
  return std::string(reinterpret_cast<const char*>(&d), sizeof d);
}

// Writes a minimal 64-bit little-endian ELF shared-object image: a header, a
// section-name table and one section `section_name` holding `contents`, with
// the section headers at the end (null, .shstrtab, payload). `patch` may then
// corrupt any header field, to probe the loader's bounds checks.
using ElfPatch = std::function<void(Elf64_Ehdr&, Elf64_Shdr& names, Elf64_Shdr& payload)>;
std::string minimal_elf(std::string_view section_name, std::string_view contents, const ElfPatch& patch = {}) {
  const std::string names = std::string("\0.shstrtab\0", 11) + std::string(section_name) + std::string(1, '\0');
  const std::size_t names_offset = sizeof(Elf64_Ehdr);
  const std::size_t payload_offset = names_offset + names.size();
  const std::size_t headers_offset = (payload_offset + contents.size() + 7) / 8 * 8;

  Elf64_Ehdr eh{};
  std::memcpy(eh.e_ident, ELFMAG, SELFMAG);
  eh.e_ident[EI_CLASS] = ELFCLASS64;
  eh.e_ident[EI_DATA] = ELFDATA2LSB;
  eh.e_ident[EI_VERSION] = EV_CURRENT;
  eh.e_type = ET_DYN;
  eh.e_machine = EM_X86_64;
  eh.e_version = EV_CURRENT;
  eh.e_ehsize = sizeof(Elf64_Ehdr);
  eh.e_shoff = headers_offset;
  eh.e_shentsize = sizeof(Elf64_Shdr);
  eh.e_shnum = 3;
  eh.e_shstrndx = 1;
  Elf64_Shdr null_section{}, names_section{}, payload_section{};
  names_section.sh_name = 1;
  names_section.sh_type = SHT_STRTAB;
  names_section.sh_offset = names_offset;
  names_section.sh_size = names.size();
  payload_section.sh_name = 11;
  payload_section.sh_type = SHT_PROGBITS;
  payload_section.sh_flags = SHF_ALLOC;
  payload_section.sh_offset = payload_offset;
  payload_section.sh_size = contents.size();
  if (patch) patch(eh, names_section, payload_section);

  std::string image(headers_offset, '\0');
  std::memcpy(image.data(), &eh, sizeof eh);
  image.replace(names_offset, names.size(), names);
  image.replace(payload_offset, contents.size(), contents);
  for (const Elf64_Shdr* sh : {&null_section, &names_section, &payload_section})
    image.append(reinterpret_cast<const char*>(sh), sizeof *sh);
  return image;
}

class EnvVarGuard {
 public:
  EnvVarGuard(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~EnvVarGuard() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Each test's plugin directory holds the two good fixtures, named to sort
// before and after any broken file, so loading must go on past a failure.
class PluginLoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir.link("aaa_test_good.so", kGoodPlugin);
    dir.link("zzz_test_other.so", kOtherPlugin);
  }

  // Loads the directory, expects exactly one problem, about `file_name`, and returns its message.
  std::string load_expecting_one_problem_about(const std::string& file_name) {
    const std::vector<PluginProblem> problems = host.load_path(dir.path());
    EXPECT_EQ(problems.size(), 1u) << describe(problems);
    if (problems.empty()) return {};
    EXPECT_EQ(problems[0].file.filename().string(), file_name) << describe(problems);
    EXPECT_THAT(problems[0].str(), HasSubstr(file_name));
    return problems[0].str();
  }

  void expect_neighbours_loaded() const {
    EXPECT_NE(registry.find("test_component", "good"), nullptr);
    EXPECT_NE(registry.find("test_component", "other"), nullptr);
    EXPECT_THAT(plugin_names(registry), IsSupersetOf({"test_good", "test_other"}));
  }

  ScratchDir dir;
  Registry registry;
  PluginHost host{registry};
};

TEST_F(PluginLoaderTest, EmptyFileIsReportedAndTheOthersLoad) {
  dir.write("libmodalities_empty.so", "");
  EXPECT_THAT(load_expecting_one_problem_about("libmodalities_empty.so"),
              HasSubstr("file is empty, not a shared library"));
  expect_neighbours_loaded();
}

TEST_F(PluginLoaderTest, RandomBytesAreReportedAsNotElf) {
  std::mt19937 rng(20240326);
  std::string bytes(4096, '\0');
  for (char& b : bytes) b = static_cast<char>(rng() & 0xff);
  ASSERT_NE(bytes.compare(0, SELFMAG, ELFMAG), 0);
  dir.write("random.so", bytes);
  EXPECT_THAT(load_expecting_one_problem_about("random.so"), HasSubstr("not an ELF file (bad magic number)"));
  expect_neighbours_loaded();
}

TEST_F(PluginLoaderTest, TruncatedPluginIsReportedAsTruncated) {
  const std::string whole = read_bytes(kGoodPlugin);
  ASSERT_GT(whole.size(), 4096u);
  dir.write("libmodalities_truncated.so", whole.substr(0, whole.size() / 2));
  EXPECT_THAT(load_expecting_one_problem_about("libmodalities_truncated.so"),
              HasSubstr("ELF section table is missing or truncated"));
  expect_neighbours_loaded();
}

TEST_F(PluginLoaderTest, SharedLibraryWithoutDescriptorIsNotAPlugin) {
  dir.link(kNotAPlugin.filename().string(), kNotAPlugin);
  EXPECT_THAT(load_expecting_one_problem_about(kNotAPlugin.filename().string()),
              AllOf(HasSubstr("not a Modalities plugin"), HasSubstr("no .modalities_plugin section"),
                    HasSubstr("MODALITIES_PLUGIN")));
  expect_neighbours_loaded();
}

TEST_F(PluginLoaderTest, WrongAbiShowsPluginAndHostValues) {
  dir.link("libmodalities_test_wrong_abi.so", kWrongAbiPlugin);
  const std::string message = load_expecting_one_problem_about("libmodalities_test_wrong_abi.so");
  EXPECT_THAT(message, HasSubstr("plugin was built for SDK ABI 999, torch 1.0.0,"));
  EXPECT_THAT(message, HasSubstr(fmt::format("host has SDK ABI {}, torch {},", MODALITIES_PLUGIN_ABI_VERSION,
                                             MODALITIES_SDK_TORCH_VERSION)));
  EXPECT_THAT(message, HasSubstr("host has " + host_fingerprint()));
  EXPECT_EQ(registry.find("test_component", "wrong_abi"), nullptr);
  EXPECT_THAT(plugin_names(registry), Not(Contains("test_wrong_abi")));
  expect_neighbours_loaded();
}

// See Note [ABI gate before dlopen] in core/src/plugin_host.cpp.
TEST_F(PluginLoaderTest, WrongAbiPluginIsRefusedBeforeAnyOfItsCodeRuns) {
  // The probe works: once the fixture is dlopen'ed, its constructor has set the
  // variable. Checked in a child process, so this process never loads it.
  EXPECT_EXIT(
      {
        ::unsetenv("MODALITIES_TEST_WRONG_ABI_CODE_RAN");
        void* handle = ::dlopen(kWrongAbiPlugin.c_str(), RTLD_NOW | RTLD_LOCAL);
        std::exit(handle != nullptr && std::getenv("MODALITIES_TEST_WRONG_ABI_CODE_RAN") != nullptr ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");

  ::unsetenv("MODALITIES_TEST_WRONG_ABI_CODE_RAN");
  dir.link("libmodalities_test_wrong_abi.so", kWrongAbiPlugin);
  load_expecting_one_problem_about("libmodalities_test_wrong_abi.so");
  EXPECT_EQ(std::getenv("MODALITIES_TEST_WRONG_ABI_CODE_RAN"), nullptr)
      << "the wrong-ABI plugin's constructor ran, so the host dlopen'ed it before checking its descriptor";
}

TEST_F(PluginLoaderTest, RegisterFunctionThatThrowsIsReportedWithItsMessageAndCommitsNothing) {
  dir.link("libmodalities_test_throws.so", kThrowsPlugin);
  EXPECT_THAT(load_expecting_one_problem_about("libmodalities_test_throws.so"), HasSubstr("registration failed: boom"));
  // It registered before_boom, then threw: all or nothing.
  EXPECT_EQ(registry.find("test_component", "before_boom"), nullptr);
  EXPECT_THAT(registry.variant_keys("test_component"), UnorderedElementsAre("good", "other"));
  EXPECT_THAT(plugin_names(registry), Not(Contains("test_throws")));
  expect_neighbours_loaded();
}

TEST_F(PluginLoaderTest, SecondPluginRegisteringTheSameVariantIsRefusedNamingBothFiles) {
  dir.link("libmodalities_test_dup_a.so", kDupAPlugin);
  dir.link("libmodalities_test_dup_b.so", kDupBPlugin);
  const std::string message = load_expecting_one_problem_about("libmodalities_test_dup_b.so");
  EXPECT_THAT(message,
              AllOf(HasSubstr("variant test_component/dup registered twice"),
                    HasSubstr("libmodalities_test_dup_a.so 1.0.0"), HasSubstr("libmodalities_test_dup_b.so 2.0.0")));
  const RegisteredVariant* dup = registry.find("test_component", "dup");
  ASSERT_NE(dup, nullptr);
  EXPECT_EQ(dup->plugin->name, "test_dup_a");
  // test_dup_b registered dup_b_extra before the conflicting variant; it must not be kept.
  EXPECT_EQ(registry.find("test_component", "dup_b_extra"), nullptr);
  EXPECT_THAT(plugin_names(registry), Not(Contains("test_dup_b")));
  expect_neighbours_loaded();
}

TEST_F(PluginLoaderTest, DanglingSymlinkIsReported) {
  dir.link("x.so", dir.path() / "nothing_here.so");
  EXPECT_THAT(load_expecting_one_problem_about("x.so"), HasSubstr("file does not exist (or is a dangling link)"));
  expect_neighbours_loaded();
}

TEST_F(PluginLoaderTest, DirectoryNamedLikeAPluginIsReported) {
  dir.mkdir("y.so");
  EXPECT_THAT(load_expecting_one_problem_about("y.so"), HasSubstr("is a directory, not a plugin file"));
  expect_neighbours_loaded();
}

TEST_F(PluginLoaderTest, FileWithoutReadPermissionIsReported) {
  const fs::path file = dir.write("libmodalities_unreadable.so", read_bytes(kOtherPlugin));
  fs::permissions(file, fs::perms::none);
  if (::geteuid() != 0) {
    EXPECT_THAT(load_expecting_one_problem_about("libmodalities_unreadable.so"),
                AllOf(HasSubstr("cannot open for reading"), HasSubstr("Permission denied")));
    expect_neighbours_loaded();
    return;
  }
  // Root reads a mode-000 file, so the check runs in a child that drops to the
  // unprivileged user `nobody` (the directory itself stays traversable for it).
  fs::permissions(dir.path(), fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                  fs::perms::others_read | fs::perms::others_exec);
  EXPECT_EXIT(
      {
        if (::setgid(65534) != 0 || ::setuid(65534) != 0) std::exit(2);
        Registry r;
        PluginHost h(r);
        const std::optional<PluginProblem> problem = h.load_file(file);
        const bool ok =
            problem && problem->reason.find("cannot open for reading: Permission denied") != std::string::npos;
        std::exit(ok ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "")
      << "expected 'cannot open for reading: Permission denied' for " << file << " as user nobody";
}

TEST_F(PluginLoaderTest, DescriptorWithoutRegisterSymbolIsReported) {
  dir.link("libmodalities_test_no_register.so", kNoRegisterPlugin);
  EXPECT_THAT(load_expecting_one_problem_about("libmodalities_test_no_register.so"),
              HasSubstr("descriptor names plugin 'test_no_register' but the library does not export "
                        "modalities_plugin_test_no_register_register"));
  expect_neighbours_loaded();
}

TEST_F(PluginLoaderTest, EveryKindOfBrokenFileInOneDirectoryIsReportedOnceEach) {
  std::mt19937 rng(7);
  std::string random(1000, '\0');
  for (char& b : random) b = static_cast<char>(rng() & 0xff);
  dir.write("libmodalities_empty.so", "");
  dir.write("random.so", random);
  dir.link("x.so", dir.path() / "nothing_here.so");
  dir.mkdir("y.so");
  for (const fs::path& f : {kNotAPlugin, kWrongAbiPlugin, kThrowsPlugin, kDupAPlugin, kDupBPlugin, kNoRegisterPlugin})
    dir.link(f.filename().string(), f);

  const std::vector<PluginProblem> problems = host.load_path(dir.path());
  std::vector<std::string> files;
  for (const auto& p : problems) files.push_back(p.file.filename().string());
  EXPECT_THAT(files, UnorderedElementsAre("libmodalities_empty.so", "random.so", "x.so", "y.so",
                                          kNotAPlugin.filename().string(), "libmodalities_test_wrong_abi.so",
                                          "libmodalities_test_throws.so", "libmodalities_test_dup_b.so",
                                          "libmodalities_test_no_register.so"))
      << describe(problems);
  EXPECT_THAT(plugin_names(registry), UnorderedElementsAre("test_good", "test_other", "test_dup_a"));
  EXPECT_THAT(registry.variant_keys("test_component"), UnorderedElementsAre("good", "other", "dup"));
}

// --- crafted ELF files: the descriptor parser's checks, one by one ----------------------

TEST_F(PluginLoaderTest, ElfObjectFileIsReportedAsNotASharedLibrary) {
  dir.write("libmodalities_object.so",
            minimal_elf(MODALITIES_PLUGIN_SECTION, as_bytes(host_descriptor("x")),
                        [](Elf64_Ehdr& eh, Elf64_Shdr&, Elf64_Shdr&) { eh.e_type = ET_REL; }));
  EXPECT_THAT(load_expecting_one_problem_about("libmodalities_object.so"),
              HasSubstr("ELF file is not a shared library"));
  expect_neighbours_loaded();
}

TEST_F(PluginLoaderTest, DescriptorWithBadMagicIsReported) {
  modalities_plugin_descriptor d = host_descriptor("test_bad_magic");
  std::strncpy(d.magic, "NOT_A_PLUGIN", sizeof d.magic);
  dir.write("libmodalities_bad_magic.so", minimal_elf(MODALITIES_PLUGIN_SECTION, as_bytes(d)));
  EXPECT_THAT(load_expecting_one_problem_about("libmodalities_bad_magic.so"),
              HasSubstr("plugin descriptor has a bad magic"));
  expect_neighbours_loaded();
}

TEST_F(PluginLoaderTest, DescriptorSectionShorterThanTheDescriptorIsReported) {
  dir.write("libmodalities_short.so",
            minimal_elf(MODALITIES_PLUGIN_SECTION, as_bytes(host_descriptor("test_short")).substr(0, 40)));
  EXPECT_THAT(load_expecting_one_problem_about("libmodalities_short.so"),
              HasSubstr("plugin descriptor section is truncated"));
  expect_neighbours_loaded();
}

TEST_F(PluginLoaderTest, DescriptorWithUnsupportedLayoutShowsBothLayouts) {
  modalities_plugin_descriptor d = host_descriptor("test_layout");
  d.layout = MODALITIES_DESCRIPTOR_LAYOUT + 1;
  dir.write("libmodalities_layout.so", minimal_elf(MODALITIES_PLUGIN_SECTION, as_bytes(d)));
  EXPECT_THAT(load_expecting_one_problem_about("libmodalities_layout.so"),
              HasSubstr(fmt::format("plugin descriptor layout {} is not supported (host reads layout {})",
                                    MODALITIES_DESCRIPTOR_LAYOUT + 1, MODALITIES_DESCRIPTOR_LAYOUT)));
  expect_neighbours_loaded();
}

TEST_F(PluginLoaderTest, MatchingDescriptorInAFileThatCannotBeLoadedIsReported) {
  // Passes the descriptor gate (so the crafted image is well-formed enough), then dlopen refuses it.
  dir.write("libmodalities_unloadable.so",
            minimal_elf(MODALITIES_PLUGIN_SECTION, as_bytes(host_descriptor("test_unloadable"))));
  EXPECT_THAT(load_expecting_one_problem_about("libmodalities_unloadable.so"), HasSubstr("cannot load shared library"));
  expect_neighbours_loaded();
}

// Regression: the bounds checks in read_descriptor() (core/src/plugin_host.cpp) used to add two
// untrusted 64-bit values from the file, `offset + size > bytes.size()`, and
// the sum can wrap around to a small number. These files make it wrap: the host
// then reads outside the file's bytes, before the buffer (section table) or far
// past it (section names, descriptor: SIGSEGV). Fixed: the checks now read
// `offset <= size && length <= size - offset`. These tests keep it fixed; the
// load runs in a child process, so a crash fails the test instead of ending the
// test binary.
void expect_reported_without_crash(const fs::path& file, const std::string& reason) {
  EXPECT_EXIT(
      {
        Registry r;
        PluginHost h(r);
        const std::optional<PluginProblem> problem = h.load_file(file);
        std::exit(problem && problem->reason.find(reason) != std::string::npos ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "")
      << "expected the problem '" << reason << "' for " << file;
}

constexpr std::uint64_t kHalfOfTwoTo64 = std::uint64_t{1} << 63;  // twice this is 0 (mod 2^64)

TEST_F(PluginLoaderTest, SectionTableAtAWrappingOffsetIsReportedAsTruncated) {
  const fs::path file = dir.write("libmodalities_wrap_section_table.so",
                                  minimal_elf(MODALITIES_PLUGIN_SECTION, as_bytes(host_descriptor("test_wrap")),
                                              [](Elf64_Ehdr& eh, Elf64_Shdr&, Elf64_Shdr&) {
                                                eh.e_shoff = std::uint64_t{0} - eh.e_shnum * sizeof(Elf64_Shdr);
                                              }));
  expect_reported_without_crash(file, "ELF section table is missing or truncated");
}

TEST_F(PluginLoaderTest, SectionNameTableAtAWrappingOffsetIsReportedAsTruncated) {
  const fs::path file = dir.write("libmodalities_wrap_names.so",
                                  minimal_elf(MODALITIES_PLUGIN_SECTION, as_bytes(host_descriptor("test_wrap")),
                                              [](Elf64_Ehdr&, Elf64_Shdr& names, Elf64_Shdr&) {
                                                names.sh_offset = kHalfOfTwoTo64;
                                                names.sh_size = kHalfOfTwoTo64;
                                              }));
  expect_reported_without_crash(file, "ELF section names are truncated");
}

TEST_F(PluginLoaderTest, DescriptorSectionAtAWrappingOffsetIsReportedAsTruncated) {
  const fs::path file = dir.write("libmodalities_wrap_descriptor.so",
                                  minimal_elf(MODALITIES_PLUGIN_SECTION, as_bytes(host_descriptor("test_wrap")),
                                              [](Elf64_Ehdr&, Elf64_Shdr&, Elf64_Shdr& payload) {
                                                payload.sh_offset = kHalfOfTwoTo64;
                                                payload.sh_size = kHalfOfTwoTo64;
                                              }));
  expect_reported_without_crash(file, "plugin descriptor section is truncated");
}

// --- a good plugin: what the registry records --------------------------------------------

class NullBuildContext final : public BuildContext {
 public:
  std::string_view path() const override { return "answer"; }
  void warn(std::string) override {}
};

TEST(PluginLoaderGoodPluginTest, RegistersItsVariantSchemaResolverAndExample) {
  Registry registry;
  PluginHost host(registry);
  ASSERT_EQ(registry.find("test_component", "good"), nullptr);
  ASSERT_FALSE(registry.has_component("test_component"));

  const std::optional<PluginProblem> problem = host.load_file(kGoodPlugin);
  ASSERT_FALSE(problem.has_value()) << problem->str();

  const RegisteredVariant* v = registry.find("test_component", "good");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->spec.id(), "test_component/good");
  EXPECT_EQ(v->spec.produces, "int");
  EXPECT_EQ(v->spec.summary, "count * factor.");
  ASSERT_EQ(v->spec.fields.size(), 2u);
  EXPECT_EQ(v->spec.fields[0].name, "count");
  EXPECT_TRUE(v->spec.fields[0].required);
  EXPECT_THAT(v->spec.fields[0].constraints, ElementsAre(">= 1"));
  EXPECT_EQ(v->spec.fields[1].name, "factor");
  EXPECT_FALSE(v->spec.fields[1].required);
  EXPECT_EQ(v->spec.fields[1].default_repr, "2");
  EXPECT_EQ(v->provenance(), "(test_component/good from libmodalities_test_good.so 1.2.3)");

  ASSERT_EQ(registry.plugins().size(), 1u);
  const PluginInfo& info = *registry.plugins()[0];
  EXPECT_EQ(v->plugin.get(), &info);
  EXPECT_EQ(info.name, "test_good");
  EXPECT_EQ(info.version, "1.2.3");
  EXPECT_EQ(info.file, kGoodPlugin);
  EXPECT_THAT(info.variants, ElementsAre("test_component/good"));
  EXPECT_THAT(info.example_config, HasSubstr("variant_key = \"good\""));

  ASSERT_EQ(registry.plugin_resolvers().size(), 1u);
  EXPECT_EQ(registry.plugin_resolvers()[0].name, "test_echo");
  EXPECT_EQ(registry.plugin_resolvers()[0].resolve("hello").as_string(), "hello");

  // The factory behind the id builds from a config table, and its schema rejects a bad one.
  NullBuildContext ctx;
  EXPECT_EQ(v->spec.build(Value(Value::Table{{"count", Value(21)}}), ctx).as_int(), 42);
  try {
    v->spec.build(Value(Value::Table{{"count", Value(0)}}), ctx);
    ADD_FAILURE() << "count = 0 was accepted";
  } catch (const ConfigError& e) {
    ASSERT_EQ(e.errors().size(), 1u);
    EXPECT_EQ(e.errors()[0].path, "count");
  }
}

TEST(PluginLoaderGoodPluginTest, LoadingTheSameFileTwiceOrThroughASymlinkIsANoOp) {
  Registry registry;
  PluginHost host(registry);
  ScratchDir dir;
  const fs::path alias = dir.link("libmodalities_alias.so", kGoodPlugin);
  EXPECT_FALSE(host.load_file(kGoodPlugin).has_value());
  const std::optional<PluginProblem> again = host.load_file(kGoodPlugin);
  EXPECT_FALSE(again.has_value()) << again->str();
  const std::optional<PluginProblem> via_link = host.load_file(alias);
  EXPECT_FALSE(via_link.has_value()) << via_link->str();
  EXPECT_EQ(registry.plugins().size(), 1u);
}

TEST(PluginLoaderGoodPluginTest, FixturesAreNotInTheBundledPluginDirectory) {
  EXPECT_EQ(kGoodPlugin.parent_path(), fs::path(MODALITIES_TEST_FIXTURE_DIR));
  for (const auto& entry : fs::directory_iterator(MODALITIES_TEST_BUNDLED_PLUGIN_DIR))
    EXPECT_FALSE(entry.path().filename().string().starts_with("libmodalities_test_")) << entry.path();
}

// --- search path: MODALITIES_PLUGIN_PATH ---------------------------------------------------

TEST(PluginSearchPathTest, BundledDirectoryThenEnvironmentColonListThenExtraPaths) {
  EnvVarGuard env("MODALITIES_PLUGIN_PATH", "/a/one::/b/two:");
  const std::vector<fs::path> paths = PluginHost::search_path({"/c/extra"});
  ASSERT_EQ(paths.size(), 4u);
  EXPECT_TRUE(fs::equivalent(paths[0], MODALITIES_TEST_BUNDLED_PLUGIN_DIR)) << paths[0];
  EXPECT_EQ(paths[1], "/a/one");
  EXPECT_EQ(paths[2], "/b/two");
  EXPECT_EQ(paths[3], "/c/extra");
}

TEST(PluginSearchPathTest, MissingEntryInPluginPathIsReportedAndTheOtherEntriesLoad) {
  ScratchDir first, second;
  first.link("libmodalities_test_good.so", kGoodPlugin);
  second.link("libmodalities_test_other.so", kOtherPlugin);
  const fs::path missing = first.path() / "no_such_dir";
  EnvVarGuard env("MODALITIES_PLUGIN_PATH",
                  first.path().string() + ":" + missing.string() + ":" + second.path().string());

  Registry registry;
  PluginHost host(registry);
  const std::vector<PluginProblem> problems =
      load_plugins(host, PluginOptions{.extra_paths = {}, .strict = false, .bundled = false});
  ASSERT_EQ(problems.size(), 1u) << describe(problems);
  EXPECT_EQ(problems[0].file, missing);
  EXPECT_THAT(problems[0].str(), AllOf(HasSubstr("no_such_dir"), HasSubstr("plugin path does not exist")));
  EXPECT_NE(registry.find("test_component", "good"), nullptr);
  EXPECT_NE(registry.find("test_component", "other"), nullptr);
  EXPECT_FALSE(registry.has_component("layer_norm")) << "bundled = false, yet a bundled plugin was loaded";
}

TEST(PluginSearchPathTest, BundledPluginsLoadBeforePluginPathEntries) {
  ScratchDir dir;
  dir.link("libmodalities_test_good.so", kGoodPlugin);
  EnvVarGuard env("MODALITIES_PLUGIN_PATH", dir.path().string());
  Registry registry;
  PluginHost host(registry);
  const std::vector<PluginProblem> problems = load_plugins(host, PluginOptions{});
  EXPECT_TRUE(problems.empty()) << describe(problems);
  EXPECT_NE(registry.find("layer_norm", "rms_norm"), nullptr);
  EXPECT_NE(registry.find("number_conversion", "num_samples_from_num_tokens"), nullptr);
  EXPECT_NE(registry.find("test_component", "good"), nullptr);
  EXPECT_EQ(plugin_names(registry).back(), "test_good");
}

}  // namespace
}  // namespace modalities::core
