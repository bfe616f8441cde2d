#!/usr/bin/env bash
# Prepares a Debian 12 machine for building Modalities C++:
#   1. installs the Debian packages listed in third_party/versions.env (needs root;
#      skipped when all are already installed),
#   2. unpacks LibTorch from the pinned PyPI `torch` wheel into the project-local
#      environment .deps/libtorch (no Python environment is created or modified).
# Re-running it is a no-op. Usage: scripts/setup.sh [--cuda] [--no-apt]
#   --cuda    also unpack the CUDA libraries of LibTorch (for the `cuda` preset)
#   --no-apt  never call apt-get (fail if a package is missing)
# Set MODALITIES_TORCH_DIR to an existing LibTorch/torch package directory to
# use it instead of downloading (e.g. the GPU machine's site-packages/torch).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=../third_party/versions.env
source "${root}/third_party/versions.env"

with_cuda=0
use_apt=1
for arg in "$@"; do
  case "${arg}" in
    --cuda) with_cuda=1 ;;
    --no-apt) use_apt=0 ;;
    -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown argument '${arg}' (try --help)" >&2; exit 2 ;;
  esac
done

log() { printf '[setup] %s\n' "$*"; }

# --- 1. Debian packages -------------------------------------------------------
missing=()
for pkg in ${MODALITIES_APT_PACKAGES}; do
  if ! dpkg-query -W -f='${Status}' "${pkg}" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("${pkg}")
  fi
done
if ((${#missing[@]})); then
  if ((use_apt == 0)); then
    echo "setup.sh: missing Debian packages: ${missing[*]}" >&2
    exit 1
  fi
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
  log "installing Debian packages: ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  log "Debian packages: all present"
fi

# --- 2. LibTorch ----------------------------------------------------------------
deps="${root}/.deps"
dest="${deps}/libtorch"
stamp="${dest}/.modalities-stamp"
want="torch=${MODALITIES_TORCH_VERSION} cudart=${MODALITIES_CUDA_RUNTIME_WHEEL} cupti=${MODALITIES_CUPTI_WHEEL} cuda=${with_cuda}"

if [[ -n "${MODALITIES_TORCH_DIR:-}" ]]; then
  log "using LibTorch from MODALITIES_TORCH_DIR=${MODALITIES_TORCH_DIR} (nothing to unpack)"
  exit 0
fi

if [[ -f "${stamp}" ]] && [[ "$(cat "${stamp}")" == "${want}" ]]; then
  log "LibTorch ${MODALITIES_TORCH_VERSION}: already unpacked in .deps/libtorch"
  exit 0
fi
# A CUDA unpack also serves CPU builds: do not shrink an existing CUDA unpack.
if ((with_cuda == 0)) && [[ -f "${stamp}" ]] && [[ "$(cat "${stamp}")" == "${want%cuda=0}cuda=1" ]]; then
  log "LibTorch ${MODALITIES_TORCH_VERSION} (with CUDA): already unpacked in .deps/libtorch"
  exit 0
fi

python="$(command -v python3 || true)"
[[ -n "${python}" ]] || { echo "setup.sh: python3 is needed to download the torch wheel" >&2; exit 1; }

mkdir -p "${deps}/wheels"
log "downloading torch==${MODALITIES_TORCH_VERSION} (wheel, ~530 MB) and CUDA runtime stubs"
"${python}" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --dest "${deps}/wheels" "torch==${MODALITIES_TORCH_VERSION}" \
  "${MODALITIES_CUDA_RUNTIME_WHEEL}" "${MODALITIES_CUPTI_WHEEL}"

wheel="$(ls "${deps}"/wheels/torch-"${MODALITIES_TORCH_VERSION}"-*.whl | head -n1)"
tmp="$(mktemp -d "${deps}/unpack.XXXXXX")"
trap 'rm -rf "${tmp}"' EXIT

log "unpacking $(basename "${wheel}")"
members=('torch/include/*' 'torch/share/cmake/*' 'torch/version.py'
         'torch/lib/libc10.so' 'torch/lib/libtorch_cpu.so' 'torch/lib/libtorch.so'
         'torch/lib/libgomp*' 'torch/lib/libshm.so' 'torch/lib/libtorch_global_deps.so')
if ((with_cuda)); then
  members+=('torch/lib/libc10_cuda.so' 'torch/lib/libtorch_cuda.so' 'torch/lib/libtorch_cuda_linalg.so'
            'torch/lib/libcaffe2_nvrtc.so' 'torch/lib/libtorch_nvshmem.so')
fi
unzip -q -o "${wheel}" "${members[@]}" -d "${tmp}"
for w in "${deps}"/wheels/nvidia_cuda_runtime-*.whl "${deps}"/wheels/nvidia_cuda_cupti-*.whl; do
  unzip -q -o "${w}" 'nvidia/cu13/lib/libcudart.so.13' 'nvidia/cu13/lib/libcupti.so.13' -d "${tmp}" 2>/dev/null || true
done
mv "${tmp}"/nvidia/cu13/lib/* "${tmp}/torch/lib/"
# Swap in atomically: a half-unpacked tree never sits under the final name.
rm -rf "${dest}.old"
[[ -d "${dest}" ]] && mv "${dest}" "${dest}.old"
mv "${tmp}/torch" "${dest}"
rm -rf "${dest}.old"
echo "${want}" > "${stamp}"
log "LibTorch $(sed -n "s/^__version__ = '\(.*\)'/\1/p" "${dest}/version.py") ready in .deps/libtorch"
