#!/usr/bin/env bash
# Step time of our FSDP2 (model/fsdp2_wrapped) next to PyTorch's own FSDP2 (fully_shard), on the
# CPU with Gloo, at 1, 2 and 4 ranks, in one run: configs/distributed/fsdp2_cpu.toml (the
# quickstart's GPT-2, global batch 8 x 128 tokens) for --steps steps, both sides from the same
# weights (scripts/reference/fsdp2_reference.py draws and writes them; our run loads them with
# model/fsdp1_checkpointed). Each rank gets OMP_NUM_THREADS=1 on both sides. Reported: the median
# seconds per optimizer step over steps 3.. (ours from each logged step's "train samples/s", theirs
# timed around each step) and the ratio theirs / ours (> 1: we are faster), ours with prefetching
# of the next unit's all-gather on and off, and our collective traffic per step (the bytes of the
# all-gather outputs and reduce-scatter inputs on rank 0, MODALITIES_FSDP_TRAFFIC) next to the
# theoretical amount: all-gathered = every unit in forward + every block unit again in backward,
# reduce-scattered = every unit once. (Gloo runs a reduce-scatter as an all-reduce, twice the wire
# bytes of a ring reduce-scatter; these are the buffers asked for, not the wire.)
#
#   scripts/bench_distributed.sh                # 1, 2, 4 ranks, 20 steps
#   scripts/bench_distributed.sh --ranks "1 2" --steps 30
#   scripts/bench_distributed.sh --layouts      # tensor / pipeline parallel layouts instead (no PyTorch)
#
# --layouts: step time of every parallel layout of the quickstart model on 2 ranks (one process,
# FSDP2, TP2 with and without sequence and loss parallelism, PP2 with each schedule;
# configs/distributed/{fsdp2,tp,pp}_cpu.toml), and for the pipelines the bubble: each rank's
# fraction of the step it spent outside forward and backward computations (MODALITIES_PIPELINE_TIMING),
# next to the theoretical (p-1)/(m+p-1), or (p-1)/(v m+p-1) interleaved, for p = 2 ranks, m = 4
# pipeline micro-batches, v stages per rank. The theory assumes equal stages; the GPT-2 here puts
# the 50k-vocabulary head on the last stage, so the measured bubble is dominated by that imbalance.
# Needs build/bin/modalities (scripts/build.sh) and the .deps/bench venv (torch 2.11.0,
# modalities 0.5.0), created or updated by scripts/setup_bench_env.sh. On a machine with fewer
# cores than ranks the numbers say little about either side.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ranks="1 2 4"
steps=20
layouts=0
out="${root}/out/bench/distributed"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ranks) ranks="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --layouts) layouts=1; shift ;;
    -h|--help) sed -n '2,25p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "bench_distributed.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
host="${root}/build/bin/modalities"
[[ -x "${host}" ]] || { echo "bench_distributed.sh: ${host} is missing; run scripts/build.sh first" >&2; exit 1; }
if [[ "${layouts}" == 1 ]]; then
  out="${out}_layouts"
  rm -rf "${out}"
  mkdir -p "${out}"
  cd "${root}"
  export OMP_NUM_THREADS=1 MODALITIES_PROGRESS=0 MODALITIES_PIPELINE_TIMING=1
  python3 - "${out}" "${steps}" "${host}" <<'PY'
import json, pathlib, re, statistics, subprocess, sys
out, steps, host = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def config(file, edits=()):
    text = pathlib.Path("configs/distributed", file).read_text()
    text = text.replace("${modalities_env:config_folder_path}/../../data", str(pathlib.Path("data").resolve()))
    for a, b in [("num_target_steps = 80", f"num_target_steps = {steps}"), ("warmup_steps = 10", "warmup_steps = 4"),
                 ("training_log_interval_in_steps = 5", "training_log_interval_in_steps = 1"),
                 ("checkpointing_interval_in_steps = 20", f"checkpointing_interval_in_steps = {steps}"),
                 ("evaluation_interval_in_steps = 20", f"evaluation_interval_in_steps = {steps}"),
                 ("config = { k = 2 }", "config = { k = 0 }"),
                 ("enforce_last_step_checkpointed = true", "enforce_last_step_checkpointed = false"), *edits]:
        assert a in text, (file, a)
        text = text.replace(a, b, 1)
    return text
untied = ("use_weight_tying = true", "use_weight_tying = false")
def pp(schedule, per_stage=2):
    return [("pp_schedule_name = \"gpipe\"", f"pp_schedule_name = \"{schedule}\"")] * 2 + \
           [("num_layers_per_stage = 2", f"num_layers_per_stage = {per_stage}")]
