#!/usr/bin/env bash
# Self-test of scripts/plot_results.py on a synthetic results JSONL in a temporary folder.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/check_plot_results.sh [--keep]

Writes a synthetic evaluation_results.jsonl (train lines with losses, lr, samples/s, mfu, grad norm;
"val" evaluation lines; a warm start that logs steps 6..8 again; a NaN loss; a list value; an
incomplete last line) into a temporary folder and checks that
  - plot_results.py writes <stem>.png next to it (default output) and an -o output for two overlaid
    runs: non-empty files starting with the PNG signature, no temporary files left behind;
  - a line that is not JSON fails with exit status 1 and names FILE:LINE.
Prints OK and exits 0, or prints what failed and exits 1.

  --keep  keep the temporary folder (its path is printed)

Environment: PYTHON (default: .deps/bench/bin/python if present, else python3) must have matplotlib.
EOF
}

keep=0
for arg in "$@"; do
    case "$arg" in
        --keep) keep=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "check_plot_results.sh: unknown argument '$arg'" >&2; usage >&2; exit 2 ;;
    esac
done

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "$script_dir/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$repo_root/.deps/bench/bin/python" ]]; then PYTHON="$repo_root/.deps/bench/bin/python"; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c 'import matplotlib' 2>/dev/null; then
    echo "check_plot_results.sh: $PYTHON cannot import matplotlib: pip install matplotlib (or set PYTHON)" >&2
    exit 1
fi

tmp="$(mktemp -d "${TMPDIR:-/tmp}/check_plot_results.XXXXXX")"
if [[ $keep -eq 1 ]]; then echo "check_plot_results.sh: keeping $tmp"; else trap 'rm -rf "$tmp"' EXIT; fi

fail() { echo "check_plot_results.sh: FAIL: $*" >&2; exit 1; }

# A PNG: non-empty, starts with \x89 P N G \r \n \x1a \n.
check_png() {
    [[ -s "$1" ]] || fail "$1 missing or empty"
    [[ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" == "89504e470d0a1a0a" ]] || fail "$1 has no PNG signature"
}

mkdir -p "$tmp/run_a" "$tmp/run_b"
"$PYTHON" - "$tmp/run_a/evaluation_results.jsonl" "$tmp/run_b/evaluation_results.jsonl" <<'EOF'
import json, math, sys

def train(step, shift=0.0):
    loss = 8 * math.exp(-step / 4) + 2 + shift
    return {"dataloader_tag": "train", "num_train_steps_done": step,
            "losses": {"train loss avg": loss, "train loss last": loss - 0.1},
            "metrics": {"consumed tokens": 512 * step, "grad norm avg": 3 / step, "grad norm last": 3.2 / step},
            "throughput_metrics": {"train samples/s": 100.0 + step, "train mfu (16-bit)": 0.25,
                                   "lr mean": 1e-3 * min(1.0, step / 3), "peak memory rank 0 (MB)": 900.0}}

def val(step, shift=0.0):
    return {"dataloader_tag": "val", "num_train_steps_done": step,
            "losses": {"CLMCrossEntropyLoss": 8 * math.exp(-step / 4) + 2.3 + shift}, "metrics": {},
            "throughput_metrics": {"evaluation_num_samples_per_second": 300.0}}

lines = []
for step in range(1, 9):
    rec = train(step)
    if step == 4:
        rec["losses"]["train loss avg"] = float("nan")  # json.dumps writes NaN
    if step == 5:
        rec["metrics"]["grad norm avg"] = [1.0, 2.0]    # a non-scalar tensor
    lines.append(json.dumps(rec))
    if step % 4 == 0:
        lines.append(json.dumps(val(step)))
for step in range(6, 13):                               # warm start: steps 6..8 again
    lines.append(json.dumps(train(step, -0.2)))
    if step % 4 == 0:
        lines.append(json.dumps(val(step, -0.2)))
with open(sys.argv[1], "w") as f:
    f.write("\n".join(lines) + "\n" + '{"dataloader_tag": "train", "num_tr')  # still being written
with open(sys.argv[2], "w") as f:
    f.write("".join(json.dumps(train(s, 0.5)) + "\n" for s in range(1, 13)))
EOF

plot="$script_dir/plot_results.py"
a="$tmp/run_a/evaluation_results.jsonl"
b="$tmp/run_b/evaluation_results.jsonl"

# 1. one run, default output <stem>.png next to the input
"$PYTHON" "$plot" "$a" --title "self-test" >"$tmp/out1.txt" 2>"$tmp/err1.txt" || { cat "$tmp/err1.txt" >&2; fail "single run exited non-zero"; }
check_png "$tmp/run_a/evaluation_results.png"
grep -q "wrote $tmp/run_a/evaluation_results.png (6 panels, 1 run)" "$tmp/out1.txt" || fail "unexpected output: $(cat "$tmp/out1.txt")"
for note in "incomplete last line" "logged more than once" "NaN/Infinity" "list (non-scalar)"; do
    grep -q "$note" "$tmp/err1.txt" || fail "no note '$note' on stderr: $(cat "$tmp/err1.txt")"
done

# 2. two runs overlaid, -o, log y
"$PYTHON" "$plot" "$a" "$b" -o "$tmp/both.png" --log-y >"$tmp/out2.txt" 2>/dev/null || fail "overlay exited non-zero"
check_png "$tmp/both.png"
grep -q "(6 panels, 2 runs)" "$tmp/out2.txt" || fail "unexpected output: $(cat "$tmp/out2.txt")"

# 3. bad JSON: exit status 1, FILE:LINE in the message, no PNG written
printf '{"dataloader_tag": "train", "num_train_steps_done": 1, "losses": {"l": 1}}\n{oops}\n' >"$tmp/bad.jsonl"
set +e
"$PYTHON" "$plot" "$tmp/bad.jsonl" >/dev/null 2>"$tmp/err3.txt"
rc=$?
set -e
[[ $rc -eq 1 ]] || fail "bad JSON: exit status $rc, expected 1"
grep -q "$tmp/bad.jsonl:2: invalid JSON" "$tmp/err3.txt" || fail "bad JSON: message without FILE:LINE: $(cat "$tmp/err3.txt")"
[[ ! -e "$tmp/bad.png" ]] || fail "bad JSON: a PNG was written"

# 4. atomic write: no temporary files left in the output folders
leftovers="$(find "$tmp" -name '.*.tmp')"
[[ -z "$leftovers" ]] || fail "temporary files left behind: $leftovers"

echo "check_plot_results.sh: OK ($(stat -c %s "$tmp/run_a/evaluation_results.png") and $(stat -c %s "$tmp/both.png") byte PNGs)"
