#!/usr/bin/env python3
"""Reference training run for configs/quickstart/train.toml with Modalities' own
Python components, on CPU.

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
"""
import argparse
import json
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
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with open(args.config, "rb") as f:
        cfg = tomllib.load(f)
    s = cfg["settings"]
    sp = s["step_profile"]
    T, mbs, G = sp["sequence_length"], sp["local_train_micro_batch_size"], sp["gradient_accumulation_steps"]
    steps = s["training_target"]["num_target_steps"]

    model, conf = build_model(cfg)
    init_weights(model, conf.n_layer)
    save_file(full_state_dict(model), args.init)

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
            norms.append(norm.item())
            lrs.append(sched.get_last_lr())
            step_losses = []
            now = time.perf_counter()
            step_seconds.append(now - last)  # batch fetch + forward/backward + update, as the gym's log timer
            last = now
    seconds = time.perf_counter() - start
    tokens = len(losses) * mbs * T * G
    with open(args.out, "w") as f:
        json.dump({"loss": losses, "grad_norm": norms, "lr": lrs, "seconds": seconds, "step_seconds": step_seconds,
                   "tokens_per_second": tokens / seconds, "torch": torch.__version__,
                   "threads": torch.get_num_threads()}, f, indent=1)
    print(f"{len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, {tokens / seconds:.0f} tokens/s")


if __name__ == "__main__":
    main()
