#!/usr/bin/env bash
# The main job on a fresh machine: set up, build, then run the most useful
# pipeline available today on the bundled data: list the plugins, validate a
# config and build its component graph (a GPT-2 run's token budget computed
# from data/lorem_ipsum/lorem_ipsum_long.pbin).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"${root}/scripts/build.sh" cpu
cd "${root}"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
step "modalities --version"
build/bin/modalities --version
step "modalities plugins list"
build/bin/modalities plugins list
step "modalities config validate configs/token_budget.toml"
build/bin/modalities config validate configs/token_budget.toml
step "modalities config build configs/token_budget.toml"
build/bin/modalities config build configs/token_budget.toml
