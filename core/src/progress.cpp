#include <modalities/core/progress.h>

#include <fmt/core.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace modalities::core {

ProgressBar::ProgressBar(std::string label, std::uint64_t total, std::string unit, double log_interval_s)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      total_(total),
      log_interval_s_(log_interval_s),
      tty_(::isatty(2) != 0),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {
  const char* env = std::getenv("MODALITIES_PROGRESS");
  enabled_ = env == nullptr || std::strcmp(env, "0") != 0;
}

ProgressBar::~ProgressBar() {
  if (!finished_ && drawn_ && tty_) std::fputs("\n", stderr);
}

void ProgressBar::update(std::uint64_t done, const std::string& suffix) {
  if (!enabled_) return;
  std::unique_lock lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock() || finished_) return;
  const auto now = std::chrono::steady_clock::now();
  const double since = std::chrono::duration<double>(now - last_draw_).count();
  if (since < (tty_ ? 0.1 : log_interval_s_)) return;
  last_draw_ = now;
  draw(done, suffix, false);
}

void ProgressBar::finish(const std::string& suffix) {
  if (!enabled_) return;
  std::lock_guard lock(mutex_);
  if (finished_) return;
  finished_ = true;
  draw(total_ != 0 ? total_ : 0, suffix, true);
}

void ProgressBar::draw(std::uint64_t done, const std::string& suffix, bool final) {
  drawn_ = true;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0.0;
  std::string line = label_;
  if (total_ != 0) {
    const double frac = std::min(1.0, static_cast<double>(done) / static_cast<double>(total_));
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(frac * kWidth);
    line += fmt::format(" [{}{}] {:3.0f}% {}/{} {}", std::string(filled, '#'), std::string(kWidth - filled, '-'),
                        frac * 100, human_count(static_cast<double>(done)), human_count(static_cast<double>(total_)),
                        unit_);
  } else {
    line += fmt::format(" {} {}", human_count(static_cast<double>(done)), unit_);
  }
  line += fmt::format(" | {}/s", human_count(rate));
  if (!suffix.empty()) line += " | " + suffix;
  if (final) {
    line += fmt::format(" | {} elapsed", human_duration(elapsed));
  } else if (total_ != 0 && rate > 0) {
    line += fmt::format(" | ETA {}", human_duration(static_cast<double>(total_ - std::min(done, total_)) / rate));
  }
  if (tty_) {
    std::fprintf(stderr, "\r\033[K%s%s", line.c_str(), final ? "\n" : "");
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
}

}  // namespace modalities::core
