#!/usr/bin/env bash
# The CUDA build on a GPU machine: what runs, how it compares with Modalities' own Python
# components on the same GPU, and how fast. Run it after `scripts/build.sh cuda` on a machine with
# an NVIDIA GPU and the torch 2.11 (cu130) wheel's CUDA libraries (see docs/building.md):
#
#   scripts/bench_gpu.sh                                   # everything below, ~3 min on one H100/H200
#   scripts/bench_gpu.sh --only quickstart,gpt2            # some parts
#
#   collectives  `modalities dist check` with NCCL on every GPU of the machine (needs >= 2 GPUs;
#                NCCL refuses two ranks on one GPU)
#   ranks        several ranks on the one GPU through the staged test backend (MODALITIES_BACKEND=staged;
#                NCCL refuses two ranks on one GPU): `dist check` at 2 and 4 ranks, then
#                scripts/gpu_ranks.py: FSDP2 (2, 4), HSDP 2x2, FSDP1, TP2+SP, TP2 loss parallel, FSDP2xTP2,
#                PP2 (GPipe, 1F1B, interleaved), PP4 1F1B, PP2xFSDP2 in fp32 and FSDP2 in bf16 at 2 and 4 ranks, 20 steps each, against
#                one rank on the same global batch (fp32 within 1e-5 relative, bf16 within 2% / 3%)
#   quickstart   configs/quickstart/train.toml on cuda:0 (80 steps, fp32, checkpoints every 20),
#                warm start from the step-60 checkpoint (steps 61-80 must be bit for bit the same),
#                generate_text from the last checkpoint on the GPU
#   parity       scripts/bench_training.sh --device cuda on the quickstart config: Modalities'
#                components and ours from the same initial weights, fp32, loss of every step
#   gpt2         scripts/bench_training.sh --device cuda on configs/distributed/fsdp2_gpu_8.toml at
#                one rank: GPT-2 124M, FSDP2 with bf16 parameters and reductions, fused AdamW,
#                micro-batch 16 x 1024 tokens, 20 steps on the bundled data; PyTorch's fully_shard on
#                Modalities' GPT2LLM against ours, tokens/s and MFU
#   ac           fsdp2_gpu_8.toml at one rank (as gpt2, but without biases: Modalities' selective op
#                keeps only bias-free projections, aten.mm) without activation checkpointing (twice),
#                with selective-op (ops.aten.mm.default) and with full checkpointing: peak memory
#                and tokens/s; losses and grad norms compared step by step when the run without
#                checkpointing is reproducible on this GPU (bf16 CUDA kernels may not be)
#   configs      the single-GPU configs configs/gpu/gpt2_124m.toml and llama_1b.toml (bf16 compute,
#                fp32 master weights) for 20 / 12 steps without accumulation on the bundled data:
#                tokens/s, MFU and peak memory of ours (no Python peer: model/mixed_precision is ours)
#
# Options: --only LIST (comma-separated parts), --modalities PATH (default build-cuda/bin/modalities),
# --python PATH (an interpreter with torch 2.11 + CUDA, modalities 0.5.0 and safetensors; default the
# .deps/bench venv of scripts/setup_bench_env.sh), --out DIR (default out/bench/gpu).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
only="collectives,ranks,quickstart,parity,gpt2,ac,configs"
modalities="${root}/build-cuda/bin/modalities"
python=""
out="${root}/out/bench/gpu"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only) only="$2"; shift 2 ;;
    --modalities) modalities="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,35p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "bench_gpu.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -x "${modalities}" ]] || { echo "bench_gpu.sh: ${modalities} is missing (scripts/build.sh cuda)" >&2; exit 1; }
modalities="$(cd "$(dirname "${modalities}")" && pwd)/$(basename "${modalities}")"
command -v nvidia-smi >/dev/null || { echo "bench_gpu.sh: nvidia-smi not found: no NVIDIA GPU here" >&2; exit 1; }
py_args=()
[[ -n "${python}" ]] && py_args=(--python "${python}")
mkdir -p "${out}"
out="$(cd "${out}" && pwd)"
want() { [[ ",${only}," == *",$1,"* ]]; }
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
failed=()

step "GPU and build"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
"${modalities}" --version
gpus="$(nvidia-smi -L | grep -c '^GPU ')"

if want collectives; then
  step "collectives: modalities dist check over NCCL"
  if (( gpus >= 2 )); then
    "${modalities}" launch --nproc-per-node "${gpus}" -- dist check --backend nccl --size-mb 64 \
      || failed+=(collectives)
  else
    echo "skipped: one GPU (NCCL needs one GPU per rank)"
  fi
