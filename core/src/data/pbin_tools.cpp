// merge_packed_data, shuffle_tokenized_data, shuffle_jsonl_data and the
// shuffled chunk tools (docs/data.md; see pbin_tools.h).
// Note [Streaming outputs]: every tool first decides the output order as a
// list of (file, offset, length) references into memory-mapped inputs, then
// copies the referenced bytes into an AtomicFile. Only the references and the
// output index live in RAM (about 24 bytes per document), never the data.
#include <modalities/core/data/pbin_tools.h>
#include <modalities/core/progress.h>
#include <modalities/sdk/atomic_file.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/packed_data.h>
#include <modalities/sdk/formats/packed_file.h>
#include <modalities/sdk/formats/packed_writer.h>

#include <fmt/core.h>
#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>

namespace modalities::core::data {

namespace fs = std::filesystem;

namespace {

constexpr std::uint64_t kProgressEvery = 4096;  // documents between progress updates

void require_input_file(const fs::path& p, std::string_view what) {
  std::error_code ec;
  if (!fs::exists(p, ec)) throw Error(fmt::format("{} '{}' does not exist", what, p.string()));
  if (fs::is_directory(p, ec)) throw Error(fmt::format("{} '{}' is a directory, expected a file", what, p.string()));
}

bool same_file(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  if (fs::exists(a, ec) && fs::exists(b, ec)) return fs::equivalent(a, b, ec);
  const fs::path ca = fs::weakly_canonical(fs::absolute(a), ec);
  const fs::path cb = fs::weakly_canonical(fs::absolute(b), ec);
  return ca == cb;
}

// Applies the file existence policy. Returns false when the tool must do nothing.
bool prepare_output(const fs::path& output, FileExistencePolicy policy, ToolResult& result) {
  result.output = output;
  std::error_code ec;
  const bool existed = fs::exists(output, ec);
  if (!check_output_path(output, policy)) {
    result.skipped = true;
    return false;
  }
  result.replaced = existed;
  return true;
}

// The common start of the whole-file rewrites (shuffles): an existing input that is not
// the output, and the output policy. False: the output is skipped (policy `skip`).
bool prepare_rewrite(const fs::path& input, const fs::path& output, FileExistencePolicy policy, ToolResult& result) {
  require_input_file(input, "--input_data_path");
  if (same_file(input, output))
    throw Error(fmt::format("--input_data_path and --output_data_path are the same file '{}'", input.string()));
  return prepare_output(output, policy, result);
}

// Commits a packed output and records what it holds.
ToolResult& finish_packed(formats::PackedWriter& out, ProgressBar& bar, ToolResult& result) {
  out.commit();
  bar.finish();
  result.documents = out.num_documents();
  result.bytes = out.size();
  return result;
}

// Lines as Python's bytes readlines() yields them: each ends after its '\n';
// a final piece without '\n' is a line if it is not empty. (offset, length).
std::vector<formats::IndexEntry> readlines(std::string_view text) {
  std::vector<formats::IndexEntry> lines;
  std::size_t p = 0;
  while (p < text.size()) {
    const void* nl = std::memchr(text.data() + p, '\n', text.size() - p);
    const std::size_t end =
        nl == nullptr ? text.size() : static_cast<std::size_t>(static_cast<const char*>(nl) - text.data()) + 1;
    lines.emplace_back(p, end - p);
    p = end;
  }
  return lines;
}

// Writes one JSONL line, adding the '\n' a last line may lack (Q11).
void write_line(AtomicFile& out, std::string_view line, ToolResult& result) {
  out.write(line);
  if (line.empty() || line.back() != '\n') {
    out.write(std::string_view("\n"));
    ++result.newline_added;
  }
}

std::string short_name(const fs::path& p) { return p.filename().string(); }

}  // namespace

// --- merge_packed_data ----------------------------------------------------------

std::vector<fs::path> find_pbin_inputs(std::span<const fs::path> sources) {
  MODALITIES_CHECK(!sources.empty(), "merge_packed_data needs at least one source path");
  std::vector<fs::path> files;
  for (const auto& src : sources) {
    std::error_code ec;
    if (!fs::exists(src, ec)) throw Error(fmt::format("source path '{}' does not exist", src.string()));
    if (!fs::is_directory(src, ec)) {
      files.push_back(src);
      continue;
    }
    std::vector<fs::path> found;
    for (auto it = fs::recursive_directory_iterator(src, fs::directory_options::skip_permission_denied, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      const auto name = it->path().filename().string();
      if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".pbin") == 0 && it->is_regular_file(ec))
        found.push_back(it->path());
    }
    if (ec) throw Error(fmt::format("cannot search the directory '{}': {}", src.string(), ec.message()));
    std::sort(found.begin(), found.end());
    files.insert(files.end(), found.begin(), found.end());
  }
  if (files.empty()) {
    std::string list;
    for (const auto& s : sources) list += (list.empty() ? "" : ", ") + s.string();
    throw Error(fmt::format("no .pbin files found in {}", list));
  }
  return files;
}

