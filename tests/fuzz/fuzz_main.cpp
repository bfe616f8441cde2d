// libFuzzer entry point of one fuzz_<target> executable (built only with MODALITIES_FUZZ=ON and
// clang; tests/fuzz/CMakeLists.txt defines MODALITIES_FUZZ_TARGET as the target function).
#include "fuzz_targets.h"

#include <cstddef>
#include <cstdint>

#ifndef MODALITIES_FUZZ_TARGET
#error "MODALITIES_FUZZ_TARGET must name a modalities_fuzz_<target> function"
#endif

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return MODALITIES_FUZZ_TARGET(data, size);
}
