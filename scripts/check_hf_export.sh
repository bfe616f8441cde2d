#!/usr/bin/env bash
# Live check of the Hugging Face export against Python (needs the bench environment with torch,
# transformers and modalities: scripts/setup_bench_env.sh). Converts the checkpoint named by a
# conversion config (default: the quickstart's configs/quickstart/generate.toml, after
# scripts/quickstart.sh), loads the export with transformers and the checkpoint with Modalities'
# own Python GPT2LLM, and compares their logits (scripts/check_hf_export.py).
#
#   scripts/check_hf_export.sh [conversion config]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.deps/bench/bin/python}
BIN=${MODALITIES_BIN:-build/bin/modalities}
CONFIG=${1:-configs/quickstart/generate.toml}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
"$BIN" config resolve "$CONFIG" > "$OUT/resolved.toml"
"$BIN" convert_pytorch_to_hf_checkpoint --config_file_path "$CONFIG" --output_hf_checkpoint_dir "$OUT/hf"
ckpt=$("$PY" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["checkpointed_model"]["config"]["checkpoint_path"])' "$OUT/resolved.toml")
"$PY" scripts/check_hf_export.py --hf_dir "$OUT/hf" --resolved_config "$OUT/resolved.toml" --checkpoint "$ckpt"
