#!/usr/bin/env python3
"""Runs Modalities 0.5.0 (Python, from PyPI) on the bundled sample corpus and stores its outputs:
data/sample/{train,eval}.idx from `modalities data create_raw_index` and
data/sample/{train,eval}.pbin from `modalities data pack_encoded_data`, with the settings of
configs/data_preparation/pack_sample.toml (tokenizer data/tokenizer/gpt2_style_8k, jq `.text`,
EOD <|endoftext|>). scripts/quickstart.sh and the data tests run our verbs on the same inputs and
compare the files byte for byte.

    .deps/bench/bin/python scripts/reference/make_sample_data.py [--check]

--check runs Modalities into a temporary folder and compares with the committed files.
The environment comes from scripts/setup_bench_env.sh (modalities 0.5.0, tokenizers 0.22.2,
transformers 4.57.6); the script refuses other Modalities versions.
"""
import argparse
import filecmp
import importlib.metadata as md
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
MODALITIES = Path(sys.executable).parent / "modalities"


def run_modalities(corpus: str, out: Path) -> None:
    ours = tomllib.loads((ROOT / "configs/data_preparation/pack_sample.toml").read_text())
    src = ROOT / "data/sample" / f"{corpus}.jsonl"
    subprocess.run([str(MODALITIES), "data", "create_raw_index", str(src), "--index_path", str(out / f"{corpus}.idx")],
                   check=True)
    settings = ours["settings"]
    cfg = {
        "settings": {
            "src_path": str(src),
            "dst_path": str(out / f"{corpus}.pbin"),
            "index_path": str(out / f"{corpus}.idx"),
            "jq_pattern": settings["jq_pattern"],
            "num_cpus": 2,
            "eod_token": settings["eod_token"],
            "processing_batch_size": settings["processing_batch_size"],
            "raw_samples_queue_size": settings["raw_samples_queue_size"],
            "processed_samples_queue_size": settings["processed_samples_queue_size"],
        },
        "tokenizer": {
            "component_key": "tokenizer",
            "variant_key": "pretrained_hf_tokenizer",
            "config": {
                "pretrained_model_name_or_path": str(ROOT / "data/tokenizer/gpt2_style_8k"),
                "padding": False,
                "truncation": False,
            },
        },
    }
    (out / f"{corpus}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    subprocess.run([str(MODALITIES), "data", "pack_encoded_data", str(out / f"{corpus}.yaml")], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="run into a temp folder and compare with the committed files")
    args = ap.parse_args()
    versions = {p: md.version(p) for p in ("modalities", "tokenizers", "transformers")}
    if versions["modalities"] != "0.5.0":
        sys.exit(f"needs modalities 0.5.0 (scripts/setup_bench_env.sh), found {versions['modalities']}")
    print("versions:", ", ".join(f"{k} {v}" for k, v in versions.items()))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for corpus in ("train", "eval"):
            run_modalities(corpus, tmp)
        bad = []
        for corpus in ("train", "eval"):
            for ext in (".idx", ".pbin"):
                dst = ROOT / "data/sample" / f"{corpus}{ext}"
                if args.check:
                    if not filecmp.cmp(tmp / f"{corpus}{ext}", dst, shallow=False):
                        bad.append(str(dst.relative_to(ROOT)))
                else:
                    shutil.copyfile(tmp / f"{corpus}{ext}", dst)
                    print("wrote", dst.relative_to(ROOT), dst.stat().st_size, "bytes")
        if bad:
            sys.exit("Modalities' output differs from the committed file: " + ", ".join(bad))
        if args.check:
            print("Modalities 0.5.0 reproduces every committed .idx/.pbin byte for byte")


if __name__ == "__main__":
    main()
