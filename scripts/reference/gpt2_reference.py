#!/usr/bin/env python3
"""Reference logits and losses of Modalities' GPT2LLM for plugins/gpt2/tests.

For a matrix of tiny configurations (vocab 256, n_embd 128, 2 layers, sequence
length 16) this script builds Modalities' own GPT2LLM from the same config
dicts that it writes as TOML for the C++ test (so pydantic's parsing, e.g. the
effective layer_norm eps, is part of what is compared), fills every state-dict
tensor with the deterministic integer hash below, runs one fixed token batch
[2, 16] and stores the logits and the CLM cross-entropy loss.

Weight formula (the C++ test re-implements it bit for bit):
  h = (i + salt * 0x9E3779B9) mod 2^32, then the murmur3 32-bit finaliser
      h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16   (mod 2^32)
  x_i = float32((h / 2^32 - 0.5) * scale + offset)        (the arithmetic in float64)
  i = flat element index, salt = index of the key in Modalities' state-dict order
  (buffers and the second key of a tied pair count but are not filled: RoPE's
  inv_freq keeps its computed value). offset/scale per tensor are written to
  the manifest (norm weights 1 +- 0.1, biases +-0.1, linear weights
  +-1/sqrt(in_features) (also a tied wte/lm_head), embeddings +-1, or
  +-wte_scale/2 where a case uses tiny embeddings so that norm eps values matter).
Tokens: ids[b, t] = (7 + 31 t + 97 b + 13 t^2) mod 256 for t in 0..16;
inputs = ids[:, :16], targets = ids[:, 1:] with targets[1, 5] = -100.

Outputs (under plugins/gpt2/tests/data/):
  cases.toml       one [<case>] model/gpt2 node per case
  reference.txt    per case: loss, logits file, the tensors with salt/offset/scale, inv_freq values,
                   and (fp32 cases) per parameter the L2 norm and sum of d loss / d parameter
  <case>.f32       logits [2, 16, 256], little-endian float32
  <case>.bf16      logits of the bf16 cases, little-endian bfloat16 bit patterns

Usage (needs modalities 0.5.0 and torch 2.11.0: the venv .deps/bench of scripts/setup_bench_env.sh;
CPU is enough):
    .deps/bench/bin/python scripts/reference/gpt2_reference.py plugins/gpt2/tests/data
"""

import copy
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from modalities.models.gpt2.gpt2_model import GPT2LLMConfig
from modalities.models.model_factory import GPT2ModelFactory

V, D, L, S, B = 256, 128, 2, 16, 2


def rope(base=10000, n_head=8):
    return {"type_hint": "RotaryTransform",
            "config": {"n_embd": D, "n_head": n_head, "seq_length_dim": -2, "base_freq": base}}


IDENTITY = {"type_hint": "IdentityTransform", "config": {}}


def rms_norm(n=D, **kw):
    return {"norm_type": "rms_norm", "config": {"ndim": n, **kw}}


def layer_norm(n=D, **kw):
    return {"norm_type": "layer_norm", "config": {"normalized_shape": n, **kw}}


def torch_rms_norm(n=D, **kw):
    return {"norm_type": "pytorch_rms_norm", "config": {"normalized_shape": n, **kw}}


def model_config(**over):
    c = {
        "sample_key": "input_ids",
        "prediction_key": "logits",
        "poe_type": "NOPE",
        "sequence_length": S,
        "vocab_size": V,
        "n_layer": L,
        "n_head_q": 8,
        "n_head_kv": 4,
        "n_embd": D,
        "ffn_hidden": 128,
        "dropout": 0.0,
        "bias": False,
        "attention_implementation": "manual",
        "activation_type": "swiglu",
        "attention_config": {"qkv_transforms": [rope()]},
        "attention_norm_config": rms_norm(bias=True, epsilon=1e-5),
        "ffn_norm_config": rms_norm(bias=True, epsilon=1e-5),
        "lm_head_norm_config": rms_norm(bias=True, epsilon=1e-5),
        "use_weight_tying": False,
    }
    c.update(over)
    return c


