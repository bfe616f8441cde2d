"""Converts checkpoints between Python Modalities and Modalities C++ (formats v1 and v2 of the
checkpointing plugin, plugins/checkpointing/README.md: v1 is written by one process, v2 by several
ranks; both are read, v1 is written).

Python Modalities writes `torch.save` pickles (FSDP1: a model and an optimizer `.bin`) or PyTorch
Distributed Checkpoint folders (DCP); neither can be read from LibTorch. Modalities C++ writes a
folder with `app_state.safetensors` + `manifest.json`. Needs `torch` and `safetensors`: the venv
.deps/bench of scripts/setup_bench_env.sh (torch 2.11.0, as our LibTorch), or the Python
environment that wrote or will read the checkpoint.

    .deps/bench/bin/python scripts/convert_checkpoint.py dcp-to-modalities   <DCP folder> <checkpoint_path>
    .deps/bench/bin/python scripts/convert_checkpoint.py fsdp1-to-modalities <model.bin> <optimizer.bin> <checkpoint_path>
    .deps/bench/bin/python scripts/convert_checkpoint.py bin-to-safetensors  <model.bin> <model.safetensors>
    .deps/bench/bin/python scripts/convert_checkpoint.py modalities-to-dcp   <folder> <checkpoint_path> [--optimizer adam]
    .deps/bench/bin/python scripts/convert_checkpoint.py modalities-to-fsdp1 <folder> <checkpoint_path>

Checkpoints keep their name (eid_<E>-seen_steps_<S>-...; the FSDP1 `-model`/`-optimizer` infix is
dropped or added) and get a last_checkpoint_info.json in <checkpoint_path>. Non-numeric optimizer
options (foreach, fused, amsgrad, ...) and scheduler attributes are dropped; Modalities
checkpoints hold no RNG state.
"""

import argparse
import datetime
import hashlib
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

FORMAT = "modalities_checkpoint"
FORMAT_VERSION = 1
NAME_RE = re.compile(
    r"eid_(?P<eid>.*?)(?:-(?:model|optimizer))?-seen_steps_(?P<S>\d+)-seen_tokens_(?P<K>\d+)"
    r"-target_steps_(?P<TS>\d+)-target_tokens_(?P<TT>\d+)"
)
# Scheduler attributes that only drive PyTorch's own bookkeeping and that the C++ schedulers do not store.
SCHEDULER_SKIP = {"_is_initial", "_get_lr_called_within_step", "verbose", "anneal_func", "_anneal_func_type", "optimizer"}


def parse_name(name: str) -> dict:
    m = NAME_RE.search(name)
    if not m:
        sys.exit(f"error: '{name}' does not contain eid_<E>-seen_steps_<S>-seen_tokens_<K>-target_steps_<TS>-target_tokens_<TT>")
    return m.groupdict()


def folder_name(p: dict) -> str:
    return f"eid_{p['eid']}-seen_steps_{p['S']}-seen_tokens_{p['K']}-target_steps_{p['TS']}-target_tokens_{p['TT']}"


def bin_name(p: dict, entity: str) -> str:
    return (f"eid_{p['eid']}-{entity}-seen_steps_{p['S']}-seen_tokens_{p['K']}"
            f"-target_steps_{p['TS']}-target_tokens_{p['TT']}.bin")


# --- Python objects -> flat tensors ----------------------------------------------------------

def scalar(v):
    if isinstance(v, bool):
        return torch.tensor(v, dtype=torch.bool)
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float64)
    return None


def flat_optimizer_options(fqn: str, group: dict, out: dict):
    for name, v in group.items():
        if name == "params" or isinstance(v, bool) or v is None:
            continue
        if isinstance(v, (tuple, list)):
            for i, x in enumerate(v):
                if isinstance(x, (int, float)) and not isinstance(x, bool):
                    out[f"optimizer.param_groups.{fqn}.{name}.{i}"] = torch.tensor(float(x), dtype=torch.float64)
        elif isinstance(v, (int, float)):
            out[f"optimizer.param_groups.{fqn}.{name}"] = torch.tensor(float(v), dtype=torch.float64)
        elif torch.is_tensor(v) and v.numel() == 1:
            out[f"optimizer.param_groups.{fqn}.{name}"] = v.detach().to(torch.float64).reshape(())


