#!/usr/bin/env bash
# Loss-curve parity and throughput of `modalities run` against Modalities' own Python
# components (scripts/reference/train_reference.py: GPT2LLM, packed dataset, resumable sampler,
# collator, CLM loss, torch AdamW with Modalities' weight-decay groups, SequentialLR(LinearLR,
# CosineAnnealingLR), clip_grad_norm_; on a GPU FSDP2's fully_shard when the config's model is
# fsdp2_wrapped) on configs/quickstart/train.toml or another config (--base).
#
# Both sides start from the same weights: the reference draws them and writes init.safetensors;
# our config is the base config with `[initialized_model]` replaced by model/fsdp1_checkpointed
# loading that file (scripts/bench_training_config.py). Training log interval 1, no checkpoints.
# On CPU both run with the same number of intra-op threads (OMP_NUM_THREADS and torch.set_num_threads).
#
#   scripts/bench_training.sh                 # the quickstart's 80 steps (~1 min on 2 idle cores)
#   scripts/bench_training.sh --steps 20      # short variant (~30 s)
#   scripts/bench_training.sh --device cuda --modalities build-cuda/bin/modalities   # on one GPU
# Options: --steps N (> the config's warmup), --threads N (default 2), --out DIR (default
# out/bench/training), --device cpu|cuda (default cpu), --base CONFIG (default
# configs/quickstart/train.toml), --set TABLE.KEY=VALUE (more edits of the derived config, repeatable),
# --modalities PATH (default build/bin/modalities), --python PATH (default the .deps/bench venv,
# which it creates or updates first with scripts/setup_bench_env.sh, a no-op when current: Modalities
# 0.5.0, torch 2.11.0, safetensors; another interpreter must have those).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
steps=80
threads=2
out="${root}/out/bench/training"
device=cpu
base="${root}/configs/quickstart/train.toml"
modalities="${root}/build/bin/modalities"
python=""
extra_sets=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --device) device="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    --set) extra_sets+=(--set "$2"); shift 2 ;;
    --modalities) modalities="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    -h|--help) sed -n '2,22p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "bench_training.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ "${device}" == cpu || "${device}" == cuda ]] || { echo "bench_training.sh: --device ${device}: expected cpu or cuda" >&2; exit 2; }
[[ -f "${base}" ]] || { echo "bench_training.sh: --base ${base}: no such config" >&2; exit 2; }
base="$(cd "$(dirname "${base}")" && pwd)/$(basename "${base}")"
if [[ "${base}" == "${root}/configs/quickstart/train.toml" ]] && (( steps <= 10 )); then
  echo "bench_training.sh: --steps ${steps}: must be > 10 (the quickstart's warmup_steps)" >&2
  exit 2
fi
[[ -x "${modalities}" ]] || { echo "bench_training.sh: ${modalities} is missing (see scripts/setup.sh / scripts/build.sh)" >&2; exit 1; }
if [[ -n "${python}" && "${python}" == */* ]]; then
  python="$(cd "$(dirname "${python}")" && pwd)/$(basename "${python}")"  # the reference runs in ${out}
fi
if [[ -z "${python}" ]]; then
  # The Python side: Modalities 0.5.0 and torch 2.11.0 as pinned in scripts/bench-requirements.txt.
  python="${root}/.deps/bench/bin/python"
  "${root}/scripts/setup_bench_env.sh"
  [[ -x "${python}" ]] || { echo "bench_training.sh: ${python} is missing (scripts/setup_bench_env.sh failed?)" >&2; exit 1; }
fi
mkdir -p "${out}"
out="$(cd "${out}" && pwd)"
rm -rf "${out}/exp"

# 1. The derived config: same model, data, optimizer, scheduler and clipper as the quickstart.
python3 "${root}/scripts/bench_training_config.py" --base "${base}" \
  --out "${out}/train.toml" --init "${out}/init.safetensors" \
  --set "settings.training_target.num_target_steps=${steps}" \
  --set "settings.intervals.training_log_interval_in_steps=1" \
  --set "settings.intervals.checkpointing_interval_in_steps=${steps}" \
  --set "settings.intervals.evaluation_interval_in_steps=${steps}" \
  --set "checkpoint_saving.config.checkpoint_saving_strategy.config={ k = 0 }" "${extra_sets[@]}"
RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 "${modalities}" config resolve "${out}/train.toml" \
  --experiments_root_path "${out}/exp" --experiment_id ours >"${out}/resolved.toml"

export OMP_NUM_THREADS="${threads}" MKL_NUM_THREADS="${threads}"
echo "== Modalities components (PyTorch eager on ${device}, ${threads} threads): ${steps} steps"
(cd "${out}" && "${python}" "${root}/scripts/reference/train_reference.py" --config resolved.toml \
  --init init.safetensors --out reference.json --threads "${threads}" --device "${device}")

echo "== modalities run (LibTorch on ${device}, OMP_NUM_THREADS=${threads}): ${steps} steps"
start=${EPOCHREALTIME}
MODALITIES_DEVICE="${device}" MODALITIES_PROGRESS=0 "${modalities}" run --config_file_path "${out}/train.toml" \
  --experiments_root_path "${out}/exp" --experiment_id ours >"${out}/ours.log" 2>&1 \
  || { tail -20 "${out}/ours.log" >&2; exit 1; }
awk -v a="${start}" -v b="${EPOCHREALTIME}" -v f="${out}/ours.log" \
  'BEGIN { printf "process wall time %.1f s (start-up included; log: %s)\n", b - a, f }'

echo
python3 "${root}/scripts/bench_training_compare.py" --reference "${out}/reference.json" \
  --ours "${out}/exp/ours/evaluation_results.jsonl" --config "${out}/resolved.toml" \
  --summary-json "${out}/summary.json"
