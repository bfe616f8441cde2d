// The process-group runtime (distributed.h): launch environment, TCPStore rendezvous and the
// c10d process groups. Compiled with USE_C10D_GLOO so that ProcessGroupGloo.hpp declares the
// class; gloo's own headers come from Debian's libgloo-dev (the wheel ships c10d's headers but
// not gloo's), its code from the wheel's libtorch_cpu.so. tests/distributed/ checks the pairing.
#include <ATen/Context.h>
#include <c10/util/Logging.h>
#include <modalities/sdk/build_info.h>
#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>

#include "staged_backend.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if MODALITIES_SDK_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <fmt/core.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <string_view>
#include <thread>

namespace modalities::dist {
namespace {

// Note [Lost peers]
// The small exchanges through the store (experiment id, checkpoint plans and reports) wait for a
// peer's key. A peer killed meanwhile never writes it, and a plain store wait would last the whole
// process-group timeout (600 s by default) under a launcher that does not stop the others (srun
// without --kill-on-bad-exit), printing nothing. So every rank beats a heartbeat counter in the store
// each second from a thread with its own store connection (a blocking wait holds TCPStore's client
// lock), and the waits look at the awaited rank's counter between slices of a second: unchanged for
// 10 s, the rank is named as lost. A lost connection to the store (its host, rank 0, died) is named
// as such too, without c10's backtrace.
constexpr std::chrono::seconds kHeartbeatPeriod{1};
constexpr std::chrono::seconds kPeerLostAfter{10};

std::string heartbeat_key(int rank) { return fmt::format("modalities/heartbeat/{}", rank); }

// c10d logs a warning with a full C++ backtrace before it throws on a lost store connection; the
// waits report that loss themselves, naming the rank and what was being done, so c10's log level is
// raised to errors while they talk to the store (a process-wide level: nested and concurrent users
// share one raise).
class QuietStoreLogs {
 public:
  QuietStoreLogs() {
    std::lock_guard lock(mutex());
    if (users()++ == 0) {
      saved() = FLAGS_caffe2_log_level;
      FLAGS_caffe2_log_level = std::max(saved(), 2);
    }
  }
  ~QuietStoreLogs() {
    std::lock_guard lock(mutex());
    if (--users() == 0) FLAGS_caffe2_log_level = saved();
  }
  QuietStoreLogs(const QuietStoreLogs&) = delete;
  QuietStoreLogs& operator=(const QuietStoreLogs&) = delete;

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static int& users() {
    static int n = 0;
    return n;
  }
  static int& saved() {
    static int level = 0;
    return level;
  }
};

struct Heartbeat {
  std::mutex mutex;
  std::condition_variable cv;
  bool stop = false;
  std::thread thread;

