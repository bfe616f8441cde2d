// `dataset/mem_map_dataset` (spec data.md §6.4): a JSONL file and its raw
// index (§3), tokenized on the fly. Item k = tokenizer(first output of the jq
// path on line k). Deviation (quirk Q7): Modalities returns a bare list of
// ids, which no collator accepts; here the item is {sample_key: int64 ids}.
// No EOD token is appended, as in Modalities.
//
// Only the jq subset that Modalities' configs use is supported: `.`, `.key`,
// `.a.b`, `.["key"]` (and mixtures); anything else is rejected when the
// config is built. Lines are read with pread (thread-safe, no shared cursor)
// and parsed with simdjson, which also rejects invalid UTF-8 as Modalities'
// strict decoding does.
#include "datasets.h"

#include <modalities/sdk/formats/packed_data.h>
#include <modalities/sdk/interfaces/dataset.h>
#include <modalities/sdk/interfaces/tokenizer.h>

#include <ATen/ATen.h>
#include <simdjson.h>

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

/// A parsed jq path: the keys to follow from the top-level value.
std::vector<std::string> parse_jq_path(const std::string& program) {
  auto unsupported = [&](const std::string& why) {
    return ConfigError("jq_pattern", fmt::format("unsupported jq program '{}': {}", program, why),
                       "supported: '.', '.key', '.a.b', '.[\"key\"]'");
  };
  std::vector<std::string> keys;
  std::size_t i = 0;
  const std::size_t n = program.size();
  auto ident_char = [](char ch, bool first) {
    return std::isalpha(static_cast<unsigned char>(ch)) || ch == '_' || (!first && std::isdigit(static_cast<unsigned char>(ch)));
  };
  if (n == 0 || program[0] != '.') throw unsupported("it must start with '.'");
  if (program == ".") return keys;
  while (i < n) {
    bool dotted = false;
    if (program[i] == '.') {
      dotted = true;
      ++i;
    }
    if (i < n && program[i] == '[') {
      // ["key"]: a JSON string literal without escapes other than \" and \\.
      if (i + 1 >= n || program[i + 1] != '"') throw unsupported("only string keys are allowed in brackets");
      std::string key;
      std::size_t k = i + 2;
      for (; k < n && program[k] != '"'; ++k) {
        if (program[k] == '\\') {
          if (k + 1 >= n || (program[k + 1] != '"' && program[k + 1] != '\\')) throw unsupported("unsupported escape");
          ++k;
        }
        key.push_back(program[k]);
      }
      if (k + 1 >= n || program[k] != '"' || program[k + 1] != ']') throw unsupported("unterminated [\"...\"]");
      keys.push_back(key);
      i = k + 2;
    } else if (dotted && i < n && ident_char(program[i], true)) {
      std::size_t k = i;
      while (k < n && ident_char(program[k], false)) ++k;
      keys.push_back(program.substr(i, k - i));
      i = k;
    } else {
      throw unsupported(fmt::format("unexpected character at position {}", i));
    }
  }
  return keys;
}

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
      : path_(c.raw_data_path), tokenizer_(c.tokenizer.shared()), jq_(c.jq_pattern), key_(c.sample_key) {
    keys_ = parse_jq_path(c.jq_pattern);
    const std::filesystem::path index =
        c.index_path ? *c.index_path : path_.parent_path() / (path_.stem().string() + ".idx");
    try {
      index_ = formats::read_raw_index(index);
    } catch (const Error& e) {
      throw ConfigError(c.index_path ? "index_path" : "raw_data_path", e.what());
    }
    std::error_code ec;
    const auto size = static_cast<std::uint64_t>(std::filesystem::file_size(path_, ec));
    if (ec) throw ConfigError("raw_data_path", fmt::format("{}: {}", path_.string(), ec.message()));
    for (std::size_t k = 0; k < index_.size(); ++k) {
      const auto [off, len] = index_[k];
      if (off > size || len > size - off)
        throw ConfigError(c.index_path ? "index_path" : "raw_data_path",
                          fmt::format("{}: entry {} = ({}, {}) lies beyond the end of {} ({} bytes); stale index?",
                                      index.string(), k, off, len, path_.string(), size));
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
    std::string line(len, '\0');
    std::size_t done = 0;
    while (done < len) {
      const ssize_t got = ::pread(fd_, line.data() + done, len - done, static_cast<off_t>(off + done));
      if (got < 0 && errno == EINTR) continue;
      MODALITIES_CHECK(got > 0, "{}: read of line {} failed: {}", path_.string(), index,
                       got < 0 ? std::strerror(errno) : "unexpected end of file");
      done += static_cast<std::size_t>(got);
    }
    const std::string text = select_text(line, index);
    const std::vector<std::int64_t> ids = tokenizer_->tokenize(text);
    at::Tensor t = at::empty({static_cast<std::int64_t>(ids.size())}, at::kLong);
    std::copy(ids.begin(), ids.end(), t.data_ptr<std::int64_t>());
    return {{key_, t}};
  }

 private:
  std::string select_text(const std::string& line, std::int64_t index) const {
    simdjson::dom::parser parser;  // per call: parsers are not thread-safe
    simdjson::dom::element e;
    if (auto err = parser.parse(line).get(e))
      throw Error(fmt::format("{}: line {} is not valid JSON: {}", path_.string(), index, simdjson::error_message(err)));
    for (const auto& key : keys_) {
      simdjson::dom::object obj;
      if (e.get(obj))
        throw Error(fmt::format("{}: line {}: jq '{}': cannot index a non-object with \"{}\"", path_.string(), index,
                                jq_, key));
      if (obj[key].get(e))
        throw Error(fmt::format("{}: line {}: jq '{}' gives null (key \"{}\" is missing)", path_.string(), index, jq_,
                                key));
    }
    std::string_view s;
    if (e.get(s))
      throw Error(fmt::format("{}: line {}: jq '{}' selects a {} value, expected a string", path_.string(), index, jq_,
                              e.is_null() ? "null" : "non-string"));
    return std::string(s);
  }

  std::filesystem::path path_;
  std::shared_ptr<Tokenizer> tokenizer_;
  std::string jq_, key_;
  std::vector<std::string> keys_;
  std::vector<formats::IndexEntry> index_;
  int fd_ = -1;
};

}  // namespace

void register_mem_map(Registrar& r) {
  r.add<Dataset, MemMapDatasetConfig>(
      "mem_map_dataset", "JSONL lines tokenized on the fly; items are {sample_key: int64 ids} (Modalities: bare list).",
      [](const MemMapDatasetConfig& c) { return std::make_shared<MemMapDataset>(c); });
}

}  // namespace modalities::plugins::datasets
