// `modalities launch`: the single-node (or static multi-node) launcher, torchrun's env contract
// without Python. Spawns one process per rank with RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT set, prefixes every line of their
// output with the rank, forwards SIGINT/SIGTERM/SIGHUP to every rank, and when one rank fails
// stops the others (SIGTERM, then SIGKILL after a grace period) and exits with that rank's status.
//
// fork + exec rather than posix_spawn: the child must leave the launcher's process group (so a
// Ctrl-C reaches the ranks once, through the launcher) and die with the launcher
// (PR_SET_PDEATHSIG), which posix_spawn cannot express portably. Between fork and exec the
// child calls only async-signal-safe functions.
#include "cli.h"

#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>

#include <fmt/core.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace modalities::cli {
namespace {

constexpr const char* kLaunchUsage = R"(usage: modalities launch --nproc-per-node N [options] -- <command> [<args>]

Starts N ranks of `modalities <command> <args>` on this node (or of any program with --exec),
with the environment torchrun gives its workers: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT (a free port unless given).
Every output line is prefixed with its rank. Ctrl-C / SIGTERM reach every rank; when one rank
fails, the others get SIGTERM (SIGKILL after --grace-s) and the launcher exits with the failed
rank's status (128 + signal for a rank killed by a signal). With --max-restarts N, a failed
attempt is followed by up to N more, every rank started again (the command must resume itself).

Examples:
  modalities launch --nproc-per-node 4 -- run --config_file_path configs/distributed/fsdp2_cpu.toml --experiments_root_path out
  modalities launch --nproc-per-node 2 -- dist check
  modalities launch --nproc-per-node 2 --exec -- env      # any program: here, print each rank's env
  modalities launch --nproc-per-node 4 --max-restarts 3 -- run --config_file_path c.toml --experiments_root_path out \
      --experiment_id x --resume_from_checkpoint_info out/x/checkpoints/last_checkpoint_info.json

Several nodes without SLURM: run the same command on every node with --nnodes, --node-rank and
--master-addr/--master-port of node 0 (docs/distributed.md).)";

struct LaunchOptions {
  int nproc_per_node = 0;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::string output = "all";
  double grace_s = 10.0;
  bool exec = false;
  int max_restarts = 0;
  int restart = 0;  // this attempt: 0, then 1 .. max_restarts
  std::vector<std::string> command;
};

volatile sig_atomic_t g_signal = 0;
int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  g_signal = sig;
  const char byte = 1;
  [[maybe_unused]] const ssize_t n = write(g_signal_pipe[1], &byte, 1);
}

// A port for rank 0's store (Note [Rendezvous port] in the SDK's distributed.cpp).
int free_port(const std::string& addr) {
  try {
    return dist::free_rendezvous_port(addr);
  } catch (const Error& e) {
    throw Error(fmt::format("launch: {} (give --master-port)", e.what()));
  }
}

std::string self_exe() {
  std::vector<char> buf(4096);
  const ssize_t n = readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) throw Error("launch: cannot find the modalities binary (/proc/self/exe)");
  return std::string(buf.data(), static_cast<std::size_t>(n));
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return fmt::format("was killed by signal {} (SIG{})", sig, name ? name : "?");
  }
  return fmt::format("ended with wait status {}", status);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return kFailed;
}

// One rank's output stream: bytes are cut into lines ('\n', or '\r' for progress bars) and
// written with the rank prefix, so lines of different ranks never interleave mid-line.
struct Stream {
  int fd = -1;
  int out_fd = 1;  // 1 or 2 of the launcher
  bool show = true;
  std::string pending;
};

struct Rank {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  Stream out, err;
  bool running = false;
  int status = 0;
};

