// Fault injection for tests of crash safety: a named point in the code where a test can have this
// process killed (SIGKILL, no clean-up, like a node failure) at an exact moment instead of guessing
// with a sleep.
//
//   MODALITIES_FAULT="checkpoint_file_written@1"     rank 1 dies the first time it gets there
//   MODALITIES_FAULT="train_step@0:3"                rank 0 dies the third time
//   MODALITIES_FAULT="train_step@1:3=stop"           rank 1 hangs there (SIGSTOP: a stuck rank, not a dead one)
//   MODALITIES_FAULT="train_loss_nan@1:5=flag"       fault_point() returns true there once: the caller
//                                                    injects the fault itself (here: a NaN loss on rank 1)
//
// Points (grep fault_point): "train_step" (the gym, after a micro-batch's backward, before the
// optimizer step), "checkpoint_file_written" (format v2 checkpoints, after this rank's file is on
// disk and before rank 0 commits the folder), "checkpoint_manifest_written" (rank 0, after writing
// the manifest into the hidden folder, before the rename), "train_loss_nan" (flag: the gym logs a NaN loss for
// that micro-batch). Unset: fault_point() costs one cached branch.
#pragma once

#include <modalities/sdk/export.h>

#include <string_view>

namespace modalities {

/// When MODALITIES_FAULT names `point`, this process's rank (the RANK environment variable, 0
/// without one) and the count of calls reached: kills this process with SIGKILL ("=kill", the
/// default), stops it with SIGSTOP ("=stop"), or returns true ("=flag"). Otherwise returns false.
/// A malformed MODALITIES_FAULT throws modalities::Error naming it.
MODALITIES_SDK_API bool fault_point(std::string_view point);

}  // namespace modalities
