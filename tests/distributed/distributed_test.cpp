// The multi-process runtime: launch environment parsing (unit), `modalities launch` (rank
// environment, prefixes, failure and signal propagation, with small shell programs), and the
// collectives of this build's c10d on 2 and 3 Gloo processes (`modalities dist check`, which
// compares every collective with an exactly known result). Multi-process cases run under
// coreutils `timeout` and the launcher's own grace period, so a broken case fails, never hangs.
#include "run_command.h"
#include "scratch_dir.h"
#include "worker_case.h"

#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/safetensors.h>
#include <modalities/sdk/log.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <openssl/evp.h>
#include <simdjson.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>  // world()'s result is destroyed here

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace modalities::dist {
namespace {

using modalities::testing::CommandResult;
using modalities::testing::run_command;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kHost = MODALITIES_TEST_HOST_BINARY;

EnvLookup lookup_in(const std::map<std::string, std::string>& vars) {
  return [vars](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    (void)launch_env(lookup_in(vars));
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(LaunchEnvTest, NoVariablesMeansOneProcess) {
  const LaunchEnv e = launch_env(lookup_in({}));
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_FALSE(e.distributed());
  EXPECT_EQ(e.source, "single process");
}

TEST(LaunchEnvTest, ReadsTorchrunsContract) {
  const LaunchEnv e = launch_env(lookup_in({{"RANK", "5"},
                                            {"WORLD_SIZE", "8"},
                                            {"LOCAL_RANK", "1"},
                                            {"LOCAL_WORLD_SIZE", "4"},
                                            {"MASTER_ADDR", "node7"},
                                            {"MASTER_PORT", "29500"},
                                            {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                            {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.master_addr, "node7");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_TRUE(e.agent_store);
  EXPECT_EQ(e.restart_count, 2);
  EXPECT_TRUE(e.distributed());
}

TEST(LaunchEnvTest, FallsBackToSlurmWhenRankIsUnset) {
  const LaunchEnv e = launch_env(lookup_in({{"SLURM_PROCID", "9"},
                                            {"SLURM_NTASKS", "16"},
                                            {"SLURM_LOCALID", "1"},
                                            {"SLURM_TASKS_PER_NODE", "8(x2)"},
                                            {"SLURM_JOB_ID", "123456"},
                                            {"SLURM_STEP_NODELIST", "gpu[017-018]"}}));
  EXPECT_EQ(e.source, "SLURM");
  EXPECT_EQ(e.rank, 9);
  EXPECT_EQ(e.world_size, 16);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 8);
  EXPECT_EQ(e.master_addr, "gpu017");
  EXPECT_EQ(e.master_port, 15000 + 123456 % 20000);
}

TEST(LaunchEnvTest, RankWinsOverSlurm) {
  // torchrun inside an srun allocation: the launcher's variables describe this process.
  const LaunchEnv e = launch_env(lookup_in({{"RANK", "1"},
                                            {"WORLD_SIZE", "2"},
                                            {"MASTER_ADDR", "127.0.0.1"},
                                            {"MASTER_PORT", "1234"},
                                            {"SLURM_PROCID", "0"},
                                            {"SLURM_NTASKS", "1"}}));
  EXPECT_EQ(e.source, "RANK/WORLD_SIZE");
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
}

TEST(LaunchEnvTest, FirstSlurmHost) {
  EXPECT_EQ(first_slurm_host("node1"), "node1");
  EXPECT_EQ(first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(first_slurm_host("node[003-004,7],login"), "node003");
  EXPECT_EQ(first_slurm_host("rack[2]-gpu[5-6]"), "rack2-gpu[5-6]");
  EXPECT_EQ(first_slurm_host("a[12,14]b"), "a12b");
  EXPECT_THAT([] { (void)first_slurm_host("node[]"); }, ::testing::Throws<Error>());
}

TEST(LaunchEnvTest, BadValuesNameTheVariable) {
  EXPECT_THAT(error_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), HasSubstr("RANK=\"x\": expected a whole number"));
  EXPECT_THAT(error_of({{"RANK", "0"}}), HasSubstr("WORLD_SIZE is not set"));
  EXPECT_THAT(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}),
              HasSubstr("RANK=2 is not below WORLD_SIZE=2"));
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}),
              HasSubstr("MASTER_ADDR is not set"));
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}),
              HasSubstr("MASTER_PORT is not set"));
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}}),
              HasSubstr("MASTER_PORT=70000 is not a TCP port"));
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), HasSubstr("WORLD_SIZE=0: expected a number >= 1"));
  EXPECT_THAT(error_of({{"RANK", "1"},
                        {"WORLD_SIZE", "4"},
                        {"LOCAL_RANK", "3"},
                        {"LOCAL_WORLD_SIZE", "2"},
                        {"MASTER_ADDR", "h"},
                        {"MASTER_PORT", "1"}}),
              HasSubstr("LOCAL_RANK=3 is not below LOCAL_WORLD_SIZE=2"));
  EXPECT_THAT(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}), HasSubstr("SLURM_STEP_NODELIST"));
}

TEST(RuntimeTest, OneProcessNeedsNoProcessGroup) {
  init(launch_env(lookup_in({})), RuntimeOptions{});
  EXPECT_FALSE(initialized());
  EXPECT_TRUE(is_rank0());
  EXPECT_EQ(world_size(), 1);
  EXPECT_THAT([] { (void)world(); }, ::testing::Throws<Error>());
  barrier();  // no-op
  shutdown();
}

// --- rank-aware messages (modalities/sdk/log.h) ------------------------------------------------

TEST(RankAwareLogTest, SharedWarningsComeFromRankZeroOnlyAndOwnOnesNameTheRank) {
  const auto stderr_of = [](const char* rank, const char* world, const std::function<void()>& f) {
    setenv("RANK", rank, 1);
    setenv("WORLD_SIZE", world, 1);
    ::testing::internal::CaptureStderr();
    f();
    std::string out = ::testing::internal::GetCapturedStderr();
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    return out;
  };
  EXPECT_EQ(stderr_of("0", "4", [] { log::warning("shared"); }), "warning: shared\n");
  EXPECT_EQ(stderr_of("3", "4", [] { log::warning("shared"); }), "");
  EXPECT_EQ(stderr_of("3", "4", [] { log::info("note"); }), "");
  EXPECT_EQ(stderr_of("3", "4", [] { log::rank_warning("mine"); }), "warning: rank 3: mine\n");
  EXPECT_EQ(stderr_of("0", "1", [] { log::rank_warning("mine"); }), "warning: mine\n");
}

// --- MODALITIES_DEBUG_COLLECTIVES -------------------------------------------------------------

// Runs as 2 ranks under CollectiveCheckTest: rank 0 all-reduces a [4] tensor, rank 1 broadcasts
// a [3] one. With the debug switch c10d's ProcessGroupWrapper reports the mismatch on every rank.
MODALITIES_WORKER_CASE(CollectiveCheckWorker, MismatchedCollectives) {
  RuntimeOptions o;
  o.backend = "gloo";
  o.timeout = std::chrono::seconds(20);
  init(launch_env(), o);
  std::vector<at::Tensor> t = {at::ones({rank() == 0 ? 4 : 3})};
  try {
    if (rank() == 0) world()->allreduce(t)->wait();
    else world()->broadcast(t)->wait();
    std::printf("no error\n");
  } catch (const std::exception& e) {
    std::printf("collective error: %s\n", e.what());
  }
  shutdown();
}

TEST(CollectiveCheckTest, TheDebugSwitchNamesMismatchedCollectives) {
  const CommandResult r = modalities::testing::run_workers(kHost, 2, "CollectiveCheckWorker.MismatchedCollectives",
                                                           {{"MODALITIES_DEBUG_COLLECTIVES", "1"}}, 120);
  for (int k = 0; k < 2; ++k) EXPECT_THAT(r.out, HasSubstr(fmt::format("[rank {}] collective error: ", k))) << r;
  EXPECT_THAT(r.out, HasSubstr("ALLREDUCE")) << r;
  EXPECT_THAT(r.out, HasSubstr("BROADCAST")) << r;
}

// --- the launcher ------------------------------------------------------------------------

// The launcher and its ranks under coreutils timeout (a hang fails the test after `limit_s`).
CommandResult launch(const std::vector<std::string>& args, int limit_s = 60) {
  std::vector<std::string> argv = {"timeout", "-k", "5", std::to_string(limit_s), kHost, "launch"};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_command(argv);
}

TEST(LauncherTest, GivesEveryRankTorchrunsEnvironmentAndPrefixesItsLines) {
  const CommandResult r = launch({"--nproc-per-node", "3", "--exec", "--", "sh", "-c",
                                  "echo \"env $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR "
                                  "$MASTER_PORT\"; echo oops >&2"});
  ASSERT_EQ(r.exit_code, 0) << r;
  std::set<std::string> ports;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string prefix = "[rank " + std::to_string(rank) + "] env " + std::to_string(rank) + " " +
                               std::to_string(rank) + " 3 3 0 127.0.0.1 ";
    const auto at = r.out.find(prefix);
    ASSERT_NE(at, std::string::npos) << r;
    ports.insert(r.out.substr(at + prefix.size(), r.out.find('\n', at) - at - prefix.size()));
    EXPECT_THAT(r.err, HasSubstr("[rank " + std::to_string(rank) + "] oops")) << r;
  }
  ASSERT_EQ(ports.size(), 1u) << r;  // one free port, the same for every rank
  EXPECT_GT(std::stoi(*ports.begin()), 0);
}

TEST(LauncherTest, OutputRank0ShowsOnlyRank0sStandardOutputButEveryonesErrors) {
  const CommandResult r = launch(
      {"--nproc-per-node", "2", "--output", "rank0", "--exec", "--", "sh", "-c", "echo out$RANK; echo err$RANK >&2"});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, AllOf(HasSubstr("[rank 0] out0"), Not(HasSubstr("out1")))) << r;
  EXPECT_THAT(r.err, AllOf(HasSubstr("[rank 0] err0"), HasSubstr("[rank 1] err1"))) << r;
}

TEST(LauncherTest, AFailingRankStopsTheOthersAndGivesItsStatus) {
  const auto start = std::chrono::steady_clock::now();
  const CommandResult r = launch({"--nproc-per-node", "3", "--grace-s", "2", "--exec", "--", "sh", "-c",
                                  "if [ \"$RANK\" = 1 ]; then exit 7; fi; sleep 50"});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.exit_code, 7) << r;
  EXPECT_THAT(r.err, HasSubstr("rank 1 (pid")) << r;
  EXPECT_THAT(r.err, HasSubstr("exited with status 7; stopping the other ranks")) << r;
  EXPECT_LT(seconds, 20) << r;
}

TEST(LauncherTest, ARankKilledBySignalIsNamedWithTheSignal) {
  const CommandResult r = launch({"--nproc-per-node", "3", "--grace-s", "2", "--exec", "--", "sh", "-c",
                                  "if [ \"$RANK\" = 2 ]; then kill -9 $$; fi; sleep 50"});
  EXPECT_EQ(r.exit_code, 128 + 9) << r;
  EXPECT_THAT(r.err, HasSubstr("rank 2 (pid")) << r;
  EXPECT_THAT(r.err, HasSubstr("was killed by signal 9 (SIGKILL)")) << r;
}

TEST(LauncherTest, RanksThatIgnoreSigtermAreKilledAfterTheGracePeriod) {
  const auto start = std::chrono::steady_clock::now();
  const CommandResult r = launch({"--nproc-per-node", "2", "--grace-s", "1", "--exec", "--", "sh", "-c",
                                  "if [ \"$RANK\" = 0 ]; then sleep 0.5; exit 3; fi; trap '' TERM; "
                                  "while :; do sleep 0.1; done"});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.exit_code, 3) << r;
  EXPECT_THAT(r.err, HasSubstr("sending SIGKILL")) << r;
  EXPECT_LT(seconds, 20) << r;
}

TEST(LauncherTest, ForwardsSigtermToEveryRank) {
  // The launcher gets SIGTERM from `timeout` after 2 s; every rank traps it and reports.
  const CommandResult r =
      run_command({"timeout", "--preserve-status", "-k", "20", "2", kHost, "launch", "--nproc-per-node", "2", "--exec",
                   "--", "sh", "-c", "trap 'echo got TERM; exit 5' TERM; sleep 30 & wait"});
  EXPECT_EQ(r.exit_code, 128 + 15) << r;
  EXPECT_THAT(r.err, HasSubstr("received SIGTERM, forwarding it to every rank")) << r;
  EXPECT_THAT(r.out, AllOf(HasSubstr("[rank 0] got TERM"), HasSubstr("[rank 1] got TERM"))) << r;
}

// Ctrl-C: SIGINT to the launcher reaches every rank once. Each rank's shell leaves its background
// `sleep` behind (background jobs of a non-interactive shell ignore SIGINT), holding the rank's
// output open: the launcher kills it 2 s after the last rank exited instead of waiting 30 s.
TEST(LauncherTest, ForwardsSigintToEveryRank) {
  const CommandResult r =
      run_command({"timeout", "--preserve-status", "-s", "INT", "-k", "20", "2", kHost, "launch", "--nproc-per-node",
                   "2", "--exec", "--", "sh", "-c", "trap 'echo got INT; exit 6' INT; sleep 30 & wait"});
  EXPECT_EQ(r.exit_code, 128 + 2) << r;
  EXPECT_THAT(r.err, HasSubstr("received SIGINT, forwarding it to every rank")) << r;
  EXPECT_THAT(r.out, AllOf(HasSubstr("[rank 0] got INT"), HasSubstr("[rank 1] got INT"))) << r;
  EXPECT_THAT(r.err, HasSubstr("killing the processes they left behind")) << r;
}

TEST(LauncherTest, BadUsageIsRefusedWithAHint) {
  CommandResult r = launch({"--nproc-per-node", "2"});
  EXPECT_EQ(r.exit_code, 2) << r;
  EXPECT_THAT(r.err, HasSubstr("no command after `--`")) << r;
  r = launch({"--nproc-per-node", "0", "--", "dist", "check"});
  EXPECT_EQ(r.exit_code, 2) << r;
  EXPECT_THAT(r.err, HasSubstr("--nproc-per-node must be >= 1")) << r;
  r = launch({"--nproc-per-node", "2", "--nnodes", "2", "--", "dist", "check"});
  EXPECT_EQ(r.exit_code, 2) << r;
  EXPECT_THAT(r.err, HasSubstr("same --master-port")) << r;
  r = launch({"--nproc-per-node", "1", "--exec", "--", "/nonexistent/program"});
  EXPECT_EQ(r.exit_code, 127) << r;
  EXPECT_THAT(r.err, HasSubstr("cannot execute '/nonexistent/program'")) << r;
}

// --- collectives through this build's c10d ---------------------------------------------------

void expect_dist_check_passes(int ranks) {
  const CommandResult r = launch({"--nproc-per-node", std::to_string(ranks), "--", "dist", "check", "--device", "cpu",
                                  "--timeout-s", "30", "--size-mb", "1", "--iters", "2"},
                                 120);
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr("[rank 0] dist check: " + std::to_string(ranks) + " ranks")) << r;
  EXPECT_THAT(r.out, HasSubstr("backend gloo")) << r;
  EXPECT_THAT(r.out, HasSubstr("all exact on every rank")) << r;
  EXPECT_THAT(r.out, HasSubstr("_reduce_scatter_base")) << r;
  // Only rank 0 reports.
  EXPECT_THAT(r.out, Not(HasSubstr("[rank 1] dist check"))) << r;
}

TEST(CollectivesTest, TwoGlooProcessesGetExactResults) { expect_dist_check_passes(2); }
TEST(CollectivesTest, ThreeGlooProcessesGetExactResults) { expect_dist_check_passes(3); }

// The staged test backend (several ranks on one GPU; Note [Staged collectives]) on CPU tensors: the
// same queue, issuing and completing threads as for CUDA tensors, with host copies for the staging.
// Every collective of `dist check` gives exact values at 2 and 3 ranks (3: an odd ring of send/recv).
TEST(CollectivesTest, TheStagedTestBackendGetsExactResults) {
  for (const int ranks : {2, 3}) {
    const CommandResult r = launch({"--nproc-per-node", std::to_string(ranks), "--", "dist", "check", "--backend",
                                    "staged", "--device", "cpu", "--timeout-s", "30", "--size-mb", "1", "--iters", "2"},
                                   120);
    ASSERT_EQ(r.exit_code, 0) << r;
    EXPECT_THAT(r.out, HasSubstr(fmt::format("dist check: {} ranks", ranks))) << r;
    EXPECT_THAT(r.out, HasSubstr("backend staged")) << r;
    EXPECT_THAT(r.out, HasSubstr("all exact on every rank")) << r;
  }
}

TEST(CollectivesTest, AnUnknownBackendInTheEnvironmentIsNamed) {
  const CommandResult r = run_command({"timeout", "-k", "5", "60", kHost, "launch", "--nproc-per-node", "2", "--",
                                       "dist", "check", "--device", "cpu", "--timeout-s", "20"},
                                      {{"MODALITIES_BACKEND", "mpi"}});
  EXPECT_NE(r.exit_code, 0) << r;
  EXPECT_THAT(r.err, HasSubstr("environment variable MODALITIES_BACKEND: process group backend \"mpi\": expected "
                               "\"auto\", \"gloo\", \"nccl\" or \"staged\""))
      << r;
}

