// Typed config schemas. A component's config struct declares its keys once,
// in a static `describe(Schema<Config>&)`: name, help, default (the member's
// initial value), constraints, deprecated aliases. The same declaration drives
// `modalities plugins describe`, the validator (dry run before anything is
// built) and the conversion of a config table into the struct that the
// factory receives. Factories never see TOML or Values.
//
//   struct AdamWConfig {
//     Ref<Module> wrapped_model;
//     double lr = 3e-4;
//     static void describe(Schema<AdamWConfig>& s) {
//       s.field("wrapped_model", &AdamWConfig::wrapped_model, "Model to optimize.").required();
//       s.field("lr", &AdamWConfig::lr, "Peak learning rate.").positive();
//     }
//   };
#pragma once

#include <modalities/sdk/error.h>
#include <modalities/sdk/export.h>
#include <modalities/sdk/value.h>

#include <fmt/core.h>

#include <array>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace modalities {

/// Nearest candidate to `word` by edit distance, or "" when nothing is close
/// enough to be a plausible typo. Used for "did you mean" hints.
MODALITIES_SDK_API std::string closest_match(std::string_view word, std::span<const std::string> candidates);
/// "'a', 'b', 'c'" for messages.
MODALITIES_SDK_API std::string quoted_list(std::span<const std::string> items);
/// Formats a double the way TOML would show it (shortest round trip, always with '.' or 'e').
MODALITIES_SDK_API std::string format_float(double x);
/// A TOML basic string literal for `s`. With `escape_interpolation`, a literal
/// "${" is written as "\\${" so that loading the text back keeps it literal.
MODALITIES_SDK_API std::string toml_quote(std::string_view s, bool escape_interpolation = false);

/// Static description of one config key, for `plugins describe`, docs and
/// did-you-mean hints. Filled from the Schema declaration.
struct FieldInfo {
  std::string name;
  std::vector<std::string> aliases;  // deprecated spellings still accepted
  std::string type;                  // "int", "float", "list[int]", "Ref<Module>", ...
  std::string help;
  bool required = false;
  std::string default_repr;              // empty when required
  std::vector<std::string> constraints;  // "> 0", "one of 'a', 'b'", ...
  std::string interface;                 // for Ref fields: the interface name
  std::vector<FieldInfo> children;       // for nested structs
};

/// Collects errors and warnings while a config table is parsed into a struct.
/// In a dry run, `Pending` placeholders stand for components that are not
/// built yet: they are accepted where their produced type fits, and checks
/// that need their value are skipped.
class ParseContext {
 public:
  ParseContext(bool dry_run, std::vector<FieldError>* errors, std::vector<FieldError>* warnings = nullptr)
      : dry_run_(dry_run), errors_(errors), warnings_(warnings) {}
  bool dry_run() const { return dry_run_; }
  void fail(std::string path, std::string message, std::string hint = {}) {
    errors_->push_back({std::move(path), std::move(message), std::move(hint)});
  }
  void warn(std::string path, std::string message) {
    if (warnings_ != nullptr) warnings_->push_back({std::move(path), std::move(message), {}});
  }
  std::size_t error_count() const { return errors_->size(); }

 private:
  bool dry_run_;
  std::vector<FieldError>* errors_;
  std::vector<FieldError>* warnings_;
};

/// Outcome of parsing one value: a concrete value, a Pending placeholder
/// (dry run only), or an error that was already reported.
enum class Parsed { kOk, kPending, kError };

inline std::string join_path(std::string_view base, std::string_view key) {
  if (base.empty()) return std::string(key);
  return fmt::format("{}.{}", base, key);
}
inline std::string index_path(std::string_view base, std::size_t i) { return fmt::format("{}[{}]", base, i); }

