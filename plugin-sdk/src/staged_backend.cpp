// The staged test backend (staged_backend.h).
//
// Note [Staged collectives]
// Each call becomes a job that passes through two threads of the backend:
//  1. the issuer thread waits (on the GPU) for the caller's stream to reach the call, copies the inputs
//     into pinned host buffers on the side stream, waits (on the host) for those copies, and issues
//     the collective to the inner Gloo backend on the host buffers. One thread, in call order: Gloo
//     needs every rank to issue the same collectives in the same order, as NCCL does.
//  2. a completer thread of its own per job waits for the inner work, copies the outputs back on
//     the side stream and records an event there, then marks the work done.
// A caller's `wait()` blocks until the work is done and makes its current stream wait for the
// event, so kernels it queues afterwards read the results; nothing else synchronizes the host with
// the GPU. Works complete independently, as Gloo's own do: one completer waiting for the jobs in
// call order deadlocked 1F1B on an H100 (rank 0's completer waited for a send whose receive rank 1
// posts only after its own completer, itself waiting behind a send to rank 0, finished a receive;
// see TheStagedTestBackendTrainsBitForBitLikeGloo). The
// device tensors are recorded on the side stream for the caching allocator, so memory the caller
// frees early is not reused before the side stream is done with it; pinned buffers are kept by the
// host allocator until their copies complete (non-blocking copies record an event on them).
#include "staged_backend.h"

#include <modalities/sdk/build_info.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if MODALITIES_SDK_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <fmt/core.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace modalities::dist::detail {
namespace {

using c10d::OpType;
using Tensors = std::vector<at::Tensor>;

#if MODALITIES_SDK_WITH_CUDA
using Event = c10::cuda::CUDAEvent;
#else
struct Event {};  // no GPU work to order in a CPU build
#endif

class StagedWork final : public c10d::Work {
 public:
  StagedWork(int rank, OpType op, Tensors outputs) : Work(rank, op), outputs_(std::move(outputs)) {}

  // Called once by the completer: `done` (null for CPU tensors) is recorded after the write-back.
  void complete(std::exception_ptr error, std::shared_ptr<Event> done, c10::DeviceIndex device) {
    {
      std::lock_guard lock(mutex_);
      done_ = std::move(done);
      device_ = device;
    }
    finish(std::move(error));
  }

  bool wait(std::chrono::milliseconds timeout) override {
    {
      std::unique_lock lock(mutex_);
      if (timeout == kNoTimeout) {
        cv_.wait(lock, [&] { return completed_; });
      } else if (!cv_.wait_for(lock, timeout, [&] { return completed_; })) {
        throw std::runtime_error(fmt::format("staged collective {} did not complete within {} ms",
                                             c10d::opTypeToString(opType_), timeout.count()));
      }
      if (exception_) std::rethrow_exception(exception_);
    }
    synchronize();
    return true;
  }

  void synchronize() override {
#if MODALITIES_SDK_WITH_CUDA
    std::shared_ptr<Event> done;
    c10::DeviceIndex device = 0;
    {
      std::lock_guard lock(mutex_);
      done = done_;
      device = device_;
    }
    if (done) done->block(c10::cuda::getCurrentCUDAStream(device));
#endif
  }

  Tensors result() override { return outputs_; }

 private:
  Tensors outputs_;
  std::shared_ptr<Event> done_;
  c10::DeviceIndex device_ = 0;
};

struct Job {
  OpType op = OpType::UNKNOWN;
  Tensors device_in, host_in;    // copied to the host before the collective
  Tensors device_out, host_out;  // copied back after it (host_out may alias host_in: in-place ops)
  std::function<c10::intrusive_ptr<c10d::Work>(Job&)> issue;
  c10d::Backend* backend = nullptr;  // the inner backend, which `issue` calls
  c10::intrusive_ptr<StagedWork> work;
  c10::intrusive_ptr<c10d::Work> inner;
  std::exception_ptr error;
  bool cuda = false;
  c10::DeviceIndex device = 0;
  std::shared_ptr<Event> ready;  // recorded on the caller's stream at the call

  c10d::Backend* issue_inner() const { return backend; }
};

// A contiguous host tensor shaped like `t`, pinned when `t` lives on a GPU.
at::Tensor host_like(const at::Tensor& t) {
  return at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()).device(at::kCPU).pinned_memory(t.is_cuda()));
}

Tensors host_like(const Tensors& ts) {
  Tensors out;
  out.reserve(ts.size());
  for (const at::Tensor& t : ts) out.push_back(host_like(t));
  return out;
}

Tensors flatten(const std::vector<Tensors>& nested) {
  Tensors out;
  for (const Tensors& v : nested) out.insert(out.end(), v.begin(), v.end());
  return out;
}

// `flat` cut into lists of the lengths of `shape`'s lists.
std::vector<Tensors> nest_like(const Tensors& flat, const std::vector<Tensors>& shape) {
  std::vector<Tensors> out;
  std::size_t at = 0;
  for (const Tensors& v : shape) {
    out.emplace_back(flat.begin() + static_cast<std::ptrdiff_t>(at),
                     flat.begin() + static_cast<std::ptrdiff_t>(at + v.size()));
    at += v.size();
  }
  return out;
}