ToolResult merge_packed_data(std::span<const fs::path> sources, const fs::path& target) {
  ToolResult result;
  result.output = target;
  std::error_code ec;
  if (fs::exists(target, ec))
    throw Error(
        fmt::format("the target '{}' already exists; merge_packed_data never overwrites a file", target.string()));
  const std::vector<fs::path> inputs = find_pbin_inputs(sources);

  // Headers first: token sizes must agree before anything is written.
  std::vector<formats::PackedFile> files;
  files.reserve(inputs.size());
  std::uint64_t data_len = 0;
  for (const auto& p : inputs) {
    files.emplace_back(p);
    const auto& f = files.back();
    if (f.token_size() != files.front().token_size())
      throw Error(fmt::format(
          "token size mismatch: '{}' has {}-byte tokens but '{}' has {}-byte tokens (files packed with different "
          "tokenizers cannot be merged)",
          inputs.front().string(), files.front().token_size(), p.string(), f.token_size()));
    data_len += f.header().data_len;
  }

  formats::PackedWriter out(target, files.front().token_size());
  ProgressBar bar(fmt::format("merging {} files", files.size()), data_len, "bytes");
  constexpr std::size_t kBlock = std::size_t{64} << 20;
  for (auto& f : files) {
    // The index is read (and checked) before the data is copied so that a
    // damaged input fails early; it is freed with the file right after.
    const auto& entries = f.index();
    if (f.legacy()) ++result.legacy_inputs;
    const auto data = f.data();
    const std::uint64_t start = out.data_len();
    // In 64 MiB pieces for the progress bar; the index is relative to the first piece.
    for (std::size_t pos = 0; pos == 0 || pos < data.size(); pos += kBlock) {
      const auto piece = data.subspan(pos, std::min(kBlock, data.size() - pos));
      out.append_block(
          piece, pos == 0 ? std::span<const formats::IndexEntry>(entries) : std::span<const formats::IndexEntry>());
      bar.update(start + pos);
    }
    f.close();
  }
  return finish_packed(out, bar, result);
}

// --- shuffle_tokenized_data / shuffle_jsonl_data ------------------------------------

ToolResult shuffle_tokenized_data(const fs::path& input, const fs::path& output, const PyInt& seed,
                                  FileExistencePolicy policy) {
  ToolResult result;
  if (!prepare_rewrite(input, output, policy, result)) return result;

  formats::PackedFile in(input);
  std::vector<formats::IndexEntry> order = in.index();  // copy: shuffled in place below
  if (in.legacy()) ++result.legacy_inputs;
  CPythonRandom(seed).shuffle(order);

  formats::PackedWriter out(output, in.token_size());
  const auto data = in.data();
  ProgressBar bar(fmt::format("shuffling {}", short_name(input)), order.size(), "docs");
  for (std::size_t k = 0; k < order.size(); ++k) {
    out.add_document(data.subspan(order[k].first, order[k].second));
    if (k % kProgressEvery == 0) bar.update(k);
  }
  order = {};
  return finish_packed(out, bar, result);
}

ToolResult shuffle_jsonl_data(const fs::path& input, const fs::path& output, const PyInt& seed,
                              FileExistencePolicy policy) {
  ToolResult result;
  if (!prepare_rewrite(input, output, policy, result)) return result;

  MappedFile in(input);
  const std::string_view text = in.text();
  std::vector<formats::IndexEntry> lines = readlines(text);
  CPythonRandom(seed).shuffle(lines);
  AtomicFile out(output);
  ProgressBar bar(fmt::format("shuffling {}", short_name(input)), lines.size(), "lines");
  for (std::size_t k = 0; k < lines.size(); ++k) {
    write_line(out, text.substr(lines[k].first, lines[k].second), result);
    if (k % kProgressEvery == 0) bar.update(k);
  }
  out.commit();
  bar.finish();
  result.documents = lines.size();
  result.bytes = out.size();
  return result;
}

// --- shuffled chunks ----------------------------------------------------------------------

ChunkRange chunk_range(std::uint64_t num_items, std::uint64_t num_chunks, std::uint64_t chunk_id) {
  MODALITIES_CHECK(num_chunks > 0, "--num_chunks must be greater than 0");
  MODALITIES_CHECK(chunk_id < num_chunks, "--chunk_id ({}) must be less than --num_chunks ({})", chunk_id, num_chunks);
  const std::uint64_t m = num_items / num_chunks + (num_items % num_chunks != 0 ? 1 : 0);  // ceil
  std::uint64_t f = num_items % num_chunks;
  if (f == 0) f = num_chunks;
  ChunkRange r;
  // m == 0 only if num_items == 0, and then f == num_chunks > chunk_id: no (m - 1) term.
  r.begin = m * std::min(f, chunk_id) + (chunk_id > f ? (chunk_id - f) * (m - 1) : 0);
  r.end = chunk_id < f ? r.begin + m : r.begin + m - 1;
  return r;
}

