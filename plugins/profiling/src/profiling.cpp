// Profiling components of Modalities (see README.md): `dataset_batch_generator/random`,
// `steppable_component/forward_pass` and `steppable_profiler/{no_profiler, kernel_tracing,
// memory_tracing, combined}`. `modalities profile` runs a steppable component under a profiler;
// the training gym takes the same profilers (`profiler` key of a training config).
#include <modalities/sdk/distributed.h>
#include <modalities/sdk/interfaces/dataset_batch_generator.h>
#include <modalities/sdk/interfaces/loss.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/optimizer.h>
#include <modalities/sdk/interfaces/steppable_component.h>
#include <modalities/sdk/interfaces/steppable_profiler.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/run_context.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#if defined(MODALITIES_WITH_CUDA)
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace modalities {
namespace plugins::profiling {

/// `dims` of dataset_batch_generator/random: a table whose values, in document order, are the shape.
struct Dims {
  std::vector<std::pair<std::string, std::int64_t>> entries;
};

}  // namespace plugins::profiling

template <>
struct Codec<plugins::profiling::Dims> {
  using D = plugins::profiling::Dims;
  static std::string type_name() { return "table[string -> int] (ordered)"; }
  static Parsed parse(const Value& v, D& out, const std::string& path, ParseContext& ctx) {
    if (!v.is_table())
      return detail::type_error(v, "a table of dimension sizes, e.g. { batch_size = 8, seq = 256 }", path, ctx);
    out.entries.clear();
    Parsed worst = Parsed::kOk;
    for (const auto& [key, item] : v.as_table()) {
      std::int64_t n = 0;
      const Parsed r = Codec<std::int64_t>::parse(item, n, join_path(path, key), ctx);
      if (r == Parsed::kError) worst = Parsed::kError;
      else if (r == Parsed::kPending && worst == Parsed::kOk) worst = Parsed::kPending;
      else if (r == Parsed::kOk && n < 1) {
        ctx.fail(join_path(path, key), fmt::format("must be at least 1, got {}", n));
        worst = Parsed::kError;
      }
      out.entries.emplace_back(key, n);
    }
    if (worst == Parsed::kOk && out.entries.empty()) {
      ctx.fail(path, "needs at least one dimension");
      return Parsed::kError;
    }
    return worst;
  }
  static std::string repr(const D& d) {
    std::string s = "{";
    for (std::size_t i = 0; i < d.entries.size(); ++i)
      s += (i ? ", " : " ") + d.entries[i].first + " = " + std::to_string(d.entries[i].second);
    return s + (d.entries.empty() ? "}" : " }");
  }
};

namespace plugins::profiling {
namespace {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------
// dataset_batch_generator/random

struct RandomBatchConfig {
  Dims dims;
  std::string data_type;
  std::int64_t min_val = 0, max_val = 0;

  static void describe(Schema<RandomBatchConfig>& s) {
    s.field("dims", &RandomBatchConfig::dims, "Shape of input_ids and target_ids: the values in order.").required();
    s.field("data_type", &RandomBatchConfig::data_type,
            "int64: integers in [min_val, max_val); float32 / bfloat16: uniform in [min_val, max_val).")
        .required()
        .one_of({"float32", "bfloat16", "int64"});
    s.field("min_val", &RandomBatchConfig::min_val, "Lower bound (inclusive).").required();
    s.field("max_val", &RandomBatchConfig::max_val, "Upper bound (exclusive); above min_val.").required();
  }
};

class RandomBatchGenerator final : public DatasetBatchGenerator {
 public:
  explicit RandomBatchGenerator(const RandomBatchConfig& c) : c_(c) {
    if (c.max_val <= c.min_val)
      throw ConfigError("max_val", fmt::format("must be above min_val ({}), got {}", c.min_val, c.max_val));
    for (const auto& [name, n] : c.dims.entries) size_.push_back(n);
  }

  // Modalities' RandomDatasetBatchGenerator: {"input_ids"} and {"target_ids"}, drawn independently,
  // on the run device.
  DatasetBatch dataset_batch() override {
    const auto options = at::TensorOptions().device(run_device());
    auto draw = [&] {
      if (c_.data_type == "int64") return at::randint(c_.min_val, c_.max_val, size_, options.dtype(at::kLong));
      const auto dtype = c_.data_type == "bfloat16" ? at::kBFloat16 : at::kFloat;
      return at::rand(size_, options.dtype(dtype)) * static_cast<double>(c_.max_val - c_.min_val) +
             static_cast<double>(c_.min_val);
    };
    DatasetBatch b;
    b.samples["input_ids"] = draw();
    b.targets["target_ids"] = draw();
    return b;
  }

 private:
  RandomBatchConfig c_;
  std::vector<std::int64_t> size_;
};

// ---------------------------------------------------------------------------
// steppable_component/forward_pass

struct ForwardPassConfig {
  Ref<Module> model;
  Ref<DatasetBatchGenerator> dataset_batch_generator;
  std::optional<Ref<Loss>> loss_fn;
  std::optional<Ref<Optimizer>> optimizer;

  static void describe(Schema<ForwardPassConfig>& s) {
    s.field("model", &ForwardPassConfig::model, "Model whose forward pass is profiled.").required();
    s.field("dataset_batch_generator", &ForwardPassConfig::dataset_batch_generator, "Source of the batches.")
        .required();
    s.field("loss_fn", &ForwardPassConfig::loss_fn, "If set, the loss is computed and backpropagated.");
    s.field("optimizer", &ForwardPassConfig::optimizer,
            "If set (with loss_fn), an optimizer step and zero_grad follow the backward pass.");
  }
};

class ForwardPass final : public SteppableComponent {
 public:
  explicit ForwardPass(const ForwardPassConfig& c) : c_(c) {
    if (c.optimizer && !c.loss_fn)
      throw ConfigError("optimizer", "an optimizer step needs gradients: set loss_fn as well");
  }

  void step() override {
    DatasetBatch batch = c_.dataset_batch_generator->dataset_batch();
    batch.to(run_device());
    InferenceResultBatch result;
    result.predictions = c_.model->forward(batch.samples);
    if (!c_.loss_fn) return;
    result.targets = std::move(batch.targets);
    at::Tensor loss = (*c_.loss_fn)->compute(result);
    loss.backward();
    if (c_.optimizer) {
      (*c_.optimizer)->step();
      (*c_.optimizer)->zero_grad();
    }
  }

 private:
  ForwardPassConfig c_;
};

// ---------------------------------------------------------------------------
// Profilers

class NoProfiler final : public SteppableProfiler {
 public:
  explicit NoProfiler(std::int64_t steps = -1) : steps_(steps) {}
  void enter() override {}
  void step() override {}
  void exit() override {}
  std::int64_t size() const override { return steps_; }

 private:
  std::int64_t steps_;
};

struct Schedule {
  std::int64_t wait = 0, warmup = 0, active = 0;
  std::int64_t total() const { return wait + warmup + active; }
};

template <class C>
void describe_schedule(Schema<C>& s) {
  s.field("num_wait_steps", &C::num_wait_steps, "Steps before anything is recorded.").required().non_negative();
  s.field("num_warmup_steps", &C::num_warmup_steps, "Steps that warm the profiler up (not recorded).")
      .required()
      .non_negative();
  s.field("num_active_steps", &C::num_active_steps, "Steps that are recorded.").required().non_negative();
  s.field("tracked_ranks", &C::tracked_ranks,
          "Ranks that profile; the others run a no-op profiler of the same length. Unset or []: no rank "
          "(as in Modalities).");
}

bool tracked(const std::optional<std::vector<std::int64_t>>& ranks) {
  if (!ranks) return false;
  return std::find(ranks->begin(), ranks->end(), static_cast<std::int64_t>(dist::rank())) != ranks->end();
}

void write_text_atomically(const fs::path& file, const std::string& text) {
  const fs::path tmp = file.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    out << text;
    if (!out) throw Error(fmt::format("cannot write '{}'", tmp.string()));
  }
  fs::rename(tmp, file);
}

// kernel_tracing --------------------------------------------------------------

struct KernelTracingConfig {
  std::int64_t num_wait_steps = 0, num_warmup_steps = 0, num_active_steps = 0;
  std::vector<std::string> profiler_activities;
  bool profile_memory = false, record_shapes = false, with_flops = false, with_stack = false, with_modules = false;
  fs::path output_folder_path;
  std::optional<std::vector<std::int64_t>> tracked_ranks;

  static void describe(Schema<KernelTracingConfig>& s) {
    describe_schedule(s);
    s.field("profiler_activities", &KernelTracingConfig::profiler_activities,
            "What to record: \"CPU\" (operators) and/or \"CUDA\" (kernels; needs a CUDA device).")
        .required();
    s.field("profile_memory", &KernelTracingConfig::profile_memory, "Record tensor allocations.").required();
    s.field("record_shapes", &KernelTracingConfig::record_shapes, "Record input shapes of operators.").required();
    s.field("with_flops", &KernelTracingConfig::with_flops, "Estimate FLOPs of matmuls and convolutions.").required();
    s.field("with_stack", &KernelTracingConfig::with_stack, "Record source stacks (Python frames; none here).")
        .required();
    s.field("with_modules", &KernelTracingConfig::with_modules, "Record the module hierarchy (TorchScript only).")
        .required();
    s.field("output_folder_path", &KernelTracingConfig::output_folder_path,
            "Folder of profiler_trace_ranks_<world>_rank_<rank>.json (Chrome trace: Perfetto, chrome://tracing) and "
            "profiler_summary_ranks_<world>_rank_<rank>.txt (per-operator table).")
        .required()
        .non_empty();
  }
};

// The summary: one table of the operators (CPU events: calls, inclusive time) and, when device
// activity was recorded, one of the kernels and copies (device events), each sorted by total time.
std::string summary_table(const std::vector<torch::autograd::profiler::KinetoEvent>& events, std::int64_t steps) {
  struct Row {
    std::int64_t calls = 0;
    std::uint64_t ns = 0;
  };
  std::map<std::string, Row> cpu, device;
  std::uint64_t cpu_total = 0, device_total = 0;
  for (const auto& e : events) {
    const bool on_cpu = e.deviceType() == c10::DeviceType::CPU;
    Row& r = (on_cpu ? cpu : device)[e.name()];
    ++r.calls;
    r.ns += e.durationNs();
    (on_cpu ? cpu_total : device_total) += e.durationNs();
  }
  auto table = [](const std::map<std::string, Row>& rows, std::uint64_t total, std::string_view title) {
    std::vector<std::pair<std::string, Row>> sorted(rows.begin(), rows.end());
    std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
    std::size_t width = 4;
    for (const auto& [name, r] : sorted) width = std::max(width, std::min<std::size_t>(name.size(), 70));
    const std::string rule(width + 50, '-');
    std::string out = fmt::format("{}\n{}\n{:<{}}  {:>8}  {:>12}  {:>8}  {:>12}\n{}\n", title, rule, "Name", width,
                                  "Calls", "Total", "%", "Avg", rule);
    for (const auto& [name, r] : sorted) {
      const std::string shown = name.size() > width ? name.substr(0, width - 3) + "..." : name;
      out += fmt::format("{:<{}}  {:>8}  {:>9.3f} ms  {:>7.2f}%  {:>9.3f} us\n", shown, width, r.calls, r.ns / 1e6,
                         total ? 100.0 * static_cast<double>(r.ns) / static_cast<double>(total) : 0.0,
                         r.calls ? static_cast<double>(r.ns) / 1e3 / static_cast<double>(r.calls) : 0.0);
    }
    return out + rule + fmt::format("\nTotal: {:.3f} ms\n", total / 1e6);
  };
  std::string out = fmt::format(
      "{} recorded step(s), {} events. Operator times are inclusive (an operator contains the "
      "operators it calls), summed over the recorded steps.\n\n",
      steps, events.size());
  out += table(cpu, cpu_total, "Operators and runtime calls (CPU)");
  if (!device.empty()) out += "\n" + table(device, device_total, "Kernels and copies (device)");
  return out;
}

// Kineto through LibTorch's profiler API, with the wait/warmup/active schedule of
// torch.profiler.schedule: Kineto is prepared when the warmup starts and records from the first
// active step to the last; the trace is written right after the last active step.
class KernelTracing final : public SteppableProfiler {
 public:
  explicit KernelTracing(const KernelTracingConfig& c) : c_(c) {
    s_ = {c.num_wait_steps, c.num_warmup_steps, c.num_active_steps};
    if (c.profiler_activities.empty()) throw ConfigError("profiler_activities", "needs \"CPU\" and/or \"CUDA\"");
    for (const auto& a : c.profiler_activities) {
      if (a == "CPU") activities_.insert(torch::profiler::impl::ActivityType::CPU);
      else if (a == "CUDA") {
        if (!at::hasCUDA())
          throw ConfigError("profiler_activities", "\"CUDA\" needs a CUDA device, and this process has none");
        activities_.insert(torch::profiler::impl::ActivityType::CUDA);
      } else {
        throw ConfigError("profiler_activities",
                          fmt::format("unknown activity '{}' (expected \"CPU\" or \"CUDA\")", a));
      }
    }
    // Kineto probes for GPUs when it starts and logs an ERROR line on machines without one; with
    // only CPU activities that probe is irrelevant, so its log is silenced unless the user set it.
    if (!activities_.contains(torch::profiler::impl::ActivityType::CUDA)) ::setenv("KINETO_LOG_LEVEL", "5", 0);
    const std::string suffix = fmt::format("ranks_{}_rank_{}", dist::world_size(), dist::rank());
    trace_ = c.output_folder_path / fmt::format("profiler_trace_{}.json", suffix);
    summary_ = c.output_folder_path / fmt::format("profiler_summary_{}.txt", suffix);
  }

  ~KernelTracing() override {
    if (recording_) {
      try {
        torch::autograd::profiler::disableProfiler();
      } catch (...) {
      }
    }
  }

  void enter() override {
    if (step_ >= 0) throw Error("steppable_profiler/kernel_tracing: entered twice");
    step_ = 0;
    advance();
  }

  void step() override {
    if (step_ < 0) throw Error("steppable_profiler/kernel_tracing: step() outside enter()/exit()");
    ++step_;
    advance();
  }

  // Leaving early (a training run with fewer steps left than the schedule) keeps what was recorded,
  // as torch.profiler does when it stops: the trace of the active steps so far, with a warning.
  void exit() override {
    if (step_ < 0) throw Error("steppable_profiler/kernel_tracing: exit() without enter()");
    const std::int64_t done = step_;
    step_ = -1;
    if (done >= s_.total()) return;
    if (recording_) {
      auto result = torch::autograd::profiler::disableProfiler();
      recording_ = false;
      write(*result, done - s_.wait - s_.warmup);
      std::cerr << fmt::format(
          "warning: steppable_profiler/kernel_tracing: left after {} of {} steps; the trace holds "
          "the {} active step(s) recorded: {}\n",
          done, s_.total(), done - s_.wait - s_.warmup, trace_.string());
    } else {
      std::cerr << fmt::format(
          "warning: steppable_profiler/kernel_tracing: left after {} of {} steps, before the "
          "first active step (wait {}, warmup {}); no trace was written\n",
          done, s_.total(), s_.wait, s_.warmup);
    }
  }

  std::int64_t size() const override { return s_.total(); }

 private:
  torch::profiler::impl::ProfilerConfig config() const {
    return torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::KINETO, c_.record_shapes,
                                                 c_.profile_memory, c_.with_stack, c_.with_flops, c_.with_modules);
  }

  void advance() {
    if (s_.active == 0) return;
    if (step_ == s_.wait) torch::autograd::profiler::prepareProfiler(config(), activities_);
    if (step_ == s_.wait + s_.warmup) {
      torch::autograd::profiler::enableProfiler(config(), activities_);
      recording_ = true;
    }
    if (step_ == s_.total() && recording_) {
      auto result = torch::autograd::profiler::disableProfiler();
      recording_ = false;
      write(*result, s_.active);
    }
  }

  void write(torch::autograd::profiler::ProfilerResult& result, std::int64_t active_steps) const {
    std::error_code ec;
    fs::create_directories(c_.output_folder_path, ec);
    if (ec)
      throw Error(fmt::format("steppable_profiler/kernel_tracing: cannot create '{}': {}",
                              c_.output_folder_path.string(), ec.message()));
    const fs::path tmp = trace_.string() + ".tmp";
    result.save(tmp.string());
    fs::rename(tmp, trace_);
    write_text_atomically(summary_, summary_table(result.events(), active_steps));
  }

  KernelTracingConfig c_;
  Schedule s_;
  std::set<torch::profiler::impl::ActivityType> activities_;
  fs::path trace_, summary_;
  std::int64_t step_ = -1;
  bool recording_ = false;
};

// memory_tracing --------------------------------------------------------------

struct MemoryTracingConfig {
  std::int64_t num_wait_steps = 0, num_warmup_steps = 0, num_active_steps = 0;
  fs::path memory_snapshot_folder_path;
  std::optional<std::vector<std::int64_t>> tracked_ranks;

  static void describe(Schema<MemoryTracingConfig>& s) {
    describe_schedule(s);
    s.field("memory_snapshot_folder_path", &MemoryTracingConfig::memory_snapshot_folder_path,
            "Folder of memory_snapshot_ranks_<world>_rank_<rank>.pkl (open it at pytorch.org/memory_viz).")
        .required()
        .non_empty();
  }
};

// The CUDA caching allocator's history, recorded from the first active step and dumped as
// PyTorch's pickled snapshot after the last (torch.cuda.memory._snapshot()).
class MemoryTracing final : public SteppableProfiler {
 public:
  explicit MemoryTracing(const MemoryTracingConfig& c) : c_(c) {
    s_ = {c.num_wait_steps, c.num_warmup_steps, c.num_active_steps};
#if !defined(MODALITIES_WITH_CUDA)
    throw ConfigError("memory_snapshot_folder_path",
                      "memory_tracing records the CUDA caching allocator; this build has no CUDA (build with "
                      "scripts/build.sh cuda)");
#else
    if (!at::hasCUDA() || !run_device().is_cuda())
      throw ConfigError("memory_snapshot_folder_path",
                        "memory_tracing records the CUDA caching allocator; the run device is not a CUDA device");
#endif
    file_ = c.memory_snapshot_folder_path /
            fmt::format("memory_snapshot_ranks_{}_rank_{}.pkl", dist::world_size(), dist::rank());
  }

  void enter() override {
    step_ = 0;
    advance();
  }
  void step() override {
    if (step_ < 0) throw Error("steppable_profiler/memory_tracing: step() outside enter()/exit()");
    ++step_;
    advance();
  }
  void exit() override {
    const std::int64_t done = step_;
    step_ = -1;
    if (done >= s_.total()) return;
#if defined(MODALITIES_WITH_CUDA)
    if (done >= s_.wait + s_.warmup && s_.active > 0) torch::cuda::_record_memory_history(std::nullopt);
#endif
    // As Modalities: leaving before the last step is an error (no snapshot).
    throw Error(fmt::format("steppable_profiler/memory_tracing: exited after {} of {} steps; no snapshot was written",
                            done, s_.total()));
  }
  std::int64_t size() const override { return s_.total(); }

 private:
  void advance() {
#if defined(MODALITIES_WITH_CUDA)
    if (s_.active == 0) return;
    if (step_ == s_.wait + s_.warmup)
      torch::cuda::_record_memory_history(std::optional<std::string>("all"), std::optional<std::string>("all"), "all",
                                          100000);
    if (step_ == s_.total()) {
      const std::string pickled = torch::cuda::_memory_snapshot_pickled();
      std::error_code ec;
      fs::create_directories(c_.memory_snapshot_folder_path, ec);
      write_text_atomically(file_, pickled);
      torch::cuda::_record_memory_history(std::nullopt);
    }
#endif
  }

  MemoryTracingConfig c_;
  Schedule s_;
  fs::path file_;
  std::int64_t step_ = -1;
};

// combined ----------------------------------------------------------------------

struct CombinedConfig {
  std::vector<Ref<SteppableProfiler>> profilers;
  static void describe(Schema<CombinedConfig>& s) {
    s.field("profilers", &CombinedConfig::profilers, "Profilers entered, stepped and exited together.").required();
  }
};

class Combined final : public SteppableProfiler {
 public:
  explicit Combined(const CombinedConfig& c, BuildContext& ctx) : c_(c) {
    if (c.profilers.empty()) throw ConfigError("profilers", "needs at least one profiler");
    std::int64_t longest = -1, shortest = -1;
    for (const auto& p : c.profilers) {
      longest = std::max(longest, p->size());
      if (p->size() >= 0) shortest = shortest < 0 ? p->size() : std::min(shortest, p->size());
    }
    size_ = longest;
    if (shortest >= 0 && shortest != longest)
      ctx.warn(
          fmt::format("steppable_profiler/combined: the profilers want {} to {} steps; it runs {} and the "
                      "shorter ones stop early (as in Modalities)",
                      shortest, longest, longest));
  }
  void enter() override {
    for (auto& p : c_.profilers) p->enter();
  }
  void step() override {
    for (auto& p : c_.profilers) p->step();
  }
  void exit() override {
    for (auto& p : c_.profilers) p->exit();
  }
  std::int64_t size() const override { return size_; }

 private:
  CombinedConfig c_;
  std::int64_t size_ = -1;
};

struct EmptyConfig {
  static void describe(Schema<EmptyConfig>&) {}
};

}  // namespace