// srun's contract alone: each rank gets SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID /
// SLURM_NTASKS_PER_NODE / SLURM_STEP_NODELIST (rank 0's host) and MASTER_PORT, and no RANK,
// WORLD_SIZE, LOCAL_RANK or MASTER_ADDR (the launcher's are removed before the host starts).
TEST(CollectivesTest, RanksStartedWithOnlySlurmVariablesFindEachOther) {
  const std::string script = fmt::format(
      "exec env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR SLURM_PROCID=$RANK "
      "SLURM_NTASKS=$WORLD_SIZE SLURM_LOCALID=$LOCAL_RANK SLURM_NTASKS_PER_NODE=$LOCAL_WORLD_SIZE "
      "SLURM_STEP_NODELIST=localhost SLURM_JOB_ID=1 MASTER_PORT=$MASTER_PORT {} dist check --device cpu "
      "--timeout-s 30 --size-mb 1 --iters 2",
      modalities::testing::shell_quote(kHost));
  const CommandResult r = launch({"--nproc-per-node", "2", "--exec", "--", "/bin/sh", "-c", script}, 120);
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr("[rank 0] dist check: 2 ranks (2 per node, from SLURM)")) << r;
  EXPECT_THAT(r.out, HasSubstr("rendezvous localhost:")) << r;
  EXPECT_THAT(r.out, HasSubstr("all exact on every rank")) << r;
}

TEST(CollectivesTest, OneProcessIsToldToUseALauncher) {
  const CommandResult r = run_command(
      {"env", "-u", "RANK", "-u", "WORLD_SIZE", "-u", "SLURM_PROCID", "timeout", "30", kHost, "dist", "check"});
  EXPECT_EQ(r.exit_code, 2) << r;
  EXPECT_THAT(r.err, HasSubstr("needs several processes")) << r;
}

int free_port() { return dist::free_rendezvous_port("127.0.0.1"); }

// Note [Rendezvous port]: the ports come from 10000 up to the start of the kernel's ephemeral range
// (bind(0) would give ones inside it) and are free. Where the range starts below 11000 there is no
// room below it, and the ports (from bind(0) then) need only be free.
TEST(CollectivesTest, RendezvousPortsComeFromBelowTheEphemeralRange) {
  int low = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> low;
  const bool room_below = low >= 11000;
  for (int k = 0; k < 20; ++k) {
    const int port = free_port();
    EXPECT_GT(port, 0);
    if (room_below) {
      EXPECT_GE(port, 10000);
      EXPECT_LT(port, low);
    }
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = htons(static_cast<std::uint16_t>(port));
    EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0) << port;
    close(fd);
  }
}

TEST(CollectivesTest, ARendezvousThatNeverCompletesTimesOutWithAClearError) {
  // WORLD_SIZE 2 but only rank 0 starts: its store waits for a worker that never comes.
  const auto start = std::chrono::steady_clock::now();
  const CommandResult r = run_command(
      {"timeout", "-k", "5", "60", kHost, "dist", "check", "--device", "cpu", "--timeout-s", "3"},
      {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(free_port())}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("rank 0 of 2: rendezvous at 127.0.0.1:")) << r;
  EXPECT_LT(seconds, 40) << r;
}

// --- `run` under the launcher ----------------------------------------------------------------

TEST(DistributedRunTest, TwoRanksAgreeOnTheRunTestCommAndRefuseAnUnwrappedModelOnEveryRank) {
  const modalities::testing::ScratchDir dir;
  const std::string config = std::string(MODALITIES_TEST_SOURCE_ROOT) + "/configs/quickstart/train.toml";
  const CommandResult r = launch(
      {"--nproc-per-node", "2", "--grace-s", "5", "--", "run", "--config_file_path", config, "--experiments_root_path",
       (dir.path() / "experiments").string(), "--test_comm", "--process_group_timeout_s", "30"},
      120);
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("[rank 0] test_comm: every collective gave exact results on 2 ranks (gloo)")) << r;
  for (int rank = 0; rank < 2; ++rank)
    EXPECT_THAT(r.err, HasSubstr(fmt::format("[rank {}] error: rank {}: settings.cuda_env.world_size = 2: the model "
                                             "is not wrapped for data parallelism",
                                             rank, rank)))
        << r;
  // Rank 0 alone wrote the experiment folder, under the id both ranks used.
  std::vector<std::string> folders;
  for (const auto& e : std::filesystem::directory_iterator(dir.path() / "experiments"))
    folders.push_back(e.path().filename().string());
  ASSERT_EQ(folders.size(), 1u) << r;
  EXPECT_THAT(r.err, HasSubstr("[rank 0] experiment " + folders[0] + " in ")) << r;
  EXPECT_THAT(r.err, Not(HasSubstr("[rank 1] experiment "))) << r;
  EXPECT_THAT(r.out, Not(HasSubstr("[rank 1] Training Report"))) << r;
}

TEST(DistributedRunTest, ASettingsWorldSizeThatIsNotTheLaunchersIsRefused) {
  const modalities::testing::ScratchDir dir;
  std::ifstream in(std::string(MODALITIES_TEST_SOURCE_ROOT) + "/configs/quickstart/train.toml");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string from = "world_size = \"${cuda_env:WORLD_SIZE}\"";
  ASSERT_NE(text.find(from), std::string::npos);
  text.replace(text.find(from), from.size(), "world_size = 1");
  // The copy lives elsewhere: make its data path absolute.
  const std::string data = "${modalities_env:config_folder_path}/../../data";
  ASSERT_NE(text.find(data), std::string::npos);
  text.replace(text.find(data), data.size(), std::string(MODALITIES_TEST_SOURCE_ROOT) + "/data");
  const auto config = dir.write("train.toml", text);
  const CommandResult r = launch({"--nproc-per-node", "2", "--grace-s", "5", "--", "run", "--config_file_path",
                                  config.string(), "--experiments_root_path", (dir.path() / "experiments").string()},
                                 120);
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("settings.cuda_env says global_rank")) << r;
  EXPECT_THAT(r.err, HasSubstr("of world_size 1, but this process is rank")) << r;
}

// Note [Rank fingerprint] in core/app/cli_run.cpp: rank 1 is started on a config file that differs
// from rank 0's by a comment; both ranks refuse to start, naming rank 1 and the config file.
TEST(DistributedRunTest, ARankWithAnotherConfigFileIsRefusedOnEveryRank) {
  const modalities::testing::ScratchDir dir;
  std::ifstream in(std::string(MODALITIES_TEST_SOURCE_ROOT) + "/configs/distributed/fsdp2_cpu.toml");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto a = dir.write("a.toml", text);
  const auto b = dir.write("b.toml", text + "# edited on one node only\n");
  const std::string script = fmt::format(
      "if [ \"$RANK\" = 1 ]; then c={}; else c={}; fi; exec {} run --config_file_path \"$c\" --experiments_root_path "
      "{} --experiment_id fp",
      modalities::testing::shell_quote(b.string()), modalities::testing::shell_quote(a.string()),
      modalities::testing::shell_quote(kHost), modalities::testing::shell_quote((dir.path() / "experiments").string()));
  const CommandResult r = launch({"--nproc-per-node", "2", "--grace-s", "5", "--exec", "--", "sh", "-c", script}, 120);
  EXPECT_NE(r.exit_code, 0) << r;
  for (int rank : {0, 1})
    EXPECT_THAT(r.err, HasSubstr(fmt::format("[rank {}] error: rank {}: the ranks do not run the same program and "
                                             "config as rank 0 (rank 1: config file)",
                                             rank, rank)))
        << r;
}

// --- FSDP2 training through `run` ----------------------------------------------------------------

// `text` with its first `from` replaced by `to`; a config without `from` means the test is out of date.
std::string edited(std::string text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  if (at == std::string::npos) throw std::runtime_error("the config has no '" + from + "'");
  return text.replace(at, from.size(), to);
}

// The number after "key": in a line of evaluation_results.jsonl (NaN without the key).
double number_after(const std::string& line, const std::string& key) {
  const auto at = line.find("\"" + key + "\": ");
  return at == std::string::npos ? std::nan("") : std::stod(line.substr(at + key.size() + 4));
}

// `run` of `config_file` as experiment `id` under `root`: one process, or `ranks` ranks under the
// launcher; no progress bar, one thread per rank, under coreutils timeout.
CommandResult train(int ranks, const std::filesystem::path& config_file, const std::filesystem::path& root,
                    const std::string& id, int limit_s = 300, const std::string& backend = "",
                    const std::vector<std::string>& extra_args = {}) {
  std::vector<std::string> argv = {"timeout", "-k", "5", std::to_string(limit_s), kHost};
  if (ranks > 1) argv.insert(argv.end(), {"launch", "--nproc-per-node", std::to_string(ranks), "--grace-s", "5", "--"});
  argv.insert(argv.end(), {"run", "--config_file_path", config_file.string(), "--experiments_root_path", root.string(),
                           "--experiment_id", id});
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  std::vector<std::pair<std::string, std::string>> env = {{"MODALITIES_PROGRESS", "0"}, {"OMP_NUM_THREADS", "1"}};
  if (!backend.empty()) env.emplace_back("MODALITIES_BACKEND", backend);
  return run_command(argv, env);
}

