#!/usr/bin/env python3
"""Reference run of configs/distributed/fsdp2_cpu.toml with PyTorch's own FSDP2
(torch.distributed.fsdp.fully_shard) on CPU with Gloo.

Python Modalities' own `modalities run` cannot run on a CPU, so this script drives the same Python
components as scripts/reference/train_reference.py (both build them with
reference_training.py: GPT2LLM built from the config's model_raw by Modalities'
factory, PackedMemMapDatasetContinuous + ResumableDistributedSampler +
GPT2LLMCollateFn, CLMCrossEntropyLoss, torch AdamW with Modalities' weight-decay
groups, LinearLR + CosineAnnealingLR in a SequentialLR, clip_grad_norm_), but sharded the way the config's
model/fsdp2_wrapped does it: fully_shard on every GPT2Block, then on the whole
model, over a one-dimensional CPU device mesh of all ranks (also for one rank,
so that the code path is the same), reshard_after_forward, fp32 reductions and
fp32 parameters, or with --param-dtype bf16 FSDP2's MixedPrecisionPolicy
(param_dtype bf16: units all-gathered and computed in bf16; fp32 master weights).

The global batch is fixed at 8 samples of 128 tokens: every rank takes
8 // world_size samples of each step from its ResumableDistributedSampler
(seed 42, shuffled), so the per-step loss is the same at every world size up to
rounding. The logged loss of a step is the mean over the ranks of each rank's
loss; the logged learning rates (one per optimizer group) are get_last_lr()
after sched.step(), as in train_reference.py; the logged gradient norm is the full (all-rank) norm that clip_grad_norm_
returns (a DTensor under FSDP2, reduced with .full_tensor()).

Initial weights: not Modalities' initializer, but one seeded generator
(torch.Generator().manual_seed(1234)) drawn over model.named_parameters() in
order on every rank before sharding: output projections (attn.c_proj, mlp.W_2 /
mlp.c_proj) N(0, 0.02 / sqrt(2 * n_layer)), other non-norm weights N(0, 0.02),
norm weights left at 1. Rank 0 writes the full state_dict to --init
(safetensors; the tied lm_head weight is stored as its own copy), and the JSON
(--out) records, per tensor, the rule applied and the sha256 of its bytes.

Run (N = 1, 2 or 4; .deps/bench is the venv of scripts/setup_bench_env.sh; the committed
fixture has fp32 runs on 1, 2 and 4 ranks and a bf16 run on 2, made by the command it records):

  mkdir -p /tmp/fsdp2_ref
  LOCAL_RANK=0 RANK=0 WORLD_SIZE=1 build/bin/modalities config resolve configs/distributed/fsdp2_cpu.toml \
      --experiments_root_path /tmp/fsdp2_ref --experiment_id ref > /tmp/fsdp2_ref/resolved.toml
  OMP_NUM_THREADS=1 .deps/bench/bin/torchrun --standalone --nproc_per_node N \
      scripts/reference/fsdp2_reference.py --config /tmp/fsdp2_ref/resolved.toml --steps 20 --warmup 4 \
      --init /tmp/fsdp2_ref/init_N.safetensors --out /tmp/fsdp2_ref/run_N.json

(the cuda_env variables only satisfy the resolver; the world size used here is
torchrun's). Then merge the runs into the committed fixture:

  .deps/bench/bin/python scripts/reference/fsdp2_reference.py --merge \
      /tmp/fsdp2_ref/run_1.json /tmp/fsdp2_ref/run_2.json /tmp/fsdp2_ref/run_4.json \
      --out tests/distributed/data/pytorch_fsdp2_reference.json
"""
import argparse
import hashlib
import importlib.metadata
import json
import platform
import sys
import time
import tomllib
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from modalities.batch import InferenceResultBatch
from modalities.models.gpt2.gpt2_model import GPT2Block
from reference_training import (INIT_SEED, build_loader, build_loss, build_model, build_optimizer, build_scheduler,
                                clip_settings, full_state_dict, init_weights)

GLOBAL_BATCH_SIZE = 8
SEQUENCE_LENGTH = 128
GRADIENT_ACCUMULATION_STEPS = 1
MERGED_KEYS = ("generated_by", "command", "versions", "init", "runs")
PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def sha256(t):
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def run_key(world, param_dtype):
    """The key of a run in the merged file: "2" for fp32, "2_bf16" with bf16 parameters."""
    return str(world) if param_dtype == "fp32" else f"{world}_{param_dtype}"


