#!/usr/bin/env bash
# Set-up (idempotent) and build of a CMake preset.
# Usage: scripts/build.sh [cpu|cuda|debug|asan] [cmake --build arguments, e.g. --target modalities_runtime]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
preset="${1:-cpu}"
(( $# )) && shift
setup_args=()
[[ "${preset}" == "cuda" ]] && setup_args+=(--cuda)
"${root}/scripts/setup.sh" "${setup_args[@]}"
cd "${root}"
export CCACHE_DIR="${CCACHE_DIR:-${root}/.deps/ccache}"
cmake --preset "${preset}"
cmake --build --preset "${preset}" -j "$(nproc)" "$@"
