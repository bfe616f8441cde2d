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
