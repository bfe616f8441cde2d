// The raw index (`.idx`) builder behind `modalities data create_raw_index`
// (docs/data.md, "Raw index (.idx)"). Line splitting, JSON validation and jq paths live in the
// SDK (modalities/sdk/formats/jsonl.h), shared with the dataset plugins.
#pragma once

#include <modalities/core/data/mapped_file.h>
#include <modalities/sdk/formats/jsonl.h>
#include <modalities/sdk/formats/packed_data.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace modalities::core::data {

using formats::default_index_path;
using formats::JqPath;
using formats::JsonLineParser;
using formats::split_lines;

struct RawIndexOptions {
  /// Skip invalid lines (with a warning each, and a count) instead of failing.
  /// Entry numbers then no longer equal line numbers.
  bool drop_faulty_entries = false;
  /// Validation threads; 0 = all cores.
  unsigned num_threads = 0;
  /// Called from the calling thread with (bytes validated, total bytes).
  std::function<void(std::uint64_t, std::uint64_t)> progress;
  /// Receives one message per dropped line.
  std::function<void(const std::string&)> warn;
};

struct RawIndexResult {
  std::vector<formats::IndexEntry> entries;
  std::uint64_t dropped = 0;
};

/// Splits and validates a JSONL file (docs/data.md). Throws
/// modalities::Error "FILE:LINE: ..." at the first invalid line unless
/// drop_faulty_entries is set.
RawIndexResult index_jsonl(const std::filesystem::path& src, const RawIndexOptions& options = {});

}  // namespace modalities::core::data
