#!/usr/bin/env bash
# Long-context training with and without context parallelism (docs/distributed.md, "Context
# parallelism"): forward + backward of a small decoder (4 layers, width 256, 8 query / 2 kv heads,
# vocabulary 8192) on one sample of 4096, 8192 and 16384 tokens, on one rank (cp 1) and on two
# Gloo ranks (cp 2), one thread per rank. Prints the step time, the whole sequence's tokens per
# second and the peak activation memory of the worst rank, counted by a counting CPU allocator
# (live tensor bytes at the step's peak minus those live before it), then cp 2 over cp 1.
# Needs the build (scripts/build.sh cpu).
# Usage: scripts/bench_context_parallel.sh [lengths...]   (default 4096 8192 16384)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
test_bin="${root}/build/bin/modalities_plugin_gpt2_test"
[[ -x "${test_bin}" ]] || { echo "bench_context_parallel.sh: ${test_bin} not found; run scripts/build.sh cpu first" >&2; exit 1; }
lengths="${*:-4096 8192 16384}"
out="$(MODALITIES_CP_BENCH=1 MODALITIES_CP_BENCH_LENGTHS="${lengths}" "${test_bin}" \
  --gtest_filter='Gpt2ContextParallelBench.*' | grep -E 'long-context T=' | sed 's/^\[rank 0\] //')"
echo "${out}"
echo "${out}" | awk '
  { for (i = 1; i <= NF; ++i) { split($i, kv, "="); v[kv[1]] = kv[2] }
    key = v["T"]; if (v["cp"] == 1) { s1[key] = v["step_s"]; m1[key] = v["activation_peak_MB"] }
    else { s2[key] = v["step_s"]; m2[key] = v["activation_peak_MB"]; order[++n] = key } }
  END { for (k = 1; k <= n; ++k) { t = order[k]
          if (t in s1) printf "T=%s: cp 2 / cp 1: step time %.2fx, activation memory per rank %.2fx\n", t, s2[t] / s1[t], m2[t] / m1[t] } }'