fi

if want ranks; then
  step "ranks: several ranks on cuda:0 through the staged test backend"
  for n in 2 4; do
    MODALITIES_BACKEND=staged timeout -k 5 120 "${modalities}" launch --nproc-per-node "${n}" -- dist check \
      --device cuda:0 --timeout-s 60 \
      --size-mb 16 --iters 3 2>&1 | tee "${out}/dist_check_staged_${n}.log" | grep -v '^\[rank [1-9]' \
      || failed+=("ranks/dist-check-${n}")
    grep -q "all exact on every rank" "${out}/dist_check_staged_${n}.log" || failed+=("ranks/dist-check-${n}")
  done
  python3 "${root}/scripts/gpu_ranks.py" --modalities "${modalities}" --device cuda:0 --timeout-s 120 --out "${out}/ranks" \
    || failed+=(ranks)
fi

# The GPU parts train 20 steps of 16 x 1024 tokens (327 680 + 1): more than the 233 300 tokens of
# data/sample/train.pbin, so they read three copies of it merged into one file.
if want gpt2 || want ac || want configs; then
  mkdir -p "${out}/data"
  rm -f "${out}/data/train_x3.pbin"
  "${modalities}" data merge_packed_data "${root}/data/sample/train.pbin" "${root}/data/sample/train.pbin" \
    "${root}/data/sample/train.pbin" "${out}/data/train_x3.pbin" >/dev/null
  export MODALITIES_BENCH_DATA="${out}/data/train_x3.pbin"
fi

if want quickstart; then
  step "quickstart on cuda:0: train 80 steps, warm start from step 60, generate"
  exp="${out}/experiments"
  rm -rf "${exp}"
  if (cd "${root}" && MODALITIES_DEVICE=cuda MODALITIES_PROGRESS=0 "${modalities}" run \
        --config_file_path configs/quickstart/train.toml --experiments_root_path "${exp}" \
        --experiment_id quickstart >"${out}/quickstart.log" 2>&1); then
    grep -E "device|step +80|train loss" "${out}/quickstart.log" | tail -n 3 || true
    checkpoint="$(ls -d "${exp}"/quickstart/checkpoints/eid_quickstart-seen_steps_60-*)"
    printf '{"checkpoint_folder_path": "%s"}\n' "${checkpoint}" >"${exp}/resume_from_step_60.json"
    (cd "${root}" && MODALITIES_DEVICE=cuda MODALITIES_PROGRESS=0 "${modalities}" warmstart \
      --config_file_path configs/quickstart/warmstart.toml --experiments_root_path "${exp}" \
      --experiment_id quickstart_resumed --last_checkpoint_info_file_path "${exp}/resume_from_step_60.json" \
      >"${out}/warmstart.log" 2>&1) || { tail -n 20 "${out}/warmstart.log"; failed+=(warmstart); }
    strip() { grep '"dataloader_tag": "train"' "$1" | sed -E 's/"throughput_metrics".*"lr mean"/"lr mean"/; s/, "peak memory[^}]*//' | tail -n 4; }
    if diff <(strip "${exp}/quickstart/evaluation_results.jsonl") \
            <(strip "${exp}/quickstart_resumed/evaluation_results.jsonl") >"${out}/warmstart.diff"; then
      echo "warm start on the GPU reproduces steps 61-80 exactly (train loss, grad norm, lr of every logged step)"
    else
      echo "warm start on the GPU differs from the uninterrupted run (${out}/warmstart.diff)"
      failed+=(warmstart-exact)
    fi
    # The quickstart's generation config, pointed at this run's last checkpoint and the GPU.
    last="$(ls -d "${exp}"/quickstart/checkpoints/eid_quickstart-seen_steps_80-*)"
    sed -E -e "s|\\$\\{modalities_env:config_folder_path\\}/\\.\\./\\.\\.|${root}|g" \
      -e "s|^model_path = .*|model_path = \"${last}\"|" -e 's|^device = "cpu"|device = "cuda"|' \
      "${root}/configs/quickstart/generate.toml" >"${out}/generate.toml"
    echo "Lorem ipsum dolor sit amet" | "${modalities}" generate_text --config_file_path "${out}/generate.toml" \
      >"${out}/generate.log" 2>&1 && tail -n 4 "${out}/generate.log" || { tail -n 20 "${out}/generate.log"; failed+=(generate); }
  else
    tail -n 30 "${out}/quickstart.log"
    failed+=(quickstart)
  fi
fi

