#!/usr/bin/env bash
# Set-up, build and the whole test suite (GoogleTest via CTest, plugin smoke
# tests, out-of-tree plugin against the installed SDK). Usage: scripts/test.sh [ctest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"${root}/scripts/build.sh" cpu
cd "${root}"
ctest --preset cpu "$@"