def describe_init(model, rules):
    """The init record: parameters (then non-parameter state_dict tensors) in order, and the state_dict keys."""
    params = dict(model.named_parameters())
    param_ids = {id(p): n for n, p in params.items()}
    sd = model.state_dict(keep_vars=True)

    def entry(name, t, **extra):
        return {"name": name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), **extra,
                "sha256": sha256(t)}

    parameters = [entry(n, p, kind="parameter", **rules[n]) for n, p in params.items()]
    state_dict = []
    for k, t in sd.items():
        alias = param_ids.get(id(t))
        if alias is None:  # a buffer (e.g. the rotary inv_freq)
            parameters.append(entry(k, t, kind="buffer", rule="unchanged"))
        state_dict.append(entry(k, t, **({"alias_of": alias} if alias is not None and alias != k else {})))
    return {"seed": INIT_SEED, "parameters": parameters, "state_dict": state_dict}


def full_norm(norm):
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def float64_norm(parameters, norm_type):
    """The full 2-norm of the gradients summed in float64 (each rank's shards, then an all-reduce):
    clip_grad_norm_ sums float32 squares, off by up to about 1e-3 relative for the 6.4M-element
    embedding gradient; this is the value an exact computation approaches."""
    assert float(norm_type) == 2.0, f"float64_norm: only the 2-norm, not {norm_type}"
    total = torch.zeros((), dtype=torch.float64)
    for p in parameters:
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        total += g.detach().double().pow(2).sum()
    if dist.get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return float(total.sqrt())


def versions():
    return {"torch": torch.__version__, "modalities": importlib.metadata.version("modalities"),
            "python": platform.python_version()}


def train(args):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert GLOBAL_BATCH_SIZE % (world * GRADIENT_ACCUMULATION_STEPS) == 0, \
        f"global batch {GLOBAL_BATCH_SIZE} is not divisible by world size {world}"
    mbs = GLOBAL_BATCH_SIZE // (world * GRADIENT_ACCUMULATION_STEPS)  # local_micro_batch_size_from_global_batch_size
    T, G, steps = SEQUENCE_LENGTH, GRADIENT_ACCUMULATION_STEPS, args.steps
    if args.threads:
        torch.set_num_threads(args.threads)

    with open(args.config, "rb") as f:
        cfg = tomllib.load(f)
    assert cfg["model_raw"]["config"]["sequence_length"] == T and cfg["model_raw"]["config"]["dropout"] == 0.0, \
        "expected fsdp2_cpu.toml's model"
    model, conf = build_model(cfg)
    rules = init_weights(model, conf.n_layer)
    init = describe_init(model, rules)
    if rank == 0:
        save_file(full_state_dict(model), args.init)

    # Mixed precision as the config's mixed_precision_settings {param_dtype = "BF_16", reduce_dtype = "FP_32"}:
    # units all-gathered and computed in bf16, gradients reduced in fp32, fp32 master parameters.
    mp = MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[args.param_dtype], reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h.values():
        assert isinstance(block, GPT2Block)
        fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=mp)

    loader = build_loader(cfg, T, mbs, rank, world)
    loss_fn = build_loss(cfg)
    opt = build_optimizer(cfg, model)
    W, total = args.warmup, steps  # total_steps = num_target_steps
    sched = build_scheduler(cfg, opt, W, total)
    max_norm, norm_type = clip_settings(cfg)
    o, sc, clip = cfg["optimizer"]["config"], cfg["scheduler"]["config"], cfg["gradient_clipper"]["config"]

    model.train()
    losses, norms, norms_f64, lrs, step_seconds, step_losses = [], [], [], [], [], []
    dist.barrier()
    last = time.perf_counter()
    for i, batch in enumerate(loader):
        if i >= steps * G:
            break
        out = model(batch.samples)
        loss = loss_fn(InferenceResultBatch(targets=batch.targets, predictions=out))
        (loss / G).backward()
        step_losses.append(loss.detach())
        if (i + 1) % G == 0:
            norms_f64.append(float64_norm(model.parameters(), norm_type))  # before clipping scales the gradients
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm, norm_type=norm_type)
            norm = full_norm(norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            lrs.append(sched.get_last_lr())  # after sched.step(), as train_reference.py logs it
            step_loss = torch.stack(step_losses).mean()
            dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)
            losses.append(float(step_loss / world))  # float32 mean over the ranks
            norms.append(float(norm))
            step_losses = []
            now = time.perf_counter()
            step_seconds.append(now - last)
            last = now
            if rank == 0:
                print(f"step {len(losses)}: loss {losses[-1]:.6f} grad_norm {norms[-1]:.6f} lr {lrs[-1][0]:.3e}",
                      flush=True)
    assert len(losses) == steps, f"the data loader ran out after {len(losses)} steps"

    if rank == 0:
        result = {
            "world_size": world, "param_dtype": args.param_dtype, "steps": steps, "loss": losses, "grad_norm": norms,
            "grad_norm_f64": norms_f64, "lr": lrs, **versions(),
            "init": init, "seconds_per_step": step_seconds, "threads": torch.get_num_threads(),
            "config": (f"configs/distributed/fsdp2_cpu.toml: GPT2LLM n_layer={conf.n_layer} n_embd={conf.n_embd} "
                       f"vocab={conf.vocab_size} tied; global batch {GLOBAL_BATCH_SIZE} = {world} ranks x micro batch "
                       f"{mbs} x {G} accumulation, sequence {T}; AdamW lr {o['lr']} betas {o['betas']} "
                       f"eps {o['eps']} wd {o['weight_decay']} (excluded {o['weight_decay_groups_excluded']}) "
                       f"fused={o.get('fused')}; warmup {W} from {sc['initial_lr']} to {sc['max_lr']}, cosine to "
                       f"{sc['final_lr']} over {total} steps; clip {clip['norm_type']} max_norm {clip['max_norm']}; "
                       f"fully_shard per GPT2Block + root, gloo, param_dtype {args.param_dtype}, reduce_dtype fp32"),
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"{steps} steps on {world} ranks, loss {losses[0]:.6f} -> {losses[-1]:.6f}, "
              f"{sum(step_seconds) / steps:.3f} s/step")
    dist.destroy_process_group()