// configs/<path> (a run of `target_steps` steps) for a short run, logged every step, with absolute
// data paths. The configs fix the global batch (8 samples); the micro-batch size follows the
// world size and `accumulation`. `checkpoint_every` > 0 keeps a checkpoint every that many steps.
std::string short_run_config(const std::string& path, int target_steps, int steps, int accumulation,
                             int checkpoint_every) {
  std::ifstream in(std::string(MODALITIES_TEST_SOURCE_ROOT) + "/configs/" + path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto replace = [&](const std::string& from, const std::string& to) {
    text = edited(std::move(text), from, to);
  };
  replace("${modalities_env:config_folder_path}/../../data", std::string(MODALITIES_TEST_SOURCE_ROOT) + "/data");
  replace(fmt::format("num_target_steps = {}", target_steps), fmt::format("num_target_steps = {}", steps));
  replace("training_log_interval_in_steps = 5", "training_log_interval_in_steps = 1");
  replace("checkpointing_interval_in_steps = 20",
          fmt::format("checkpointing_interval_in_steps = {}", checkpoint_every > 0 ? checkpoint_every : steps));
  replace("evaluation_interval_in_steps = 20", fmt::format("evaluation_interval_in_steps = {}", steps));
  replace("warmup_steps = 10", "warmup_steps = 4");
  replace("gradient_accumulation_steps = 1", fmt::format("gradient_accumulation_steps = {}", accumulation));
  if (checkpoint_every > 0) replace("config = { k = 2 }", "config = { k = -1 }");
  return text;
}

// configs/distributed/<file> (80 steps) for a short run (short_run_config).
std::string distributed_config(const std::string& file, int steps, int accumulation = 1, int checkpoint_every = 0) {
  return short_run_config("distributed/" + file, 80, steps, accumulation, checkpoint_every);
}

std::string fsdp2_config(int steps, int accumulation = 1) {
  return distributed_config("fsdp2_cpu.toml", steps, accumulation);
}

// (train loss avg, grad norm avg) of every logged step of evaluation_results.jsonl.
std::vector<std::pair<double, double>> logged_losses_and_norms(const std::filesystem::path& results) {
  std::ifstream in(results);
  std::vector<std::pair<double, double>> out;
  for (std::string line; std::getline(in, line);)
    if (line.find("\"train loss avg\"") != std::string::npos)
      out.emplace_back(number_after(line, "train loss avg"), number_after(line, "grad norm avg"));
  return out;
}

// The logged (loss, grad norm) curve of experiment `id` under `root`.
std::vector<std::pair<double, double>> curve_of(const std::filesystem::path& root, const std::string& id) {
  return logged_losses_and_norms(root / id / "evaluation_results.jsonl");
}

// A data-parallel layout to train: its experiment id, the number of ranks and the config.
struct Layout {
  std::string id;
  int ranks;
  std::string config;
};

// Trains one process on the global batch of 8 (8 x 1, the reference, and 2 x 4 accumulation, the
// noise floor of splitting the same batch differently) and every layout for `steps` steps: the
// loss and grad norm of every step of each layout agree with the one-process run within 1e-5
// relative, or within 10x the noise floor if that is larger. A layout whose id starts with
// "no_shard" is compared with one process using gradient_clipper/fsdp1 (FSDP1's float32 norm, bit
// for bit PyTorch's, which differs from the float64 norm of the sharded clippers by up to ~1e-4
// relative). Every curve is printed.
// `reference(accumulation)`: the one-process config with that many accumulation steps.
// `inspect(root)`, when given, then looks at the runs' outputs under root/<id>.
void expect_layouts_train_like_a_reference(int steps, const std::vector<Layout>& layouts,
                                           const std::function<std::string(int)>& reference,
                                           const std::function<void(const std::filesystem::path&)>& inspect = {}) {
  const modalities::testing::ScratchDir dir;
  const auto root = dir.path() / "experiments";
  const auto run_on = [&](int ranks, const std::string& id, const std::string& config) {
    const CommandResult r = train(ranks, dir.write(id + ".toml", config), root, id);
    EXPECT_EQ(r.exit_code, 0) << r;
  };
  const std::string no_shard = edited(distributed_config("fsdp1_cpu.toml", steps), "sharding_strategy = \"FULL_SHARD\"",
                                      "sharding_strategy = \"NO_SHARD\"");
  const bool any_no_shard =
      std::any_of(layouts.begin(), layouts.end(), [](const Layout& l) { return l.id.starts_with("no_shard"); });
  run_on(1, "one_8x1", reference(1));
  run_on(1, "one_2x4", reference(4));
  if (any_no_shard) run_on(1, "one_fsdp1", no_shard);
  for (const Layout& l : layouts) run_on(l.ranks, l.id, l.config);

  const auto ref_fsdp2 = curve_of(root, "one_8x1");
  const auto floor = curve_of(root, "one_2x4");
  ASSERT_EQ(ref_fsdp2.size(), static_cast<std::size_t>(steps));
  ASSERT_EQ(floor.size(), static_cast<std::size_t>(steps));
  const auto rel = [](double a, double b) { return std::abs(a - b) / std::abs(b); };
  double loss_floor = 0, norm_floor = 0;
  for (int k = 0; k < steps; ++k) {
    loss_floor = std::max(loss_floor, rel(floor[k].first, ref_fsdp2[k].first));
    norm_floor = std::max(norm_floor, rel(floor[k].second, ref_fsdp2[k].second));
  }
  std::printf("noise floor (one process, 2 x 4 accumulation vs 8 x 1): loss %.2e, grad norm %.2e\n", loss_floor,
              norm_floor);
  const auto ref_fsdp1 = any_no_shard ? curve_of(root, "one_fsdp1") : ref_fsdp2;
  for (const Layout& l : layouts) {
    const auto& ref = l.id.starts_with("no_shard") ? ref_fsdp1 : ref_fsdp2;
    const auto got = curve_of(root, l.id);
    ASSERT_EQ(got.size(), static_cast<std::size_t>(steps)) << l.id;
    double loss = 0, norm = 0;
    for (int k = 0; k < steps; ++k) {
      loss = std::max(loss, rel(got[k].first, ref[k].first));
      norm = std::max(norm, rel(got[k].second, ref[k].second));
      std::printf("%-15s step %2d  loss %.9g (one process %.9g)  grad norm %.9g (one process %.9g)\n", l.id.c_str(),
                  k + 1, got[k].first, ref[k].first, got[k].second, ref[k].second);
    }
    std::printf("%-15s worst relative difference: loss %.2e, grad norm %.2e\n", l.id.c_str(), loss, norm);
    EXPECT_LE(loss, std::max(1e-5, 10 * loss_floor)) << l.id;
    EXPECT_LE(norm, std::max(1e-5, 10 * norm_floor)) << l.id;
  }
  if (inspect) inspect(root);
}

void expect_layouts_train_like_one_process(int steps, const std::vector<Layout>& layouts,
                                           const std::function<std::string(std::string)>& reference_edit = {}) {
  expect_layouts_train_like_a_reference(steps, layouts, [&](int accumulation) {
    std::string config = fsdp2_config(steps, accumulation);
    return reference_edit ? reference_edit(std::move(config)) : config;
  });
}

// The issue's acceptance (label `full`): one process vs FSDP2 on 2 and 4 ranks vs HSDP 2x2 vs FSDP1
// NO_SHARD on 2 ranks vs FSDP1 FULL_SHARD on 2 ranks with gradient accumulation 2, 20 steps.
TEST(DistributedRunFullTest, EveryDataParallelLayoutTrainsLikeOneProcessOnTheSameGlobalBatch) {
  constexpr int kSteps = 20;
  const std::string fsdp2 = fsdp2_config(kSteps);
  expect_layouts_train_like_one_process(
      kSteps, {{"fsdp2_2", 2, fsdp2},
               {"fsdp2_4", 4, fsdp2},
               {"hsdp_2x2", 4,
                edited(fsdp2, "data_parallel_shard_degree = -1",
                       "data_parallel_replicate_degree = 2, data_parallel_shard_degree = -1")},
               {"no_shard_2", 2,
                edited(distributed_config("fsdp1_cpu.toml", kSteps), "sharding_strategy = \"FULL_SHARD\"",
                       "sharding_strategy = \"NO_SHARD\"")},
               {"fsdp1_2_accum2", 2, distributed_config("fsdp1_cpu.toml", kSteps, 2)}});
}

// `config` run on 2 ranks fails with `message`, and rank 1 took part: it printed output itself, or
// the launcher stopped it after the first rank failed (which rank reports first is a race: the
// launcher ends the others as soon as one rank exits with an error).
void expect_refused_on_two_ranks(const modalities::testing::ScratchDir& dir, const std::string& id,
                                 const std::string& config, const std::string& message) {
  const CommandResult r = launch(
      {"--nproc-per-node", "2", "--grace-s", "5", "--", "run", "--config_file_path",
       dir.write(id + ".toml", config).string(), "--experiments_root_path", (dir.path() / "experiments").string()},
      120);
  EXPECT_NE(r.exit_code, 0) << r;
  EXPECT_THAT(r.err, HasSubstr(message)) << r;
  EXPECT_TRUE(r.err.find("[rank 1]") != std::string::npos || r.err.find("[launch] rank 1 ") != std::string::npos) << r;
}

// --- tensor parallel -------------------------------------------------------------------------

// configs/distributed/tp_cpu.toml for a short run (see distributed_config), with or without
// sequence parallelism and loss parallelism.
std::string tp_config(int steps, bool sequence_parallel = true, bool loss_parallel = false) {
  std::string text = distributed_config("tp_cpu.toml", steps);
  if (!sequence_parallel) text = edited(text, "sequence_parallel = true", "sequence_parallel = false");
  if (loss_parallel) text = edited(text, "enable_loss_parallel = false", "enable_loss_parallel = true");
  return text;
}

// The issue's acceptance (label `full`): TP2, SP on TP2, SP and loss parallel on TP2, FSDP2 x TP2
// on 4 ranks (dp_shard 2 x tp 2) with and without loss parallel, 20 steps each.
TEST(DistributedTpFullTest, EveryTensorParallelLayoutTrainsLikeOneProcess) {
  constexpr int kSteps = 20;
  expect_layouts_train_like_one_process(kSteps, {{"tp2", 2, tp_config(kSteps, false)},
                                                 {"tp2_sp", 2, tp_config(kSteps)},
                                                 {"tp2_sp_loss_parallel", 2, tp_config(kSteps, true, true)},
                                                 {"fsdp2x2_tp2_sp", 4, tp_config(kSteps)},
                                                 {"fsdp2x2_tp2_loss_parallel", 4, tp_config(kSteps, false, true)}});
}

// --- document masking -------------------------------------------------------------------------

// A configs/distributed/*.toml whose collator also writes the document ids of the packed samples
// (collate_fn/document_masking_collator_wrapper, EOD id 0 of data/tokenizer/gpt2_style_8k) and
// whose model attends inside each document, with positions restarting at each one.
std::string document_masked(std::string text) {
  text = edited(
      std::move(text),
      "[collate_fn]\ncomponent_key = \"collate_fn\"\nvariant_key = \"gpt_2_llm_collator\"\n\n[collate_fn.config]",
      "[collate_fn]\ncomponent_key = \"collate_fn\"\nvariant_key = \"document_masking_collator_wrapper\"\n\n"
      "[collate_fn.config]\nsample_key = \"${settings.referencing_keys.sample_key}\"\neod_token_id = 0\n"
      "wrapped_collate_fn = { instance_key = \"packing_collate_fn\", pass_type = \"BY_REFERENCE\" }\n\n"
      "[packing_collate_fn]\ncomponent_key = \"collate_fn\"\nvariant_key = \"gpt_2_llm_collator\"\n\n"
      "[packing_collate_fn.config]");
  return edited(std::move(text), "[model_raw.config]\n",
                "[model_raw.config]\ndocument_ids_key = \"document_ids\"\ndocument_positions = \"restart\"\n");
}

// Document masking on 2 ranks: FSDP2 and TP2 with sequence parallelism train like one process with
// the same masking on the same global batch (the bundled documents average ~470 tokens, so the
// 128-token samples cross boundaries); 5 steps. Under `full`: 20 steps, also FSDP2 on 4 ranks and
// activation checkpointing.
TEST(DistributedDocumentMaskingTest, Fsdp2AndSequenceParallelTensorParallelismTrainLikeOneProcess) {
  constexpr int kSteps = 5;
  expect_layouts_train_like_one_process(
      kSteps,
      {{"fsdp2_2", 2, document_masked(fsdp2_config(kSteps))}, {"tp2_sp", 2, document_masked(tp_config(kSteps))}},
      document_masked);
}

TEST(DistributedDocumentMaskingFullTest, EveryLayoutTrainsLikeOneProcess) {
  constexpr int kSteps = 20;
  expect_layouts_train_like_one_process(kSteps,
                                        {{"fsdp2_2", 2, document_masked(fsdp2_config(kSteps))},
                                         {"fsdp2_4", 4, document_masked(fsdp2_config(kSteps))},
                                         {"tp2_sp", 2, document_masked(tp_config(kSteps))},
                                         {"fsdp2_ac_2", 2, document_masked(distributed_config("ac_cpu.toml", kSteps))}},
                                        document_masked);
}

// Heads or kv heads that the tp ranks cannot split evenly are config errors, on every rank, before
// anything is built on them. (The vocabulary, a multiple of 128 for model/gpt2, always splits over
// a power-of-two degree; its check is the same code.)
TEST(DistributedTpTest, WhatTheTensorParallelRanksCannotSplitIsAConfigError) {
  const modalities::testing::ScratchDir dir;
  const auto refused = [&](const std::string& id, const std::string& config, const std::string& message) {
    expect_refused_on_two_ranks(dir, id, config, message);
  };
  refused("kv_heads", edited(tp_config(6), "n_head_kv = 4", "n_head_kv = 1"),
          "model/gpt2's n_head_kv = 1 is not divisible by the tensor-parallel degree 2");
  refused("heads", edited(edited(tp_config(6), "n_head_kv = 4", "n_head_kv = 1"), "n_head_q = 8", "n_head_q = 1"),
          "model/gpt2's n_head_q = 1 is not divisible by the tensor-parallel degree 2");
}

// The one-process reference of a pipeline: the same model without weight tying.
std::string untied(std::string config) {
  return edited(std::move(config), "use_weight_tying = true", "use_weight_tying = false");
}

// ep_cpu.toml's sampler over the mesh's dp_shard ranks: under tp or pp several ranks read the same
// samples.
std::string sampled_over_dp_shard(std::string text) {
  text = edited(std::move(text), "variant_key = \"resumable_distributed_sampler\"",
                "variant_key = \"resumable_distributed_multi_dim_sampler\"");
  return edited(std::move(text),
                "rank = \"${settings.cuda_env.global_rank}\"\nnum_replicas = \"${settings.cuda_env.world_size}\"",
                "device_mesh = { instance_key = \"device_mesh\", pass_type = \"BY_REFERENCE\" }\n"
                "data_parallel_key = \"dp_shard\"");
}

// --- context parallel ---------------------------------------------------------------------

// configs/distributed/cp_cpu.toml for a short run (see distributed_config).
std::string cp_config(int steps, int checkpoint_every = 0) {
  return distributed_config("cp_cpu.toml", steps, 1, checkpoint_every);
}

// configs/distributed/tp_cpu.toml with a cp dim of 2 as well: model/gpt2_tp applies context
// parallelism after splitting the model (Modalities' gpt2_tp with context_parallel_load_balancer).
std::string cp_tp_config(int steps) {
  return edited(edited(tp_config(steps), "tensor_parallel_degree = 2,",
                       "tensor_parallel_degree = 2, context_parallel_degree = 2,"),
                "sequence_parallel = true\n",
                "sequence_parallel = true\ncontext_parallel_load_balancer = \"headtail\"\n");
}

// Context parallelism on 2 ranks trains like one process on the same global batch, with and
// without document masking (the bundled documents cross the 128-token samples); 5 steps. Under
// `full`: 20 steps, also CP2 x FSDP2 on 4 ranks (parameters sharded over dp_shard x cp) with and
// without masking, CP2 x TP2 with sequence parallelism, CP2 with activation checkpointing and
// CP2 x PP2.
TEST(DistributedContextParallelTest, TwoRanksTrainLikeOneProcessWithAndWithoutDocumentMasking) {
  constexpr int kSteps = 5;
  expect_layouts_train_like_one_process(kSteps, {{"cp2", 2, cp_config(kSteps)}});
  expect_layouts_train_like_one_process(kSteps, {{"cp2_documents", 2, document_masked(cp_config(kSteps))}},
                                        document_masked);
}

// configs/distributed/pp_fsdp2_parallelized_cpu.toml (PP2, gpipe, FSDP2 per stage) with a cp dim of
// 2: model/parallelized applies context parallelism before staging the model.
std::string cp_pp_config(int steps) {
  return edited(distributed_config("pp_fsdp2_parallelized_cpu.toml", steps), "pipeline_parallel_degree = 2,",
                "pipeline_parallel_degree = 2, context_parallel_degree = 2,");
}

// configs/distributed/ac_parallelized_cpu.toml (every block activation-checkpointed, FSDP2) with a
// cp dim of 2, the data split over dp_shard.
std::string cp_ac_config(int steps) {
  return sampled_over_dp_shard(edited(distributed_config("ac_parallelized_cpu.toml", steps),
                                      "data_parallel_shard_degree = -1,",
                                      "data_parallel_shard_degree = -1, context_parallel_degree = 2,"));
}

TEST(DistributedContextParallelFullTest, EveryLayoutTrainsLikeOneProcess) {
  constexpr int kSteps = 20;
  expect_layouts_train_like_one_process(
      kSteps,
      {{"cp2", 2, cp_config(kSteps)}, {"fsdp2x2_cp2", 4, cp_config(kSteps)}, {"cp2_tp2_sp", 4, cp_tp_config(kSteps)}});
  expect_layouts_train_like_one_process(kSteps, {{"cp2_ac", 2, cp_ac_config(kSteps)}});
  expect_layouts_train_like_one_process(kSteps, {{"cp2_pp2", 4, cp_pp_config(kSteps)}}, untied);
  expect_layouts_train_like_one_process(kSteps,
                                        {{"cp2_documents", 2, document_masked(cp_config(kSteps))},
                                         {"fsdp2x2_cp2_documents", 4, document_masked(cp_config(kSteps))}},
                                        document_masked);
  // No loss on the first token of each next document: the cp ranks hold different numbers of
  // ignored targets, and the loss still is the whole sequences' mean (each rank's sum over the
  // count of all ranks; an average of the ranks' local means would differ).
  const auto boundary = [](std::string config) {
    return edited(
        document_masked(std::move(config)), "eod_token_id = 0\n",
        "eod_token_id = 0\nmask_boundary_targets = true\ntarget_key = \"${settings.referencing_keys.target_key}\"\n");
  };
  expect_layouts_train_like_one_process(kSteps, {{"cp2_documents_boundary", 2, boundary(cp_config(kSteps))}}, boundary);
}

// A sequence length that 2 x cp does not divide is refused on every rank before training.
TEST(DistributedContextParallelTest, WhatContextParallelismCannotSplitIsAConfigError) {
  const modalities::testing::ScratchDir dir;
  expect_refused_on_two_ranks(
      dir, "length", edited(cp_config(4), "sequence_length = 128", "sequence_length = 126"),
      "model/gpt2's sequence_length = 126 is not divisible by 2 x the context-parallel degree 2 = 4");
}

// --- expert parallel (plugins/moe) ------------------------------------------------------------

// configs/moe/ep_cpu.toml (40 steps) for a short run (short_run_config) at the expert-parallel
// degree `ep` (1: one process).
std::string moe_ep_config(int steps, int ep = 2, int accumulation = 1, int checkpoint_every = 0) {
  return edited(short_run_config("moe/ep_cpu.toml", 40, steps, accumulation, checkpoint_every),
                "expert_parallel_degree = 2", fmt::format("expert_parallel_degree = {}", ep));
}

// moe_ep_config that logs every expert's routing slots (moe_config.log_tokens_per_expert), and
// computes in float64 if `fp64` (param_dtype = reduce_dtype = FP_64; the master weights and the
// optimizer stay float32).
std::string moe_counted_config(int steps, int ep, int accumulation, bool fp64) {
  std::string text = edited(moe_ep_config(steps, ep, accumulation), "use_expert_bias = true",
                            "use_expert_bias = true\nlog_tokens_per_expert = true");
  if (fp64)
    text = edited(text, "param_dtype = \"FP_32\", reduce_dtype = \"FP_32\"",
                  "param_dtype = \"FP_64\", reduce_dtype = \"FP_64\"");
  return text;
}

// Every logged step's routing slots per expert and block ("moe tokens of expert e (block L)",
// summed over the ranks) of experiment `id` under `root`.
std::vector<std::map<std::string, double>> tokens_per_expert_of(const std::filesystem::path& root,
                                                                const std::string& id) {
  std::ifstream in(root / id / "evaluation_results.jsonl");
  std::vector<std::map<std::string, double>> out;
  const std::string key = "\"moe tokens of expert ";
  for (std::string line; std::getline(in, line);) {
    if (line.find("\"train loss avg\"") == std::string::npos) continue;
    std::map<std::string, double>& step = out.emplace_back();
    for (auto at = line.find(key); at != std::string::npos; at = line.find(key, at + 1)) {
      const auto end = line.find('"', at + 1);
      step[line.substr(at + 1, end - at - 1)] = number_after(line, line.substr(at + 1, end - at - 1));
    }
  }
  return out;
}

// The layouts' routing against the one-process run's ("one_8x1"): every expert of every block got
// the same slots at step 1 and, if `every_step`, at every step. Prints how many (step, block,
// expert) counts differ: in float32 the reordered sums of the layouts can flip a near-tied choice
// once the weights have drifted apart by rounding, and from then on a step may differ.
void expect_same_tokens_per_expert(const std::filesystem::path& root, const std::vector<std::string>& ids, int steps,
                                   bool every_step) {
  const auto ref = tokens_per_expert_of(root, "one_8x1");
  ASSERT_EQ(ref.size(), static_cast<std::size_t>(steps));
  ASSERT_FALSE(ref[0].empty()) << "no \"moe tokens of expert\" metric was logged";
  for (const std::string& id : ids) {
    const auto got = tokens_per_expert_of(root, id);
    ASSERT_EQ(got.size(), ref.size()) << id;
    EXPECT_EQ(got[0], ref[0]) << id << ": the tokens per expert of step 1 differ";
    int differing = 0, steps_differing = 0;
    for (int k = 0; k < steps; ++k) {
      ASSERT_EQ(got[k].size(), ref[k].size()) << id << " step " << k + 1;
      int here = 0;
      for (const auto& [name, count] : ref[k]) here += got[k].at(name) != count ? 1 : 0;
      differing += here;
      steps_differing += here > 0 ? 1 : 0;
      if (every_step) {
        EXPECT_EQ(here, 0) << id << ": the tokens per expert of step " << k + 1 << " differ";
      }
    }
    std::printf("%-15s tokens per expert: %d of %zu counts differ from one process (in %d of %d steps)\n", id.c_str(),
                differing, ref[0].size() * static_cast<std::size_t>(steps), steps_differing, steps);
  }
}

// EP2 on two ranks (each rank 2 of the 4 experts of every block, its own 4 sequences) trains like
// one process on the 8 sequences, and routes the same tokens to every expert at step 1: 5 steps
// in the default suite, the acceptance under `full`.
TEST(DistributedMoeTest, ExpertParallelOnTwoRanksTrainsLikeOneProcess) {
  constexpr int kSteps = 5;  // the warm-up's 4 steps and one
  expect_layouts_train_like_a_reference(
      kSteps, {{"ep2", 2, moe_counted_config(kSteps, 2, 1, false)}},
      [](int accumulation) { return moe_counted_config(kSteps, 1, accumulation, false); },
      [](const std::filesystem::path& root) { expect_same_tokens_per_expert(root, {"ep2"}, kSteps, false); });
}

// EP2 on 2 ranks and EP2 x FSDP2 on 4 (dp_shard 4 with ep 2: each expert pair sharded over 2 ranks)
// against one process, 20 steps, in float32 or float64 compute: the losses and grad norms, and the
// tokens per expert at step 1 or, with `every_step`, at every step (how many differ is printed).
void expect_ep2_and_its_fsdp2_route_like_one_process(bool fp64, bool every_step) {
  constexpr int kSteps = 20;
  expect_layouts_train_like_a_reference(
      kSteps,
      {{"ep2", 2, moe_counted_config(kSteps, 2, 1, fp64)}, {"ep2_fsdp2", 4, moe_counted_config(kSteps, 2, 1, fp64)}},
      [fp64](int accumulation) { return moe_counted_config(kSteps, 1, accumulation, fp64); },
      [every_step](const std::filesystem::path& root) {
        expect_same_tokens_per_expert(root, {"ep2", "ep2_fsdp2"}, kSteps, every_step);
      });
}

// The issue's acceptance (label `full`), in float32.
TEST(DistributedMoeFullTest, ExpertParallelAndItsFsdp2TrainLikeOneProcess) {
  expect_ep2_and_its_fsdp2_route_like_one_process(/*fp64=*/false, /*every_step=*/false);
}

// The same in float64 compute (label `full`): no near tie is close enough for the layouts'
// reordering to flip it, so every step's tokens per expert equal one process's.
TEST(DistributedMoeFullTest, InFloat64ExpertParallelRoutesLikeOneProcessAtEveryStep) {
  expect_ep2_and_its_fsdp2_route_like_one_process(/*fp64=*/true, /*every_step=*/true);
}

// A model/parallelized config with every block activation-checkpointed.
std::string activation_checkpointed(const std::string& text) {
  return edited(text, "fully_shard = {",
                "activation_checkpointing = { ac_variant = \"full_activation_checkpointing\", layers_fqn = "
                "\"transformer.h\", ac_fun_params = {} }\nfully_shard = {");
}

// configs/moe/ep_cpu.toml without the auxiliary losses (the cross-entropy alone), with every block
// activation-checkpointed if `ac`.
std::string moe_ep_config_without_aux(int steps, int ep, int accumulation, bool ac) {
  std::string text = moe_ep_config(steps, ep, accumulation);
  text = edited(text, "aux_loss_coef = 0.01", "aux_loss_coef = 0.0");
  text = edited(text, "z_loss_coef = 0.001", "z_loss_coef = 0.0");
  text = edited(text, ", { instance_key = \"moe_aux_loss\", pass_type = \"BY_REFERENCE\" }]", "]");
  text = edited(text, "weights = [1.0, 1.0]", "weights = [1.0]");
  return ac ? activation_checkpointed(text) : text;
}

// Activation checkpointing of the MoE blocks under EP2 (label `full`): every block recomputed in
// backward, its all-to-alls again, on both ranks in the same order, with and without the
// auxiliary losses (which pass through the recomputation: plugins/gpt2, Note [Auxiliary losses
// through a block runner]); each run trains like one process without checkpointing, 20 steps.
TEST(DistributedMoeFullTest, ActivationCheckpointedMoeBlocksUnderExpertParallelismTrainLikeOneProcess) {
  constexpr int kSteps = 20;
  expect_layouts_train_like_a_reference(
      kSteps, {{"ep2_ac", 2, moe_ep_config_without_aux(kSteps, 2, 1, true)}},
      [](int accumulation) { return moe_ep_config_without_aux(kSteps, 1, accumulation, false); });
  expect_layouts_train_like_a_reference(kSteps, {{"ep2_ac_aux", 2, activation_checkpointed(moe_ep_config(kSteps))}},
                                        [](int accumulation) { return moe_ep_config(kSteps, 1, accumulation); });
}

// EP2 x TP2 on 4 ranks (dp_shard 2 x tp 2, ep over dp_shard): tensor parallelism of the attention
// and the dense parts; every MoE block computes whole on both tp ranks, its experts split over ep
// (under sequence parallelism on the sequence gathered for it).
std::string moe_ep_tp_config(int steps, int ep = 2, bool sequence_parallel = false) {
  std::string text = sampled_over_dp_shard(moe_ep_config(steps, ep));
  text = edited(text, fmt::format("expert_parallel_degree = {},", ep),
                fmt::format("expert_parallel_degree = {}, tensor_parallel_degree = 2,", ep));
  return edited(text, "fully_shard = {",
                fmt::format("tensor_parallel = {{ sequence_parallel = {} }}\nfully_shard = {{", sequence_parallel));
}

// EP2 x PP2 on 4 ranks (pp 2 x dp_shard 2, ep over dp_shard; `ep` 1: PP2 alone on 2 ranks): one MoE
// block per stage, 1F1B over pipeline micro-batches of 2 sequences, untied; the first stage's
// auxiliary losses travel to the last stage's loss with the activations (plugins/pipeline, Note
// [Side losses through the pipeline]).
std::string moe_ep_pp_config(int steps, int ep = 2) {
  std::string text = sampled_over_dp_shard(untied(moe_ep_config(steps, ep)));
  text = edited(text, fmt::format("expert_parallel_degree = {},", ep),
                fmt::format("expert_parallel_degree = {}, pipeline_parallel_degree = 2,", ep));
  return edited(text, "fully_shard = {",
                "pipeline = { pp_schedule_name = \"1F1B\", num_layers_per_stage = 2, batch_size = "
                "\"${settings.step_profile.local_train_micro_batch_size}\", microbatch_size = 2, loss_fn = { "
                "instance_key = \"loss_fn\", pass_type = \"BY_REFERENCE\" }, stages_generator = { component_key = "
                "\"stages_generator\", variant_key = \"gpt2_stages_generator\", config = { num_model_layers = "
                "\"${model_raw.config.n_layer}\", input_layer_equivalence = 1, output_layer_equivalence = 1 } } }\n"
                "fully_shard = {");
}

// TP2 with sequence parallelism on the MoE model (2 ranks, no ep dim): the MoE blocks take the
// gathered sequence, and the run trains like one process, with the auxiliary losses; 5 steps.
TEST(DistributedMoeTest, SequenceParallelTensorParallelismTrainsLikeOneProcess) {
  constexpr int kSteps = 5;
  expect_layouts_train_like_a_reference(kSteps, {{"tp2_sp", 2, moe_ep_tp_config(kSteps, 1, true)}},
                                        [](int accumulation) { return moe_ep_config(kSteps, 1, accumulation); });
}

// PP2 on the MoE model with the auxiliary losses (2 ranks, no ep dim): the first stage's losses
// reach the loss of the last, and the run trains like one process; 5 steps.
TEST(DistributedMoeTest, PipelineParallelismCarriesTheAuxiliaryLossesAndTrainsLikeOneProcess) {
  constexpr int kSteps = 5;
  expect_layouts_train_like_a_reference(kSteps, {{"pp2", 2, moe_ep_pp_config(kSteps, 1)}}, [](int accumulation) {
    return untied(moe_ep_config(kSteps, 1, accumulation));
  });
}

// Context parallelism on the MoE model (label full): EP2 x CP2 on 2 ranks (ep over dp_shard x cp)
// against one process, 15 steps. Each cp rank's blocks route and balance its own tokens, so the
// auxiliary losses are per rank (as per data-parallel rank) and the curves are close, not equal:
// measured 7.2e-5 (loss) and 1.3e-3 (grad norm) relative; bounds 1e-3 and 1e-2.
TEST(DistributedMoeFullTest, ContextParallelismTrainsCloseToOneProcess) {
  constexpr int kSteps = 15;
  const modalities::testing::ScratchDir dir;
  const auto root = dir.path() / "experiments";
  const std::string cp = sampled_over_dp_shard(edited(moe_ep_config(kSteps, 2), "expert_parallel_degree = 2,",
                                                      "expert_parallel_degree = 2, context_parallel_degree = 2,"));
  const std::string one = sampled_over_dp_shard(moe_ep_config(kSteps, 1));
  ASSERT_EQ(train(2, dir.write("cp.toml", cp), root, "ep2_cp2").exit_code, 0);
  ASSERT_EQ(train(1, dir.write("one.toml", one), root, "one").exit_code, 0);
  const auto got = curve_of(root, "ep2_cp2"), want = curve_of(root, "one");
  ASSERT_EQ(got.size(), want.size());
  ASSERT_FALSE(got.empty());
  for (std::size_t k = 0; k < got.size(); ++k) {
    std::printf("ep2_cp2 log %zu: loss %.9g (one process %.9g), grad norm %.9g (%.9g)\n", k, got[k].first,
                want[k].first, got[k].second, want[k].second);
    EXPECT_LE(std::abs(got[k].first - want[k].first) / want[k].first, 1e-3);
    EXPECT_LE(std::abs(got[k].second - want[k].second) / want[k].second, 1e-2);
  }
}

// The issue's acceptance (label `full`): EP2 x TP2 (with and without sequence parallelism) and
// EP2 x PP2 (4 ranks each) against one process on the same 8 sequences, 20 steps.
TEST(DistributedMoeFullTest, ExpertParallelWithTensorAndPipelineParallelismTrainsLikeOneProcess) {
  constexpr int kSteps = 20;
  expect_layouts_train_like_a_reference(
      kSteps, {{"ep2_tp2", 4, moe_ep_tp_config(kSteps)}, {"ep2_tp2_sp", 4, moe_ep_tp_config(kSteps, 2, true)}},
      [](int accumulation) { return moe_ep_config(kSteps, 1, accumulation); });
  expect_layouts_train_like_a_reference(kSteps, {{"ep2_pp2", 4, moe_ep_pp_config(kSteps)}}, [](int accumulation) {
    return untied(moe_ep_config(kSteps, 1, accumulation));
  });
}

// What expert parallelism cannot split is a config error on every rank: a dense model, and experts
// that do not divide over the ep ranks.
TEST(DistributedMoeTest, WhatTheExpertParallelRanksCannotSplitIsAConfigError) {
  const modalities::testing::ScratchDir dir;
  expect_refused_on_two_ranks(
      dir, "dense",
      edited(distributed_config("fsdp2_parallelized_cpu.toml", 2), "data_parallel_shard_degree = -1,",
             "data_parallel_shard_degree = -1, expert_parallel_degree = 2,"),
      "has an ep dim of 2 ranks (expert_parallel_degree), but the model has no experts");
  expect_refused_on_two_ranks(dir, "experts", edited(moe_ep_config(2), "num_experts = 4", "num_experts = 3"),
                              "is 3, which is not divisible by the expert-parallel degree 2");
}

// --- pipeline parallel -----------------------------------------------------------------------

// configs/distributed/pp_cpu.toml for a short run with `schedule` (in both pipeline components)
// and `layers_per_stage` (2: two stages, one per rank; 1: four stages, two per rank).
std::string pp_config(int steps, const std::string& schedule = "gpipe", int layers_per_stage = 2,
                      const std::string& file = "pp_cpu.toml", int checkpoint_every = 0) {
  std::string text = distributed_config(file, steps, 1, checkpoint_every);
  for (int k = 0; k < 2; ++k)
    text = edited(text, "pp_schedule_name = \"gpipe\"", "pp_schedule_name = \"" + schedule + "\"");
  return edited(text, "num_layers_per_stage = 2", fmt::format("num_layers_per_stage = {}", layers_per_stage));
}

// Document masking under pipeline parallelism (label full): every stage gets the document ids
// with its input (PipelineSchedule::set_stage_inputs), so PP2 with 1F1B and CP2 x PP2 train like
// one process with the same masking (without weight tying), 20 steps.
TEST(DistributedDocumentMaskingFullTest, PipelineStagesTrainLikeOneProcess) {
  constexpr int kSteps = 20;
  expect_layouts_train_like_one_process(kSteps,
                                        {{"pp2_1f1b_documents", 2, document_masked(pp_config(kSteps, "1F1B"))},
                                         {"cp2_pp2_documents", 4, document_masked(cp_pp_config(kSteps))}},
                                        [](std::string config) { return document_masked(untied(std::move(config))); });
}

// PP4 with 1F1B: one layer-equivalent per stage, so rank 0 holds the embedding alone (no parameter
// with weight decay on that rank: its optimizer group is empty there, not on every rank).
std::string pp4_config(int steps) {
  std::string text = pp_config(steps, "1F1B", 1);
  text = edited(text, "pipeline_parallel_degree = 2", "pipeline_parallel_degree = 4");
  return edited(text, "pp_degree = 2", "pp_degree = 4");
}

// In the default suite, each family of parallelism on 2 ranks against one process on the same
// global batch, 5 steps (above the shortened warm-up of 4), all without weight tying (the pipeline cannot tie across stages; one
// reference serves all): FSDP2, TP2 with sequence parallelism, PP2 with 1F1B (4 pipeline
// micro-batches of 2 samples per step). The full suite (`scripts/test.sh --full`) adds FSDP1 with
// gradient accumulation, loss parallel and every other layout, 20 steps each (*FullTest below);
// the default suite keeps the runs of a few seconds each, for a CI run well under 40 minutes.
TEST(DistributedRunTest, EveryParallelismOnTwoRanksTrainsLikeOneProcess) {
  constexpr int kSteps = 5;
  expect_layouts_train_like_one_process(kSteps,
                                        {{"fsdp2_2", 2, untied(fsdp2_config(kSteps))},
                                         {"tp2_sp", 2, untied(tp_config(kSteps))},
                                         {"pp2_1f1b", 2, pp_config(kSteps, "1F1B")}},
                                        untied);
}

// FSDP1 with gradient accumulation 2 (gradients synchronised once per step) and TP2 with loss
// parallel (vocabulary-split logits into the loss), 8 steps.
TEST(DistributedRunFullTest, AccumulationAndLossParallelOnTwoRanksTrainLikeOneProcess) {
  constexpr int kSteps = 8;
  expect_layouts_train_like_one_process(kSteps,
                                        {{"fsdp1_2_accum2", 2, untied(distributed_config("fsdp1_cpu.toml", kSteps, 2))},
                                         {"tp2_loss_parallel", 2, untied(tp_config(kSteps, false, true))}},
                                        untied);
}

// The staged test backend runs the same Gloo collectives on staged copies of the tensors, so FSDP2
// (all-gathers and reduce-scatters, prefetched) and PP2 with 1F1B (point-to-point work in flight while
// a completer waits for an earlier receive) train bit for bit as with Gloo itself; `dist check` above
// covers the other collectives. A backend that dropped,
// reordered or mixed up a staged buffer would change the curves or hang (caught by the timeout).
TEST(DistributedRunFullTest, TheStagedTestBackendTrainsBitForBitLikeGloo) {
  constexpr int kSteps = 5;  // above the shortened warm-up of 4
  const modalities::testing::ScratchDir dir;
  const auto root = dir.path() / "experiments";
  for (const auto& [id, config] : {std::pair<std::string, std::string>{"fsdp2_2", untied(fsdp2_config(kSteps))},
                                   {"pp2_1f1b", pp_config(kSteps, "1F1B")}}) {
    const auto file = dir.write(id + ".toml", config);
    for (const std::string backend : {"gloo", "staged"}) {
      const CommandResult r = train(2, file, root, id + "_" + backend, 300, backend);
      ASSERT_EQ(r.exit_code, 0) << r;
    }
    const auto gloo = curve_of(root, id + "_gloo");
    ASSERT_EQ(gloo.size(), static_cast<std::size_t>(kSteps)) << id;
    EXPECT_EQ(curve_of(root, id + "_staged"), gloo) << id;
  }
}

// The issue's acceptance (label `full`): PP2 with GPipe, 1F1B, interleaved 1F1B with 2 stages per
// rank and looped BFS, and PP4 with 1F1B (a stage holding only the embedding), 20 steps each.
TEST(DistributedPpFullTest, EveryScheduleTrainsLikeOneProcess) {
  constexpr int kSteps = 20;
  expect_layouts_train_like_one_process(kSteps,
                                        {{"pp2_gpipe", 2, pp_config(kSteps, "gpipe")},
                                         {"pp2_1f1b", 2, pp_config(kSteps, "1F1B")},
                                         {"pp2_interleaved_v2", 2, pp_config(kSteps, "Interleaved1F1B", 1)},
                                         {"pp2_looped_bfs_v2", 2, pp_config(kSteps, "LoopedBFS", 1)},
                                         {"pp4_1f1b", 4, pp4_config(kSteps)}},
                                        untied);
}

// The issue's acceptance (label `full`): PP2 x FSDP2 on 4 ranks (pp 2 x dp_shard 2,
// configs/distributed/pp_fsdp2_cpu.toml), GPipe and 1F1B, 20 steps; and two stages per rank
// (Interleaved1F1B, LoopedBFS: fsdp2_wrapped shards each of a rank's stages with an engine of its own).
TEST(DistributedPpFullTest, PipelineStagesShardedWithFsdp2TrainLikeOneProcess) {
  constexpr int kSteps = 20;
  const auto config = [&](const std::string& schedule, int layers_per_stage) {
    return pp_config(kSteps, schedule, layers_per_stage, "pp_fsdp2_cpu.toml");
  };
  expect_layouts_train_like_one_process(kSteps,
                                        {{"pp2_fsdp2x2_gpipe", 4, config("gpipe", 2)},
                                         {"pp2_fsdp2x2_1f1b", 4, config("1F1B", 2)},
                                         {"pp2_v2_fsdp2x2_interleaved", 4, config("Interleaved1F1B", 1)},
                                         {"pp2_v2_fsdp2x2_looped_bfs", 4, config("LoopedBFS", 1)}},
                                        untied);
}

// What the pipeline cannot run is a config error on every rank: more stages than one per rank for
// GPipe, a micro-batch count that interleaving cannot use, weight tying across stages.
TEST(DistributedPpTest, WhatThePipelineCannotRunIsAConfigError) {
  const modalities::testing::ScratchDir dir;
  const auto refused = [&](const std::string& id, const std::string& config, const std::string& message) {
    expect_refused_on_two_ranks(dir, id, config, message);
  };
  refused("gpipe_4_stages", pp_config(6, "gpipe", 1),
          "gives 4 stages for 2 pipeline ranks, but schedule 'gpipe' runs exactly one stage per rank");
  refused("interleaved_3", edited(pp_config(6, "Interleaved1F1B", 1), "microbatch_size = 2", "microbatch_size = 8"),
          "gives 1 pipeline micro-batches (batch_size 8 / microbatch_size 8); Interleaved1F1B needs a multiple of the "
          "2 pipeline ranks");
  refused("tied", edited(pp_config(6), "use_weight_tying = false", "use_weight_tying = true"),
          "transformer.wte and transformer.lm_head (one shared weight) into different stages");
}

// A dp_degree that is not the data-parallel size (here a literal 1 on 2 ranks) would make every
// token count wrong while training "works": refused before the first step, on every rank.
TEST(DistributedRunTest, ADpDegreeThatDisagreesWithTheMeshIsRefused) {
  const modalities::testing::ScratchDir dir;
  std::string text = fsdp2_config(6);
  const auto begin = text.find("[settings.step_profile.dp_degree]");
  const auto end = text.find("[settings.training_target.num_target_tokens]");
  ASSERT_NE(begin, std::string::npos);
  text.erase(begin, end - begin);
  text.replace(text.find("sequence_length = 128\n"), 22, "sequence_length = 128\ndp_degree = 1\n");
  const auto file = dir.write("bad.toml", text);
  const CommandResult r = launch({"--nproc-per-node", "2", "--grace-s", "5", "--", "run", "--config_file_path",
                                  file.string(), "--experiments_root_path", (dir.path() / "experiments").string()},
                                 120);
  EXPECT_NE(r.exit_code, 0) << r;
  EXPECT_THAT(r.err, HasSubstr("settings.step_profile.dp_degree = 1, but the run's data-parallel size is 2 "
                               "(device_mesh dp_shard 2)"))
      << r;
}

// A world size the data cannot feed is refused on every rank before training: 3 ranks cannot
// split fsdp2_cpu.toml's global batch of 8, and on 2 ranks a target of 10,000 steps needs more
// tokens than the dataset holds.
TEST(DistributedRunTest, AWorldSizeTheDataCannotFeedIsRefusedBeforeTraining) {
  const modalities::testing::ScratchDir dir;
  const auto run_on = [&](int ranks, const std::string& text) {
    const std::string id = fmt::format("feed_{}", ranks);
    return train(ranks, dir.write(id + ".toml", text), dir.path() / "experiments", id, 120);
  };
  const CommandResult three = run_on(3, fsdp2_config(6));
  EXPECT_NE(three.exit_code, 0) << three;
  EXPECT_THAT(three.err,
              HasSubstr("global_batch_size 8 is not divisible by dp_degree 3 x gradient_accumulation_steps 1"))
      << three;
  const CommandResult many = run_on(2, fsdp2_config(10000));
  EXPECT_NE(many.exit_code, 0) << many;
  EXPECT_THAT(many.err, HasSubstr("settings.training_target.num_target_tokens"));
  EXPECT_THAT(many.err, HasSubstr("fewer than num_target_tokens (10240000)")) << many;
  for (const CommandResult* r : {&three, &many}) EXPECT_THAT(r->out, Not(HasSubstr("step: 1 |"))) << *r;
}

// Gradients are reduce-scattered once per optimizer step, at the accumulation boundary, and the
// collective traffic is the theory of docs/distributed.md: with the engine's counters
// (MODALITIES_FSDP_TRAFFIC=1, rank 0 of the shard group), 5 steps on 2 ranks reduce-scatter exactly
// 5 x the model's (padded) bytes with 1 and with 2 micro-batches per step, and all-gather 2 x model
// - root per micro-batch (every unit before its forward, every unit but the root again before its
// backward: the root stays gathered in between).
TEST(DistributedRunTest, GradientsAreReducedOncePerStepAndTheTrafficIsTheTheory) {
  const modalities::testing::ScratchDir dir;
  constexpr int kSteps = 5;  // > the warm-up (4)
  for (const int accumulation : {1, 2}) {
    const std::string id = fmt::format("traffic_g{}", accumulation);
    const auto config = dir.write(id + ".toml", distributed_config("fsdp2_cpu.toml", kSteps, accumulation));
    const CommandResult r =
        run_command({"timeout", "-k", "5", "120", kHost, "launch", "--nproc-per-node", "2", "--grace-s", "5", "--",
                     "run", "--config_file_path", config.string(), "--experiments_root_path",
                     (dir.path() / "experiments").string(), "--experiment_id", id},
                    {{"MODALITIES_PROGRESS", "0"}, {"OMP_NUM_THREADS", "1"}, {"MODALITIES_FSDP_TRAFFIC", "1"}});
    ASSERT_EQ(r.exit_code, 0) << r;
    const auto at = r.err.find("fsdp traffic: ");
    ASSERT_NE(at, std::string::npos) << r;
    double gathered = 0, reduced = 0, model = 0, root = 0;
    ASSERT_EQ(std::sscanf(r.err.c_str() + at,
                          "fsdp traffic: all-gathered %lf bytes, reduce-scattered %lf bytes; model %lf bytes (root "
                          "unit %lf)",
                          &gathered, &reduced, &model, &root),
              4)
        << r;
    std::printf("accumulation %d: all-gathered %.0f B (theory %.0f), reduce-scattered %.0f B (theory %.0f)\n",
                accumulation, gathered, kSteps * accumulation * (2 * model - root), reduced, kSteps * model);
    EXPECT_EQ(reduced, kSteps * model) << "accumulation " << accumulation;
    EXPECT_EQ(gathered, kSteps * accumulation * (2 * model - root)) << "accumulation " << accumulation;
  }
}

// MFU and the parameter count are global: the training report counts every sharded parameter at
// its whole size (the same number on 1 and 2 ranks), and mfu_calculator/gpt2 logs, from the global
// samples/s, samples/s x T x (6N + 12 L T d) / (peak x world size) with that N. A made-up peak of
// 1 GFLOP/s per device keeps the CPU's MFU readable after rounding.
TEST(DistributedRunFullTest, MfuAndTheParameterCountAreGlobal) {
  const modalities::testing::ScratchDir dir;
  const std::string mfu = R"(
[mfu_calculator]
component_key = "mfu_calculator"
variant_key = "gpt2"

[mfu_calculator.config]
n_layer = "${model_raw.config.n_layer}"
sequence_length = "${settings.step_profile.sequence_length}"
n_embd = "${model_raw.config.n_embd}"
world_size = "${settings.cuda_env.world_size}"
model_parts = { instance_key = "model", pass_type = "BY_REFERENCE" }
device_mesh = { instance_key = "device_mesh", pass_type = "BY_REFERENCE" }
peak_flops_per_device = 1e9
)";
  const auto sharded = dir.write("mfu.toml", fsdp2_config(6) + mfu);
  // PP2: each rank holds one stage; the count is summed over the pipeline stages.
  const auto pipelined = dir.write("mfu_pp.toml", distributed_config("pp_cpu.toml", 6) + mfu);
  std::vector<std::int64_t> counts;
  for (const auto& [ranks, file, id] : std::vector<std::tuple<int, std::filesystem::path, std::string>>{
           {1, sharded, "on1"}, {2, sharded, "on2"}, {2, pipelined, "pp2"}}) {
    const CommandResult r = train(ranks, file, dir.path() / "experiments", id);
    ASSERT_EQ(r.exit_code, 0) << r;
    const auto at = r.out.find("trainable parameters: ");
    ASSERT_NE(at, std::string::npos) << r;
    const std::int64_t n = std::stoll(r.out.substr(at + 22));
    counts.push_back(n);
    const double flops_per_token = 6.0 * static_cast<double>(n) + 12.0 * 2 * 128 * 128;
    std::ifstream in(dir.path() / "experiments" / id / "evaluation_results.jsonl");
    int logged = 0;
    for (std::string line; std::getline(in, line);) {
      if (line.find("\"train mfu (16-bit)\"") == std::string::npos) continue;
      const double samples_per_s = number_after(line, "train samples/s");
      const double mfu_value = number_after(line, "train mfu (16-bit)");
      const double expected = samples_per_s * 128 * flops_per_token / (1e9 * ranks);
      std::printf("%s: %.1f samples/s, mfu %.6g, expected %.6g\n", id.c_str(), samples_per_s, mfu_value, expected);
      EXPECT_GT(mfu_value, 0.0);
      EXPECT_NEAR(mfu_value, expected, 1e-5 * expected) << id << ": " << line;
      ++logged;
    }
    EXPECT_EQ(logged, 6) << id;
  }
  // GPT-2 of fsdp2_cpu.toml: 50304 x 128 tied embedding + 2 blocks + final norm; pp_cpu.toml's is
  // untied (pipeline stages cannot share a tensor): one more 50304 x 128 matrix.
  EXPECT_EQ(counts[0], counts[1]);
  EXPECT_GT(counts[0], 50304 * 128);
  EXPECT_EQ(counts[2], counts[0] + 50304 * 128);
}