void write_all(int fd, std::string_view s) {
  while (!s.empty()) {
    const ssize_t n = write(fd, s.data(), s.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    s.remove_prefix(static_cast<std::size_t>(n));
  }
}

void emit(Stream& s, const std::string& prefix, bool flush_all) {
  std::size_t start = 0;
  while (true) {
    const std::size_t end = s.pending.find_first_of("\n\r", start);
    if (end == std::string::npos) break;
    if (s.show) {
      std::string line;
      line.reserve(prefix.size() + end - start + 1);
      line += prefix;
      line.append(s.pending, start, end - start);
      line += s.pending[end];
      write_all(s.out_fd, line);
    }
    start = end + 1;
  }
  s.pending.erase(0, start);
  if (flush_all && !s.pending.empty()) {
    if (s.show) write_all(s.out_fd, prefix + s.pending + "\n");
    s.pending.clear();
  }
}

void drain(Stream& s, const std::string& prefix) {
  char buf[65536];
  while (s.fd >= 0) {
    const ssize_t n = read(s.fd, buf, sizeof(buf));
    if (n > 0) {
      s.pending.append(buf, static_cast<std::size_t>(n));
      emit(s, prefix, false);
      if (static_cast<std::size_t>(n) < sizeof(buf)) return;
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    close(s.fd);  // EOF or error
    s.fd = -1;
    emit(s, prefix, true);
  }
}

std::vector<std::string> child_environment(const LaunchOptions& o, int rank, int local_rank, int world_size) {
  const std::map<std::string, std::string> set = {
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"WORLD_SIZE", std::to_string(world_size)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
      {"GROUP_RANK", std::to_string(o.node_rank)},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(o.master_port)},
      {"MODALITIES_RESTART_COUNT", std::to_string(o.restart)},
  };
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string key = entry.substr(0, entry.find('='));
    if (!set.contains(key)) env.push_back(entry);
  }
  for (const auto& [k, v] : set) env.push_back(k + "=" + v);
  // One rank per core group: LibTorch sizes its intra-op pool from OMP_NUM_THREADS. Like
  // torchrun, do not let N ranks each start a pool of every core.
  if (std::getenv("OMP_NUM_THREADS") == nullptr && o.nproc_per_node > 1) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    env.push_back(fmt::format("OMP_NUM_THREADS={}", std::max(1u, cores / static_cast<unsigned>(o.nproc_per_node))));
  }
  return env;
}

void spawn(Rank& r, const LaunchOptions& o, const std::string& program, int world_size) {
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0)
    throw Error(fmt::format("launch: cannot create pipes for rank {}: {}", r.rank, std::strerror(errno)));
  // Everything the child needs is prepared before fork.
  std::vector<std::string> args;
  args.push_back(program);
  args.insert(args.end(), o.command.begin() + (o.exec ? 1 : 0), o.command.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env = child_environment(o, r.rank, r.local_rank, world_size);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const std::string exec_failed = fmt::format("[rank {}] launch: cannot execute '{}'\n", r.rank, program);
  const pid_t parent = getpid();

  const pid_t pid = fork();
  if (pid < 0) throw Error(fmt::format("launch: fork failed for rank {}: {}", r.rank, std::strerror(errno)));
  if (pid == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    dup2(out[1], 1);
    dup2(err[1], 2);
    if (program.find('/') == std::string::npos) execvpe(program.c_str(), argv.data(), envp.data());
    else execve(program.c_str(), argv.data(), envp.data());
    [[maybe_unused]] const ssize_t n = write(2, exec_failed.data(), exec_failed.size());
    _exit(127);
  }
  close(out[1]);
  close(err[1]);
  fcntl(out[0], F_SETFL, fcntl(out[0], F_GETFL) | O_NONBLOCK);
  fcntl(err[0], F_SETFL, fcntl(err[0], F_GETFL) | O_NONBLOCK);
  r.pid = pid;
  r.running = true;
  r.out = Stream{out[0], 1, o.output == "all" || r.rank == 0, {}};
  r.err = Stream{err[0], 2, true, {}};  // every rank's errors are shown
}

void signal_all(std::vector<Rank>& ranks, int sig) {
  for (const Rank& r : ranks)
    if (r.running) kill(-r.pid, sig);
}

