// `modalities dist check`: runs every collective the distributed components use through this
// build's c10d (ProcessGroupGloo / ProcessGroupNCCL from the LibTorch wheel, gloo's headers from
// Debian) on values whose result is known exactly, and reports per-collective time and bus
// bandwidth on rank 0. A wrong value names the rank, the collective and the first bad element,
// so a header/library mismatch or a broken interconnect cannot go unnoticed. Run it under any
// launcher: `modalities launch --nproc-per-node 4 -- dist check`, torchrun --no-python, srun.
#include "cli.h"

#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/run_context.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <fmt/core.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

namespace modalities::cli {
namespace {

constexpr const char* kDistUsage = R"(usage: modalities dist check [options]

Checks the collectives of a multi-process run (all-reduce, all-gather, reduce-scatter,
broadcast, send/recv, barrier) on every rank against exactly known results, then times an
all-reduce, all-gather and reduce-scatter of --size-mb per rank. Needs a launcher:
  modalities launch --nproc-per-node 2 -- dist check
  torchrun --nproc_per_node 2 --no-python build/bin/modalities dist check
  srun -n 8 build/bin/modalities dist check)";

struct CheckOptions {
  std::string backend = "auto";
  std::string device = "auto";
  double timeout_s = 60;
  double size_mb = 4;
  int iters = 5;
};

[[noreturn]] void mismatch(const std::string& what, const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor bad = (got.cpu() != want.cpu()).nonzero();
  const std::int64_t i = bad.numel() > 0 ? bad[0][0].item<std::int64_t>() : -1;
  throw Error(fmt::format("{} returned a wrong result: element {} is {}, expected {} ({} of {} elements wrong)", what,
                          i, i >= 0 ? got.cpu().flatten()[i].item<double>() : 0.0,
                          i >= 0 ? want.cpu().flatten()[i].item<double>() : 0.0, bad.size(0), got.numel()));
}

void expect_equal(const std::string& what, const at::Tensor& got, const at::Tensor& want) {
  if (!at::equal(got.cpu(), want.cpu())) mismatch(what, got, want);
}

// Exact checks: small integers in float32 add without rounding.
void check_values(c10d::ProcessGroup& pg, const at::TensorOptions& opt) {
  const std::int64_t r = pg.getRank();
  const std::int64_t w = pg.getSize();
  const std::int64_t n = 1000 + 3;  // not a multiple of anything in particular

  std::vector<at::Tensor> t = {at::full({n}, static_cast<double>(r + 1), opt)};
  pg.allreduce(t)->wait();
  expect_equal("allreduce(SUM)", t[0], at::full({n}, static_cast<double>(w * (w + 1) / 2), opt));

  c10d::AllreduceOptions max_opt;
  max_opt.reduceOp = c10d::ReduceOp::MAX;
  t = {at::arange(n, opt) * static_cast<double>(r)};
  pg.allreduce(t, max_opt)->wait();
  expect_equal("allreduce(MAX)", t[0], at::arange(n, opt) * static_cast<double>(w - 1));

  at::Tensor mine = at::arange(n, opt) + static_cast<double>(r * n);
  at::Tensor gathered = at::empty({w * n}, opt);
  pg._allgather_base(gathered, mine)->wait();
  expect_equal("_allgather_base", gathered, at::arange(w * n, opt));

  std::vector<std::vector<at::Tensor>> outs = {std::vector<at::Tensor>(static_cast<std::size_t>(w))};
  for (auto& o : outs[0]) o = at::empty({n}, opt);
  std::vector<at::Tensor> ins = {mine};
  pg.allgather(outs, ins)->wait();
  for (std::int64_t k = 0; k < w; ++k)
    expect_equal(fmt::format("allgather (piece of rank {})", k), outs[0][static_cast<std::size_t>(k)],
                 at::arange(n, opt) + static_cast<double>(k * n));

  // Every rank contributes index + rank: chunk c of the sum is sum_r (c*n + i + r).
  at::Tensor input = at::arange(w * n, opt) + static_cast<double>(r);
  at::Tensor chunk = at::empty({n}, opt);
  pg._reduce_scatter_base(chunk, input)->wait();
  expect_equal("_reduce_scatter_base(SUM)", chunk,
               (at::arange(n, opt) + static_cast<double>(r * n)) * static_cast<double>(w) +
                   static_cast<double>(w * (w - 1) / 2));

  const std::int64_t root = w - 1;
  c10d::BroadcastOptions bopt;
  bopt.rootRank = root;
  t = {r == root ? at::arange(n, opt) * 2.0 : at::zeros({n}, opt)};
  pg.broadcast(t, bopt)->wait();
  expect_equal(fmt::format("broadcast(root {})", root), t[0], at::arange(n, opt) * 2.0);

  // A ring of send/recv: even ranks send first, odd ranks receive first (no deadlock at w = 2).
  std::vector<at::Tensor> out = {at::full({n}, static_cast<double>(r), opt)};
  std::vector<at::Tensor> in = {at::empty({n}, opt)};
  const int next = static_cast<int>((r + 1) % w);
  const int prev = static_cast<int>((r + w - 1) % w);
  if (r % 2 == 0) {
    pg.send(out, next, 0)->wait();
    pg.recv(in, prev, 0)->wait();
  } else {
    pg.recv(in, prev, 0)->wait();
    pg.send(out, next, 0)->wait();
  }
  expect_equal(fmt::format("send/recv (from rank {})", prev), in[0], at::full({n}, static_cast<double>(prev), opt));

  pg.barrier()->wait();
}

struct Timing {
  std::string name;
  double seconds;
  double bus_bytes;  // bytes each rank moves over the wire for an ideal ring algorithm
};

Timing time_collective(const std::string& name, int iters, double bus_bytes, const std::function<void()>& op,
                       c10d::ProcessGroup& pg, const at::Device& device) {
  op();  // warm-up (connections, buffers)
  pg.barrier()->wait();
  const auto start = std::chrono::steady_clock::now();
  for (int k = 0; k < iters; ++k) op();
  if (device.is_cuda()) at::empty({1}, at::TensorOptions().device(device)).cpu();  // drain the stream
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
  return {name, s, bus_bytes};
}

int check(const CheckOptions& o) {
  const dist::LaunchEnv env = dist::launch_env();
  if (!env.distributed()) {
    print_error(
        "dist check needs several processes (WORLD_SIZE > 1): run it under `modalities launch "
        "--nproc-per-node N -- dist check`, torchrun --no-python or srun");
    return kUsage;
  }
  set_run_device(parse_run_device(o.device, "--device"));
  if (o.backend == "gloo" && run_device().is_cuda()) {
    print_error(
        fmt::format("dist check: --backend gloo moves CPU tensors only, but the device is {}: use "
                    "--device cpu with gloo, --backend nccl (or auto) on GPUs, or --backend staged for "
                    "several ranks on one GPU (a test backend)",
                    run_device().str()));
    return kUsage;
  }
  dist::RuntimeOptions ro;
  ro.backend = o.backend;
  ro.timeout = std::chrono::milliseconds(static_cast<long>(o.timeout_s * 1000));
  const auto t0 = std::chrono::steady_clock::now();
  dist::init(env, ro);
  const double rendezvous_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto pg = dist::world();
  const at::Device device = run_device();
  const auto opt = at::TensorOptions().dtype(at::kFloat).device(device);
  if (dist::is_rank0())
    fmt::print(
        "dist check: {} ranks ({} per node, from {}), backend {}, device {}, rendezvous {}:{} ({}) in {:.2f} s\n",
        env.world_size, env.local_world_size, env.source, dist::backend_name(), device.str(), env.master_addr,
        env.master_port, env.agent_store ? "torchrun agent store" : "TCPStore on rank 0", rendezvous_s);
  check_values(*pg, opt);
  if (dist::is_rank0())
    fmt::print(
        "values: allreduce(SUM, MAX), _allgather_base, allgather, _reduce_scatter_base, "
        "broadcast, send/recv, barrier: all exact on every rank\n");

  const double w = env.world_size;
  const std::int64_t per_rank = std::max<std::int64_t>(1, static_cast<std::int64_t>(o.size_mb * 1024 * 1024 / 4));
  const std::int64_t n = per_rank * env.world_size;
  at::Tensor big = at::ones({n}, opt);
  at::Tensor shard = at::ones({per_rank}, opt);
  std::vector<Timing> timings;
  std::vector<at::Tensor> ar = {big};
  const double bytes = static_cast<double>(n) * 4;
  timings.push_back(time_collective(
      "allreduce", o.iters, 2 * (w - 1) / w * bytes, [&] { pg->allreduce(ar)->wait(); }, *pg, device));
  timings.push_back(time_collective(
      "_allgather_base", o.iters, (w - 1) / w * bytes, [&] { pg->_allgather_base(big, shard)->wait(); }, *pg, device));
  timings.push_back(time_collective(
      "_reduce_scatter_base", o.iters, (w - 1) / w * bytes, [&] { pg->_reduce_scatter_base(shard, big)->wait(); }, *pg,
      device));
  // Rank 0's times are reported; every rank ran the same loops.
  if (dist::is_rank0()) {
    fmt::print("{:<22} {:>12} {:>12} {:>14}\n", "collective", "MiB total", "ms", "bus GB/s");
    for (const Timing& t : timings)
      fmt::print("{:<22} {:>12.2f} {:>12.3f} {:>14.3f}\n", t.name, bytes / (1024.0 * 1024.0), t.seconds * 1e3,
                 t.bus_bytes / t.seconds / 1e9);
    if (dist::backend_name() == "gloo")
      fmt::print(
          "note: Gloo runs _reduce_scatter_base as an all-reduce followed by a copy of this rank's chunk, "
          "about twice the traffic of a ring reduce-scatter\n");
  }
  pg->barrier()->wait();
  dist::shutdown();
  return kOk;
}

std::string rank_label() {
  try {
    return std::to_string(dist::launch_env().rank);
  } catch (const std::exception&) {
    return "?";
  }
}

}  // namespace

