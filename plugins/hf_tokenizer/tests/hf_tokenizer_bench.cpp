// Single-thread throughput of the tokenizer.json engine (tokens/s and MB/s) on
// data/multilingual/multilingual.jsonl repeated to about 20 MB, for the GPT-2
// fixture and the Llama-3-/Qwen2-style test tokenizers. scripts/bench_tokenizer.py
// measures Python `tokenizers` (and tiktoken) on the same text for comparison.
// Built only with -DMODALITIES_BUILD_BENCHMARKS=ON.
#include "tokenizer_json.h"

#include <benchmark/benchmark.h>
#include <simdjson.h>

#include <filesystem>
#include <fstream>
#include <memory>

namespace {

namespace fs = std::filesystem;
using modalities::plugins::hf_tokenizer::TokenizerJson;

constexpr std::size_t kTargetBytes = 20u << 20;

const std::vector<std::string>& corpus() {
  static const std::vector<std::string> texts = [] {
    std::vector<std::string> lines;
    std::ifstream in(fs::path(MODALITIES_TEST_SOURCE_ROOT) / "data" / "multilingual" / "multilingual.jsonl");
    simdjson::dom::parser parser;
    for (std::string line; std::getline(in, line);) {
      std::string_view s;
      if (parser.parse(line)["text"].get_string().get(s) == simdjson::SUCCESS) lines.emplace_back(s);
    }
    std::vector<std::string> out;
    std::size_t bytes = 0;
    while (bytes < kTargetBytes && !lines.empty())
      for (const auto& l : lines) {
        out.push_back(l);
        bytes += l.size();
      }
    return out;
  }();
  return texts;
}

fs::path tokenizer_file(const std::string& name) {
  if (name == "gpt2")
    return fs::path(MODALITIES_TEST_FIXTURES_DIR) / "data" / "tokenizer" / "hf_gpt2" /
           "tokenizer.json";
  return fs::path(MODALITIES_TEST_SOURCE_ROOT) / "plugins" / "hf_tokenizer" / "tests" / "data" / name /
         "tokenizer.json";
}

void BM_Encode(benchmark::State& state, const std::string& name) {
  const TokenizerJson tok(tokenizer_file(name));
  const auto& texts = corpus();
  std::size_t bytes = 0;
  for (const auto& t : texts) bytes += t.size();
  tok.encode(texts.front());  // warm-up: per-thread regex and cache state
  std::int64_t tokens = 0;
  for (auto _ : state) {
    tokens = 0;
    for (const auto& t : texts) tokens += static_cast<std::int64_t>(tok.encode(t).size());
    benchmark::DoNotOptimize(tokens);
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(tokens) * state.iterations(),
                                                  benchmark::Counter::kIsRate);
  state.counters["tokens"] = static_cast<double>(tokens);
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
}

BENCHMARK_CAPTURE(BM_Encode, gpt2, std::string("gpt2"))->Unit(benchmark::kMillisecond)->MinTime(3.0);
BENCHMARK_CAPTURE(BM_Encode, llama3_style, std::string("llama3_style"))->Unit(benchmark::kMillisecond)->MinTime(3.0);
BENCHMARK_CAPTURE(BM_Encode, qwen2_style, std::string("qwen2_style"))->Unit(benchmark::kMillisecond)->MinTime(3.0);

}  // namespace

BENCHMARK_MAIN();
