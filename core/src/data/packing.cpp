#include <modalities/core/data/jsonl.h>
#include <modalities/core/data/packing.h>
#include <modalities/core/progress.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/packed_data.h>
#include <modalities/sdk/formats/packed_writer.h>
#include <modalities/sdk/interfaces/tokenizer.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <thread>

namespace modalities::core::data {

void PackingSettings::describe(Schema<PackingSettings>& s) {
  using C = PackingSettings;
  s.ignore_unknown_keys();  // as in Modalities: settings may hold values used only for interpolation
  s.field("src_path", &C::src_path, "The JSONL file to tokenize.").required().existing_file();
  s.field("dst_path", &C::dst_path, "Output .pbin (default: <src folder>/<src stem>.pbin).");
  s.field("index_path", &C::index_path, "Raw index of src_path (default: <src folder>/<src stem>.idx).")
      .existing_file();
  s.field("jq_pattern", &C::jq_pattern, "jq path of the text in each line, e.g. .text").required().non_empty();
  s.field("num_cpus", &C::num_cpus, "Tokenizer threads (default: all cores).").non_negative();
  s.field("eod_token", &C::eod_token, "Token string appended to each document, e.g. <|endoftext|>.")
      .required()
      .non_empty();
  s.field("processing_batch_size", &C::processing_batch_size, "Lines per work item.").at_least(1);
  s.field("raw_samples_queue_size", &C::raw_samples_queue_size, "Work items waiting for a worker.").at_least(1);
  s.field("processed_samples_queue_size", &C::processed_samples_queue_size, "Finished items waiting for the writer.")
      .at_least(1);
  s.field("skip_invalid_documents", &C::skip_invalid_documents,
          "Skip documents that cannot be packed (bad JSON, missing field, empty) and report them, instead of failing. "
          "Not in Modalities.");
  s.rule([](const C& c, ParseContext& ctx) {
    if (c.resolved_dst() == c.src_path) ctx.fail("dst_path", "must differ from src_path");
    if (c.index_path && *c.index_path == c.src_path) ctx.fail("index_path", "must differ from src_path");
    try {
      (void)JqPath::parse(c.jq_pattern);
    } catch (const Error& e) {
      ctx.fail("jq_pattern", e.what());
    }
  });
}

std::filesystem::path PackingSettings::resolved_dst() const {
  if (dst_path) return *dst_path;
  return src_path.parent_path() / (src_path.stem().string() + ".pbin");
}

std::filesystem::path PackingSettings::resolved_index() const {
  return index_path ? *index_path : default_index_path(src_path);
}

void check_packing_settings(const Value& settings, ParseContext& ctx) {
  PackingSettings s;
  Schema<PackingSettings>::instance().parse(settings, s, "", ctx);
}

PackingSettings parse_packing_settings(const Value& settings) {
  std::vector<FieldError> errors;
  ParseContext ctx(false, &errors);
  PackingSettings s;
  Schema<PackingSettings>::instance().parse(settings, s, "settings", ctx);
  if (!errors.empty()) throw ConfigError(std::move(errors));
  return s;
}

std::uint32_t token_size_for_vocab(std::int64_t vocab_size) {
  // docs/data.md "Token size", in integers (Modalities computes ceil(log2(V) / 8) in floating point).
  if (vocab_size < 1) throw Error(fmt::format("the tokenizer reports a vocabulary size of {}", vocab_size));
  if (vocab_size == 1) return 4;  // Modalities' quirk (n = 0 -> 4 bytes), kept for identical files
  if (vocab_size <= 256) return 1;
  if (vocab_size <= 65536) return 2;
  if (vocab_size <= (std::int64_t{1} << 32)) return 4;
  throw Error(fmt::format("vocabulary size {} needs more than 4 bytes per token", vocab_size));
}

namespace {

struct Item {
  std::string bytes;                   // encoded tokens of the item's documents
  std::vector<std::uint64_t> lengths;  // byte length per written document
  std::uint64_t tokens = 0;
  std::vector<std::pair<std::uint64_t, std::string>> skipped;  // (line, why)
  std::optional<std::pair<std::uint64_t, std::string>> error;  // first failing line
  std::optional<std::string> wrong_index;                      // an entry that is not a line (fatal)
};

// Appends `ids` as `width`-byte little-endian integers (as Modalities writes them); false when an id
// does not fit (the bytes appended then are garbage, for the caller to drop). The range check rides
// along in the same pass (one OR per id): as a loop over each id's bytes after a separate check, this
// was about a tenth of the single-thread packer's worker time with a fast tokenizer.
template <class T>
bool encode_as(std::span<const std::int64_t> ids, char* p) {
  std::uint64_t high = 0;  // bits of any id above T's width (a negative id, as unsigned, has them)
  for (const std::int64_t id : ids) {
    high |= static_cast<std::uint64_t>(id) >> (8 * sizeof(T));
    const T v = static_cast<T>(id);
    std::memcpy(p, &v, sizeof(T));
    p += sizeof(T);
  }
  return high == 0;
}

bool encode(std::span<const std::int64_t> ids, std::uint32_t width, std::string& out) {
  static_assert(std::endian::native == std::endian::little, "the .pbin format is little-endian");
  const std::size_t at = out.size();
  out.resize(at + ids.size() * width);
  char* p = out.data() + at;
  if (width == 1) return encode_as<std::uint8_t>(ids, p);
  if (width == 2) return encode_as<std::uint16_t>(ids, p);
  return encode_as<std::uint32_t>(ids, p);
}

// The first id outside [0, limit) (encode found one).
std::int64_t first_out_of_range(std::span<const std::int64_t> ids, std::uint64_t limit) {
  for (const std::int64_t id : ids)
    if (static_cast<std::uint64_t>(id) >= limit) return id;
  return -1;
}

}  // namespace

PackingResult pack_encoded_data(const PackingSettings& settings, const Tokenizer& tokenizer,
                                const PackingHooks& hooks) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::filesystem::path src = settings.src_path;
  const std::filesystem::path dst = settings.resolved_dst();
  const std::filesystem::path idx_path = settings.resolved_index();
  if (!std::filesystem::exists(idx_path))
    throw Error(
        fmt::format("the raw index '{}' of '{}' does not exist; create it with `modalities data "
                    "create_raw_index {}`",
                    idx_path.string(), src.string(), src.string()));
  const JqPath jq = JqPath::parse(settings.jq_pattern);
  const std::uint32_t width = token_size_for_vocab(tokenizer.vocab_size());
  const std::int64_t eod = tokenizer.token_id(settings.eod_token);
  const std::uint64_t limit = width == 4 ? (std::uint64_t{1} << 32) : (std::uint64_t{1} << (8 * width));
  if (eod < 0 || static_cast<std::uint64_t>(eod) >= limit)
    throw Error(
        fmt::format("{}settings.eod_token = '{}': the tokenizer (config key 'tokenizer') gives it the id {}, "
                    "which does not fit in the {} byte(s) per token that its vocab_size {} calls for; the "
                    "tokenizer's vocab_size must count its special tokens",
                    settings.config_file.empty() ? "" : settings.config_file + ": ", settings.eod_token, eod, width,
                    tokenizer.vocab_size()));

