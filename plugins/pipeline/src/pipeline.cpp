// Pipeline parallelism (README.md): `pipeline/staged` cuts a whole model into this rank's stages,
// `pipeline/scheduled` attaches a schedule (GPipe, 1F1B, interleaved 1F1B, looped BFS),
// `pipeline/selector` projects stages, model parts or the schedule out of a pipeline, and
// `pipeline/builder` re-assembles one from stages and (wrapped) parts. LibTorch has no pipelining
// runtime: the schedules are action lists run by one executor, activations and gradients cross
// ranks with c10d send/recv on the mesh's pp group (Note [Pipeline transfers]).
#include "pipeline.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/interfaces/loss.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/pipeline.h>
#include <modalities/sdk/interfaces/pipeline_stage.h>
#include <modalities/sdk/interfaces/stages_generator.h>
#include <modalities/sdk/model_parts.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/run_context.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace modalities::plugins::pipeline {

namespace {

using i64 = std::int64_t;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

// One stage of this rank: its global index, its module, and the pp group it talks over.
class Stage final : public PipelineStage {
 public:
  Stage(i64 index, i64 num_stages, std::shared_ptr<Module> part, Group group, i64 pp_rank, i64 pp_size)
      : index_(index),
        num_(num_stages),
        part_(std::move(part)),
        group_(std::move(group)),
        pp_rank_(pp_rank),
        pp_size_(pp_size) {}
  bool is_first() const override { return index_ == 0; }
  bool is_last() const override { return index_ == num_ - 1; }
  std::int64_t stage_index() const override { return index_; }
  std::int64_t num_stages() const override { return num_; }
  std::shared_ptr<Module> submodule() const override { return part_; }

  // The same place in the pipeline, running `part` (a wrapped version of this stage's module).
  std::shared_ptr<Stage> with_part(std::shared_ptr<Module> part) const {
    return std::make_shared<Stage>(index_, num_, std::move(part), group_, pp_rank_, pp_size_);
  }
  const Group& group() const { return group_; }
  i64 pp_rank() const { return pp_rank_; }
  i64 pp_size() const { return pp_size_; }
  i64 owner(i64 stage) const { return stage % pp_size_; }  // the looped layout

 private:
  i64 index_, num_;
  std::shared_ptr<Module> part_;
  Group group_;
  i64 pp_rank_, pp_size_;
};

// Whether this rank holds the first (or last) stage.
bool holds_first(const std::vector<std::shared_ptr<Stage>>& stages) {
  return std::any_of(stages.begin(), stages.end(), [](const auto& s) { return s->is_first(); });
}
bool holds_last(const std::vector<std::shared_ptr<Stage>>& stages) {
  return std::any_of(stages.begin(), stages.end(), [](const auto& s) { return s->is_last(); });
}

class PipelineImpl final : public Pipeline {
 public:
  PipelineImpl(std::vector<std::shared_ptr<Stage>> stages, std::string schedule_name)
      : stages_(std::move(stages)), schedule_name_(std::move(schedule_name)) {}
  std::vector<std::shared_ptr<PipelineStage>> stages() const override { return {stages_.begin(), stages_.end()}; }
  std::vector<std::shared_ptr<Module>> model_parts() const override {
    std::vector<std::shared_ptr<Module>> out;
    for (const auto& s : stages_) out.push_back(s->submodule());
    return out;
  }
  std::shared_ptr<PipelineSchedule> schedule() const override { return schedule_; }
  void set_schedule(std::shared_ptr<PipelineSchedule> schedule) override { schedule_ = std::move(schedule); }
  bool has_first_stage() const override { return holds_first(stages_); }
  bool has_last_stage() const override { return holds_last(stages_); }
  const std::vector<std::shared_ptr<Stage>>& local_stages() const { return stages_; }
  const std::string& schedule_name() const { return schedule_name_; }

