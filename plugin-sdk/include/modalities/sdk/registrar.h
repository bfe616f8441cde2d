// Registration API. A plugin's register function receives a Registrar and
// declares each (component_key, variant_key) it provides: a typed config
// schema, a factory that receives the validated struct, and the interface (or
// plain value kind) the variant produces. The host implements Registrar; a
// plugin's registrations take effect only if its register function returns
// without throwing (all or nothing).
#pragma once

#include <modalities/sdk/error.h>
#include <modalities/sdk/export.h>
#include <modalities/sdk/schema.h>
#include <modalities/sdk/value.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace modalities {

/// What a factory may ask the host while it builds. Implemented by the host.
/// Since: SDK 0.1. ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API BuildContext {
 public:
  virtual ~BuildContext();
  /// Dotted config path of the node being built, e.g. "train_dataloader.config.sampler".
  virtual std::string_view path() const = 0;
  /// Reports a non-fatal problem; shown with the node's path and source location.
  virtual void warn(std::string message) = 0;
  /// The config table of the node being built, as its factory received it before parsing: what
  /// a factory hands on to build() unchanged. The default (a host without it) is null.
  /// Since: SDK 0.1 (ABI 8).
  virtual const Value& config() const;
  /// Builds another registered variant with `config` (a table of built values, as a factory's
  /// config arrives) and returns what its factory returned: how a factory hands part of its
  /// domain to a variant another plugin registers (model/huggingface_pretrained_model hands the
  /// Mixture-of-Experts families to plugins/moe). Its config errors name this node's config
  /// keys. Throws modalities::Error naming the variant when no loaded plugin registers it. The
  /// default (a host without nested builds) throws. Since: SDK 0.1 (ABI 8).
  virtual Value build(std::string_view component_key, std::string_view variant_key, Value config);
};

/// A registered `${name:argument}` resolver. Returns the substituted value
/// (scalar, list, table or null); throws modalities::Error on bad arguments.
struct ResolverSpec {
  std::string name;
  std::string help;
  std::function<Value(std::string_view argument)> resolve;
};

/// What continues a run from its last checkpoint (`modalities run --resume_from_checkpoint_info`,
/// which `modalities launch --max-restarts` passes): the nodes that replace the run config's
/// `settings.training_progress` and `app_state`, so the same config goes on from the checkpoint
/// instead of starting fresh. The checkpointing plugin registers it (it writes the info file and
/// the checkpoints); the host knows only this hook. Since: SDK 0.1 (ABI 6).
struct ResumedRun {
  std::string checkpoint_folder;  // for the "resuming from ..." line
  Value training_progress;        // the new settings.training_progress table
  Value app_state;                // the new app_state node
};
struct RunResumeSpec {
  std::string help;
  /// `info_file`: the last_checkpoint_info.json the run names (it exists); `app_state`: the run
  /// config's app_state node as written (before interpolation). Throws modalities::Error naming
  /// the file or the node.
  std::function<ResumedRun(const std::string& info_file, const Value& app_state)> resume;
};

/// Type-erased description of one variant, as stored by the host.
struct VariantSpec {
  std::string component_key;
  std::string variant_key;
  std::string summary;
  /// Interface name ("Module", "Optimizer") or plain value kind ("int").
  std::string produces;
  std::vector<FieldInfo> fields;
  /// Parses `config`; in a dry run, Pending placeholders stand for unbuilt components.
  std::function<Parsed(const Value& config, ParseContext& ctx)> validate;
  /// Parses, validates and constructs. Throws ConfigError for invalid
  /// configs and Error (or any exception) for failures of the factory.
  std::function<Value(const Value& config, BuildContext& ctx)> build;

  std::string id() const { return component_key + "/" + variant_key; }
};