def merge(args):
    """One file of several runs; the init record once (it must be the same in every run)."""
    runs, init = {}, None
    for path in args.merge:
        with open(path) as f:
            r = json.load(f)
        run_init = r.pop("init")
        if init is None:
            init = run_init
        assert run_init == init, f"{path}: initial weights differ from the first run's"
        runs[run_key(r["world_size"], r.get("param_dtype", "fp32"))] = r
    first = next(iter(runs.values()))
    command = ("mkdir -p /tmp/fsdp2_ref; LOCAL_RANK=0 RANK=0 WORLD_SIZE=1 build/bin/modalities config resolve configs/distributed/fsdp2_cpu.toml "
               "--experiments_root_path /tmp/fsdp2_ref --experiment_id ref > /tmp/fsdp2_ref/resolved.toml; " +
               "; ".join(f"OMP_NUM_THREADS=1 .deps/bench/bin/torchrun --standalone --nproc_per_node {r['world_size']} "
                         f"scripts/reference/fsdp2_reference.py --config /tmp/fsdp2_ref/resolved.toml "
                         f"--steps {r['steps']} --warmup {args.warmup} --param-dtype {r.get('param_dtype', 'fp32')} "
                         f"--init /tmp/fsdp2_ref/init_{n}.safetensors --out /tmp/fsdp2_ref/run_{n}.json"
                         for n, r in runs.items()) +
               "; .deps/bench/bin/python scripts/reference/fsdp2_reference.py --merge " +
               " ".join(f"/tmp/fsdp2_ref/run_{n}.json" for n in runs) + f" --warmup {args.warmup} --out {args.out}")
    out = {"generated_by": "scripts/reference/fsdp2_reference.py", "command": command,
           "versions": {k: first[k] for k in ("torch", "modalities", "python")}, "init": init, "runs": runs}
    names = [n for n, r in runs.items() if r.get("param_dtype", "fp32") == "fp32"]
    worst = {}
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            la, lb = runs[names[a]]["loss"], runs[names[b]]["loss"]
            worst[f"{names[a]}_vs_{names[b]}"] = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
    out["loss_max_rel_diff_between_world_sizes"] = worst
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps(worst, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="resolved TOML of configs/distributed/fsdp2_cpu.toml")
    ap.add_argument("--steps", type=int, default=20, help="training steps (= the scheduler's total_steps)")
    ap.add_argument("--warmup", type=int, default=4, help="the scheduler's warmup_steps")
    ap.add_argument("--init", help="where rank 0 writes the initial weights (.safetensors)")
    ap.add_argument("--out", required=True, help="where rank 0 writes the results (.json)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    ap.add_argument("--param-dtype", choices=sorted(PARAM_DTYPES), default="fp32",
                    help="FSDP2 MixedPrecisionPolicy param_dtype (reduce_dtype is always fp32)")
    ap.add_argument("--merge", nargs="+", metavar="RUN_JSON",
                    help="instead of training: merge the JSONs of several runs into --out")
    args = ap.parse_args()
    if args.merge:
        merge(args)
    else:
        if not (args.config and args.init):
            ap.error("--config and --init are required for a run")
        train(args)


if __name__ == "__main__":
    sys.exit(main())
