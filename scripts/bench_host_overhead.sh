#!/usr/bin/env bash
# Host overhead per optimizer step: the time a training step spends outside the math kernels.
#
# Method: the quickstart's component graph and model structure (2 layers, 8 query / 4 key-value
# heads, RoPE, SwiGLU, RMSNorm, tied embedding: the same ops and parameter tensors per step)
# shrunk until the kernels take microseconds: vocab 128 (a copy of the bundled lorem-ipsum tokens
# modulo 128), ffn_hidden 128 (n_embd stays 128: Modalities wants both multiples of 128),
# sequence 8, micro-batch 1. What remains of a step is
# host work: batch fetch and collation, op dispatch, autograd bookkeeping, the loss, clipping's
# norm, AdamW over every tensor, the scheduler, progress messages and the gym's own code. The
# measured ms/step is therefore an upper bound of the overhead the quickstart model pays per step.
# Logging as Modalities would run it: log interval `--window` steps (one JSONL record per window,
# whose "train samples/s" gives the window's ms/step; the first window, with warm-up, is dropped).
# The same config runs through Modalities' components in PyTorch eager
# (scripts/reference/train_reference.py, per-step timer, loss.item() per step as Modalities does).
# The data loader runs inline (num_workers = 0) on both sides: the reference uses PyTorch's
# DataLoader with its default num_workers = 0. (With a worker thread, handing each batch over
# costs a thread wake-up per step, ~60 us on a 2-vCPU VM where waking the idle vCPU is a VM
# exit: more than producing the ~100-byte batch inline, ~20 us. Negligible for real steps.)
# One intra-op thread by default: these ops are far below ATen's parallel grain size, and a
# two-thread OpenMP pool on a busy machine measures the scheduler, not the framework.
#
# --perf additionally profiles both (perf record, after a delay that skips start-up) and splits the
# samples into kernels / allocator / Python / our code / the rest of LibTorch
# (scripts/bench_perf_split.py), giving the host part of the measured ms/step.
#
# --repeat N (default 3) runs both sides N times, alternating, and reports the median and the
# fastest window over all runs: on a shared machine the speed drifts by tens of percent between
# minutes; the fastest window is the least disturbed measurement, the ratio is robust to drift.
#
#   scripts/bench_host_overhead.sh [--steps 3000] [--window 500] [--threads 1] [--repeat 3] [--perf] [--out DIR]
# Needs build/bin/modalities (scripts/build.sh) and the .deps/bench venv (modalities 0.5.0, torch 2.11.0,
# safetensors), which it creates or updates first with scripts/setup_bench_env.sh (a no-op when current).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
steps=3000
window=500
threads=1
repeat=3
profile=0
out="${root}/out/bench/host_overhead"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --window) window="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --repeat) repeat="$2"; shift 2 ;;
    --perf) profile=1; shift ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,33p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "bench_host_overhead.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if (( steps % window != 0 || steps / window < 2 )); then
  echo "bench_host_overhead.sh: --steps ${steps} must be a multiple of --window ${window}, at least two windows" >&2
  exit 2
fi
python="${root}/.deps/bench/bin/python"
modalities="${root}/build/bin/modalities"
[[ -x "${modalities}" ]] || { echo "bench_host_overhead.sh: ${modalities} is missing (see scripts/setup.sh / scripts/build.sh)" >&2; exit 1; }
# The Python side: Modalities 0.5.0 and torch 2.11.0 as pinned in scripts/bench-requirements.txt.
"${root}/scripts/setup_bench_env.sh"
[[ -x "${python}" ]] || { echo "bench_host_overhead.sh: ${python} is missing (scripts/setup_bench_env.sh failed?)" >&2; exit 1; }
mkdir -p "${out}"
out="$(cd "${out}" && pwd)"
rm -rf "${out}/exp"

# 1. data/sample/train.pbin with every token id taken modulo 128 (same layout: 2-byte tokens,
#    index [(0, data_len)]; continuous datasets do not read the index).
python3 - "${root}/data/sample/train.pbin" "${out}/vocab128.pbin" <<'EOF'
import pickle, struct, sys
src = open(sys.argv[1], "rb").read()
data_len, token_size = struct.unpack_from("<QI", src, 0)
assert token_size == 2, token_size
ids = struct.unpack_from(f"<{data_len // 2}H", src, 12)
data = struct.pack(f"<{len(ids)}H", *(i % 128 for i in ids))
with open(sys.argv[2], "wb") as f:
    f.write(struct.pack("<QI", len(data), 2) + data + pickle.dumps([(0, len(data))], protocol=4))
EOF

# 2. The tiny config: the quickstart's graph, model loaded from the reference's init weights.
python3 "${root}/scripts/bench_training_config.py" --base "${root}/configs/quickstart/train.toml" \
  --out "${out}/train.toml" --init "${out}/init.safetensors" \
  --set "settings.paths.train_dataset_path=\"${out}/vocab128.pbin\"" \
  --set "settings.step_profile.local_train_micro_batch_size=1" \
  --set "settings.step_profile.sequence_length=8" \
  --set "settings.training_target.num_target_steps=${steps}" \
  --set "settings.intervals.training_log_interval_in_steps=${window}" \
  --set "settings.intervals.checkpointing_interval_in_steps=${steps}" \
  --set "settings.intervals.evaluation_interval_in_steps=${steps}" \
  --set "checkpoint_saving.config.checkpoint_saving_strategy.config={ k = 0 }" \
  --set "train_dataloader.config.num_workers=0" \
  --set "model_raw.config.vocab_size=128" \
  --set "model_raw.config.ffn_hidden=128"
RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 "${modalities}" config resolve "${out}/train.toml" \
  --experiments_root_path "${out}/exp" --experiment_id ours >"${out}/resolved.toml"

export OMP_NUM_THREADS="${threads}" MKL_NUM_THREADS="${threads}"
run_ours() {
  rm -rf "${out}/exp"
  MODALITIES_PROGRESS=0 "$@" "${modalities}" run --config_file_path "${out}/train.toml" \
    --experiments_root_path "${out}/exp" --experiment_id ours >"${out}/ours.log" 2>&1 \
    || { tail -20 "${out}/ours.log" >&2; exit 1; }
}
# Repetitions alternate the two sides, so that a shared machine's slow and fast phases fall on both.
for ((rep = 1; rep <= repeat; ++rep)); do
  echo "== [${rep}/${repeat}] Modalities components (PyTorch eager, ${threads} threads): ${steps} steps"
  (cd "${out}" && "${python}" "${root}/scripts/reference/train_reference.py" --config resolved.toml \
    --init init.safetensors --out "reference_${rep}.json" --threads "${threads}" 2>&1 | grep -v "^Expected .ffn_hidden")
  echo "== [${rep}/${repeat}] modalities run (LibTorch, OMP_NUM_THREADS=${threads}): ${steps} steps, one record per ${window}"
  run_ours
  cp "${out}/exp/ours/evaluation_results.jsonl" "${out}/ours_${rep}.jsonl"
done

python3 - "${out}" "${window}" "${repeat}" <<'EOF'
import json, statistics, sys
out, window, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ours, py, losses = [], [], []
for rep in range(1, repeat + 1):
    ref = json.load(open(f"{out}/reference_{rep}.json"))
    recs = [json.loads(l) for l in open(f"{out}/ours_{rep}.jsonl")]
    # Batch 1: a window of `window` steps has `window` samples, so ms/step = 1000 / (samples/s).
    o = [1000.0 / r["throughput_metrics"]["train samples/s"] for r in recs if r["dataloader_tag"] == "train"][1:]
    steps = [1000.0 * s for s in ref["step_seconds"][window:]]  # the first window dropped, as for ours
    p = [statistics.fmean(steps[i:i + window]) for i in range(0, len(steps), window)]
    print(f"[{rep}] ours, ms/step per {window}-step window (first dropped): " + ", ".join(f"{x:.3f}" for x in o))
    print(f"[{rep}] Modalities (PyTorch eager), ms/step per window:        " + ", ".join(f"{x:.3f}" for x in p))
    ours += o
    py += p
    losses.append((recs[-1]["losses"]["train loss last"], ref["loss"][-1]))
o, p = statistics.median(ours), statistics.median(py)
print(f"median ms/step over {len(ours)} windows: ours {o:.3f}, Modalities {p:.3f}; Modalities/ours {p / o:.1f}x")
print(f"fastest window: ours {min(ours):.3f}, Modalities {min(py):.3f}; Modalities/ours {min(py) / min(ours):.1f}x")
print("final loss: " + "; ".join(f"ours {a:.6f}, Modalities {b:.6f}" for a, b in losses))
json.dump({"ms_per_step_ours": o, "ms_per_step_modalities": p, "min_ms_per_step_ours": min(ours),
           "min_ms_per_step_modalities": min(py), "windows_ours": ours, "windows_modalities": py},
          open(f"{out}/summary.json", "w"), indent=1)
EOF

if (( profile )); then
  command -v perf >/dev/null || { echo "bench_host_overhead.sh: --perf needs perf" >&2; exit 1; }
  read -r ms_ours ms_py min_ours min_py < <(python3 -c "import json; s = json.load(open('${out}/summary.json')); \
print(s['ms_per_step_ours'], s['ms_per_step_modalities'], s['min_ms_per_step_ours'], s['min_ms_per_step_modalities'])")
  echo "== perf: modalities run (recording from 1.5 s on)"
  run_ours perf record -q -F 2000 --delay 1500 -o "${out}/perf_ours.data"
  echo "== perf: Modalities components (recording from 8 s on)"
  (cd "${out}" && perf record -q -F 2000 --delay 8000 -o perf_modalities.data "${python}" \
    "${root}/scripts/reference/train_reference.py" --config resolved.toml --init init_perf.safetensors \
    --out reference_perf.json --threads "${threads}" 2>&1 | grep -v "^Expected .ffn_hidden")
  for side in ours modalities; do
    perf report -i "${out}/perf_${side}.data" --no-children --sort dso,sym 2>/dev/null >"${out}/perf_${side}.txt"
  done
  echo "split of the median step:"
  python3 "${root}/scripts/bench_perf_split.py" "${out}/perf_ours.txt" --ms-per-step "${ms_ours}" --label "  ours:       "
  python3 "${root}/scripts/bench_perf_split.py" "${out}/perf_modalities.txt" --ms-per-step "${ms_py}" \
    --label "  Modalities: "
  echo "split of the fastest window:"
  python3 "${root}/scripts/bench_perf_split.py" "${out}/perf_ours.txt" --ms-per-step "${min_ours}" --label "  ours:       "
  python3 "${root}/scripts/bench_perf_split.py" "${out}/perf_modalities.txt" --ms-per-step "${min_py}" \
    --label "  Modalities: "
fi