// Activation checkpointing under FSDP2 (Modalities' order: checkpoint the blocks, then shard) on
// 2 ranks: every logged loss and grad norm is bit for bit that of the same run without it.
TEST(DistributedRunFullTest, ActivationCheckpointingUnderFsdp2OnTwoRanksChangesNoBit) {
  const modalities::testing::ScratchDir dir;
  const std::string plain = fsdp2_config(6);
  // fsdp2_cpu.toml's model has no biases, so selective op keeps projections (Modalities' aten.mm).
  const auto checkpointed = [&](const std::string& variant, const std::string& params) {
    return edited(plain, "[model.config]\nmodel = { instance_key = \"initialized_model\"",
                  "[model.config]\nmodel = { instance_key = \"checkpointed_model\"") +
           fmt::format(R"(
[checkpointed_model]
component_key = "model"
variant_key = "activation_checkpointed"
config = {{ ac_variant = "{}", layers_fqn = "transformer.h", model = {{ instance_key = "initialized_model", pass_type = "BY_REFERENCE" }}, ac_fun_params = {} }}
)",
                       variant, params);
  };
  std::vector<std::vector<std::pair<double, double>>> curves;
  for (const auto& [id, text] : {std::pair<std::string, std::string>{"plain", plain},
                                 {"full", checkpointed("full_activation_checkpointing", "{}")},
                                 {"selective_op", checkpointed("selective_op_activation_checkpointing",
                                                               "{ save_ops_keys = [\"ops.aten.mm.default\"] }")}}) {
    const CommandResult r = train(2, dir.write(id + ".toml", text), dir.path() / "experiments", id);
    ASSERT_EQ(r.exit_code, 0) << r;
    curves.push_back(curve_of(dir.path() / "experiments", id));
  }
  ASSERT_EQ(curves[0].size(), 6u);
  EXPECT_EQ(curves[1], curves[0]) << "full";
  EXPECT_EQ(curves[2], curves[0]) << "selective_op";
}

