// Out-of-line members of the SDK exception types (their key functions), so
// that exactly one typeinfo exists for each, in libmodalities_sdk.so.
#include <modalities/sdk/error.h>

namespace modalities {

Error::Error(const std::string& message) : std::runtime_error(message) {}
Error::~Error() = default;

namespace {
std::string summarize(const std::vector<FieldError>& errors) {
  std::string s;
  for (const auto& e : errors) {
    if (!s.empty()) s += "\n";
    s += e.path.empty() ? e.message : e.path + ": " + e.message;
    if (!e.hint.empty()) s += " (hint: " + e.hint + ")";
  }
  return s.empty() ? "invalid configuration" : s;
}
}  // namespace

ConfigError::ConfigError(std::vector<FieldError> errors) : Error(summarize(errors)), errors_(std::move(errors)) {}
ConfigError::ConfigError(std::string path, std::string message, std::string hint)
    : ConfigError(std::vector<FieldError>{{std::move(path), std::move(message), std::move(hint)}}) {}
ConfigError::~ConfigError() = default;

}  // namespace modalities