if want parity; then
  step "parity: Modalities' components vs ours on cuda:0, quickstart config, fp32, same initial weights"
  "${root}/scripts/bench_training.sh" --device cuda --modalities "${modalities}" "${py_args[@]}" \
    --steps 80 --out "${out}/parity" || failed+=(parity)
fi

if want gpt2; then
  step "gpt2: GPT-2 124M, FSDP2 bf16 at one rank, micro-batch 16 x 1024, 20 steps"
  "${root}/scripts/bench_training.sh" --device cuda --modalities "${modalities}" "${py_args[@]}" \
    --base "${root}/configs/distributed/fsdp2_gpu_8.toml" --steps 20 --out "${out}/gpt2" \
    --set "settings.step_profile.gradient_accumulation_steps=1" \
    --set 'settings.step_profile.local_train_micro_batch_size.config={ global_batch_size = 16, dp_degree = "${settings.step_profile.dp_degree}", gradient_accumulation_steps = "${settings.step_profile.gradient_accumulation_steps}" }' \
    --set "scheduler.config.warmup_steps=4" || failed+=(gpt2)
  if [[ -f "${out}/gpt2/exp/ours/evaluation_results.jsonl" && -f "${out}/gpt2/summary.json" ]]; then
    python3 - "${out}/gpt2/exp/ours/evaluation_results.jsonl" "${out}/gpt2/summary.json" <<'EOF'
import json, statistics, sys
mfu = [r["throughput_metrics"].get("train mfu (16-bit)") for r in map(json.loads, open(sys.argv[1]))
       if r.get("dataloader_tag") == "train"]
mfu = [m for m in mfu[1:] if m is not None and m > 0]
s = json.load(open(sys.argv[2]))
if mfu:
    ours = statistics.median(mfu)
    peer = ours / s["ratio_ours_over_modalities_median"]
    print(f"MFU (median of steps 2-{len(mfu) + 1}, mfu_calculator/gpt2): ours {ours:.3f}, "
          f"Modalities (same formula, from its tokens/s) {peer:.3f}")
else:
    print("MFU: the mfu calculator reported none (GPU not in its table?)")
EOF
  fi
fi

if want ac; then
  step "ac: GPT-2 124M, FSDP2 bf16 at one rank: no / selective-op / full activation checkpointing"
  mkdir -p "${out}/ac"
  python3 "${root}/scripts/bench_training_config.py" --base "${root}/configs/distributed/fsdp2_gpu_8.toml" \
    --out "${out}/ac/plain.toml" --set "settings.training_target.num_target_steps=20" \
    --set "settings.intervals.training_log_interval_in_steps=1" \
    --set "settings.intervals.checkpointing_interval_in_steps=20" \
    --set "settings.intervals.evaluation_interval_in_steps=20" \
    --set "checkpoint_saving.config.checkpoint_saving_strategy.config={ k = 0 }" \
    --set "settings.step_profile.gradient_accumulation_steps=1" \
    --set 'settings.step_profile.local_train_micro_batch_size.config={ global_batch_size = 16, dp_degree = "${settings.step_profile.dp_degree}", gradient_accumulation_steps = "${settings.step_profile.gradient_accumulation_steps}" }' \
    --set "scheduler.config.warmup_steps=4" --set "model_raw.config.bias=false"
  # The checkpointed variants wrap the initialized model before sharding (Modalities' order).
  python3 - "${out}/ac" <<'EOF'
import pathlib, sys
d = pathlib.Path(sys.argv[1])
plain = (d / "plain.toml").read_text()
old = '[model.config]\nmodel = { instance_key = "initialized_model"'
assert old in plain
for name, params in (("selective_op", '{ save_ops_keys = ["ops.aten.mm.default"] }'), ("full", "{}")):
    variant = "selective_op_activation_checkpointing" if name == "selective_op" else "full_activation_checkpointing"
    text = plain.replace(old, '[model.config]\nmodel = { instance_key = "checkpointed_model"')
    text += (f'\n[checkpointed_model]\ncomponent_key = "model"\nvariant_key = "activation_checkpointed"\n'
             f'config = {{ ac_variant = "{variant}", layers_fqn = "transformer.h", model = {{ instance_key = '
             f'"initialized_model", pass_type = "BY_REFERENCE" }}, ac_fun_params = {params} }}\n')
    (d / f"{name}.toml").write_text(text)
