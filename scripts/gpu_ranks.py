#!/usr/bin/env python3
"""Several ranks on one GPU: every parallelism's CUDA path against one rank on the same global batch.

NCCL refuses two ranks on one GPU, so the ranks use the staged test backend (MODALITIES_BACKEND=staged:
Gloo, CUDA tensors staged through pinned host memory on a side stream, NCCL's work semantics). Each
layout trains the configs/distributed/*_cpu.toml model (untied weights, global batch 8 x 128 tokens)
for --steps steps on --device; its loss and grad norm at every step are compared with one rank:

  fp32: within 1e-5 relative, or 10x the noise floor (one rank, 2 x 4 accumulation against 8 x 1) if that
        is larger, as the CPU suite does (tests/distributed);
  bf16: FSDP2 with bf16 parameters and reductions at 2 and 4 ranks against the same at one rank: loss
        within 2%, grad norm within 3% (bf16 has 8 bits of mantissa), as the CPU suite's bf16 test.

  scripts/gpu_ranks.py --modalities build-cuda/bin/modalities --device cuda:0 --out out/gpu_ranks
  scripts/gpu_ranks.py --device cpu --steps 6 --only fsdp2_2,tp2_sp     # the same on the CPU build

Writes <out>/summary.txt (every curve and the verdicts) and <out>/summary.json; exits 1 when a layout
fails its tolerance or a run fails (its log is <out>/<id>.log).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def edited(text, old, new, count=1):
    if old not in text:
        raise SystemExit(f"gpu_ranks.py: the config has no {old!r}")
    return text.replace(old, new, count)


def distributed_config(name, steps, device, accumulation=1):
    text = (ROOT / "configs" / "distributed" / name).read_text()
    text = edited(text, "${modalities_env:config_folder_path}/../../data", str(ROOT / "data"))
    text = edited(text, "num_target_steps = 80", f"num_target_steps = {steps}")
    text = edited(text, "training_log_interval_in_steps = 5", "training_log_interval_in_steps = 1")
    text = edited(text, "checkpointing_interval_in_steps = 20", f"checkpointing_interval_in_steps = {steps}")
    text = edited(text, "evaluation_interval_in_steps = 20", f"evaluation_interval_in_steps = {steps}")
    text = edited(text, "warmup_steps = 10", "warmup_steps = 4")
    text = edited(text, "gradient_accumulation_steps = 1", f"gradient_accumulation_steps = {accumulation}")
    text = edited(text, 'device = "cpu"', f'device = "{device}"')
    text = edited(text, 'device_type = "cpu"', f'device_type = "{"cpu" if device == "cpu" else "cuda"}"')
    # The pipeline cannot tie weights across stages: one untied reference serves every layout.
    if "use_weight_tying = true" in text:
        text = edited(text, "use_weight_tying = true", "use_weight_tying = false")
    return text


def layouts(steps, device):
    fsdp2 = distributed_config("fsdp2_cpu.toml", steps, device)
    tp = distributed_config("tp_cpu.toml", steps, device)
    def pp_config(schedule, layers_per_stage=2, name="pp_cpu.toml"):
        text = distributed_config(name, steps, device)
        text = edited(text, 'pp_schedule_name = "gpipe"', f'pp_schedule_name = "{schedule}"', 2)
        return edited(text, "num_layers_per_stage = 2", f"num_layers_per_stage = {layers_per_stage}")

    pp = pp_config("1F1B")
    pp4 = edited(edited(pp_config("1F1B", 1), "pipeline_parallel_degree = 2", "pipeline_parallel_degree = 4"),
                 "pp_degree = 2", "pp_degree = 4")
    pp_fsdp2 = pp_config("1F1B", 2, "pp_fsdp2_cpu.toml")
    hsdp = edited(fsdp2, "data_parallel_shard_degree = -1,", "data_parallel_replicate_degree = 2, data_parallel_shard_degree = -1,")
    bf16 = edited(fsdp2, 'param_dtype = "FP_32", reduce_dtype = "FP_32"', 'param_dtype = "BF_16", reduce_dtype = "BF_16"')
    # (id, ranks, config, reference id, kind)
    return [
        ("one_8x1", 1, fsdp2, None, "reference"),
        ("one_2x4", 1, distributed_config("fsdp2_cpu.toml", steps, device, 4), None, "floor"),
        ("fsdp2_2", 2, fsdp2, "one_8x1", "fp32"),
        ("fsdp2_4", 4, fsdp2, "one_8x1", "fp32"),
        ("hsdp_2x2", 4, hsdp, "one_8x1", "fp32"),
        ("fsdp1_2_accum2", 2, distributed_config("fsdp1_cpu.toml", steps, device, 2), "one_8x1", "fp32"),
        ("tp2_sp", 2, tp, "one_8x1", "fp32"),
        ("tp2_sp_loss_parallel", 2, edited(tp, "enable_loss_parallel = false", "enable_loss_parallel = true"),
         "one_8x1", "fp32"),
        ("fsdp2x2_tp2_sp", 4, tp, "one_8x1", "fp32"),
        ("pp2_gpipe", 2, pp_config("gpipe"), "one_8x1", "fp32"),
        ("pp2_1f1b", 2, pp, "one_8x1", "fp32"),
        ("pp2_interleaved_v2", 2, pp_config("Interleaved1F1B", 1), "one_8x1", "fp32"),
        ("pp4_1f1b", 4, pp4, "one_8x1", "fp32"),
        ("pp2_fsdp2x2_1f1b", 4, pp_fsdp2, "one_8x1", "fp32"),
        ("bf16_one", 1, bf16, None, "reference"),
        ("bf16_fsdp2_2", 2, bf16, "bf16_one", "bf16"),
        ("bf16_fsdp2_4", 4, bf16, "bf16_one", "bf16"),
    ]


def curve(results):
    out = []
    if not results.exists():
        return out
    for line in results.read_text().splitlines():
        if '"train loss avg"' in line:
            row = json.loads(line)
            metrics = row.get("losses", {}) | row.get("metrics", {})
            out.append((float(metrics["train loss avg"]), float(metrics["grad norm avg"])))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modalities", default=str(ROOT / "build-cuda" / "bin" / "modalities"))
    ap.add_argument("--device", default="cuda:0", help="cuda:0 (every rank on that GPU) or cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated layout ids (the references always run)")
    ap.add_argument("--backend", default="staged", help="process-group backend of the multi-rank runs")
    ap.add_argument("--timeout-s", type=int, default=300, help="limit of one run")
    ap.add_argument("--out", default=str(ROOT / "out" / "gpu_ranks"))
    a = ap.parse_args()
    out = Path(a.out).resolve()
    (out / "configs").mkdir(parents=True, exist_ok=True)
    experiments = out / "experiments"
    only = {s for s in a.only.split(",") if s}
    chosen = [l for l in layouts(a.steps, a.device) if not only or l[0] in only or l[4] in ("reference", "floor")]
    if only:
        refs = {l[3] for l in chosen if l[3]}
        chosen = [l for l in chosen if l[4] not in ("reference", "floor") or l[0] in refs or l[4] == "floor"]
    env = dict(os.environ, MODALITIES_PROGRESS="0", MODALITIES_BACKEND=a.backend, OMP_NUM_THREADS="1",
               MODALITIES_DEVICE=a.device)
    curves, seconds, failed = {}, {}, []
    for ident, ranks, config, _, _ in chosen:
        shutil.rmtree(experiments / ident, ignore_errors=True)  # results are appended to: start clean
        path = out / "configs" / f"{ident}.toml"
        path.write_text(config)
        cmd = [a.modalities]
        if ranks > 1:
            cmd += ["launch", "--nproc-per-node", str(ranks), "--grace-s", "5", "--"]
        cmd += ["run", "--config_file_path", str(path), "--experiments_root_path", str(experiments),
                "--experiment_id", ident]
        t0 = time.time()
        with open(out / f"{ident}.log", "w") as log:
            try:
                rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        seconds[ident] = time.time() - t0
        curves[ident] = curve(experiments / ident / "evaluation_results.jsonl")
        status = "ok" if rc == 0 and len(curves[ident]) == a.steps else f"FAILED (exit {rc}, {len(curves[ident])} steps)"
        print(f"{ident:<22} {ranks} rank(s) {seconds[ident]:6.1f} s  {status}", flush=True)
        if status != "ok":
            failed.append(ident)

    rel = lambda x, y: abs(x - y) / abs(y)
    lines, verdicts = [], {}
    floor_loss = floor_norm = 0.0
    if not {"one_8x1", "one_2x4"} & set(failed) and "one_2x4" in curves and "one_8x1" in curves:
        for (l, n), (rl, rn) in zip(curves["one_2x4"], curves["one_8x1"]):
            floor_loss, floor_norm = max(floor_loss, rel(l, rl)), max(floor_norm, rel(n, rn))
    lines.append(f"device {a.device}, backend {a.backend}, {a.steps} steps; noise floor (one rank, 2 x 4 accumulation "
                 f"vs 8 x 1): loss {floor_loss:.2e}, grad norm {floor_norm:.2e}")
    for ident, ranks, _, ref, kind in chosen:
        if kind in ("reference", "floor") or ident in failed or ref in failed:
            continue
        got, want = curves[ident], curves[ref]
        loss = max(rel(g[0], w[0]) for g, w in zip(got, want))
        norm = max(rel(g[1], w[1]) for g, w in zip(got, want))
        if kind == "fp32":
            tol_loss, tol_norm = max(1e-5, 10 * floor_loss), max(1e-5, 10 * floor_norm)
        else:
            tol_loss, tol_norm = 0.02, 0.03
        ok = loss <= tol_loss and norm <= tol_norm
        verdicts[ident] = {"ranks": ranks, "kind": kind, "reference": ref, "loss_rel": loss, "grad_norm_rel": norm,
                           "tolerance_loss": tol_loss, "tolerance_grad_norm": tol_norm, "passed": ok,
                           "seconds": seconds[ident]}
        for k, (g, w) in enumerate(zip(got, want)):
            lines.append(f"{ident:<22} step {k + 1:2d}  loss {g[0]:.9g} ({ref} {w[0]:.9g})  grad norm {g[1]:.9g} "
                         f"({ref} {w[1]:.9g})")
        lines.append(f"{ident:<22} {ranks} ranks, {kind}: worst relative difference loss {loss:.2e} (tolerance "
                     f"{tol_loss:.0e}), grad norm {norm:.2e} (tolerance {tol_norm:.0e}): {'PASS' if ok else 'FAIL'}")
        if not ok:
            failed.append(ident)
    lines.append(f"{len(verdicts) - len([v for v in verdicts.values() if not v['passed']])} of {len(verdicts)} layouts "
                 f"within tolerance; failed runs or layouts: {', '.join(failed) or 'none'}")
    text = "\n".join(lines) + "\n"
    (out / "summary.txt").write_text(text)
    (out / "summary.json").write_text(json.dumps({"device": a.device, "backend": a.backend, "steps": a.steps,
                                                  "noise_floor": {"loss": floor_loss, "grad_norm": floor_norm},
                                                  "layouts": verdicts, "seconds": seconds, "failed": failed},
                                                 indent=1))
    print("\n".join(l for l in lines if " step " not in l))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
