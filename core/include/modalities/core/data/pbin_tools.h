// The `modalities data` tools that rewrite packed (`.pbin`) and JSONL files
// (docs/data.md): merge, shuffle of a .pbin or JSONL file with
// CPython's random.Random, and the shuffled dataset chunks with numpy's
// default_rng. Outputs are byte-identical to what Modalities writes for the
// same inputs and seeds, except for the bugs fixed deliberately (Q4, Q11; see
// each function). Inputs are memory-mapped and documents are streamed into an
// AtomicFile, so the output never needs to fit in RAM and a failed run never
// leaves a partial file under the output name.
#pragma once

#include <modalities/core/data/mapped_file.h>
#include <modalities/core/data/reference_rng.h>

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace modalities::core::data {

/// What a tool did; the CLI turns it into its summary line and warnings.
struct ToolResult {
  std::filesystem::path output;
  bool skipped = false;             // output existed and the policy was skip: nothing was done
  bool replaced = false;            // output existed and was replaced (policy override)
  std::uint64_t documents = 0;      // documents / lines written
  std::uint64_t bytes = 0;          // size of the output file
  std::uint64_t legacy_inputs = 0;  // .pbin inputs with legacy absolute offsets (converted)
  std::uint64_t newline_added = 0;  // JSONL lines that lacked their final '\n' (Q11)
  std::uint64_t numpy_seed = 0;     // chunk tools: the seed given to default_rng
};

// --- merge_packed_data -----------------------------------------------------------

/// Expands `sources` (files, or directories searched recursively for `*.pbin`)
/// into the list of files to merge, in argument order. Files found in one
/// directory are sorted by path so the result is deterministic; Modalities
/// uses filesystem order (pathlib glob) there, which differs between machines.
/// Throws when a source does not exist or nothing is found.
std::vector<std::filesystem::path> find_pbin_inputs(std::span<const std::filesystem::path> sources);

/// Concatenates the `.pbin` files (as expanded by find_pbin_inputs) into
/// `target`, which must not exist. All inputs must have the same token size
/// (else an error naming both files). The merged index has correct
/// data-relative offsets: entry k of input i is shifted by the data_len of all
/// earlier inputs. Modalities shifts by (data_len - 12) instead (quirk Q4), so
/// its merged files are wrong for per-document access; we deliberately differ.
/// Legacy inputs (absolute offsets) are converted. Data sections are copied
/// whole, so bytes outside any document survive like in Modalities.
ToolResult merge_packed_data(std::span<const std::filesystem::path> sources, const std::filesystem::path& target);

// --- shuffles -----------------------------------------------------------------------

/// Writes the documents of `input` (.pbin) in the order of CPython's
/// random.Random(seed).shuffle applied to the index, followed by a new
/// contiguous index. The header (data_len, token_size) equals the input's for
/// every file whose index covers its data section, as all writers produce.
/// Legacy inputs are converted (Modalities would copy wrong bytes for them).
/// Input and output must differ; `policy` applies to an existing output.
ToolResult shuffle_tokenized_data(const std::filesystem::path& input, const std::filesystem::path& output,
                                  const PyInt& seed, FileExistencePolicy policy);

/// Writes the lines of `input` (each with its '\n') in the order of CPython's
/// random.Random(seed).shuffle. A last line without '\n' gets one, so it is
/// not glued to the line that follows it after shuffling (Modalities quirk
/// Q11; for files that end in '\n' the output is identical to Modalities').
ToolResult shuffle_jsonl_data(const std::filesystem::path& input, const std::filesystem::path& output,
                              const PyInt& seed, FileExistencePolicy policy);

// --- shuffled chunks ------------------------------------------------------------------

/// [begin, end) of chunk `chunk_id` of `num_chunks` over `num_items` items:
/// the first (num_items mod K, or K if 0) chunks have ceil(n/K) items, the
/// rest one fewer. Throws when num_chunks == 0 or chunk_id >= num_chunks.
struct ChunkRange {
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};
ChunkRange chunk_range(std::uint64_t num_items, std::uint64_t num_chunks, std::uint64_t chunk_id);

/// Modalities' calculate_hashed_seed: (sum over s of int(sha256_hex(s), 16))
/// mod (2^32 - 1), computed exactly.
std::uint32_t hashed_seed(std::span<const std::string> strings);
/// The default_rng seed of a chunk: hashed_seed({str(global_seed), str(chunk_id)}).
std::uint32_t chunk_seed(const PyInt& global_seed, std::uint64_t chunk_id);

/// Reads the file list of the chunk tools: each line, stripped of surrounding
/// whitespace, gets its last suffix replaced (or `suffix` appended, as
/// pathlib's with_suffix) and is joined to `root` (absolute lines stay
/// absolute). Blank lines are skipped (Modalities fails on them).
std::vector<std::filesystem::path> read_chunk_file_list(const std::filesystem::path& list_file,
                                                        const std::filesystem::path& root, std::string_view suffix);

struct ChunkJob {
  std::vector<std::filesystem::path> inputs;  // from read_chunk_file_list
  std::filesystem::path output;
  std::uint64_t chunk_id = 0;
  std::uint64_t num_chunks = 1;
  PyInt global_seed;  // the numpy seed is chunk_seed(global_seed, chunk_id)
  FileExistencePolicy policy = FileExistencePolicy::kError;
};

/// Takes chunk `chunk_id` of every input's documents (in list order),
/// shuffles the concatenation with numpy's default_rng(chunk seed) and writes
/// it as a new `.pbin` with the inputs' common token size. Legacy inputs are
/// converted. An empty chunk is an error (no file is written).
ToolResult create_shuffled_dataset_chunk(const ChunkJob& job);

/// The same for JSONL files: lines (with '\n') instead of documents. A last
/// line without '\n' gets one (Q11, see shuffle_jsonl_data).
ToolResult create_shuffled_jsonl_chunk(const ChunkJob& job);

/// Lower-case hex SHA-256 of `bytes` (OpenSSL), as hashlib's hexdigest().
std::string sha256_hex(std::string_view bytes);

/// A 63-bit seed from std::random_device, for runs without --seed /
/// --global_seed (the CLI prints it, so every run can be reproduced).
std::uint64_t random_seed();

}  // namespace modalities::core::data
