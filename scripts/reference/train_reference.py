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
import math
import re
import time
import tomllib
from pathlib import Path

import torch
from safetensors.torch import save_file

from modalities.dataloader.dataset_factory import DatasetFactory
from modalities.dataloader.samplers import ResumableDistributedSampler
from modalities.loss_functions import CLMCrossEntropyLoss
from modalities.models.gpt2.collator import GPT2LLMCollateFn
from modalities.models.gpt2.gpt2_model import GPT2LLMConfig
from modalities.models.model_factory import GPT2ModelFactory
from modalities.optimizers.optimizer_factory import _build_optimizer_groups_via_weight_decay_split
from modalities.batch import InferenceResultBatch


def init_weights(model, n_layer, seed):
    """Composed 'scaled' initialisation: N(0, 0.02), output projections 0.02/sqrt(2L)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.fullmatch(r"transformer\.h\.\d+\.attn\.c_proj\.weight|transformer\.h\.\w+\.mlp\.(W_2|c_proj)\.weight", name):
                p.normal_(0.0, 0.02 / math.sqrt(2 * n_layer), generator=g)
            elif name.endswith(".weight") and "norm" not in name:
                p.normal_(0.0, 0.02, generator=g)


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

    mcfg = dict(cfg["model_raw"]["config"])
    conf = GPT2LLMConfig(**mcfg)
    model = GPT2ModelFactory.get_gpt2_model(**{k: getattr(conf, k) for k in type(conf).model_fields})
    init_weights(model, conf.n_layer, 1234)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, args.init)

    ds_cfg = cfg["train_dataset"]["config"]
    dataset = DatasetFactory.get_packed_mem_map_dataset_continuous(
        raw_data_path=Path(ds_cfg["raw_data_path"]), sequence_length=T, sample_key=ds_cfg["sample_key"],
        reuse_last_target=ds_cfg.get("reuse_last_target", True))
    smp = cfg["train_dataloader"]["config"]["batch_sampler"]["config"]["sampler"]["config"]
    sampler = ResumableDistributedSampler(dataset, rank=0, num_replicas=1, shuffle=smp["shuffle"], seed=smp["seed"],
                                          drop_last=True, skip_num_global_samples=0)
    batch_sampler = torch.utils.data.BatchSampler(sampler, batch_size=mbs, drop_last=True)
    keys = s["referencing_keys"]
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler,
                                         collate_fn=GPT2LLMCollateFn(keys["sample_key"], keys["target_key"]))
    loss_fn = CLMCrossEntropyLoss(target_key=keys["target_key"], prediction_key=keys["prediction_key"])

    o = cfg["optimizer"]["config"]
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    groups = _build_optimizer_groups_via_weight_decay_split(o["weight_decay"], o["weight_decay_groups_excluded"],
                                                            model.weight_decay_groups, params)
    opt = torch.optim.AdamW(groups, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                            foreach=o.get("foreach"), fused=o.get("fused"))
    sc = cfg["scheduler"]["config"]
    W, total = sc["warmup_steps"], sc["total_steps"]
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=sc["initial_lr"] / sc["max_lr"], end_factor=1.0,
                                             total_iters=W)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - W, eta_min=sc["final_lr"])
    sched = torch.optim.lr_scheduler.SequentialLR(opt, schedulers=[warm, cos], milestones=[W])
    clip = cfg["gradient_clipper"]["config"]
    norm_type = {"P1_NORM": 1.0, "P2_NORM": 2.0, "MAX_NORM": math.inf}[clip["norm_type"]]

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
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=clip["max_norm"], norm_type=norm_type)
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
