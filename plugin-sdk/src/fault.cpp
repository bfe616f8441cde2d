// fault.h: parsed once; each point counts its own calls.
#include <modalities/sdk/error.h>
#include <modalities/sdk/fault.h>

#include <fmt/format.h>

#include <atomic>
#include <charconv>
#include <csignal>
#include <cstdlib>
#include <string>

namespace modalities {
namespace {

struct Fault {
  bool armed = false;
  std::string point;
  long long count = 1;
  int signal = SIGKILL;  // 0: "=flag", fault_point() returns true instead
};

long long parse_number(std::string_view text, std::string_view spec) {
  long long v = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < 0)
    throw Error(fmt::format(
        "MODALITIES_FAULT=\"{}\": expected <point>@<rank>[:<n>][=kill|stop|flag] with whole numbers", spec));
  return v;
}

Fault& fault() {
  static Fault f = [] {
    Fault out;
    const char* env = std::getenv("MODALITIES_FAULT");
    if (env == nullptr || *env == '\0') return out;
    const std::string_view spec = env;
    const auto at = spec.find('@');
    if (at == std::string_view::npos || at == 0)
      throw Error(fmt::format("MODALITIES_FAULT=\"{}\": expected <point>@<rank>[:<n>][=kill|stop|flag]", spec));
    std::string_view rest = spec.substr(at + 1);
    if (const auto eq = rest.find('='); eq != std::string_view::npos) {
      const std::string_view action = rest.substr(eq + 1);
      if (action == "stop") out.signal = SIGSTOP;
      else if (action == "flag") out.signal = 0;
      else if (action != "kill")
        throw Error(fmt::format("MODALITIES_FAULT=\"{}\": the action after '=' must be kill, stop or flag", spec));
      rest = rest.substr(0, eq);
    }
    const auto colon = rest.find(':');
    const long long rank = parse_number(rest.substr(0, colon), spec);
    if (colon != std::string_view::npos) out.count = parse_number(rest.substr(colon + 1), spec);
    const char* rank_env = std::getenv("RANK");
    const long long mine = rank_env ? std::atoll(rank_env) : 0;
    out.point = std::string(spec.substr(0, at));
    out.armed = rank == mine;
    return out;
  }();
  return f;
}

}  // namespace

bool fault_point(std::string_view point) {
  static const Fault& f = fault();
  static std::atomic<long long> seen{0};
  if (!f.armed || point != f.point || ++seen != f.count) return false;
  if (f.signal == 0) return true;
  std::raise(f.signal);
  return false;
}

}  // namespace modalities