def flat_optimizer_from_flattened(opt: dict, out: dict):
    """Modalities' DCP optimizer state: already flat ('state.<fqn>.exp_avg', 'param_groups.<fqn>.lr')."""
    groups = {}
    for key, v in opt.items():
        if key.startswith("state."):
            out["optimizer." + key] = v if torch.is_tensor(v) else torch.tensor(float(v), dtype=torch.float32)
        elif key.startswith("param_groups."):
            fqn, _, name = key[len("param_groups."):].rpartition(".")
            groups.setdefault(fqn, {})[name] = v
    for fqn, group in groups.items():
        flat_optimizer_options(fqn, group, out)


def flat_optimizer_from_fsdp1(opt: dict, out: dict):
    """FSDP1 full optimizer state dict: {'state': {fqn: {...}}, 'param_groups': [{..., 'params': [fqn]}]}."""
    for fqn, state in opt["state"].items():
        for name, v in state.items():
            out[f"optimizer.state.{fqn}.{name}"] = v if torch.is_tensor(v) else torch.tensor(float(v), dtype=torch.float32)
    for group in opt["param_groups"]:
        for fqn in group["params"]:
            flat_optimizer_options(fqn, group, out)


def flat_scheduler(prefix: str, state: dict, out: dict):
    for name, v in state.items():
        if name in SCHEDULER_SKIP or v is None or isinstance(v, str):
            continue
        if name == "_schedulers":  # SequentialLR children
            for i, child in enumerate(v):
                flat_scheduler(f"{prefix}schedulers.{i}.", child, out)
        elif name == "_schedule_phases":  # OneCycleLR: the C++ port keeps the phase end steps
            out[f"{prefix}_schedule_phases.end_step"] = torch.tensor([float(p["end_step"]) for p in v], dtype=torch.float64)
        elif isinstance(v, (list, tuple)):
            ints = all(isinstance(x, int) and not isinstance(x, bool) for x in v) and name == "_milestones"
            out[prefix + name] = torch.tensor(v, dtype=torch.int64 if ints else torch.float64)
        elif torch.is_tensor(v):
            out[prefix + name] = v
        else:
            t = scalar(v)
            if t is not None:
                out[prefix + name] = t


# --- format v1 writer / reader ---------------------------------------------------------------

def write_modalities_folder(folder: pathlib.Path, tensors: dict, progress: dict, source: str):
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}  # no shared storage
        file = tmp / "app_state.safetensors"
        save_file(tensors, str(file), metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
        data = file.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        base = 8 + n
        entries = {}
        for name in sorted(k for k in header if k != "__metadata__"):
            e = header[name]
            b, end = e["data_offsets"]
            entries[name] = {"dtype": e["dtype"], "shape": e["shape"], "sha256": hashlib.sha256(data[base + b:base + end]).hexdigest()}
        S, K, TS, TT = (int(progress[k]) for k in ("S", "K", "TS", "TT"))
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "written_by": {"plugin": "scripts/convert_checkpoint.py", "plugin_version": "0.1.0", "variant": source,
                           "sdk_version": "", "torch_version": torch.__version__},
            "created_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "experiment_id": progress["eid"],
            "training_progress": {"num_seen_steps_total": S, "num_seen_tokens_total": K, "num_target_steps": TS,
                                  "num_target_tokens": TT, "num_seen_steps_current_run": S,
                                  "num_seen_tokens_current_run": K, "num_seen_steps_previous_run": 0,
                                  "num_seen_tokens_previous_run": 0},
            "run_device": "cpu",
            "loaded_plugins": {},
            "files": {"app_state.safetensors": {"bytes": len(data)}},
            "checksum": "sha256",
            "tensors": entries,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_info(folder.parent, {"checkpoint_folder_path": str(folder.absolute())})
    print(f"wrote {folder} ({len(tensors)} tensors)")


def write_info(directory: pathlib.Path, info: dict):
    (directory / "last_checkpoint_info.json").write_text(json.dumps(info))


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def checked_tensors(folder: pathlib.Path, file: str, expected: dict) -> dict:
    """The tensors of one safetensors file of the folder whose SHA-256 are `expected` (name -> hex)."""
    data = (folder / file).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    for name, sha in expected.items():
        if name not in header:
            sys.exit(f"error: {folder}: {file} lacks tensor '{name}'")
        b, end = header[name]["data_offsets"]
        if hashlib.sha256(data[8 + n + b:8 + n + end]).hexdigest() != sha:
            sys.exit(f"error: {folder}: tensor '{name}' in {file} does not match its SHA-256")
    return load_file(str(folder / file))


def read_modalities_folder(folder: pathlib.Path) -> dict:
    """Every tensor of a format-v1 (one file) or format-v2 (one file per rank, tensors in chunks)
    checkpoint, whole; RNG states (rng.*) of format v1 included, per-rank ones of v2 left out."""
    manifest = json.loads((folder / "manifest.json").read_text())
    version = manifest.get("format_version")
    if manifest.get("format") != FORMAT or version not in (1, 2):
        sys.exit(f"error: {folder} is not a Modalities C++ checkpoint of format version 1 or 2")
    if version == 1:
        return checked_tensors(folder, "app_state.safetensors",
                               {name: e["sha256"] for name, e in manifest["tensors"].items()})
    per_file = {}
    for name, e in manifest["tensors"].items():
        for c in e["chunks"]:
            per_file.setdefault(c["file"], {})[name] = c["sha256"]
    files = {file: checked_tensors(folder, file, expected) for file, expected in per_file.items()}
    out = {}
    for name, e in manifest["tensors"].items():
        full = torch.empty(e["shape"], dtype=SAFETENSORS_DTYPES[e["dtype"]])
        for c in e["chunks"]:
            index = tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["shape"]))
            full[index] = files[c["file"]][name]
        out[name] = full
    return out


