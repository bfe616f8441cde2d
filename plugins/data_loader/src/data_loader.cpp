// `data_loader/default` (Modalities' LLMDataLoader, see README.md): yields
// the batches of the batch sampler in order: for batch [i1..ib] it fetches
// dataset[i1..ib] and collates them. With num_workers > 0, that many worker
// threads build batches ahead of the consumer, at most num_workers *
// prefetch_factor batches in flight (PyTorch's bound), and the consumer takes
// them strictly in batch order, so the output never depends on the number of
// workers. Threads instead of processes: datasets here are thread-safe
// (memory-mapped, const get()), so nothing needs to be pickled or forked.
#include <modalities/sdk/interfaces/batch.h>
#include <modalities/sdk/interfaces/collate_fn.h>
#include <modalities/sdk/interfaces/data_loader.h>
#include <modalities/sdk/interfaces/dataset.h>
#include <modalities/sdk/interfaces/sampler.h>
#include <modalities/sdk/plugin.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

namespace modalities::plugins::data_loader {
namespace {

struct DataLoaderConfig {
  std::string dataloader_tag;
  Ref<Dataset> dataset;
  Ref<BatchSampler> batch_sampler;
  std::optional<Ref<CollateFn>> collate_fn;
  std::int64_t num_workers = 0;
  bool pin_memory = false;
  std::int64_t prefetch_factor = 2;

  static void describe(Schema<DataLoaderConfig>& s) {
    using C = DataLoaderConfig;
    s.field("dataloader_tag", &C::dataloader_tag, "Name in logs and metrics (e.g. 'train', 'val').").required();
    s.field("dataset", &C::dataset, "Dataset the batch sampler's indices refer to.").required();
    s.field("batch_sampler", &C::batch_sampler, "Batches of dataset indices, in delivery order.").required();
    s.field("collate_fn", &C::collate_fn,
            "Turns a list of samples into a batch; null: stack every sample key into `samples` (no targets).");
    s.field("num_workers", &C::num_workers, "Worker threads building batches ahead; 0: build in next().")
        .required()
        .non_negative();
    s.field("pin_memory", &C::pin_memory, "Return batches in page-locked memory (only when CUDA is available).")
        .required();
    s.field("prefetch_factor", &C::prefetch_factor,
            "Batches in flight per worker (PyTorch's prefetch_factor); ignored without workers.")
        .positive();
  }
};

// PyTorch's default collation for dict samples: stack each key (no targets).
DatasetBatch stack_each_key(std::span<const Sample> samples) {
  MODALITIES_CHECK(!samples.empty(), "cannot collate an empty batch");
  DatasetBatch batch;
  for (const auto& [key, first] : samples.front()) {
    std::vector<at::Tensor> parts;
    for (std::size_t i = 0; i < samples.size(); ++i) {
      auto it = samples[i].find(key);
      MODALITIES_CHECK(it != samples[i].end(), "sample {} of the batch has no key '{}'", i, key);
      parts.push_back(it->second);
    }
    batch.samples[key] = at::stack(parts);
  }
  return batch;
}

class DefaultDataLoader final : public DataLoader {
 public:
  DefaultDataLoader(const DataLoaderConfig& c, bool pin)
      : tag_(c.dataloader_tag),
        dataset_(c.dataset.shared()),
        sampler_(c.batch_sampler.shared()),
        collate_(c.collate_fn ? c.collate_fn->shared() : nullptr),
        workers_(c.num_workers),
        pin_(pin),
        window_(c.num_workers * c.prefetch_factor) {}

  ~DefaultDataLoader() override { stop_workers(); }

  std::string tag() const override { return tag_; }
  std::int64_t size() const override { return sampler_->size(); }

  void begin(std::int64_t first_batch) override {
    stop_workers();
    MODALITIES_CHECK(first_batch >= 0 && first_batch <= size(),
                     "data_loader '{}': cannot begin at batch {} of {} (must be in [0, {}])", tag_, first_batch, size(),
                     size());
    next_ = first_batch;
    end_ = size();
    started_ = true;
    if (workers_ == 0 || next_ == end_) return;
    pass_ = std::make_unique<Pass>();
    pass_->dispatch = next_;
    pass_->consume = next_;
    for (std::int64_t w = 0; w < workers_; ++w) threads_.emplace_back([this, pass = pass_.get()] { work(*pass); });
  }

