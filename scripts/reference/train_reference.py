#!/usr/bin/env python3
"""Reference training run for configs/quickstart/train.toml with Modalities' own
Python components, on CPU (or on one GPU with --device cuda).

`modalities run` cannot run on a CPU (it always initialises NCCL and moves the
model with FSDP), so this script drives the same pieces Modalities' trainer
uses in the order of its training loop: GPT2LLM built from the config by
Modalities' factory, PackedMemMapDatasetContinuous + ResumableDistributedSampler
(same seed, hence the same batches) + GPT2LLMCollateFn, CLMCrossEntropyLoss,
torch AdamW with Modalities' weight-decay groups, LinearLR + CosineAnnealingLR
in a SequentialLR (what `linear_warmup_cosine_annealing_lr` builds), and
clip_grad_norm_. Step order per micro-batch: forward, loss / G backward; at a
step boundary clip, optimizer step, scheduler step, zero_grad.

The initial weights are written to --init (safetensors), so that our run can
start from the very same weights (see scripts/bench_training.sh), and the
per-step losses to --out (JSON).

  .deps/bench/bin/python scripts/reference/train_reference.py --config resolved.toml \
      --init out/ref/init.safetensors --out out/ref/losses.json
where resolved.toml is `modalities config resolve configs/quickstart/train.toml ...` and .deps/bench
is the venv of scripts/setup_bench_env.sh (Modalities 0.5.0, torch 2.11.0).

On a GPU (--device cuda, scripts/bench_gpu.sh): the model moves to cuda:0 after the initial
weights are written, and when the config's `model` is `fsdp2_wrapped` it is sharded the way
Modalities' FSDP2 wrapper does it, on a one-rank NCCL mesh: fully_shard on every GPT2Block, then
on the whole model, with the config's reshard_after_forward and mixed_precision_settings
(MixedPrecisionPolicy param_dtype / reduce_dtype). The step timer then includes a
torch.cuda.synchronize() per step, so a step's time is its GPU work.
"""
import argparse
import json
import tempfile
import time
import tomllib

import torch
from safetensors.torch import save_file

from modalities.batch import InferenceResultBatch
from reference_training import (build_loader, build_loss, build_model, build_optimizer, build_scheduler,
                                clip_settings, full_state_dict, init_weights)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="resolved TOML of the training config")
    ap.add_argument("--init", required=True, help="where to write the initial weights (.safetensors)")
    ap.add_argument("--out", required=True, help="where to write the per-step losses (.json)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where to train (cuda: cuda:0, FSDP2 as the config's model says)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with open(args.config, "rb") as f:
        cfg = tomllib.load(f)
    s = cfg["settings"]
    sp = s["step_profile"]
    T, G = sp["sequence_length"], sp["gradient_accumulation_steps"]
    mbs = local_micro_batch_size(sp["local_train_micro_batch_size"])
    steps = s["training_target"]["num_target_steps"]

    model, conf = build_model(cfg)
    init_weights(model, conf.n_layer)
    save_file(full_state_dict(model), args.init)

    cuda = args.device == "cuda"
    if cuda:
        model = to_gpu(cfg, model)

    loader = build_loader(cfg, T, mbs)
    loss_fn = build_loss(cfg)
    opt = build_optimizer(cfg, model)
    sc = cfg["scheduler"]["config"]
    sched = build_scheduler(cfg, opt, sc["warmup_steps"], sc["total_steps"])
    max_norm, norm_type = clip_settings(cfg)

    model.train()
    losses, norms, lrs, step_seconds = [], [], [], []
    step_losses = []
    start = last = time.perf_counter()
    for i, batch in enumerate(loader):
        if i >= steps * G:
            break
        if cuda:
            batch.samples = {k: v.cuda(non_blocking=True) for k, v in batch.samples.items()}
            batch.targets = {k: v.cuda(non_blocking=True) for k, v in batch.targets.items()}
        out = model(batch.samples)
        loss = loss_fn(InferenceResultBatch(targets=batch.targets, predictions=out))
        (loss / G).backward()
        step_losses.append(loss.item())
        if (i + 1) % G == 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm, norm_type=norm_type)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(sum(step_losses) / len(step_losses))
            norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
            lrs.append(sched.get_last_lr())
            step_losses = []
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            step_seconds.append(now - last)  # batch fetch + forward/backward + update, as the gym's log timer
            last = now
    seconds = time.perf_counter() - start
    tokens = len(losses) * mbs * T * G
    with open(args.out, "w") as f:
        json.dump({"loss": losses, "grad_norm": norms, "lr": lrs, "seconds": seconds, "step_seconds": step_seconds,
                   "tokens_per_second": tokens / seconds, "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "device": device_name(args.device),
                   "wrapping": getattr(model, "_reference_wrapping", "none")}, f, indent=1)
    print(f"{len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, {tokens / seconds:.0f} tokens/s")


def local_micro_batch_size(value):
    """A number, or Modalities' number_conversion component that derives it from the global batch
    size (this script is one process: data-parallel degree 1)."""
    if isinstance(value, int):
        return value
    if value.get("variant_key") == "local_micro_batch_size_from_global_batch_size":
        c = value["config"]
        return c["global_batch_size"] // c["gradient_accumulation_steps"]
    raise SystemExit(f"train_reference.py: local_train_micro_batch_size {value}: expected a number or "
                     "local_micro_batch_size_from_global_batch_size")


DTYPES = {"BF_16": torch.bfloat16, "FP_16": torch.float16, "FP_32": torch.float32}


def to_gpu(cfg, model):
    """cuda:0; fully_shard per GPT2Block + root on a one-rank NCCL mesh when the config's model is
    fsdp2_wrapped (what Modalities' FSDP2 wrapper does), else the plain module on the GPU."""
    torch.cuda.set_device(0)
    model = model.cuda()
    wrapped = cfg.get("model", {})
    if wrapped.get("variant_key") != "fsdp2_wrapped":
        model._reference_wrapping = "none"
        return model
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from modalities.models.gpt2.gpt2_model import GPT2Block

    wc = wrapped["config"]
    mps = wc.get("mixed_precision_settings", {})
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[mps.get("param_dtype", "FP_32")],
                              reduce_dtype=DTYPES[mps.get("reduce_dtype", "FP_32")])
    # One rank: rendezvous through a FileStore in a temporary folder (no port to collide with).
    store = tempfile.mkdtemp(prefix="train_reference_")
    dist.init_process_group("nccl", init_method=f"file://{store}/store", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    reshard = wc.get("reshard_after_forward", True)
    for block in model.transformer.h.values():
        assert isinstance(block, GPT2Block)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    model._reference_wrapping = (f"fully_shard per GPT2Block + root, nccl, 1 rank, param_dtype "
                                 f"{mps.get('param_dtype', 'FP_32')}, reduce_dtype {mps.get('reduce_dtype', 'FP_32')}")
    return model


def device_name(device):
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


if __name__ == "__main__":
    main()
