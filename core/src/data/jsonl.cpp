// `modalities data create_raw_index`: parallel validation of a JSONL file's
// lines (formats::JsonLineParser) and the raw index.
#include <modalities/core/data/jsonl.h>
#include <modalities/sdk/error.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

namespace modalities::core::data {

// --- raw index -----------------------------------------------------------------------

RawIndexResult index_jsonl(const std::filesystem::path& src, const RawIndexOptions& options) {
  MappedFile file(src);
  file.advise_sequential();
  const std::string_view text = file.text();
  std::vector<formats::IndexEntry> lines = split_lines(text);

  unsigned threads = options.num_threads != 0 ? options.num_threads : std::max(1u, std::thread::hardware_concurrency());
  threads = static_cast<unsigned>(std::min<std::size_t>(threads, std::max<std::size_t>(1, lines.size() / 64)));
  // Only bad lines are recorded (line number, reason), so memory stays at the
  // index itself however large the file is.
  std::mutex bad_mutex;
  std::vector<std::pair<std::size_t, std::string>> bad;
  std::atomic<std::size_t> first_bad{lines.size()};
  std::atomic<std::uint64_t> bytes_done{0};
  std::atomic<std::size_t> next_chunk{0};
  constexpr std::size_t kChunk = 4096;  // lines per work unit
  const std::size_t chunks = (lines.size() + kChunk - 1) / kChunk;

  auto work = [&] {
    JsonLineParser parser;
    std::string why;
    while (true) {
      const std::size_t c = next_chunk.fetch_add(1);
      if (c >= chunks) return;
      const std::size_t begin = c * kChunk, end = std::min(lines.size(), begin + kChunk);
      if (!options.drop_faulty_entries && begin > first_bad.load()) return;  // an earlier error wins
      std::uint64_t bytes = 0;
      for (std::size_t i = begin; i < end; ++i) {
        const auto [off, len] = lines[i];
        bytes += len + 1;
        if (parser.valid(text.substr(off, len), &why)) continue;
        {
          std::lock_guard lock(bad_mutex);
          bad.emplace_back(i, why);
        }
        std::size_t prev = first_bad.load();
        while (i < prev && !first_bad.compare_exchange_weak(prev, i)) {
        }
        if (!options.drop_faulty_entries) break;
      }
      bytes_done += bytes;
    }
  };
  std::vector<std::thread> pool;
  if (threads == 1) {
    work();
  } else {
    for (unsigned t = 0; t < threads; ++t) pool.emplace_back(work);
    while (options.progress && next_chunk.load() < chunks) {  // the calling thread only reports
      options.progress(bytes_done.load(), text.size());
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    for (auto& t : pool) t.join();
  }
  if (options.progress) options.progress(text.size(), text.size());

  RawIndexResult result;
  if (bad.empty()) {
    result.entries = std::move(lines);
    return result;
  }
  std::sort(bad.begin(), bad.end());
  if (!options.drop_faulty_entries)
    throw Error(fmt::format("{}:{}: {}; every line of a JSONL file must be one JSON value (no index was written)",
                            src.string(), bad.front().first + 1, bad.front().second));
  result.entries.reserve(lines.size() - bad.size());
  std::size_t next_bad = 0;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    if (next_bad < bad.size() && bad[next_bad].first == i) {
      if (options.warn)
        options.warn(fmt::format("{}:{}: {}; line dropped from the index", src.string(), i + 1, bad[next_bad].second));
      ++next_bad;
      continue;
    }
    result.entries.push_back(lines[i]);
  }
  result.dropped = bad.size();
  return result;
}

}  // namespace modalities::core::data