namespace {
std::array<unsigned char, 32> sha256(std::string_view bytes) {
  std::array<unsigned char, 32> md{};
  unsigned int md_len = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), md.data(), &md_len, EVP_sha256(), nullptr) != 1 || md_len != md.size())
    throw Error("SHA-256 failed (OpenSSL EVP_Digest)");
  return md;
}
}  // namespace

std::string sha256_hex(std::string_view bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned char c : sha256(bytes)) {
    hex.push_back(kHex[c >> 4]);
    hex.push_back(kHex[c & 15]);
  }
  return hex;
}

std::uint32_t hashed_seed(std::span<const std::string> strings) {
  // int(hex, 16) of a SHA-256 digest is the digest read big-endian. Since
  // 2^32 == 1 (mod 2^32 - 1), a number is congruent to the sum of its 32-bit
  // words, so the exact big-integer sum mod (2^32 - 1) needs no big integers.
  constexpr std::uint64_t kModulus = 0xffffffffULL;
  std::uint64_t sum = 0;
  for (const auto& s : strings) {
    const auto md = sha256(s);
    for (std::size_t w = 0; w < 8; ++w) {
      std::uint32_t word = 0;
      for (std::size_t b = 0; b < 4; ++b) word = (word << 8) | md[4 * w + b];
      sum = (sum + word) % kModulus;
    }
  }
  return static_cast<std::uint32_t>(sum % kModulus);
}

std::uint32_t chunk_seed(const PyInt& global_seed, std::uint64_t chunk_id) {
  const std::array<std::string, 2> strings{global_seed.decimal(), std::to_string(chunk_id)};
  return hashed_seed(strings);
}

std::vector<fs::path> read_chunk_file_list(const fs::path& list_file, const fs::path& root, std::string_view suffix) {
  require_input_file(list_file, "--input_file_list_path");
  std::ifstream in(list_file, std::ios::binary);
  if (!in) throw Error(fmt::format("cannot read --input_file_list_path '{}'", list_file.string()));
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  std::vector<fs::path> out;
  std::size_t line_no = 0;
  std::size_t p = 0;
  while (p < text.size()) {
    // Python opens the list in text mode: "\n", "\r\n" and "\r" all end a line.
    const std::size_t e = std::min(text.find_first_of("\r\n", p), text.size());
    const std::string_view line_raw(text.data() + p, e - p);
    p = e + 1;
    if (e < text.size() && text[e] == '\r' && p < text.size() && text[p] == '\n') ++p;
    std::string_view line = line_raw;
    ++line_no;
    const auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\f' || c == '\v' || (c >= 0x1c && c <= 0x1f); };
    while (!line.empty() && ws(line.front())) line.remove_prefix(1);
    while (!line.empty() && ws(line.back())) line.remove_suffix(1);
    if (line.empty()) continue;  // Modalities: Path("").with_suffix() raises
    std::string s(line);
    while (s.size() > 1 && s.back() == '/') s.pop_back();  // pathlib drops trailing slashes
    fs::path rel(s);
    std::string name = rel.filename().string();
    if (name.empty() || name == "." || name == "..")
      throw Error(
          fmt::format("{}:{}: '{}' has no file name to give the suffix {}", list_file.string(), line_no, s, suffix));
    // pathlib's suffix: from the last '.', unless the name starts with it or ends with it.
    const std::size_t dot = name.rfind('.');
    if (dot != std::string::npos && dot > 0 && dot < name.size() - 1) name.erase(dot);
    name += suffix;
    out.push_back(root / rel.parent_path() / name);
  }
  return out;
}

std::uint64_t random_seed() {
  std::random_device rd;
  const std::uint64_t hi = rd();
  const std::uint64_t lo = rd();
  return ((hi << 32) | lo) >> 1;
}

namespace {

struct SampleRef {
  std::uint32_t file;
  std::uint64_t offset;
  std::uint64_t length;
};

void check_chunk_job(const ChunkJob& job) {
  (void)chunk_range(0, job.num_chunks, job.chunk_id);  // validates num_chunks / chunk_id
  for (const auto& p : job.inputs)
    if (same_file(p, job.output))
      throw Error(fmt::format("the input file '{}' is also the --output_chunk_file_path", p.string()));
}

[[noreturn]] void empty_chunk(const ChunkJob& job) {
  throw Error(fmt::format(
      "chunk {} of {} has no samples ({} input file(s)); use fewer chunks (the inputs have fewer items than chunks)",
      job.chunk_id, job.num_chunks, job.inputs.size()));
}

}  // namespace

