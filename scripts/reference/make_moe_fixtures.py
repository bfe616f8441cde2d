#!/usr/bin/env python3
"""Reference values of the MoE feed-forward of model/gpt2_moe (plugins/moe/tests/moe_test.cpp).

For each case a tiny MoE block with seeded random weights runs forward and backward on a random
input; the file holds the weights in our names, the input, the output, the upstream gradient,
the gradients of the input and of every weight, and the tokens each expert received. The
transformers cases also hold the auxiliary losses of transformers' own functions on the block's
router logits: load_balancing_loss_func (Mixtral's; for one layer k times our load-balancing term,
plugins/moe/src/moe.cpp, Note [MoE auxiliary losses]), router_z_loss_func (Switch Transformers'),
and the gradient of the router weight of load_balancing / k + z:

  mixtral_top2           transformers' MixtralSparseMoeBlock (softmax, top-2, normalized)
  qwen2_moe_shared_gate  transformers' Qwen2MoeSparseMoeBlock (not normalized, gated shared expert)
  qwen3_moe_norm_topk    transformers' Qwen3MoeSparseMoeBlock (normalized top-k)
  sigmoid_scaled         the DeepSeek-V3 rule written out here (sigmoid scores, normalized over the
                         chosen experts, routed scaling factor, one ungated shared expert), computed
                         token by token over all experts: an independent algorithm from ours
  deepseek_v3_grouped    the same with group-limited routing (8 experts in 4 groups, 2 groups per
                         token) and a selection bias, token by token, and one step of the
                         auxiliary-loss-free bias update on its tokens per expert
  capacity_drop          softmax top-2 with a capacity of ceil(0.5 * N * k / E) slots per expert:
                         each expert keeps its first tokens in token order, the outputs with the
                         overflow dropped and with fully dropped tokens passed through (residual)

Run with the reference environment (scripts/setup_bench_env.sh: torch 2.11.0, transformers 4.57.6):
  .deps/bench/bin/python scripts/reference/make_moe_fixtures.py plugins/moe/tests/data
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

D, N_TOKENS = 16, 24  # model width, tokens (B*T = 2*12)


def stack(linears):
    return torch.stack([l.weight.detach() for l in linears]).contiguous()


def experts_of(block, names):
    """Per-expert Linear layers (gate, down, up) of a transformers MoE block."""
    g, d, u = names
    return ([getattr(e, g) for e in block.experts], [getattr(e, d) for e in block.experts],
            [getattr(e, u) for e in block.experts])


def run_hf(block, names, shared=None):
    """Forward + backward of a transformers block; returns (weights, grads, y, tokens_per_expert)."""
    w1s, w2s, w3s = experts_of(block, names)
    torch.manual_seed(7)
    x = torch.randn(2, N_TOKENS // 2, D, requires_grad=True)
    dy = torch.randn(2, N_TOKENS // 2, D)
    y, router_logits = block(x)
    k = block.top_k
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func
    lb = load_balancing_loss_func((router_logits,), len(block.experts), k)
    z = router_z_loss_func(router_logits.float().unsqueeze(0))
    aux = {"aux.load_balancing": lb.detach().reshape(1), "aux.z_loss": z.detach().reshape(1),
           "aux.grad.router.gate.weight": torch.autograd.grad(lb / k + z, block.gate.weight, retain_graph=True)[0]}
    (y * dy).sum().backward()
    chosen = torch.topk(F.softmax(router_logits.float(), dim=-1), k, dim=-1).indices
    weights = {
        "router.gate.weight": block.gate.weight.detach(),
        "experts.w1": stack(w1s),
        "experts.w2": stack(w2s),
        "experts.w3": stack(w3s),
    }
    grads = {
        "router.gate.weight": block.gate.weight.grad,
        "experts.w1": torch.stack([l.weight.grad for l in w1s]),
        "experts.w2": torch.stack([l.weight.grad for l in w2s]),
        "experts.w3": torch.stack([l.weight.grad for l in w3s]),
    }
    if shared is not None:
        mlp, gate = shared
        for ours, lin in (("W", mlp.gate_proj), ("V", mlp.up_proj), ("W_2", mlp.down_proj)):
            weights[f"shared_experts.{ours}.weight"] = lin.weight.detach()
            grads[f"shared_experts.{ours}.weight"] = lin.weight.grad
        if gate is not None:
            weights["shared_expert_gate.weight"] = gate.weight.detach()
            grads["shared_expert_gate.weight"] = gate.weight.grad
    tpe = torch.bincount(chosen.reshape(-1), minlength=len(w1s))
    return x, dy, y, weights, grads, tpe, aux


def mixtral():
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    c = transformers.MixtralConfig(hidden_size=D, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                   router_jitter_noise=0.0)
    torch.manual_seed(1)
    block = MixtralSparseMoeBlock(c)
    meta = dict(num_experts=4, top_k=2, moe_ffn_hidden=24, score_function="softmax", norm_topk_prob=True,
                route_scale=1.0, shared_hidden=0, shared_expert_gate=False)
    return meta, run_hf(block, ("w1", "w2", "w3"))


def qwen2_moe():
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    c = transformers.Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=20, shared_expert_intermediate_size=40,
                                    num_experts=6, num_experts_per_tok=2, norm_topk_prob=False)
    torch.manual_seed(2)
    block = Qwen2MoeSparseMoeBlock(c)
    meta = dict(num_experts=6, top_k=2, moe_ffn_hidden=20, score_function="softmax", norm_topk_prob=False,
                route_scale=1.0, shared_hidden=40, shared_expert_gate=True)
    return meta, run_hf(block, ("gate_proj", "down_proj", "up_proj"), (block.shared_expert, block.shared_expert_gate))


def qwen3_moe():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    c = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=12, num_experts=8, num_experts_per_tok=3,
                                    norm_topk_prob=True)
    torch.manual_seed(3)
    block = Qwen3MoeSparseMoeBlock(c)
    meta = dict(num_experts=8, top_k=3, moe_ffn_hidden=12, score_function="softmax", norm_topk_prob=True,
                route_scale=1.0, shared_hidden=0, shared_expert_gate=False)
    return meta, run_hf(block, ("gate_proj", "down_proj", "up_proj"))


def sigmoid_scaled():
    """DeepSeek-V3 (arXiv:2412.19437, eqs. 12-16, without the bias): s = sigmoid(u W_gate^T); the top-k
    experts by s; g = s / sum of the chosen s; times the routed scaling factor; plus the shared expert."""
    E, k, Fh, scale, Fs = 5, 2, 16, 2.5, 32
    torch.manual_seed(4)
    p = {
        "router.gate.weight": torch.randn(E, D) * 0.3,
        "experts.w1": torch.randn(E, Fh, D) * 0.2,
        "experts.w2": torch.randn(E, D, Fh) * 0.2,
        "experts.w3": torch.randn(E, Fh, D) * 0.2,
        "shared_experts.W.weight": torch.randn(Fs, D) * 0.2,
        "shared_experts.V.weight": torch.randn(Fs, D) * 0.2,
        "shared_experts.W_2.weight": torch.randn(D, Fs) * 0.2,
    }
    for t in p.values():
        t.requires_grad_(True)
    torch.manual_seed(7)
    x = torch.randn(2, N_TOKENS // 2, D, requires_grad=True)
    dy = torch.randn(2, N_TOKENS // 2, D)
    rows = []
    chosen_all = []
    for u in x.reshape(-1, D):
        s = torch.sigmoid(p["router.gate.weight"] @ u)
        chosen = torch.topk(s, k).indices
        g = s[chosen] / s[chosen].sum() * scale
        out = torch.zeros(D)
        for j, e in enumerate(chosen.tolist()):
            h = F.silu(p["experts.w1"][e] @ u) * (p["experts.w3"][e] @ u)
            out = out + g[j] * (p["experts.w2"][e] @ h)
        shared = p["shared_experts.W_2.weight"] @ (F.silu(p["shared_experts.W.weight"] @ u) *
                                                   (p["shared_experts.V.weight"] @ u))
        rows.append(out + shared)
        chosen_all.append(chosen)
    y = torch.stack(rows).reshape(x.shape)
    (y * dy).sum().backward()
    weights = {n: t.detach() for n, t in p.items()}
    grads = {n: t.grad for n, t in p.items()}
    tpe = torch.bincount(torch.stack(chosen_all).reshape(-1), minlength=E)
    meta = dict(num_experts=E, top_k=k, moe_ffn_hidden=Fh, score_function="sigmoid", norm_topk_prob=True,
                route_scale=scale, shared_hidden=Fs, shared_expert_gate=False)
    return meta, (x, dy, y, weights, grads, tpe, {})


def silu_expert(p, e, u):
    h = F.silu(p["experts.w1"][e] @ u) * (p["experts.w3"][e] @ u)
    return p["experts.w2"][e] @ h


def random_block(seed, E, Fh, Fs=0):
    torch.manual_seed(seed)
    p = {
        "router.gate.weight": torch.randn(E, D) * 0.3,
        "experts.w1": torch.randn(E, Fh, D) * 0.2,
        "experts.w2": torch.randn(E, D, Fh) * 0.2,
        "experts.w3": torch.randn(E, Fh, D) * 0.2,
    }
    if Fs:
        p["shared_experts.W.weight"] = torch.randn(Fs, D) * 0.2
        p["shared_experts.V.weight"] = torch.randn(Fs, D) * 0.2
        p["shared_experts.W_2.weight"] = torch.randn(D, Fs) * 0.2
    for t in p.values():
        t.requires_grad_(True)
    torch.manual_seed(7)
    x = torch.randn(2, N_TOKENS // 2, D, requires_grad=True)
    dy = torch.randn(2, N_TOKENS // 2, D)
    return p, x, dy


def deepseek_v3_grouped():
    """DeepSeek-V3 (arXiv:2412.19437, section 2.1.2 and eqs. 12-16) with node-limited routing as
    DeepSeek's inference code does it: s = sigmoid(u W_gate^T); the biased scores s + b choose:
    each group of E / n_group experts is scored by the sum of its two largest biased scores, the
    topk_group best groups are kept, and the top-k experts among theirs by biased score are
    chosen; the combine weights are the unbiased s of the chosen, normalized, times the routed
    scaling factor. Then one bias update: b += gamma * sign(mean load - load)."""
    E, k, Fh, scale, Fs, n_group, topk_group, gamma = 8, 2, 16, 2.5, 32, 4, 2, 1e-3
    p, x, dy = random_block(5, E, Fh, Fs)
    torch.manual_seed(6)
    bias = torch.randn(E) * 0.1  # large enough to change choices (asserted below)
    rows, chosen_all, unbiased_changes = [], [], 0
    per_group = E // n_group
    for u in x.reshape(-1, D):
        s = torch.sigmoid(p["router.gate.weight"] @ u)
        b = (s + bias).detach()
        groups = [sorted(b[g * per_group:(g + 1) * per_group].tolist(), reverse=True) for g in range(n_group)]
        group_score = torch.tensor([sum(v[:2]) for v in groups])
        kept = torch.topk(group_score, topk_group).indices.tolist()
        allowed = [e for e in range(E) if e // per_group in kept]
        chosen = sorted(allowed, key=lambda e: -b[e].item())[:k]
        unbiased_changes += set(chosen) != set(torch.topk(s, k).indices.tolist())
        g = s[chosen] / s[chosen].sum() * scale
        out = torch.zeros(D)
        for j, e in enumerate(chosen):
            out = out + g[j] * silu_expert(p, e, u)
        shared = p["shared_experts.W_2.weight"] @ (F.silu(p["shared_experts.W.weight"] @ u) *
                                                   (p["shared_experts.V.weight"] @ u))
        rows.append(out + shared)
        chosen_all.append(torch.tensor(chosen))
    assert unbiased_changes > 0, "the bias and the groups must change some choices"
    y = torch.stack(rows).reshape(x.shape)
    (y * dy).sum().backward()
    weights = {n: t.detach() for n, t in p.items()}
    weights["router.expert_bias"] = bias
    grads = {n: t.grad for n, t in p.items()}
    tpe = torch.bincount(torch.stack(chosen_all).reshape(-1), minlength=E)
    load = tpe.to(torch.float32)
    extra = {"bias.updated": bias + gamma * torch.sign(load.mean() - load)}
    meta = dict(num_experts=E, top_k=k, moe_ffn_hidden=Fh, score_function="sigmoid", norm_topk_prob=True,
                route_scale=scale, shared_hidden=Fs, shared_expert_gate=False, n_group=n_group,
                topk_group=topk_group, expert_bias_update_rate=gamma, changed_choices=unbiased_changes)
    return meta, (x, dy, y, weights, grads, tpe, extra)


def capacity_drop():
    """Softmax top-2 of 4 experts (normalized), capacity C = ceil(0.5 * N * k / E): going through
    the tokens in order, a token's slot at expert e is kept while e has had at most C slots. A
    dropped slot adds nothing (its weight is not given to the others); with the residual policy a
    token whose every slot was dropped passes through as its own output."""
    import math
    E, k, Fh, cf = 4, 2, 24, 0.5
    p, x, dy = random_block(8, E, Fh)
    u_all = x.reshape(-1, D)
    N = u_all.shape[0]
    C = math.ceil(cf * N * k / E)
    seen = [0] * E
    rows, rows_residual, kept_all, fully, partly = [], [], [], 0, 0
    for u in u_all:
        s = F.softmax(p["router.gate.weight"] @ u, dim=-1)
        top = torch.topk(s, k)
        g = top.values / top.values.sum()
        out = torch.zeros(D)
        kept = 0
        for j, e in enumerate(top.indices.tolist()):
            seen[e] += 1
            if seen[e] <= C:
                out = out + g[j] * silu_expert(p, e, u)
                kept_all.append(e)
                kept += 1
        fully += kept == 0
        partly += 0 < kept < k
        rows.append(out)
        rows_residual.append(u if kept == 0 else out)
    assert fully > 0 and partly > 0, (fully, partly)
    y = torch.stack(rows).reshape(x.shape)
    y_residual = torch.stack(rows_residual).reshape(x.shape)
    (y * dy).sum().backward()
    weights = {n: t.detach() for n, t in p.items()}
    grads = {n: t.grad for n, t in p.items()}
    tpe = torch.bincount(torch.tensor(kept_all), minlength=E)  # kept slots per expert
    extra = {"y.residual": y_residual.detach().reshape(-1, D)}
    meta = dict(num_experts=E, top_k=k, moe_ffn_hidden=Fh, score_function="softmax", norm_topk_prob=True,
                route_scale=1.0, shared_hidden=0, shared_expert_gate=False, capacity_factor=cf,
                dropped_slots=N * k - len(kept_all), fully_dropped_tokens=fully)
    return meta, (x, dy, y, weights, grads, tpe, extra)


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "plugins/moe/tests/data")
    out.mkdir(parents=True, exist_ok=True)
    for name, make in (("mixtral_top2", mixtral), ("qwen2_moe_shared_gate", qwen2_moe),
                       ("qwen3_moe_norm_topk", qwen3_moe), ("sigmoid_scaled", sigmoid_scaled),
                       ("deepseek_v3_grouped", deepseek_v3_grouped), ("capacity_drop", capacity_drop)):
        meta, (x, dy, y, weights, grads, tpe, aux) = make()
        tensors = {"x": x.detach().reshape(-1, D), "dy": dy.reshape(-1, D), "y": y.detach().reshape(-1, D),
                   "grad.x": x.grad.reshape(-1, D), "tokens_per_expert": tpe.to(torch.int64)}
        for n, t in weights.items():
            tensors[f"weight.{n}"] = t
        for n, t in grads.items():
            tensors[f"grad.{n}"] = t
        tensors.update(aux)
        tensors = {n: t.contiguous().clone() for n, t in tensors.items()}
        metadata = {k: json.dumps(v) for k, v in meta.items()}
        metadata["source"] = f"transformers {transformers.__version__}, torch {torch.__version__}"
        save_file(tensors, str(out / f"{name}.safetensors"), metadata=metadata)
        print(f"{name}: {len(tensors)} tensors, tokens per expert {tpe.tolist()}")


if __name__ == "__main__":
    main()