  std::optional<DatasetBatch> next() override {
    MODALITIES_CHECK(started_, "data_loader '{}': next() called before begin()", tag_);
    if (next_ >= end_) {
      stop_workers();
      return std::nullopt;
    }
    const std::int64_t b = next_++;
    if (!pass_) return produce(b);
    Result r;
    {
      std::unique_lock lk(pass_->m);
      pass_->ready_cv.wait(lk, [&] { return pass_->ready.count(b) > 0; });
      auto node = pass_->ready.extract(b);
      r = std::move(node.mapped());
      pass_->consume = b + 1;
    }
    pass_->work_cv.notify_all();
    if (auto* e = std::get_if<std::exception_ptr>(&r)) std::rethrow_exception(*e);
    return std::move(std::get<DatasetBatch>(r));
  }

 private:
  using Result = std::variant<DatasetBatch, std::exception_ptr>;
  struct Pass {
    std::mutex m;
    std::condition_variable work_cv, ready_cv;
    std::int64_t dispatch = 0;  // next batch a worker takes
    std::int64_t consume = 0;   // next batch the consumer takes
    bool stop = false;
    std::map<std::int64_t, Result> ready;
  };

  // Fetch, collate, pin one batch; any failure names the loader and the batch.
  DatasetBatch produce(std::int64_t b) const {
    try {
      const std::vector<std::int64_t> ids = sampler_->batch_at(b);
      std::vector<Sample> samples;
      samples.reserve(ids.size());
      for (std::int64_t i : ids) samples.push_back(dataset_->get(i));
      DatasetBatch batch = collate_ ? collate_->collate(samples) : stack_each_key(samples);
      batch.sample_ids = ids;
      if (pin_) {
        for (auto& [k, t] : batch.samples) t = t.pin_memory();
        for (auto& [k, t] : batch.targets) t = t.pin_memory();
      }
      return batch;
    } catch (const std::exception& e) {
      throw Error(fmt::format("data_loader '{}': batch {} failed: {}", tag_, b, e.what()));
    }
  }

  void work(Pass& p) const {
    std::unique_lock lk(p.m);
    while (true) {
      p.work_cv.wait(lk, [&] { return p.stop || (p.dispatch < end_ && p.dispatch < p.consume + window_); });
      if (p.stop) return;
      const std::int64_t b = p.dispatch++;
      lk.unlock();
      Result r;
      try {
        r = produce(b);
      } catch (...) {
        r = std::current_exception();
      }
      lk.lock();
      p.ready.emplace(b, std::move(r));
      p.ready_cv.notify_all();
    }
  }

  void stop_workers() {
    if (pass_) {
      {
        std::lock_guard lk(pass_->m);
        pass_->stop = true;
      }
      pass_->work_cv.notify_all();
    }
    for (auto& t : threads_) t.join();
    threads_.clear();
    pass_.reset();
  }

  std::string tag_;
  std::shared_ptr<Dataset> dataset_;
  std::shared_ptr<BatchSampler> sampler_;
  std::shared_ptr<CollateFn> collate_;
  std::int64_t workers_;
  bool pin_;
  std::int64_t window_;
  // Consumer state (the gym's thread only).
  bool started_ = false;
  std::int64_t next_ = 0, end_ = 0;
  std::unique_ptr<Pass> pass_;
  std::vector<std::thread> threads_;
};

}  // namespace

void register_components(Registrar& r) {
  r.add<DataLoader, DataLoaderConfig>(
      "default", "Batches in batch-sampler order, optionally built ahead by worker threads; resumable at any batch.",
      [](const DataLoaderConfig& c, BuildContext& ctx) {
        bool pin = c.pin_memory;
        if (pin && !at::hasCUDA()) {
          ctx.warn("pin_memory = true, but CUDA is not available: batches are not pinned");
          pin = false;
        }
        return std::make_shared<DefaultDataLoader>(c, pin);
      });
}

}  // namespace modalities::plugins::data_loader

MODALITIES_PLUGIN(data_loader, MODALITIES_PLUGIN_VERSION, modalities::plugins::data_loader::register_components)
