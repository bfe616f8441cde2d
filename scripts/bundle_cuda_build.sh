#!/usr/bin/env bash
# Packs a CUDA build for a GPU machine that has the torch 2.11 (cu130) wheel but not this project's
# Debian packages (a cluster node, a container with PyTorch): the host, its libraries and plugins,
# stripped, plus the shared libraries they need that are neither LibTorch's, CUDA's nor the C
# library's (Boost, Abseil, tcmalloc, simdjson, PCRE2, utf8proc, SentencePiece, yaml-cpp, ...).
#
#   scripts/bundle_cuda_build.sh [--build build-cuda] [--out out/modalities-cuda.tar.gz]
#
# On the GPU machine:
#   mkdir m && tar -xzf modalities-cuda.tar.gz -C m
#   torch=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')
#   export LD_LIBRARY_PATH=$PWD/m/deps:$torch/lib:$(ls -d "$torch"/../nvidia/*/lib | paste -sd:)
#   m/bin/modalities --version
# m/deps-cxx holds this machine's libstdc++ and libgcc_s: add it to LD_LIBRARY_PATH only where the
# GPU machine's are older (`m/bin/modalities` then fails with "GLIBCXX_... not found").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${root}/build-cuda"
out="${root}/out/modalities-cuda.tar.gz"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "bundle_cuda_build.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -x "${build}/bin/modalities" ]] || { echo "bundle_cuda_build.sh: ${build}/bin/modalities is missing (scripts/build.sh cuda)" >&2; exit 1; }
stage="$(mktemp -d)"
trap 'rm -rf "${stage}"' EXIT
mkdir -p "${stage}/bin" "${stage}/lib/modalities/plugins" "${stage}/deps" "${stage}/deps-cxx"
cp "${build}/bin/modalities" "${stage}/bin/"
cp -P "${build}"/lib/libmodalities_*.so* "${stage}/lib/"
cp "${build}"/lib/modalities/plugins/*.so "${stage}/lib/modalities/plugins/"
find "${stage}/bin" "${stage}/lib" -type f -exec strip --strip-debug {} +
# Every library the binaries resolve from the system, except the C library's, LibTorch's and CUDA's
# (the GPU machine's torch wheel brings those).
skip='^(linux-vdso|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libutil\.so|ld-linux|libmodalities_|libtorch|libc10|libcuda|libcudart|libcupti|libnvrtc|libnccl|libcudnn|libcublas|libcusparse|libcufft|libcurand|libcusolver|libnvJitLink|libnvshmem|libcufile|libgomp|libshm)'
find "${stage}/bin" "${stage}/lib" -type f \( -name modalities -o -name '*.so*' \) -print0 |
  xargs -0 ldd 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r name path; do
    [[ "${name}" =~ ${skip} ]] && continue
    [[ "${path}" == "${build}"/* || "${path}" == "${stage}"/* ]] && continue
    case "${name}" in
      libstdc++.so*|libgcc_s.so*) cp -L "${path}" "${stage}/deps-cxx/${name}" ;;
      *) cp -L "${path}" "${stage}/deps/${name}" ;;
    esac
  done
mkdir -p "$(dirname "${out}")"
tar -C "${stage}" -czf "${out}.tmp" .
mv "${out}.tmp" "${out}"
echo "bundle_cuda_build.sh: $(du -h "${out}" | cut -f1) in ${out} ($(ls "${stage}/deps" | wc -l) system libraries)"
