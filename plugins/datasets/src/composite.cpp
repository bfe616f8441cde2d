// Datasets built from other datasets or from nothing:
//   combined          concatenation (README.md)
//   weighted_mixture  NEW: exact, seed-determined weighted mixture (see
//                     mixture_schedule.h, Note [Mixture order])
//   dummy_dataset     random samples of fixed shapes (README.md); optionally
//                     seeded per index, which Modalities is not
#include "datasets.h"
#include "mixture_schedule.h"

#include <modalities/sdk/interfaces/dataset.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

namespace modalities::plugins::datasets {
namespace {

std::vector<std::shared_ptr<Dataset>> unwrap(const std::vector<Ref<Dataset>>& refs) {
  std::vector<std::shared_ptr<Dataset>> out;
  for (const auto& r : refs) out.push_back(r.shared());
  return out;
}

// The common token size of `parts`, or 0 when they differ or do not say.
std::int64_t common_token_size(const std::vector<std::shared_ptr<Dataset>>& parts) {
  std::int64_t size = -1;
  for (const auto& p : parts) {
    const std::int64_t s = p->token_size_in_bytes();
    if (size != -1 && s != size) return 0;
    size = s;
  }
  return std::max<std::int64_t>(size, 0);
}

// --- combined ------------------------------------------------------------------

struct CombinedConfig {
  std::vector<Ref<Dataset>> datasets;
  static void describe(Schema<CombinedConfig>& s) {
    s.field("datasets", &CombinedConfig::datasets, "Datasets to concatenate, in order.").required();
  }
};

class CombinedDataset final : public Dataset {
 public:
  explicit CombinedDataset(const CombinedConfig& c) : parts_(unwrap(c.datasets)) {
    std::int64_t total = 0;
    for (const auto& p : parts_) cumulative_.push_back(total += p->size());
  }
  std::int64_t size() const override { return cumulative_.empty() ? 0 : cumulative_.back(); }
  Sample get(std::int64_t index) const override {
    MODALITIES_CHECK(index >= 0 && index < size(), "combined dataset: sample index {} is out of range [0, {})", index,
                     size());
    // First dataset whose cumulative size exceeds the index (Python's bisect_right).
    const auto it = std::upper_bound(cumulative_.begin(), cumulative_.end(), index);
    const auto j = static_cast<std::size_t>(it - cumulative_.begin());
    return parts_[j]->get(index - (j == 0 ? 0 : cumulative_[j - 1]));
  }
  std::int64_t token_size_in_bytes() const override { return common_token_size(parts_); }

 private:
  std::vector<std::shared_ptr<Dataset>> parts_;
  std::vector<std::int64_t> cumulative_;
};

// --- weighted_mixture -------------------------------------------------------------

struct WeightedMixtureConfig {
  std::vector<Ref<Dataset>> datasets;
  std::vector<double> weights;
  std::optional<std::int64_t> num_samples;
  std::int64_t seed = 0;
  bool shuffle = true;

  static void describe(Schema<WeightedMixtureConfig>& s) {
    s.field("datasets", &WeightedMixtureConfig::datasets, "Source datasets.").required().non_empty();
    s.field("weights", &WeightedMixtureConfig::weights,
            "Relative share of each source (one per dataset; need not sum to 1).")
        .required()
        .non_negative();
    s.field("num_samples", &WeightedMixtureConfig::num_samples,
            "Length of the mixture; null: the longest mixture that repeats no sample of any source.")
        .non_negative();
    s.field("seed", &WeightedMixtureConfig::seed, "Seed of the per-pass permutations of each source.");
    s.field("shuffle", &WeightedMixtureConfig::shuffle,
            "Visit each source in a seed-determined order that changes every pass; false: in order.");
    s.rule([](const WeightedMixtureConfig& c, ParseContext& ctx) {
      if (c.weights.size() != c.datasets.size())
        ctx.fail("weights",
                 fmt::format("expected one weight per dataset ({}), got {}", c.datasets.size(), c.weights.size()));
      else if (std::none_of(c.weights.begin(), c.weights.end(), [](double w) { return w > 0; }))
        ctx.fail("weights", "at least one weight must be positive");
    });
  }
};

class WeightedMixtureDataset final : public Dataset {
 public:
  WeightedMixtureDataset(const WeightedMixtureConfig& c, MixtureSchedule schedule)
      : parts_(unwrap(c.datasets)), schedule_(std::move(schedule)) {}

