#!/usr/bin/env python3
"""Live check of `modalities convert_pytorch_to_hf_checkpoint` against Python.

Loads the exported folder with transformers' AutoModelForCausalLM (no Modalities code), loads
the original checkpoint into Modalities' own GPT2LLM (the Python package, built from the same
model config), runs both on the same random token ids and compares the logits. Also checks that
AutoTokenizer loads the copied tokenizer files when there are any.

    .deps/bench/bin/python scripts/check_hf_export.py --hf_dir out/hf/quickstart \
        --resolved_config resolved.toml --checkpoint <checkpoint folder or .safetensors>

`resolved.toml` is `modalities config resolve <conversion config>`; its model_raw (or model)
section gives the Modalities model config. scripts/check_hf_export.sh runs the whole chain on the
quickstart checkpoint. Needs torch, transformers, safetensors and modalities (the bench
environment, scripts/setup_bench_env.sh). Exit status 0 when the logits agree within --atol.
"""
import argparse
import json
import sys
import tomllib
from pathlib import Path

import torch
from safetensors.torch import load_file


def modalities_model(resolved: dict):
    from modalities.models.gpt2.gpt2_model import GPT2LLMConfig
    from modalities.models.model_factory import GPT2ModelFactory

    for key in ("model_raw", "model"):
        node = resolved.get(key)
        if node and node.get("variant_key") == "gpt2":
            cfg = dict(node["config"])
            break
    else:
        sys.exit("the resolved config has no model_raw/model of variant gpt2")
    cfg.pop("seed", None)
    parsed = GPT2LLMConfig(**cfg)
    return GPT2ModelFactory.get_gpt2_model(**{k: getattr(parsed, k) for k in type(parsed).model_fields})


def sharded_state(folder: Path) -> dict:
    """A format-v2 checkpoint (one file per rank; plugins/checkpointing/README.md): every tensor
    assembled from the chunks the manifest lists."""
    manifest = json.loads((folder / "manifest.json").read_text())
    files = {}
    sd = {}
    for name, rec in manifest["tensors"].items():
        if not name.startswith("model."):
            continue
        parts = []
        for c in rec["chunks"]:
            f = files.setdefault(c["file"], load_file(str(folder / c["file"])))
            parts.append((c["offsets"], f[name]))
        full = torch.empty(rec["shape"], dtype=parts[0][1].dtype)
        for offsets, t in parts:
            full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
        sd[name] = full
    return sd


def checkpoint_state(path: Path) -> dict:
    if path.is_dir() and not (path / "app_state.safetensors").exists():
        sd = sharded_state(path)
    else:
        sd = load_file(str(path / "app_state.safetensors" if path.is_dir() else path))
    if any(k.startswith("model.") for k in sd):
        sd = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}
    return sd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf_dir", type=Path, required=True)
    ap.add_argument("--resolved_config", type=Path, required=True)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=0, help="tokens per sequence (default: the model's maximum)")
    ap.add_argument("--atol", type=float, default=1e-4)
    a = ap.parse_args()

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    resolved = tomllib.loads(a.resolved_config.read_text())
    ours = modalities_model(resolved)
    missing, unexpected = ours.load_state_dict(checkpoint_state(a.checkpoint), strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        sys.exit(f"checkpoint does not fit the Modalities model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    ours.eval()

    hf = AutoModelForCausalLM.from_pretrained(a.hf_dir, torch_dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    cfg = hf.config
    length = a.length or getattr(cfg, "max_position_embeddings", None) or cfg.n_positions
    vocab = cfg.vocab_size
    ids = torch.randint(0, vocab, (a.batch, length), generator=torch.Generator().manual_seed(1234))
    with torch.no_grad():
        ref = ours({ours.sample_key: ids})[ours.prediction_key].float()
        got = hf(ids).logits.float()
    diff = (ref - got).abs().max().item()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: {type(hf).__name__} from {a.hf_dir}")
    print(f"logits {tuple(got.shape)}: max |Modalities(checkpoint) - transformers(export)| = {diff:.3g} "
          f"(atol {a.atol}; max |logit| {ref.abs().max().item():.3g})")
    ok = diff <= a.atol
    if (a.hf_dir / "tokenizer.json").exists():
        tok = AutoTokenizer.from_pretrained(a.hf_dir)
        text = "Lorem ipsum dolor sit amet"
        print(f"AutoTokenizer {type(tok).__name__}: {text!r} -> {tok(text)['input_ids']}")
        gen = hf.generation_config
        print(f"generation_config: bos {gen.bos_token_id}, eos {gen.eos_token_id}")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
