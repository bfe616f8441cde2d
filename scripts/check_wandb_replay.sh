#!/usr/bin/env bash
# Replays a recorded W&B run offline and checks the result with wandb's own record format.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/check_wandb_replay.sh [--keep] [RUN_DIR]
       scripts/check_wandb_replay.sh [--keep] --self-test

Replays RUN_DIR (a folder <directory>/modalities-offline-run-<experiment_id>/ recorded by
results_subscriber/wandb) with scripts/wandb_replay.py under WANDB_MODE=offline into a temporary
wandb dir, then reads the run-<id>.wandb file of the offline run (scripts/wandb_check_offline.py:
LevelDB-style log parsed into wandb.proto Record messages) and compares history rows (step, keys,
values), run config (config file + config updates) and the config artifact with the recorded
files. Prints OK or every difference; exits non-zero on a mismatch.

Without RUN_DIR it builds a small synthetic run (steps 1..3, three wandb.log lines per step,
config updates, a TOML config) in the temporary folder and checks that.

  --self-test  the synthetic check, then alters one history value and one config update in the
               recorded files and expects the check to FAIL (proves the check detects changes)
  --keep       keep the temporary folder (printed) instead of deleting it
  -h, --help   this help

Environment: PYTHON (default: .deps/check/bin/python, else .deps/bench/bin/python, else python3) must have wandb.
The check needs no network; wandb's data/cache/config dirs point into the temporary folder.
EOF
}

keep=0
self_test=0
run_dir=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --keep) keep=1 ;;
        --self-test) self_test=1 ;;
        -*) echo "check_wandb_replay.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *)
            if [[ -n "$run_dir" ]]; then echo "check_wandb_replay.sh: only one RUN_DIR" >&2; exit 2; fi
            run_dir="$1" ;;
    esac
    shift
done
if [[ $self_test -eq 1 && -n "$run_dir" ]]; then
    echo "check_wandb_replay.sh: --self-test uses its own synthetic run; drop RUN_DIR" >&2; exit 2
fi

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(dirname "$script_dir")"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$repo_root/.deps/check/bin/python" ]]; then PYTHON="$repo_root/.deps/check/bin/python";
    elif [[ -x "$repo_root/.deps/bench/bin/python" ]]; then PYTHON="$repo_root/.deps/bench/bin/python"; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c 'import wandb' 2>/dev/null; then
    echo "check_wandb_replay.sh: $PYTHON cannot import wandb: run scripts/setup_check_env.sh (or pip install wandb, or set PYTHON)" >&2
    exit 2
fi
if [[ -n "$run_dir" && ! -d "$run_dir" ]]; then
    echo "check_wandb_replay.sh: run folder $run_dir does not exist" >&2; exit 2
fi

tmp="$(mktemp -d "${TMPDIR:-/tmp}/check_wandb_replay.XXXXXX")"
# shellcheck disable=SC2317  # called through the EXIT trap
cleanup() { if [[ $keep -eq 1 ]]; then echo "kept $tmp"; else rm -rf "$tmp"; fi; }
trap cleanup EXIT

make_synthetic_run() {  # $1: folder to create
    local d="$1"
    mkdir -p "$d"
    cat > "$d/run.json" <<'EOF'
{"format": 1, "project": "modalities-cpp-check", "name": "synthetic-2026", "mode": "OFFLINE", "config_file": "config.toml", "created": "2026-01-01T12:00:00Z"}
EOF
    cat > "$d/config.toml" <<'EOF'
[settings]
experiment_id = "synthetic-2026"
[settings.step_profile]
gradient_accumulation_steps = 2
local_train_micro_batch_size = 4
sequence_length = 256

[optimizer]
component_key = "optimizer"
variant_key = "adam_w"
[optimizer.config]
lr = 0.0003
betas = [0.9, 0.95]
weight_decay = 0.1
EOF
    cat > "$d/history.jsonl" <<'EOF'
{"step": 1, "data": {"train loss avg": 10.9375, "train loss last": 10.875}}
{"step": 1, "data": {"train consumed tokens": 2048, "train grad norm avg": 3.25, "train lr mean": 3e-05}}
{"step": 1, "data": {"train num samples/s": 41.5, "train mfu": 0.0123}}
{"step": 2, "data": {"train loss avg": 9.8125, "train loss last": 9.75}}
{"step": 2, "data": {"train consumed tokens": 4096, "train grad norm avg": 2.875, "train lr mean": 6e-05}}
{"step": 2, "data": {"train num samples/s": 43.25, "train mfu": 0.0131}}
{"step": 3, "data": {"train loss avg": 8.6640625, "train loss last": 8.5}}
{"step": 3, "data": {"train consumed tokens": 6144, "train grad norm avg": 2.5, "train lr mean": 9e-05}}
{"step": 3, "data": {"train num samples/s": 44.0, "train mfu": 0.0134}}
EOF
    cat > "$d/config_updates.jsonl" <<'EOF'
{"No. parameters": 124439808}
{"world_size": 1, "dtype": "bfloat16", "fsdp": false, "devices": ["cpu"]}
EOF
}

export WANDB_DATA_DIR="$tmp/wandb-data" WANDB_CACHE_DIR="$tmp/wandb-cache" WANDB_CONFIG_DIR="$tmp/wandb-config"

replay_and_check() {  # $1: recorded run, $2: wandb dir; returns the checker's status
    WANDB_MODE=offline "$PYTHON" "$script_dir/wandb_replay.py" "$1" --wandb-dir "$2"
    "$PYTHON" "$script_dir/wandb_check_offline.py" "$2" "$1"
}

if [[ -z "$run_dir" ]]; then
    run_dir="$tmp/recorded/modalities-offline-run-synthetic-2026"
    make_synthetic_run "$run_dir"
    echo "synthetic recorded run: $run_dir"
fi

if [[ $self_test -eq 0 ]]; then
    replay_and_check "$run_dir" "$tmp/wandb-out"
    exit $?
fi

echo "== positive check: replay and compare"
replay_and_check "$run_dir" "$tmp/wandb-out"

echo "== negative check: alter history.jsonl line 5 and config_updates.jsonl line 1 after the replay"
sed -i '5s/"train grad norm avg": 2.875/"train grad norm avg": 2.876/' "$run_dir/history.jsonl"
sed -i '1s/124439808/124439809/' "$run_dir/config_updates.jsonl"
set +e
"$PYTHON" "$script_dir/wandb_check_offline.py" "$tmp/wandb-out" "$run_dir"
status=$?
set -e
if [[ $status -eq 1 ]]; then
    echo "SELF-TEST OK: the check passes on the replay and detects the altered recorded files"
    exit 0
fi
echo "SELF-TEST FAILED: the check returned $status on altered files (expected 1)" >&2
exit 1
