// The `sampler` variants of Modalities (README.md) and
// `batch_sampler/default`. Exact sample order is the point: shuffling uses
// LibTorch's own randperm with a CPU generator seeded seed + epoch, exactly
// as torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
// does in Modalities, so every rank reads the same indices as a Python run.
//
// Resumable order: with n = len(dataset), K skipped, G = n - K,
// L = G div R if drop_last and G mod R != 0 else ceil(G / R), E = L * R:
// full = permutation (or identity); rest = full[K:]; drop_last keeps
// rest[:E], otherwise rest is padded to E from the start of the *whole*
// permutation, cyclically; rank r reads rest[r], rest[r + R], ...
#include <modalities/sdk/interfaces/dataset.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/interfaces/sampler.h>
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/plugin.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <optional>
#include <string>
#include <vector>

namespace modalities::plugins::samplers {
namespace {

struct Order {
  std::int64_t rank = 0;
  std::int64_t num_replicas = 1;
  std::int64_t epoch = 0;
  bool shuffle = false;
  std::int64_t seed = 0;
  bool drop_last = true;
  std::int64_t skip = 0;
};

// The indices one rank reads, in order. Shuffled orders are materialised (the
// rank's slice only, as a contiguous int64 tensor); identity orders are computed.
class DistributedOrder final : public Sampler {
 public:
  DistributedOrder(std::int64_t n, const Order& o, const char* skip_key) : o_(o), n_(n) {
    if (o.skip > n) throw ConfigError(skip_key, fmt::format("cannot skip {} samples of a dataset with {}", o.skip, n));
    const std::int64_t global = n - o.skip;
    const std::int64_t r = o.num_replicas;
    local_ = (o.drop_last && global % r != 0) ? global / r : (global + r - 1) / r;
    if (o.shuffle) {
      const at::Tensor full = at::randperm(
          n, at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(o.seed + o.epoch)), at::kLong);
      const std::int64_t* f = full.data_ptr<std::int64_t>();
      local_indices_ = at::empty({local_}, at::kLong);
      std::int64_t* out = local_indices_.data_ptr<std::int64_t>();
      for (std::int64_t q = 0; q < local_; ++q) out[q] = f[rest_position(q)];
    }
  }

  std::int64_t size() const override { return local_; }

  std::int64_t index_at(std::int64_t position) const override {
    MODALITIES_CHECK(position >= 0 && position < local_, "sampler position {} is out of range [0, {}) (rank {} of {})",
                     position, local_, o_.rank, o_.num_replicas);
    if (local_indices_.defined()) return local_indices_.data_ptr<std::int64_t>()[position];
    return rest_position(position);
  }

 private:
  // Position in `full` of this rank's q-th index.
  std::int64_t rest_position(std::int64_t q) const {
    const std::int64_t p = o_.rank + q * o_.num_replicas;  // position in rest (padded)
    const std::int64_t global = n_ - o_.skip;
    return p < global ? o_.skip + p : (p - global) % n_;  // padding restarts at full[0]
  }

  Order o_;
  std::int64_t n_;
  std::int64_t local_ = 0;
  at::Tensor local_indices_;
};

// --- configs -------------------------------------------------------------------

constexpr const char* kDropLastHelp =
    "Drop the tail that does not divide evenly among the replicas. Modalities only accepts true; "
    "false pads by repeating the start of the (shuffled) order, like the Python class.";

// The order fields shared by the two resumable samplers (README.md, "Order").
template <class C>
void describe_resumable_order(Schema<C>& s) {
  s.field("epoch", &C::epoch, "Added to the seed (shuffle generator seed = seed + epoch).").non_negative();
  s.field("shuffle", &C::shuffle, "Shuffle with torch.randperm (null means false).");
  s.field("seed", &C::seed, "Shuffle seed.");
  s.field("drop_last", &C::drop_last, kDropLastHelp);
  s.field("skip_num_global_samples", &C::skip_num_global_samples,
          "Samples of the global (shuffled) order already consumed, e.g. on a warm start.")
      .non_negative();
  s.rule([](const C& c, ParseContext& ctx) {
    if (c.shuffle.value_or(false) && !c.seed) ctx.fail("seed", "must be an integer when shuffle is true");
  });
}

struct ResumableDistributedSamplerConfig {
  Ref<Dataset> dataset;
  std::int64_t rank = 0;
  std::int64_t num_replicas = 0;
  std::int64_t epoch = 0;
  std::optional<bool> shuffle = false;
  std::optional<std::int64_t> seed = 0;
  bool drop_last = true;
  std::int64_t skip_num_global_samples = 0;