 private:
  std::vector<std::shared_ptr<Stage>> stages_;
  std::string schedule_name_;
  std::shared_ptr<PipelineSchedule> schedule_;
};

// Note [Pipeline transfers]
// A stage's output goes to the next stage as a header (int64[12]: rank of the tensor, its
// sizes, its dtype, and how many side losses follow: the count, the bytes of their names, their
// dtype) followed by the tensor, both sent asynchronously (the sends are waited for at the end of
// the step, so a send never blocks the schedule); the receiver blocks on the header, allocates,
// and receives. Gradients go back the same way. Tags name the transfer (micro-batch, stage,
// direction, part), so transfers between the same ranks cannot be confused. Every order the
// schedules produce is deadlock-free when sends do not block and a receive waits only for data
// its sender produces earlier in its own order.
//
// Note [Side losses through the pipeline]
// A stage's outputs other than its prediction are side losses (0-dim floating tensors, e.g. the
// MoE blocks' auxiliary losses): each stage adds its own to those it received, key by key, and
// sends their sum on with its activation (their names, newline-separated, then their values
// stacked); the last stage's loss reads them with the predictions (Loss::compute of a batch, as
// in one process). The received values are a leaf of the stage's graph, so the backward sends
// their gradient back with the activation's, and every stage's side losses get the gradient the
// loss gave their sum.
constexpr i64 kHeader = 12, kMaxDims = 6;

class Executor {
 public:
  Executor(const std::vector<std::shared_ptr<Stage>>& stages, std::shared_ptr<Loss> loss, ScheduleKind kind,
           i64 micro_batches)
      : stages_(stages), loss_(std::move(loss)), kind_(kind), m_(micro_batches) {}

  // PipelineSchedule::set_stage_inputs: given to every stage's forward, per micro-batch.
  void set_stage_inputs(TensorMap inputs) { stage_inputs_ = std::move(inputs); }

