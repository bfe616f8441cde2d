#!/usr/bin/env bash
# MoE step time, side by side in one run (plugins/moe/README.md, "Benchmark"): forward + backward of
# one feed-forward on 8 x 256 tokens of width 256, fp32 on the CPU, with the same threads on both
# sides: our MoE block (8 experts of hidden 512, top-2; looped and grouped_mm backends) next to the
# dense SwiGLU of the same active size, our block under expert parallelism on 2 ranks (1 thread
# each, with the all-to-all bytes per step), transformers' MixtralSparseMoeBlock and the dense
# SwiGLU in PyTorch; then the ratios.
# Needs the build (scripts/build.sh cpu) and the Python venv (scripts/setup_bench_env.sh).
# Usage: scripts/bench_moe.sh [threads]   (default 2)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
threads="${1:-2}"
test_bin="${root}/build/bin/modalities_plugin_moe_test"
python="${root}/.deps/bench/bin/python"
[[ -x "${test_bin}" ]] || { echo "bench_moe.sh: ${test_bin} not found; run scripts/build.sh cpu first" >&2; exit 1; }
[[ -x "${python}" ]] || { echo "bench_moe.sh: ${python} not found; run scripts/setup_bench_env.sh first" >&2; exit 1; }
out="$(mktemp)"
trap 'rm -f "${out}"' EXIT
OMP_NUM_THREADS="${threads}" MODALITIES_MOE_BENCH=1 "${test_bin}" --gtest_filter='MoeBench.*' \
  | grep -E '^(\[rank 0\] )?bench_moe:' | sed 's/^\[rank 0\] //' | tee "${out}"
OMP_NUM_THREADS="${threads}" "${python}" "${root}/scripts/bench_moe.py" | tee -a "${out}"
ms() { grep -E "$1 [0-9.]+ ms" "${out}" | sed -E "s/.*$1 ([0-9.]+) ms.*/\1/" | head -1; }
ours_dense="$(ms 'cpp dense_swiglu_hidden_1024')"
ours_looped="$(ms 'cpp moe_looped')"
ours_grouped="$(ms 'cpp moe_grouped_mm')"
ep2="$(ms 'cpp moe_ep2_looped')"
py_moe="$(ms 'python transformers_mixtral_block')"
py_dense="$(ms 'python dense_swiglu_hidden_1024')"
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
echo "bench_moe: ratios: ours looped / ours dense $(ratio "${ours_looped}" "${ours_dense}") (aim <= 1.3)," \
  "ours grouped_mm / ours dense $(ratio "${ours_grouped}" "${ours_dense}")," \
  "transformers Mixtral / ours looped $(ratio "${py_moe}" "${ours_looped}")," \
  "ours dense / PyTorch dense $(ratio "${ours_dense}" "${py_dense}")," \
  "ours EP2 per rank / ours looped one process $(ratio "${ep2}" "${ours_looped}")"
