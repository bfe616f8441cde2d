// modalities/sdk/human_format.h.
#include <modalities/sdk/human_format.h>

#include <fmt/core.h>

#include <cmath>

namespace modalities {

std::string human_count(double v) {
  const double a = std::fabs(v);
  if (a >= 1e9) return fmt::format("{:.2f}G", v / 1e9);
  if (a >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (a >= 1e4) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

std::string human_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<long long>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

}  // namespace modalities
