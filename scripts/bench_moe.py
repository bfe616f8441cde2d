#!/usr/bin/env python3
"""Python side of scripts/bench_moe.sh: forward + backward of one feed-forward on the sizes of
MoeBench in plugins/moe/tests/moe_test.cpp (8 sequences x 256 tokens, width 256), fp32 on the
CPU: transformers' MixtralSparseMoeBlock (8 experts of hidden 512, top-2; its per-expert
one-hot mask + index_select loop) and a dense SwiGLU of the same active size (hidden 1024).
Mean milliseconds over 10 timed passes after 3 warm-up passes, as the C++ side.

Usage: .deps/bench/bin/python scripts/bench_moe.py (the venv of scripts/setup_bench_env.sh).
"""

import time

import torch
import torch.nn.functional as F
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

D, E, K, FH, B, T = 256, 8, 2, 512, 8, 256


def mean_ms(step):
    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    return (time.perf_counter() - t0) / 10 * 1e3


def main():
    torch.manual_seed(1)
    x = torch.randn(B, T, D)
    w = [torch.nn.Linear(D, K * FH, bias=False), torch.nn.Linear(D, K * FH, bias=False),
         torch.nn.Linear(K * FH, D, bias=False)]

    def dense():
        h = x.clone().requires_grad_(True)
        (w[2](F.silu(w[0](h)) * w[1](h))).sum().backward()

    cfg = transformers.MixtralConfig(hidden_size=D, intermediate_size=FH, num_local_experts=E, num_experts_per_tok=K,
                                     router_jitter_noise=0.0)
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(cfg)

    def moe():
        h = x.clone().requires_grad_(True)
        y, _ = block(h)
        y.sum().backward()

    print(f"bench_moe: python threads {torch.get_num_threads()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    dense_ms = mean_ms(dense)
    print(f"bench_moe: python dense_swiglu_hidden_{K * FH} {dense_ms:.2f} ms")
    moe_ms = mean_ms(moe)
    print(f"bench_moe: python transformers_mixtral_block {moe_ms:.2f} ms ({moe_ms / dense_ms:.2f}x dense)")


if __name__ == "__main__":
    main()
