// Tests that compare against files from Modalities' repository (its .idx/.pbin files, GPT-2 and
// SentencePiece tokenizers, example configs) read them from ../shared/fixtures beside the checkout
// (CMake's MODALITIES_SHARED_DIR). CI has that folder; a user's clone does not. Such a test starts
// with MODALITIES_REQUIRE_SHARED(path): where `path` is missing it is skipped with one line, and
// CTest counts it as skipped (SKIP_REGULAR_EXPRESSION on every discovered test), not as passed.
#pragma once

#include <filesystem>

#define MODALITIES_REQUIRE_SHARED(required_path)                                                  \
  do {                                                                                            \
    if (!std::filesystem::exists(required_path))                                                  \
      GTEST_SKIP() << "skipped: needs " << std::filesystem::path(required_path).string()          \
                   << " (Modalities' files from ../shared/fixtures, present in CI, absent here)"; \
  } while (0)

namespace modalities::testing {

/// A folder holding the worked example of the data formats (spec: data.md §3.5/§4.4), written by
/// this project, not copied: tiny.jsonl (two documents, "Hello" and "World!"), tiny.idx (its raw
/// index, [(0,17),(18,18)]) and tiny.pbin (GPT-2 ids [15496] and [10603, 0], each followed by EOD
/// 50256; 2-byte tokens; index [(0,4),(4,6)]). Written once per process into a temporary folder
/// from the bytes in shared_fixtures.cpp, so tests that only need a small valid file stand alone.
const std::filesystem::path& tiny_example_dir();

}  // namespace modalities::testing
