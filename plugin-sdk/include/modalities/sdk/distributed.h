// The process-group runtime of a run: which process this is (the launch environment of
// torchrun, `modalities launch` or SLURM) and the communicator over all processes, built on
// LibTorch's c10d (ProcessGroupGloo on CPU, ProcessGroupNCCL in the CUDA build) with a c10d
// TCPStore rendezvous. The host initialises it once, before building a config; plugins (device
// mesh, FSDP wrappers, gradient clippers, subscribers) read it.
//
// Light header: c10d types are forward-declared. Code that calls into a process group includes
// <torch/csrc/distributed/c10d/ProcessGroup.hpp> itself.
#pragma once

#include <modalities/sdk/export.h>

#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace modalities::dist {

/// Who this process is in the run. Read from the environment by launch_env().
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  /// Rendezvous address of the store (hosted by rank 0, or by torchrun's agent).
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  /// TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent hosts the TCPStore, every rank is a
  /// client, and keys live under /worker/attempt_<TORCHELASTIC_RESTART_COUNT>/.
  bool agent_store = false;
  int restart_count = 0;
  /// Where the values came from: "single process", "RANK/WORLD_SIZE" or "SLURM".
  std::string source = "single process";

  bool distributed() const { return world_size > 1; }
};

/// Environment lookup (getenv's contract: nullptr when unset).
using EnvLookup = std::function<const char*(const char*)>;

/// Reads the launch contract:
///  - RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun,
///    `modalities launch`, any launcher that sets them); LOCAL_* default to the single-node
///    values when absent;
///  - when RANK is unset and SLURM_PROCID is set: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
///    SLURM_NTASKS_PER_NODE (or SLURM_TASKS_PER_NODE), MASTER_ADDR (default: the first host of
///    SLURM_STEP_NODELIST / SLURM_JOB_NODELIST), MASTER_PORT (default: 15000 + SLURM_JOB_ID % 20000);
///  - neither: one process (world size 1).
/// Throws modalities::Error naming the variable and its value when one is malformed, missing or
/// contradicts another (RANK >= WORLD_SIZE, ...).
MODALITIES_SDK_API LaunchEnv launch_env(const EnvLookup& lookup);
/// launch_env() on the process environment.
MODALITIES_SDK_API LaunchEnv launch_env();

/// The first host of a SLURM node list ("node[003-004,7],login" -> "node003").
MODALITIES_SDK_API std::string first_slurm_host(std::string_view nodelist);

/// A TCP port on `addr` (an IPv4 address; anything else: every address) that is free now, for rank
/// 0's store: random ports below the kernel's ephemeral range first, since a port from that range
/// (what bind to port 0 gives) can be taken by the local end of any outgoing connection before rank
/// 0 binds it. Throws modalities::Error when no port can be bound. Since: SDK 0.1 (ABI 5).
MODALITIES_SDK_API int free_rendezvous_port(const std::string& addr);

struct RuntimeOptions {
  /// "gloo", "nccl", "staged", or "auto": the environment variable MODALITIES_BACKEND when it is set,
  /// else nccl when the build has NCCL and a CUDA device is available, else gloo. "staged" is a test
  /// backend: Gloo for every tensor, CUDA tensors staged through pinned host memory on a side
  /// stream with NCCL's work semantics, so that several ranks can share one GPU (NCCL refuses
  /// that). Slow; for checking the parallel engines' CUDA paths on a one-GPU machine.
  std::string backend = "auto";
  /// Rendezvous and collective timeout. A collective that does not complete in time fails
  /// with an error on the ranks that wait (Gloo) instead of hanging.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
};

/// Creates the store and the world process group (a collective: every rank calls it, in the
/// same order as every other collective). A no-op returning immediately for world size 1.
/// Throws modalities::Error (with the address, the rank and the timeout) when the rendezvous
/// fails or times out. Calling it twice throws.
MODALITIES_SDK_API void init(const LaunchEnv& env, const RuntimeOptions& options);

