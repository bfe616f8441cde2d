#!/usr/bin/env bash
# Creates the Python environment of the test suite's independent checks (CTest label `check`):
# the venv .deps/check with exactly the versions of scripts/check-requirements.txt (the official
# `wandb` client, `tensorboard` and matplotlib), with `python3 -m venv` and `pip install --no-deps -r` from
# PyPI (about 330 MB), then `pip check`. A stamp file holds the sha256 of the requirements file and
# the Python version; when it matches, a rerun is a no-op. scripts/test.sh calls this.
# Usage: scripts/setup_check_env.sh [--force]   (--force recreates the venv)
# Set PYTHON to the interpreter to use (default python3; Python 3.11 or 3.12, as the pins need).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${root}/.deps/check"
requirements="${root}/scripts/check-requirements.txt"
stamp="${venv}/.modalities-check-stamp"
python="${PYTHON:-python3}"
force=0
for arg in "$@"; do
  case "${arg}" in
    --force) force=1 ;;
    -h|--help) sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup_check_env.sh: unknown argument '${arg}' (try --help)" >&2; exit 2 ;;
  esac
done
log() { printf '[setup_check_env] %s\n' "$*"; }
command -v "${python}" >/dev/null || { echo "setup_check_env.sh: ${python} not found (set PYTHON)" >&2; exit 1; }
py_version="$("${python}" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
case "${py_version}" in
  3.11|3.12) ;;
  *) echo "setup_check_env.sh: ${python} is Python ${py_version}; the pinned packages need 3.11 or 3.12 (set PYTHON)" >&2; exit 1 ;;
esac
want="$(sha256sum "${requirements}" | cut -d' ' -f1) $("${python}" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ ${force} == 0 && -f "${stamp}" && "$(cat "${stamp}")" == "${want}" ]]; then
  exit 0
fi
if [[ ${force} == 1 ]]; then rm -rf "${venv}"; fi
if [[ ! -x "${venv}/bin/python" ]]; then
  log "creating ${venv}"
  if ! err="$("${python}" -m venv "${venv}" 2>&1)"; then
    rm -rf "${venv}"
    echo "setup_check_env.sh: '${python} -m venv ${venv}' failed:" >&2
    echo "${err}" >&2
    echo "(on Debian: apt-get install python3-venv; scripts/setup.sh installs it)" >&2
    exit 1
  fi
fi
log "installing scripts/check-requirements.txt (wandb, tensorboard, matplotlib)"
"${venv}/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "${requirements}"
"${venv}/bin/python" -m pip check --disable-pip-version-check >/dev/null
echo "${want}" > "${stamp}"
log "ready: ${venv}"
