// `dataset/packed_mem_map_dataset_continuous` (README.md): a `.pbin`
// file read as one token stream cut into fixed-size blocks. Sample i is tokens
// [i*S, i*S + B) with B = S + 1 when reuse_last_target (consecutive samples
// share one token) and B = S otherwise. The index segment is never read, so
// legacy files work. Tokens are returned as int64 whatever the file's token
// size (quirk Q12: Modalities returns uint8/int32/int64; values are equal).
#include "datasets.h"

#include <modalities/sdk/formats/packed_file.h>
#include <modalities/sdk/interfaces/dataset.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <string>

namespace modalities::plugins::datasets {
namespace {

struct PackedContinuousConfig {
  std::filesystem::path raw_data_path;
  std::int64_t sequence_length = 0;
  std::string sample_key;
  bool reuse_last_target = true;

  static void describe(Schema<PackedContinuousConfig>& s) {
    s.field("raw_data_path", &PackedContinuousConfig::raw_data_path, "The .pbin file.").required();
    s.field("sequence_length", &PackedContinuousConfig::sequence_length,
            "Tokens the model sees per sample (S); a sample holds S + 1 tokens with reuse_last_target.")
        .required()
        .greater_than(1);
    s.field("sample_key", &PackedContinuousConfig::sample_key, "Key of the token array in each sample.").required();
    s.field("reuse_last_target", &PackedContinuousConfig::reuse_last_target,
            "true: blocks of S + 1 tokens overlapping by one (pre-training); false: disjoint blocks of S tokens.");
  }
};

class PackedContinuousDataset final : public Dataset {
 public:
  explicit PackedContinuousDataset(const PackedContinuousConfig& c) : key_(c.sample_key), stride_(c.sequence_length) {
    try {
      file_.open(c.raw_data_path);
    } catch (const Error& e) {
      throw ConfigError("raw_data_path", e.what());
    }
    block_ = c.reuse_last_target ? stride_ + 1 : stride_;
    const auto tokens = static_cast<std::int64_t>(file_.num_tokens());
    if (tokens < block_)
      throw ConfigError(
          "sequence_length",
          fmt::format("{} holds {} tokens, fewer than one sample of {} tokens (sequence_length {}{})",
                      c.raw_data_path.string(), tokens, block_, stride_, c.reuse_last_target ? " + 1" : ""));
    // reuse: (T - B) div (B - 1) + 1 = (T - 1) div S;  no reuse: T div S.
    size_ = c.reuse_last_target ? (tokens - 1) / stride_ : tokens / stride_;
  }

  std::int64_t size() const override { return size_; }

  Sample get(std::int64_t index) const override {
    MODALITIES_CHECK(index >= 0 && index < size_, "{}: sample index {} is out of range [0, {})", file_.path().string(),
                     index, size_);
    at::Tensor t = at::empty({block_}, at::kLong);
    file_.copy_tokens(static_cast<std::uint64_t>(index * stride_), static_cast<std::uint64_t>(block_),
                      t.data_ptr<std::int64_t>());
    return {{key_, t}};
  }

  std::int64_t token_size_in_bytes() const override { return file_.token_size(); }

 private:
  formats::PackedFile file_;
  std::string key_;
  std::int64_t stride_ = 0, block_ = 0, size_ = 0;
};

}  // namespace

void register_packed(Registrar& r) {
  r.add<Dataset, PackedContinuousConfig>(
      "packed_mem_map_dataset_continuous",
      "A .pbin token stream cut into blocks of sequence_length (+1) tokens; int64 samples.",
      [](const PackedContinuousConfig& c) { return std::make_shared<PackedContinuousDataset>(c); });
}

}  // namespace modalities::plugins::datasets