int supervise(std::vector<Rank>& ranks, const LaunchOptions& o) {
  using Clock = std::chrono::steady_clock;
  std::optional<int> result;
  std::optional<Clock::time_point> kill_at;
  std::optional<Clock::time_point> first_failure;
  std::optional<Clock::time_point> all_exited;
  bool killed = false;
  const auto stop_others = [&](int sig) {
    signal_all(ranks, sig);
    if (!kill_at) kill_at = Clock::now() + std::chrono::milliseconds(static_cast<long>(o.grace_s * 1000));
  };
  const auto note = [](const std::string& message) { write_all(2, "[launch] " + message + "\n"); };

  while (true) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Stream*, const Rank*>> owners;
    for (Rank& r : ranks)
      for (Stream* s : {&r.out, &r.err})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          owners.emplace_back(s, &r);
        }
    fds.push_back({g_signal_pipe[0], POLLIN, 0});
    const bool any_running = std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.running; });
    if (!any_running && owners.empty()) break;
    // Every rank has exited but something still holds an output pipe open: a child a rank left
    // behind (e.g. a shell's background job, which ignores SIGINT). After 2 s of draining, kill
    // what is left in the ranks' process groups and stop reading, instead of waiting for it.
    if (!any_running) {
      if (!all_exited) all_exited = Clock::now();
      if (Clock::now() - *all_exited > std::chrono::seconds(2)) {
        note("every rank has exited; killing the processes they left behind, which still held their output open");
        for (const Rank& r : ranks) kill(-r.pid, SIGKILL);
        for (Rank& r : ranks)
          for (Stream* st : {&r.out, &r.err})
            if (st->fd >= 0) {
              drain(*st, fmt::format("[rank {}] ", r.rank));
              if (st->fd >= 0) {
                close(st->fd);
                st->fd = -1;
                emit(*st, fmt::format("[rank {}] ", r.rank), true);
              }
            }
        break;
      }
    }
    poll(fds.data(), fds.size(), 100);
    for (std::size_t k = 0; k < owners.size(); ++k)
      if (fds[k].revents != 0) drain(*owners[k].first, fmt::format("[rank {}] ", owners[k].second->rank));
    if (fds.back().revents != 0) {
      char buf[64];
      while (read(g_signal_pipe[0], buf, sizeof(buf)) > 0) {
      }
      const int sig = g_signal;
      note(fmt::format("received SIG{}, forwarding it to every rank", sigabbrev_np(sig) ? sigabbrev_np(sig) : "?"));
      if (!result) result = 128 + sig;
      signal_all(ranks, sig);
      if (!kill_at) kill_at = Clock::now() + std::chrono::milliseconds(static_cast<long>(o.grace_s * 1000));
    }
    int status = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
      for (Rank& r : ranks) {
        if (r.pid != pid || !r.running) continue;
        r.running = false;
        r.status = status;
        const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (failed && !result) {
          result = exit_code_of(status);
          first_failure = Clock::now();
          note(fmt::format("rank {} (pid {}) {}; stopping the other ranks", r.rank, r.pid, describe_status(status)));
          stop_others(SIGTERM);
        } else if (failed && !killed) {
          note(fmt::format("rank {} (pid {}) {}", r.rank, r.pid, describe_status(status)));
        }
      }
    }
    if (kill_at && !killed && Clock::now() >= *kill_at) {
      const bool left = std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.running; });
      if (left) note(fmt::format("ranks still running after {} s: sending SIGKILL", o.grace_s));
      signal_all(ranks, SIGKILL);
      killed = true;
    }
  }
  if (first_failure)
    note(fmt::format("every rank stopped {:.1f} s after the first failure",
                     std::chrono::duration<double>(Clock::now() - *first_failure).count()));
  return result.value_or(kOk);
}

}  // namespace

