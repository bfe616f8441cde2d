// `modalities data pack_encoded_data` (docs/data.md): JSONL + raw index ->
// tokenized `.pbin`, byte-identical to Modalities for clean inputs.
//
// Work is split into items of `processing_batch_size` consecutive lines.
// `num_cpus` worker threads claim items in order from the memory-mapped
// input and tokenize them; the calling thread writes finished items strictly
// in line order, so the output never depends on the thread count. At most
// raw_samples_queue_size + processed_samples_queue_size items are in flight,
// which bounds memory whatever the file size.
//
// Deviations from Modalities (docs/differences.md): a bad document is an error that
// names the line and leaves no output (Modalities silently truncates the file,
// Q1-Q3) unless `skip_invalid_documents` is set, which skips only the bad
// documents and reports them; `dst_path` is optional (Q13); an EOD string that
// is not in the vocabulary is an error (Q9, decided by the tokenizer plugin).
#pragma once

#include <modalities/core/data/mapped_file.h>
#include <modalities/sdk/schema.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

namespace modalities {
class Tokenizer;
}

namespace modalities::core::data {

struct PackingSettings {
  std::filesystem::path src_path;
  std::optional<std::filesystem::path> dst_path;
  std::optional<std::filesystem::path> index_path;
  std::string jq_pattern;
  std::int64_t num_cpus = 0;  // 0 = all cores
  std::string eod_token;
  std::int64_t processing_batch_size = 10;
  std::int64_t raw_samples_queue_size = 20;
  std::int64_t processed_samples_queue_size = 20;
  bool skip_invalid_documents = false;
  std::string config_file;  // for messages only (not a config key): the file these settings came from

  static void describe(Schema<PackingSettings>& s);

  std::filesystem::path resolved_dst() const;
  std::filesystem::path resolved_index() const;
};

/// The packing pipeline's `settings` check (pipeline profile "packing").
void check_packing_settings(const Value& settings, ParseContext& ctx);
/// Parses `settings`; throws ConfigError listing every problem.
PackingSettings parse_packing_settings(const Value& settings);

/// Bytes per token for a vocabulary of `vocab_size` ids (docs/data.md, "Token size"): 1, 2 or 4.
std::uint32_t token_size_for_vocab(std::int64_t vocab_size);

struct PackingResult {
  std::filesystem::path dst;
  std::uint64_t documents = 0;
  std::uint64_t tokens = 0;
  std::uint64_t skipped = 0;
  std::uint32_t token_size = 0;
  double seconds = 0;
};

struct PackingHooks {
  std::function<void(const std::string&)> warn;  // skipped documents, empty output
  bool progress = true;                          // a ProgressBar on stderr
};

/// Packs `settings.src_path` into `settings.resolved_dst()` (written atomically:
/// nothing appears under that name unless packing succeeds). The file-existence
/// policy must have been applied by the caller. Throws modalities::Error naming
/// the source file and line on bad input.
PackingResult pack_encoded_data(const PackingSettings& settings, const Tokenizer& tokenizer,
                                const PackingHooks& hooks = {});

}  // namespace modalities::core::data