  std::vector<at::Tensor> run(const std::optional<at::Tensor>& input, const std::optional<at::Tensor>& target,
                              bool backward, double loss_scale) {
    const Stage& any = *stages_.front();
    const i64 v = static_cast<i64>(stages_.size());
    std::vector<at::Tensor> inputs, targets;
    if (has_first()) {
      if (!input) throw Error("pipeline: the rank holding the first stage needs the model input");
      inputs = split(*input, "input");
    }
    if (has_last()) {
      if (!target) throw Error("pipeline: the rank holding the last stage needs the target");
      targets = split(*target, "target");
    }
    std::map<std::string, std::vector<at::Tensor>> extras;  // the stage inputs, per micro-batch
    for (const auto& [key, t] : stage_inputs_) extras.emplace(key, split(t, key.c_str()));
    std::vector<Action> actions = schedule_actions(kind_, any.pp_rank(), any.pp_size(), v, m_);
    if (!backward) {  // evaluation: the forwards, in schedule order
      std::erase_if(actions, [](const Action& a) { return !a.forward; });
    }
    std::map<std::pair<i64, i64>, Saved> saved;  // (local stage, micro-batch)
    std::vector<at::Tensor> losses(static_cast<std::size_t>(m_));
    sends_.clear();
    const auto step_start = Clock::now();
    double compute_s = 0;  // time in forward and backward computations, transfers excluded
    for (const Action& a : actions) {
      const Stage& st = *stages_[static_cast<std::size_t>(a.local_stage)];
      Saved& s = saved[{a.local_stage, a.micro_batch}];
      if (a.forward) {
        Transfer in;
        if (st.is_first()) {
          in.tensor = inputs[static_cast<std::size_t>(a.micro_batch)];
        } else {
          in = receive(st, st.stage_index() - 1, a.micro_batch, /*gradient=*/false, {});
          if (backward) {
            in.tensor.requires_grad_(true);
            if (in.side.defined()) in.side.requires_grad_(true);
          }
        }
        Module& part = *st.submodule();
        const auto t0 = Clock::now();
        TensorMap stage_in{{part.sample_key(), in.tensor}};
        for (const auto& [key, chunks] : extras) stage_in.emplace(key, chunks[static_cast<std::size_t>(a.micro_batch)]);
        TensorMap out = part.forward(stage_in);
        at::Tensor y = out.at(part.prediction_key());
        TensorMap side = side_losses(in, out, part.prediction_key(), st);
        if (st.is_last()) {
          const at::Tensor& target = targets[static_cast<std::size_t>(a.micro_batch)];
          at::Tensor l;
          // Context parallelism: the stage's predictions cover this rank's tokens of the whole targets.
          std::optional<cp::SequenceShard> tokens = part.sequence_shard();
          if (tokens && !loss_->accepts_sequence_shards())
            throw Error(
                fmt::format("pipeline: the last stage computes this rank's tokens of every sequence "
                            "(context parallelism over {} ranks), and loss '{}' cannot take them",
                            tokens->size, loss_->tag()));
          if (side.empty() && !tokens) {
            l = loss_->compute(y, target);
          } else {
            InferenceResultBatch batch;
            batch.targets.emplace(loss_->target_key(), target);
            batch.predictions = std::move(side);
            batch.predictions.insert_or_assign(part.prediction_key(), y);
            batch.sequence_shard = std::move(tokens);
            batch.vocab_shard = part.vocab_shard();  // loss parallel as well (CP x TP with PP)
            l = loss_->compute(batch);
          }
          losses[static_cast<std::size_t>(a.micro_batch)] = l.detach();
          s.output = l;
          compute_s += seconds_since(t0);
        } else {
          compute_s += seconds_since(t0);
          Transfer t{y.detach(), {}, {}};
          if (!side.empty()) {
            std::vector<at::Tensor> values;
            for (auto& [name, value] : side) {
              t.names.push_back(name);
              values.push_back(value);
            }
            s.side_output = at::stack(values);
            t.side = s.side_output.detach();
          }
          send(st, st.stage_index() + 1, a.micro_batch, /*gradient=*/false, t);
          s.output = y;
        }
        s.input = in.tensor;
        s.side_input = in.side;
      } else {
        if (st.is_last()) {
          // The gradient of the mean over the micro-batches (PyTorch's scale_grads), times the
          // gym's scale (1 / gradient accumulation steps).
          const auto t0 = Clock::now();
          (s.output * (loss_scale / static_cast<double>(m_))).backward();
          compute_s += seconds_since(t0);
        } else {
          const i64 sides = s.side_output.defined() ? s.side_output.numel() : 0;
          const Transfer g = receive(st, st.stage_index() + 1, a.micro_batch, /*gradient=*/true, sides);
          const auto t0 = Clock::now();
          if (sides > 0 && s.side_output.requires_grad())
            torch::autograd::backward({s.output, s.side_output}, {g.tensor, g.side});
          else s.output.backward(g.tensor);
          compute_s += seconds_since(t0);
        }
        if (!st.is_first()) {
          const auto grad_of = [](const at::Tensor& t) {
            at::Tensor g = t.grad();
            return g.defined() ? g : at::zeros_like(t);
          };
          Transfer g{grad_of(s.input), {}, {}};
          if (s.side_input.defined()) g.side = grad_of(s.side_input);
          send(st, st.stage_index() - 1, a.micro_batch, /*gradient=*/true, g);
        }
        s = Saved{};  // free the micro-batch's activations
      }
    }
    for (auto& w : sends_) w->wait();
    sends_.clear();
    keep_.clear();
    // scripts/bench_distributed.sh measures the bubble from these lines: the step's time this rank
    // did not compute (waiting for its neighbours, transfers).
    if (timing_) {
      const double total = seconds_since(step_start);
      std::fprintf(stderr, "pipeline timing: step %.6f s, compute %.6f s, idle fraction %.4f\n", total, compute_s,
                   total > 0 ? 1.0 - compute_s / total : 0.0);
    }
    if (!has_last()) return {};
    return losses;
  }

 private:
  struct Saved {
    at::Tensor input, output;
    at::Tensor side_input, side_output;  // the side losses received and sent (Note [Side losses ...])
  };
  // What crosses from one stage to the next: the activation (or its gradient) and the side losses
  // (their names forward only; their values, or gradients, stacked [n]).
  struct Transfer {
    at::Tensor tensor;
    std::vector<std::string> names;
    at::Tensor side;
  };
  using Clock = std::chrono::steady_clock;
  static double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
  const bool timing_ = std::getenv("MODALITIES_PIPELINE_TIMING") != nullptr;

  bool has_first() const { return holds_first(stages_); }
  bool has_last() const { return holds_last(stages_); }

  // The side losses after stage `st`: those received plus the stage's own outputs other than its
  // prediction, by name (Note [Side losses through the pipeline]).
  static TensorMap side_losses(const Transfer& in, const TensorMap& out, const std::string& prediction_key,
                               const Stage& st) {
    TensorMap side;
    for (std::size_t i = 0; i < in.names.size(); ++i) side.emplace(in.names[i], in.side[static_cast<i64>(i)]);
    for (const auto& [name, value] : out) {
      if (name == prediction_key) continue;
      if (value.dim() != 0 || !value.is_floating_point())
        throw Error(fmt::format(
            "pipeline: stage {} output '{}' is not a 0-dim floating tensor (got {}-dim {}); a stage's outputs "
            "besides its prediction '{}' are side losses carried to the last stage",
            st.stage_index(), name, value.dim(), c10::toString(value.scalar_type()), prediction_key));
      auto it = side.find(name);
      if (it == side.end()) side.emplace(name, value);
      else it->second = it->second + value;
    }
    return side;
  }

