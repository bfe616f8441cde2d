# Finds every third-party dependency of Modalities C++ and defines imported
# targets for them. Versions are pinned in third_party/versions.env; the
# Debian packages and the LibTorch unpack come from scripts/setup.sh.
#
#   modalities::torch     LibTorch (CPU libraries; + CUDA libraries when MODALITIES_WITH_CUDA)
#   Boost::headers, Boost::program_options, tomlplusplus::tomlplusplus,
#   absl::*, GTest::gtest_main, benchmark::benchmark
include_guard(GLOBAL)

find_package(Boost 1.74 REQUIRED COMPONENTS program_options)
find_package(tomlplusplus 3.3 REQUIRED)
find_package(absl REQUIRED)
find_package(Threads REQUIRED)

include(ModalitiesLibTorch)
# fmt: LibTorch's include directory ships fmt (12.x) and, being on every include
# path, would shadow a system fmt. We therefore use exactly that copy, header-only,
# everywhere (see ModalitiesLibTorch.cmake), and do not use Debian's libfmt.

# Data pipeline libraries (Debian packages, see versions.env):
#   simdjson::simdjson  JSON parsing (JSONL validation, jq paths, tokenizer.json)
#   modalities::pcre2   PCRE2 8-bit with JIT and Unicode properties (pre-tokenizer regexes)
#   modalities::utf8proc  Unicode normalisation (NFC/NFKC normalizers)
#   modalities::sentencepiece  SentencePiece models
find_package(simdjson 3 REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(MODALITIES_PCRE2 REQUIRED IMPORTED_TARGET GLOBAL libpcre2-8)
pkg_check_modules(MODALITIES_UTF8PROC REQUIRED IMPORTED_TARGET GLOBAL libutf8proc)
pkg_check_modules(MODALITIES_SENTENCEPIECE REQUIRED IMPORTED_TARGET GLOBAL sentencepiece)
add_library(modalities::pcre2 ALIAS PkgConfig::MODALITIES_PCRE2)
add_library(modalities::utf8proc ALIAS PkgConfig::MODALITIES_UTF8PROC)
add_library(modalities::sentencepiece ALIAS PkgConfig::MODALITIES_SENTENCEPIECE)
#   OpenSSL::Crypto  SHA-256 (seed derivation of the chunking tools, docs/data.md)
find_package(OpenSSL 3 REQUIRED COMPONENTS Crypto)
#   yaml-cpp  reading Modalities' YAML configs (`modalities config import`)
find_package(yaml-cpp 0.7 REQUIRED)
#   modalities::allocator  the process-wide malloc of the `modalities` binary. A training step
#   allocates and frees hundreds of small tensors; glibc's malloc spends ~0.3 ms per step of the
#   quickstart model in that (scripts/bench_host_overhead.sh --perf), gperftools' tcmalloc a
#   tenth of it. MODALITIES_ALLOCATOR=system keeps glibc's.
set(MODALITIES_ALLOCATOR "tcmalloc" CACHE STRING "malloc of the modalities binary: tcmalloc or system")
set_property(CACHE MODALITIES_ALLOCATOR PROPERTY STRINGS tcmalloc system)
add_library(modalities_allocator INTERFACE)
add_library(modalities::allocator ALIAS modalities_allocator)
if(MODALITIES_ALLOCATOR STREQUAL "tcmalloc")
  pkg_check_modules(MODALITIES_TCMALLOC REQUIRED IMPORTED_TARGET GLOBAL libtcmalloc_minimal)
  # --no-as-needed: the binary references malloc only through the C library's symbols, so an
  # as-needed link would drop the library that is meant to provide them.
  target_link_libraries(modalities_allocator INTERFACE "-Wl,--push-state,--no-as-needed"
                        PkgConfig::MODALITIES_TCMALLOC "-Wl,--pop-state")
elseif(NOT MODALITIES_ALLOCATOR STREQUAL "system")
  message(FATAL_ERROR "MODALITIES_ALLOCATOR must be tcmalloc or system, got '${MODALITIES_ALLOCATOR}'")
endif()
#   benchmark::benchmark  Google Benchmark (only with MODALITIES_BUILD_BENCHMARKS)
if(MODALITIES_BUILD_BENCHMARKS)
  find_package(benchmark REQUIRED)
endif()