/// A typed edge in the component graph: a reference to (or an inline
/// definition of) a component that implements interface `I`. The host builds
/// the target first and checks its interface before the factory runs.
template <class I>
class Ref {
 public:
  Ref() = default;
  Ref(std::shared_ptr<I> ptr, std::string origin) : ptr_(std::move(ptr)), origin_(std::move(origin)) {}
  I* operator->() const { return ptr_.get(); }
  I& operator*() const { return *ptr_; }
  I* get() const { return ptr_.get(); }
  const std::shared_ptr<I>& shared() const { return ptr_; }
  explicit operator bool() const { return static_cast<bool>(ptr_); }
  /// Registry id of the component that produced the target ("model/gpt2").
  const std::string& origin() const { return origin_; }

 private:
  std::shared_ptr<I> ptr_;
  std::string origin_;
};

template <class C>
class Schema;

template <class T>
concept DescribedStruct = requires(Schema<T>& s) {
  T::describe(s);
};

/// Codec<T> converts a Value into a T. Specialisations define:
///   static std::string type_name();
///   static Parsed parse(const Value&, T&, const std::string& path, ParseContext&);
///   static std::string repr(const T&);
///   static void annotate(FieldInfo&) (optional details: interface, children)
template <class T>
struct Codec;

namespace detail {

inline Parsed type_error(const Value& v, std::string_view expected, const std::string& path, ParseContext& ctx) {
  if (v.is_null())  // "null null" says nothing; null usually comes from an unset variable
    ctx.fail(path, fmt::format("expected {}, got null", expected),
             "an unset environment variable (${cuda_env:NAME}) or ${null:} gives null");
  else ctx.fail(path, fmt::format("expected {}, got {} {}", expected, v.type_name(), v.repr()));
  return Parsed::kError;
}

// A Pending placeholder producing `produces` is acceptable where `wanted` is expected.
// An empty `produces` marks a node that already failed validation (unknown
// variant): it fits anywhere, so one mistake is reported once.
inline bool pending_fits(const Value& v, std::initializer_list<std::string_view> wanted) {
  if (!v.is_pending()) return false;
  if (v.as_pending().produces.empty()) return true;
  for (auto w : wanted)
    if (v.as_pending().produces == w) return true;
  return false;
}

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

}  // namespace detail

template <>
struct Codec<bool> {
  static std::string type_name() { return "bool"; }
  static Parsed parse(const Value& v, bool& out, const std::string& path, ParseContext& ctx) {
    if (ctx.dry_run() && detail::pending_fits(v, {"bool"})) return Parsed::kPending;
    if (!v.is_bool()) return detail::type_error(v, "a boolean", path, ctx);
    out = v.as_bool();
    return Parsed::kOk;
  }
  static std::string repr(const bool& b) { return b ? "true" : "false"; }
};

template <class T>
requires(std::integral<T> && !std::same_as<T, bool>) struct Codec<T> {
  static std::string type_name() {
    if constexpr (std::same_as<T, std::int64_t>) return "int";
    else return fmt::format("int ({} to {})", std::numeric_limits<T>::min(), std::numeric_limits<T>::max());
  }
  // Strict: integers only (no float, bool or numeric string), range-checked.
  static Parsed parse(const Value& v, T& out, const std::string& path, ParseContext& ctx) {
    if (ctx.dry_run() && detail::pending_fits(v, {"int"})) return Parsed::kPending;
    if (!v.is_int()) return detail::type_error(v, "an integer", path, ctx);
    const std::int64_t i = v.as_int();
    if (!std::in_range<T>(i)) {
      ctx.fail(path, fmt::format("integer {} is out of range [{}, {}]", i, std::numeric_limits<T>::min(),
                                 std::numeric_limits<T>::max()));
      return Parsed::kError;
    }
    out = static_cast<T>(i);
    return Parsed::kOk;
  }
  static std::string repr(const T& x) { return fmt::format("{}", x); }
};

