#!/usr/bin/env python3
"""Checks that an offline W&B run holds exactly what a recorded run folder holds.

Used by scripts/check_wandb_replay.sh after scripts/wandb_replay.py. It reads the run's .wandb
transaction log the way wandb itself stores it, with no network: the file is a LevelDB-style log
(7-byte header ":W&B" + magic 0xBEE1 + version 0; 32 KiB blocks of chunks, each with a CRC-32 over
type byte + payload) of wandb.proto.wandb_internal_pb2.Record messages, which are parsed with
wandb's own protobuf classes. (wandb 0.31 no longer ships a Python reader for this file, the former
wandb.sdk.internal.datastore; `wandb sync` uploads it with the Go wandb-core.)

Compared against the recorded run (run.json, config file, history.jsonl, config_updates.jsonl):
  run       project and display name of the run record; an exit record (run finished)
  config    run-record config + config records (minus wandb's "_wandb") == parsed config file
            with every config update applied in order
  history   one history record per step, in order: W&B merges the wandb.log calls of one step
            into one row and ignores a call with a smaller step than the one before; the user keys
            and values of every row (wandb's _step/_runtime/_timestamp left out) must equal the
            merged recorded data (ints and floats compare by value; NaN equals NaN)
  artifact  an artifact record named config_<run id>, type "config", whose manifest lists the
            config file name with the MD5 digest and size of the recorded config file

Prints OK and a summary, or every difference; exit status 0 = match, 1 = mismatch, 2 = error.
"""
import argparse
import base64
import datetime
import hashlib
import json
import math
import struct
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wandb_replay import ReplayError, load_recorded_run  # noqa: E402

HEADER = struct.Struct("<4sHB")  # ident, magic, version
HEADER_IDENT, HEADER_MAGIC, HEADER_VERSION = b":W&B", 0xBEE1, 0
BLOCK_LEN = 32768
CHUNK = struct.Struct("<IHB")  # crc32(type + data), length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
WANDB_HISTORY_KEYS = {"_step", "_runtime", "_timestamp"}
MAX_DIFFS = 40


class CheckError(Exception):
    pass


def read_wandb_records(path: Path):
    """All Record messages of a .wandb file, in order."""
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError:
        raise CheckError("the wandb package is not installed: pip install wandb") from None
    data = path.read_bytes()
    if len(data) < HEADER.size:
        raise CheckError(f"{path}: too short for a .wandb file")
    ident, magic, version = HEADER.unpack_from(data, 0)
    if ident != HEADER_IDENT or magic != HEADER_MAGIC:
        raise CheckError(f"{path}: not a .wandb file (header {data[:7]!r})")
    if version != HEADER_VERSION:
        raise CheckError(f"{path}: unsupported .wandb format version {version}")

    records, pending, pos = [], None, HEADER.size
    while pos < len(data):
        left = BLOCK_LEN - pos % BLOCK_LEN
        if left < CHUNK.size:  # block trailer
            pos += left
            continue
        if pos + CHUNK.size > len(data):
            raise CheckError(f"{path}: truncated chunk header at byte {pos}")
        crc, length, ctype = CHUNK.unpack_from(data, pos)
        if crc == 0 and length == 0 and ctype == 0:  # zero padding (preallocated tail)
            break
        payload = data[pos + CHUNK.size: pos + CHUNK.size + length]
        if len(payload) != length:
            raise CheckError(f"{path}: truncated chunk at byte {pos}")
        if zlib.crc32(bytes([ctype]) + payload) & 0xFFFFFFFF != crc:
            raise CheckError(f"{path}: checksum mismatch in chunk at byte {pos}")
        pos += CHUNK.size + length
        if ctype == FULL:
            if pending is not None:
                raise CheckError(f"{path}: unterminated record before byte {pos}")
            records.append(payload)
        elif ctype == FIRST:
            pending = payload
        elif ctype in (MIDDLE, LAST):
            if pending is None:
                raise CheckError(f"{path}: continuation chunk without a first chunk at byte {pos}")
            pending += payload
            if ctype == LAST:
                records.append(pending)
                pending = None
        else:
            raise CheckError(f"{path}: unknown chunk type {ctype} at byte {pos}")
    if pending is not None:
        raise CheckError(f"{path}: file ends inside a record")

    out = []
    for raw in records:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        out.append(rec)
    return out


