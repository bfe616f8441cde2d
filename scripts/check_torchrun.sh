#!/usr/bin/env bash
# Launches `modalities dist check` with the pinned torch wheel's torchrun, as users do with
# `torchrun --no-python`: torchrun's agent hosts the TCPStore (TORCHELASTIC_USE_AGENT_STORE=True)
# and our ranks connect to it as clients. Checks every collective on exact values and prints the
# timings. Needs a build (scripts/build.sh) and the Python environment of scripts/setup_bench_env.sh;
# CI does not need Python: tests/distributed covers the same ranks with `modalities launch`.
# Usage: scripts/check_torchrun.sh [nproc-per-node (default 2)] [build dir (default build)]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nproc="${1:-2}"
bin="${root}/${2:-build}/bin/modalities"
torchrun="${root}/.deps/bench/bin/torchrun"
if [[ ! -x "${torchrun}" ]]; then
  echo "check_torchrun.sh: ${torchrun} is missing; run scripts/setup_bench_env.sh first" >&2
  exit 2
fi
if [[ ! -x "${bin}" ]]; then
  echo "check_torchrun.sh: ${bin} is missing; run scripts/build.sh first" >&2
  exit 2
fi
"${torchrun}" --version 2>/dev/null | head -1 || true
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "${torchrun}" --standalone --nproc_per_node "${nproc}" --no-python \
  "${bin}" dist check --device cpu --timeout-s 60 --size-mb 1 --iters 2
echo "check_torchrun.sh: torchrun --no-python with ${nproc} ranks: OK"