// A chained-wrapper config of configs/distributed/, its model/parallelized twin, and the ranks both
// run on.
struct Twin {
  std::string chained;
  std::string parallelized;
  int ranks;
};

// Each twin and its chained config train `steps` steps on the same ranks: every logged loss and
// grad norm is the same double (bit for bit), each curve printed.
void expect_twins_train_alike(int steps, const std::vector<Twin>& twins) {
  const modalities::testing::ScratchDir dir;
  const auto root = dir.path() / "experiments";
  for (const Twin& t : twins) {
    std::vector<std::vector<std::pair<double, double>>> curves;
    for (const std::string& file : {t.chained, t.parallelized}) {
      const std::string id = file.substr(0, file.find('.'));
      const CommandResult r = train(t.ranks, dir.write(id + ".toml", distributed_config(file, steps)), root, id);
      ASSERT_EQ(r.exit_code, 0) << file << "\n" << r;
      curves.push_back(curve_of(root, id));
    }
    ASSERT_EQ(curves[0].size(), static_cast<std::size_t>(steps)) << t.chained;
    for (int k = 0; k < steps; ++k)
      std::printf("%-30s step %d  loss %.9g (chained %.9g)  grad norm %.9g (chained %.9g)\n", t.parallelized.c_str(),
                  k + 1, curves[1][k].first, curves[0][k].first, curves[1][k].second, curves[0][k].second);
    EXPECT_EQ(curves[1], curves[0]) << t.parallelized << " vs " << t.chained << " on " << t.ranks << " ranks";
  }
}

// model/parallelized (the initialization and FSDP2 from one node) on 2 ranks: the losses and grad
// norms of fsdp2_cpu.toml's chained wrappers, bit for bit.
TEST(DistributedRunTest, ParallelizedFsdp2TrainsBitForBitLikeTheChainedWrappers) {
  expect_twins_train_alike(5, {{"fsdp2_cpu.toml", "fsdp2_parallelized_cpu.toml", 2}});
}

// Every parallelized twin of configs/distributed/ (issue 32's acceptance, label `full`): FSDP2,
// HSDP 2 x 2, activation checkpointing, FSDP2 2 x TP2, PP2 and PP2 x FSDP2 2, each bit for bit
// like its chained config on the same ranks.
TEST(DistributedParallelizedFullTest, EveryTwinTrainsBitForBitLikeItsChainedConfig) {
  expect_twins_train_alike(6, {{"fsdp2_cpu.toml", "fsdp2_parallelized_cpu.toml", 4},
                               {"hsdp_cpu.toml", "hsdp_parallelized_cpu.toml", 4},
                               {"ac_cpu.toml", "ac_parallelized_cpu.toml", 2},
                               {"tp_cpu.toml", "tp_parallelized_cpu.toml", 4},
                               {"pp_cpu.toml", "pp_parallelized_cpu.toml", 2},
                               {"pp_fsdp2_cpu.toml", "pp_fsdp2_parallelized_cpu.toml", 4}});
}

// bf16 all the way (param_dtype and reduce_dtype BF_16: bf16 gathers, bf16 reduce-scatter over the
// shards and bf16 all-reduce over the replicas) on HSDP 2 x 2 trains like fp32: every logged loss
// within 2% (bf16 has 8 bits of mantissa; measured 1.0%) and grad norm within 3% (measured 0.6%).
TEST(DistributedRunFullTest, Bf16HsdpTrainsLikeFp32) {
  const modalities::testing::ScratchDir dir;
  const std::string fp32 = edited(fsdp2_config(6), "data_parallel_shard_degree = -1,",
                                  "data_parallel_replicate_degree = 2, data_parallel_shard_degree = -1,");
  const std::string bf16 = edited(fp32, R"(param_dtype = "FP_32", reduce_dtype = "FP_32")",
                                  R"(param_dtype = "BF_16", reduce_dtype = "BF_16")");
  std::vector<std::vector<std::pair<double, double>>> curves;
  for (const auto& [id, text] : {std::pair{"fp32", fp32}, std::pair{"bf16", bf16}}) {
    const CommandResult r = train(4, dir.write(std::string(id) + ".toml", text), dir.path() / "experiments", id);
    ASSERT_EQ(r.exit_code, 0) << r;
    curves.push_back(curve_of(dir.path() / "experiments", id));
  }
  ASSERT_EQ(curves[0].size(), 6u);
  ASSERT_EQ(curves[1].size(), 6u);
  for (std::size_t k = 0; k < 6; ++k) {
    std::printf("step %zu: loss fp32 %.4f bf16 %.4f, grad norm fp32 %.4f bf16 %.4f\n", k + 1, curves[0][k].first,
                curves[1][k].first, curves[0][k].second, curves[1][k].second);
    EXPECT_NEAR(curves[1][k].first, curves[0][k].first, 0.02 * curves[0][k].first) << "step " << k + 1;
    EXPECT_NEAR(curves[1][k].second, curves[0][k].second, 0.03 * curves[0][k].second) << "step " << k + 1;
    EXPECT_NE(curves[1][k].first, curves[0][k].first) << "step " << k + 1 << ": bf16 computed nothing in bf16?";
  }
}

// FSDP1's HYBRID_SHARD shards within a node and replicates across nodes: two launchers act as two
// "nodes" of 2 ranks (--nnodes 2, the same rendezvous), and the 4-rank run follows one process on
// the same global batch like the other layouts (within 1e-5 relative; gradient_clipper/fsdp1
// divides the replicas out of its norm).
TEST(DistributedRunFullTest, Fsdp1HybridShardOverTwoLauncherNodesTrainsLikeOneProcess) {
  const modalities::testing::ScratchDir dir;
  constexpr int kSteps = 8;
  const std::string root = (dir.path() / "experiments").string();
  std::string hybrid = distributed_config("fsdp1_cpu.toml", kSteps);
  hybrid.replace(hybrid.find("sharding_strategy = \"FULL_SHARD\""), 32, "sharding_strategy = \"HYBRID_SHARD\"");
  const auto hybrid_file = dir.write("hybrid.toml", hybrid);
  const auto one_file = dir.write("one.toml", fsdp2_config(kSteps));
  const CommandResult one = run_command({"timeout", "-k", "5", "300", kHost, "run", "--config_file_path",
                                         one_file.string(), "--experiments_root_path", root, "--experiment_id", "one"},
                                        {{"MODALITIES_PROGRESS", "0"}, {"OMP_NUM_THREADS", "1"}});
  ASSERT_EQ(one.exit_code, 0) << one;
  const int port = free_port();
  const auto node = [&](int rank) {
    return fmt::format(
        "timeout -k 5 240 {} launch --nnodes 2 --node-rank {} --nproc-per-node 2 --master-port {} "
        "--grace-s 5 -- run --config_file_path {} --experiments_root_path {} --experiment_id hybrid",
        modalities::testing::shell_quote(kHost), rank, port, modalities::testing::shell_quote(hybrid_file.string()),
        modalities::testing::shell_quote(root));
  };
  const CommandResult r = run_command(
      {"sh", "-c", fmt::format("{} & first=$!; {}; second=$?; wait $first; exit $(( $? | second ))", node(0), node(1))},
      {{"MODALITIES_PROGRESS", "0"}, {"OMP_NUM_THREADS", "1"}});
  ASSERT_EQ(r.exit_code, 0) << r;
  const auto ref = logged_losses_and_norms(dir.path() / "experiments/one/evaluation_results.jsonl");
  const auto got = logged_losses_and_norms(dir.path() / "experiments/hybrid/evaluation_results.jsonl");
  ASSERT_EQ(got.size(), ref.size()) << r;
  double loss = 0, norm = 0;
  for (std::size_t k = 0; k < ref.size(); ++k) {
    loss = std::max(loss, std::abs(got[k].first - ref[k].first) / std::abs(ref[k].first));
    norm = std::max(norm, std::abs(got[k].second - ref[k].second) / std::abs(ref[k].second));
  }
  std::printf("HYBRID_SHARD 2 nodes x 2 ranks: worst relative difference to one process: loss %.2e, grad norm %.2e\n",
              loss, norm);
  EXPECT_LE(loss, 1e-5);
  EXPECT_LE(norm, 1e-5);
}

// Modalities' own order: model_raw built on the meta device -> fsdp2_wrapped -> model_initialized
// (Module::apply_to_full_parameters: the initializer runs on gathered, whole tensors). The weights
// must then not depend on the world size: 2 ranks train like 1 process of the same config.
TEST(DistributedRunFullTest, InitializingAfterWrappingAMetaModelGivesTheSameWeightsAtEveryWorldSize) {
  const modalities::testing::ScratchDir dir;
  constexpr int kSteps = 6;
  std::string text = fsdp2_config(kSteps);
  const auto swap = [&](const std::string& from, const std::string& to) { text = edited(std::move(text), from, to); };
  for (std::string::size_type at; (at = text.find("{ instance_key = \"model\", pass_type")) != std::string::npos;)
    text.replace(at, 24, "{ instance_key = \"initialized_model\"");
  swap("[model.config]\nmodel = { instance_key = \"initialized_model\"",
       "[model.config]\nmodel = { instance_key = \"model_raw\"");
  swap("[initialized_model.config]\nmodel = { instance_key = \"model_raw\"",
       "[initialized_model.config]\nmodel = { instance_key = \"model\"");
  swap("use_weight_tying = true", "use_weight_tying = false\nuse_meta_device = true");
  const auto file = dir.write("meta.toml", text);
  for (const int ranks : {1, 2}) {
    const CommandResult r = train(ranks, file, dir.path() / "experiments", fmt::format("on{}", ranks));
    ASSERT_EQ(r.exit_code, 0) << r;
  }
  const auto one = curve_of(dir.path() / "experiments", "on1");
  const auto two = curve_of(dir.path() / "experiments", "on2");
  ASSERT_EQ(one.size(), static_cast<std::size_t>(kSteps));
  ASSERT_EQ(two.size(), one.size());
  for (std::size_t k = 0; k < one.size(); ++k) {
    EXPECT_NEAR(two[k].first, one[k].first, 1e-5 * one[k].first) << "step " << k + 1;
    EXPECT_NEAR(two[k].second, one[k].second, 1e-5 * one[k].second) << "step " << k + 1;
  }
  // The first loss is that of an initialized model (about ln(50304) = 10.8), not of garbage.
  EXPECT_NEAR(one[0].first, 10.8, 0.2);
}

