// Single-thread throughput of the tokenizer.json engine (tokens/s and MB/s, mean and best pass)
// on data/multilingual/multilingual.jsonl repeated to about 20 MB (MODALITIES_BENCH_MB changes
// the size, MODALITIES_BENCH_PASSES the number of passes; MODALITIES_BENCH_CORPUS names another
// JSONL with a "text" field, e.g. the less repetitive corpus of scripts/make_bench_corpus.py), for
// the GPT-2 fixture, the Llama-3-/Qwen2-style test tokenizers and every tokenizer family of
// tests/data/families. scripts/bench_tokenizer.py runs
// Python `tokenizers` (and tiktoken) on the same text and this benchmark side by side.
// Built only with -DMODALITIES_BUILD_BENCHMARKS=ON.
#include "tokenizer_json.h"

#include <benchmark/benchmark.h>
#include <simdjson.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>

namespace {

namespace fs = std::filesystem;
using modalities::plugins::hf_tokenizer::TokenizerJson;

std::size_t target_bytes() {
  const char* mb = std::getenv("MODALITIES_BENCH_MB");
  return static_cast<std::size_t>((mb != nullptr ? std::atof(mb) : 20.0) * (1u << 20));
}

const std::vector<std::string>& corpus() {
  static const std::vector<std::string> texts = [] {
    std::vector<std::string> lines;
    const char* other = std::getenv("MODALITIES_BENCH_CORPUS");
    std::ifstream in(other != nullptr
                         ? fs::path(other)
                         : fs::path(MODALITIES_TEST_SOURCE_ROOT) / "data" / "multilingual" / "multilingual.jsonl");
    simdjson::dom::parser parser;
    for (std::string line; std::getline(in, line);) {
      std::string_view s;
      if (parser.parse(line)["text"].get_string().get(s) == simdjson::SUCCESS) lines.emplace_back(s);
    }
    std::vector<std::string> out;
    std::size_t bytes = 0;
    const std::size_t target = target_bytes();
    while (bytes < target && !lines.empty())
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
    return fs::path(MODALITIES_TEST_FIXTURES_DIR) / "data" / "tokenizer" / "hf_gpt2" / "tokenizer.json";
  const fs::path data = fs::path(MODALITIES_TEST_SOURCE_ROOT) / "plugins" / "hf_tokenizer" / "tests" / "data";
  if (fs::exists(data / name)) return data / name / "tokenizer.json";
  return data / "families" / name / "tokenizer.json";
}

void BM_Encode(benchmark::State& state, const std::string& name) {
  const TokenizerJson tok(tokenizer_file(name));
  const auto& texts = corpus();
  std::size_t bytes = 0;
  for (const auto& t : texts) bytes += t.size();
  tok.encode(texts.front());  // warm-up: per-thread regex and cache state
  std::int64_t tokens = 0;
  // The fastest single pass as well as the mean: scripts/bench_tokenizer.py compares the best pass of
  // each engine, since the Python side times whole passes and keeps the best (noise only slows a pass).
  double best_seconds = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    tokens = 0;
    for (const auto& t : texts) tokens += static_cast<std::int64_t>(tok.encode(t).size());
    benchmark::DoNotOptimize(tokens);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (best_seconds == 0 || s < best_seconds) best_seconds = s;
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(tokens) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["best_pass_tokens/s"] = static_cast<double>(tokens) / best_seconds;
  state.counters["tokens"] = static_cast<double>(tokens);
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
}

}  // namespace

int main(int argc, char** argv) {
  for (const char* name :
       {"gpt2", "llama3_style", "qwen2_style", "starcoder_style", "tekken_style", "gpt4o_style", "deepseek_v3_style",
        "gptneox_style", "roberta_style", "bloom_style", "llama2_style", "mistral_style", "gemma_style", "bert_style",
        "t5_style", "t5_nmt_style", "unigram_style", "pretok_sequences_style", "whitespace_style"}) {
    auto* b = benchmark::RegisterBenchmark((std::string("BM_Encode/") + name).c_str(), BM_Encode, std::string(name))
                  ->Unit(benchmark::kMillisecond);
    // MODALITIES_BENCH_PASSES: exactly that many passes (scripts/bench_tokenizer.py gives both engines
    // the same number); otherwise as many as fit in a second.
    const char* passes = std::getenv("MODALITIES_BENCH_PASSES");
    if (const int n = passes != nullptr ? std::atoi(passes) : 0; n > 0) b->Iterations(n);
    else b->MinTime(1.0);
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