ToolResult create_shuffled_dataset_chunk(const ChunkJob& job) {
  ToolResult result;
  check_chunk_job(job);
  if (!prepare_output(job.output, job.policy, result)) return result;
  MODALITIES_CHECK(job.inputs.size() < (std::uint64_t{1} << 32), "too many input files ({})", job.inputs.size());

  // Pass 1: the chunk's documents of each file. Files are closed again so that
  // only the selected index entries stay in memory (Note [Streaming outputs]).
  std::vector<SampleRef> samples;
  std::vector<std::uint64_t> data_lens;
  std::uint32_t token_size = 0;
  {
    ProgressBar bar(fmt::format("reading the indexes for chunk {}", job.chunk_id), job.inputs.size(), "files");
    for (std::size_t i = 0; i < job.inputs.size(); ++i) {
      formats::PackedFile f(job.inputs[i]);
      if (i == 0) token_size = f.token_size();
      if (f.token_size() != token_size)
        throw Error(fmt::format(
            "token size mismatch: '{}' has {}-byte tokens but '{}' has {}-byte tokens (all inputs of a chunk must "
            "use the same tokenizer)",
            job.inputs.front().string(), token_size, job.inputs[i].string(), f.token_size()));
      const auto& index = f.index();
      if (f.legacy()) ++result.legacy_inputs;
      const ChunkRange r = chunk_range(index.size(), job.num_chunks, job.chunk_id);
      for (std::uint64_t k = r.begin; k < r.end; ++k)
        samples.push_back({static_cast<std::uint32_t>(i), index[k].first, index[k].second});
      data_lens.push_back(f.header().data_len);
      bar.update(i + 1);
    }
    bar.finish();
  }
  if (samples.empty()) empty_chunk(job);

  result.numpy_seed = chunk_seed(job.global_seed, job.chunk_id);
  NumpyRandom(result.numpy_seed).shuffle(samples);

  // Pass 2: map the files again (header only) and stream the documents.
  std::vector<formats::PackedFile> files;
  files.reserve(job.inputs.size());
  for (std::size_t i = 0; i < job.inputs.size(); ++i) {
    files.emplace_back(job.inputs[i]);
    if (files.back().header().data_len != data_lens[i] || files.back().token_size() != token_size)
      throw Error(fmt::format("'{}' changed while the chunk was being written", job.inputs[i].string()));
  }
  formats::PackedWriter out(job.output, token_size);
  ProgressBar bar(fmt::format("writing chunk {}", job.chunk_id), samples.size(), "docs");
  for (std::size_t k = 0; k < samples.size(); ++k) {
    const SampleRef& s = samples[k];
    out.add_document(files[s.file].data().subspan(s.offset, s.length));
    if (k % kProgressEvery == 0) bar.update(k);
  }
  samples = {};
  return finish_packed(out, bar, result);
}

ToolResult create_shuffled_jsonl_chunk(const ChunkJob& job) {
  ToolResult result;
  check_chunk_job(job);
  if (!prepare_output(job.output, job.policy, result)) return result;
  MODALITIES_CHECK(job.inputs.size() < (std::uint64_t{1} << 32), "too many input files ({})", job.inputs.size());

  std::vector<std::unique_ptr<MappedFile>> files;
  std::vector<SampleRef> samples;
  {
    ProgressBar bar(fmt::format("splitting lines for chunk {}", job.chunk_id), job.inputs.size(), "files");
    for (std::size_t i = 0; i < job.inputs.size(); ++i) {
      files.push_back(std::make_unique<MappedFile>(job.inputs[i]));
      files.back()->advise_sequential();
      const std::vector<formats::IndexEntry> lines = readlines(files.back()->text());
      const ChunkRange r = chunk_range(lines.size(), job.num_chunks, job.chunk_id);
      for (std::uint64_t k = r.begin; k < r.end; ++k)
        samples.push_back({static_cast<std::uint32_t>(i), lines[k].first, lines[k].second});
      bar.update(i + 1);
    }
    bar.finish();
  }
  if (samples.empty()) empty_chunk(job);

  result.numpy_seed = chunk_seed(job.global_seed, job.chunk_id);
  NumpyRandom(result.numpy_seed).shuffle(samples);

  AtomicFile out(job.output);
  ProgressBar bar(fmt::format("writing chunk {}", job.chunk_id), samples.size(), "lines");
  for (std::size_t k = 0; k < samples.size(); ++k) {
    const SampleRef& s = samples[k];
    write_line(out, files[s.file]->text().substr(s.offset, s.length), result);
    if (k % kProgressEvery == 0) bar.update(k);
  }
  out.commit();
  bar.finish();
  result.documents = samples.size();
  result.bytes = out.size();
  return result;
}

}  // namespace modalities::core::data