  MappedFile file(src);
  file.advise_sequential();
  const std::string_view text = file.text();
  const std::vector<formats::IndexEntry> index = formats::read_raw_index(idx_path);
  formats::check_raw_index_fits(index, text.size(), idx_path, src);
  // Lines without an entry (dropped as faulty when the index was made) are reported, never skipped
  // silently. That every entry is a whole line is checked by the workers (index_mismatch).
  std::size_t gaps = 0;
  for (std::size_t k = 0; k < index.size(); ++k) {
    const std::uint64_t expected = k == 0 ? 0 : index[k - 1].first + index[k - 1].second + 1;
    if (index[k].first != expected) ++gaps;
  }
  const std::uint64_t end = index.empty() ? 0 : index.back().first + index.back().second + 1;
  if (end < text.size()) ++gaps;
  if (gaps > 0 && hooks.warn)
    hooks.warn(
        fmt::format("the raw index '{}' leaves out {} stretch(es) of lines of '{}' (lines dropped as faulty "
                    "when it was created?); they are not packed",
                    idx_path.string(), gaps, src.string()));

  const std::size_t batch = static_cast<std::size_t>(settings.processing_batch_size);
  const std::size_t num_items = (index.size() + batch - 1) / batch;
  const std::size_t window =
      static_cast<std::size_t>(settings.raw_samples_queue_size + settings.processed_samples_queue_size);
  unsigned workers = settings.num_cpus > 0 ? static_cast<unsigned>(settings.num_cpus)
                                           : std::max(1u, std::thread::hardware_concurrency());
  workers = static_cast<unsigned>(std::max<std::size_t>(1, std::min<std::size_t>(workers, num_items)));

  // Shared state: workers claim item numbers in order, but never more than
  // `window` ahead of the writer; results wait in `done` until written.
  std::mutex mu;
  std::condition_variable cv_claim, cv_done;
  std::size_t next_claim = 0, next_write = 0;
  std::map<std::size_t, Item> done;
  bool stop = false;
  std::exception_ptr fatal;  // an exception that is not about one document (e.g. a tokenizer bug)

  // Every entry must be a whole line of the file, or the index belongs to another file: fatal, even
  // with skip_invalid_documents. Checked by the workers for their items, as they read the lines: a
  // pass over the whole index up front, by one thread before any other work, mapped every page of
  // the file (24 ms of a 0.8 s two-thread pack of 210 MB).
  auto index_mismatch = [&](std::size_t begin, std::size_t end) -> std::optional<std::string> {
    for (std::size_t k = begin; k < end; ++k)
      if (auto why = formats::raw_index_entry_mismatch(text, index[k]))
        return fmt::format(
            "the raw index '{}' does not belong to '{}': entry {} ({}, {}) is not a line of the file: "
            "{}; re-create it with `modalities data create_raw_index`",
            idx_path.string(), src.string(), k, index[k].first, index[k].second, *why);
    return std::nullopt;
  };