template <class T>
requires std::floating_point<T>
struct Codec<T> {
  static std::string type_name() { return "float"; }
  // Floats or integers (an integer literal is a valid float), nothing else.
  static Parsed parse(const Value& v, T& out, const std::string& path, ParseContext& ctx) {
    if (ctx.dry_run() && detail::pending_fits(v, {"int", "float"})) return Parsed::kPending;
    if (v.is_float()) out = static_cast<T>(v.as_float());
    else if (v.is_int()) out = static_cast<T>(v.as_int());
    else return detail::type_error(v, "a number", path, ctx);
    return Parsed::kOk;
  }
  static std::string repr(const T& x) { return format_float(static_cast<double>(x)); }
};

template <>
struct Codec<std::string> {
  static std::string type_name() { return "string"; }
  static Parsed parse(const Value& v, std::string& out, const std::string& path, ParseContext& ctx) {
    if (ctx.dry_run() && detail::pending_fits(v, {"string"})) return Parsed::kPending;
    if (!v.is_string()) return detail::type_error(v, "a string", path, ctx);
    out = v.as_string();
    return Parsed::kOk;
  }
  static std::string repr(const std::string& s) { return fmt::format("\"{}\"", s); }
};

template <>
struct Codec<std::filesystem::path> {
  static std::string type_name() { return "path"; }
  static Parsed parse(const Value& v, std::filesystem::path& out, const std::string& path, ParseContext& ctx) {
    if (ctx.dry_run() && detail::pending_fits(v, {"string", "path"})) return Parsed::kPending;
    if (!v.is_string()) return detail::type_error(v, "a path string", path, ctx);
    out = v.as_string();
    return Parsed::kOk;
  }
  static std::string repr(const std::filesystem::path& p) { return fmt::format("\"{}\"", p.string()); }
};

template <class T>
struct Codec<std::optional<T>> {
  static std::string type_name() { return Codec<T>::type_name() + "?"; }
  static Parsed parse(const Value& v, std::optional<T>& out, const std::string& path, ParseContext& ctx) {
    if (v.is_null()) {
      out.reset();
      return Parsed::kOk;
    }
    T inner{};
    const Parsed r = Codec<T>::parse(v, inner, path, ctx);
    if (r == Parsed::kOk) out = std::move(inner);
    return r;
  }
  static std::string repr(const std::optional<T>& x) { return x ? Codec<T>::repr(*x) : "null"; }
  static void annotate(FieldInfo& info) {
    if constexpr (requires { Codec<T>::annotate(info); }) Codec<T>::annotate(info);
  }
};

template <class T>
struct Codec<std::vector<T>> {
  static std::string type_name() { return "list[" + Codec<T>::type_name() + "]"; }
  static Parsed parse(const Value& v, std::vector<T>& out, const std::string& path, ParseContext& ctx) {
    if (!v.is_list()) return detail::type_error(v, "a list", path, ctx);
    out.clear();
    out.reserve(v.as_list().size());
    Parsed worst = Parsed::kOk;
    for (std::size_t i = 0; i < v.as_list().size(); ++i) {
      T item{};
      const Parsed r = Codec<T>::parse(v.as_list()[i], item, index_path(path, i), ctx);
      if (r == Parsed::kError) worst = Parsed::kError;
      else if (r == Parsed::kPending && worst == Parsed::kOk) worst = Parsed::kPending;
      out.push_back(std::move(item));
    }
    return worst;
  }
  static std::string repr(const std::vector<T>& xs) {
    std::string s = "[";
    for (std::size_t i = 0; i < xs.size(); ++i) s += (i ? ", " : "") + Codec<T>::repr(xs[i]);
    return s + "]";
  }
  static void annotate(FieldInfo& info) {
    if constexpr (requires { Codec<T>::annotate(info); }) Codec<T>::annotate(info);
  }
};