# name -> (config, wte_scale or None, bf16 as well?)
CASES = {
    # the tutorial's architecture (RoPE, GQA, SwiGLU, rms_norm with bias) at tiny size
    "rope_gqa_swiglu_rmsnorm_manual": (model_config(), None, True),
    "rope_gqa_swiglu_rmsnorm_flash": (model_config(attention_implementation="pytorch_flash"), None, False),
    # MHA, GELU, layer_norm with only normalized_shape (effective eps 1e-5), linear biases
    "rope_mha_gelu_layernorm_bias_flash": (
        model_config(n_head_kv=8, activation_type="gelu", ffn_hidden=256, bias=True,
                     attention_implementation="pytorch_flash",
                     attention_config={"qkv_transforms": [rope(base=100000)]},
                     attention_norm_config=layer_norm(), ffn_norm_config=layer_norm(),
                     lm_head_norm_config=layer_norm()),
        0.01, True),
    # NOPE, no transforms, Hkv 2, pytorch RMSNorm, tied
    "nope_gqa2_swiglu_torchrms_tied": (
        model_config(n_head_kv=2, ffn_hidden=256, attention_config={"qkv_transforms": []},
                     attention_norm_config=torch_rms_norm(eps=1e-5), ffn_norm_config=torch_rms_norm(),
                     lm_head_norm_config=torch_rms_norm(eps=1e-5), use_weight_tying=True),
        None, True),
    # learned positions, identity transform, layer_norm with elementwise_affine given (effective eps 1e-6)
    "absolute_mha_gelu_layernorm_affine_bias": (
        model_config(poe_type="ABSOLUTE", n_head_kv=8, activation_type="gelu", bias=True,
                     attention_config={"qkv_transforms": [IDENTITY]},
                     attention_norm_config=layer_norm(elementwise_affine=True),
                     ffn_norm_config=layer_norm(elementwise_affine=True),
                     lm_head_norm_config=layer_norm(elementwise_affine=True)),
        0.01, False),
    # qk-norm (per head, after RoPE), rms_norm without bias and default epsilon 1e-6, SwiGLU multiple 128
    "rope_gqa_swiglu_qknorm_rmsnorm_nobias": (
        model_config(attention_config={"qkv_transforms": [rope()], "qk_norm_config": torch_rms_norm(16)},
                     attention_norm_config=rms_norm(bias=False), ffn_norm_config=rms_norm(bias=False),
                     lm_head_norm_config=rms_norm(bias=False), enforce_swiglu_hidden_dim_multiple_of=128),
        0.01, False),
    # one norm of each kind, Identity then RoPE, GELU with biases, flash, tied
    "mixed_norms_identity_rope_gelu_flash_tied": (
        model_config(activation_type="gelu", bias=True, attention_implementation="pytorch_flash",
                     attention_config={"qkv_transforms": [IDENTITY, rope()]},
                     attention_norm_config=layer_norm(bias=False), ffn_norm_config=torch_rms_norm(),
                     lm_head_norm_config=rms_norm(), use_weight_tying=True),
        None, False),
}

M32 = np.uint64(0xFFFFFFFF)


def hash_values(n, salt):
    h = (np.arange(n, dtype=np.uint64) + np.uint64(salt) * np.uint64(0x9E3779B9)) & M32
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & M32
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & M32
    h ^= h >> np.uint64(16)
    return h


def fill_value(salt, shape, offset, scale):
    n = int(np.prod(shape)) if shape else 1
    x = (hash_values(n, salt).astype(np.float64) / 4294967296.0 - 0.5) * scale + offset
    return torch.from_numpy(x.astype(np.float32).reshape(shape))