EOF
  cp "${out}/ac/plain.toml" "${out}/ac/plain_again.toml"
  for name in plain plain_again selective_op full; do
    rm -rf "${out}/ac/exp/${name}"
    MODALITIES_PROGRESS=0 "${modalities}" run --config_file_path "${out}/ac/${name}.toml" \
      --experiments_root_path "${out}/ac/exp" --experiment_id "${name}" >"${out}/ac/${name}.log" 2>&1 \
      || { tail -n 20 "${out}/ac/${name}.log"; failed+=("ac/${name}"); }
  done
  python3 - "${out}/ac/exp" <<'EOF' || failed+=(ac-compare)
import json, pathlib, statistics, sys
exp = pathlib.Path(sys.argv[1])
runs = {}
for name in ("plain", "plain_again", "selective_op", "full"):
    f = exp / name / "evaluation_results.jsonl"
    if f.exists():
        runs[name] = [r for r in map(json.loads, f.open()) if r.get("dataloader_tag") == "train"]
if len(runs) != 4:
    sys.exit(1)
curve = lambda rs: [(r["losses"], r["metrics"]) for r in rs]
reproducible = curve(runs["plain"]) == curve(runs["plain_again"])
for name, rs in runs.items():
    tps = statistics.median(r["throughput_metrics"]["train samples/s"] for r in rs[1:]) * 1024
    mem = max(v for r in rs for k, v in r["throughput_metrics"].items() if k.startswith("peak memory"))
    same = "identical to" if curve(rs) == curve(runs["plain"]) else "different from"
    print(f"{name:>13}: {tps:8.0f} tokens/s (median), peak memory {mem / 1024:6.2f} GiB, "
          f"losses and grad norms {same} the first run without checkpointing")
if reproducible:
    bad = [n for n in ("selective_op", "full") if curve(runs[n]) != curve(runs["plain"])]
    if bad:
        print(f"checkpointing changed the results of a reproducible run: {bad}")
        sys.exit(1)
else:
    print("the run without checkpointing is not reproducible on this GPU (two runs differ), so the curves of the "
          "checkpointed runs cannot be compared bit for bit here; the CPU tests compare them (plugins/model_wrappers)")
EOF
fi

if want configs; then
  for name in gpt2_124m llama_1b; do
    steps=20
    [[ "${name}" == llama_1b ]] && steps=12
    step "configs/gpu/${name}.toml: ${steps} steps, accumulation 1"
    mkdir -p "${out}/configs"
    python3 "${root}/scripts/bench_training_config.py" --base "${root}/configs/gpu/${name}.toml" \
      --out "${out}/configs/${name}.toml" --set "settings.training_target.num_target_steps=${steps}" \
      --set "settings.intervals.training_log_interval_in_steps=1" \
      --set "settings.intervals.checkpointing_interval_in_steps=${steps}" \
      --set "settings.intervals.evaluation_interval_in_steps=${steps}" \
      --set "checkpoint_saving.config.checkpoint_saving_strategy.config={ k = 0 }" \
      --set "settings.step_profile.gradient_accumulation_steps=1" --set "scheduler.config.warmup_steps=2"
    rm -rf "${out}/configs/exp/${name}"
    if MODALITIES_PROGRESS=0 "${modalities}" run --config_file_path "${out}/configs/${name}.toml" \
         --experiments_root_path "${out}/configs/exp" --experiment_id "${name}" >"${out}/configs/${name}.log" 2>&1; then
      python3 - "${out}/configs/exp/${name}/evaluation_results.jsonl" "${out}/configs/${name}.toml" <<'EOF'
import json, statistics, sys, tomllib
sp = tomllib.load(open(sys.argv[2], "rb"))["settings"]["step_profile"]
rs = [r for r in map(json.loads, open(sys.argv[1])) if r.get("dataloader_tag") == "train"][1:]
tps = statistics.median(r["throughput_metrics"]["train samples/s"] for r in rs) * sp["sequence_length"]
mfu = statistics.median(r["throughput_metrics"].get("train mfu (16-bit)", -1) for r in rs)
mem = max(v for r in rs for k, v in r["throughput_metrics"].items() if k.startswith("peak memory"))
print(f"steps 2-{len(rs) + 1}: {tps:.0f} tokens/s (median), MFU {mfu:.3f}, peak memory {mem / 1024:.1f} GiB, "
      f"loss {rs[0]['losses']['train loss avg']:.3f} -> {rs[-1]['losses']['train loss avg']:.3f}")
EOF
    else
      tail -n 20 "${out}/configs/${name}.log"
      failed+=("configs/${name}")
    fi
  done
fi

echo
if (( ${#failed[@]} )); then
  echo "bench_gpu.sh: failed: ${failed[*]} (logs in ${out})" >&2
  exit 1
fi
echo "bench_gpu.sh: all parts passed (${only}); outputs in ${out}"