void check_collective_values() {
  check_values(*dist::world(), at::TensorOptions().dtype(at::kFloat).device(run_device()));
  if (dist::is_rank0())
    fmt::print(stderr, "test_comm: every collective gave exact results on {} ranks ({})\n", dist::world_size(),
               dist::backend_name());
}

int run_dist(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::cout << kDistUsage << "\n";
    return args.empty() ? kUsage : kOk;
  }
  if (args[0] != "check") {
    print_error(fmt::format("unknown `dist` command '{}'\n\n{}", args[0], kDistUsage));
    return kUsage;
  }
  CheckOptions o;
  po::options_description desc("Options");
  desc.add_options()("help,h", "this help")(
      "backend", po::value<std::string>(&o.backend)->default_value("auto"),
      "auto (MODALITIES_BACKEND if set, else nccl with GPUs, gloo without), gloo, nccl, or staged (test "
      "backend: Gloo with CUDA tensors staged through host memory, several ranks on one GPU)")(
      "device", po::value<std::string>(&o.device)->default_value("auto"),
      "auto (cuda:LOCAL_RANK if CUDA is available), cpu, cuda")(
      "timeout-s", po::value<double>(&o.timeout_s)->default_value(60), "rendezvous and collective timeout")(
      "size-mb", po::value<double>(&o.size_mb)->default_value(4), "MiB per rank for the timed collectives")(
      "iters", po::value<int>(&o.iters)->default_value(5), "timed repetitions");
  po::variables_map vm;
  int status = kOk;
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (!parse(rest, desc, {}, vm, kDistUsage, status)) return status;
  if (o.timeout_s <= 0 || o.size_mb <= 0 || o.iters < 1) {
    print_error("dist check: --timeout-s and --size-mb must be positive, --iters at least 1");
    return kUsage;
  }
  try {
    return check(o);
  } catch (const std::exception& e) {
    print_error(fmt::format("rank {}: {}", rank_label(), e.what()));
    return kFailed;
  }
}

}  // namespace modalities::cli