def offset_scale(name, shape, wte_scale, tied):
    if name.endswith(".bias"):
        return 0.0, 0.2
    if len(shape) == 1:  # norm weights
        return 1.0, 0.2
    if name in ("transformer.wte.weight", "transformer.wpe.weight"):
        if wte_scale is not None:
            return 0.0, wte_scale
        if not tied:
            return 0.0, 2.0
    return 0.0, 2.0 / math.sqrt(shape[1])  # linear weights and a tied wte/lm_head


def tokens():
    t = torch.arange(S + 1, dtype=torch.int64)
    b = torch.arange(B, dtype=torch.int64)[:, None]
    ids = (7 + 31 * t + 97 * b + 13 * t * t) % V
    inputs, targets = ids[:, :S].clone(), ids[:, 1:].clone()
    targets[1, 5] = -100
    return inputs, targets


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }" if v else "{}"
    raise TypeError(v)


def build(cfg):
    parsed = GPT2LLMConfig(**copy.deepcopy(cfg))
    return GPT2ModelFactory.get_gpt2_model(**{k: getattr(parsed, k) for k in type(parsed).model_fields})


def main(out_dir: Path):
    out_dir.mkdir(parents=True, exist_ok=True)
    inputs, targets = tokens()
    toml = ["# Generated by scripts/reference/gpt2_reference.py; do not edit.", ""]
    manifest = [f"# Generated by scripts/reference/gpt2_reference.py (torch {torch.__version__}); do not edit."]
    for name, (cfg, wte_scale, with_bf16) in CASES.items():
        toml += [f"[{name}]", 'component_key = "model"', 'variant_key = "gpt2"',
                 f"config = {toml_value(cfg)}", ""]
        torch.manual_seed(0)
        model = build(cfg)
        model.eval()
        sd = model.state_dict()
        seen = {}
        lines = []
        with torch.no_grad():
            for salt, (key, t) in enumerate(sd.items()):
                shape = list(t.shape)
                dims = ",".join(map(str, shape))
                if key.endswith("inv_freq"):
                    lines.append(f"buffer {key} {dims} " + " ".join(f"{float(x):.9g}" for x in t.tolist()))
                    continue
                if t.data_ptr() in seen:
                    lines.append(f"tied {key} {seen[t.data_ptr()]}")
                    continue
                seen[t.data_ptr()] = key
                offset, scale = offset_scale(key, shape, wte_scale, cfg["use_weight_tying"])
                t.copy_(fill_value(salt, shape, offset, scale))
                lines.append(f"tensor {key} {dims} {salt} {offset!r} {scale!r}")
        logits = model({"input_ids": inputs})["logits"]
        loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100)
        loss.backward()
        grads = []
        for key, p in model.named_parameters():  # a tied matrix once, as transformer.wte.weight
            g = p.grad.double()
            grads.append(f"grad {key} {g.norm().item():.9g} {g.sum().item():.9g}")
        logits.detach().numpy().astype("<f4").tofile(out_dir / f"{name}.f32")
        manifest.append(f"case {name} float32 {loss.item():.9g} {name}.f32")
        manifest += lines + grads
        manifest.append("end")
        if with_bf16:
            # Closest Python equivalent of FSDP2's param_dtype=bf16 on one process: the whole
            # model cast to bf16 (inv_freq too, which RoPE rounds to the activation dtype anyway).
            model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
            with torch.no_grad():
                logits16 = model_bf16({"input_ids": inputs})["logits"]
                loss16 = F.cross_entropy(logits16.reshape(-1, V), targets.reshape(-1), ignore_index=-100)
            assert logits16.dtype == torch.bfloat16
            logits16.view(torch.int16).numpy().astype("<i2").tofile(out_dir / f"{name}.bf16")
            # The C++ test wraps the case's model in model/mixed_precision (param_dtype BF_16).
            manifest.append(f"case {name} bfloat16 {loss16.float().item():.9g} {name}.bf16")
            manifest += lines
            manifest.append("end")
    (out_dir / "cases.toml").write_text("\n".join(toml))
    (out_dir / "reference.txt").write_text("\n".join(manifest) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