  static std::shared_ptr<WeightedMixtureDataset> create(const WeightedMixtureConfig& c) {
    std::vector<std::int64_t> sizes;
    for (const auto& d : c.datasets) sizes.push_back(d->size());
    try {
      return std::make_shared<WeightedMixtureDataset>(
          c, MixtureSchedule(c.weights, sizes, c.num_samples, static_cast<std::uint64_t>(c.seed), c.shuffle));
    } catch (const std::invalid_argument& e) {
      // Messages start with the offending key ("weights[2]: ...").
      const std::string what = e.what();
      const auto colon = what.find(": ");
      throw ConfigError(what.substr(0, colon), what.substr(colon + 2));
    }
  }

  std::int64_t size() const override { return schedule_.size(); }
  Sample get(std::int64_t index) const override {
    MODALITIES_CHECK(index >= 0 && index < size(), "weighted mixture: sample index {} is out of range [0, {})", index,
                     size());
    const auto [j, local] = schedule_.at(index);
    return parts_[j]->get(local);
  }
  std::int64_t token_size_in_bytes() const override { return common_token_size(parts_); }

 private:
  std::vector<std::shared_ptr<Dataset>> parts_;
  MixtureSchedule schedule_;
};

// --- dummy_dataset ----------------------------------------------------------------

struct DummySampleDefinition {
  std::string sample_key;
  std::vector<std::int64_t> sample_shape;
  std::string sample_type;
  static void describe(Schema<DummySampleDefinition>& s) {
    s.field("sample_key", &DummySampleDefinition::sample_key, "Key of this tensor in each sample.").required();
    s.field("sample_shape", &DummySampleDefinition::sample_shape, "Shape of the tensor.").required().non_negative();
    s.field("sample_type", &DummySampleDefinition::sample_type,
            "float: standard normal float64; int: uniform int64 in [0, 512).")
        .required()
        .one_of({"float", "int"});
  }
};

struct DummyDatasetConfig {
  std::int64_t num_samples = 0;
  std::vector<DummySampleDefinition> sample_definition;
  std::optional<std::int64_t> seed;
  static void describe(Schema<DummyDatasetConfig>& s) {
    s.field("num_samples", &DummyDatasetConfig::num_samples, "Number of samples.").required().non_negative();
    s.field("sample_definition", &DummyDatasetConfig::sample_definition, "The tensors of each sample.").required();
    s.field("seed", &DummyDatasetConfig::seed,
            "null: fresh random data on every access (as Modalities); an integer: sample i is a pure function of "
            "(seed, i).");
  }
};

class DummyDataset final : public Dataset {
 public:
  explicit DummyDataset(DummyDatasetConfig c) : c_(std::move(c)) {}
  std::int64_t size() const override { return c_.num_samples; }
  Sample get(std::int64_t index) const override {
    MODALITIES_CHECK(index >= 0 && index < size(), "dummy dataset: sample index {} is out of range [0, {})", index,
                     size());
    std::optional<at::Generator> gen;
    if (c_.seed)
      gen = at::make_generator<at::CPUGeneratorImpl>(
          splitmix64(static_cast<std::uint64_t>(*c_.seed) ^ splitmix64(static_cast<std::uint64_t>(index))));
    Sample s;
    for (const auto& d : c_.sample_definition)
      s[d.sample_key] = d.sample_type == "float" ? at::randn(d.sample_shape, gen, at::kDouble)
                                                 : at::randint(0, 512, d.sample_shape, gen, at::kLong);
    return s;
  }

 private:
  DummyDatasetConfig c_;
};

}  // namespace

void register_composite(Registrar& r) {
  r.add<Dataset, CombinedConfig>("combined", "Concatenation of datasets.",
                                 [](const CombinedConfig& c) { return std::make_shared<CombinedDataset>(c); });
  r.add<Dataset, WeightedMixtureConfig>(
      "weighted_mixture",
      "NEW: weighted mixture of datasets; position -> (source, sample) is a pure function of the config.",
      [](const WeightedMixtureConfig& c) { return WeightedMixtureDataset::create(c); });
  r.add<Dataset, DummyDatasetConfig>("dummy_dataset",
                                     "Random tensors of fixed shapes (float64 normal / int64 [0, 512)).",
                                     [](const DummyDatasetConfig& c) { return std::make_shared<DummyDataset>(c); });
}

}  // namespace modalities::plugins::datasets