int run_launch(const std::vector<std::string>& all_args) {
  const auto dashes = std::find(all_args.begin(), all_args.end(), "--");
  const std::vector<std::string> args(all_args.begin(), dashes);
  LaunchOptions o;
  if (dashes != all_args.end()) o.command.assign(dashes + 1, all_args.end());

  po::options_description desc("Options");
  desc.add_options()("help,h", "this help")("nproc-per-node", po::value<int>(&o.nproc_per_node)->required(),
                                            "ranks on this node")("nnodes", po::value<int>(&o.nnodes)->default_value(1),
                                                                  "nodes of the run (each runs this command)")(
      "node-rank", po::value<int>(&o.node_rank)->default_value(0), "this node's index in [0, nnodes)")(
      "master-addr", po::value<std::string>(&o.master_addr)->default_value("127.0.0.1"),
      "address of node 0, where rank 0 hosts the rendezvous store")(
      "master-port", po::value<int>(&o.master_port)->default_value(0),
      "port of the rendezvous store; 0: a free port (one node only)")(
      "output", po::value<std::string>(&o.output)->default_value("all"),
      "whose standard output to show: all (each line prefixed with [rank N]) or rank0 (errors of every rank are "
      "always shown)")("grace-s", po::value<double>(&o.grace_s)->default_value(10.0),
                       "seconds between SIGTERM and SIGKILL when stopping the ranks")(
      "exec", po::bool_switch(&o.exec), "the command is a program and its arguments, not a modalities command")(
      "max-restarts", po::value<int>(&o.max_restarts)->default_value(0),
      "when a rank fails, stop all, then start every rank again, up to this many times (one node only); the "
      "command must resume by itself, e.g. `run --resume_from_checkpoint_info "
      "<checkpoints>/last_checkpoint_info.json`; "
      "each attempt gets MODALITIES_RESTART_COUNT and a new free port");
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, {}, vm, kLaunchUsage, status)) return status;
  const auto usage_error = [&](const std::string& message) {
    print_error(fmt::format("launch: {} (try `modalities launch --help`)", message));
    return kUsage;
  };
  if (o.command.empty()) return usage_error("no command after `--`, e.g. `-- run --config_file_path c.toml`");
  if (o.nproc_per_node < 1) return usage_error(fmt::format("--nproc-per-node must be >= 1, got {}", o.nproc_per_node));
  if (o.nnodes < 1) return usage_error(fmt::format("--nnodes must be >= 1, got {}", o.nnodes));
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    return usage_error(fmt::format("--node-rank must be in [0, {}), got {}", o.nnodes, o.node_rank));
  if (o.output != "all" && o.output != "rank0")
    return usage_error(fmt::format("--output must be all or rank0, got '{}'", o.output));
  if (o.master_port < 0 || o.master_port > 65535)
    return usage_error(fmt::format("--master-port must be a TCP port, got {}", o.master_port));
  if (o.master_port == 0 && o.nnodes > 1) return usage_error("several nodes need the same --master-port on every node");
  if (o.grace_s < 0) return usage_error("--grace-s must not be negative");
  if (o.max_restarts < 0) return usage_error(fmt::format("--max-restarts must be >= 0, got {}", o.max_restarts));
  if (o.max_restarts > 0 && o.nnodes > 1)
    return usage_error("--max-restarts works on one node only (several nodes would have to agree on each restart)");
  const bool pick_port = o.master_port == 0;
  if (pick_port) o.master_port = free_port(o.master_addr);
  const std::string program = o.exec ? o.command.front() : self_exe();
  const int world_size = o.nnodes * o.nproc_per_node;

  if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
    throw Error(fmt::format("launch: cannot create a pipe: {}", std::strerror(errno)));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  for (;; ++o.restart) {
    std::vector<Rank> ranks(static_cast<std::size_t>(o.nproc_per_node));
    for (int local = 0; local < o.nproc_per_node; ++local) {
      Rank& r = ranks[static_cast<std::size_t>(local)];
      r.local_rank = local;
      r.rank = o.node_rank * o.nproc_per_node + local;
    }
    write_all(2, fmt::format("[launch] {} rank(s) on this node, world size {}, rendezvous {}:{}{}\n", o.nproc_per_node,
                             world_size, o.master_addr, o.master_port,
                             o.restart > 0 ? fmt::format(" (restart {} of {})", o.restart, o.max_restarts) : ""));
    for (Rank& r : ranks) {
      try {
        spawn(r, o, program, world_size);
      } catch (const Error&) {
        signal_all(ranks, SIGKILL);
        for (Rank& s : ranks)
          if (s.running) waitpid(s.pid, nullptr, 0);
        throw;
      }
    }
    const int status = supervise(ranks, o);
    // A signal to the launcher (Ctrl-C, the job's end) is never a reason to restart.
    if (status == kOk || g_signal != 0 || o.restart >= o.max_restarts) return status;
    write_all(2, fmt::format("[launch] restarting every rank ({} of {} restarts left after this one)\n",
                             o.max_restarts - o.restart - 1, o.max_restarts));
    if (pick_port) o.master_port = free_port(o.master_addr);  // the old store's port may still be in TIME_WAIT
  }
}

}  // namespace modalities::cli
