// Debugging components of Modalities (see README.md): `debugging/settings`,
// `model_debugging_hook/{nan_hook, print_forward_hook}` and `model/debugging_enriched`.
// The hooks attach through Module::add_hook, so they see the model's hookable submodules (the
// root "" and its blocks, e.g. transformer.h.3), in the forward and in the backward pass.
#include <modalities/sdk/distributed.h>
#include <modalities/sdk/interfaces/debugging.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/removable_handle.h>
#include <modalities/sdk/model_parts.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/python_format.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace modalities {
namespace plugins::debugging {

/// `forward_hooks` of debugging/settings: handles, or (nested) lists of them, as the
/// model_debugging_hook nodes produce them (one list per hooked model).
struct HandleLists {
  std::vector<std::shared_ptr<RemovableHandle>> handles;
};

}  // namespace plugins::debugging

template <>
struct Codec<plugins::debugging::HandleLists> {
  using H = plugins::debugging::HandleLists;
  static std::string type_name() { return "list[list[RemovableHandle]]"; }
  static Parsed parse(const Value& v, H& out, const std::string& path, ParseContext& ctx) {
    out.handles.clear();
    return collect(v, out, path, ctx);
  }
  static Parsed collect(const Value& v, H& out, const std::string& path, ParseContext& ctx) {
    if (v.is_pending()) {
      const std::string& p = v.as_pending().produces;
      if (p.empty() || p == "RemovableHandle" || p == "list<RemovableHandle>") return Parsed::kPending;
      ctx.fail(path, fmt::format("expected model_debugging_hook handles, got a component that produces {}", p));
      return Parsed::kError;
    }
    if (v.is_object()) {
      if (v.as_object().interface != RemovableHandle::kInterface) {
        ctx.fail(path, fmt::format("expected model_debugging_hook handles, got a {}", v.as_object().interface));
        return Parsed::kError;
      }
      out.handles.push_back(std::static_pointer_cast<RemovableHandle>(v.as_object().ptr));
      return Parsed::kOk;
    }
    if (!v.is_list()) return detail::type_error(v, "a list of model_debugging_hook references", path, ctx);
    Parsed worst = Parsed::kOk;
    for (std::size_t i = 0; i < v.as_list().size(); ++i) {
      const Parsed r = collect(v.as_list()[i], out, fmt::format("{}[{}]", path, i), ctx);
      if (r == Parsed::kError) worst = Parsed::kError;
      else if (r == Parsed::kPending && worst == Parsed::kOk) worst = Parsed::kPending;
    }
    return worst;
  }
  static std::string repr(const H& h) { return fmt::format("[{} handles]", h.handles.size()); }
};

