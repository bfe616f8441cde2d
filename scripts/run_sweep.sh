#!/usr/bin/env bash
# Runs the configs listed in a file (one path per line, as `modalities benchmark
# list_remaining_runs` writes it), each at the world size of its folder
# (<sweep>/<world size>/<hash>_<timestamp>/<config>.toml): one process, or `modalities launch`
# with that many ranks. The experiment folder is the config's folder, so evaluation_results.jsonl
# and error_logs_*.log land where list_remaining_runs and summarize look. A failing run is
# reported and the next one starts.
#
#   scripts/run_sweep.sh out/sweeps/remaining_runs.txt
set -uo pipefail
BIN=${MODALITIES_BIN:-$(dirname "$0")/../build/bin/modalities}
list=${1:?usage: scripts/run_sweep.sh <file list>}
failed=0
while IFS= read -r cfg; do
  [ -z "$cfg" ] && continue
  run_dir=$(dirname "$cfg")
  ws=$(basename "$(dirname "$run_dir")")
  args=(run --config_file_path "$cfg" --experiments_root_path "$(dirname "$run_dir")"
        --experiment_id "$(basename "$run_dir")" --error_log_folder "$run_dir")
  echo "== $cfg (world size $ws)"
  if [ "$ws" = 1 ]; then "$BIN" "${args[@]}"; else "$BIN" launch --nproc-per-node "$ws" -- "${args[@]}"; fi \
    || { echo "== failed: $cfg"; failed=$((failed + 1)); }
done < "$list"
echo "== done; $failed run(s) failed"
[ "$failed" = 0 ]