  std::vector<at::Tensor> split(const at::Tensor& t, const char* what) const {
    if (t.size(0) % m_ != 0)
      throw Error(fmt::format("pipeline: the {}'s batch of {} samples does not split into {} pipeline micro-batches",
                              what, t.size(0), m_));
    std::vector<at::Tensor> out;
    for (const at::Tensor& c : t.chunk(m_, 0)) out.push_back(c.contiguous());
    return out;
  }

  // part: 0 header, 1 tensor, 2 side-loss names, 3 side-loss values.
  int tag(i64 stage, i64 micro_batch, bool gradient, int part) const {
    const i64 n = stages_.front()->num_stages();
    return static_cast<int>(((micro_batch * n + stage) * 2 + (gradient ? 1 : 0)) * 4 + part);
  }

  void post(const Stage& from, int dst, int tag, const at::Tensor& t) {
    std::vector<at::Tensor> p = {t.contiguous()};
    sends_.push_back(from.group()->send(p, dst, tag));
    keep_.push_back(p.front());
  }

  // Sends `t` from stage `from` (this rank) to stage `to`; the tag names the sending stage.
  void send(const Stage& from, i64 to, i64 micro_batch, bool gradient, const Transfer& t) {
    const int dst = static_cast<int>(from.owner(to));
    const i64 stage = from.stage_index();
    if (dst == from.pp_rank()) {  // both stages on this rank (interleaved): hand it over directly
      local_[{stage, micro_batch, gradient}] =
          Transfer{t.tensor.detach().clone(), t.names, t.side.defined() ? t.side.detach().clone() : at::Tensor()};
      return;
    }
    if (t.tensor.dim() > kMaxDims)
      throw Error(fmt::format("pipeline: stage {} sends a {}-dim tensor; at most {} dims cross stages", stage,
                              t.tensor.dim(), kMaxDims));
    std::string names;
    for (const std::string& n : t.names) names += n + "\n";
    at::Tensor header = at::zeros({kHeader}, at::kLong);
    header[0] = t.tensor.dim();
    for (i64 d = 0; d < t.tensor.dim(); ++d) header[d + 1] = t.tensor.size(d);
    header[7] = static_cast<i64>(t.tensor.scalar_type());
    header[8] = t.side.defined() ? t.side.numel() : 0;
    header[9] = static_cast<i64>(names.size());
    header[10] = t.side.defined() ? static_cast<i64>(t.side.scalar_type()) : 0;
    post(from, dst, tag(stage, micro_batch, gradient, 0), header);
    post(from, dst, tag(stage, micro_batch, gradient, 1), t.tensor);
    if (!names.empty()) {
      const at::Tensor bytes = at::empty({static_cast<i64>(names.size())}, at::kByte);
      std::copy(names.begin(), names.end(), reinterpret_cast<char*>(bytes.data_ptr<std::uint8_t>()));
      post(from, dst, tag(stage, micro_batch, gradient, 2), bytes);
    }
    if (t.side.defined()) post(from, dst, tag(stage, micro_batch, gradient, 3), t.side);
  }

