#!/usr/bin/env python3
"""Runs Modalities' own `data prepare_instruction_tuning_data` (modalities 0.5.0, Python) on the
bundled example -- data/instruction_tuning/chats.jsonl, the chat template and split of
configs/instruction_tuning/apply_chat_template.toml, the packing of packed_chat_dataset.toml --
and stores its outputs per split as <split>.jsonl / <split>.idx / <split>.pbin in the output
folder (default tests/data/instruction_tuning/expected). tests/cli/cli_test.cpp runs our verb on
the same inputs and compares the files byte for byte.

    .deps/bench/bin/python scripts/reference/make_instruction_tuning_reference.py [out_dir]
"""
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def main(out: Path) -> None:
    from modalities.dataloader.create_instruction_tuning_data import create_instruction_tuning_data

    ours = tomllib.loads((ROOT / "configs/instruction_tuning/apply_chat_template.toml").read_text())
    pack = tomllib.loads((ROOT / "configs/instruction_tuning/packed_chat_dataset.toml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pack_cfg = {
            "settings": {k: v for k, v in pack["settings"].items()},
            "tokenizer": {
                "component_key": "tokenizer",
                "variant_key": "pretrained_hf_tokenizer",
                "config": {
                    "pretrained_model_name_or_path": str(ROOT / "data/tokenizer/qwen2_style_small"),
                    "padding": False,
                    "truncation": False,
                    "special_tokens": {"pad_token": "${settings.eod_token}",
                                       "additional_special_tokens": pack["tokenizer"]["config"]["special_tokens"][
                                           "additional_special_tokens"]},
                },
            },
        }
        (tmp / "pack.yaml").write_text(yaml.safe_dump(pack_cfg, sort_keys=False, allow_unicode=True))
        cfg = {
            "settings": {
                "src_path": str(ROOT / "data/instruction_tuning/chats.jsonl"),
                "dst_path": str(tmp / "out/chats.jsonl"),
                "messages_key": ours["settings"]["messages_key"],
                "pbin_creation_config_file_path": str(tmp / "pack.yaml"),
                "split_config": ours["settings"]["split_config"],
            },
            "instruction_data_transformation": ours["instruction_data_transformation"],
            "jinja2_chat_template": ours["jinja2_chat_template"],
            "chat_template_data": ours["chat_template_data"],
        }
        (tmp / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
        create_instruction_tuning_data(tmp / "config.yaml")
        [folder] = list((tmp / "out").iterdir())
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted(folder.iterdir()):
            name = f.name
            for split in ("train", "val", "test"):
                if name.startswith(f"chats_{split}.") and f.suffix in (".jsonl", ".idx", ".pbin"):
                    shutil.copyfile(f, out / f"{split}{f.suffix}")
                    print(f"{f.name} -> {out / (split + f.suffix)} ({f.stat().st_size} bytes)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests/data/instruction_tuning/expected")
