// Exceptions used across the SDK boundary. Plugins throw these (never exit());
// the host adds file, line, config path and plugin provenance when it catches.
// Both classes have their key function in the SDK library, so one typeinfo
// exists process-wide and a plugin's throw is caught by the host's catch.
#pragma once

#include <modalities/sdk/export.h>

#include <fmt/core.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace modalities {

/// Any runtime failure inside a component (I/O, numerics, invariants).
/// Since: SDK 0.1.
class MODALITIES_SDK_API Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message);
  ~Error() override;
};

/// One problem found in a config, relative to the component being validated.
/// `path` is relative to the component's `config` table (e.g. "betas[1]"),
/// or empty for problems with the node itself; the host prefixes it with the
/// node's dotted path and adds the source location.
struct FieldError {
  std::string path;
  std::string message;
  std::string hint;  // optional "did you mean ..." or a pointer to the docs
};

/// A configuration that cannot be built. Carries every problem found, so a
/// user sees all errors of a file at once. Since: SDK 0.1.
class MODALITIES_SDK_API ConfigError : public Error {
 public:
  explicit ConfigError(std::vector<FieldError> errors);
  ConfigError(std::string path, std::string message, std::string hint = {});
  ~ConfigError() override;
  const std::vector<FieldError>& errors() const { return errors_; }

 private:
  std::vector<FieldError> errors_;
};

}  // namespace modalities

/// Throws modalities::Error with a formatted message when `cond` is false.
/// Say what is wrong and show the received value next to the expected one:
///   MODALITIES_CHECK(c.warmup < c.total, "warmup ({}) must be < total ({})", c.warmup, c.total);
#define MODALITIES_CHECK(cond, ...)                                     \
  do {                                                                  \
    if (!(cond)) throw ::modalities::Error(::fmt::format(__VA_ARGS__)); \
  } while (false)
