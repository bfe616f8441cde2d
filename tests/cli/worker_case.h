// Multi-rank test cases. A normal test starts this test binary again as N ranks under
// `modalities launch --exec` with MODALITIES_TEST_WORKER=<Suite.Name>; only in that process is the
// case Suite.Name registered (so it never shows up, or is skipped, in a normal run), and each rank
// runs it with the launcher's torchrun environment.
//
//   MODALITIES_WORKER_CASE(FsdpWorker, MatchesOneProcess) { ... gtest assertions ... }
//   TEST(FsdpTest, TwoRanksMatchOneProcess) {
//     expect_workers_pass(run_workers(MODALITIES_TEST_HOST_BINARY, 2, "FsdpWorker.MatchesOneProcess"), 2);
//   }
#pragma once

#include "run_command.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace modalities::testing {

/// Registers `body` as the gtest case suite.name when MODALITIES_TEST_WORKER names it.
inline bool register_worker_case(const char* suite, const char* name, void (*body)()) {
  const char* wanted = std::getenv("MODALITIES_TEST_WORKER");
  if (wanted == nullptr || std::string(wanted) != std::string(suite) + "." + name) return false;
  struct Case : ::testing::Test {
    explicit Case(void (*f)()) : f_(f) {}
    void TestBody() override { f_(); }
    void (*f_)();
  };
  ::testing::RegisterTest(suite, name, nullptr, nullptr, __FILE__, __LINE__,
                          [body]() -> ::testing::Test* { return new Case(body); });
  return true;
}

#define MODALITIES_WORKER_CASE(suite, name)                                                            \
  void modalities_worker_##suite##_##name();                                                           \
  [[maybe_unused]] static const bool modalities_worker_registered_##suite##_##name =                   \
      ::modalities::testing::register_worker_case(#suite, #name, &modalities_worker_##suite##_##name); \
  void modalities_worker_##suite##_##name()

/// This test binary's path.
inline std::string self_exe() {
  char buf[4096] = {};
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
}

/// Runs worker case `worker` ("Suite.Name") as `ranks` ranks through `host` launch --exec, under
/// coreutils timeout; `env` adds variables (OMP_NUM_THREADS=1 is always set).
inline CommandResult run_workers(const std::string& host, int ranks, const std::string& worker,
                                 std::vector<std::pair<std::string, std::string>> env = {}, int limit_s = 180) {
  env.emplace_back("MODALITIES_TEST_WORKER", worker);
  env.emplace_back("OMP_NUM_THREADS", "1");
  return run_command({"timeout", "-k", "5", std::to_string(limit_s), host, "launch", "--nproc-per-node",
                      std::to_string(ranks), "--grace-s", "2", "--exec", "--", self_exe(), "--gtest_filter=" + worker},
                     env);
}

/// Every rank ran its case and passed.
inline void expect_workers_pass(const CommandResult& r, int ranks) {
  ASSERT_EQ(r.exit_code, 0) << r;
  for (int k = 0; k < ranks; ++k)
    EXPECT_THAT(r.out, ::testing::HasSubstr("[rank " + std::to_string(k) + "] [  PASSED  ] 1 test")) << r;
}

}  // namespace modalities::testing