template <class T, std::size_t N>
struct Codec<std::array<T, N>> {
  static std::string type_name() { return fmt::format("list[{}] of length {}", Codec<T>::type_name(), N); }
  static Parsed parse(const Value& v, std::array<T, N>& out, const std::string& path, ParseContext& ctx) {
    if (!v.is_list()) return detail::type_error(v, fmt::format("a list of {} elements", N), path, ctx);
    if (v.as_list().size() != N) {
      ctx.fail(path, fmt::format("expected exactly {} elements, got {}", N, v.as_list().size()));
      return Parsed::kError;
    }
    Parsed worst = Parsed::kOk;
    for (std::size_t i = 0; i < N; ++i) {
      const Parsed r = Codec<T>::parse(v.as_list()[i], out[i], index_path(path, i), ctx);
      if (r == Parsed::kError) worst = Parsed::kError;
      else if (r == Parsed::kPending && worst == Parsed::kOk) worst = Parsed::kPending;
    }
    return worst;
  }
  static std::string repr(const std::array<T, N>& xs) {
    std::string s = "[";
    for (std::size_t i = 0; i < N; ++i) s += (i ? ", " : "") + Codec<T>::repr(xs[i]);
    return s + "]";
  }
};

template <class T>
struct Codec<std::map<std::string, T>> {
  static std::string type_name() { return "table[string -> " + Codec<T>::type_name() + "]"; }
  static Parsed parse(const Value& v, std::map<std::string, T>& out, const std::string& path, ParseContext& ctx) {
    if (!v.is_table()) return detail::type_error(v, "a table", path, ctx);
    out.clear();
    Parsed worst = Parsed::kOk;
    for (const auto& [key, item] : v.as_table()) {
      T parsed{};
      const Parsed r = Codec<T>::parse(item, parsed, join_path(path, key), ctx);
      if (r == Parsed::kError) worst = Parsed::kError;
      else if (r == Parsed::kPending && worst == Parsed::kOk) worst = Parsed::kPending;
      out.emplace(key, std::move(parsed));
    }
    return worst;
  }
  static std::string repr(const std::map<std::string, T>& m) {
    std::string s = "{";
    bool first = true;
    for (const auto& [k, x] : m) {
      s += (first ? " " : ", ") + k + " = " + Codec<T>::repr(x);
      first = false;
    }
    return s + (m.empty() ? "}" : " }");
  }
};

// Note [Object identity]
// Type identity (typeid, dynamic_cast) is not reliable across shared objects
// loaded with RTLD_LOCAL, so the engine never relies on it. A factory's result
// is converted to std::shared_ptr<Interface> *before* it is erased to void,
// and tagged with Interface::kInterface. A Ref<I> accepts an Object only when
// the tags are equal, so the static_pointer_cast back is exact.
template <class I>
struct Codec<Ref<I>> {
  static std::string type_name() { return fmt::format("Ref<{}>", I::kInterface); }
  static Parsed parse(const Value& v, Ref<I>& out, const std::string& path, ParseContext& ctx) {
    if (v.is_pending()) {
      if (v.as_pending().produces == I::kInterface || v.as_pending().produces.empty()) return Parsed::kPending;
      ctx.fail(path, fmt::format("expected a {}, but {} produces {}", I::kInterface, v.as_pending().origin,
                                 v.as_pending().produces));
      return Parsed::kError;
    }
    if (v.is_object()) {
      const Object& o = v.as_object();
      if (o.interface == I::kInterface) {
        out = Ref<I>(std::static_pointer_cast<I>(o.ptr), o.origin);
        return Parsed::kOk;
      }
      ctx.fail(path, fmt::format("expected a {}, but {} produces {}", I::kInterface, o.origin, o.interface));
      return Parsed::kError;
    }
    return detail::type_error(
        v,
        fmt::format(
            "a {} (a component node, or a reference {{ instance_key = \"...\", pass_type = \"BY_REFERENCE\" }})",
            I::kInterface),
        path, ctx);
  }
  static std::string repr(const Ref<I>& r) { return r ? "<" + r.origin() + ">" : "null"; }
  static void annotate(FieldInfo& info) { info.interface = std::string(I::kInterface); }
};

