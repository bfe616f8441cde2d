// The staged test backend of the process-group runtime (distributed.cpp; not installed, not part
// of the SDK's API): collectives on CUDA tensors through a CPU backend (Gloo), the data staged in
// pinned host memory on a side stream. It lets several ranks share one GPU, which NCCL refuses, so
// every parallelism's CUDA path can be checked against one rank on a one-GPU machine. For tests
// only: it moves every byte through the host twice.
#pragma once

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Backend;
}  // namespace c10d

namespace modalities::dist::detail {

/// A backend that runs each collective of `inner` (a Gloo backend of `size` ranks) on host copies of
/// its tensors. Work semantics are those of ProcessGroupNCCL: the call returns at once; the tensors
/// are read after everything already queued on the caller's current stream; the results are written
/// on a side stream; `wait()` returns when the collective is done and makes the caller's current
/// stream wait for the write-back (an event), without blocking the host on the GPU. Collectives are
/// issued to `inner` in the order of the calls, on one thread, so every rank issues them in the same
/// order. CPU tensors are staged through plain host copies (the same code path, testable without a
/// GPU).
c10::intrusive_ptr<c10d::Backend> make_staged_backend(c10::intrusive_ptr<c10d::Backend> inner, int rank, int size);

}  // namespace modalities::dist::detail
