#!/usr/bin/env bash
# Step time of our FSDP2 (model/fsdp2_wrapped) next to PyTorch's own FSDP2 (fully_shard), on the
# CPU with Gloo, at 1, 2 and 4 ranks, in one run: configs/distributed/fsdp2_cpu.toml (the
# quickstart's GPT-2, global batch 8 x 128 tokens) for --steps steps, both sides from the same
# weights (scripts/reference/fsdp2_reference.py draws and writes them; our run loads them with
# model/fsdp1_checkpointed). Each rank gets OMP_NUM_THREADS=1 on both sides. Reported: the median
# seconds per optimizer step over steps 3.. (ours from each logged step's "train samples/s", theirs
# timed around each step) and the ratio theirs / ours (> 1: we are faster).
#
#   scripts/bench_distributed.sh                # 1, 2, 4 ranks, 20 steps
#   scripts/bench_distributed.sh --ranks "1 2" --steps 30
# Needs build/bin/modalities (scripts/build.sh) and the .deps/bench venv (torch 2.11.0,
# modalities 0.5.0), created or updated by scripts/setup_bench_env.sh. On a machine with fewer
# cores than ranks the numbers say little about either side.
# Not measured yet: prefetching (not implemented) and bytes moved per step.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ranks="1 2 4"
steps=20
out="${root}/out/bench/distributed"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ranks) ranks="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "bench_distributed.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
"${root}/scripts/setup_bench_env.sh" >/dev/null
py="${root}/.deps/bench/bin/python"
host="${root}/build/bin/modalities"
[[ -x "${host}" ]] || { echo "bench_distributed.sh: ${host} is missing; run scripts/build.sh first" >&2; exit 1; }
rm -rf "${out}"
mkdir -p "${out}"
cd "${root}"
LOCAL_RANK=0 RANK=0 WORLD_SIZE=1 "${host}" config resolve configs/distributed/fsdp2_cpu.toml \
  --experiments_root_path "${out}" --experiment_id resolve > "${out}/resolved.toml"
export OMP_NUM_THREADS=1 MODALITIES_PROGRESS=0
for n in ${ranks}; do
  echo "== ${n} rank(s): PyTorch fully_shard"
  "${root}/.deps/bench/bin/torchrun" --standalone --nproc_per_node "${n}" scripts/reference/fsdp2_reference.py \
    --config "${out}/resolved.toml" --steps "${steps}" --warmup 4 --init "${out}/init.safetensors" \
    --out "${out}/pytorch_${n}.json" > "${out}/pytorch_${n}.log" 2>&1
  echo "== ${n} rank(s): model/fsdp2_wrapped"
  "${py}" - "${out}" "${steps}" <<'PY'
import pathlib, sys
out, steps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
text = pathlib.Path("configs/distributed/fsdp2_cpu.toml").read_text()
text = text.replace("${modalities_env:config_folder_path}/../../data", str(pathlib.Path("data").resolve()))
for a, b in [("num_target_steps = 80", f"num_target_steps = {steps}"), ("warmup_steps = 10", "warmup_steps = 4"),
             ("training_log_interval_in_steps = 5", "training_log_interval_in_steps = 1"),
             ("checkpointing_interval_in_steps = 20", f"checkpointing_interval_in_steps = {steps}"),
             ("evaluation_interval_in_steps = 20", f"evaluation_interval_in_steps = {steps}"),
             ("config = { k = 2 }", "config = { k = 0 }"), ("enforce_last_step_checkpointed = true", "enforce_last_step_checkpointed = false")]:
    assert a in text, a
    text = text.replace(a, b)
begin, end = text.index("[initialized_model]"), text.index("[model_raw]")
text = text[:begin] + f'''[initialized_model]
component_key = "model"
variant_key = "fsdp1_checkpointed"

[initialized_model.config]
checkpoint_path = "{(out / 'init.safetensors').resolve()}"
model = {{ instance_key = "model_raw", pass_type = "BY_REFERENCE" }}
checkpoint_loading = {{ component_key = "checkpoint_loading", variant_key = "torch", config = {{ device = "cpu" }} }}

''' + text[end:]
(out / "ours.toml").write_text(text)
PY
  "${host}" launch --nproc-per-node "${n}" --output rank0 -- run --config_file_path "${out}/ours.toml" \
    --experiments_root_path "${out}" --experiment_id "ours_${n}" > "${out}/ours_${n}.log" 2>&1
done
"${py}" - "${out}" "${ranks}" <<'PY'
import json, pathlib, statistics, sys
out, ranks = pathlib.Path(sys.argv[1]), [int(r) for r in sys.argv[2].split()]
print(f"\n{'ranks':>5}  {'PyTorch FSDP2 s/step':>20}  {'ours s/step':>11}  {'ratio (theirs/ours)':>19}  {'loss at the last step: theirs / ours':>36}")
for n in ranks:
    theirs = json.loads((out / f"pytorch_{n}.json").read_text())
    t = statistics.median(theirs["seconds_per_step"][2:])
    lines = [json.loads(l) for l in (out / f"ours_{n}" / "evaluation_results.jsonl").read_text().splitlines()
             if '"train loss avg"' in l]
    ours = [8 / l["throughput_metrics"]["train samples/s"] for l in lines][2:]
    o = statistics.median(ours)
    print(f"{n:>5}  {t:>20.3f}  {o:>11.3f}  {t / o:>19.2f}  {theirs['loss'][-1]:>17.6f} / {lines[-1]['losses']['train loss avg']:.6f}")
PY