  void start(c10::intrusive_ptr<c10d::Store> own, int rank) {
    stop = false;
    thread = std::thread([this, own = std::move(own), key = heartbeat_key(rank)] {
      std::unique_lock lock(mutex);
      while (!stop) {
        lock.unlock();
        try {
          const QuietStoreLogs quiet;
          own->add(key, 1);
        } catch (const std::exception&) {
          return;  // the store is gone: the waits report that themselves
        }
        lock.lock();
        cv.wait_for(lock, kHeartbeatPeriod, [&] { return stop; });
      }
    });
  }
  void halt() {
    if (!thread.joinable()) return;
    {
      std::lock_guard lock(mutex);
      stop = true;
    }
    cv.notify_all();
    thread.join();
  }
  ~Heartbeat() { halt(); }
};

struct Runtime {
  std::mutex mutex;
  LaunchEnv env;
  std::string backend;
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> world;
  c10::intrusive_ptr<c10d::ProcessGroup> control;  // Gloo: world itself, or a second group next to NCCL
  int groups_created = 0;
  Heartbeat heartbeat;  // Note [Lost peers]
};

Runtime& runtime() {
  static Runtime r;
  return r;
}

std::optional<std::string> get(const EnvLookup& lookup, const char* name) {
  const char* v = lookup(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

int parse_int(const std::string& text, const char* name, int min_value) {
  int value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end)
    throw Error(fmt::format("environment variable {}={:?}: expected a whole number", name, text));
  if (value < min_value)
    throw Error(fmt::format("environment variable {}={}: expected a number >= {}", name, value, min_value));
  return value;
}

int require_int(const EnvLookup& lookup, const char* name, int min_value, const char* why) {
  const auto v = get(lookup, name);
  if (!v) throw Error(fmt::format("environment variable {} is not set ({})", name, why));
  return parse_int(*v, name, min_value);
}

int optional_int(const EnvLookup& lookup, const char* name, int min_value, int fallback) {
  const auto v = get(lookup, name);
  return v ? parse_int(*v, name, min_value) : fallback;
}

// SLURM_TASKS_PER_NODE is "4(x2),3": the count of this node's first group is enough when all
// nodes run the same number of tasks, which is the only layout a homogeneous mesh supports.
std::optional<int> slurm_tasks_per_node(const EnvLookup& lookup) {
  if (const auto v = get(lookup, "SLURM_NTASKS_PER_NODE")) return parse_int(*v, "SLURM_NTASKS_PER_NODE", 1);
  const auto v = get(lookup, "SLURM_TASKS_PER_NODE");
  if (!v) return std::nullopt;
  const std::string first = v->substr(0, v->find_first_of("(,"));
  return parse_int(first, "SLURM_TASKS_PER_NODE", 1);
}

void check_consistent(const LaunchEnv& e, const char* rank_var, const char* size_var, const char* local_var,
                      const char* local_size_var) {
  if (e.rank >= e.world_size)
    throw Error(fmt::format("environment: {}={} is not below {}={}", rank_var, e.rank, size_var, e.world_size));
  if (e.local_rank >= e.local_world_size)
    throw Error(fmt::format("environment: {}={} is not below {}={}", local_var, e.local_rank, local_size_var,
                            e.local_world_size));
  if (e.local_world_size > e.world_size)
    throw Error(
        fmt::format("environment: {}={} exceeds {}={}", local_size_var, e.local_world_size, size_var, e.world_size));
  if (e.master_port < 0 || e.master_port > 65535)
    throw Error(fmt::format("environment: MASTER_PORT={} is not a TCP port (0-65535)", e.master_port));
}

c10::intrusive_ptr<c10d::Backend> make_backend(const std::string& backend, const c10::intrusive_ptr<c10d::Store>& store,
                                               int rank, int size, std::chrono::milliseconds timeout) {
  if (backend == "gloo") {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    // Loopback-capable default device: binds to the address this machine's hostname resolves
    // to, or 127.0.0.1; GLOO_SOCKET_IFNAME selects an interface on clusters.
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname != '\0')
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    else options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
  }
  if (backend == "staged")
    return detail::make_staged_backend(make_backend("gloo", store, rank, size, timeout), rank, size);
#if MODALITIES_SDK_WITH_CUDA
  if (backend == "nccl") {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  }
#endif
  throw Error(fmt::format("process group backend \"{}\" is not available in this build (expected gloo, staged{})",
                          backend, MODALITIES_SDK_WITH_CUDA ? " or nccl" : "; nccl needs the CUDA build"));
}

// MODALITIES_DEBUG_COLLECTIVES=1 (or PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL): every group's
// backend is wrapped in c10d's ProcessGroupWrapper, which checks over a helper Gloo group, before
// each collective, that every rank issues the same collective with the same shapes; a mismatch is
// an error naming both sides instead of a hang or a wrong result. Costs one extra round trip per
// collective: for debugging.
bool debug_collectives() {
  const char* ours = std::getenv("MODALITIES_DEBUG_COLLECTIVES");
  const char* torch = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  return (ours != nullptr && std::string_view(ours) == "1") ||
         (torch != nullptr && std::string_view(torch) == "DETAIL");
}

c10::intrusive_ptr<c10d::ProcessGroup> make_group(const std::string& backend,
                                                  const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                  std::chrono::milliseconds timeout, const std::string& name) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  c10::intrusive_ptr<c10d::Backend> impl = make_backend(backend, store, rank, size, timeout);
  if (debug_collectives()) {
    auto helper =
        make_backend("gloo", c10::make_intrusive<c10d::PrefixStore>("collective_check/", store), rank, size, timeout);
    impl = c10::make_intrusive<c10d::ProcessGroupWrapper>(impl, helper);
  }
  using BackendType = c10d::ProcessGroup::BackendType;
  const auto type = backend == "nccl"     ? BackendType::NCCL
                    : backend == "staged" ? BackendType::CUSTOM
                                          : BackendType::GLOO;
  group->setDefaultBackend(type);
  // Gloo serves CPU tensors, NCCL CUDA tensors: an NCCL group gets a Gloo backend for the CPU
  // tensors of a GPU run (small control values), as torch.distributed's "cpu:gloo,cuda:nccl".
  // Gloo is not registered for CUDA tensors: with the wheel's Gloo most collectives on them abort
  // the process (seen on an H200: a socket write of a device pointer), so a CUDA tensor on a Gloo
  // group is c10d's "no backend for cuda" error instead.
  // The staged test backend serves both (one queue, so CPU and CUDA collectives keep their order).
  if (backend == "staged") {
    group->setBackend(c10::DeviceType::CPU, type, impl);
    group->setBackend(c10::DeviceType::CUDA, type, impl);
  } else if (backend == "nccl") {
    group->setBackend(c10::DeviceType::CUDA, type, impl);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO,
                      make_backend("gloo", c10::make_intrusive<c10d::PrefixStore>("cpu/", store), rank, size, timeout));
  } else {
    group->setBackend(c10::DeviceType::CPU, type, impl);
  }
  group->setGroupName(name);
  return group;
}