// --- against PyTorch's own FSDP2 ----------------------------------------------------------------

std::string sha256_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(c.data_ptr(), c.nbytes(), md, &len, EVP_sha256(), nullptr);
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) hex += fmt::format("{:02x}", md[i]);
  return hex;
}

std::vector<std::int64_t> shape_of(simdjson::dom::element e) {
  std::vector<std::int64_t> out;
  for (auto d : e.get_array()) out.push_back(d.get_int64());
  return out;
}

// tests/distributed/data/pytorch_fsdp2_reference.json holds the losses of PyTorch's fully_shard
// (torch 2.11, Gloo, CPU; scripts/reference/fsdp2_reference.py) training Modalities' GPT2LLM with
// fsdp2_cpu.toml's model, data, optimizer, scheduler and clipper on 1, 2 and 4 ranks for 20 steps,
// from weights drawn with a seeded generator. This test draws the very same weights (every tensor
// checked against the recorded SHA-256), trains our fsdp2_cpu.toml from them on 1, 2 and 4 ranks,
// and compares every step's loss with PyTorch's at the same world size: within 1e-5 relative. The
// grad norm is compared with the reference's float64 norm of PyTorch's gradients (grad_norm_f64):
// clip_grad_norm_'s own float32 norm of the 6.4M-element embedding gradient is off from it by up to
// 1.5e-3 relative (measured on the sample corpus), ours is computed in float64.
// And with bf16 mixed precision on 2 ranks (param_dtype BF_16, reduce_dtype FP_32 against FSDP2's
// MixedPrecisionPolicy): losses within one bf16 step (8e-3; measured 3.9e-3, most steps equal),
// grad norms within 4e-3 (measured 6.5e-4 where the reference was made; see below). In fp32 the
// grad norms agree within 2e-4 (measured 1.5e-5 to 5.8e-5 at 1, 2 and 4 ranks).
// A world size and precision to compare with PyTorch FSDP2, with the allowed relative differences.
struct PyTorchCase {
  int ranks;
  bool bf16;
  double loss_tolerance, norm_tolerance;
};

void expect_fsdp2_matches_pytorch(const std::vector<PyTorchCase>& cases) {
  const modalities::testing::ScratchDir dir;
  simdjson::dom::parser parser;
  const simdjson::dom::element ref =
      parser.load(std::string(MODALITIES_TEST_SOURCE_ROOT) + "/tests/distributed/data/pytorch_fsdp2_reference.json");
  const simdjson::dom::element init = ref["init"];
  // The initial weights, in the order the reference drew them.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(init["seed"].get_int64()));
  StateDict weights;
  for (auto p : init["parameters"].get_array()) {
    const std::string name(p["name"].get_string().value());
    at::Tensor t = at::empty(shape_of(p["shape"]), at::kFloat);
    if (std::string_view(p["rule"].get_string()) == "normal")
      t.normal_(p["mean"].get_double(), p["std"].get_double(), gen);
    else if (std::string_view(p["kind"].get_string()) == "buffer")  // RoPE: 1 / base^(2i/d), d = n_embd / n_head_q
      t = at::reciprocal(at::pow(100000.0, at::arange(0, 16, 2, at::kFloat) / 16));
    else t.fill_(1.0);  // "unchanged": the norm weights GPT2LLM starts with
    ASSERT_EQ(sha256_of(t), std::string_view(p["sha256"].get_string())) << name;
    weights[name] = t;
  }
  for (auto e : init["state_dict"].get_array()) {
    const std::string name(e["name"].get_string().value());
    std::string_view alias;
    if (!e["alias_of"].get_string().get(alias)) weights[name] = weights.at(std::string(alias)).clone();
    ASSERT_TRUE(weights.contains(name)) << name;
    ASSERT_EQ(sha256_of(weights.at(name)), std::string_view(e["sha256"].get_string())) << name;
  }
  const auto init_file = dir.path() / "init.safetensors";
  formats::write_safetensors(init_file, weights);

  // fsdp2_cpu.toml, its model loaded from init.safetensors instead of initialized.
  std::string config = distributed_config("fsdp2_cpu.toml", 20);
  const auto begin = config.find("[initialized_model]");
  const auto end = config.find("[model_raw]");
  ASSERT_NE(begin, std::string::npos);
  config.replace(begin, end - begin,
                 fmt::format(R"([initialized_model]
component_key = "model"
variant_key = "fsdp1_checkpointed"

[initialized_model.config]
checkpoint_path = "{}"
model = {{ instance_key = "model_raw", pass_type = "BY_REFERENCE" }}
checkpoint_loading = {{ component_key = "checkpoint_loading", variant_key = "torch", config = {{ device = "cpu" }} }}

)",
                             init_file.string()));
  const auto file = dir.write("train.toml", config);
  const auto bf16_file = dir.write("train_bf16.toml", edited(config, R"(param_dtype = "FP_32", reduce_dtype = "FP_32")",
                                                             R"(param_dtype = "BF_16", reduce_dtype = "FP_32")"));
  const std::string root = (dir.path() / "experiments").string();
  for (const PyTorchCase& c : cases) {
    const int ranks = c.ranks;
    const std::string key = fmt::format("{}{}", ranks, c.bf16 ? "_bf16" : "");
    const std::string id = "on" + key;
    const CommandResult r = train(ranks, c.bf16 ? bf16_file : file, root, id);
    ASSERT_EQ(r.exit_code, 0) << r;
    const auto got = curve_of(root, id);
    const simdjson::dom::element run = ref["runs"][key];
    std::vector<double> loss, norm;
    for (auto v : run["loss"].get_array()) loss.push_back(v.get_double());
    simdjson::dom::array norms;
    if (run["grad_norm_f64"].get_array().get(norms) != simdjson::SUCCESS) norms = run["grad_norm"].get_array();
    for (auto v : norms) norm.push_back(v.get_double());
    ASSERT_EQ(got.size(), loss.size()) << r;
    double worst_loss = 0, worst_norm = 0;
    int equal_losses = 0;
    for (std::size_t k = 0; k < loss.size(); ++k) {
      equal_losses += got[k].first == loss[k];
      worst_loss = std::max(worst_loss, std::abs(got[k].first - loss[k]) / std::abs(loss[k]));
      worst_norm = std::max(worst_norm, std::abs(got[k].second - norm[k]) / std::abs(norm[k]));
      std::printf("%s step %2zu  loss %.9g (PyTorch FSDP2 %.9g)  grad norm %.9g (PyTorch %.9g)\n", key.c_str(), k + 1,
                  got[k].first, loss[k], got[k].second, norm[k]);
    }
    std::printf("%d rank(s)%s: worst relative difference to PyTorch FSDP2: loss %.2e, grad norm %.2e\n", ranks,
                c.bf16 ? " bf16" : "", worst_loss, worst_norm);
    EXPECT_LE(worst_loss, c.loss_tolerance) << key;
    // In bf16 both losses are means of bf16 values: most steps agree exactly (an fp32 computation
    // would match none), the others by one bf16 step (2^-7 relative at most).
    if (c.bf16) {
      EXPECT_GE(equal_losses, 10) << key;
    }
    EXPECT_LE(worst_norm, c.norm_tolerance) << key;
  }
}

// In the default suite: fp32 on 2 ranks.
TEST(DistributedRunFullTest, Fsdp2MatchesPyTorchFullyShardOnTwoRanks) {
  expect_fsdp2_matches_pytorch({{2, false, 1e-5, 2e-4}});
}

// Label `full`: fp32 on 1 and 4 ranks, bf16 on 2. The bf16 gradient norms depend on the CPU that
// computes them (LibTorch picks its bf16 kernels by instruction set): PyTorch's own bf16 run on an
// AMD EPYC with AVX512-BF16 (2026-11-27) differed from a reference made on another machine by up
// to 2.4e-3, and ours by 4.3e-4 from that same-CPU PyTorch run; hence 4e-3 (the reference now
// committed, made 2026-11-28 on the sample corpus, agrees with ours within 6.5e-4 on its machine).
TEST(DistributedRunFullTest, Fsdp2MatchesPyTorchFullyShardOnOneAndFourRanksAndInBf16) {
  expect_fsdp2_matches_pytorch({{1, false, 1e-5, 2e-4}, {4, false, 1e-5, 2e-4}, {2, true, 8e-3, 4e-3}});
}

// --- sharded checkpoints ------------------------------------------------------------------

// step -> (train loss avg, grad norm avg) of the training lines of evaluation_results.jsonl.
std::map<int, std::pair<double, double>> logged_steps(const std::filesystem::path& results) {
  std::ifstream in(results);
  std::map<int, std::pair<double, double>> out;
  for (std::string line; std::getline(in, line);)
    if (line.find("\"train loss avg\"") != std::string::npos)
      out[static_cast<int>(number_after(line, "num_train_steps_done"))] = {number_after(line, "train loss avg"),
                                                                           number_after(line, "grad norm avg")};
  return out;
}

// The checkpoint folder of experiment `id` after `step` steps.
std::filesystem::path checkpoint_of(const std::filesystem::path& root, const std::string& id, int step) {
  const std::string marker = fmt::format("-seen_steps_{}-", step);
  for (const auto& e : std::filesystem::directory_iterator(root / id / "checkpoints"))
    if (e.is_directory() && e.path().filename().string().find(marker) != std::string::npos) return e.path();
  throw std::runtime_error(fmt::format("{} has no checkpoint of step {}", id, step));
}

// Training runs of fsdp2_cpu.toml for `steps` steps with a checkpoint every `every` steps, and
// their continuations (warmstart) from a checkpoint on any number of ranks. Every run has the
// global batch 8 (the config derives the micro-batch size from the world size).
// Which configs a run uses: fsdp2_cpu.toml (any world size), tp_cpu.toml (TP2), pp_cpu.toml (PP2),
// cp_cpu.toml (CP2),
// and their _warmstart.toml to continue.
// kPpInterleaved: PP2 with two stages per rank (Interleaved1F1B) sharded with FSDP2 over dp_shard 2
// (pp_fsdp2_cpu.toml, 4 ranks).
enum class Parallelism { kFsdp2, kTp, kPp, kPpInterleaved, kCp };

// step -> sample_ids_hash of data_ledger.jsonl (a later line for the same step wins: the attempt
// that counted), and every step in the order of appearance.
std::pair<std::map<int, std::string>, std::vector<int>> ledger_of(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::map<int, std::string> hashes;
  std::vector<int> order;
  for (std::string line; std::getline(in, line);) {
    const auto step_at = line.find("\"step\": ");
    const auto hash_at = line.find("\"sample_ids_hash\": ");
    if (step_at == std::string::npos || hash_at == std::string::npos) continue;
    const int step = std::stoi(line.substr(step_at + 8));
    hashes[step] = line.substr(hash_at + 19, line.find('}', hash_at) - hash_at - 19);
    order.push_back(step);
  }
  return {hashes, order};
}

class CheckpointRuns {
 public:
  // `untied`: fsdp2_cpu.toml without weight tying (the one-process peer of pp_cpu.toml).
  CheckpointRuns(int steps, int every, bool untied = false) : steps_(steps), root_(dir_.path() / "experiments") {
    const auto fsdp2 = [&](const std::string& file) {
      std::string text = distributed_config(file, steps, 1, every);
      return untied ? edited(text, "use_weight_tying = true", "use_weight_tying = false") : text;
    };
    configs_[Parallelism::kFsdp2] = {dir_.write("train.toml", fsdp2("fsdp2_cpu.toml")),
                                     dir_.write("resume.toml", fsdp2("fsdp2_cpu_warmstart.toml"))};
    configs_[Parallelism::kTp] = {
        dir_.write("train_tp.toml", distributed_config("tp_cpu.toml", steps, 1, every)),
        dir_.write("resume_tp.toml", distributed_config("tp_cpu_warmstart.toml", steps, 1, every))};
    configs_[Parallelism::kCp] = {
        dir_.write("train_cp.toml", distributed_config("cp_cpu.toml", steps, 1, every)),
        dir_.write("resume_cp.toml", distributed_config("cp_cpu_warmstart.toml", steps, 1, every))};
    configs_[Parallelism::kPp] = {
        dir_.write("train_pp.toml", distributed_config("pp_cpu.toml", steps, 1, every)),
        dir_.write("resume_pp.toml", distributed_config("pp_cpu_warmstart.toml", steps, 1, every))};
    // pp_fsdp2_cpu.toml has no warm-start twin: continue_on resumes it with
    // `run --resume_from_checkpoint_info`, which derives the warm-start form itself.
    const auto ppi = dir_.write("train_ppi.toml", pp_config(steps, "Interleaved1F1B", 1, "pp_fsdp2_cpu.toml", every));
    configs_[Parallelism::kPpInterleaved] = {ppi, ppi};
  }

  // Trains experiment `id` from scratch on `ranks` ranks.
  void train_on(int ranks, const std::string& id, Parallelism layout = Parallelism::kFsdp2) {
    const CommandResult r = run_on(ranks, {"run", "--config_file_path", configs_.at(layout).first.string(),
                                           "--experiments_root_path", root_.string(), "--experiment_id", id});
    ASSERT_EQ(r.exit_code, 0) << r;
    ASSERT_EQ(logged_steps(root_ / id / "evaluation_results.jsonl").size(), static_cast<std::size_t>(steps_)) << r;
  }

  // Continues experiment `from`'s checkpoint of `step` on `ranks` ranks as experiment `id`.
  void continue_on(int ranks, const std::string& from, int step, const std::string& id,
                   Parallelism layout = Parallelism::kFsdp2) {
    const auto info = dir_.write(id + "_info.json", fmt::format("{{\"checkpoint_folder_path\": \"{}\"}}\n",
                                                                checkpoint_of(root_, from, step).string()));
    const CommandResult r = layout == Parallelism::kPpInterleaved
                                ? run_on(ranks, {"run", "--config_file_path", configs_.at(layout).second.string(),
                                                 "--experiments_root_path", root_.string(), "--experiment_id", id,
                                                 "--resume_from_checkpoint_info", info.string()})
                                : run_on(ranks, {"warmstart", "--config_file_path", configs_.at(layout).second.string(),
                                                 "--experiments_root_path", root_.string(), "--experiment_id", id,
                                                 "--last_checkpoint_info_file_path", info.string()});
    EXPECT_EQ(r.exit_code, 0) << r;
  }

  // Steps `first`..steps of `id` equal those of the uninterrupted `base` within `tolerance`.
  void compare(const std::string& base_id, const std::string& id, int first, double tolerance) const {
    const auto base = logged_steps(root_ / base_id / "evaluation_results.jsonl");
    const auto got = logged_steps(root_ / id / "evaluation_results.jsonl");
    ASSERT_EQ(got.size(), static_cast<std::size_t>(steps_ - first + 1)) << id;
    const auto rel = [](double a, double b) { return std::abs(a - b) / std::abs(b); };
    double worst = 0;
    for (int k = first; k <= steps_; ++k) {
      ASSERT_TRUE(got.contains(k)) << id << " step " << k;
      worst = std::max({worst, rel(got.at(k).first, base.at(k).first), rel(got.at(k).second, base.at(k).second)});
      std::printf("%-10s step %2d  loss %.9g (uninterrupted %.9g)  grad norm %.9g (uninterrupted %.9g)\n", id.c_str(),
                  k, got.at(k).first, base.at(k).first, got.at(k).second, base.at(k).second);
    }
    std::printf("%-10s worst relative difference %.2e (allowed %.0e)\n", id.c_str(), worst, tolerance);
    EXPECT_LE(worst, tolerance) << id;
    // The data ledger: the continued run (any world size or parallelism) saw the same global
    // batches as the uninterrupted one, step for step.
    const auto base_ledger = ledger_of(root_ / base_id / "data_ledger.jsonl").first;
    const auto ledger = ledger_of(root_ / id / "data_ledger.jsonl").first;
    for (int k = first; k <= steps_; ++k) {
      ASSERT_TRUE(ledger.contains(k) && base_ledger.contains(k)) << id << ": no ledger line for step " << k;
      EXPECT_EQ(ledger.at(k), base_ledger.at(k)) << id << ": step " << k << " saw other samples";
    }
  }

  const std::filesystem::path& root() const { return root_; }

 private:
  CommandResult run_on(int ranks, const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {"timeout", "-k", "5", "300", kHost};
    if (ranks > 1)
      argv.insert(argv.end(), {"launch", "--nproc-per-node", std::to_string(ranks), "--grace-s", "5", "--"});
    argv.insert(argv.end(), args.begin(), args.end());
    return run_command(argv, {{"MODALITIES_PROGRESS", "0"}, {"OMP_NUM_THREADS", "1"}});
  }

  modalities::testing::ScratchDir dir_;
  int steps_;
  std::filesystem::path root_;
  std::map<Parallelism, std::pair<std::filesystem::path, std::filesystem::path>> configs_;  // train, resume
};

