#!/usr/bin/env python3
"""Reference values of model/coca (plugins/coca/tests/coca_test.cpp) from Modalities 0.5.0's own CoCa.

Each case builds Modalities' CoCa at tiny sizes, then sets every parameter explicitly from a seeded
generator (including text_decoder.cls_token, which Modalities allocates with torch.empty and never
initializes, and the attention-pooling queries): LayerNorm weights 1 + N(0, 0.1), everything else
N(0, 0.2). It runs forward on seeded images [2, 3, 8, 8] and token ids [2, 7] and backward of
sum(logits * w_logits) + sum(vision_cls * w_vision) + sum(text_cls * w_text) with seeded weights w,
in float64 (so the comparison measures the implementation, not float32 rounding; the weights and
inputs are float32 values, so they are stored exactly, and the results are stored rounded to
float32: 6e-8 relative, far below the tests' 1e-5). The ViT's MLP is 3072 wide whatever the
config (Modalities hard-codes it), so the widths are small elsewhere. The file holds,
per case (prefix "<case>."): every state_dict entry under Modalities' name ("state." + name, the
tied lm_head weight included; the attention mask buffers, tril of ones, only named in the metadata),
the inputs, the three outputs, the
w's, and the gradient of every named parameter ("grad." + name); its metadata the config, the
state_dict keys and the named_parameters of each case, in Modalities' order.

  swiglu_default   SwiGLU text MLPs, default_attention (the manual softmax and its mask buffers)
  gelu_flash       GELU text MLPs, pytorch_flash_attention, a ViT cls token, biases off in the text

Run with the reference environment (scripts/setup_bench_env.sh: torch 2.11.0, Modalities 0.5.0):
  .deps/bench/bin/python scripts/reference/make_coca_reference.py plugins/coca/tests/data
"""

import importlib.metadata
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from modalities.models.coca.coca_model import CoCa, CoCaConfig

CASES = {
    "swiglu_default": dict(engine="default_attention", activation="swiglu", add_cls_token=False, text_bias=True,
                           bias_attn_pool=False, vision_layers=1),
    "gelu_flash": dict(engine="pytorch_flash_attention", activation="gelu", add_cls_token=True, text_bias=False,
                       bias_attn_pool=True, vision_layers=1),
}


def config(c):
    attention = {"attention_engine_type": c["engine"]}
    return {
        "prediction_key": "logits",
        "vision_embd_prediction_key": "vision_embeddings",
        "text_embd_prediction_key": "text_embeddings",
        "vision_cls_prediction_key": "vision_cls",
        "text_cls_prediction_key": "text_cls",
        "vision_encoder_config": {
            "sample_key": "images", "prediction_key": "vision_embeddings", "img_size": 8, "n_classes": None,
            "n_layer": c["vision_layers"], "attention_config": attention, "n_head": 2, "n_embd": 8, "dropout": 0.0,
            "patch_size": 4, "patch_stride": 4, "n_img_channels": 3, "add_cls_token": c["add_cls_token"],
            "bias": True,
        },
        "text_decoder_config": {
            "sample_key": "input_ids", "prediction_key": "logits", "block_size": 8, "vocab_size": 64,
            "n_layer_text": 2, "n_layer_multimodal_text": 2, "attention_config": attention, "n_head": 2,
            "ffn_hidden": 48, "n_embd": 8, "dropout": 0.0, "bias": c["text_bias"], "activation": c["activation"],
            "epsilon": 1e-5,
        },
        "n_pool_head": 4,
        "n_vision_queries": 3,
        "bias_attn_pool": c["bias_attn_pool"],
        "epsilon_attn_pool": 1e-5,
    }


def main(out_dir: Path):
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors, meta = {}, {"modalities": importlib.metadata.version("modalities"), "torch": torch.__version__,
                         "cases": {}}
    for name, c in CASES.items():
        cfg = config(c)
        model = CoCa(**dict(CoCaConfig(**cfg))).double()
        g = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                is_norm = "norm" in pname or ".ln_" in pname
                values = torch.randn(p.shape, generator=g, dtype=torch.float32).double()
                value = 1.0 + 0.1 * values if is_norm and pname.endswith(".weight") else 0.2 * values
                p.copy_(value.float().double())  # float32 values
        images = torch.randn((2, 3, 8, 8), generator=g, dtype=torch.float32).double()
        ids = torch.randint(0, 64, (2, 7), generator=g)
        out = model({"images": images, "input_ids": ids})
        w = {k: torch.randn(out[k].shape, generator=g, dtype=torch.float32).double()
             for k in ("logits", "vision_cls", "text_cls")}
        loss = sum((out[k] * w[k]).sum() for k in w)
        loss.backward()
        # The attention mask buffers of default_attention (tril of ones, [1, 1, 1024, 1024]) are only
        # named (in the metadata): their values are fixed.
        for k, v in model.state_dict().items():
            if v.dim() == 4 and v.shape[-1] == 1024:
                continue
            tensors[f"{name}.state.{k}"] = v.detach().clone().contiguous()
        for k, p in model.named_parameters():
            tensors[f"{name}.grad.{k}"] = p.grad.detach().clone().contiguous()
        tensors[f"{name}.images"] = images
        tensors[f"{name}.input_ids"] = ids
        for k in w:
            tensors[f"{name}.out.{k}"] = out[k].detach().clone().contiguous()
            tensors[f"{name}.w.{k}"] = w[k]
        meta["cases"][name] = {"config": cfg, "state_dict_keys": list(model.state_dict().keys()),
                               "named_parameters": [k for k, _ in model.named_parameters()]}
    tensors = {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    metadata = {"modalities": meta["modalities"], "torch": meta["torch"]}
    for name, m in meta["cases"].items():
        metadata[f"{name}.config"] = json.dumps(m["config"])
        metadata[f"{name}.state_dict_keys"] = "\n".join(m["state_dict_keys"])
        metadata[f"{name}.named_parameters"] = "\n".join(m["named_parameters"])
    save_file(tensors, str(out_dir / "coca_reference.safetensors"), metadata=metadata)
    print(f"wrote {len(tensors)} tensors to {out_dir}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "plugins/coca/tests/data"))