std::string choose_backend(std::string requested) {
  const char* env = std::getenv("MODALITIES_BACKEND");
  const bool from_env = requested == "auto" && env != nullptr && *env != '\0';
  if (from_env) requested = env;
  if (requested == "gloo" || requested == "nccl" || requested == "staged") return requested;
  if (requested != "auto")
    throw Error(fmt::format("{}process group backend \"{}\": expected \"auto\", \"gloo\", \"nccl\" or \"staged\"",
                            from_env ? "environment variable MODALITIES_BACKEND: " : "", requested));
  // Like torch.distributed's default: NCCL where there are GPUs. Independent of the config's
  // run device, so the runtime can start before the config is read.
  return MODALITIES_SDK_WITH_CUDA && at::hasCUDA() ? "nccl" : "gloo";
}

}  // namespace

std::string first_slurm_host(std::string_view nodelist) {
  // Hosts are separated by commas outside brackets; a bracket holds ranges "003-004" or single
  // numbers, of which the first gives the first host (zero padding kept).
  std::size_t end = 0;
  int depth = 0;
  while (end < nodelist.size() && !(nodelist[end] == ',' && depth == 0)) {
    if (nodelist[end] == '[') ++depth;
    if (nodelist[end] == ']') --depth;
    ++end;
  }
  const std::string_view first = nodelist.substr(0, end);
  const std::size_t open = first.find('[');
  if (open == std::string_view::npos) return std::string(first);
  const std::size_t stop = first.find_first_of(",-]", open + 1);
  if (stop == std::string_view::npos || stop == open + 1)
    throw Error(fmt::format("SLURM node list \"{}\": cannot read the first host", nodelist));
  std::string host(first.substr(0, open));
  host += first.substr(open + 1, stop - open - 1);
  const std::size_t close = first.find(']', open);
  if (close != std::string_view::npos) host += first.substr(close + 1);
  return host;
}

