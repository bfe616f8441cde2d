#!/usr/bin/env bash
# Formats the C++ sources tracked by git with clang-format 14 and the repository's .clang-format.
#
# Usage: scripts/format.sh [--check] [file ...]
#   --check  change nothing: list the files whose formatting differs and exit 1 if there are any
#            (scripts/test.sh runs this first, so CI refuses unformatted code)
#   file     only these files (default: every *.h, *.cpp, *.cu and *.cuh that git tracks)
#
# The version is pinned (clang-format-14, Debian 12's; scripts/setup.sh installs it) because
# clang-format's output changes between major versions.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${root}"

check=0
files=()
for arg in "$@"; do
  case "${arg}" in
    --check) check=1 ;;
    -h|--help) sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "format.sh: unknown option '${arg}' (try --help)" >&2; exit 2 ;;
    *) files+=("${arg}") ;;
  esac
done

tool="${MODALITIES_CLANG_FORMAT:-clang-format-14}"
if ! command -v "${tool}" > /dev/null; then
  echo "format.sh: ${tool} is not installed (scripts/setup.sh installs it: apt-get install clang-format-14)" >&2
  exit 2
fi
if ((${#files[@]} == 0)); then
  mapfile -t files < <(git ls-files '*.h' '*.cpp' '*.cu' '*.cuh')
fi
if ((check == 0)); then
  printf '%s\0' "${files[@]}" | xargs -0 -n 32 -P "$(nproc)" "${tool}" -i --style=file
  exit 0
fi

# --dry-run --Werror prints a diagnostic per misformatted line; one line per file is enough here.
bad=()
for f in "${files[@]}"; do
  if ! "${tool}" --dry-run --Werror --style=file "${f}" > /dev/null 2>&1; then bad+=("${f}"); fi
done
if ((${#bad[@]})); then
  echo "format.sh: ${#bad[@]} file(s) are not formatted as .clang-format says:" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "Run scripts/format.sh (or scripts/format.sh FILE ...) to format them." >&2
  exit 1
fi
echo "format.sh: ${#files[@]} files formatted as .clang-format says"