namespace plugins::debugging {
namespace {

namespace fs = std::filesystem;

std::string where(std::string_view fqn, std::string_view class_name) {
  return fqn.empty() ? fmt::format("the model ({})", class_name) : fmt::format("'{}' ({})", fqn, class_name);
}

std::string shapes(std::span<const at::Tensor> ts) {
  std::string s = "[";
  for (std::size_t i = 0; i < ts.size(); ++i) {
    if (i) s += ", ";
    s += ts[i].defined() ? fmt::format("{} {}", fmt::join(ts[i].sizes(), "x"), c10::toString(ts[i].scalar_type()))
                         : std::string("undefined");
  }
  return s + "]";
}

// Handles of one hook on several model parts, returned as a list Value of RemovableHandle objects.
Value handles_value(const std::vector<std::shared_ptr<RemovableHandle>>& hs, const std::string& origin) {
  Value::List out;
  for (const auto& h : hs)
    out.push_back(Object{std::string(RemovableHandle::kInterface), std::static_pointer_cast<void>(h), origin});
  return out;
}

// ---------------------------------------------------------------------------
// model_debugging_hook/nan_hook

struct NanHookConfig {
  ModelParts model;
  bool raise_exception = false;
  static void describe(Schema<NanHookConfig>& s) {
    s.field("model", &NanHookConfig::model, "Model (or list of pipeline parts) to watch.").required();
    s.field("raise_exception", &NanHookConfig::raise_exception,
            "Stop the run with an error at the first NaN/Inf instead of printing a warning.");
  }
};

// Which of `ts` holds a NaN or an Inf (floating tensors only): "NaN", "Inf" or "".
std::string non_finite(std::span<const at::Tensor> ts, std::size_t* index) {
  for (std::size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    if (!t.defined() || !at::isFloatingType(t.scalar_type())) continue;
    if (at::isfinite(t).all().item<bool>()) continue;
    *index = i;
    return at::isnan(t).any().item<bool>() ? "NaN" : "Inf";
  }
  return "";
}

std::vector<std::shared_ptr<RemovableHandle>> add_nan_hooks(const NanHookConfig& c) {
  std::vector<std::shared_ptr<RemovableHandle>> out;
  for (const auto& part : c.model.shared()) {
    auto forward_calls = std::make_shared<std::atomic<std::int64_t>>(0);
    const bool raise = c.raise_exception;
    ModuleHook hook = [forward_calls, raise](const ModuleHookCall& call) {
      if (call.point == HookPoint::kPreForward) {
        if (call.fqn.empty()) ++*forward_calls;
        return;
      }
      const std::int64_t n = forward_calls->load();
      auto report = [&](std::span<const at::Tensor> ts, std::string_view what) {
        std::size_t i = 0;
        const std::string kind = non_finite(ts, &i);
        if (kind.empty()) return;
        const std::string message = fmt::format(
            "model_debugging_hook/nan_hook: {} in {} {} of {}, forward call {} of this model (the micro-batch "
            "count since the run started){}",
            kind, what, i, where(call.fqn, call.class_name), n,
            dist::world_size() > 1 ? fmt::format(", rank {}", dist::rank()) : "");
        if (raise) throw Error(message);
        std::cerr << "warning: " << message << "\n";
      };
      if (call.point == HookPoint::kForward) {
        report(call.inputs, "input");
        report(call.outputs, "output");
      } else {
        report(call.outputs, "the gradient of output");
      }
    };
    out.push_back(part->add_hook(std::move(hook), {}));
  }
  return out;
}

// ---------------------------------------------------------------------------
// model_debugging_hook/print_forward_hook

struct PrintHookConfig {
  ModelParts model;
  bool print_shape_only = false;
  static void describe(Schema<PrintHookConfig>& s) {
    s.field("model", &PrintHookConfig::model, "Model (or list of pipeline parts) whose forward calls are printed.")
        .required();
    s.field("print_shape_only", &PrintHookConfig::print_shape_only,
            "Print shapes and dtypes only (otherwise also the tensors, summarised as LibTorch prints them).");
  }
};

std::vector<std::shared_ptr<RemovableHandle>> add_print_hooks(const PrintHookConfig& c) {
  std::vector<std::shared_ptr<RemovableHandle>> out;
  for (const auto& part : c.model.shared()) {
    const bool shape_only = c.print_shape_only;
    ModuleHook hook = [shape_only](const ModuleHookCall& call) {
      if (call.point != HookPoint::kForward) return;
      std::ostringstream line;
      line << "Module: " << call.class_name << " '" << call.fqn << "' input: " << shapes(call.inputs)
           << " output: " << shapes(call.outputs) << "\n";
      if (!shape_only) {
        for (const auto& t : call.inputs) line << "input:\n" << t << "\n";
        for (const auto& t : call.outputs) line << "output:\n" << t << "\n";
      }
      std::cout << line.str() << std::flush;
    };
    out.push_back(part->add_hook(std::move(hook), {}));
  }
  return out;
}

// ---------------------------------------------------------------------------
// debugging/settings

struct SettingsConfig {
  HandleLists forward_hooks;
  bool enable_determinism = false;
  static void describe(Schema<SettingsConfig>& s) {
    s.field("forward_hooks", &SettingsConfig::forward_hooks,
            "model_debugging_hook nodes whose hooks live for the run and are removed at its end.");
    s.field("enable_determinism", &SettingsConfig::enable_determinism,
            "Deterministic algorithms only (errors for ops without one), deterministic cuDNN without autotuning, "
            "CUBLAS_WORKSPACE_CONFIG=:4096:8; restored at the end of the run.");
  }
};

class DebugSettings final : public Debugging {
 public:
  explicit DebugSettings(const SettingsConfig& c)
      : handles_(c.forward_hooks.handles), determinism_(c.enable_determinism) {
    if (!determinism_) return;
    auto& ctx = at::globalContext();
    was_deterministic_ = ctx.deterministicAlgorithms();
    was_warn_only_ = ctx.deterministicAlgorithmsWarnOnly();
    was_cudnn_deterministic_ = ctx.deterministicCuDNN();
    was_cudnn_benchmark_ = ctx.benchmarkCuDNN();
    if (const char* v = std::getenv("CUBLAS_WORKSPACE_CONFIG")) cublas_workspace_ = std::string(v);
    ctx.setDeterministicAlgorithms(true, /*warn_only=*/false);
    ctx.setDeterministicCuDNN(true);
    ctx.setBenchmarkCuDNN(false);
    ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 1);
  }
  ~DebugSettings() override {
    for (const auto& h : handles_) h->remove();
    if (!determinism_) return;
    auto& ctx = at::globalContext();
    ctx.setDeterministicAlgorithms(was_deterministic_, was_warn_only_);
    ctx.setDeterministicCuDNN(was_cudnn_deterministic_);
    ctx.setBenchmarkCuDNN(was_cudnn_benchmark_);
    if (cublas_workspace_) ::setenv("CUBLAS_WORKSPACE_CONFIG", cublas_workspace_->c_str(), 1);
    else ::unsetenv("CUBLAS_WORKSPACE_CONFIG");
  }