  auto process = [&](std::size_t item_no, JsonLineParser& parser) {
    Item item;
    const std::size_t begin = item_no * batch, end = std::min(index.size(), begin + batch);
    if ((item.wrong_index = index_mismatch(begin, end))) return item;
    std::vector<std::int64_t> ids;
    for (std::size_t line = begin; line < end; ++line) {
      const auto [off, len] = index[line];
      try {
        const std::string_view doc = parser.extract_string(text.substr(off, len), jq);
        ids = tokenizer.tokenize(doc);
        if (ids.empty()) throw Error("empty document: the tokenizer produced no tokens");
        if (ids.back() != eod) ids.push_back(eod);
        const std::size_t at = item.bytes.size();
        if (!encode(ids, width, item.bytes)) {
          item.bytes.resize(at);
          throw Error(fmt::format("token id {} does not fit in {} byte(s) per token (vocab_size {})",
                                  first_out_of_range(ids, limit), width, tokenizer.vocab_size()));
        }
      } catch (const Error& e) {
        if (settings.skip_invalid_documents) {
          item.skipped.emplace_back(line, e.what());
          continue;
        }
        item.error.emplace(line, e.what());
        break;
      }
      item.lengths.push_back(ids.size() * width);
      item.tokens += ids.size();
    }
    return item;
  };

  auto worker = [&] {
    JsonLineParser parser;
    while (true) {
      std::size_t item_no;
      {
        std::unique_lock lock(mu);
        cv_claim.wait(lock, [&] { return stop || next_claim >= num_items || next_claim < next_write + window; });
        if (stop || next_claim >= num_items) return;
        item_no = next_claim++;
      }
      Item item;
      try {
        item = process(item_no, parser);
      } catch (...) {
        std::lock_guard lock(mu);
        if (!fatal) fatal = std::current_exception();
        stop = true;
        cv_done.notify_all();
        cv_claim.notify_all();
        return;
      }
      std::lock_guard lock(mu);
      if (item.error || item.wrong_index) stop = true;  // later items are useless; earlier ones still finish
      done.emplace(item_no, std::move(item));
      cv_done.notify_all();
      if (stop) cv_claim.notify_all();
    }
  };

  formats::PackedWriter out(dst, width);

  ProgressBar bar(fmt::format("packing {}", src.filename().string()), index.size(), "docs");
  const bool show = hooks.progress && bar.enabled();
  std::vector<std::thread> pool;
  pool.reserve(workers);
  for (unsigned w = 0; w < workers; ++w) pool.emplace_back(worker);
  auto join_all = [&] {
    {
      std::lock_guard lock(mu);
      stop = true;
    }
    cv_claim.notify_all();
    for (auto& t : pool)
      if (t.joinable()) t.join();
  };

  PackingResult result;
  result.dst = dst;
  result.token_size = width;
  std::uint64_t lines_done = 0;
  std::vector<std::pair<std::uint64_t, std::string>> skipped;
  try {
    while (next_write < num_items) {
      Item item;
      {
        std::unique_lock lock(mu);
        cv_done.wait(lock, [&] { return done.contains(next_write) || fatal != nullptr; });
        if (fatal && !done.contains(next_write)) std::rethrow_exception(fatal);
        auto node = done.extract(next_write);
        item = std::move(node.mapped());
        ++next_write;
      }
      cv_claim.notify_all();
      if (item.wrong_index) throw Error(*item.wrong_index);
      if (item.error)
        throw Error(fmt::format("{}:{}: {} (document {} of the index '{}'); nothing was written to '{}'{}",
                                src.string(), item.error->first + 1, item.error->second, item.error->first,
                                idx_path.string(), dst.string(),
                                settings.skip_invalid_documents ? ""
                                                                : " (set settings.skip_invalid_documents = true "
                                                                  "to skip such documents)"));
      out.append(std::as_bytes(std::span(item.bytes)), item.lengths);
      result.tokens += item.tokens;
      lines_done = std::min<std::uint64_t>(index.size(), next_write * batch);
      for (auto& s : item.skipped) skipped.push_back(std::move(s));
      if (show) {
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        bar.update(lines_done,
                   fmt::format("{} tok/s", human_count(static_cast<double>(result.tokens) / std::max(secs, 1e-9))));
      }
    }
  } catch (...) {
    join_all();
    throw;
  }
  join_all();

  result.documents = out.num_documents();
  result.skipped = skipped.size();
  if (hooks.warn) {
    constexpr std::size_t kShown = 20;
    for (std::size_t i = 0; i < std::min(kShown, skipped.size()); ++i)
      hooks.warn(fmt::format("{}:{}: skipped: {}", src.string(), skipped[i].first + 1, skipped[i].second));
    if (skipped.size() > kShown) hooks.warn(fmt::format("... and {} more skipped documents", skipped.size() - kShown));
    if (result.documents == 0)
      hooks.warn(fmt::format("no document was packed; '{}' holds an empty dataset", dst.string()));
  }
  out.commit();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (show)
    bar.finish(fmt::format("{} tokens, {} tok/s", human_count(static_cast<double>(result.tokens)),
                           human_count(static_cast<double>(result.tokens) / std::max(result.seconds, 1e-9))));
  return result;
}

}  // namespace modalities::core::data
