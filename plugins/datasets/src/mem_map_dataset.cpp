// `dataset/mem_map_dataset` (README.md): a JSONL file and its raw
// index (docs/data.md), tokenized on the fly. Item k = tokenizer(first output of the jq
// path on line k). Deviation (quirk Q7): Modalities returns a bare list of
// ids, which no collator accepts; here the item is {sample_key: int64 ids}.
// No EOD token is appended, as in Modalities.
//
// The jq paths and JSON rules are the packer's (modalities/sdk/formats/jsonl.h):
// key paths and array indices, anything else rejected when the config is
// built; Python json.loads acceptance; invalid UTF-8 rejected as Modalities'
// strict decoding does. Lines are read with pread (thread-safe, no shared cursor).
#include "datasets.h"

#include <modalities/sdk/formats/jsonl.h>
#include <modalities/sdk/formats/packed_data.h>
#include <modalities/sdk/interfaces/dataset.h>
#include <modalities/sdk/interfaces/tokenizer.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace modalities::plugins::datasets {
namespace {

struct MemMapDatasetConfig {
  std::filesystem::path raw_data_path;
  std::optional<std::filesystem::path> index_path;
  Ref<Tokenizer> tokenizer;
  std::string jq_pattern;
  std::string sample_key;

  static void describe(Schema<MemMapDatasetConfig>& s) {
    s.field("raw_data_path", &MemMapDatasetConfig::raw_data_path, "The JSONL file.").required().existing_file();
    s.field("index_path", &MemMapDatasetConfig::index_path,
            "Its raw index (.idx); default: <directory>/<stem>.idx next to the JSONL file.")
        .existing_file();
    s.field("tokenizer", &MemMapDatasetConfig::tokenizer, "Tokenizer applied to each selected text.").required();
    s.field("jq_pattern", &MemMapDatasetConfig::jq_pattern, "jq path selecting the text, e.g. '.text'.").required();
    s.field("sample_key", &MemMapDatasetConfig::sample_key, "Key of the token array in each sample.").required();
  }
};

class MemMapDataset final : public Dataset {
 public:
  explicit MemMapDataset(const MemMapDatasetConfig& c)
      : path_(c.raw_data_path), tokenizer_(c.tokenizer.shared()), key_(c.sample_key) {
    try {
      jq_ = formats::JqPath::parse(c.jq_pattern);
    } catch (const Error& e) {
      throw ConfigError("jq_pattern", e.what());
    }
    const std::filesystem::path index =
        c.index_path ? *c.index_path : path_.parent_path() / (path_.stem().string() + ".idx");
    try {
      index_ = formats::read_raw_index(index);
    } catch (const Error& e) {
      throw ConfigError(c.index_path ? "index_path" : "raw_data_path", e.what());
    }
    std::error_code ec;
    const auto size = static_cast<std::uint64_t>(std::filesystem::file_size(path_, ec));
    size_ = size;
    if (ec) throw ConfigError("raw_data_path", fmt::format("{}: {}", path_.string(), ec.message()));
    try {
      formats::check_raw_index_fits(index_, size, index, path_);
    } catch (const Error& e) {
      throw ConfigError(c.index_path ? "index_path" : "raw_data_path", e.what());
    }
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);  // last: nothing below can throw and leak it
    if (fd_ < 0)
      throw ConfigError("raw_data_path", fmt::format("{}: cannot open: {}", path_.string(), std::strerror(errno)));
  }
  ~MemMapDataset() override {
    if (fd_ >= 0) ::close(fd_);
  }

  std::int64_t size() const override { return static_cast<std::int64_t>(index_.size()); }

  Sample get(std::int64_t index) const override {
    MODALITIES_CHECK(index >= 0 && index < size(), "{}: sample index {} is out of range [0, {})", path_.string(), index,
                     size());
    const auto [off, len] = index_[static_cast<std::size_t>(index)];
    // Read the line with the byte before and after it: an entry of a stale or corrupt index that
    // is not a whole line is an error, not a wrong sample.
    const std::uint64_t lo = off > 0 ? off - 1 : 0;
    const std::uint64_t hi = std::min<std::uint64_t>(off + len + 1, size_);
    std::string buf(hi - lo, '\0');
    std::size_t done = 0;
    while (done < buf.size()) {
      const ssize_t got = ::pread(fd_, buf.data() + done, buf.size() - done, static_cast<off_t>(lo + done));
      if (got < 0 && errno == EINTR) continue;
      MODALITIES_CHECK(got > 0, "{}: read of line {} failed: {}", path_.string(), index,
                       got < 0 ? std::strerror(errno) : "unexpected end of file (the file shrank?)");
      done += static_cast<std::size_t>(got);
    }
    MODALITIES_CHECK((off == 0 || buf.front() == '\n') && (off + len == size_ || buf.back() == '\n'),
                     "{}: index entry {} = ({}, {}) is not a whole line of the file; the index is stale or corrupt "
                     "(re-create it with `modalities data create_raw_index`)",
                     path_.string(), index, off, len);
    const std::string line = buf.substr(off - lo, len);
    const std::string text = select_text(line, index);
    const std::vector<std::int64_t> ids = tokenizer_->tokenize(text);
    at::Tensor t = at::empty({static_cast<std::int64_t>(ids.size())}, at::kLong);
    std::copy(ids.begin(), ids.end(), t.data_ptr<std::int64_t>());
    return {{key_, t}};
  }

 private:
  std::string select_text(const std::string& line, std::int64_t index) const {
    thread_local formats::JsonLineParser parser;  // parsers own buffers: one per thread
    try {
      return std::string(parser.extract_string(line, jq_));
    } catch (const Error& e) {
      throw Error(fmt::format("{}:{}: {} (sample {})", path_.string(), index + 1, e.what(), index));
    }
  }

  std::filesystem::path path_;
  std::shared_ptr<Tokenizer> tokenizer_;
  formats::JqPath jq_;
  std::string key_;
  std::vector<formats::IndexEntry> index_;
  int fd_ = -1;
  std::uint64_t size_ = 0;  // of the JSONL file when the dataset was built
};

}  // namespace

void register_mem_map(Registrar& r) {
  r.add<Dataset, MemMapDatasetConfig>(
      "mem_map_dataset", "JSONL lines tokenized on the fly; items are {sample_key: int64 ids} (Modalities: bare list).",
      [](const MemMapDatasetConfig& c) { return std::make_shared<MemMapDataset>(c); });
}

}  // namespace modalities::plugins::datasets