  // Receives what stage `from` sent to `to` (this rank's stage). A gradient carries `sides` side
  // loss gradients, as many as the forward sent (the header must agree).
  Transfer receive(const Stage& to, i64 from, i64 micro_batch, bool gradient, i64 sides) {
    const int src = static_cast<int>(to.owner(from));
    if (src == to.pp_rank()) {
      const auto it = local_.find({from, micro_batch, gradient});
      if (it == local_.end())
        throw Error(
            fmt::format("pipeline: stage {} needs micro-batch {} of stage {} before it was computed (a "
                        "schedule bug)",
                        to.stage_index(), micro_batch, from));
      Transfer t = std::move(it->second);
      local_.erase(it);
      return t;
    }
    const auto recv = [&](at::Tensor t, int part) {
      std::vector<at::Tensor> p = {std::move(t)};
      to.group()->recv(p, src, tag(from, micro_batch, gradient, part))->wait();
      return p.front();
    };
    const at::Tensor header = recv(at::empty({kHeader}, at::kLong), 0);
    const auto* h = header.data_ptr<i64>();
    std::vector<i64> sizes(h + 1, h + 1 + h[0]);
    // The payload lands on the run device (the stages' device; the header is a CPU tensor).
    const auto on_device = [](c10::ScalarType dtype) { return at::TensorOptions().dtype(dtype).device(run_device()); };
    Transfer t;
    t.tensor = recv(at::empty(sizes, on_device(static_cast<c10::ScalarType>(h[7]))), 1);
    const i64 count = h[8], name_bytes = h[9];
    if (gradient && count != sides)
      throw Error(fmt::format("pipeline: stage {} sent gradients of {} side losses for micro-batch {}, not {}", from,
                              count, micro_batch, sides));
    if (name_bytes > 0) {
      const at::Tensor bytes = recv(at::empty({name_bytes}, at::kByte), 2);
      const std::string names(reinterpret_cast<const char*>(bytes.data_ptr<std::uint8_t>()),
                              static_cast<std::size_t>(name_bytes));
      for (std::size_t at = 0, end; (end = names.find('\n', at)) != std::string::npos; at = end + 1)
        t.names.push_back(names.substr(at, end - at));
    }
    if (count > 0) t.side = recv(at::empty({count}, on_device(static_cast<c10::ScalarType>(h[10]))), 3);
    if (!gradient && static_cast<i64>(t.names.size()) != count)
      throw Error(fmt::format("pipeline: stage {} sent {} side losses for micro-batch {} but {} names", from, count,
                              micro_batch, t.names.size()));
    return t;
  }

  std::vector<std::shared_ptr<Stage>> stages_;
  std::shared_ptr<Loss> loss_;
  ScheduleKind kind_;
  i64 m_;
  std::vector<c10::intrusive_ptr<c10d::Work>> sends_;
  TensorMap stage_inputs_;        // PipelineSchedule::set_stage_inputs
  std::vector<at::Tensor> keep_;  // payloads of pending sends
  std::map<std::tuple<i64, i64, bool>, Transfer> local_;
};

class Schedule final : public PipelineSchedule {
 public:
  Schedule(const std::vector<std::shared_ptr<Stage>>& stages, std::shared_ptr<Loss> loss, ScheduleKind kind,
           i64 micro_batches)
      : executor_(stages, std::move(loss), kind, micro_batches) {}
  std::vector<at::Tensor> step(const std::optional<at::Tensor>& input,
                               const std::optional<at::Tensor>& target) override {
    return executor_.run(input, target, /*backward=*/true, loss_scale_);
  }
  std::vector<at::Tensor> eval(const std::optional<at::Tensor>& input,
                               const std::optional<at::Tensor>& target) override {
    at::NoGradGuard no_grad;
    return executor_.run(input, target, /*backward=*/false, 1.0);
  }
  void set_loss_scale(double scale) override { loss_scale_ = scale; }
  void set_stage_inputs(TensorMap inputs) override { executor_.set_stage_inputs(std::move(inputs)); }