 private:
  std::vector<std::shared_ptr<RemovableHandle>> handles_;
  bool determinism_;
  bool was_deterministic_ = false, was_warn_only_ = false, was_cudnn_deterministic_ = false,
       was_cudnn_benchmark_ = false;
  std::optional<std::string> cublas_workspace_;
};

// ---------------------------------------------------------------------------
// model/debugging_enriched

struct EnrichedConfig {
  ModelParts model;
  fs::path logging_dir_path;
  std::optional<std::vector<std::int64_t>> tracked_ranks;
  std::int64_t log_interval_steps = 1;
  static void describe(Schema<EnrichedConfig>& s) {
    s.field("model", &EnrichedConfig::model, "Model (or list of pipeline parts); returned as it is, with hooks.")
        .required();
    s.field("logging_dir_path", &EnrichedConfig::logging_dir_path,
            "Folder of tensor_stats_rank_<rank>.jsonl (one line per tensor and hook call).")
        .required()
        .non_empty();
    s.field("tracked_ranks", &EnrichedConfig::tracked_ranks, "Ranks that log; unset: every rank.");
    s.field("log_interval_steps", &EnrichedConfig::log_interval_steps,
            "Each hook logs on its calls number 0, n, 2n, ... (0: every call).")
        .non_negative();
  }
};

// Modalities' TensorStats as one JSON line (json.dumps of the dict, keys in its order).
std::string stats_line(const at::Tensor& t, std::string_view tag, std::string_view hook_type, std::int64_t counter,
                       std::int64_t timestamp_ns) {
  const at::Tensor x = t.detach();
  const auto dtype = x.scalar_type();
  const bool is_float = dtype == at::kFloat || dtype == at::kBFloat16;  // Modalities' {torch.float, torch.bfloat16}
  const bool is_numeric = is_float || dtype == at::kInt || dtype == at::kLong;
  auto number = [&](const at::Tensor& v) {
    if (at::isFloatingType(v.scalar_type())) return py::float_repr(v.item<double>());
    return fmt::format("{}", v.item<std::int64_t>());
  };
  const bool empty = x.numel() == 0;
  const std::string mean = is_float && !empty ? py::float_repr(x.mean().item<double>()) : "-1";
  const std::string stdev = is_float && !empty ? py::float_repr(x.std().item<double>()) : "-1";
  const std::string min = is_numeric && !empty ? number(x.min()) : "-1";
  const std::string max = is_numeric && !empty ? number(x.max()) : "-1";
  const std::int64_t nans = at::isFloatingType(dtype) ? at::isnan(x).sum().item<std::int64_t>() : 0;
  const std::int64_t infs = at::isFloatingType(dtype) ? at::isinf(x).sum().item<std::int64_t>() : 0;
  std::string torch_dtype = "torch." + std::string(c10::toString(dtype));
  // c10 names Float/BFloat16/Long; torch's repr is float32/bfloat16/int64.
  static const std::map<std::string, std::string> names = {
      {"torch.Float", "torch.float32"},  {"torch.BFloat16", "torch.bfloat16"}, {"torch.Half", "torch.float16"},
      {"torch.Double", "torch.float64"}, {"torch.Long", "torch.int64"},        {"torch.Int", "torch.int32"},
      {"torch.Bool", "torch.bool"},      {"torch.Byte", "torch.uint8"},        {"torch.Char", "torch.int8"},
      {"torch.Short", "torch.int16"}};
  if (auto it = names.find(torch_dtype); it != names.end()) torch_dtype = it->second;
  const std::string shape = fmt::format("[{}]", fmt::join(x.sizes(), ", "));
  return fmt::format(
      "{{\"tensor_tag\": {}, \"hook_type\": {}, \"global_shape\": {}, \"local_shape\": {}, \"dtype\": {}, "
      "\"is_dtensor\": false, \"nan_count\": {}, \"inf_count\": {}, \"mean\": {}, \"std\": {}, \"min\": {}, \"max\": "
      "{}, "
      "\"counter\": {}, \"rank\": {}, \"timestamp_ns\": {}}}\n",
      py::json_string(tag), py::json_string(hook_type), shape, shape, py::json_string(torch_dtype), nans, infs, mean,
      stdev, min, max, counter, dist::rank(), timestamp_ns);
}

class StatsLog {
 public:
  explicit StatsLog(fs::path file) : file_(std::move(file)) {}
  void write(const std::string& lines) {
    std::lock_guard lock(mutex_);
    std::FILE* f = std::fopen(file_.c_str(), "ab");
    if (f == nullptr) throw Error(fmt::format("model/debugging_enriched: cannot open '{}'", file_.string()));
    const bool ok = std::fwrite(lines.data(), 1, lines.size(), f) == lines.size();
    if (std::fclose(f) != 0 || !ok)
      throw Error(fmt::format("model/debugging_enriched: cannot write '{}'", file_.string()));
  }