class StagedBackend final : public c10d::Backend {
 public:
  StagedBackend(c10::intrusive_ptr<c10d::Backend> inner, int rank, int size)
      : Backend(rank, size), inner_(std::move(inner)) {
    issuer_ = std::thread([this] { issue_loop(); });
  }

  ~StagedBackend() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    issue_cv_.notify_all();
    issuer_.join();
    // Completers still waiting for their inner work end with it (Gloo's timeout bounds them).
    std::unique_lock lock(mutex_);
    completers_done_.wait(lock, [&] { return completers_ == 0; });
  }

  const std::string getBackendName() const override { return "staged_gloo"; }
  void setTimeout(std::chrono::milliseconds timeout) override { inner_->setTimeout(timeout); }

  c10::intrusive_ptr<c10d::Work> broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) override {
    return in_place(OpType::BROADCAST, tensors, [opts](Job& j) { return j.issue_inner()->broadcast(j.host_in, opts); });
  }

  c10::intrusive_ptr<c10d::Work> allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) override {
    return in_place(OpType::ALLREDUCE, tensors, [opts](Job& j) { return j.issue_inner()->allreduce(j.host_in, opts); });
  }

  c10::intrusive_ptr<c10d::Work> reduce(Tensors& tensors, const c10d::ReduceOptions& opts) override {
    return in_place(OpType::REDUCE, tensors, [opts](Job& j) { return j.issue_inner()->reduce(j.host_in, opts); });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    return staged(OpType::_ALLGATHER_BASE, {input}, {output},
                  [opts](Job& j) { return j.issue_inner()->_allgather_base(j.host_out[0], j.host_in[0], opts); });
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    return staged(OpType::_REDUCE_SCATTER_BASE, {input}, {output},
                  [opts](Job& j) { return j.issue_inner()->_reduce_scatter_base(j.host_out[0], j.host_in[0], opts); });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<Tensors>& outputs, Tensors& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    return staged(OpType::ALLGATHER, inputs, flatten(outputs), [opts, shape = outputs](Job& j) {
      std::vector<Tensors> out = nest_like(j.host_out, shape);
      return j.issue_inner()->allgather(out, j.host_in, opts);
    });
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<Tensors>& outputs, Tensors& inputs,
                                        const c10d::GatherOptions& opts) override {
    return staged(OpType::GATHER, inputs, flatten(outputs), [opts, shape = outputs](Job& j) {
      std::vector<Tensors> out = nest_like(j.host_out, shape);
      return j.issue_inner()->gather(out, j.host_in, opts);
    });
  }

  c10::intrusive_ptr<c10d::Work> scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    return staged(OpType::SCATTER, flatten(inputs), outputs, [opts, shape = inputs](Job& j) {
      std::vector<Tensors> in = nest_like(j.host_in, shape);
      return j.issue_inner()->scatter(j.host_out, in, opts);
    });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    return staged(OpType::REDUCE_SCATTER, flatten(inputs), outputs, [opts, shape = inputs](Job& j) {
      std::vector<Tensors> in = nest_like(j.host_in, shape);
      return j.issue_inner()->reduce_scatter(j.host_out, in, opts);
    });
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_counts, std::vector<int64_t>& input_counts,
                                               const c10d::AllToAllOptions& opts) override {
    return staged(OpType::ALLTOALL_BASE, {input}, {output}, [opts, output_counts, input_counts](Job& j) mutable {
      return j.issue_inner()->alltoall_base(j.host_out[0], j.host_in[0], output_counts, input_counts, opts);
    });
  }

  c10::intrusive_ptr<c10d::Work> send(Tensors& tensors, int dst, int tag) override {
    return staged(OpType::SEND, tensors, {}, [dst, tag](Job& j) { return j.issue_inner()->send(j.host_in, dst, tag); });
  }

  c10::intrusive_ptr<c10d::Work> recv(Tensors& tensors, int src, int tag) override {
    return staged(OpType::RECV, {}, tensors,
                  [src, tag](Job& j) { return j.issue_inner()->recv(j.host_out, src, tag); });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    // Through the queue, so it is issued in order with the collectives before it.
    return staged(OpType::BARRIER, {}, {}, [opts](Job& j) { return j.issue_inner()->barrier(opts); });
  }

 private:
  c10::intrusive_ptr<c10d::Work> in_place(OpType op, const Tensors& tensors,
                                          std::function<c10::intrusive_ptr<c10d::Work>(Job&)> issue) {
    return staged(op, tensors, tensors, std::move(issue), /*in_place=*/true);
  }

  // Queues one job (Note [Staged collectives]); runs on the caller's thread.
  c10::intrusive_ptr<c10d::Work> staged(OpType op, const Tensors& in, const Tensors& out,
                                        std::function<c10::intrusive_ptr<c10d::Work>(Job&)> issue,
                                        bool in_place = false) {
    auto job = std::make_unique<Job>();
    job->op = op;
    job->device_in = in;
    job->device_out = out;
    job->issue = std::move(issue);
    job->backend = inner_.get();
    std::optional<c10::Device> device;
    for (const Tensors* ts : {&in, &out})
      for (const at::Tensor& t : *ts) {
        if (!t.is_cuda() && !t.is_cpu())
          throw std::invalid_argument(fmt::format("staged collective {}: tensors on {} are not supported",
                                                  c10d::opTypeToString(op), t.device().str()));
        if (!device) device = t.device();
        if (t.device() != *device)
          throw std::invalid_argument(fmt::format("staged collective {}: tensors on {} and {} in one call",
                                                  c10d::opTypeToString(op), device->str(), t.device().str()));
      }
    job->host_in = host_like(in);
    job->host_out = in_place ? job->host_in : host_like(out);
    job->work = c10::make_intrusive<StagedWork>(getRank(), op, out);
    if (device && device->is_cuda()) {
#if MODALITIES_SDK_WITH_CUDA
      job->cuda = true;
      job->device = device->index();
      const c10::cuda::CUDAStream side = side_stream(job->device);
      job->ready = std::make_shared<Event>();
      job->ready->record(c10::cuda::getCurrentCUDAStream(job->device));
      for (const Tensors* ts : {&in, &out})
        for (const at::Tensor& t : *ts)
          if (t.has_storage()) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), side);