 private:
  Executor executor_;
  double loss_scale_ = 1.0;
};

// --- configs ---------------------------------------------------------------------------------

constexpr const char* kScheduleNames = "gpipe, 1F1B, Interleaved1F1B, LoopedBFS";

ScheduleKind parse_schedule(const std::string& name, const char* field) {
  if (const auto k = schedule_kind(name)) return *k;
  const std::string n = lower(name);
  if (n == "zbvzerobubble" || n == "dualpipev" || n == "interleavedzerobubble")
    throw ConfigError(field, fmt::format("the schedule '{}' (zero-bubble / V-shaped) is not implemented; use one of {}",
                                         name, kScheduleNames));
  throw ConfigError(field,
                    fmt::format("unknown schedule '{}'; expected one of {} (case-insensitive)", name, kScheduleNames));
}

struct StagedConfig {
  Ref<Module> whole_model;
  Ref<StagesGenerator> stages_generator;
  Ref<DeviceMesh> device_mesh;
  i64 local_rank = 0;
  std::string pp_schedule_name;
  i64 num_layers_per_stage = 1;
  static void describe(Schema<StagedConfig>& s) {
    s.field("whole_model", &StagedConfig::whole_model,
            "The whole model; each local stage is a copy of it pruned to the stage's modules.")
        .required();
    s.field("stages_generator", &StagedConfig::stages_generator, "Decides which modules each stage holds.").required();
    s.field("device_mesh", &StagedConfig::device_mesh, "Mesh with a pp dim (pipeline_parallel_degree > 1).").required();
    s.field("local_rank", &StagedConfig::local_rank, "This process's local rank (the device on GPUs).")
        .required()
        .at_least(0);
    s.field("pp_schedule_name", &StagedConfig::pp_schedule_name,
            "gpipe or 1F1B (one stage per rank), Interleaved1F1B or LoopedBFS (stages r, r + pp, ... on rank r); "
            "case-insensitive.")
        .required();
    s.field("num_layers_per_stage", &StagedConfig::num_layers_per_stage,
            "Compute weight per stage in blocks; the stages generator derives the number of stages from it.")
        .required()
        .positive();
  }
};

std::shared_ptr<Pipeline> build_staged(const StagedConfig& c) {
  return stage_model(c.whole_model.shared(), *c.stages_generator, *c.device_mesh, c.pp_schedule_name,
                     c.num_layers_per_stage);
}

struct ScheduledConfig {
  Ref<Loss> loss_fn;
  std::string pp_schedule_name;
  i64 batch_size = 1;
  i64 microbatch_size = 1;
  i64 pp_degree = 2;
  Ref<Pipeline> pipeline;
  static void describe(Schema<ScheduledConfig>& s) {
    s.field("loss_fn", &ScheduledConfig::loss_fn, "Loss of the last stage, per pipeline micro-batch.").required();
    s.field("pp_schedule_name", &ScheduledConfig::pp_schedule_name, "The pipeline's schedule (as in pipeline/staged).")
        .required();
    s.field("batch_size", &ScheduledConfig::batch_size, "The local micro-batch size the data loader gives.")
        .required()
        .positive();
    s.field("microbatch_size", &ScheduledConfig::microbatch_size,
            "Samples per pipeline micro-batch; batch_size / microbatch_size micro-batches per step.")
        .required()
        .positive();
    s.field("pp_degree", &ScheduledConfig::pp_degree, "Pipeline ranks (the mesh's pp size).").required().at_least(2);
    s.field("pipeline", &ScheduledConfig::pipeline, "The pipeline to schedule (returned, with the schedule).")
        .required();
  }
};

PipelineImpl& concrete(Pipeline& p, const char* field) {
  auto* impl = dynamic_cast<PipelineImpl*>(&p);
  if (impl == nullptr)
    throw ConfigError(field, "is not a pipeline of this plugin (pipeline/staged or pipeline/builder)");
  return *impl;
}

std::shared_ptr<Pipeline> build_scheduled(const ScheduledConfig& c) {
  PipelineImpl& p = concrete(*c.pipeline, "pipeline");
  if (!p.local_stages().empty() && c.pp_degree != p.local_stages().front()->pp_size())
    throw ConfigError("pp_degree", fmt::format("is {}, but the mesh's pp dim has {} ranks", c.pp_degree,
                                               p.local_stages().front()->pp_size()));
  attach_schedule(p, c.loss_fn.shared(), c.pp_schedule_name, c.batch_size, c.microbatch_size);
  return c.pipeline.shared();
}

// A list of stages, as pipeline/selector with PP_STAGE gives it. In the dry validation, before the
// selector is built, its value is Pending with no kind (the kind follows from selection_type), which
// the codec accepts as pending.
struct StageList {
  std::vector<Ref<PipelineStage>> stages;
};

}  // namespace
}  // namespace modalities::plugins::pipeline

namespace modalities {
template <>
struct Codec<plugins::pipeline::StageList> {
  static std::string type_name() { return "list[Ref<PipelineStage>]"; }
  static Parsed parse(const Value& v, plugins::pipeline::StageList& out, const std::string& path, ParseContext& ctx) {
    if (v.is_pending() && v.as_pending().produces.empty()) return Parsed::kPending;
    return Codec<std::vector<Ref<PipelineStage>>>::parse(v, out.stages, path, ctx);
  }
  static std::string repr(const plugins::pipeline::StageList& l) {
    return fmt::format("<{} stage(s)>", l.stages.size());
  }
  static void annotate(FieldInfo& info) { info.interface = std::string(PipelineStage::kInterface); }
};
}  // namespace modalities