 private:
  fs::path file_;
  std::mutex mutex_;
};

void enrich(const EnrichedConfig& c) {
  const bool tracked = !c.tracked_ranks || std::find(c.tracked_ranks->begin(), c.tracked_ranks->end(),
                                                     static_cast<std::int64_t>(dist::rank())) != c.tracked_ranks->end();
  std::error_code ec;
  fs::create_directories(c.logging_dir_path, ec);
  if (ec)
    throw ConfigError("logging_dir_path",
                      fmt::format("cannot create '{}': {}", c.logging_dir_path.string(), ec.message()));
  if (!tracked) return;
  auto log = std::make_shared<StatsLog>(c.logging_dir_path / fmt::format("tensor_stats_rank_{}.jsonl", dist::rank()));
  const std::int64_t interval = c.log_interval_steps;
  for (const auto& part : c.model.shared()) {
    // Parameters of each hooked submodule: a block's own (recursively), the root's those outside every block.
    const std::vector<std::string> blocks = part->block_fqns();
    auto counters = std::make_shared<std::map<std::pair<int, std::string>, std::int64_t>>();
    auto mutex = std::make_shared<std::mutex>();
    ModuleHook hook = [part = part.get(), blocks, counters, mutex, log, interval](const ModuleHookCall& call) {
      const auto now = std::chrono::steady_clock::now().time_since_epoch();
      const std::int64_t ts = std::chrono::duration_cast<std::chrono::nanoseconds>(now).count();
      std::int64_t counter;
      {
        std::lock_guard lock(*mutex);
        counter = (*counters)[{static_cast<int>(call.point), std::string(call.fqn)}]++;
      }
      if (interval > 0 && counter % interval != 0) return;
      const std::string tag = call.fqn.empty() ? std::string(call.class_name) : std::string(call.fqn);
      std::string lines;
      if (call.point == HookPoint::kPreForward) {
        for (const auto& t : call.inputs)
          if (t.defined()) lines += stats_line(t, tag, "forward_input", counter, ts);
        for (const auto& [name, p] : part->named_parameters()) {
          const bool in_block = std::any_of(blocks.begin(), blocks.end(), [&](const std::string& b) {
            return name.size() > b.size() && name.compare(0, b.size(), b) == 0 && name[b.size()] == '.';
          });
          const bool mine = call.fqn.empty()
                                ? !in_block
                                : name.size() > call.fqn.size() && name.compare(0, call.fqn.size(), call.fqn) == 0 &&
                                      name[call.fqn.size()] == '.';
          if (mine) lines += stats_line(p, call.fqn.empty() ? name : name, "forward_weights", counter, ts);
        }
      } else if (call.point == HookPoint::kForward) {
        for (const auto& t : call.outputs)
          if (t.defined()) lines += stats_line(t, tag, "forward_output", counter, ts);
      } else {
        for (const auto& t : call.outputs)
          if (t.defined()) lines += stats_line(t, tag, "backward_output", counter, ts);
      }
      if (!lines.empty()) log->write(lines);
    };
    part->add_hook(std::move(hook), {});  // lives with the model (as in Modalities)
  }
}

struct EmptyConfig {
  static void describe(Schema<EmptyConfig>&) {}
};

}  // namespace