def find_wandb_file(target: Path) -> Path:
    """TARGET: a .wandb file, an offline-run-* folder, or a --wandb-dir holding one offline run."""
    if target.is_file():
        return target
    candidates = sorted(target.glob("run-*.wandb"))
    if not candidates:
        candidates = sorted(target.glob("wandb/offline-run-*/run-*.wandb"))
    if not candidates:
        candidates = sorted(target.glob("offline-run-*/run-*.wandb"))
    if len(candidates) != 1:
        what = "no" if not candidates else f"{len(candidates)}"
        raise CheckError(f"{target}: found {what} offline .wandb files; name the run folder or .wandb file")
    return candidates[0]


def set_nested(dest: dict, keys, value):
    for k in keys[:-1]:
        dest = dest.setdefault(k, {})
    dest[keys[-1]] = value


def item_keys(item):
    return list(item.nested_key) if item.nested_key else [item.key]


def normalize(value):
    """What wandb stores for a config value parsed from TOML/YAML (dates become ISO strings)."""
    if isinstance(value, dict):
        return {str(k): normalize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [normalize(v) for v in value]
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    return value


def diff(expected, actual, path, out):
    """Appends 'path: expected X, run has Y' lines for every difference."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for k in expected:
            if k not in actual:
                out.append(f"{path}[{k!r}]: missing in the run (recorded {expected[k]!r})")
            else:
                diff(expected[k], actual[k], f"{path}[{k!r}]", out)
        for k in actual:
            if k not in expected:
                out.append(f"{path}[{k!r}]: not recorded, run has {actual[k]!r}")
        return
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        for i, (e, a) in enumerate(zip(expected, actual)):
            diff(e, a, f"{path}[{i}]", out)
        return
    if not same_scalar(expected, actual):
        out.append(f"{path}: recorded {expected!r}, run has {actual!r}")


def same_scalar(e, a):
    if isinstance(e, bool) or isinstance(a, bool):
        return type(e) is type(a) and e == a
    if isinstance(e, (int, float)) and isinstance(a, (int, float)):
        if isinstance(e, float) and isinstance(a, float) and math.isnan(e) and math.isnan(a):
            return True
        return e == a
    return type(e) is type(a) and e == a


def expected_history(rec, problems):
    """Rows as W&B builds them from the wandb.log calls: [(step, merged data, first line)]."""
    rows = []  # (step, data, {key: history.jsonl line that set it}, first line of the step)
    for n, step, data in rec["history"]:
        if rows and step < rows[-1][0]:
            problems.append(f"history.jsonl:{n}: step {step} < step {rows[-1][0]} before it; "
                            "W&B ignored this line, so the run lacks it")
            continue
        if not rows or step > rows[-1][0]:
            rows.append((step, {}, {}, n))
        rows[-1][1].update(data)
        rows[-1][2].update({k: n for k in data})
    return rows


def check(wandb_file: Path, run_dir: Path) -> tuple[list[str], str]:
    rec = load_recorded_run(run_dir)
    meta = rec["meta"]
    records = read_wandb_records(wandb_file)
    problems = []

    run_records = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    if not run_records:
        raise CheckError(f"{wandb_file}: no run record")
    run = run_records[0]
    if run.project != meta["project"]:
        problems.append(f"run: project is {run.project!r}, recorded {meta['project']!r}")
    if run.display_name != meta["name"]:
        problems.append(f"run: name is {run.display_name!r}, recorded {meta['name']!r}")
    if not any(r.WhichOneof("record_type") == "exit" for r in records):
        problems.append("run: no exit record (the replay did not finish the run)")

    # Config: the run record's initial config, then config records in order.
    config = {}
    for item in run.config.update:
        set_nested(config, item_keys(item), json.loads(item.value_json))
    history_rows, artifacts = [], []
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "config":
            for item in r.config.update:
                set_nested(config, item_keys(item), json.loads(item.value_json))
            for item in r.config.remove:
                keys = item_keys(item)
                parent = config
                for k in keys[:-1]:
                    parent = parent.get(k, {})
                parent.pop(keys[-1], None)
        elif kind == "history":
            row, step = {}, r.history.step.num
            for item in r.history.item:
                keys = item_keys(item)
                if keys[0] == "_step":
                    step = json.loads(item.value_json)
                if keys[0] in WANDB_HISTORY_KEYS or keys[0].startswith("_wandb"):
                    continue
                set_nested(row, keys, json.loads(item.value_json))
            history_rows.append((step, row))
        elif kind == "artifact":
            artifacts.append(r.artifact)
    config.pop("_wandb", None)

    expected_config = normalize(rec["config"])
    for _, update in rec["updates"]:
        expected_config.update(normalize(update))
    diff(expected_config, config, "config", problems)

    expected_rows = expected_history(rec, problems)
    for i in range(max(len(expected_rows), len(history_rows))):
        if i >= len(history_rows):
            step, _, _, n = expected_rows[i]
            problems.append(f"history.jsonl:{n}: step {step} is missing in the run")
            continue
        if i >= len(expected_rows):
            problems.append(f"history: run has an extra row at step {history_rows[i][0]}: {history_rows[i][1]!r}")
            continue
        (estep, edata, source, n), (astep, adata) = expected_rows[i], history_rows[i]
        if estep != astep:
            problems.append(f"history.jsonl:{n}: recorded step {estep}, the run's row {i} has step {astep}")
            continue
        for k, v in edata.items():
            where = f"history.jsonl:{source[k]} step {estep} [{k!r}]"
            if k not in adata:
                problems.append(f"{where}: missing in the run (recorded {v!r})")
            else:
                diff(v, adata[k], where, problems)
        for k in adata:
            if k not in edata:
                problems.append(f"history step {estep} [{k!r}]: not recorded, run has {adata[k]!r}")

    config_bytes = rec["config_path"].read_bytes()
    want_digest = base64.b64encode(hashlib.md5(config_bytes).digest()).decode()
    want_name = f"config_{run.run_id}"
    art = [a for a in artifacts if a.name == want_name]
    if not art:
        problems.append(f"artifact: no artifact named {want_name!r} (artifacts: {[a.name for a in artifacts]})")
    else:
        a = art[0]
        if a.type != "config":
            problems.append(f"artifact {want_name}: type {a.type!r}, expected 'config'")
        entries = {c.path: c for c in a.manifest.contents}
        entry = entries.get(rec["config_path"].name)
        if entry is None:
            problems.append(f"artifact {want_name}: no entry {rec['config_path'].name!r} (has {sorted(entries)})")
        elif entry.digest != want_digest or entry.size != len(config_bytes):
            problems.append(f"artifact {want_name}: {entry.path} has md5 {entry.digest} / {entry.size} bytes, "
                            f"recorded config file has {want_digest} / {len(config_bytes)} bytes")

    summary = (f"run {run.run_id} ({meta['project']}/{meta['name']}): {len(history_rows)} history rows "
               f"from {len(rec['history'])} lines, {len(config)} config keys "
               f"({len(rec['updates'])} update lines), artifact {want_name} ({rec['config_path'].name})")
    return problems, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="wandb_check_offline.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("offline_run", metavar="OFFLINE_RUN", type=Path,
                    help="a run-<id>.wandb file, its offline-run-* folder, or the --wandb-dir given to the replay "
                         "(must then hold exactly one offline run)")
    ap.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the recorded run folder that was replayed")
    args = ap.parse_args(argv)
    try:
        wandb_file = find_wandb_file(args.offline_run)
        problems, summary = check(wandb_file, args.run_dir)
    except (CheckError, ReplayError) as e:
        print(f"wandb_check_offline.py: error: {e}", file=sys.stderr)
        return 2
    print(f"checked {wandb_file}")
    if problems:
        for p in problems[:MAX_DIFFS]:
            print(f"  MISMATCH {p}")
        if len(problems) > MAX_DIFFS:
            print(f"  ... and {len(problems) - MAX_DIFFS} more")
        print(f"FAIL: {len(problems)} difference(s) between {args.run_dir} and the offline run")
        return 1
    print(f"OK: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