  static void describe(Schema<ResumableDistributedSamplerConfig>& s) {
    using C = ResumableDistributedSamplerConfig;
    s.field("dataset", &C::dataset, "Dataset whose indices are sampled.").required();
    s.field("rank", &C::rank, "This replica's data-parallel rank.").required().non_negative();
    s.field("num_replicas", &C::num_replicas, "Number of data-parallel replicas.").required().positive();
    describe_resumable_order(s);
    s.rule([](const C& c, ParseContext& ctx) { check_rank(c, ctx); });
  }

  template <class C>
  static void check_rank(const C& c, ParseContext& ctx) {
    if (c.rank >= c.num_replicas)
      ctx.fail("rank", fmt::format("must be < num_replicas ({}), got {}", c.num_replicas, c.rank));
  }
};

struct DistributedSamplerConfig {
  Ref<Dataset> dataset;
  std::int64_t rank = 0;
  std::int64_t num_replicas = 0;
  bool shuffle = false;
  std::optional<std::int64_t> seed = 0;
  bool drop_last = true;

  static void describe(Schema<DistributedSamplerConfig>& s) {
    using C = DistributedSamplerConfig;
    s.field("rank", &C::rank, "This replica's data-parallel rank.").required().non_negative();
    s.field("num_replicas", &C::num_replicas, "Number of data-parallel replicas.").required().positive();
    s.field("shuffle", &C::shuffle, "Shuffle with torch.randperm.").required();
    s.field("dataset", &C::dataset, "Dataset whose indices are sampled.").required();
    s.field("seed", &C::seed, "Shuffle seed.");
    s.field("drop_last", &C::drop_last, kDropLastHelp);
    s.rule([](const C& c, ParseContext& ctx) {
      ResumableDistributedSamplerConfig::check_rank(c, ctx);
      if (c.shuffle && !c.seed) ctx.fail("seed", "must be an integer when shuffle is true");
    });
  }
};

struct MultiDimSamplerConfig {
  Ref<Dataset> dataset;
  Ref<DeviceMesh> device_mesh;
  std::string data_parallel_key;
  std::int64_t epoch = 0;
  std::optional<bool> shuffle = false;
  std::optional<std::int64_t> seed = 0;
  bool drop_last = true;
  std::int64_t skip_num_global_samples = 0;

  static void describe(Schema<MultiDimSamplerConfig>& s) {
    using C = MultiDimSamplerConfig;
    s.field("dataset", &C::dataset, "Dataset whose indices are sampled.").required();
    s.field("device_mesh", &C::device_mesh, "Mesh giving this rank's data-parallel coordinate.").required();
    s.field("data_parallel_key", &C::data_parallel_key,
            "Mesh dimension that splits the data: rank = coordinate along it, replicas = its size.")
        .required()
        .one_of(mesh_dim_names());
    describe_resumable_order(s);
  }
};

struct SequentialSamplerConfig {
  Ref<Dataset> data_source;
  static void describe(Schema<SequentialSamplerConfig>& s) {
    s.field("data_source", &SequentialSamplerConfig::data_source, "Dataset whose indices 0..n-1 are yielded.")
        .required();
  }
};

class SequentialSampler final : public Sampler {
 public:
  explicit SequentialSampler(std::int64_t n) : n_(n) {}
  std::int64_t size() const override { return n_; }
  std::int64_t index_at(std::int64_t position) const override {
    MODALITIES_CHECK(position >= 0 && position < n_, "sampler position {} is out of range [0, {})", position, n_);
    return position;
  }