/// Creates the world process group over an existing store (tests: a c10d FileStore in a temp
/// folder). Same contract as init().
MODALITIES_SDK_API void init_with_store(const LaunchEnv& env, const RuntimeOptions& options,
                                        c10::intrusive_ptr<c10d::Store> store);

/// Drops the world group and the store (the host calls it at exit; tests between cases).
MODALITIES_SDK_API void shutdown();

/// Whether init() created a process group (false for one process).
MODALITIES_SDK_API bool initialized();

/// The environment init() was called with; a single process's defaults before that.
MODALITIES_SDK_API const LaunchEnv& env();
MODALITIES_SDK_API int rank();
MODALITIES_SDK_API int world_size();
MODALITIES_SDK_API int local_rank();
/// True on the one process that prints progress and results.
MODALITIES_SDK_API bool is_rank0();

/// The backend init() chose ("gloo", "nccl", "staged"); "" before init or for one process.
MODALITIES_SDK_API const std::string& backend_name();
MODALITIES_SDK_API std::chrono::milliseconds timeout();

/// The communicator over all ranks. Throws modalities::Error when not initialized().
MODALITIES_SDK_API c10::intrusive_ptr<c10d::ProcessGroup> world();

/// A CPU communicator over all ranks for small control values (stop requests, error flags): the
/// world group itself on Gloo, a second (Gloo) group next to NCCL. Throws when not initialized().
MODALITIES_SDK_API c10::intrusive_ptr<c10d::ProcessGroup> control();

/// Whether `flag` is true on any rank: a collective on control(), so every rank calls it at the
/// same point. Returns `flag` for one process.
MODALITIES_SDK_API bool any_rank(bool flag);

/// The smallest `value` over all ranks (a collective on control()); `value` for one process.
MODALITIES_SDK_API std::int64_t min_over_ranks(std::int64_t value);

/// The rendezvous store (for sub-groups and small exchanges). Throws when not initialized().
MODALITIES_SDK_API c10::intrusive_ptr<c10d::Store> store();

/// A communicator over `ranks` (global ranks, ascending), for the device mesh. Every rank of the
/// world calls it with the same arguments in the same order; a rank not in `ranks` gets null.
/// `name` must be unique per group (it prefixes the group's keys in the store).
MODALITIES_SDK_API c10::intrusive_ptr<c10d::ProcessGroup> new_group(const std::vector<int>& ranks,
                                                                    const std::string& name);

/// Blocks until every rank arrived (world group); no-op for one process.
MODALITIES_SDK_API void barrier();

/// Rank 0's `value` on every rank, through the store under `key` (unique per use): e.g. the
/// experiment id that rank 0 derived from its clock. Returns `value` for one process.
MODALITIES_SDK_API std::string broadcast_from_rank0(const std::string& key, const std::string& value);

/// Every rank's `value`, indexed by rank, on every rank (through the store under `key`, unique per
/// use): small exchanges such as the list of tensor chunks each rank will write into a checkpoint.
/// Waits up to the store's timeout for the slowest rank. Returns {value} for one process.
MODALITIES_SDK_API std::vector<std::string> all_gather_strings(const std::string& key, const std::string& value);

/// Every rank's `value` on rank 0 (indexed by rank); an empty vector on the other ranks.
MODALITIES_SDK_API std::vector<std::string> gather_strings_to_rank0(const std::string& key, const std::string& value);

/// When `e` is a collective's failure because the connection to another rank closed (Gloo's
/// "Connection closed by peer" / "Connection reset by peer", a broken pipe), the error to report
/// instead: which rank was lost during `during` ("step 7"), found from the ranks' heartbeats in the
/// store within about 10 s, or that rank 0 (the store's host) is gone. "" for any other error, and
/// for one process (Note [Lost peers]). A nonzero `*stop_request` (SIGTERM from a launcher that
/// already names the lost rank) ends the wait early.
MODALITIES_SDK_API std::string lost_peer_message(const std::exception& e, const std::string& during,
                                                 const std::atomic<int>* stop_request = nullptr);

}  // namespace modalities::dist
