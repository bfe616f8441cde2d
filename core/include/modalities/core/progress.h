// A terminal progress bar for long-running work (packing, indexing, training).
// On a terminal it redraws one line on stderr at most ~10 times a second; when
// stderr is not a terminal (CI logs, files) it prints a plain line every
// `log_interval` seconds instead. MODALITIES_PROGRESS=0 silences it.
#pragma once

#include <modalities/sdk/human_format.h>  // human_count, human_duration for the bars

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace modalities::core {

class ProgressBar {
 public:
  /// `total` = 0 means unknown (no percentage or ETA); `unit` names the counted things.
  ProgressBar(std::string label, std::uint64_t total, std::string unit, double log_interval_s = 10.0);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  /// Sets the count done so far and an optional free-text suffix (e.g. "1.2M tok/s").
  /// Thread-safe; cheap when called often (throttled).
  void update(std::uint64_t done, const std::string& suffix = {});
  /// Draws the final state and ends the line.
  void finish(const std::string& suffix = {});

  bool enabled() const { return enabled_; }

 private:
  void draw(std::uint64_t done, const std::string& suffix, bool final);

  std::string label_, unit_;
  std::uint64_t total_;
  double log_interval_s_;
  bool enabled_, tty_;
  bool finished_ = false;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
  std::mutex mutex_;
};

}  // namespace modalities::core