 private:
  std::int64_t n_;
};

// --- batch_sampler/default ----------------------------------------------------------

struct BatchSamplerConfig {
  Ref<Sampler> sampler;
  std::int64_t batch_size = 0;
  bool drop_last = true;
  static void describe(Schema<BatchSamplerConfig>& s) {
    s.field("sampler", &BatchSamplerConfig::sampler, "Sampler whose indices are grouped.").required();
    s.field("batch_size", &BatchSamplerConfig::batch_size, "Indices per micro-batch.").required().positive();
    s.field("drop_last", &BatchSamplerConfig::drop_last,
            "Drop an incomplete last batch. Modalities only accepts true; false keeps it (PyTorch semantics).");
  }
};

class DefaultBatchSampler final : public BatchSampler {
 public:
  explicit DefaultBatchSampler(const BatchSamplerConfig& c) : sampler_(c.sampler.shared()), batch_size_(c.batch_size) {
    const std::int64_t n = sampler_->size();
    size_ = c.drop_last ? n / batch_size_ : (n + batch_size_ - 1) / batch_size_;
  }
  std::int64_t size() const override { return size_; }
  std::vector<std::int64_t> batch_at(std::int64_t batch) const override {
    MODALITIES_CHECK(batch >= 0 && batch < size_, "batch {} is out of range [0, {})", batch, size_);
    const std::int64_t first = batch * batch_size_;
    const std::int64_t last = std::min(first + batch_size_, sampler_->size());
    std::vector<std::int64_t> out;
    out.reserve(static_cast<std::size_t>(last - first));
    for (std::int64_t p = first; p < last; ++p) out.push_back(sampler_->index_at(p));
    return out;
  }

 private:
  std::shared_ptr<Sampler> sampler_;
  std::int64_t batch_size_;
  std::int64_t size_ = 0;
};

}  // namespace

void register_components(Registrar& r) {
  r.add<Sampler, ResumableDistributedSamplerConfig>(
      "resumable_distributed_sampler",
      "Rank slice of the (torch.randperm-shuffled) dataset order after skipping the globally consumed samples.",
      [](const ResumableDistributedSamplerConfig& c) {
        return std::make_shared<DistributedOrder>(c.dataset->size(),
                                                  Order{c.rank, c.num_replicas, c.epoch, c.shuffle.value_or(false),
                                                        c.seed.value_or(0), c.drop_last, c.skip_num_global_samples},
                                                  "skip_num_global_samples");
      });
  r.add<Sampler, DistributedSamplerConfig>(
      "distributed_sampler", "PyTorch's DistributedSampler: rank slice of the (shuffled) dataset order.",
      [](const DistributedSamplerConfig& c) {
        return std::make_shared<DistributedOrder>(
            c.dataset->size(), Order{c.rank, c.num_replicas, 0, c.shuffle, c.seed.value_or(0), c.drop_last, 0},
            "dataset");
      });
  r.add<Sampler, MultiDimSamplerConfig>(
      "resumable_distributed_multi_dim_sampler",
      "resumable_distributed_sampler with rank and replicas taken from one device-mesh dimension.",
      [](const MultiDimSamplerConfig& c) {
        const DeviceMesh& mesh = *c.device_mesh;
        const MeshDim dim = *parse_mesh_dim(c.data_parallel_key);  // one_of(mesh_dim_names())
        if (!mesh.has_dim(dim))
          throw ConfigError("data_parallel_key", fmt::format("the device mesh has no dimension '{}' (it has: {})",
                                                             c.data_parallel_key, join_mesh_dims(mesh.dims())));
        return std::make_shared<DistributedOrder>(
            c.dataset->size(),
            Order{mesh.coordinate(dim), mesh.size(dim), c.epoch, c.shuffle.value_or(false), c.seed.value_or(0),
                  c.drop_last, c.skip_num_global_samples},
            "skip_num_global_samples");
      });
  r.add<Sampler, SequentialSamplerConfig>(
      "sequential_sampler", "Indices 0..n-1 in order.",
      [](const SequentialSamplerConfig& c) { return std::make_shared<SequentialSampler>(c.data_source->size()); });
  r.add<BatchSampler, BatchSamplerConfig>(
      "default", "Groups a sampler's indices into micro-batches of batch_size (PyTorch's BatchSampler).",
      [](const BatchSamplerConfig& c) { return std::make_shared<DefaultBatchSampler>(c); });
}

}  // namespace modalities::plugins::samplers

MODALITIES_PLUGIN(samplers, MODALITIES_PLUGIN_VERSION, modalities::plugins::samplers::register_components)
