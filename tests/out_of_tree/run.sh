#!/usr/bin/env bash
# Installs the SDK and host from a build tree into a temporary prefix, builds
# the example plugin out of tree against that installation (find_package),
# and checks that the installed host loads it through MODALITIES_PLUGIN_PATH
# and passes its smoke test. Usage: run.sh <build dir> <source root>
set -euo pipefail
build="$1"
src="$2"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
cmake --install "${build}" --prefix "${work}/prefix" > "${work}/install.log"
cmake -S "${src}/plugin-sdk/examples/tokens_per_step" -B "${work}/build" -G Ninja \
  -DCMAKE_PREFIX_PATH="${work}/prefix" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" > "${work}/configure.log"
cmake --build "${work}/build" > "${work}/build.log"
plugin="${work}/build/libmodalities_example_tokens_per_step.so"
test -f "${plugin}"
out="$(MODALITIES_PLUGIN_PATH="${work}/build" "${work}/prefix/bin/modalities" plugins list --strict-plugins)"
echo "${out}" | grep -E "number_conversion/tokens_per_step +-> int +libmodalities_example_tokens_per_step.so 1.0.0"
echo "${out}" | grep -q "layer_norm/rms_norm"  # bundled plugins of the installed host still load
"${work}/prefix/bin/modalities" plugins smoke "${plugin}"
echo "out-of-tree plugin: OK"
