# Imports LibTorch as the target modalities::torch.
#
# LibTorch is the content of the PyPI `torch` wheel (pinned in versions.env),
# unpacked by scripts/setup.sh into .deps/libtorch. MODALITIES_TORCH_DIR may
# point at any directory with the same layout (include/, lib/), e.g. an
# installed Python torch package. We import the libraries directly rather than
# through the wheel's TorchConfig.cmake, because that config always pulls in
# the CUDA libraries and the CUDA toolkit; a CPU build needs libtorch_cpu and
# libc10 only (plus the libcudart/libcupti that setup.sh puts beside them).
include_guard(GLOBAL)

set(_modalities_default_torch_dir "${CMAKE_CURRENT_LIST_DIR}/../../.deps/libtorch")
if(DEFINED ENV{MODALITIES_TORCH_DIR} AND NOT MODALITIES_TORCH_DIR)
  set(_modalities_default_torch_dir "$ENV{MODALITIES_TORCH_DIR}")
endif()
set(MODALITIES_TORCH_DIR "${_modalities_default_torch_dir}" CACHE PATH "LibTorch root (include/, lib/)")
get_filename_component(MODALITIES_TORCH_DIR "${MODALITIES_TORCH_DIR}" ABSOLUTE)

if(NOT EXISTS "${MODALITIES_TORCH_DIR}/include/torch/csrc/api/include/torch/version.h"
   OR NOT EXISTS "${MODALITIES_TORCH_DIR}/lib/libtorch_cpu.so")
  message(FATAL_ERROR
    "LibTorch not found in MODALITIES_TORCH_DIR='${MODALITIES_TORCH_DIR}'.\n"
    "Run scripts/setup.sh (CPU) or scripts/setup.sh --cuda, or point MODALITIES_TORCH_DIR at a torch installation.")
endif()

set(_torch_version_header "${MODALITIES_TORCH_DIR}/include/torch/headeronly/version.h")
if(NOT EXISTS "${_torch_version_header}")
  set(_torch_version_header "${MODALITIES_TORCH_DIR}/include/torch/csrc/api/include/torch/version.h")
endif()
foreach(_part MAJOR MINOR PATCH)
  file(STRINGS "${_torch_version_header}" _line REGEX "#define TORCH_VERSION_${_part} ")
  string(REGEX REPLACE ".*TORCH_VERSION_${_part} ([0-9]+).*" "\\1" _torch_${_part} "${_line}")
endforeach()
set(MODALITIES_TORCH_VERSION "${_torch_MAJOR}.${_torch_MINOR}.${_torch_PATCH}")
if(NOT MODALITIES_TORCH_VERSION MATCHES "^[0-9]+\\.[0-9]+\\.[0-9]+$")
  message(FATAL_ERROR "Cannot read the LibTorch version from ${_torch_version_header}")
endif()
message(STATUS "LibTorch ${MODALITIES_TORCH_VERSION} from ${MODALITIES_TORCH_DIR}")

add_library(modalities_torch INTERFACE)
add_library(modalities::torch ALIAS modalities_torch)
target_include_directories(modalities_torch SYSTEM INTERFACE
  "${MODALITIES_TORCH_DIR}/include"
  "${MODALITIES_TORCH_DIR}/include/torch/csrc/api/include")
# The wheel is built with the C++11 std::string ABI; say so explicitly.
target_compile_definitions(modalities_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=1)
# LibTorch's include directory carries fmt; use it header-only so that every
# translation unit sees one fmt (see ModalitiesDependencies.cmake).
target_compile_definitions(modalities_torch INTERFACE FMT_HEADER_ONLY=1)
target_link_libraries(modalities_torch INTERFACE
  "${MODALITIES_TORCH_DIR}/lib/libtorch_cpu.so"
  "${MODALITIES_TORCH_DIR}/lib/libc10.so"
  Threads::Threads)

if(MODALITIES_WITH_CUDA)
  foreach(_lib libtorch_cuda.so libc10_cuda.so)
    if(NOT EXISTS "${MODALITIES_TORCH_DIR}/lib/${_lib}")
      message(FATAL_ERROR "MODALITIES_WITH_CUDA=ON but ${_lib} is missing: run scripts/setup.sh --cuda")
    endif()
  endforeach()
  find_package(CUDAToolkit REQUIRED)
  # The CUDA kernels register themselves from static initialisers of
  # libtorch_cuda.so, which nothing references by symbol: keep it linked.
  target_link_libraries(modalities_torch INTERFACE
    "-Wl,--no-as-needed,${MODALITIES_TORCH_DIR}/lib/libtorch_cuda.so,--as-needed"
    "${MODALITIES_TORCH_DIR}/lib/libc10_cuda.so"
    CUDA::cudart)
  target_compile_definitions(modalities_torch INTERFACE MODALITIES_WITH_CUDA=1 USE_C10D_NCCL)
  # libtorch_cuda.so needs the CUDA libraries of the torch wheel's dependencies
  # (cuDNN, NCCL, cuSPARSELt, NVSHMEM, ...), found at run time through its RPATH
  # ($ORIGIN/../../nvidia/*/lib in a pip installation). A system CUDA toolkit
  # lacks some of them, so do not require them at link time; run CUDA builds
  # with MODALITIES_TORCH_DIR pointing at an installed torch (site-packages/torch).
  target_link_options(modalities_torch INTERFACE -Wl,--allow-shlib-undefined)
endif()
