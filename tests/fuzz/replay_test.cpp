// Replays the saved fuzz corpora (tests/fuzz/corpus/<target>/*: seeds from the repository's own
// files, hand-made adversarial inputs, and inputs scripts/fuzz.sh found) through the same
// entry points the libFuzzer executables use, built with the project's compiler. Every input must
// come back normally: no crash, no exception other than the documented ones (which the targets
// catch), and every rejection naming its file.
#include "fuzz_targets.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace modalities::fuzz {
namespace {

namespace fs = std::filesystem;

const fs::path kCorpus = MODALITIES_FUZZ_CORPUS_DIR;

void fail_test(const std::string& message) { ADD_FAILURE() << message; }

std::vector<std::string> target_names() {
  std::size_t n = 0;
  const NamedTarget* t = all_targets(&n);
  std::vector<std::string> names;
  for (std::size_t k = 0; k < n; ++k) names.emplace_back(t[k].name);
  return names;
}

FuzzTarget find_target(const std::string& name) {
  std::size_t n = 0;
  const NamedTarget* t = all_targets(&n);
  for (std::size_t k = 0; k < n; ++k)
    if (name == t[k].name) return t[k].run;
  return nullptr;
}

std::vector<std::uint8_t> read_bytes(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

class CorpusReplay : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { set_failure_handler(&fail_test); }
  void TearDown() override { set_failure_handler(nullptr); }
};

TEST_P(CorpusReplay, EveryInputReturnsNormally) {
  const FuzzTarget run = find_target(GetParam());
  ASSERT_NE(run, nullptr);
  const fs::path dir = kCorpus / GetParam();
  ASSERT_TRUE(fs::is_directory(dir)) << dir << " is missing: every target needs a seed corpus";
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  ASSERT_FALSE(files.empty()) << dir << " holds no inputs";
  for (const fs::path& file : files) {
    SCOPED_TRACE(file.string());
    const std::vector<std::uint8_t> bytes = read_bytes(file);
    EXPECT_EQ(run(bytes.data(), bytes.size()), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Fuzz, CorpusReplay, ::testing::ValuesIn(target_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// Fuzzing inputs that scripts/fuzz.sh saved as crash-*/leak-*/timeout-* files must be fixed and
// moved into the corpus, not kept beside it.
TEST(CorpusReplay, NoUnsortedFindingsInTheCorpus) {
  for (const auto& e : fs::recursive_directory_iterator(kCorpus)) {
    const std::string name = e.path().filename().string();
    EXPECT_FALSE(name.starts_with("crash-") || name.starts_with("leak-") || name.starts_with("timeout-") ||
                 name.starts_with("oom-"))
        << e.path() << ": rename a fixed finding descriptively (e.g. <what>_crash_<date>)";
  }
}

}  // namespace
}  // namespace modalities::fuzz
