#!/usr/bin/env bash
# Document-masked attention next to plain causal attention (plugins/gpt2/README.md, "Document
# masking"): forward + backward of a small decoder on 4 samples of 1024, 2048 and 4096 tokens cut
# from the bundled data, whose EOD tokens give the documents. Needs the build (scripts/build.sh cpu).
# Usage: scripts/bench_document_masking.sh [threads]   (default 2)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
threads="${1:-2}"
test_bin="${root}/build/bin/modalities_plugin_gpt2_test"
[[ -x "${test_bin}" ]] || { echo "bench_document_masking.sh: ${test_bin} not found; run scripts/build.sh cpu first" >&2; exit 1; }
OMP_NUM_THREADS="${threads}" MODALITIES_DOCUMENT_MASKING_BENCH=1 "${test_bin}" \
  --gtest_filter='Gpt2DocumentMaskingBench.*' | grep -E '^bench_document_masking:'
