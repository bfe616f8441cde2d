#!/usr/bin/env python3
"""Fixtures of plugins/gpt2/tests/huggingface_test.cpp: tiny transformers models and the logits
transformers computes for them (fp32, CPU).

import_<family>/  a randomly initialised transformers model saved with save_pretrained
                  (config.json + safetensors; import_llama is sharded with an index), and
                  reference.safetensors: input_ids [2, 16] and transformers' logits.
                  model/huggingface_pretrained_model must reproduce the logits.
export_<case>/    case.toml: a model/gpt2 config (with our extensions where the family needs
                  them); weights.txt: how every state-dict tensor is filled (the integer hash of
                  gpt2_reference.py, salt = position in sorted key order); expected_config.json:
                  the config.json fields a transformers model of that family has;
                  reference.safetensors: input_ids and the logits of that transformers model
                  holding the same weights, mapped here independently of the C++ exporter.
                  The test fills model/gpt2, checks its logits, exports it, compares config.json,
                  loads the export back and checks logits and tensors.

    .deps/bench/bin/python scripts/reference/make_hf_fixtures.py plugins/gpt2/tests/data/hf plugins/moe/tests/data/hf

plugins/moe/tests/data/hf/import_<family>/ (Mixtral, Qwen2-MoE, Qwen3-MoE): as import_<family>,
and reference.safetensors also holds the next-token cross-entropy of the logits ("loss") and its
gradient of every parameter ("grad/<transformers name>").

Versions are recorded in every reference.safetensors' metadata.
"""
import json
import math
import shutil
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt2_reference import fill_value, toml_value  # noqa: E402  (the shared weight formula and TOML writer)

B, T = 2, 16
META = {"torch": torch.__version__, "transformers": transformers.__version__,
        "script": "scripts/reference/make_hf_fixtures.py"}


def input_ids(vocab):
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (B, T), generator=g)


