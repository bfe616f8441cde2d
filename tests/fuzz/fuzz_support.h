// Helpers shared by the fuzz targets (internal to tests/fuzz). Standard library only: the
// SentencePiece target's translation unit must not see Abseil (sentencepiece_processor.h
// declares its own absl::string_view).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace modalities::fuzz {

/// A private folder of this process under $TMPDIR (default /tmp), created on first use and
/// removed at exit. Targets that need a path write their input to a fixed name inside it, so
/// every run of a target reuses one file.
const std::filesystem::path& scratch_dir();

/// Replaces the content of `file` with the bytes. Aborts (a harness problem, not a finding of
/// the code under test) when the file cannot be written.
void write_file(const std::filesystem::path& file, const std::uint8_t* data, std::size_t size);

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

/// Reports a broken promise through the installed failure handler (see fuzz_targets.h).
void report_failure(const std::string& message);

/// The acceptance rule of issue 16: a rejection names the file. Reports a failure when
/// `message` does not contain `file_name`.
void expect_names_file(std::string_view target, std::string_view message, std::string_view file_name);

}  // namespace modalities::fuzz
