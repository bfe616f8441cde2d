#!/usr/bin/env bash
# Set-up, build and the test suite (GoogleTest via CTest, plugin smoke tests, out-of-tree plugin
# against the installed SDK). Usage: scripts/test.sh [--full] [ctest args...]
# The default suite leaves out the tests labelled `full` (the heavy multi-rank acceptance runs:
# 4 ranks, 20 steps, every layout); --full runs them too. The tests labelled `check` run the
# official Python `wandb` and `tensorboard` packages on our output; their venv .deps/check is
# created by scripts/setup_check_env.sh (pinned, from PyPI) first. The C++ sources must be
# formatted as .clang-format says (scripts/format.sh --check, after the set-up that installs
# clang-format-14): an unformatted file fails the command before anything is built.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
preset=cpu
if [[ "${1:-}" == "--full" ]]; then
  preset=cpu-full
  shift
fi
"${root}/scripts/setup.sh"
"${root}/scripts/format.sh" --check
"${root}/scripts/build.sh" cpu
"${root}/scripts/setup_check_env.sh"
cd "${root}"
ctest --preset "${preset}" "$@"