def randomize(model, seed):
    """Weights large enough that every part matters (transformers' init, std 0.02, gives flat logits)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed" in name or name.endswith(("wte.weight", "wpe.weight")):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[0] if "transformer.h" in name else p.shape[1]  # GPT-2's Conv1D is [in, out]
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / math.sqrt(fan_in)))


def save_reference(folder, ids, logits):
    save_file({"input_ids": ids.contiguous(), "logits": logits.float().contiguous()},
              str(folder / "reference.safetensors"), metadata=META)


IMPORTS = {
    "llama": (transformers.LlamaConfig, dict(vocab_size=96, hidden_size=32, intermediate_size=48,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                                             tie_word_embeddings=False), "20KB"),
    "llama3_scaled_bias": (transformers.LlamaConfig, dict(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        # wavelengths 6.3, 167, 4443, 118k against 16 / 200: one kept, one smoothed, two scaled
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 25.0,
                      "original_max_position_embeddings": 400},
        attention_bias=True, mlp_bias=True, tie_word_embeddings=True), None),
    "mistral_window": (transformers.MistralConfig, dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1000000.0,
        sliding_window=5, tie_word_embeddings=False), None),
    "qwen2_linear": (transformers.Qwen2Config, dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0}, use_sliding_window=False, tie_word_embeddings=True),
        None),
    # qk-norm before RoPE, heads wider than hidden_size / num_attention_heads, biases on q/k/v/o
    "qwen3": (transformers.Qwen3Config, dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
        attention_bias=True, tie_word_embeddings=True), None),
    # Mistral-Nemo's shape: head_dim given and not hidden_size / num_attention_heads
    "mistral_head_dim": (transformers.MistralConfig, dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1000000.0,
        sliding_window=7, tie_word_embeddings=False), None),
    "gpt2": (transformers.GPT2Config, dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                           activation_function="gelu_new", layer_norm_epsilon=1e-5), None),
    "gpt2_gelu_untied": (transformers.GPT2Config, dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                                       n_inner=48, activation_function="gelu",
                                                       tie_word_embeddings=False), None),
}

CAUSAL_LM = {
    "LlamaConfig": transformers.LlamaForCausalLM, "MistralConfig": transformers.MistralForCausalLM,
    "Qwen2Config": transformers.Qwen2ForCausalLM, "GPT2Config": transformers.GPT2LMHeadModel,
    "Qwen3Config": transformers.Qwen3ForCausalLM, "MixtralConfig": transformers.MixtralForCausalLM,
    "Qwen2MoeConfig": transformers.Qwen2MoeForCausalLM, "Qwen3MoeConfig": transformers.Qwen3MoeForCausalLM,
}

# The Mixture-of-Experts families (plugins/moe/tests/data/hf): logits and the gradients of the
# next-token cross-entropy of every parameter ("grad/<transformers name>").
MOE_IMPORTS = {
    # softmax top-2 of 4, normalized; every block MoE
    "mixtral": (transformers.MixtralConfig, dict(
        vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1000000.0,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    # top-2 of 4, not normalized, a gated shared expert, block 1 dense (mlp_only_layers), q/k/v biases
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=True)),
    # top-3 of 6, normalized, qk-norm, wide heads, every second block MoE (decoder_sparse_step 2)
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
        moe_intermediate_size=16, num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=2,
        tie_word_embeddings=False)),
}


def make_import(out, name, config_cls, kwargs, shard=None, grads=False):
    """import_<name>/: the model saved with save_pretrained and reference.safetensors; with `grads`,
    also the next-token cross-entropy of the logits ("loss") and its gradient of every parameter
    ("grad/<transformers name>")."""
    folder = out / f"import_{name}"
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    config = config_cls(**kwargs)
    model = CAUSAL_LM[config_cls.__name__](config).eval()
    randomize(model, seed=len(name))
    model.tie_weights()
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, safe_serialization=True, **kw)
    ids = input_ids(config.vocab_size)
    with torch.set_grad_enabled(grads):
        logits = model(ids).logits
    if not grads:
        save_reference(folder, ids, logits)
        print(f"import_{name}: {type(model).__name__}, {sum(p.numel() for p in model.parameters())} parameters")
        return
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1))
    loss.backward()
    tensors = {"input_ids": ids.contiguous(), "logits": logits.detach().float().contiguous(), "loss": loss.detach()}
    for n, p in model.named_parameters():
        tensors["grad/" + n] = p.grad.detach().contiguous()
    save_file(tensors, str(folder / "reference.safetensors"), metadata=META)
    print(f"import_{name}: {type(model).__name__}, {sum(p.numel() for p in model.parameters())} parameters, "
          f"loss {loss.item():.5f}")


# ---- export cases: model/gpt2 configs and the transformers model they must become -------------------

D, V, S = 128, 256, 16


def rms(eps=1e-5):
    return {"norm_type": "pytorch_rms_norm", "config": {"normalized_shape": D, "eps": eps}}


def layer_norm(eps=1e-5):
    return {"norm_type": "layer_norm", "config": {"normalized_shape": D, "eps": eps, "elementwise_affine": True,
                                                  "bias": True}}


def rope(base, scaling=None):
    cfg = {"n_embd": D, "n_head": 8, "seq_length_dim": -2, "base_freq": base}
    if scaling:
        cfg["rope_scaling"] = scaling
    return {"type_hint": "RotaryTransform", "config": cfg}


def gpt2_config(**over):
    cfg = dict(sample_key="input_ids", prediction_key="logits", poe_type="NOPE", sequence_length=S, vocab_size=V,
               n_layer=2, n_head_q=8, n_head_kv=4, n_embd=D, ffn_hidden=128, dropout=0.0, bias=False,
               attention_implementation="manual", activation_type="swiglu",
               attention_config={"qkv_transforms": [rope(100000)]}, attention_norm_config=rms(),
               ffn_norm_config=rms(), lm_head_norm_config=rms(), use_weight_tying=True,
               enforce_swiglu_hidden_dim_multiple_of=128)
    cfg.update(over)
    return cfg


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}

EXPORTS = {
    # the quickstart's shape: RoPE, GQA, SwiGLU, RMSNorm, tied
    "llama": (gpt2_config(), "llama", transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=16, max_position_embeddings=S, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False)),
    "qwen2_llama3_rope": (gpt2_config(qkv_bias=True, use_weight_tying=False,
                                      attention_config={"qkv_transforms": [rope(500000, LLAMA3)]}),
                          "qwen2", transformers.Qwen2Config(
        vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=S, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3), tie_word_embeddings=False, use_sliding_window=False)),
    "mistral_window": (gpt2_config(attention_implementation="pytorch_flash",
                                   attention_config={"qkv_transforms": [rope(10000)], "sliding_window": 6}),
                       "mistral", transformers.MistralConfig(
        vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=16, max_position_embeddings=S, rms_norm_eps=1e-5, rope_theta=10000.0,
        sliding_window=6, tie_word_embeddings=True)),
    # qk-norm before RoPE, heads of 32 (not D / 8 = 16), biases on q/k/v/o
    "qwen3": (gpt2_config(qkv_bias=True, attn_proj_bias=True, head_dim=32,
                          attention_config={"qkv_transforms": [
                              {"type_hint": "RotaryTransform",
                               "config": {"n_embd": 256, "n_head": 8, "seq_length_dim": -2, "base_freq": 1000000}}],
                              "qk_norm_config": {"norm_type": "pytorch_rms_norm",
                                                 "config": {"normalized_shape": 32, "eps": 1e-5}},
                              "qk_norm_position": "before_transforms"}),
              "qwen3", transformers.Qwen3Config(
        vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=S, rms_norm_eps=1e-5, rope_theta=1000000.0,
        attention_bias=True, tie_word_embeddings=True)),
    "gpt2": (gpt2_config(poe_type="ABSOLUTE", n_head_kv=8, bias=True, activation_type="gelu_tanh", ffn_hidden=256,
                         attention_config={"qkv_transforms": []}, attention_norm_config=layer_norm(),
                         ffn_norm_config=layer_norm(), lm_head_norm_config=layer_norm(), use_weight_tying=False),
             "gpt2", transformers.GPT2Config(vocab_size=V, n_positions=S, n_embd=D, n_layer=2, n_head=8, n_inner=256,
                                             activation_function="gelu_new", layer_norm_epsilon=1e-5,
                                             tie_word_embeddings=False)),
}


def hf_name_map(family, cfg, hf_sd):
    """our key -> (hf key, kind): an independent statement of the naming the exporter must follow."""
    m = {}
    L = cfg["n_layer"]
    if family == "gpt2":
        m["transformer.wte.weight"] = ("transformer.wte.weight", "same")
        m["transformer.wpe.weight"] = ("transformer.wpe.weight", "same")
        for i in range(L):
            o, h = f"transformer.h.{i}.", f"transformer.h.{i}."
            for p in ("weight", "bias"):
                m[o + "attention_norm." + p] = (h + "ln_1." + p, "same")
                m[o + "ffn_norm." + p] = (h + "ln_2." + p, "same")
            for j, x in enumerate("qkv"):
                m[o + f"attn.{x}_attn.weight"] = (h + "attn.c_attn.weight", f"qkv_w{j}")
                m[o + f"attn.{x}_attn.bias"] = (h + "attn.c_attn.bias", f"qkv_b{j}")
            for ours, theirs in (("attn.c_proj", "attn.c_proj"), ("mlp.c_fc", "mlp.c_fc"), ("mlp.c_proj", "mlp.c_proj")):
                m[o + ours + ".weight"] = (h + theirs + ".weight", "t")
                m[o + ours + ".bias"] = (h + theirs + ".bias", "same")
        m["transformer.lm_head_norm.weight"] = ("transformer.ln_f.weight", "same")
        m["transformer.lm_head_norm.bias"] = ("transformer.ln_f.bias", "same")
    else:
        m["transformer.wte.weight"] = ("model.embed_tokens.weight", "same")
        for i in range(L):
            o, h = f"transformer.h.{i}.", f"model.layers.{i}."
            m[o + "attention_norm.weight"] = (h + "input_layernorm.weight", "same")
            m[o + "ffn_norm.weight"] = (h + "post_attention_layernorm.weight", "same")
            for ours, theirs in (("q_attn", "q_proj"), ("k_attn", "k_proj"), ("v_attn", "v_proj"), ("c_proj", "o_proj")):
                for p in ("weight", "bias"):
                    if h + f"self_attn.{theirs}.{p}" in hf_sd:
                        m[o + f"attn.{ours}.{p}"] = (h + f"self_attn.{theirs}.{p}", "same")
            for x in ("q", "k"):
                if h + f"self_attn.{x}_norm.weight" in hf_sd:
                    m[o + f"attn.{x}_norm.weight"] = (h + f"self_attn.{x}_norm.weight", "same")
            for ours, theirs in (("W", "gate_proj"), ("V", "up_proj"), ("W_2", "down_proj")):
                m[o + f"mlp.{ours}.weight"] = (h + f"mlp.{theirs}.weight", "same")
        m["transformer.lm_head_norm.weight"] = ("model.norm.weight", "same")
    if not cfg["use_weight_tying"]:
        m["transformer.lm_head.weight"] = ("lm_head.weight", "same")
    return m


def our_shape(hf_t, kind):
    if kind == "t":
        return list(hf_t.shape[::-1])
    if kind.startswith("qkv_w"):
        return [hf_t.shape[1] // 3, hf_t.shape[0]]
    if kind.startswith("qkv_b"):
        return [hf_t.shape[0] // 3]
    return list(hf_t.shape)


def fill_spec(key, shape):
    if key.endswith(".bias"):
        return 0.0, 0.2
    if len(shape) == 1:
        return 1.0, 0.2
    if key in ("transformer.wte.weight", "transformer.wpe.weight"):
        return 0.0, 2.0
    return 0.0, 2.0 / math.sqrt(shape[1])


EXPECTED_KEYS = {
    "llama": ["model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
              "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act"],
    "qwen2": ["model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta",
              "rope_scaling", "tie_word_embeddings", "use_sliding_window", "hidden_act"],
    "mistral": ["model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                "rope_theta", "sliding_window", "tie_word_embeddings", "hidden_act"],
    "qwen3": ["model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
              "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias", "use_sliding_window",
              "hidden_act"],
    "gpt2": ["model_type", "architectures", "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
             "activation_function", "layer_norm_epsilon", "tie_word_embeddings", "scale_attn_weights",
             "scale_attn_by_inverse_layer_idx"],
}


def make_export(out, name, cfg, family, hf_config):
    folder = out / f"export_{name}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    hf_config.architectures = [CAUSAL_LM[type(hf_config).__name__].__name__]
    model = CAUSAL_LM[type(hf_config).__name__](hf_config).eval()
    hf_sd = model.state_dict()
    names = hf_name_map(family, cfg, hf_sd)
    lines = ["# key salt offset scale (gpt2_reference.py's hash; salt = index in sorted key order)"]
    hf_new = {}
    with torch.no_grad():
        for salt, key in enumerate(sorted(names)):
            hf_key, kind = names[key]
            shape = our_shape(hf_sd[hf_key], kind)
            offset, scale = fill_spec(key, shape)
            t = fill_value(salt, shape, offset, scale)
            lines.append(f"{key} {salt} {offset!r} {scale!r}")
            if kind == "same":
                hf_new[hf_key] = t
            elif kind == "t":
                hf_new[hf_key] = t.t().contiguous()
            else:
                j = int(kind[-1])
                full = hf_new.setdefault(hf_key, hf_sd[hf_key].clone())
                d = shape[0]
                if kind.startswith("qkv_w"):
                    full[:, j * d:(j + 1) * d] = t.t()
                else:
                    full[j * d:(j + 1) * d] = t
        missing, unexpected = model.load_state_dict(hf_new, strict=False)
        missing = [k for k in missing if not (cfg["use_weight_tying"] and k == "lm_head.weight")
                   and not k.endswith((".attn.bias", ".attn.masked_bias"))]
        assert not missing and not unexpected, (missing, unexpected)
        model.tie_weights()
        ids = input_ids(V)
        logits = model(ids).logits
    (folder / "case.toml").write_text(
        "# Generated by scripts/reference/make_hf_fixtures.py; do not edit.\n\n[model]\ncomponent_key = \"model\"\n"
        f"variant_key = \"gpt2\"\nconfig = {toml_value(cfg)}\n")
    (folder / "weights.txt").write_text("\n".join(lines) + "\n")
    full = json.loads(model.config.to_json_string())
    expected = {k: full.get(k) for k in EXPECTED_KEYS[family]}
    (folder / "expected_config.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    save_reference(folder, ids, logits)
    print(f"export_{name}: {type(model).__name__}, max |logit| {logits.abs().max().item():.3g}")


def main(out: Path, moe_out: Path):
    versions = (f"Generated by scripts/reference/make_hf_fixtures.py with torch {torch.__version__}, "
                f"transformers {transformers.__version__} (CPU, float32).\n")
    out.mkdir(parents=True, exist_ok=True)
    for name, (cls, kwargs, shard) in IMPORTS.items():
        make_import(out, name, cls, kwargs, shard)
    for name, (cfg, family, hf_config) in EXPORTS.items():
        make_export(out, name, cfg, family, hf_config)
    (out / "VERSIONS").write_text(versions)
    moe_out.mkdir(parents=True, exist_ok=True)
    for name, (cls, kwargs) in MOE_IMPORTS.items():
        make_import(moe_out, name, cls, kwargs, grads=True)
    (moe_out / "VERSIONS").write_text(versions)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("plugins/gpt2/tests/data/hf"),
         Path(sys.argv[2]) if len(sys.argv) > 2 else Path("plugins/moe/tests/data/hf"))