#endif
    }
    c10::intrusive_ptr<c10d::Work> work = job->work;
    {
      std::lock_guard lock(mutex_);
      to_issue_.push_back(std::move(job));
    }
    issue_cv_.notify_one();
    return work;
  }

#if MODALITIES_SDK_WITH_CUDA
  c10::cuda::CUDAStream side_stream(c10::DeviceIndex device) {
    std::lock_guard lock(mutex_);
    if (!side_ || side_->device_index() != device)
      side_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device);
    return *side_;
  }
#endif

  std::unique_ptr<Job> pop() {
    std::unique_lock lock(mutex_);
    issue_cv_.wait(lock, [&] { return stopping_ || !to_issue_.empty(); });
    if (to_issue_.empty()) return nullptr;
    std::unique_ptr<Job> job = std::move(to_issue_.front());
    to_issue_.pop_front();
    return job;
  }

  void issue_loop() {
    const at::NoGradGuard no_grad;  // copies into tensors that require grad (per thread)
    while (std::unique_ptr<Job> job = pop()) {
      try {
        if (job->cuda) {
#if MODALITIES_SDK_WITH_CUDA
          const c10::cuda::CUDAGuard device(job->device);
          const c10::cuda::CUDAStream side = side_stream(job->device);
          const c10::cuda::CUDAStreamGuard on_side(side);
          job->ready->block(side);
          for (std::size_t i = 0; i < job->device_in.size(); ++i)
            job->host_in[i].copy_(job->device_in[i], /*non_blocking=*/true);
          Event staged;
          staged.record(side);
          staged.synchronize();
#endif
        } else {
          for (std::size_t i = 0; i < job->device_in.size(); ++i) job->host_in[i].copy_(job->device_in[i]);
        }
        job->inner = job->issue(*job);
      } catch (...) {
        job->error = std::current_exception();
      }
      {
        std::lock_guard lock(mutex_);
        ++completers_;
      }
      std::thread([this, j = std::shared_ptr<Job>(std::move(job))] {
        complete(*j);
        std::lock_guard lock(mutex_);
        if (--completers_ == 0) completers_done_.notify_all();
      }).detach();
    }
  }

  // Runs on a completer thread of its own (Note [Staged collectives]).
  void complete(Job& job) {
    const at::NoGradGuard no_grad;
    std::shared_ptr<Event> done;
    try {
      if (!job.error && job.inner) job.inner->wait();
      if (!job.error && job.cuda) {
#if MODALITIES_SDK_WITH_CUDA
        const c10::cuda::CUDAGuard device(job.device);
        const c10::cuda::CUDAStream side = side_stream(job.device);
        const c10::cuda::CUDAStreamGuard on_side(side);
        for (std::size_t i = 0; i < job.device_out.size(); ++i)
          job.device_out[i].copy_(job.host_out[i], /*non_blocking=*/true);
        done = std::make_shared<Event>();
        done->record(side);
#endif
      } else if (!job.error) {
        for (std::size_t i = 0; i < job.device_out.size(); ++i) job.device_out[i].copy_(job.host_out[i]);
      }
    } catch (...) {
      job.error = std::current_exception();
    }
    job.work->complete(job.error, std::move(done), job.device);
  }

  c10::intrusive_ptr<c10d::Backend> inner_;
  std::mutex mutex_;
  std::condition_variable issue_cv_, completers_done_;
  std::deque<std::unique_ptr<Job>> to_issue_;
  int completers_ = 0;  // completer threads running
  bool stopping_ = false;
#if MODALITIES_SDK_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> side_;
#endif
  std::thread issuer_;
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> make_staged_backend(c10::intrusive_ptr<c10d::Backend> inner, int rank, int size) {
  return c10::make_intrusive<StagedBackend>(std::move(inner), rank, size);
}

}  // namespace modalities::dist::detail