/// Declares the keys of config struct C. See the file comment.
template <class C>
class Schema {
 public:
  /// Builder returned by field(); chain constraints and options on it.
  template <class T>
  class FieldBuilder {
   public:
    FieldBuilder(Schema* s, std::size_t index) : s_(s), i_(index) {}
    /// No default: the key must be present.
    FieldBuilder& required() {
      rec().info.required = true;
      rec().info.default_repr.clear();
      return *this;
    }
    /// A deprecated spelling still accepted (with a warning); giving both is an error.
    FieldBuilder& alias(std::string old_name) {
      rec().info.aliases.push_back(std::move(old_name));
      return *this;
    }
    FieldBuilder& positive() {
      return number_check("> 0", [](double x) { return x > 0; });
    }
    FieldBuilder& non_negative() {
      return number_check(">= 0", [](double x) { return x >= 0; });
    }
    FieldBuilder& at_least(double lo) {
      return number_check(">= " + fmt::format("{}", lo), [lo](double x) { return x >= lo; });
    }
    FieldBuilder& at_most(double hi) {
      return number_check("<= " + fmt::format("{}", hi), [hi](double x) { return x <= hi; });
    }
    FieldBuilder& greater_than(double lo) {
      return number_check("> " + fmt::format("{}", lo), [lo](double x) { return x > lo; });
    }
    FieldBuilder& in_closed(double lo, double hi) {
      return number_check(fmt::format("in [{}, {}]", lo, hi), [lo, hi](double x) { return x >= lo && x <= hi; });
    }
    FieldBuilder& in_open(double lo, double hi) {
      return number_check(fmt::format("in ({}, {})", lo, hi), [lo, hi](double x) { return x > lo && x < hi; });
    }
    /// String (or list of strings) restricted to a set of spellings.
    FieldBuilder& one_of(std::vector<std::string> allowed) {
      std::string desc = "one of " + quoted_list(allowed);
      rec().info.constraints.push_back(desc);
      rec().checks.push_back(
          [allowed = std::move(allowed), m = member_](const C& c, const std::string& path, ParseContext& ctx) {
            visit_strings(c.*m, path, [&](const std::string& p, const std::string& s) {
              for (const auto& a : allowed)
                if (a == s) return;
              std::string hint;
              if (auto near = closest_match(s, allowed); !near.empty()) hint = fmt::format("did you mean '{}'?", near);
              ctx.fail(p, fmt::format("must be one of {}, got '{}'", quoted_list(allowed), s), hint);
            });
          });
      return *this;
    }
    /// Path string that must name an existing regular file at validation time.
    FieldBuilder& existing_file() {
      rec().info.constraints.push_back("existing file");
      rec().checks.push_back([m = member_](const C& c, const std::string& path, ParseContext& ctx) {
        visit_strings(c.*m, path, [&](const std::string& p, const std::string& s) {
          std::error_code ec;
          if (!std::filesystem::is_regular_file(s, ec))
            ctx.fail(p, fmt::format("file '{}' does not exist or is not a regular file", s));
        });
      });
      return *this;
    }
    /// A string or list that must not be empty.
    FieldBuilder& non_empty() {
      rec().info.constraints.push_back("not empty");
      rec().checks.push_back([m = member_](const C& c, const std::string& path, ParseContext& ctx) {
        if constexpr (requires { (c.*m).empty(); }) {
          if ((c.*m).empty()) ctx.fail(path, "must not be empty");
        }
      });
      return *this;
    }

   private:
    friend class Schema;
    auto& rec() { return s_->records_[i_]; }  // Record is declared below; the body sees the complete class
    template <class Pred>
    FieldBuilder& number_check(std::string desc, Pred pred) {
      rec().info.constraints.push_back(desc);
      rec().checks.push_back([desc, pred, m = member_](const C& c, const std::string& path, ParseContext& ctx) {
        visit_numbers(c.*m, path, [&](const std::string& p, double x, const std::string& shown) {
          if (!pred(x)) ctx.fail(p, fmt::format("must be {}, got {}", desc, shown));
        });
      });
      return *this;
    }
    Schema* s_;
    std::size_t i_;
    T C::*member_ = nullptr;
  };