namespace modalities::plugins::pipeline {
namespace {

struct BuilderConfig {
  StageList pp_stages;
  ModelParts model_parts;
  std::optional<Ref<PipelineSchedule>> pp_schedule;
  static void describe(Schema<BuilderConfig>& s) {
    s.field("pp_stages", &BuilderConfig::pp_stages, "This rank's stages (pipeline/selector with PP_STAGE).")
        .required()
        .alias("pp_stage");
    s.field("model_parts", &BuilderConfig::model_parts,
            "The stages' modules, possibly wrapped meanwhile (fsdp2_wrapped, model_initialized), same order.")
        .required()
        .alias("model_part");
    s.field("pp_schedule", &BuilderConfig::pp_schedule,
            "A schedule to attach (usually none: pipeline/scheduled does).");
  }
};

std::shared_ptr<Pipeline> build_builder(const BuilderConfig& c) {
  const auto parts = c.model_parts.shared();
  const auto& in = c.pp_stages.stages;
  if (parts.size() != in.size())
    throw ConfigError("model_parts", fmt::format("has {} part(s) for {} stage(s); give one per stage, in order",
                                                 parts.size(), in.size()));
  std::vector<std::shared_ptr<Stage>> stages;
  std::string name;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    auto* st = dynamic_cast<Stage*>(in[i].get());
    if (st == nullptr) throw ConfigError("pp_stages", "holds a stage that pipeline/staged did not make");
    stages.push_back(st->with_part(parts[i]));
  }
  // The schedule name travels with the stages' pipeline; the builder keeps the staged one's.
  auto out = std::make_shared<PipelineImpl>(std::move(stages), std::string());
  if (c.pp_schedule) out->set_schedule(c.pp_schedule->shared());
  return out;
}

struct SelectorConfig {
  Ref<Pipeline> pipeline;
  std::string selection_type;
  static void describe(Schema<SelectorConfig>& s) {
    s.field("pipeline", &SelectorConfig::pipeline, "The pipeline to project.").required();
    s.field("selection_type", &SelectorConfig::selection_type,
            "PP_STAGE (list of this rank's stages), MODEL_PART (list of their modules) or PP_SCHEDULE (the schedule).")
        .required()
        .one_of({"PP_STAGE", "MODEL_PART", "PP_SCHEDULE"});
  }
};

Value select(const SelectorConfig& c, const std::string& origin) {
  const Pipeline& p = *c.pipeline;
  if (c.selection_type == "PP_SCHEDULE") {
    if (!p.schedule()) throw ConfigError("pipeline", "has no schedule yet (select from pipeline/scheduled's result)");
    return Object{std::string(PipelineSchedule::kInterface), std::static_pointer_cast<void>(p.schedule()), origin};
  }
  Value::List out;
  if (c.selection_type == "PP_STAGE") {
    for (const auto& s : p.stages())
      out.emplace_back(Object{std::string(PipelineStage::kInterface), std::static_pointer_cast<void>(s), origin});
  } else {
    for (const auto& m : p.model_parts())
      out.emplace_back(Object{std::string(Module::kInterface), std::static_pointer_cast<void>(m), origin});
  }
  return out;
}

}  // namespace

// --- the engine (pipeline.h) --------------------------------------------------------------

std::shared_ptr<Pipeline> stage_model(const std::shared_ptr<Module>& whole_model, const StagesGenerator& generator,
                                      const DeviceMesh& mesh, const std::string& schedule_name,
                                      std::int64_t num_layers_per_stage) {
  const ScheduleKind kind = parse_schedule(schedule_name, "pp_schedule_name");
  if (!mesh.has_dim(MeshDim::pp))
    throw ConfigError("device_mesh", fmt::format("has no pp dim (dims: {}); set pipeline_parallel_degree > 1",
                                                 join_mesh_dims(mesh.dims())));
  const i64 pp = mesh.size(MeshDim::pp), rank = mesh.coordinate(MeshDim::pp);
  const std::vector<std::vector<std::string>> fqns = generator.stages(num_layers_per_stage, pp);
  const i64 n = static_cast<i64>(fqns.size());
  if (one_stage_per_rank(kind) && n != pp)
    throw ConfigError("num_layers_per_stage",
                      fmt::format("gives {} stages for {} pipeline ranks, but schedule '{}' runs exactly one stage per "
                                  "rank (raise num_layers_per_stage, or use Interleaved1F1B / LoopedBFS)",
                                  n, pp, schedule_name));
  if (n % pp != 0)
    throw ConfigError("num_layers_per_stage",
                      fmt::format("gives {} stages, not a multiple of the {} pipeline ranks", n, pp));
  const Group group = mesh.process_group(MeshDim::pp);
  std::vector<std::shared_ptr<Stage>> stages;
  for (i64 s = rank; s < n; s += pp) {
    std::shared_ptr<Module> part = whole_model->clone();
    part->retain_modules(fqns[static_cast<std::size_t>(s)]);
    stages.push_back(std::make_shared<Stage>(s, n, std::move(part), group, rank, pp));
  }
  return std::make_shared<PipelineImpl>(std::move(stages), schedule_name);
}