def split(tensors: dict):
    model = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
    opt = {k[10:]: v for k, v in tensors.items() if k.startswith("optimizer.")}
    sched = {k[13:]: v for k, v in tensors.items() if k.startswith("lr_scheduler.")}
    return model, opt, sched


def python_value(t: torch.Tensor):
    if t.dim() == 0:
        return t.item()
    return t.tolist()


def optimizer_groups(opt: dict):
    """Flat optimizer keys -> per-parameter state and options (betas.0/betas.1 -> betas tuple)."""
    state, options = {}, {}
    for key, v in opt.items():
        if key.startswith("state."):
            fqn, _, name = key[6:].rpartition(".")
            state.setdefault(fqn, {})[name] = v
        elif key.startswith("param_groups."):
            rest = key[13:]
            m = re.match(r"(.*)\.(betas)\.(\d)$", rest)
            if m:
                options.setdefault(m.group(1), {}).setdefault("betas", {})[int(m.group(3))] = v.item()
            else:
                fqn, _, name = rest.rpartition(".")
                options.setdefault(fqn, {})[name] = v.item()
    for o in options.values():
        if "betas" in o:
            o["betas"] = tuple(o["betas"][i] for i in sorted(o["betas"]))
    return state, options


# torch.optim options this format drops (not numbers); DCP loading needs every key, so they come back with
# Modalities' values (as in Modalities: amsgrad, maximize, capturable, differentiable are false).
def optimizer_defaults(adam_w: bool) -> dict:
    return {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
            "fused": None, "decoupled_weight_decay": adam_w}


def python_scheduler(sched: dict) -> dict:
    out, children = {"_is_initial": False, "_get_lr_called_within_step": False}, {}
    for key, v in sched.items():
        m = re.match(r"schedulers\.(\d+)\.(.*)$", key)
        if m:
            children.setdefault(int(m.group(1)), {})[m.group(2)] = v
        elif key.startswith("_schedule_phases."):
            continue  # rebuilt by OneCycleLR's constructor
        else:
            out[key] = python_value(v)
    if children:
        out["_schedulers"] = [python_scheduler(children[i]) for i in sorted(children)]
    return out


# --- commands ------------------------------------------------------------------------------

