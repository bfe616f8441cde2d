// Differentiable collectives beyond tensor parallelism's conjugate pairs (tensor_parallel.h):
// the all-to-all of rows with split sizes, with which expert parallelism dispatches tokens to the
// ranks holding their experts and combines the results (and context parallelism's head/sequence
// exchanges will). c10d underneath: ProcessGroupGloo on CPU, ProcessGroupNCCL on GPUs.
//
//   const at::Tensor counts_in = dist::exchange_counts(counts_out, group);       // what each rank sends me
//   at::Tensor mine = dist::all_to_all_rows(x, send, recv, group);                // rows, per source rank
//   ... compute on mine ...
//   at::Tensor back = dist::all_to_all_rows(result, recv, send, group);           // the same rows of x
//
// Every rank of the group calls the same ops in the same order (backward too: a rank whose
// output gets no gradient still takes part, sending zeros). Without a group (null or one rank)
// every op is the identity.
#pragma once

#include <modalities/sdk/export.h>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <vector>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace modalities::dist {

/// Sends rows of x [sum(send), ...] in blocks, the first send[0] rows to rank 0 of `group`, the
/// next send[1] rows to rank 1, ..., and returns the rows received, [sum(recv), ...], the block
/// from rank 0 first. recv[i] must equal what rank i sends to this rank (exchange_counts tells).
/// Autograd: the backward sends the gradient of every received row back to where the row came
/// from (the same op with send and recv swapped), so rows keep their identity both ways.
/// Throws modalities::Error when send or recv do not have one entry per rank of the group, have
/// a negative entry, or when sum(send) is not x.size(0). Since: SDK 0.1 (ABI 6).
MODALITIES_SDK_API at::Tensor all_to_all_rows(const at::Tensor& x, const std::vector<std::int64_t>& send,
                                              const std::vector<std::int64_t>& recv,
                                              const c10::intrusive_ptr<c10d::ProcessGroup>& group);

/// counts [G * m] (int64, G ranks in the group): block i, entries [i m, (i + 1) m), is meant for
/// rank i. Returns [G * m] whose block i is what rank i meant for this rank (an all-to-all of
/// equal blocks, no autograd). Throws modalities::Error when the size is not a multiple of G.
/// Since: SDK 0.1 (ABI 6).
MODALITIES_SDK_API at::Tensor exchange_counts(const at::Tensor& counts,
                                              const c10::intrusive_ptr<c10d::ProcessGroup>& group);

}  // namespace modalities::dist
