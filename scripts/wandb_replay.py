#!/usr/bin/env python3
"""Replays a run recorded by our results_subscriber/wandb through the official wandb client.

The C++ subscriber cannot talk to the W&B service. On rank 0 it records the run into
<directory>/modalities-offline-run-<experiment_id>/:

  run.json               {"format": 1, "project", "name", "mode", "config_file", "created"}
  <config_file>          copy of the run config (TOML; YAML if the original was .yaml/.yml)
  history.jsonl          one {"step": int, "data": {...}} per wandb.log call (optional)
  config_updates.jsonl   one {key: value, ...} per consume_dict call (optional)

This script makes the calls that Modalities' WandBEvaluationResultSubscriber makes, in the same order:

  run = wandb.init(project=..., entity=<entity or None>, name=<name>, mode=<mode>, dir=<wandb dir>, config=<parsed config file>,
                   settings=wandb.Settings(init_timeout=120, console="off"))
  run.log_artifact(<config file>, name=f"config_{run.id}", type="config")
  run.config[k] = v           for every key of every config_updates.jsonl line
  run.log(data, step=step)    for every history.jsonl line, in file order
  run.finish()

The config file is parsed with tomllib (.toml) or yaml.safe_load (.yaml/.yml).

Mode: --mode if given; otherwise WANDB_MODE if it is "offline", "online" or "dryrun" (= offline);
otherwise offline. (wandb.init's mode argument would override WANDB_MODE, so the script resolves it
itself.) Offline needs no network and no login: the script prints the offline run folder and the
`wandb sync` command that uploads it. Online needs a login (`wandb login` or WANDB_API_KEY); the
script prints the run URL.

Output: wandb's own console output is silenced (WANDB_SILENT=true) unless --verbose is given or
WANDB_SILENT is already set in the environment. Other WANDB_* variables (WANDB_ENTITY,
WANDB_BASE_URL, WANDB_DATA_DIR, ...) are honoured by wandb as usual.

W&B ignores a wandb.log call whose step is smaller than the previous one; the script warns about
such history lines before replaying. Exit status: 0 on success, 1 on any error.
"""
import argparse
import json
import os
import shlex
import sys
from pathlib import Path

RUN_JSON_FORMAT = 1
MODE_ALIASES = {"offline": "offline", "dryrun": "offline", "online": "online"}


class ReplayError(Exception):
    """A problem with the recorded run or the replay, reported without a traceback."""