def dcp_to_modalities(args):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = pathlib.Path(args.src)
    progress = parse_name(src.name)
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d) / "full.pt"
        dcp_to_torch_save(str(src), str(tmp))
        app = torch.load(tmp, map_location="cpu", weights_only=False)["app"]
    out = {f"model.{k}": v for k, v in app["model"].items()}
    flat_optimizer_from_flattened(app["optimizer"], out)
    if "lr_scheduler" in app:
        flat_scheduler("lr_scheduler.", app["lr_scheduler"], out)
    write_modalities_folder(pathlib.Path(args.dst) / folder_name(progress), out, progress, "dcp (Python Modalities)")


def fsdp1_to_modalities(args):
    model_file = pathlib.Path(args.model)
    progress = parse_name(model_file.name)
    model = torch.load(model_file, map_location="cpu", weights_only=False)
    opt = torch.load(args.optimizer, map_location="cpu", weights_only=False)
    out = {f"model.{k}": v for k, v in model.items()}
    flat_optimizer_from_fsdp1(opt, out)
    write_modalities_folder(pathlib.Path(args.dst) / folder_name(progress), out, progress, "fsdp1 (Python Modalities)")


def bin_to_safetensors(args):
    model = torch.load(args.src, map_location="cpu", weights_only=False)
    save_file({k: v.detach().contiguous().clone() for k, v in model.items()}, args.dst)
    print(f"wrote {args.dst} ({len(model)} tensors)")


def modalities_to_dcp(args):
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    src = pathlib.Path(args.src)
    model, opt, sched = split(read_modalities_folder(src))
    state, options = optimizer_groups(opt)
    flat_opt = {}
    for fqn, s in state.items():
        for name, v in s.items():
            flat_opt[f"state.{fqn}.{name}"] = v
    for fqn, o in options.items():
        for name, v in {**optimizer_defaults(args.optimizer == "adam_w"), **o}.items():
            flat_opt[f"param_groups.{fqn}.{name}"] = v
    app = {"model": model, "optimizer": flat_opt}
    if sched:
        app["lr_scheduler"] = python_scheduler(sched)
    dst = pathlib.Path(args.dst) / src.name
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d) / "full.pt"
        torch.save({"app": app}, tmp)
        torch_save_to_dcp(str(tmp), str(dst))
    write_info(dst.parent, {"checkpoint_folder_path": str(dst.absolute())})
    print(f"wrote {dst}")


def modalities_to_fsdp1(args):
    src = pathlib.Path(args.src)
    progress = parse_name(src.name)
    model, opt, _ = split(read_modalities_folder(src))
    state, options = optimizer_groups(opt)
    groups = []  # parameters with identical options share a group, in model order
    for fqn in model:
        if fqn not in options:
            continue
        o = options[fqn]
        for g in groups:
            if {k: v for k, v in g.items() if k != "params"} == o:
                g["params"].append(fqn)
                break
        else:
            groups.append({**o, "params": [fqn]})
    dst = pathlib.Path(args.dst)
    dst.mkdir(parents=True, exist_ok=True)
    model_path, opt_path = dst / bin_name(progress, "model"), dst / bin_name(progress, "optimizer")
    torch.save(model, model_path)
    torch.save({"state": state, "param_groups": groups}, opt_path)
    write_info(dst, {"model_checkpoint_path": str(model_path.absolute()), "optimizer_checkpoint_path": str(opt_path.absolute())})
    print(f"wrote {model_path} and {opt_path}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("dcp-to-modalities")
    c.add_argument("src"), c.add_argument("dst")
    c.set_defaults(fn=dcp_to_modalities)
    c = sub.add_parser("fsdp1-to-modalities")
    c.add_argument("model"), c.add_argument("optimizer"), c.add_argument("dst")
    c.set_defaults(fn=fsdp1_to_modalities)
    c = sub.add_parser("bin-to-safetensors")
    c.add_argument("src"), c.add_argument("dst")
    c.set_defaults(fn=bin_to_safetensors)
    c = sub.add_parser("modalities-to-dcp")
    c.add_argument("src"), c.add_argument("dst")
    c.add_argument("--optimizer", choices=["adam_w", "adam"], default="adam_w",
                   help="the optimizer variant that wrote the checkpoint (sets decoupled_weight_decay)")
    c.set_defaults(fn=modalities_to_dcp)
    c = sub.add_parser("modalities-to-fsdp1")
    c.add_argument("src"), c.add_argument("dst")
    c.set_defaults(fn=modalities_to_fsdp1)
    args = p.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