  /// Declares key `name` stored in `member`. Its default is the member's value
  /// in a default-constructed C, unless `.required()` is chained.
  template <class T>
  FieldBuilder<T> field(std::string name, T C::*member, std::string help) {
    Record r;
    r.info.name = std::move(name);
    r.info.type = Codec<T>::type_name();
    r.info.help = std::move(help);
    if constexpr (requires(FieldInfo & i) { Codec<T>::annotate(i); }) Codec<T>::annotate(r.info);
    if constexpr (DescribedStruct<T>) r.info.children = Schema<T>::instance().fields();
    static const C defaults{};
    r.info.default_repr = Codec<T>::repr(defaults.*member);
    r.parse = [member](const Value& v, C& out, const std::string& path, ParseContext& ctx) {
      return Codec<T>::parse(v, out.*member, path, ctx);
    };
    records_.push_back(std::move(r));
    FieldBuilder<T> b(this, records_.size() - 1);
    b.member_ = member;
    return b;
  }

  /// Unknown keys are ignored instead of reported (Modalities' Settings
  /// schemas behave like this; component configs never do).
  void ignore_unknown_keys() { ignore_unknown_ = true; }

  /// A rule over several fields, run after every field parsed cleanly.
  /// Report with ctx.fail("<key>", "...") naming the key that should change.
  void rule(std::function<void(const C&, ParseContext&)> check) { rules_.push_back(std::move(check)); }

  /// The schema of C, built once from C::describe.
  static const Schema& instance() {
    static const Schema s = [] {
      Schema built;
      C::describe(built);
      return built;
    }();
    return s;
  }

  std::vector<FieldInfo> fields() const {
    std::vector<FieldInfo> out;
    for (const auto& r : records_) out.push_back(r.info);
    return out;
  }

  /// Parses the table `v` into `out`. Unknown keys, missing required keys,
  /// type errors and constraint violations are all reported (not just the first).
  Parsed parse(const Value& v, C& out, const std::string& path, ParseContext& ctx) const {
    if (!v.is_table()) return detail::type_error(v, "a table", path, ctx);
    const std::size_t errors_before = ctx.error_count();
    std::vector<const Value*> given(records_.size(), nullptr);
    std::vector<std::string> known;
    for (const auto& r : records_) {
      known.push_back(r.info.name);
      for (const auto& a : r.info.aliases) known.push_back(a);
    }
    for (const auto& [key, item] : v.as_table()) {
      bool matched = false;
      for (std::size_t i = 0; i < records_.size() && !matched; ++i) {
        const FieldInfo& info = records_[i].info;
        bool is_alias = false;
        if (info.name != key) {
          for (const auto& a : info.aliases) is_alias = is_alias || a == key;
          if (!is_alias) continue;
        }
        matched = true;
        if (given[i] != nullptr) {
          ctx.fail(join_path(path, key),
                   fmt::format("'{}' and its alias are both given; keep only '{}'", info.name, info.name));
          continue;
        }
        if (is_alias) ctx.warn(join_path(path, key), fmt::format("'{}' is a deprecated alias of '{}'", key, info.name));
        given[i] = &item;
      }
      if (!matched && !ignore_unknown_) {
        std::string hint;
        if (auto near = closest_match(key, known); !near.empty()) hint = fmt::format("did you mean '{}'?", near);
        else if (!known.empty()) hint = "valid keys: " + quoted_list(known);
        ctx.fail(join_path(path, key), "unknown key", hint);
      } else if (!matched) {
        // Tables that allow extra keys (Modalities' settings) still warn about a likely typo: a
        // misspelt enforce_* flag would otherwise switch a check off without a word.
        if (auto near = closest_match(key, known); !near.empty())
          ctx.warn(join_path(path, key), fmt::format("unknown key, ignored; did you mean '{}'?", near));
      }
    }
    std::vector<Parsed> status(records_.size(), Parsed::kOk);
    bool any_pending = false;
    for (std::size_t i = 0; i < records_.size(); ++i) {
      const std::string fpath = join_path(path, records_[i].info.name);
      if (given[i] == nullptr) {
        if (records_[i].info.required) {
          ctx.fail(fpath, fmt::format("missing required key ({}: {})", records_[i].info.type, records_[i].info.help));
          status[i] = Parsed::kError;
        }
        continue;
      }
      status[i] = records_[i].parse(*given[i], out, fpath, ctx);
      any_pending = any_pending || status[i] == Parsed::kPending;
    }
    // Constraints of every field that parsed, even if others failed: all errors at once.
    for (std::size_t i = 0; i < records_.size(); ++i) {
      if (status[i] != Parsed::kOk || given[i] == nullptr) continue;  // defaults are trusted
      for (const auto& check : records_[i].checks) check(out, join_path(path, records_[i].info.name), ctx);
    }
    if (ctx.error_count() != errors_before) return Parsed::kError;
    if (any_pending) return Parsed::kPending;  // rules need every value
    for (const auto& rule : rules_) {
      std::vector<FieldError> local, local_warnings;
      ParseContext rule_ctx(ctx.dry_run(), &local, &local_warnings);
      rule(out, rule_ctx);
      for (auto& e : local) ctx.fail(join_path(path, e.path), std::move(e.message), std::move(e.hint));
      for (auto& w : local_warnings) ctx.warn(join_path(path, w.path), std::move(w.message));
    }
    return ctx.error_count() != errors_before ? Parsed::kError : Parsed::kOk;
  }