LaunchEnv launch_env(const EnvLookup& lookup) {
  LaunchEnv e;
  if (get(lookup, "RANK")) {
    e.source = "RANK/WORLD_SIZE";
    e.rank = require_int(lookup, "RANK", 0, "set by the launcher with RANK");
    e.world_size = require_int(lookup, "WORLD_SIZE", 1, "RANK is set, so the launcher must set WORLD_SIZE too");
    e.local_rank = optional_int(lookup, "LOCAL_RANK", 0, e.rank);
    e.local_world_size = optional_int(lookup, "LOCAL_WORLD_SIZE", 1, e.world_size);
    if (e.world_size > 1) {
      e.master_addr = get(lookup, "MASTER_ADDR").value_or("");
      if (e.master_addr.empty())
        throw Error(
            fmt::format("environment variable MASTER_ADDR is not set (WORLD_SIZE={} needs a rendezvous "
                        "address; `modalities launch` and torchrun set it)",
                        e.world_size));
      e.master_port = require_int(lookup, "MASTER_PORT", 1, "the rendezvous port of rank 0's store");
    }
    check_consistent(e, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  } else if (get(lookup, "SLURM_PROCID")) {
    e.source = "SLURM";
    e.rank = require_int(lookup, "SLURM_PROCID", 0, "set by srun");
    e.world_size = require_int(lookup, "SLURM_NTASKS", 1, "set by srun with SLURM_PROCID");
    e.local_rank = optional_int(lookup, "SLURM_LOCALID", 0, 0);
    e.local_world_size = slurm_tasks_per_node(lookup).value_or(e.world_size);
    if (const auto addr = get(lookup, "MASTER_ADDR"); addr && !addr->empty()) {
      e.master_addr = *addr;
    } else if (const auto list = get(lookup, "SLURM_STEP_NODELIST") ? get(lookup, "SLURM_STEP_NODELIST")
                                                                    : get(lookup, "SLURM_JOB_NODELIST")) {
      e.master_addr = first_slurm_host(*list);
    } else if (e.world_size > 1) {
      throw Error(
          "environment: SLURM_PROCID is set but neither MASTER_ADDR nor SLURM_STEP_NODELIST / "
          "SLURM_JOB_NODELIST names the host of rank 0");
    }
    if (const auto port = get(lookup, "MASTER_PORT")) {
      e.master_port = parse_int(*port, "MASTER_PORT", 1);
    } else {
      const int job = optional_int(lookup, "SLURM_JOB_ID", 0, 0);
      e.master_port = 15000 + job % 20000;
    }
    check_consistent(e, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE");
  }
  if (const auto agent = get(lookup, "TORCHELASTIC_USE_AGENT_STORE")) e.agent_store = *agent == "True" || *agent == "1";
  e.restart_count = optional_int(lookup, "TORCHELASTIC_RESTART_COUNT", 0, 0);
  return e;
}

LaunchEnv launch_env() {
  return launch_env([](const char* name) { return std::getenv(name); });
}

void init_with_store(const LaunchEnv& env, const RuntimeOptions& options, c10::intrusive_ptr<c10d::Store> store) {
  Runtime& r = runtime();
  std::lock_guard lock(r.mutex);
  if (r.world) throw Error("the distributed runtime is initialised already (dist::init called twice)");
  r.env = env;
  r.timeout = options.timeout;
  if (!env.distributed()) return;
  r.backend = choose_backend(options.backend);
  store->setTimeout(options.timeout);
  try {
    r.world = make_group(r.backend, store, env.rank, env.world_size, options.timeout, "world");
    r.control = r.backend == "gloo" ? r.world
                                    : make_group("gloo", c10::make_intrusive<c10d::PrefixStore>("control/", store),
                                                 env.rank, env.world_size, options.timeout, "control");
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(fmt::format("rank {} of {}: creating the {} process group failed (timeout {} s): {}", env.rank,
                            env.world_size, r.backend, options.timeout.count() / 1000.0, e.what()));
  }
  r.store = std::move(store);
  // Note [Lost peers]: a connection of its own (clone), so a blocking wait cannot hold it up.
  try {
    r.heartbeat.start(r.store->clone(), env.rank);
  } catch (const std::exception&) {
    // A store that cannot be cloned: no heartbeat; the waits then fall back to the timeout.
  }
}

void init(const LaunchEnv& env, const RuntimeOptions& options) {
  if (!env.distributed()) {
    init_with_store(env, options, {});
    return;
  }
  c10::intrusive_ptr<c10d::Store> store;
  try {
    c10d::TCPStoreOptions o;
    o.port = static_cast<std::uint16_t>(env.master_port);
    o.isServer = !env.agent_store && env.rank == 0;
    o.numWorkers = env.agent_store ? std::nullopt : std::optional<std::size_t>(env.world_size);
    o.waitWorkers = !env.agent_store;
    o.timeout = options.timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
    // torchrun's agent store holds every restart's keys: the ranks of one attempt use their own prefix.
    if (env.agent_store)
      store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("/worker/attempt_{}", env.restart_count), tcp);
    else store = tcp;
  } catch (const std::exception& e) {
    throw Error(fmt::format("rank {} of {}: rendezvous at {}:{} failed within {} s ({}): {}", env.rank, env.world_size,
                            env.master_addr, env.master_port, options.timeout.count() / 1000.0,
                            env.agent_store ? "torchrun's agent store"
                            : env.rank == 0 ? "hosting the store"
                                            : "connecting to rank 0",
                            e.what()));
  }
  init_with_store(env, options, std::move(store));
}

void shutdown() {
  Runtime& r = runtime();
  std::lock_guard lock(r.mutex);
  r.heartbeat.halt();
  r.world.reset();
  r.control.reset();
  r.store.reset();
  r.env = LaunchEnv{};
  r.backend.clear();
  r.groups_created = 0;
}

bool initialized() { return static_cast<bool>(runtime().world); }
const LaunchEnv& env() { return runtime().env; }
int rank() { return runtime().env.rank; }
int world_size() { return runtime().env.world_size; }
int local_rank() { return runtime().env.local_rank; }
bool is_rank0() { return runtime().env.rank == 0; }
const std::string& backend_name() { return runtime().backend; }
std::chrono::milliseconds timeout() { return runtime().timeout; }

c10::intrusive_ptr<c10d::ProcessGroup> world() {
  if (!runtime().world) throw Error("no process group: the distributed runtime is not initialised (world size 1)");
  return runtime().world;
}

c10::intrusive_ptr<c10d::ProcessGroup> control() {
  if (!runtime().control) throw Error("no process group: the distributed runtime is not initialised (world size 1)");
  return runtime().control;
}

namespace {
std::int64_t allreduce_int(std::int64_t value, c10d::ReduceOp::RedOpType op) {
  if (!initialized()) return value;
  std::vector<at::Tensor> t = {at::scalar_tensor(value, at::kLong).reshape({1})};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp(op);
  control()->allreduce(t, o)->wait();
  return t[0].item<std::int64_t>();
}
}  // namespace

bool any_rank(bool flag) { return allreduce_int(flag ? 1 : 0, c10d::ReduceOp::MAX) != 0; }
std::int64_t min_over_ranks(std::int64_t value) { return allreduce_int(value, c10d::ReduceOp::MIN); }

c10::intrusive_ptr<c10d::Store> store() {
  if (!runtime().store) throw Error("no store: the distributed runtime is not initialised (world size 1)");
  return runtime().store;
}

c10::intrusive_ptr<c10d::ProcessGroup> new_group(const std::vector<int>& ranks, const std::string& name) {
  Runtime& r = runtime();
  std::lock_guard lock(r.mutex);
  if (!r.world) throw Error(fmt::format("process group '{}': the distributed runtime is not initialised", name));
  if (ranks.empty() || !std::is_sorted(ranks.begin(), ranks.end()) ||
      std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end() || ranks.front() < 0 ||
      ranks.back() >= r.env.world_size)
    throw Error(fmt::format("process group '{}': ranks must be distinct, ascending and below the world size {}", name,
                            r.env.world_size));
  ++r.groups_created;
  const auto it = std::find(ranks.begin(), ranks.end(), r.env.rank);
  if (it == ranks.end()) return {};
  const int group_rank = static_cast<int>(it - ranks.begin());
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(fmt::format("group/{}/", name), r.store);
  return make_group(r.backend, prefixed, group_rank, static_cast<int>(ranks.size()), r.timeout, name);
}

namespace {

// What a store key is waited for, for messages: "saving checkpoint 'F' (written)" for the
// checkpoint protocol's keys (checkpoint/<n>/<folder>/<phase>), else the key.
std::string purpose(const std::string& key) {
  if (key.starts_with("checkpoint/")) {
    const auto folder = key.find('/', 11);
    const auto phase = key.rfind('/');
    if (folder != std::string::npos && phase > folder)
      return fmt::format("saving checkpoint '{}' ({})", key.substr(folder + 1, phase - folder - 1),
                         key.substr(phase + 1));
  }
  return fmt::format("exchanging '{}'", key);
}

// c10's errors carry a backtrace in what(); messages here name the peer and the purpose instead.
std::string message_of(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

Error lost_store(const std::string& key, const std::exception& e) {
  return Error(fmt::format("lost the connection to the rendezvous store{} while {} ({}); did rank 0 stop?",
                           env().agent_store ? " (torchrun's agent)" : " (hosted by rank 0)", purpose(key),
                           message_of(e)));
}

// The value of `store_key`, which rank `peer` writes, waiting up to the runtime's timeout; a lost
// peer or store is an error within seconds (Note [Lost peers]).
std::vector<std::uint8_t> get_from(int peer, const std::string& store_key, const std::string& key) {
  const QuietStoreLogs quiet;
  auto& store = *runtime().store;
  const auto start = std::chrono::steady_clock::now();
  std::int64_t last_beat = -1;
  auto last_change = start, last_look = start;
  auto pause = std::chrono::microseconds(200);
  while (true) {
    // check() does not block (a store wait with a short timeout logs a c10d warning each time).
    try {
      if (store.check({store_key})) return store.get(store_key);
    } catch (const std::exception& e) {
      throw lost_store(key, e);
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(50'000));
    const auto now = std::chrono::steady_clock::now();
    if (now - start > timeout())
      throw Error(fmt::format("waited {} s for rank {} while {} (the process-group timeout); is rank {} stuck?",
                              std::chrono::duration_cast<std::chrono::seconds>(timeout()).count(), peer, purpose(key),
                              peer));
    if (now - last_look < kHeartbeatPeriod) continue;
    last_look = now;
    std::int64_t beat = 0;
    try {
      beat = store.add(heartbeat_key(peer), 0);
    } catch (const std::exception& e) {
      throw lost_store(key, e);
    }
    if (beat != last_beat) {
      last_beat = beat;
      last_change = now;
    } else if (now - last_change > kPeerLostAfter) {
      throw Error(
          fmt::format("rank {} was lost while {}: no sign of life from it for {} s (killed, or its host "
                      "failed)",
                      peer, purpose(key), kPeerLostAfter.count()));
    }
  }
}

// Note [Reads before rank 0 returns]: rank 0 hosts the store (unless torchrun's agent does). A rank
// that returns from an exchange may fail at once (the ranks' fingerprints differ, say) and exit,
// taking the store with it while other ranks still read their values: they then reported a lost
// store instead of the real error (seen under load in DistributedRunTest.ARankWithAnotherConfig-
// FileIsRefusedOnEveryRank). So every other rank marks `<prefix>read/<rank>` once it has read what
// it needs, and rank 0 returns only when all have (a lost peer is still named within seconds).
void reads_done(const std::string& prefix, const std::string& key) {
  if (rank() != 0) {
    try {
      const QuietStoreLogs quiet;
      runtime().store->set(prefix + "read/" + std::to_string(rank()), std::vector<std::uint8_t>{1});
    } catch (const std::exception& e) {
      throw lost_store(key, e);
    }
    return;
  }
  for (int r = 1; r < world_size(); ++r) get_from(r, prefix + "read/" + std::to_string(r), key);
}

}  // namespace

std::string broadcast_from_rank0(const std::string& key, const std::string& value) {
  if (!initialized()) return value;
  const std::string k = "modalities/broadcast/" + key;
  if (rank() == 0) {
    try {
      const QuietStoreLogs quiet;
      runtime().store->set(k, std::vector<std::uint8_t>(value.begin(), value.end()));
    } catch (const std::exception& e) {
      throw lost_store(key, e);
    }
    reads_done(k + "/", key);
    return value;
  }
  const std::vector<std::uint8_t> got = get_from(0, k, key);
  reads_done(k + "/", key);
  return std::string(got.begin(), got.end());
}

namespace {
std::vector<std::string> gather_strings(const std::string& key, const std::string& value, bool everyone) {
  if (!initialized()) return {value};
  const std::string prefix = "modalities/gather/" + key + "/";
  try {
    const QuietStoreLogs quiet;
    runtime().store->set(prefix + std::to_string(rank()), std::vector<std::uint8_t>(value.begin(), value.end()));
  } catch (const std::exception& e) {
    throw lost_store(key, e);
  }
  std::vector<std::string> out;
  if (!everyone && rank() != 0) return out;
  out.reserve(static_cast<std::size_t>(world_size()));
  for (int r = 0; r < world_size(); ++r) {
    if (r == rank()) {
      out.push_back(value);
      continue;
    }
    const std::vector<std::uint8_t> got = get_from(r, prefix + std::to_string(r), key);
    out.emplace_back(got.begin(), got.end());
  }
  if (everyone) reads_done(prefix, key);  // Note [Reads before rank 0 returns]
  return out;
}
}  // namespace

std::vector<std::string> all_gather_strings(const std::string& key, const std::string& value) {
  return gather_strings(key, value, true);
}

std::vector<std::string> gather_strings_to_rank0(const std::string& key, const std::string& value) {
  return gather_strings(key, value, false);
}

// Note [Lost peers], in a step: a collective fails at once when a peer's connection closes, with
// Gloo's "[.../pair.cc:N] Connection closed by peer [IP]:PORT", which names no rank. The heartbeats
// say which: the peer whose counter stood still for 10 s, or rank 0 when the store it hosts is gone.
std::string lost_peer_message(const std::exception& e, const std::string& during,
                              const std::atomic<int>* stop_request) {
  // Our own errors (a lost store named by get_from, ...) already say what happened.
  if (!initialized() || world_size() < 2 || dynamic_cast<const Error*>(&e) != nullptr) return "";
  const std::string what = message_of(e);
  constexpr std::string_view kSigns[] = {"Connection closed by peer", "Connection reset by peer", "Broken pipe"};
  if (std::none_of(std::begin(kSigns), std::end(kSigns),
                   [&](std::string_view s) { return what.find(s) != std::string::npos; }))
    return "";
  std::string cause = what.substr(0, what.find('\n'));
  if (cause.starts_with('[') && cause.find("] ") != std::string::npos) cause = cause.substr(cause.find("] ") + 2);
  const QuietStoreLogs quiet;
  auto& store = *runtime().store;
  const int n = world_size();
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::int64_t> last(static_cast<std::size_t>(n), -1);
  std::vector<std::chrono::steady_clock::time_point> changed(static_cast<std::size_t>(n), start);
  for (auto now = start; now - start <= kPeerLostAfter + 2 * kHeartbeatPeriod; now = std::chrono::steady_clock::now()) {
    for (int r = 0; r < n; ++r) {
      if (r == rank()) continue;
      std::int64_t beat = 0;
      try {
        beat = store.add(heartbeat_key(r), 0);
      } catch (const std::exception&) {
        if (env().agent_store)
          return fmt::format(
              "lost the connection to another rank during {} ({}) and to the rendezvous store "
              "(torchrun's agent): is that node gone?",
              during, cause);
        return fmt::format(
            "rank 0 was lost during {}: its connection closed ({}), and so did the rendezvous store it "
            "hosts (killed, stopped by its own error, or its host failed)",
            during, cause);
      }
      const auto i = static_cast<std::size_t>(r);
      if (beat != last[i]) {
        last[i] = beat;
        changed[i] = now;
      } else if (now - changed[i] > kPeerLostAfter) {
        return fmt::format(
            "rank {} was lost during {}: its connection closed ({}) and it has shown no sign of life "
            "for {} s (killed, stopped by its own error, or its host failed)",
            r, during, cause, kPeerLostAfter.count());
      }
    }
    if (stop_request != nullptr && stop_request->load() != 0)
      return fmt::format(
          "a connection to another rank closed during {} ({}); stopped on request before telling "
          "which rank was lost",
          during, cause);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return fmt::format(
      "a connection to another rank closed during {} ({}), yet every rank still shows signs of life: "
      "a network problem?",
      during, cause);
}

void barrier() {
  if (!initialized()) return;
  world()->barrier()->wait();
}

// Note [Rendezvous port]: a port the kernel picks for bind(0) comes from its ephemeral range
// (net.ipv4.ip_local_port_range, 32768-60999 by default), from which it also takes the local port
// of every outgoing connection. Between choosing the port and rank 0's bind, such a connection (Gloo
// opens many; two multi-rank tests ran at once) took it once in CI: EADDRINUSE. Ports below the
// range are never handed out that way, so random ones there are tried first.
int free_rendezvous_port(const std::string& addr) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  if (inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1) sa.sin_addr.s_addr = htonl(INADDR_ANY);
  int last_error = 0;  // errno of the last failed bind
  // Binds `port` (0: any) on `addr`; the port bound, or 0.
  auto try_bind = [&](int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw Error(fmt::format("cannot open a socket to find a free port: {}", std::strerror(errno)));
    sockaddr_in at = sa;
    at.sin_port = htons(static_cast<std::uint16_t>(port));
    socklen_t len = sizeof(at);
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof(at)) == 0 &&
                    ::getsockname(fd, reinterpret_cast<sockaddr*>(&at), &len) == 0;
    if (!ok) last_error = errno;
    ::close(fd);
    return ok ? static_cast<int>(ntohs(at.sin_port)) : 0;
  };
  int low = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> low;
  constexpr int kFirst = 10000;  // above the ports services usually take
  if (low - kFirst >= 1000) {
    std::mt19937 rng{std::random_device{}()};
    std::uniform_int_distribution<int> pick(kFirst, low - 1);
    for (int attempt = 0; attempt < 64; ++attempt)
      if (const int port = try_bind(pick(rng))) return port;
  }
  if (const int port = try_bind(0)) return port;
  throw Error(fmt::format("cannot find a free port on {}: {}", addr, std::strerror(last_error)));
}

}  // namespace modalities::dist
