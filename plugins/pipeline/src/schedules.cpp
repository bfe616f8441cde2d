// Schedules as action lists (pipeline.h): which forward or backward each pipeline rank runs when,
// and an idealized timing of a whole schedule (every stage forward and backward takes the same
// time, transfers are free) from which the bubble fraction is measured.
#include "pipeline.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace modalities::plugins::pipeline {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::optional<ScheduleKind> schedule_kind(const std::string& name) {
  const std::string n = lower(name);
  if (n == "gpipe") return ScheduleKind::kGPipe;
  if (n == "1f1b") return ScheduleKind::k1F1B;
  if (n == "interleaved1f1b") return ScheduleKind::kInterleaved1F1B;
  if (n == "loopedbfs") return ScheduleKind::kLoopedBFS;
  return std::nullopt;
}

bool one_stage_per_rank(ScheduleKind k) { return k == ScheduleKind::kGPipe || k == ScheduleKind::k1F1B; }

// The order in which rank `r` of `p` runs forwards and backwards of `m` micro-batches on its `v`
// local stages (local index l is global stage r + l * p).
std::vector<Action> schedule_actions(ScheduleKind kind, std::int64_t r, std::int64_t p, std::int64_t v,
                                     std::int64_t m) {
  std::vector<Action> out;
  switch (kind) {
    case ScheduleKind::kGPipe:  // every forward, then every backward
      for (std::int64_t i = 0; i < m; ++i) out.push_back({true, 0, i});
      for (std::int64_t i = 0; i < m; ++i) out.push_back({false, 0, i});
      break;
    case ScheduleKind::k1F1B: {  // warm-up forwards, then one forward and one backward, then backwards
      const std::int64_t warmup = std::min(p - r - 1, m);
      std::int64_t f = 0, b = 0;
      for (; f < warmup; ++f) out.push_back({true, 0, f});
      for (; f < m; ++f, ++b) {
        out.push_back({true, 0, f});
        out.push_back({false, 0, b});
      }
      for (; b < m; ++b) out.push_back({false, 0, b});
      break;
    }
    case ScheduleKind::kLoopedBFS:  // each local stage forwards every micro-batch; backwards in reverse
      for (std::int64_t l = 0; l < v; ++l)
        for (std::int64_t i = 0; i < m; ++i) out.push_back({true, l, i});
      for (std::int64_t l = v - 1; l >= 0; --l)
        for (std::int64_t i = 0; i < m; ++i) out.push_back({false, l, i});
      break;
    case ScheduleKind::kInterleaved1F1B: {
      // Megatron-LM's interleaved schedule (m a multiple of p): the k-th forward of this rank is
      // micro-batch (k / (p v)) p + k % p on local stage (k / p) % v; the k-th backward the same
      // micro-batch on local stage v - 1 - (k / p) % v. Warm-up: 2 (p - r - 1) + (v - 1) p forwards.
      const std::int64_t total = m * v;
      const auto micro = [&](std::int64_t k) { return (k / (p * v)) * p + k % p; };
      const auto fwd = [&](std::int64_t k) { return Action{true, (k / p) % v, micro(k)}; };
      const auto bwd = [&](std::int64_t k) { return Action{false, v - 1 - (k / p) % v, micro(k)}; };
      const std::int64_t warmup = std::min(total, 2 * (p - r - 1) + (v - 1) * p);
      std::int64_t f = 0, b = 0;
      for (; f < warmup; ++f) out.push_back(fwd(f));
      for (; f < total; ++f, ++b) {
        out.push_back(fwd(f));
        out.push_back(bwd(b));
      }
      for (; b < total; ++b) out.push_back(bwd(b));
      break;
    }
  }
  return out;
}

double theoretical_bubble(ScheduleKind kind, std::int64_t p, std::int64_t v, std::int64_t m) {
  const double pp = static_cast<double>(p), mm = static_cast<double>(m);
  if (kind == ScheduleKind::kInterleaved1F1B) return (pp - 1) / (static_cast<double>(v) * mm + pp - 1);
  return (pp - 1) / (mm + pp - 1);
}

std::optional<Timeline> simulate(ScheduleKind kind, std::int64_t pp, std::int64_t v, std::int64_t m) {
  // Every rank runs its actions in order; an action starts when the rank is free and its input is
  // there: the forward of stage s needs stage s - 1's forward of the micro-batch, the backward of
  // stage s needs stage s + 1's backward (the last stage: its own forward). A stage's forward and
  // backward each take 1 / v (a rank holds v stages of the model's equal-cost layers).
  const std::int64_t stages = pp * v;
  const double t = 1.0 / static_cast<double>(v);
  std::vector<std::vector<Action>> actions;
  for (std::int64_t r = 0; r < pp; ++r) actions.push_back(schedule_actions(kind, r, pp, v, m));
  std::map<std::tuple<bool, std::int64_t, std::int64_t>, double> done;  // (forward, stage, micro-batch) -> end
  std::vector<std::size_t> next(static_cast<std::size_t>(pp), 0);
  std::vector<double> free(static_cast<std::size_t>(pp), 0.0);
  Timeline out;
  out.busy.assign(static_cast<std::size_t>(pp), 0.0);
  for (bool progress = true; progress;) {
    progress = false;
    for (std::int64_t r = 0; r < pp; ++r) {
      auto& k = next[static_cast<std::size_t>(r)];
      while (k < actions[static_cast<std::size_t>(r)].size()) {
        const Action& a = actions[static_cast<std::size_t>(r)][k];
        const std::int64_t stage = r + a.local_stage * pp;
        std::optional<std::tuple<bool, std::int64_t, std::int64_t>> need;
        if (a.forward && stage > 0) need = {true, stage - 1, a.micro_batch};
        if (!a.forward)
          need = stage == stages - 1 ? std::tuple{true, stage, a.micro_batch}
                                     : std::tuple{false, stage + 1, a.micro_batch};
        double ready = free[static_cast<std::size_t>(r)];
        if (need) {
          const auto it = done.find(*need);
          if (it == done.end()) break;  // blocked on another rank
          ready = std::max(ready, it->second);
        }
        free[static_cast<std::size_t>(r)] = ready + t;
        out.busy[static_cast<std::size_t>(r)] += t;
        done[{a.forward, stage, a.micro_batch}] = ready + t;
        ++k;
        progress = true;
      }
    }
  }
  for (std::int64_t r = 0; r < pp; ++r)
    if (next[static_cast<std::size_t>(r)] < actions[static_cast<std::size_t>(r)].size())
      return std::nullopt;  // deadlock
  out.makespan = *std::max_element(free.begin(), free.end());
  double idle = 0;
  for (double b : out.busy) idle += out.makespan - b;
  out.bubble = idle / (out.makespan * static_cast<double>(pp));
  return out;
}

}  // namespace modalities::plugins::pipeline