std::shared_ptr<Pipeline> with_model_parts(const Pipeline& staged, const std::vector<std::shared_ptr<Module>>& parts) {
  const auto* impl = dynamic_cast<const PipelineImpl*>(&staged);
  if (impl == nullptr) throw Error("with_model_parts: not a pipeline of stage_model()");
  const auto& in = impl->local_stages();
  if (parts.size() != in.size())
    throw Error(fmt::format("with_model_parts: {} part(s) for {} stage(s)", parts.size(), in.size()));
  std::vector<std::shared_ptr<Stage>> stages;
  for (std::size_t i = 0; i < parts.size(); ++i) stages.push_back(in[i]->with_part(parts[i]));
  return std::make_shared<PipelineImpl>(std::move(stages), impl->schedule_name());
}

void attach_schedule(Pipeline& pipeline, std::shared_ptr<Loss> loss, const std::string& schedule_name,
                     std::int64_t batch_size, std::int64_t microbatch_size) {
  PipelineImpl& p = concrete(pipeline, "pipeline");
  const ScheduleKind kind = parse_schedule(schedule_name, "pp_schedule_name");
  if (!p.schedule_name().empty() && schedule_kind(p.schedule_name()) != kind)  // pipeline/builder's: no name
    throw ConfigError("pp_schedule_name",
                      fmt::format("is '{}', but the pipeline was staged for '{}'", schedule_name, p.schedule_name()));
  const auto& stages = p.local_stages();
  if (stages.empty()) throw ConfigError("pipeline", "has no stage on this rank");
  const i64 pp = stages.front()->pp_size();
  if (batch_size % microbatch_size != 0)
    throw ConfigError("microbatch_size", fmt::format("{} does not divide batch_size {}", microbatch_size, batch_size));
  const i64 m = batch_size / microbatch_size;
  if (kind == ScheduleKind::kInterleaved1F1B && m % pp != 0)
    throw ConfigError("microbatch_size",
                      fmt::format("gives {} pipeline micro-batches (batch_size {} / microbatch_size {}); "
                                  "Interleaved1F1B needs a multiple of the {} pipeline ranks",
                                  m, batch_size, microbatch_size, pp));
  p.set_schedule(std::make_shared<Schedule>(stages, std::move(loss), kind, m));
}

void register_pipeline(Registrar& r) {
  r.add<Pipeline, StagedConfig>(
      "staged", "Cuts a whole model into this rank's pipeline stages (pruned copies); no schedule yet.", build_staged);
  r.add<Pipeline, ScheduledConfig>(
      "scheduled",
      "Attaches a schedule (GPipe, 1F1B, Interleaved1F1B, LoopedBFS) over batch_size / microbatch_size "
      "micro-batches; returns the same pipeline.",
      build_scheduled);
  r.add<Pipeline, BuilderConfig>("builder", "A pipeline from this rank's stages and their (wrapped) modules.",
                                 build_builder);
  // The selector's result is a list of stages, a list of modules or a schedule, by selection_type:
  // registered by hand, as a variant whose output kind is decided when it is built.
  VariantSpec spec = detail::make_spec<SelectorConfig>("pipeline", "selector",
                                                       "Projects this rank's stages, their modules or the schedule "
                                                       "out of a pipeline.",
                                                       "");
  spec.build = [](const Value& config, BuildContext&) -> Value {
    return select(detail::parse_or_throw<SelectorConfig>(config), "pipeline/selector");
  };
  r.add_variant(std::move(spec));
}

}  // namespace modalities::plugins::pipeline