void register_components(Registrar& r) {
  r.add<DatasetBatchGenerator, RandomBatchConfig>(
      "random", "Random input_ids/target_ids batches of a fixed shape on the run device (for profiling).",
      [](const RandomBatchConfig& c) { return std::make_shared<RandomBatchGenerator>(c); });
  r.add<SteppableComponent, ForwardPassConfig>(
      "forward_pass", "One forward pass on a generated batch; with loss_fn also backward, with optimizer also a step.",
      [](const ForwardPassConfig& c) { return std::make_shared<ForwardPass>(c); });
  r.add<SteppableProfiler, EmptyConfig>("no_profiler", "Does nothing; its length is -1 (no preference).",
                                        [](const EmptyConfig&) { return std::make_shared<NoProfiler>(); });
  r.add<SteppableProfiler, KernelTracingConfig>(
      "kernel_tracing",
      "Kineto operator (and CUDA kernel) trace of the active steps: a Chrome trace and a per-operator table per "
      "tracked rank.",
      [](const KernelTracingConfig& c) -> std::shared_ptr<SteppableProfiler> {
        if (!tracked(c.tracked_ranks))
          return std::make_shared<NoProfiler>(c.num_wait_steps + c.num_warmup_steps + c.num_active_steps);
        return std::make_shared<KernelTracing>(c);
      });
  r.add<SteppableProfiler, MemoryTracingConfig>(
      "memory_tracing", "CUDA caching-allocator history of the active steps as PyTorch's pickled memory snapshot.",
      [](const MemoryTracingConfig& c) -> std::shared_ptr<SteppableProfiler> {
        if (!tracked(c.tracked_ranks))
          return std::make_shared<NoProfiler>(c.num_wait_steps + c.num_warmup_steps + c.num_active_steps);
        return std::make_shared<MemoryTracing>(c);
      });
  r.add<SteppableProfiler, CombinedConfig>(
      "combined", "Several profilers at once; its length is the longest of theirs.",
      [](const CombinedConfig& c, BuildContext& ctx) { return std::make_shared<Combined>(c, ctx); });
}

}  // namespace plugins::profiling
}  // namespace modalities

MODALITIES_PLUGIN(profiling, MODALITIES_PLUGIN_VERSION, modalities::plugins::profiling::register_components)