namespace detail {
template <class F, class C>
decltype(auto) call_factory(F& f, const C& config, BuildContext& ctx) {
  if constexpr (std::is_invocable_v<F&, const C&, BuildContext&>) return f(config, ctx);
  else return f(config);
}

template <class C>
C parse_or_throw(const Value& config) {
  std::vector<FieldError> errors;
  ParseContext pctx(/*dry_run=*/false, &errors);
  C c{};
  if (Schema<C>::instance().parse(config, c, "", pctx) != Parsed::kOk) throw ConfigError(std::move(errors));
  return c;
}

template <class C>
VariantSpec make_spec(std::string_view component_key, std::string_view variant_key, std::string summary,
                      std::string produces) {
  VariantSpec spec;
  spec.component_key = component_key;
  spec.variant_key = variant_key;
  spec.summary = std::move(summary);
  spec.produces = std::move(produces);
  spec.fields = Schema<C>::instance().fields();
  spec.validate = [](const Value& config, ParseContext& ctx) {
    C c{};
    return Schema<C>::instance().parse(config, c, "", ctx);
  };
  return spec;
}

template <class R>
constexpr std::string_view value_kind() {
  if constexpr (std::is_same_v<R, bool>) return "bool";
  else if constexpr (std::is_integral_v<R>) return "int";
  else if constexpr (std::is_floating_point_v<R>) return "float";
  else if constexpr (std::is_same_v<R, std::string>) return "string";
  else static_assert(sizeof(R) == 0, "add_value supports bool, integers, floating point and std::string");
}
}  // namespace detail

/// Collects a plugin's registrations. Implemented by the host.
/// Since: SDK 0.1. ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API Registrar {
 public:
  virtual ~Registrar();

  virtual void add_variant(VariantSpec spec) = 0;
  virtual void add_resolver(ResolverSpec spec) = 0;
  /// The plugin's example config (configs/example.toml, embedded at build
  /// time); `modalities plugins smoke` builds every variant from it.
  virtual void set_example_config(std::string_view toml) = 0;
  /// Registers how a run continues from a checkpoint (RunResumeSpec); at most one loaded plugin
  /// may. Since: SDK 0.1 (ABI 6).
  virtual void add_run_resume(RunResumeSpec spec) = 0;

  /// Registers a variant producing interface I under I::kComponentKey.
  /// `factory(const Config&)` or `factory(const Config&, BuildContext&)`
  /// returns std::shared_ptr<T> with T derived from I.
  template <class I, class Config, class Factory>
  void add(std::string_view variant_key, std::string summary, Factory factory) {
    add<I, Config>(I::kComponentKey, variant_key, std::move(summary), std::move(factory));
  }

  /// Same, under an explicit component key (e.g. "layer_norm" producing a Module).
  template <class I, class Config, class Factory>
  void add(std::string_view component_key, std::string_view variant_key, std::string summary, Factory factory) {
    VariantSpec spec =
        detail::make_spec<Config>(component_key, variant_key, std::move(summary), std::string(I::kInterface));
    std::string origin = spec.id();
    spec.build = [factory = std::move(factory), origin](const Value& config, BuildContext& ctx) mutable -> Value {
      const Config c = detail::parse_or_throw<Config>(config);
      std::shared_ptr<I> obj = detail::call_factory(factory, c, ctx);  // converts to the interface first
      if (!obj) throw Error(fmt::format("factory of {} returned no object", origin));
      return Object{std::string(I::kInterface), std::static_pointer_cast<void>(std::move(obj)), origin};
    };
    add_variant(std::move(spec));
  }

  /// Registers a variant whose result is a plain value (bool, integer, float,
  /// string), e.g. the `number_conversion` family producing integers.
  template <class R, class Config, class Function>
  void add_value(std::string_view component_key, std::string_view variant_key, std::string summary, Function fn) {
    VariantSpec spec =
        detail::make_spec<Config>(component_key, variant_key, std::move(summary), std::string(detail::value_kind<R>()));
    spec.build = [fn = std::move(fn)](const Value& config, BuildContext& ctx) mutable -> Value {
      const Config c = detail::parse_or_throw<Config>(config);
      R r = detail::call_factory(fn, c, ctx);
      if constexpr (std::is_integral_v<R> && !std::is_same_v<R, bool>) return Value(static_cast<std::int64_t>(r));
      else if constexpr (std::is_floating_point_v<R>) return Value(static_cast<double>(r));
      else return Value(std::move(r));
    };
    add_variant(std::move(spec));
  }

  /// Registers `${name:argument}`.
  void resolver(std::string name, std::string help, std::function<Value(std::string_view)> fn) {
    add_resolver(ResolverSpec{std::move(name), std::move(help), std::move(fn)});
  }
};

}  // namespace modalities
