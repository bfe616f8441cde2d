#!/usr/bin/env bash
# Launches our binary with the pinned torch wheel's torchrun, as users do with `torchrun
# --no-python`: torchrun's agent hosts the TCPStore (TORCHELASTIC_USE_AGENT_STORE=True) and our
# ranks connect to it as clients.
#   1. `modalities dist check`: every collective on exact values, timings; the rendezvous line must
#      say that the ranks used torchrun's agent store;
#   2. `modalities run` of configs/distributed/fsdp2_cpu.toml cut to 6 steps (log interval 1, no
#      checkpoints) under torchrun and under `modalities launch`: the loss, grad norm and learning
#      rate of every step must be the same bit for bit.
# Needs a build (scripts/build.sh) and the Python environment of scripts/setup_bench_env.sh;
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
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
out="$(mktemp -d)"
trap 'rm -rf "${out}"' EXIT
"${torchrun}" --version 2>/dev/null | head -1 || true

echo "== torchrun --no-python ... dist check"
"${torchrun}" --standalone --nproc_per_node "${nproc}" --no-python \
  "${bin}" dist check --device cpu --timeout-s 60 --size-mb 1 --iters 2 | tee "${out}/check.log"
grep -q "torchrun agent store" "${out}/check.log" \
  || { echo "check_torchrun.sh: the ranks did not rendezvous through torchrun's agent store" >&2; exit 1; }

echo "== torchrun --no-python ... run, and modalities launch ... run (6 steps of fsdp2_cpu.toml)"
python3 "${root}/scripts/bench_training_config.py" --base "${root}/configs/distributed/fsdp2_cpu.toml" \
  --out "${out}/train.toml" --set settings.training_target.num_target_steps=6 \
  --set settings.intervals.training_log_interval_in_steps=1 --set settings.intervals.checkpointing_interval_in_steps=6 \
  --set settings.intervals.evaluation_interval_in_steps=6 \
  --set "checkpoint_saving.config.checkpoint_saving_strategy.config={ k = 0 }" --set scheduler.config.warmup_steps=2
MODALITIES_PROGRESS=0 "${torchrun}" --standalone --nproc_per_node "${nproc}" --no-python "${bin}" run \
  --config_file_path "${out}/train.toml" --experiments_root_path "${out}" --experiment_id torchrun >"${out}/torchrun.log" 2>&1 \
  || { tail -n 30 "${out}/torchrun.log" >&2; exit 1; }
MODALITIES_PROGRESS=0 "${bin}" launch --nproc-per-node "${nproc}" -- run \
  --config_file_path "${out}/train.toml" --experiments_root_path "${out}" --experiment_id launch >"${out}/launch.log" 2>&1 \
  || { tail -n 30 "${out}/launch.log" >&2; exit 1; }
# Every logged training step, without the timing fields.
steps() { grep '"dataloader_tag": "train"' "$1" | sed -E 's/"throughput_metrics".*"lr mean"/"lr mean"/; s/, "peak memory[^}]*//'; }
if ! diff <(steps "${out}/torchrun/evaluation_results.jsonl") <(steps "${out}/launch/evaluation_results.jsonl"); then
  echo "check_torchrun.sh: the run under torchrun differs from the run under modalities launch" >&2
  exit 1
fi
echo "$(steps "${out}/torchrun/evaluation_results.jsonl" | wc -l) logged steps identical under torchrun and modalities launch"
echo "check_torchrun.sh: torchrun --no-python with ${nproc} ranks: OK"