// In the default suite: a checkpoint at step 5 of 10 on 2 ranks, continued on 2 ranks bit for bit
// and on 1 rank within 1e-5.
TEST(DistributedCheckpointFullTest, SavedOnTwoRanksContinuesOnTwoAndOne) {
  CheckpointRuns runs(10, 5);
  ASSERT_NO_FATAL_FAILURE(runs.train_on(2, "base"));
  const auto folder = checkpoint_of(runs.root(), "base", 5);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(std::filesystem::exists(folder / fmt::format("rank_{:05d}.safetensors", r)));
  runs.continue_on(2, "base", 5, "on2");
  runs.continue_on(1, "base", 5, "on1");
  runs.compare("base", "on2", 6, 0.0);  // bit for bit
  runs.compare("base", "on1", 6, 1e-5);
}

// A sharded (format v2) checkpoint continued by a model of another shape (MLP width 512 -> 256) is
// refused on every rank, naming the first tensor and both shapes, before any step.
TEST(DistributedCheckpointTest, ACheckpointOfAnotherShapeIsRefusedOnEveryRank) {
  CheckpointRuns runs(6, 3);
  ASSERT_NO_FATAL_FAILURE(runs.train_on(2, "base"));
  const modalities::testing::ScratchDir dir;
  const auto config = dir.write("resume.toml", edited(distributed_config("fsdp2_cpu_warmstart.toml", 6, 1, 3),
                                                      "ffn_hidden = 512", "ffn_hidden = 256"));
  const auto info = dir.write("info.json", fmt::format("{{\"checkpoint_folder_path\": \"{}\"}}\n",
                                                       checkpoint_of(runs.root(), "base", 3).string()));
  const CommandResult r = launch({"--nproc-per-node", "2", "--grace-s", "5", "--", "warmstart", "--config_file_path",
                                  config.string(), "--experiments_root_path", (dir.path() / "experiments").string(),
                                  "--experiment_id", "other_shape", "--last_checkpoint_info_file_path", info.string()},
                                 120);
  EXPECT_NE(r.exit_code, 0) << r;
  for (const int rank : {0, 1}) EXPECT_THAT(r.err, HasSubstr(fmt::format("[rank {}] error: rank {}", rank, rank))) << r;
  EXPECT_THAT(r.err, HasSubstr("was written by a model of a different shape: transformer.h.0.mlp.V.weight is "
                               "[512,128] in the checkpoint, [256,128] in this model"))
      << r;
  EXPECT_THAT(r.out, Not(HasSubstr("step: 4 |"))) << r;
}

// Across tensor-parallel degrees (default suite): a checkpoint of step 3 (of 9) written by TP2 is
// continued on TP2 bit for bit and on one process (no TP: fsdp2_cpu_warmstart.toml) within 1e-5;
// that one process's step-6 checkpoint continues on TP2 within 1e-5 of the uninterrupted run.
TEST(DistributedCheckpointTest, TensorParallelCheckpointsContinueAtAnotherDegreeAndBack) {
  CheckpointRuns runs(9, 3);
  ASSERT_NO_FATAL_FAILURE(runs.train_on(2, "tp2", Parallelism::kTp));
  runs.continue_on(2, "tp2", 3, "tp2_on_tp2", Parallelism::kTp);
  runs.continue_on(1, "tp2", 3, "tp2_on_tp1");
  runs.continue_on(2, "tp2_on_tp1", 6, "tp1_on_tp2", Parallelism::kTp);
  runs.compare("tp2", "tp2_on_tp2", 4, 0.0);  // bit for bit
  runs.compare("tp2", "tp2_on_tp1", 4, 1e-5);
  runs.compare("tp2", "tp1_on_tp2", 7, 1e-5);
}

// Across context-parallel degrees (label full): CP2 trains 9 steps with a checkpoint every 3, on
// the same samples at every step as one process (the data ledger counts each sample once, by the
// cp rank 0 of each dp rank). Its step-3 checkpoint continues on CP2 bit for bit and on one
// process within 1e-5; that process's step-6 checkpoint continues on CP2 within 1e-5 of the
// uninterrupted run.
TEST(DistributedCheckpointFullTest, ContextParallelCheckpointsContinueAtAnotherDegreeAndBack) {
  CheckpointRuns runs(9, 3);
  ASSERT_NO_FATAL_FAILURE(runs.train_on(2, "cp2", Parallelism::kCp));
  ASSERT_NO_FATAL_FAILURE(runs.train_on(1, "one"));
  const auto cp_ledger = ledger_of(runs.root() / "cp2" / "data_ledger.jsonl");
  EXPECT_EQ(cp_ledger.first, ledger_of(runs.root() / "one" / "data_ledger.jsonl").first);
  EXPECT_EQ(cp_ledger.second.size(), 9u);  // one line per step: only one rank of the cp group counts
  runs.continue_on(2, "cp2", 3, "cp2_on_cp2", Parallelism::kCp);
  runs.continue_on(1, "cp2", 3, "cp2_on_cp1");
  runs.continue_on(2, "cp2_on_cp1", 6, "cp1_on_cp2", Parallelism::kCp);
  runs.compare("cp2", "cp2_on_cp2", 4, 0.0);  // bit for bit
  runs.compare("cp2", "cp2_on_cp1", 4, 1e-5);
  runs.compare("cp2", "cp1_on_cp2", 7, 1e-5);
}

// Across pipeline degrees (default suite): a checkpoint of step 3 (of 9) written by PP2 (each rank
// its stage's tensors) is continued on PP2 bit for bit and on one process within 1e-5; that
// process's step-6 checkpoint continues on PP2 within 1e-5 of the uninterrupted run.
TEST(DistributedCheckpointFullTest, PipelineCheckpointsContinueAtAnotherDegreeAndBack) {
  CheckpointRuns runs(9, 3, /*untied=*/true);
  ASSERT_NO_FATAL_FAILURE(runs.train_on(2, "pp2", Parallelism::kPp));
  runs.continue_on(2, "pp2", 3, "pp2_on_pp2", Parallelism::kPp);
  runs.continue_on(1, "pp2", 3, "pp2_on_pp1");
  runs.continue_on(2, "pp2_on_pp1", 6, "pp1_on_pp2", Parallelism::kPp);
  runs.compare("pp2", "pp2_on_pp2", 4, 0.0);  // bit for bit
  runs.compare("pp2", "pp2_on_pp1", 4, 1e-5);
  runs.compare("pp2", "pp1_on_pp2", 7, 1e-5);
}

// FSDP2 x TP2 (tp_cpu.toml on 4 ranks: dp_shard 2 x tp 2; label full): a checkpoint of step 3 (of 9)
// continues at the same layout bit for bit, on TP2 alone (2 ranks) and on one process within 1e-5.
TEST(DistributedCheckpointFullTest, FsdpTimesTpCheckpointsContinueInOtherLayouts) {
  CheckpointRuns runs(9, 3);
  ASSERT_NO_FATAL_FAILURE(runs.train_on(4, "fxt", Parallelism::kTp));
  runs.continue_on(4, "fxt", 3, "fxt_on_fxt", Parallelism::kTp);
  runs.continue_on(2, "fxt", 3, "fxt_on_tp2", Parallelism::kTp);
  runs.continue_on(1, "fxt", 3, "fxt_on_one");
  runs.compare("fxt", "fxt_on_fxt", 4, 0.0);  // bit for bit
  runs.compare("fxt", "fxt_on_tp2", 4, 1e-5);
  runs.compare("fxt", "fxt_on_one", 4, 1e-5);
}

// Two pipeline stages per rank, each sharded with FSDP2 (pp 2 x dp_shard 2 on 4 ranks, Interleaved1F1B;
// label full): a checkpoint of step 3 (of 9) continues at the same layout bit for bit, on one
// process within 1e-5, and that process's step-6 checkpoint on PP2 with 1F1B (one stage per rank,
// no FSDP) within 1e-5. (The optimizer's groups are the same in every layout: those of every part
// are merged.)
TEST(DistributedCheckpointFullTest, InterleavedShardedPipelineCheckpointsContinueInOtherLayouts) {
  CheckpointRuns runs(9, 3, /*untied=*/true);
  ASSERT_NO_FATAL_FAILURE(runs.train_on(4, "ppi", Parallelism::kPpInterleaved));
  runs.continue_on(4, "ppi", 3, "ppi_on_ppi", Parallelism::kPpInterleaved);
  runs.continue_on(1, "ppi", 3, "ppi_on_one");
  runs.continue_on(2, "ppi_on_one", 6, "one_on_pp2", Parallelism::kPp);
  runs.compare("ppi", "ppi_on_ppi", 4, 0.0);  // bit for bit
  runs.compare("ppi", "ppi_on_one", 4, 1e-5);
  runs.compare("ppi", "one_on_pp2", 7, 1e-5);
}

// The issue's acceptance (label `full`): checkpoint at step 10 on 4 ranks; continued on 4 ranks the
// steps 11-20 are bit for bit those of the uninterrupted run, continued on 2 and on 1 rank within
// 1e-5; and back: the 2-rank and 1-rank continuations' step-15 checkpoints continued on 4 ranks.
TEST(DistributedCheckpointFullTest, SavedOnFourRanksContinuesOnFourTwoAndOneAndBack) {
  CheckpointRuns runs(20, 5);
  ASSERT_NO_FATAL_FAILURE(runs.train_on(4, "base"));
  const auto folder = checkpoint_of(runs.root(), "base", 10);
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(std::filesystem::exists(folder / fmt::format("rank_{:05d}.safetensors", r)));
  runs.continue_on(4, "base", 10, "on4");
  runs.continue_on(2, "base", 10, "on2");
  runs.continue_on(1, "base", 10, "on1");
  runs.continue_on(4, "on2", 15, "on2_then4");
  runs.continue_on(4, "on1", 15, "on1_then4");
  runs.compare("base", "on4", 11, 0.0);  // bit for bit
  runs.compare("base", "on2", 11, 1e-5);
  runs.compare("base", "on1", 11, 1e-5);
  runs.compare("base", "on2_then4", 16, 1e-5);
  runs.compare("base", "on1_then4", 16, 1e-5);
}

// Checkpoints across expert-parallel degrees and a kill -9 during an EP run (label `full`): EP2 on 2
// ranks trains 9 steps with a checkpoint every 3. Its step-3 checkpoint continues on one process
// (expert_parallel_degree 1) within 1e-5, and that run's step-6 checkpoint on 4 ranks (EP2 x FSDP2)
// within 1e-5: the checkpoints hold the global expert stack, whatever the degree that wrote them.
// Then `launch --max-restarts 1` kills rank 1 in step 7 (kill -9 in a step of all-to-alls): every
// rank stops, starts again from the step-6 checkpoint, and every step equals the uninterrupted
// run's bit for bit.
TEST(DistributedMoeFullTest, CheckpointsContinueAtOtherExpertDegreesAndAfterAKill) {
  constexpr int kSteps = 9;
  const modalities::testing::ScratchDir dir;
  const std::filesystem::path root = dir.path() / "experiments";
  const auto ep2 = dir.write("ep2.toml", moe_ep_config(kSteps, 2, 1, 3));
  const auto ep1 = dir.write("ep1.toml", moe_ep_config(kSteps, 1, 1, 3));
  // `run` of `config` as `id`, continuing from `info` (its own last checkpoint when empty: a fresh
  // start the first time, the checkpoint before a restart).
  const auto run = [&](int ranks, const std::filesystem::path& config, const std::string& id,
                       std::filesystem::path info, const std::string& fault = "", int max_restarts = 0) {
    if (info.empty()) info = root / id / "checkpoints/last_checkpoint_info.json";
    std::vector<std::string> argv = {"timeout", "-k", "5", "240", kHost};
    if (ranks > 1)
      argv.insert(argv.end(), {"launch", "--nproc-per-node", std::to_string(ranks), "--grace-s", "5", "--max-restarts",
                               std::to_string(max_restarts), "--"});
    argv.insert(argv.end(), {"run", "--config_file_path", config.string(), "--experiments_root_path", root.string(),
                             "--experiment_id", id, "--process_group_timeout_s", "10", "--resume_from_checkpoint_info",
                             info.string()});
    return run_command(argv, {{"MODALITIES_PROGRESS", "0"}, {"OMP_NUM_THREADS", "1"}, {"MODALITIES_FAULT", fault}});
  };
  const auto info_of = [&](const std::string& from, int step) {
    return dir.write(from + fmt::format("_{}_info.json", step),
                     fmt::format("{{\"checkpoint_folder_path\": \"{}\"}}\n", checkpoint_of(root, from, step).string()));
  };
  const CommandResult base = run(2, ep2, "ep2", "");
  ASSERT_EQ(base.exit_code, 0) << base;
  const CommandResult on1 = run(1, ep1, "ep2_on_1", info_of("ep2", 3));
  ASSERT_EQ(on1.exit_code, 0) << on1;
  const CommandResult on4 = run(4, ep2, "ep1_on_4", info_of("ep2_on_1", 6));
  ASSERT_EQ(on4.exit_code, 0) << on4;
  const CommandResult killed = run(2, ep2, "restarted", "", "train_step@1:7", 1);
  ASSERT_EQ(killed.exit_code, 0) << killed;
  EXPECT_THAT(killed.err, HasSubstr("was killed by signal 9 (SIGKILL)"));
  EXPECT_THAT(killed.err, HasSubstr("(restart 1 of 1)"));
  EXPECT_THAT(killed.err, HasSubstr("seen_steps_6-"));

  const auto expected = logged_steps(root / "ep2/evaluation_results.jsonl");
  ASSERT_EQ(expected.size(), static_cast<std::size_t>(kSteps));
  const auto rel = [](double a, double b) { return std::abs(a - b) / std::abs(b); };
  const auto compare = [&](const std::string& id, int first, double tolerance) {
    const auto got = logged_steps(root / id / "evaluation_results.jsonl");
    double worst = 0;
    for (int k = first; k <= kSteps; ++k) {
      ASSERT_TRUE(got.contains(k)) << id << " step " << k;
      worst =
          std::max({worst, rel(got.at(k).first, expected.at(k).first), rel(got.at(k).second, expected.at(k).second)});
      std::printf("%-10s step %d  loss %.9g (EP2 uninterrupted %.9g)  grad norm %.9g (%.9g)\n", id.c_str(), k,
                  got.at(k).first, expected.at(k).first, got.at(k).second, expected.at(k).second);
    }
    std::printf("%-10s worst relative difference %.2e (allowed %.0e)\n", id.c_str(), worst, tolerance);
    EXPECT_LE(worst, tolerance) << id;
  };
  compare("ep2_on_1", 4, 1e-5);
  compare("ep1_on_4", 7, 1e-5);
  compare("restarted", 4, 0.0);  // bit for bit from the checkpoint on
}

// --- failures -----------------------------------------------------------------------------

struct TimedResult {
  CommandResult result;
  double seconds = 0;
};

// `modalities launch` of 2 ranks training configs/distributed/fsdp2_cpu.toml, with
// MODALITIES_FAULT = `fault` (modalities/sdk/fault.h), a 5 s process-group timeout and a launcher
// grace period of `grace_s`.
TimedResult run_with_fault(const modalities::testing::ScratchDir& dir, const std::string& id, const std::string& fault,
                           int steps, int checkpoint_every, int grace_s, int timeout_s = 5) {
  // The timeout comes from the config (settings.process_group_timeout_s), as users set it.
  std::string text = distributed_config("fsdp2_cpu.toml", steps, 1, checkpoint_every);
  const auto settings = text.find("[settings]\n");
  if (settings == std::string::npos) throw std::runtime_error("fsdp2_cpu.toml has no [settings] table");
  text.insert(settings + 11, fmt::format("process_group_timeout_s = {}\n", timeout_s));
  const auto config = dir.write(id + ".toml", text);
  const auto start = std::chrono::steady_clock::now();
  TimedResult t;
  t.result = run_command({"timeout", "-k", "5", "120", kHost, "launch", "--nproc-per-node", "2", "--grace-s",
                          std::to_string(grace_s), "--", "run", "--config_file_path", config.string(),
                          "--experiments_root_path", (dir.path() / "experiments").string(), "--experiment_id", id},
                         {{"MODALITIES_PROGRESS", "0"}, {"OMP_NUM_THREADS", "1"}, {"MODALITIES_FAULT", fault}});
  t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return t;
}

// kill -9 of one rank in the middle of a step (after its backward), rank 0 (which hosts the
// store) and rank 1: the launcher names the rank and the signal and exits with 128 + 9; the other
// rank is out within the process-group timeout (5 s) + 10 s of the failure, as the launcher
// reports it (its grace period is 60 s, so it did not have to SIGKILL it). Measured from the failure, not from the launch: start-up and the
// six steps before it take as long as the CI machine is loaded.
TEST(DistributedFailureTest, ARankKilledMidStepEndsTheRunNamingItOnEveryRank) {
  const modalities::testing::ScratchDir dir;
  for (const int victim : {1, 0}) {
    const TimedResult t =
        run_with_fault(dir, fmt::format("kill{}", victim), fmt::format("train_step@{}:7", victim), 36, 6, 60);
    EXPECT_EQ(t.result.exit_code, 128 + 9) << t.result;
    EXPECT_THAT(t.result.err, HasSubstr(fmt::format("rank {} (pid", victim))) << t.result;
    EXPECT_THAT(t.result.err, HasSubstr("was killed by signal 9 (SIGKILL)")) << t.result;
    ASSERT_THAT(t.result.err, HasSubstr("s after the first failure")) << t.result;
    const std::string marker = "every rank stopped ";
    const double stopped_after = std::stod(t.result.err.substr(t.result.err.find(marker) + marker.size()));
    EXPECT_LT(stopped_after, 5.0 + 10.0) << t.result;
    std::printf("rank %d killed at its 7th micro-batch: every rank stopped %.1f s later (%.1f s from the launch)\n",
                victim, stopped_after, t.seconds);
  }
}

