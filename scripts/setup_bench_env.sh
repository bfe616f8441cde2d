#!/usr/bin/env bash
# Creates the Python environment of the benchmarks and reference generators (scripts/bench_*,
# scripts/convert_checkpoint.py, scripts/reference/*.py): the venv .deps/bench with exactly the
# versions of scripts/bench-requirements.txt (Modalities 0.5.0, torch 2.11.0 as our LibTorch,
# transformers 4.x, tokenizers, tiktoken, sentencepiece, safetensors, numpy):
#   1. installs Debian's python3-venv when `python3 -m venv` cannot work (apt-get; sudo when not root),
#   2. creates .deps/bench with `python3 -m venv`,
#   3. runs `pip install --no-deps -r scripts/bench-requirements.txt` (from PyPI; torch and its
#      CUDA wheels are several GB) and `pip check`.
# A stamp file (.deps/bench/.modalities-bench-stamp) holds the sha256 of the requirements file and
# the Python version; when it matches, a rerun is a no-op. Changed requirements are installed into
# the existing venv; a different Python (or --force) recreates it.
# Usage: scripts/setup_bench_env.sh [--force] [--no-apt]
#   --force   delete and recreate .deps/bench
#   --no-apt  never call apt-get (fail if python3-venv is missing)
# Set PYTHON to the interpreter to use (default python3; Python 3.11 or 3.12).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${root}/.deps/bench"
requirements="${root}/scripts/bench-requirements.txt"
stamp="${venv}/.modalities-bench-stamp"
python="${PYTHON:-python3}"

force=0
use_apt=1
for arg in "$@"; do
  case "${arg}" in
    --force) force=1 ;;
    --no-apt) use_apt=0 ;;
    -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup_bench_env.sh: unknown argument '${arg}' (try --help)" >&2; exit 2 ;;
  esac
done

log() { printf '[setup_bench_env] %s\n' "$*"; }

command -v "${python}" >/dev/null || { echo "setup_bench_env.sh: ${python} not found (set PYTHON)" >&2; exit 1; }
py_version="$("${python}" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
case "${py_version}" in
  3.11.*|3.12.*) ;;
  *) echo "setup_bench_env.sh: ${python} is Python ${py_version}; the pinned packages need Python 3.11 or 3.12" \
          "(numpy 2.4 needs >= 3.11, Modalities 0.5.0 <= 3.13); set PYTHON" >&2
     exit 1 ;;
esac
want="requirements-sha256=$(sha256sum "${requirements}" | cut -d' ' -f1) python=${py_version}"

if ((force == 0)) && [[ -f "${stamp}" ]] && [[ "$(cat "${stamp}")" == "${want}" ]]; then
  log ".deps/bench is up to date (scripts/bench-requirements.txt unchanged, Python ${py_version})"
  exit 0
fi

# --- 1. python3-venv ------------------------------------------------------------------------
# Debian's python3 has the venv module but not ensurepip without python3-venv.
if ! "${python}" -c 'import ensurepip, venv' 2>/dev/null; then
  if ((use_apt == 0)); then
    echo "setup_bench_env.sh: ${python} cannot create a venv (install python3-venv)" >&2
    exit 1
  fi
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
  log "installing python3-venv (apt-get)"
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends python3-venv
fi

# --- 2. the venv ------------------------------------------------------------------------------
if [[ -d "${venv}" ]]; then
  venv_version="$("${venv}/bin/python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || true)"
  "${venv}/bin/python" -m pip --version >/dev/null 2>&1 || venv_version=""  # a venv without pip: start over
  if ((force)) || [[ "${venv_version}" != "${py_version}" ]]; then
    log "removing .deps/bench (${venv_version:-broken}$( ((force)) && echo ', --force'))"
    rm -rf "${venv}"
  fi
fi
if [[ ! -d "${venv}" ]]; then
  log "creating .deps/bench with ${python} (Python ${py_version})"
  mkdir -p "${root}/.deps"
  "${python}" -m venv "${venv}"
fi
rm -f "${stamp}"

# --- 3. the pinned packages ---------------------------------------------------------------------
log "installing scripts/bench-requirements.txt into .deps/bench (torch and CUDA wheels: several GB on first run)"
"${venv}/bin/python" -m pip install --disable-pip-version-check --no-input --no-deps -r "${requirements}"
log "checking the installed set (pip check)"
"${venv}/bin/python" -m pip check --disable-pip-version-check
"${venv}/bin/python" -c 'import modalities, torch, transformers, tokenizers, tiktoken, sentencepiece, safetensors, numpy
from modalities.models.gpt2.gpt2_model import GPT2LLM
print("[setup_bench_env] torch %s, transformers %s, tokenizers %s, tiktoken %s" % (
    torch.__version__, transformers.__version__, tokenizers.__version__, tiktoken.__version__))'
echo "${want}" > "${stamp}"
log ".deps/bench ready: run the benchmarks and reference generators with .deps/bench/bin/python"