void register_components(Registrar& r) {
  r.add<Debugging, SettingsConfig>(
      "settings",
      "Keeps model_debugging_hook hooks for the run (removed at its end) and optionally switches to deterministic "
      "algorithms; place it under settings.debugging.",
      [](const SettingsConfig& c) { return std::make_shared<DebugSettings>(c); });
  for (const bool nan : {true, false}) {
    VariantSpec spec = nan ? detail::make_spec<NanHookConfig>(
                                 "model_debugging_hook", "nan_hook",
                                 "Checks every hooked submodule's inputs, outputs and output gradients for NaN/Inf and "
                                 "names the submodule and forward call (warning, or error with raise_exception).",
                                 "list<RemovableHandle>")
                           : detail::make_spec<PrintHookConfig>(
                                 "model_debugging_hook", "print_forward_hook",
                                 "Prints each hooked submodule's forward call: class, name, input and output shapes "
                                 "(and the tensors unless print_shape_only).",
                                 "list<RemovableHandle>");
    if (nan)
      spec.build = [](const Value& config, BuildContext&) -> Value {
        return handles_value(add_nan_hooks(detail::parse_or_throw<NanHookConfig>(config)),
                             "model_debugging_hook/nan_hook");
      };
    else
      spec.build = [](const Value& config, BuildContext&) -> Value {
        return handles_value(add_print_hooks(detail::parse_or_throw<PrintHookConfig>(config)),
                             "model_debugging_hook/print_forward_hook");
      };
    r.add_variant(std::move(spec));
  }
  VariantSpec enriched = detail::make_spec<EnrichedConfig>(
      "model", "debugging_enriched",
      "The model (or list of parts) with hooks that append tensor statistics of every hooked submodule's inputs, "
      "weights, outputs and output gradients to tensor_stats_rank_<rank>.jsonl.",
      std::string(Module::kInterface));
  enriched.build = [](const Value& config, BuildContext&) -> Value {
    enrich(detail::parse_or_throw<EnrichedConfig>(config));
    // The same object(s): the `model` value as given.
    for (const auto& [key, v] : config.as_table())
      if (key == "model") return v;
    throw Error("model/debugging_enriched: no model");
  };
  r.add_variant(std::move(enriched));
}

}  // namespace plugins::debugging
}  // namespace modalities

MODALITIES_PLUGIN(debugging, MODALITIES_PLUGIN_VERSION, modalities::plugins::debugging::register_components)