def read_json_lines(path: Path) -> list[tuple[int, object]]:
    """(line number, parsed object) for each non-blank line; [] if the file is missing."""
    if not path.exists():
        return []
    out = []
    try:
        with path.open("r", encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    out.append((n, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ReplayError(f"{path}:{n}: invalid JSON: {e.msg} (column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ReplayError(f"cannot read {path}: {e}") from None
    return out


def load_config_file(path: Path) -> dict:
    """The run config as a dict: tomllib for .toml, yaml.safe_load for .yaml/.yml."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            import tomllib

            with path.open("rb") as f:
                config = tomllib.load(f)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ReplayError(f"{path} is YAML but PyYAML is not installed: pip install pyyaml") from None
            with path.open("r", encoding="utf-8") as f:
                config = yaml.safe_load(f)
            if config is None:
                config = {}
        else:
            raise ReplayError(f"{path}: unknown config file type {suffix!r} (expected .toml, .yaml or .yml)")
    except ReplayError:
        raise
    except OSError as e:
        raise ReplayError(f"cannot read config file: {e}") from None
    except Exception as e:  # tomllib.TOMLDecodeError, yaml.YAMLError
        raise ReplayError(f"{path}: cannot parse config file: {e}") from None
    if not isinstance(config, dict):
        raise ReplayError(f"{path}: the config file must hold a table/mapping at top level")
    return config


def load_recorded_run(run_dir: Path) -> dict:
    """Reads and validates a recorded run folder. Shared with wandb_check_offline.py."""
    if not run_dir.exists():
        raise ReplayError(f"run folder {run_dir} does not exist")
    if not run_dir.is_dir():
        raise ReplayError(f"{run_dir} is not a folder")
    meta_path = run_dir / "run.json"
    if not meta_path.is_file():
        raise ReplayError(f"{run_dir} is not a recorded run: {meta_path.name} is missing")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ReplayError(f"cannot read {meta_path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ReplayError(f"{meta_path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(meta, dict):
        raise ReplayError(f"{meta_path}: expected a JSON object")
    if meta.get("format") != RUN_JSON_FORMAT:
        raise ReplayError(f"{meta_path}: unsupported format {meta.get('format')!r} (this script reads format 1)")
    for key in ("project", "name", "config_file"):
        if not isinstance(meta.get(key), str) or not meta[key]:
            raise ReplayError(f"{meta_path}: {key!r} must be a non-empty string")
    if "entity" in meta and (not isinstance(meta["entity"], str) or not meta["entity"]):
        raise ReplayError(f"{meta_path}: 'entity' must be a non-empty string when given")
    config_name = meta["config_file"]
    if Path(config_name).name != config_name:
        raise ReplayError(f"{meta_path}: config_file must be a file name in the run folder, not {config_name!r}")
    config_path = run_dir / config_name
    if not config_path.is_file():
        raise ReplayError(f"config file {config_path} (named in run.json) is missing")
    config = load_config_file(config_path)

    history_path = run_dir / "history.jsonl"
    history = []
    for n, obj in read_json_lines(history_path):
        where = f"{history_path}:{n}"
        if not isinstance(obj, dict) or set(obj) != {"step", "data"}:
            raise ReplayError(f'{where}: expected {{"step": int, "data": {{...}}}}')
        step, data = obj["step"], obj["data"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ReplayError(f"{where}: step must be a non-negative integer, got {step!r}")
        if not isinstance(data, dict):
            raise ReplayError(f"{where}: data must be a JSON object")
        history.append((n, step, data))

    updates_path = run_dir / "config_updates.jsonl"
    updates = []
    for n, obj in read_json_lines(updates_path):
        if not isinstance(obj, dict):
            raise ReplayError(f"{updates_path}:{n}: expected a JSON object")
        updates.append((n, obj))

    return {
        "meta": meta,
        "config_path": config_path,
        "config": config,
        "history_path": history_path,
        "history": history,
        "updates_path": updates_path,
        "updates": updates,
    }


def out_of_order_lines(history) -> list[tuple[int, int, int]]:
    """(line, step, current step) for history lines that W&B ignores: step below the current step."""
    bad, current = [], None
    for n, step, _ in history:
        if current is not None and step < current:
            bad.append((n, step, current))
        else:
            current = step
    return bad


def resolve_mode(arg_mode: str | None) -> tuple[str, str]:
    if arg_mode:
        return arg_mode, "--mode"
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env:
        if env not in MODE_ALIASES:
            raise ReplayError(f"WANDB_MODE={env!r} is not supported here; use offline or online (or pass --mode)")
        return MODE_ALIASES[env], "WANDB_MODE"
    return "offline", "default"


def replay(rec: dict, mode: str, wandb_dir: Path) -> None:
    try:
        import wandb
    except ImportError:
        raise ReplayError("the wandb package is not installed: pip install wandb") from None

    meta = rec["meta"]
    wandb_dir.mkdir(parents=True, exist_ok=True)
    stage = "wandb.init"
    run = None
    try:
        run = wandb.init(
            project=meta["project"],
            entity=meta.get("entity"),
            name=meta["name"],
            mode=mode,
            dir=str(wandb_dir),
            config=rec["config"],
            settings=wandb.Settings(init_timeout=120, console="off"),
        )
        stage = "log_artifact"
        run.log_artifact(str(rec["config_path"]), name=f"config_{run.id}", type="config")
        for n, update in rec["updates"]:
            stage = f"config update from {rec['updates_path']}:{n}"
            for k, v in update.items():
                run.config[k] = v
        for n, step, data in rec["history"]:
            stage = f"log from {rec['history_path']}:{n}"
            run.log(data, step=step)
        stage = "finish"
        url = run.url if mode == "online" else None
        sync_dir = run.settings.sync_dir
        run.finish()
    except ReplayError:
        raise
    except Exception as e:  # wandb.errors.Error, ConfigError, network errors in online mode, ...
        if run is not None:
            try:
                run.finish(exit_code=1)
            except Exception:
                pass
        raise ReplayError(f"{stage} failed: {type(e).__name__}: {e}") from None

    if mode == "offline":
        print(f"offline run: {sync_dir}")
        print(f"upload it with: wandb sync {shlex.quote(str(sync_dir))}")
    else:
        print(f"run: {url}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="wandb_replay.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                    help="recorded run folder (<directory>/modalities-offline-run-<experiment_id>)")
    ap.add_argument("--mode", choices=("offline", "online"),
                    help="wandb mode (default: WANDB_MODE if offline/online/dryrun, else offline)")
    ap.add_argument("--wandb-dir", type=Path, metavar="DIR",
                    help="wandb.init(dir=...): wandb writes DIR/wandb/... (default: the parent of RUN_DIR)")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="show wandb's own console output (default: WANDB_SILENT=true unless set)")
    args = ap.parse_args(argv)

    if not args.verbose:
        os.environ.setdefault("WANDB_SILENT", "true")
    try:
        mode, source = resolve_mode(args.mode)
        run_dir = args.run_dir
        rec = load_recorded_run(run_dir)
        wandb_dir = args.wandb_dir if args.wandb_dir is not None else run_dir.resolve().parent
        for n, step, current in out_of_order_lines(rec["history"]):
            print(f"warning: {rec['history_path']}:{n}: step {step} < step {current} before it; "
                  "W&B ignores this line", file=sys.stderr)
        meta = rec["meta"]
        print(f"replaying {run_dir}: project {meta['project']!r}, name {meta['name']!r}, "
              f"{len(rec['history'])} history lines, {len(rec['updates'])} config updates, "
              f"mode {mode} ({source}), wandb dir {wandb_dir}")
        replay(rec, mode, wandb_dir)
    except ReplayError as e:
        print(f"wandb_replay.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("wandb_replay.py: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
