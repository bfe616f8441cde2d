#!/usr/bin/env python3
"""PyTorch side of the optimizer step-time comparison in plugins/optimizers/README.md.

One torch.optim.AdamW step over 13,174,016 fp32 parameters shaped like the tutorial GPT-2
(see plugins/gpt2/README.md), one group with weight decay 0.1, as the C++ benchmark
(MODALITIES_OPTIMIZER_BENCH=1 modalities_plugin_optimizers_test --gtest_filter=*StepTime*).

Usage: .deps/bench/bin/python scripts/bench_optimizer.py
(the venv of scripts/setup_bench_env.sh: torch 2.11.0, the version of our LibTorch).
"""

import time

import torch

BLOCK = [(128,), (128,), (128,), (128,), (128, 128), (64, 128), (64, 128), (128, 128), (256, 128), (256, 128), (128, 256)]
SHAPES = [(50304, 128)] + BLOCK * 2 + [(128,), (128,), (50304, 128)]

if __name__ == "__main__":
    print(f"{sum(torch.Size(s).numel() for s in SHAPES):,} parameters, {torch.get_num_threads()} threads, torch {torch.__version__}")
    for name, kwargs in [("foreach=False", {"foreach": False}), ("foreach=True", {"foreach": True}), ("fused=True", {"fused": True})]:
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kwargs)
        for _ in range(3):
            opt.step()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        print(f"adam_w step, {name}: min {times[0]:.1f} ms, median {times[len(times) // 2]:.1f} ms")
