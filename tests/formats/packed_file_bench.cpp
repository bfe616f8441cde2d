// Random-access reads of training samples from a .pbin through PackedFile,
// as the continuous dataset does them: 1 025 tokens (sequence length 1 024 +
// the reused target) at a random sample position, widened to int64.
// scripts/bench_data.py runs it on the packed benchmark corpus and compares it
// with Modalities' PackedMemMapDatasetContinuous.
//
//   MODALITIES_BENCH_PBIN=file.pbin build/bin/modalities_packed_file_bench
// Without the variable it packs nothing and reads the bundled lorem_ipsum_long.pbin.
#include <modalities/sdk/formats/packed_file.h>

#include <benchmark/benchmark.h>

#include <cstdlib>
#include <random>
#include <vector>

namespace {

std::string bench_file() {
  const char* env = std::getenv("MODALITIES_BENCH_PBIN");
  return env != nullptr ? env : MODALITIES_BENCH_DEFAULT_PBIN;
}

void RandomSamples(benchmark::State& state) {
  const modalities::formats::PackedFile file(bench_file());
  constexpr std::uint64_t kBlock = 1025, kStride = 1024;
  const std::uint64_t samples = (file.num_tokens() - 1) / kStride;
  std::mt19937_64 rng(0);
  std::uniform_int_distribution<std::uint64_t> pick(0, samples - 1);
  std::vector<std::int64_t> out(kBlock);
  for (auto _ : state) {
    file.copy_tokens(pick(rng) * kStride, kBlock, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * kBlock));
  state.counters["file_tokens"] = static_cast<double>(file.num_tokens());
}
BENCHMARK(RandomSamples);

}  // namespace

BENCHMARK_MAIN();
