#!/usr/bin/env bash
# Fuzzes every parser a user's file reaches (tests/fuzz/fuzz_targets.h) with libFuzzer, ASan and
# UBSan, built with Debian's clang into build-fuzz/ (gcc has no libFuzzer).
#
# Usage: scripts/fuzz.sh [seconds-per-target] [target ...]
#   seconds-per-target  default 60; every target runs that long, one after the other
#   target              config pickle_index pbin jsonl tokenizer_json checkpoint sentencepiece yaml
#                       jinja hf_config manifest
#                       (default: all)
# Environment: MODALITIES_FUZZ_SEED (default 1; libFuzzer's -seed, so a run is repeatable),
#              MODALITIES_FUZZ_JOBS (build parallelism, default nproc),
#              MODALITIES_FUZZ_PARALLEL (targets fuzzed at once, one core each; default 1).
#
# Each target starts from its saved corpus tests/fuzz/corpus/<target>/ (read only) and writes
# the new inputs it finds to build-fuzz/corpus/<target>/. A finding (crash, sanitizer report,
# a rejection that does not name its file, a leak, a timeout) is written to
# build-fuzz/findings/<target>/ and makes the script exit 1 after all targets ran. Fix it, then
# copy the input into tests/fuzz/corpus/<target>/ under a descriptive name: the test suite
# replays that folder (modalities_fuzz_replay_test, label `fuzz`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
all_targets=(config pickle_index pbin jsonl tokenizer_json checkpoint sentencepiece yaml jinja hf_config manifest)

seconds=60
if [[ $# -gt 0 ]]; then
  case "$1" in
    -h|--help) sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    ''|*[!0-9]*) echo "fuzz.sh: seconds-per-target must be a whole number, got '$1' (try --help)" >&2; exit 2 ;;
    *) seconds="$1"; shift ;;
  esac
fi
targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
  if [[ ! " ${all_targets[*]} " == *" ${t} "* ]]; then
    echo "fuzz.sh: unknown target '${t}'; known: ${all_targets[*]}" >&2
    exit 2
  fi
done

# clang with libFuzzer and the sanitizer runtimes (Debian 12: clang-14, libclang-rt-14-dev).
if ! command -v clang++ >/dev/null || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  echo "[fuzz] installing clang and libFuzzer (Debian packages clang, libclang-rt-14-dev)"
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends clang libclang-rt-14-dev
fi
"${root}/scripts/setup.sh"

build="${root}/build-fuzz"
export CCACHE_DIR="${CCACHE_DIR:-${root}/.deps/ccache}"
CC=clang CXX=clang++ cmake -S "${root}" -B "${build}" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
  -DMODALITIES_WITH_CUDA=OFF -DMODALITIES_ALLOCATOR=system -DMODALITIES_FUZZ=ON \
  -DMODALITIES_UNITY_BUILD=OFF >/dev/null  # file by file: the fuzzers' build is rebuilt incrementally
cmake --build "${build}" --target modalities_fuzzers -j "${MODALITIES_FUZZ_JOBS:-$(nproc)}"

# LibTorch's one-time allocations at start-up are not leaks of ours (scripts/sanitizers/lsan.supp).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=${root}/scripts/sanitizers/lsan.supp:print_suppressions=0}"

# One target: its log, findings and new inputs in build-fuzz/; exit status 1 on a finding.
fuzz_one() {
  local t="$1"
  local work="${build}/corpus/${t}" findings="${build}/findings/${t}"
  mkdir -p "${work}" "${findings}"
  echo "[fuzz] ${t}: ${seconds} s, seed ${MODALITIES_FUZZ_SEED:-1}, corpus tests/fuzz/corpus/${t}"
  # -timeout: one input may take at most 30 s (a hang is a finding); -rss_limit_mb: 4 GiB.
  if ! "${build}/bin/fuzz_${t}" -seed="${MODALITIES_FUZZ_SEED:-1}" -max_total_time="${seconds}" \
        -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="${findings}/" \
        "${work}" "${root}/tests/fuzz/corpus/${t}" >"${build}/fuzz_${t}.log" 2>&1; then
    echo "[fuzz] ${t}: FINDING, see ${build}/fuzz_${t}.log and ${findings}/" >&2
    grep -m 5 -E "ERROR|SUMMARY|runtime error|fuzz target failure" "${build}/fuzz_${t}.log" >&2 || true
    return 1
  fi
  grep -E "stat::number_of_executed_units|stat::new_units_added" "${build}/fuzz_${t}.log" | sed "s/^/[fuzz] ${t}: /"
}

parallel="${MODALITIES_FUZZ_PARALLEL:-1}"
[[ "${parallel}" =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: MODALITIES_FUZZ_PARALLEL must be a whole number >= 1, got '${parallel}'" >&2; exit 2; }
failed=()
pids=() names=()
collect() {  # waits for the oldest running target
  if ! wait "${pids[0]}"; then failed+=("${names[0]}"); fi
  pids=("${pids[@]:1}")
  names=("${names[@]:1}")
}
for t in "${targets[@]}"; do
  (( ${#pids[@]} >= parallel )) && collect
  fuzz_one "${t}" &
  pids+=("$!")
  names+=("${t}")
done
while (( ${#pids[@]} > 0 )); do collect; done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "[fuzz] findings in: ${failed[*]}" >&2
  exit 1
fi
echo "[fuzz] no findings (${#targets[@]} targets, ${seconds} s each)"
