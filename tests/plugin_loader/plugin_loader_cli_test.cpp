// The broken plugin files of plugin_loader_test.cpp seen through the host
// binary: `modalities plugins list` prints one warning per bad file on stderr,
// naming the file and the reason, still lists every good plugin and exits 0;
// with --strict-plugins the same problems are fatal (exit 3).
#include "run_command.h"
#include "scratch_dir.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace modalities::core {
namespace {

namespace fs = std::filesystem;
using modalities::testing::CommandResult;
using modalities::testing::run_command;
using modalities::testing::ScratchDir;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

const std::string kHost = MODALITIES_TEST_HOST_BINARY;
const std::string kFixtureDir = MODALITIES_TEST_FIXTURE_DIR;

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The one line of `text` that mentions `needle`; empty (and a failure) when not exactly one does.
std::string the_line_naming(const std::string& text, const std::string& needle) {
  std::vector<std::string> found;
  for (const auto& line : lines_of(text))
    if (line.find(needle) != std::string::npos) found.push_back(line);
  EXPECT_EQ(found.size(), 1u) << "lines naming '" << needle << "' in:\n" << text;
  return found.size() == 1 ? found[0] : std::string();
}

// Bad files that CMake cannot build: written into a scratch directory that is
// passed as a second --plugin-path next to the built fixtures.
class PluginLoaderCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(99);
    std::string random(2048, '\0');
    for (char& b : random) b = static_cast<char>(rng() & 0xff);
    bad.write("libmodalities_empty.so", "");
    bad.write("random.so", random);
    bad.link("x.so", bad.path() / "nothing_here.so");
    bad.mkdir("y.so");
  }

  std::vector<std::string> list_args() const {
    return {kHost, "plugins", "list", "--plugin-path", kFixtureDir, "--plugin-path", bad.path().string()};
  }

  // (file name, part of the reason) for every bad file in the two directories.
  const std::vector<std::pair<std::string, std::string>> expected_warnings = {
      {"libmodalities_test_wrong_abi.so", "plugin was built for SDK ABI 999, torch 1.0.0"},
      {"libmodalities_test_throws.so", "registration failed: boom"},
      {"libmodalities_test_dup_b.so", "variant test_component/dup registered twice: libmodalities_test_dup_a.so"},
      {"libmodalities_test_no_register.so", "does not export modalities_plugin_test_no_register_register"},
      {"libmodalities_test_not_a_plugin.so", "not a Modalities plugin"},
      {"libmodalities_empty.so", "file is empty"},
      {"random.so", "not an ELF file"},
      {"x.so", "dangling link"},
      {"y.so", "is a directory"},
  };

  ScratchDir bad;
};

TEST_F(PluginLoaderCliTest, ListWarnsOncePerBadFileNamingItAndStillListsTheGoodPlugins) {
  const CommandResult r = run_command(list_args());
  ASSERT_EQ(r.signal, 0) << r;
  EXPECT_EQ(r.exit_code, 0) << r;
  for (const auto& [file, reason] : expected_warnings) {
    const std::string line = the_line_naming(r.err, "/" + file + ":");
    EXPECT_THAT(line, AllOf(StartsWith("warning: plugin "), HasSubstr(reason))) << r;
  }
  std::size_t warnings = 0;
  for (const auto& line : lines_of(r.err)) warnings += line.starts_with("warning: ") ? 1 : 0;
  EXPECT_EQ(warnings, expected_warnings.size()) << r;

  EXPECT_THAT(r.out, AllOf(HasSubstr("test_component/good"), HasSubstr("test_component/other"),
                           HasSubstr("test_component/dup "), HasSubstr("layer_norm/rms_norm"),
                           HasSubstr("number_conversion/num_samples_from_num_tokens")))
      << r;
  EXPECT_THAT(r.out, AllOf(Not(HasSubstr("before_boom")), Not(HasSubstr("dup_b_extra")), Not(HasSubstr("wrong_abi"))))
      << r;
  EXPECT_THAT(the_line_naming(r.out, "test_component/dup "), HasSubstr("libmodalities_test_dup_a.so 1.0.0")) << r;
  // Every bundled plugin plus the three good fixtures (good, other, dup_a); the broken ones count for nothing.
  std::size_t bundled = 0;
  for (const auto& e : std::filesystem::directory_iterator(MODALITIES_TEST_BUNDLED_PLUGIN_DIR))
    bundled += e.path().extension() == ".so" ? 1 : 0;
  EXPECT_THAT(r.out, HasSubstr(fmt::format("from {} plugins", bundled + 3))) << r;
}

TEST_F(PluginLoaderCliTest, StrictPluginsMakesAnyBadFileFatalWithExitCode3) {
  std::vector<std::string> args = list_args();
  args.push_back("--strict-plugins");
  const CommandResult r = run_command(args);
  ASSERT_EQ(r.signal, 0) << r;
  EXPECT_EQ(r.exit_code, 3) << r;
  EXPECT_THAT(r.err,
              HasSubstr(std::to_string(expected_warnings.size()) + " plugin problem(s) and --strict-plugins is set"))
      << r;
  for (const auto& [file, reason] : expected_warnings) EXPECT_THAT(r.err, HasSubstr("/" + file + ": ")) << r;
  EXPECT_EQ(r.out, "") << r;
}

TEST_F(PluginLoaderCliTest, StrictPluginsWithOnlyGoodPluginsExitsZero) {
  ScratchDir good;
  good.link("libmodalities_test_good.so", MODALITIES_TEST_GOOD_PLUGIN);
  const CommandResult r =
      run_command({kHost, "plugins", "list", "--strict-plugins", "--plugin-path", good.path().string()});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_EQ(r.err, "") << r;
  EXPECT_THAT(r.out, HasSubstr("test_component/good")) << r;
}

TEST_F(PluginLoaderCliTest, PluginPathEnvironmentEntryThatDoesNotExistIsReportedAndTheOthersLoad) {
  ScratchDir first, second;
  first.link("libmodalities_test_good.so", MODALITIES_TEST_GOOD_PLUGIN);
  second.link("libmodalities_test_other.so", MODALITIES_TEST_OTHER_PLUGIN);
  const std::string missing = (first.path() / "no_such_dir").string();
  const CommandResult r =
      run_command({kHost, "plugins", "list"},
                  {{"MODALITIES_PLUGIN_PATH", first.path().string() + ":" + missing + ":" + second.path().string()}});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_EQ(the_line_naming(r.err, "no_such_dir"), "warning: plugin " + missing + ": plugin path does not exist") << r;
  EXPECT_THAT(r.out, AllOf(HasSubstr("test_component/good"), HasSubstr("test_component/other"))) << r;
}

TEST_F(PluginLoaderCliTest, SmokeRefusesTheWrongAbiPluginNamingItsFile) {
  const CommandResult r = run_command({kHost, "plugins", "smoke", MODALITIES_TEST_WRONG_ABI_PLUGIN});
  ASSERT_EQ(r.signal, 0) << r;
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, AllOf(HasSubstr("libmodalities_test_wrong_abi.so"), HasSubstr("SDK ABI 999"))) << r;
}

TEST_F(PluginLoaderCliTest, SmokeBuildsTheGoodFixtureFromItsEmbeddedExample) {
  const CommandResult r = run_command({kHost, "plugins", "smoke", MODALITIES_TEST_GOOD_PLUGIN});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, AllOf(HasSubstr("plugin test_good 1.2.3"), HasSubstr("smoke test passed: 1 variant(s)"))) << r;
}

}  // namespace
}  // namespace modalities::core