 private:
  struct Record {
    FieldInfo info;
    std::function<Parsed(const Value&, C&, const std::string&, ParseContext&)> parse;
    std::vector<std::function<void(const C&, const std::string&, ParseContext&)>> checks;
  };

  // Calls f(path, value, shown) for every number in x (scalars, optionals, lists).
  template <class T, class F>
  static void visit_numbers(const T& x, const std::string& path, F&& f) {
    if constexpr (std::is_arithmetic_v<T> && !std::same_as<T, bool>) {
      if constexpr (std::floating_point<T>) f(path, static_cast<double>(x), format_float(static_cast<double>(x)));
      else f(path, static_cast<double>(x), fmt::format("{}", x));
    } else if constexpr (detail::is_optional<T>::value) {
      if (x) visit_numbers(*x, path, f);
    } else if constexpr (requires {
                           x.size();
                           x[0];
                         } &&
                         !std::same_as<T, std::string>) {
      for (std::size_t i = 0; i < x.size(); ++i) visit_numbers(x[i], index_path(path, i), f);
    }
  }
  template <class T, class F>
  static void visit_strings(const T& x, const std::string& path, F&& f) {
    if constexpr (std::same_as<T, std::string>) {
      f(path, x);
    } else if constexpr (std::same_as<T, std::filesystem::path>) {
      f(path, x.string());
    } else if constexpr (detail::is_optional<T>::value) {
      if (x) visit_strings(*x, path, f);
    } else if constexpr (requires {
                           x.size();
                           x[0];
                         }) {
      for (std::size_t i = 0; i < x.size(); ++i) visit_strings(x[i], index_path(path, i), f);
    }
  }

  std::vector<Record> records_;
  std::vector<std::function<void(const C&, ParseContext&)>> rules_;
  bool ignore_unknown_ = false;
};

/// Nested plain structs (e.g. `attention_config`) are tables with their own schema.
template <DescribedStruct T>
struct Codec<T> {
  static std::string type_name() { return "table"; }
  static Parsed parse(const Value& v, T& out, const std::string& path, ParseContext& ctx) {
    return Schema<T>::instance().parse(v, out, path, ctx);
  }
  static std::string repr(const T&) { return "{...}"; }
};

}  // namespace modalities