layouts = [  # name, ranks, config, (p, v) of a pipeline
    ("one process", 1, config("fsdp2_cpu.toml"), None),
    ("one process, untied (PP's peer)", 1, config("fsdp2_cpu.toml", [untied]), None),
    ("FSDP2 x2", 2, config("fsdp2_cpu.toml"), None),
    ("TP2", 2, config("tp_cpu.toml", [("sequence_parallel = true", "sequence_parallel = false")]), None),
    ("TP2 + SP", 2, config("tp_cpu.toml"), None),
    ("TP2 + SP + loss parallel", 2, config("tp_cpu.toml", [("enable_loss_parallel = false", "enable_loss_parallel = true")]), None),
    ("PP2 GPipe", 2, config("pp_cpu.toml", pp("gpipe")), (2, 1)),
    ("PP2 1F1B", 2, config("pp_cpu.toml", pp("1F1B")), (2, 1)),
    ("PP2 interleaved 1F1B, v=2", 2, config("pp_cpu.toml", pp("Interleaved1F1B", 1)), (2, 2)),
    ("PP2 looped BFS, v=2", 2, config("pp_cpu.toml", pp("LoopedBFS", 1)), (2, 2)),
    # Balanced: the head (50k-vocabulary projection and loss) counted as 3 blocks gives
    # [embeddings, h.0, h.1] and [head].
    ("PP2 1F1B, head = 3 blocks", 2,
     config("pp_cpu.toml", pp("1F1B", 3) + [("output_layer_equivalence = 1", "output_layer_equivalence = 3")]), (2, 1)),
]
m = 4  # pipeline micro-batches per step: 8 samples / microbatch_size 2
print(f"{'layout':<34} {'ranks':>5} {'s/step':>8} {'vs one process':>15} {'bubble measured':>16} {'theory':>7}")
base = None
for i, (name, ranks, text, pipe) in enumerate(layouts):
    cfg = out / f"layout_{i}.toml"
    cfg.write_text(text)
    cmd = [host] + (["launch", "--nproc-per-node", str(ranks), "--"] if ranks > 1 else []) + \
          ["run", "--config_file_path", str(cfg), "--experiments_root_path", str(out), "--experiment_id", f"layout_{i}"]
    log = subprocess.run(cmd, capture_output=True, text=True)
    (out / f"layout_{i}.log").write_text(log.stdout + log.stderr)
    if log.returncode != 0:
        print(f"{name:<34} failed (see {out}/layout_{i}.log)")
        continue
    lines = [json.loads(l) for l in (out / f"layout_{i}" / "evaluation_results.jsonl").read_text().splitlines()
             if '"train loss avg"' in l]
    step = statistics.median([8 / l["throughput_metrics"]["train samples/s"] for l in lines][2:])
    base = base if base is not None else step
    measured = theory = ""
    if pipe:
        idle = [float(x) for x in re.findall(r"idle fraction ([0-9.]+)", log.stdout + log.stderr)]
        per_rank = len(idle) // steps
        measured = f"{statistics.mean(idle[2 * per_rank:]):.3f}" if idle else "?"
        p, v = pipe
        if "looped" not in name:  # looped BFS has no closed form here
            theory = f"{(p - 1) / (v * m + p - 1):.3f}" if "interleaved" in name else f"{(p - 1) / (m + p - 1):.3f}"
    print(f"{name:<34} {ranks:>5} {step:>8.3f} {step / base:>15.2f} {measured:>16} {theory:>7}")
PY
  exit 0
fi
"${root}/scripts/setup_bench_env.sh" >/dev/null
py="${root}/.deps/bench/bin/python"
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
assert "reshard_after_forward = true" in text
(out / "ours_noprefetch.toml").write_text(text.replace("reshard_after_forward = true",
                                                       "reshard_after_forward = true\nprefetch = false"))
PY
  for variant in ours ours_noprefetch; do
    MODALITIES_FSDP_TRAFFIC=1 "${host}" launch --nproc-per-node "${n}" --output rank0 -- run \
      --config_file_path "${out}/${variant}.toml" --experiments_root_path "${out}" --experiment_id "${variant}_${n}" \
      > "${out}/${variant}_${n}.log" 2>&1
  done
done
"${py}" - "${out}" "${ranks}" "${steps}" <<'PY'
import json, pathlib, re, statistics, sys
out, ranks, steps = pathlib.Path(sys.argv[1]), [int(r) for r in sys.argv[2].split()], int(sys.argv[3])
def ours(name):
    lines = [json.loads(l) for l in (out / name / "evaluation_results.jsonl").read_text().splitlines()
             if '"train loss avg"' in l]
    return statistics.median([8 / l["throughput_metrics"]["train samples/s"] for l in lines][2:]), lines
def traffic(name):
    m = re.search(r"fsdp traffic: all-gathered (\d+) bytes, reduce-scattered (\d+) bytes; model (\d+) bytes "
                  r"\(root unit (\d+)\)", (out / f"{name}.log").read_text())
    return [int(x) for x in m.groups()] if m else None
print(f"\n{'ranks':>5}  {'PyTorch s/step':>14}  {'ours s/step':>11}  {'theirs/ours':>11}  "
      f"{'ours, no prefetch':>17}  {'theirs/ours':>11}  {'last loss: theirs / ours':>25}")
for n in ranks:
    theirs = json.loads((out / f"pytorch_{n}.json").read_text())
    t = statistics.median(theirs["seconds_per_step"][2:])
    o, lines = ours(f"ours_{n}")
    o2, _ = ours(f"ours_noprefetch_{n}")
    print(f"{n:>5}  {t:>14.3f}  {o:>11.3f}  {t / o:>11.2f}  {o2:>17.3f}  {t / o2:>11.2f}  "
          f"{theirs['loss'][-1]:>11.6f} / {lines[-1]['losses']['train loss avg']:.6f}")
print(f"\n{'ranks':>5}  {'all-gathered MB/step':>20}  {'theory':>8}  {'reduce-scattered MB/step':>24}  {'theory':>8}")
for n in ranks:
    tr = traffic(f"ours_{n}")
    if tr is None:
        continue
    gathered, reduced, model, root = tr
    print(f"{n:>5}  {gathered / steps / 1e6:>20.2f}  {(2 * model - root) / 1e6:>8.2f}  "
          f"{reduced / steps / 1e6:>24.2f}  {model / 1e6:>8.2f}")
PY
