// The schedules of the pipeline plugin as plain action lists, for the executor in pipeline.cpp and
// for tests and benchmarks (which check orders and bubble fractions without running a model).
#pragma once

#include <modalities/sdk/registrar.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace modalities {
class DeviceMesh;
class Loss;
class Module;
class Pipeline;
class StagesGenerator;
}  // namespace modalities

namespace modalities::plugins::pipeline {

enum class ScheduleKind { kGPipe, k1F1B, kInterleaved1F1B, kLoopedBFS };

/// One step of a rank's schedule: the forward or backward of `micro_batch` on local stage
/// `local_stage` (global stage rank + local_stage * pp).
struct Action {
  bool forward = true;
  std::int64_t local_stage = 0;
  std::int64_t micro_batch = 0;
  bool operator==(const Action&) const = default;
};

/// The schedule named `name` (gpipe, 1F1B, Interleaved1F1B, LoopedBFS; case-insensitive), if known.
std::optional<ScheduleKind> schedule_kind(const std::string& name);

/// Whether the schedule runs exactly one stage per rank (GPipe, 1F1B).
bool one_stage_per_rank(ScheduleKind kind);

/// The actions of pipeline rank `rank` of `pp`, holding `v` stages, for `m` micro-batches.
std::vector<Action> schedule_actions(ScheduleKind kind, std::int64_t rank, std::int64_t pp, std::int64_t v,
                                     std::int64_t m);

/// The idle fraction of the schedule with equal stage times: (p - 1) / (m + p - 1), and
/// (p - 1) / (v m + p - 1) for interleaved 1F1B with v stages per rank.
double theoretical_bubble(ScheduleKind kind, std::int64_t pp, std::int64_t v, std::int64_t m);

/// An idealized run of a schedule: every stage's forward and backward take 1 / v, transfers are
/// free. `bubble` is the idle fraction of all ranks over the makespan.
struct Timeline {
  double makespan = 0;
  std::vector<double> busy;  // per rank
  double bubble = 0;
};

/// Runs every rank's actions in order (a rank waits for the data its next action needs); nullopt
/// when the ranks wait for each other forever (a schedule that would deadlock).
std::optional<Timeline> simulate(ScheduleKind kind, std::int64_t pp, std::int64_t v, std::int64_t m);

std::string lower(std::string s);

// --- the engine of pipeline/staged, pipeline/scheduled and model/parallelized's `pipeline` ----
// Errors are ConfigErrors naming the fields of pipeline/staged and pipeline/scheduled
// (pp_schedule_name, device_mesh, num_layers_per_stage, microbatch_size).

/// This rank's stages of `whole_model` (pruned clones, stages r, r + pp, ... of the generator's
/// split) over the mesh's pp dim, staged for `schedule_name`; no schedule yet.
std::shared_ptr<Pipeline> stage_model(const std::shared_ptr<Module>& whole_model, const StagesGenerator& generator,
                                      const DeviceMesh& mesh, const std::string& schedule_name,
                                      std::int64_t num_layers_per_stage);

/// The same stages of a stage_model() pipeline running `parts` (their wrapped modules, in order).
std::shared_ptr<Pipeline> with_model_parts(const Pipeline& staged, const std::vector<std::shared_ptr<Module>>& parts);

/// Attaches the schedule `schedule_name` over batch_size / microbatch_size micro-batches, whose
/// last stage computes `loss`.
void attach_schedule(Pipeline& pipeline, std::shared_ptr<Loss> loss, const std::string& schedule_name,
                     std::int64_t batch_size, std::int64_t microbatch_size);

void register_pipeline(Registrar& r);
void register_stages_generator(Registrar& r);

}  // namespace modalities::plugins::pipeline
