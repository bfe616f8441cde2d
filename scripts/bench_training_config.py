#!/usr/bin/env python3
"""Derives the benchmark configs of scripts/bench_training.sh and scripts/bench_host_overhead.sh
from configs/quickstart/train.toml by editing its text, so comments and structure stay readable.

* The `[initialized_model]` component (model_initialized + composed init) is replaced by
  `model/fsdp1_checkpointed` loading --init with `checkpoint_loading/torch` on the CPU; the
  instance name stays `initialized_model`, so every reference to it still works. Both sides of the
  comparison then start from the very same weights (the ones train_reference.py draws and saves).
* The dataset path becomes absolute (the derived file lives in the output folder).
* `--set section.key=value` replaces one `key = ...` line of a table (value in TOML syntax).

  python3 scripts/bench_training_config.py --base configs/quickstart/train.toml --out x.toml \
      --init x/init.safetensors --set settings.training_target.num_target_steps=20
Only the standard library (Python >= 3.11 for tomllib, used to check the result).
"""
import argparse
import os
import re
import sys
import tomllib
from pathlib import Path

HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")

CHECKPOINTED_MODEL = """[initialized_model]
component_key = "model"
variant_key = "fsdp1_checkpointed"

[initialized_model.config]
checkpoint_path = "{init}"
model = {{ instance_key = "model_raw", pass_type = "BY_REFERENCE" }}

[initialized_model.config.checkpoint_loading]
component_key = "checkpoint_loading"
variant_key = "torch"
config = {{ device = "cpu" }}

"""


def split_tables(lines):
    """[(table name or None for the preamble, [lines])] in file order."""
    out = [(None, [])]
    for line in lines:
        m = HEADER.match(line)
        if m:
            out.append((m.group(1), []))
        out[-1][1].append(line)
    return out


def set_key(tables, dotted, value):
    section, _, key = dotted.rpartition(".")
    pattern = re.compile(rf"^(\s*){re.escape(key)}\s*=")
    for name, lines in tables:
        if (name or "") != section:
            continue
        for i, line in enumerate(lines):
            m = pattern.match(line)
            if m:
                lines[i] = f"{m.group(1)}{key} = {value}\n"
                return
    sys.exit(f"bench_training_config.py: no line '{key} = ...' in table [{section}] (from --set {dotted}={value})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="configs/quickstart/train.toml")
    ap.add_argument("--out", required=True, help="derived config to write")
    ap.add_argument("--init", help="safetensors file the model is loaded from (default: keep the config's "
                    "own [initialized_model])")
    ap.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE", help="replace a key's value")
    args = ap.parse_args()

    base = Path(args.base).resolve()
    tables = split_tables(base.read_text().splitlines(keepends=True))
    # The dataset: $MODALITIES_BENCH_DATA (a larger .pbin, e.g. scripts/bench_gpu.sh's copies of the
    # sample corpus), else the bundled data/sample/train.pbin, as an absolute path.
    env_data = os.environ.get("MODALITIES_BENCH_DATA")
    data = Path(env_data).resolve() if env_data else (base.parent / "../../data/sample/train.pbin").resolve()
    set_key(tables, "settings.paths.train_dataset_path", f'"{data}"')
    for item in args.set:
        dotted, sep, value = item.partition("=")
        if not sep:
            sys.exit(f"bench_training_config.py: --set {item}: expected TABLE.KEY=VALUE")
        set_key(tables, dotted.strip(), value.strip())

    text = ""
    replaced = False
    for name, lines in tables:
        if args.init and (name == "initialized_model" or (name or "").startswith("initialized_model.")):
            if not replaced:
                text += CHECKPOINTED_MODEL.format(init=Path(args.init).resolve())
                replaced = True
            continue
        text += "".join(lines)
    if args.init and not replaced:
        sys.exit(f"bench_training_config.py: {base} has no [initialized_model] table")
    tomllib.loads(text)  # still valid TOML
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