// A rank that hangs (SIGSTOP: alive, but never reaches the next collective) makes the other fail
// with the process-group timeout (5 s), which the launcher reports; the stopped rank is killed
// after the grace period. Total from the launch: start-up + one step + timeout + grace (allowed:
// timeout + 10 s + grace + 5 s). Rank 1 stops at its second micro-batch: every step trained before
// the hang counts against the bound, and on a loaded 2-core machine one step of two ranks takes
// about 1.5 s (at the 7th micro-batch the run took 26 s there).
TEST(DistributedFailureTest, AHungRankMakesTheOthersFailWithinTheTimeout) {
  const modalities::testing::ScratchDir dir;
  const TimedResult t = run_with_fault(dir, "hang", "train_step@1:2=stop", 36, 6, 3);
  EXPECT_NE(t.result.exit_code, 0) << t.result;
  EXPECT_THAT(t.result.err, HasSubstr("rank 0 (pid")) << t.result;
  // From the launch, so start-up (a few seconds, more on a loaded CI machine) is included.
  EXPECT_LT(t.seconds, 5 + 10 + 3 + 5) << t.result;
  std::printf("rank 1 hung at its 2nd micro-batch: the launcher exited after %.1f s (timeout 5 s, grace 3 s)\n",
              t.seconds);
}

// Two ranks started as srun starts them by default: each on its own, nothing stopping the other when
// one dies (no launcher). Returns each rank's standard error and the seconds until both ended.
struct TwoRanksResult {
  std::string err[2];
  double seconds = 0;
};
TwoRanksResult run_two_ranks_without_launcher(const modalities::testing::ScratchDir& dir, const std::string& id,
                                              const std::string& fault, int steps, int checkpoint_every,
                                              int timeout_s) {
  std::string text = distributed_config("fsdp2_cpu.toml", steps, 1, checkpoint_every);
  text.insert(text.find("[settings]\n") + 11, fmt::format("process_group_timeout_s = {}\n", timeout_s));
  const auto config = dir.write(id + ".toml", text);
  std::string script = fmt::format("port={}; ", dist::free_rendezvous_port("127.0.0.1"));
  for (int r = 0; r < 2; ++r)
    script += fmt::format(
        "RANK={0} WORLD_SIZE=2 LOCAL_RANK={0} LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port {1} run "
        "--config_file_path {2} --experiments_root_path {3} --experiment_id {4} 2> {5} & ",
        r, modalities::testing::shell_quote(kHost), modalities::testing::shell_quote(config.string()),
        modalities::testing::shell_quote((dir.path() / "experiments").string()), id,
        modalities::testing::shell_quote((dir.path() / fmt::format("{}_{}.err", id, r)).string()));
  script += "wait";
  const auto start = std::chrono::steady_clock::now();
  run_command({"timeout", "-k", "5", "150", "/bin/sh", "-c", script},
              {{"MODALITIES_PROGRESS", "0"}, {"OMP_NUM_THREADS", "1"}, {"MODALITIES_FAULT", fault}});
  TwoRanksResult out;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int r = 0; r < 2; ++r) {
    std::ifstream in(dir.path() / fmt::format("{}_{}.err", id, r));
    out.err[r].assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return out;
}

// Note [Lost peers]: kill -9 of rank 1 while a checkpoint is written (after its file, before its
// report), with nothing that stops rank 0 (srun's default): rank 0, waiting in the checkpoint
// protocol, names rank 1 and the checkpoint once rank 1's heartbeat has been still for 10 s, instead
// of waiting the whole process-group timeout (60 s here, 600 s by default). kill -9 of rank 0, which
// hosts the store, after writing its manifest: rank 1 names the lost store connection and the
// checkpoint at once, without c10's backtrace.
TEST(DistributedFailureTest, ARankLostWhileACheckpointIsWrittenIsNamedWithinSeconds) {
  const modalities::testing::ScratchDir dir;
  const TwoRanksResult t = run_two_ranks_without_launcher(dir, "lost1", "checkpoint_file_written@1", 12, 3, 60);
  EXPECT_THAT(t.err[0], HasSubstr("error: rank 0: rank 1 was lost while saving checkpoint 'eid_lost1-seen_steps_3-"))
      << t.err[0];
  EXPECT_THAT(t.err[0], HasSubstr("no sign of life from it for 10 s")) << t.err[0];
  EXPECT_THAT(t.err[0], Not(HasSubstr("waitForInput"))) << t.err[0];
  EXPECT_LT(t.seconds, 50.0) << t.err[0];  // start-up, 3 steps and 10 s; not the 60 s timeout
  std::printf("rank 1 killed while saving: rank 0 named it and ended %.1f s after the start\n", t.seconds);
  const TwoRanksResult u = run_two_ranks_without_launcher(dir, "lost0", "checkpoint_manifest_written@0", 12, 3, 60);
  EXPECT_THAT(u.err[1], HasSubstr("error: rank 1: lost the connection to the rendezvous store (hosted by rank 0) "
                                  "while saving checkpoint 'eid_lost0-seen_steps_3-"))
      << u.err[1];
  EXPECT_THAT(u.err[1], Not(HasSubstr("frame #"))) << u.err[1];
  EXPECT_LT(u.seconds, 50.0) << u.err[1];
}

// Note [Lost peers], in a step: kill -9 of rank 1 at its 7th micro-batch (step 7), with nothing
// that stops rank 0 (srun's default). Rank 0's collective fails with Gloo's "Connection closed by
// peer", which names no rank; rank 0 says that rank 1 was lost during step 7 once rank 1's heartbeat
// has been still for 10 s. kill -9 of rank 0 (the store's host): rank 1 names rank 0 at once.
TEST(DistributedFailureTest, ARankLostMidStepIsNamedWithTheStep) {
  const modalities::testing::ScratchDir dir;
  const TwoRanksResult t = run_two_ranks_without_launcher(dir, "mid1", "train_step@1:7", 12, 6, 60);
  EXPECT_THAT(t.err[0], HasSubstr("error: rank 0: rank 1 was lost during step 7: its connection closed (")) << t.err[0];
  EXPECT_THAT(t.err[0], HasSubstr("no sign of life for 10 s")) << t.err[0];
  EXPECT_THAT(t.err[0], Not(HasSubstr("frame #"))) << t.err[0];
  EXPECT_LT(t.seconds, 50.0) << t.err[0];  // start-up, 7 steps and 10 s; not the 60 s timeout
  std::printf("rank 1 killed mid-step: rank 0 named it and ended %.1f s after the start\n", t.seconds);
  const TwoRanksResult u = run_two_ranks_without_launcher(dir, "mid0", "train_step@0:7", 12, 6, 60);
  EXPECT_THAT(u.err[1], HasSubstr("error: rank 1: rank 0 was lost during step 7: its connection closed")) << u.err[1];
  EXPECT_THAT(u.err[1], Not(HasSubstr("frame #"))) << u.err[1];
  EXPECT_LT(u.seconds, 50.0) << u.err[1];
}

// A NaN loss on one rank only (rank 1, step 5): every rank stops with the error naming step 5 at
// the next check (a log step), instead of rank 1 leaving and rank 0 waiting for it until the
// (60 s) timeout; nothing is checkpointed after it.
TEST(DistributedFailureTest, ANanOnOneRankStopsEveryRankAtTheSameStep) {
  const modalities::testing::ScratchDir dir;
  // A 60 s timeout: had rank 0 waited for rank 1, the run would take over a minute.
  const TimedResult t = run_with_fault(dir, "nan", "train_loss_nan@1:5=flag", 12, 6, 30, 60);
  EXPECT_NE(t.result.exit_code, 0) << t.result;
  for (int rank : {0, 1})
    EXPECT_THAT(t.result.err, HasSubstr(fmt::format("[rank {}] error: rank {}: the training loss or gradient norm "
                                                    "became NaN/inf at step 5",
                                                    rank, rank)))
        << t.result;
  EXPECT_LT(t.seconds, 30.0) << t.result;  // no rank waited for the timeout
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "experiments/nan/checkpoints/last_checkpoint_info.json"));
}

// kill -9 of rank 1 while the step-6 checkpoint is being written (after its file is on disk, before
// rank 0 commits the folder): no step-6 folder appears, last_checkpoint_info.json still names step
// 3, and continuing from it reproduces steps 4-12 of an uninterrupted run bit for bit.
// Killed at two moments of the step-6 save: rank 1 after writing its file (the others wait for it),
// and rank 0 (the committer, which also hosts the store) after writing the manifest into the hidden
// folder, just before the rename that publishes it. Either way the step-3 checkpoint stays the
// last one and resumes bit for bit.
TEST(DistributedFailureFullTest, ARankKilledDuringACheckpointWriteLeavesThePreviousOneToResume) {
  const modalities::testing::ScratchDir dir;
  const std::filesystem::path root = dir.path() / "experiments";
  const TimedResult full = run_with_fault(dir, "full", "", 12, 3, 5);
  ASSERT_EQ(full.result.exit_code, 0) << full.result;
  const auto expected = logged_steps(root / "full/evaluation_results.jsonl");
  for (const auto& [fault, rank] : std::vector<std::pair<std::string, int>>{{"checkpoint_file_written@1:2", 1},
                                                                            {"checkpoint_manifest_written@0:2", 0}}) {
    SCOPED_TRACE(fault);
    const std::string id = fmt::format("killed_rank{}", rank);
    const TimedResult t = run_with_fault(dir, id, fault, 12, 3, 5);
    EXPECT_EQ(t.result.exit_code, 128 + 9) << t.result;
    EXPECT_THAT(t.result.err, HasSubstr(fmt::format("rank {} (pid", rank))) << t.result;
    const std::filesystem::path checkpoints = root / id / "checkpoints";
    bool unfinished = false;  // the hidden temporary folder of the interrupted save
    for (const auto& e : std::filesystem::directory_iterator(checkpoints)) {
      const std::string name = e.path().filename().string();
      if (name.starts_with(".")) unfinished = unfinished || name.find("seen_steps_6-") != std::string::npos;
      else EXPECT_EQ(name.find("seen_steps_6-"), std::string::npos) << e.path();
    }
    EXPECT_TRUE(unfinished);
    std::ifstream in(checkpoints / "last_checkpoint_info.json");
    const std::string info((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_THAT(info, HasSubstr("seen_steps_3-")) << info;

    const auto resume = dir.write("resume.toml", distributed_config("fsdp2_cpu_warmstart.toml", 12, 1, 3));
    const CommandResult r =
        launch({"--nproc-per-node", "2", "--grace-s", "5", "--", "warmstart", "--config_file_path", resume.string(),
                "--experiments_root_path", root.string(), "--experiment_id", "resumed_" + id,
                "--last_checkpoint_info_file_path", (checkpoints / "last_checkpoint_info.json").string()},
               120);
    ASSERT_EQ(r.exit_code, 0) << r;
    const auto got = logged_steps(root / ("resumed_" + id) / "evaluation_results.jsonl");
    ASSERT_EQ(got.size(), 9u) << r;
    for (int k = 4; k <= 12; ++k) {
      ASSERT_TRUE(got.contains(k)) << k;
      EXPECT_EQ(got.at(k), expected.at(k)) << "step " << k;
    }
  }
}

// --- restarts and the data ledger ---------------------------------------------------------

// `modalities launch --max-restarts 1`: rank 1 is killed at step 8 (after the step-6 checkpoint);
// every rank starts again, `run --resume_from_checkpoint_info` continues from step 6, and the run
// ends with exit 0. The data ledger shows steps 7 and 8 twice (trained again after the restart)
// with the same hashes, and every step's hash equals the uninterrupted run's (also at another
// world size: the global batch, not its split over ranks, is hashed): no sample skipped or repeated.
TEST(DistributedRestartFullTest, MaxRestartsResumesFromTheLastCheckpointAndTheLedgerProvesTheData) {
  const modalities::testing::ScratchDir dir;
  const std::filesystem::path root = dir.path() / "experiments";
  const auto config = dir.write("train.toml", distributed_config("fsdp2_cpu.toml", 12, 1, 3));
  const auto run = [&](int ranks, const std::string& id, const std::string& fault, int max_restarts) {
    return run_command({"timeout",
                        "-k",
                        "5",
                        "240",
                        kHost,
                        "launch",
                        "--nproc-per-node",
                        std::to_string(ranks),
                        "--grace-s",
                        "5",
                        "--max-restarts",
                        std::to_string(max_restarts),
                        "--",
                        "run",
                        "--config_file_path",
                        config.string(),
                        "--experiments_root_path",
                        root.string(),
                        "--experiment_id",
                        id,
                        "--process_group_timeout_s",
                        "10",
                        "--resume_from_checkpoint_info",
                        (root / id / "checkpoints/last_checkpoint_info.json").string()},
                       {{"MODALITIES_PROGRESS", "0"}, {"OMP_NUM_THREADS", "1"}, {"MODALITIES_FAULT", fault}});
  };
  const CommandResult full = run(2, "full", "", 0);
  ASSERT_EQ(full.exit_code, 0) << full;
  EXPECT_THAT(full.err, HasSubstr("starting fresh"));
  const CommandResult four = run(4, "four", "", 0);
  ASSERT_EQ(four.exit_code, 0) << four;
  const CommandResult r = run(2, "restarted", "train_step@1:8", 1);
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.err, HasSubstr("rank 1 (pid"));
  EXPECT_THAT(r.err, HasSubstr("was killed by signal 9 (SIGKILL)"));
  EXPECT_THAT(r.err, HasSubstr("(restart 1 of 1)"));
  EXPECT_THAT(r.err, HasSubstr("resuming from checkpoint"));
  EXPECT_THAT(r.err, HasSubstr("seen_steps_6-"));

  const auto [expected, expected_order] = ledger_of(root / "full/data_ledger.jsonl");
  const auto [on4, on4_order] = ledger_of(root / "four/data_ledger.jsonl");
  const auto [got, got_order] = ledger_of(root / "restarted/data_ledger.jsonl");
  ASSERT_EQ(expected.size(), 12u);
  EXPECT_EQ(on4, expected);  // 4 ranks x 2 samples hash like 2 ranks x 4
  EXPECT_EQ(got, expected);
  // The first attempt logged steps 1..7 (it died in step 8), the second 7..12.
  EXPECT_EQ(got_order, (std::vector<int>{1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 10, 11, 12}));
  for (const auto& [step, hash] : expected) EXPECT_NE(hash, "null") << step;
  // And the losses after the restart are the uninterrupted run's.
  const auto losses = logged_steps(root / "full/evaluation_results.jsonl");
  const auto resumed = logged_steps(root / "restarted/evaluation_results.jsonl");
  for (int k = 9; k <= 12; ++k) EXPECT_EQ(resumed.at(k), losses.at(k)) << "step " << k;
}

// --- CoCa (plugins/coca) ---------------------------------------------------------------------

// configs/coca/train_cpu.toml (a tiny CoCa, FSDP2, seeded dummy images and captions, 8 samples per
// step) for a short run.
std::string coca_config(int steps, int accumulation = 1, int checkpoint_every = 0) {
  return short_run_config("coca/train_cpu.toml", 80, steps, accumulation, checkpoint_every);
}

// FSDP2's prefetching on a model whose graph branches (CoCa's image and text towers: the blocks'
// backwards do not run in the reverse unit order): a backward prefetch its pass does not consume
// is dropped before the optimizer step, so training is bit for bit that without prefetching. (It
// used to survive into the next forward with the shards of before the step.)
TEST(DistributedCocaTest, Fsdp2PrefetchingChangesNoBitOnABranchingModel) {
  constexpr int kSteps = 5;  // above the shortened warm-up of 4
  const modalities::testing::ScratchDir dir;
  const auto root = dir.path() / "experiments";
  const std::string config = coca_config(kSteps);
  const CommandResult r = train(1, dir.write("prefetch.toml", config), root, "prefetch");
  ASSERT_EQ(r.exit_code, 0) << r;
  ASSERT_EQ(train(1,
                  dir.write("no_prefetch.toml", edited(config, "reshard_after_forward = true\n",
                                                       "reshard_after_forward = true\nprefetch = false\n")),
                  root, "no_prefetch")
                .exit_code,
            0);
  const auto with = curve_of(root, "prefetch"), without = curve_of(root, "no_prefetch");
  ASSERT_EQ(with.size(), static_cast<std::size_t>(kSteps));
  EXPECT_EQ(with, without);
}

// The issue's acceptance (label full): the tiny CoCa under FSDP2 on 2 ranks trains like one process
// on the same global batch for 5 steps, and a run resumed from its step-3 checkpoint on 2 ranks
// (`run --resume_from_checkpoint_info`) repeats steps 4-6 bit for bit.
TEST(DistributedCocaFullTest, Fsdp2OnTwoRanksTrainsLikeOneProcessAndResumesBitForBit) {
  constexpr int kSteps = 5;
  expect_layouts_train_like_a_reference(kSteps, {{"coca_fsdp2_2", 2, coca_config(kSteps)}},
                                        [](int accumulation) { return coca_config(kSteps, accumulation); });

  const modalities::testing::ScratchDir dir;
  const auto root = dir.path() / "experiments";
  const auto config = dir.write("coca.toml", coca_config(6, 1, 3));
  ASSERT_EQ(train(2, config, root, "base").exit_code, 0);
  const auto info = dir.write(
      "info.json", fmt::format("{{\"checkpoint_folder_path\": \"{}\"}}\n", checkpoint_of(root, "base", 3).string()));
  const CommandResult r = train(2, config, root, "resumed", 300, "", {"--resume_from_checkpoint_info", info.string()});
  ASSERT_EQ(r.exit_code, 0) << r;
  const auto base = logged_steps(root / "base" / "evaluation_results.jsonl");
  const auto resumed = logged_steps(root / "resumed" / "evaluation_results.jsonl");
  for (int k = 4; k <= 6; ++k) {
    ASSERT_TRUE(resumed.contains(k) && base.contains(k)) << "step " << k;
    EXPECT_EQ(resumed.at(k), base.at(k)) << "step " << k;
  }
}

}  // namespace
}  // namespace modalities::dist
