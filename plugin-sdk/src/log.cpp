// log.h.
#include <modalities/sdk/distributed.h>
#include <modalities/sdk/log.h>

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>

namespace modalities::log {
namespace {

int world() {
  if (dist::initialized()) return dist::world_size();
  const char* w = std::getenv("WORLD_SIZE");
  return w != nullptr ? std::max(1, std::atoi(w)) : 1;
}

void emit(const std::string& line) {
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
}

}  // namespace

int rank() {
  if (dist::initialized()) return dist::rank();
  const char* r = std::getenv("RANK");
  return r != nullptr ? std::atoi(r) : 0;
}

void warning(std::string_view message) {
  if (rank() == 0) emit(fmt::format("warning: {}\n", message));
}

void info(std::string_view message) {
  if (rank() == 0) emit(fmt::format("{}\n", message));
}

void rank_warning(std::string_view message) {
  emit(world() > 1 ? fmt::format("warning: rank {}: {}\n", rank(), message) : fmt::format("warning: {}\n", message));
}

}  // namespace modalities::log
