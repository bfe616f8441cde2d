// The seven `scheduler` variants (README.md): Modalities' DummyLRScheduler,
// PyTorch's StepLR, ConstantLR, LinearLR, OneCycleLR and CosineAnnealingLR, and Modalities'
// linear warmup + cosine factory (LinearLR and CosineAnnealingLR inside a SequentialLR).
// PyTorch's mechanics are re-created exactly, so the learning rates are bit-identical: the
// constructor's initial step, `initial_lr` kept in the optimizer's groups, resume with
// last_epoch >= 0, the recursive ("chainable") rules with PyTorch's operation order, the
// closed forms used when SequentialLR jumps to a milestone, and the state dict attributes.
#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/lr_scheduler.h>
#include <modalities/sdk/interfaces/optimizer.h>
#include <modalities/sdk/plugin.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numbers>
#include <optional>
#include <string>
#include <vector>

namespace modalities::plugins::schedulers {

/// A float or one float per optimizer group (OneCycle's max_lr, base_momentum, max_momentum).
struct FloatOrList {
  std::vector<double> values;
  bool is_list = false;
};

}  // namespace modalities::plugins::schedulers

namespace modalities {

template <>
struct Codec<plugins::schedulers::FloatOrList> {
  static std::string type_name() { return "float | list[float]"; }
  static Parsed parse(const Value& v, plugins::schedulers::FloatOrList& out, const std::string& path,
                      ParseContext& ctx) {
    out.is_list = v.is_list();
    if (out.is_list) {
      if (v.as_list().empty()) {
        ctx.fail(path, "expected a number or a non-empty list of numbers (one per optimizer group), got an empty list");
        return Parsed::kError;
      }
      return Codec<std::vector<double>>::parse(v, out.values, path, ctx);
    }
    out.values.assign(1, 0.0);
    return Codec<double>::parse(v, out.values[0], path, ctx);
  }
  static std::string repr(const plugins::schedulers::FloatOrList& x) {
    return x.is_list          ? Codec<std::vector<double>>::repr(x.values)
           : x.values.empty() ? "null"
                              : format_float(x.values[0]);
  }
};

}  // namespace modalities

namespace modalities::plugins::schedulers {
namespace {

constexpr double kPi = std::numbers::pi;  // == math.pi

at::Tensor int_tensor(std::int64_t x) { return at::scalar_tensor(x, at::kLong); }
at::Tensor double_tensor(double x) { return at::scalar_tensor(x, at::kDouble); }
at::Tensor doubles_tensor(const std::vector<double>& xs) {
  return at::tensor(at::ArrayRef<double>(xs), at::TensorOptions().dtype(at::kDouble)).clone();
}

const at::Tensor& entry(const StateDict& state, const std::string& key) {
  auto it = state.find(key);
  MODALITIES_CHECK(it != state.end() && it->second.defined(), "scheduler state dict: missing '{}'", key);
  return it->second;
}
std::int64_t int_entry(const StateDict& s, const std::string& key) {
  const at::Tensor& t = entry(s, key);
  MODALITIES_CHECK(t.numel() == 1, "scheduler state dict: '{}' must hold one number", key);
  return t.item<std::int64_t>();
}
double double_entry(const StateDict& s, const std::string& key) {
  const at::Tensor& t = entry(s, key);
  MODALITIES_CHECK(t.numel() == 1, "scheduler state dict: '{}' must hold one number", key);
  return t.item<double>();
}
std::vector<double> doubles_entry(const StateDict& s, const std::string& key, std::size_t n) {
  const at::Tensor t = entry(s, key).to(at::kDouble).contiguous().reshape(-1);
  MODALITIES_CHECK(static_cast<std::size_t>(t.numel()) == n, "scheduler state dict: '{}' has {} values, expected {}",
                   key, t.numel(), n);
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + n);
}

// torch.optim.lr_scheduler.LRScheduler. Subclasses set their attributes, then the factory
// calls start() (PyTorch's __init__ tail: initial_lr bookkeeping and the initial step).
class Scheduler : public LRScheduler {
 public:
  explicit Scheduler(std::shared_ptr<Optimizer> optimizer) : optimizer_(std::move(optimizer)) {}

  // LRScheduler.__init__ after the subclass attributes: `initial_lr` and the initial step.
  void start(std::int64_t last_epoch) {
    const std::size_t n = optimizer_->num_param_groups();
    if (last_epoch == -1) {
      for (std::size_t g = 0; g < n; ++g)
        if (!optimizer_->group_option(g, "initial_lr"))
          optimizer_->set_group_option(g, "initial_lr", optimizer_->learning_rates()[g]);
    } else {
      for (std::size_t g = 0; g < n; ++g)
        if (!optimizer_->group_option(g, "initial_lr"))
          throw ConfigError(
              "last_epoch",
              fmt::format("resuming with last_epoch = {} needs 'initial_lr' in every optimizer group, but "
                          "group {} has none: load the optimizer state first, or use last_epoch = -1",
                          last_epoch, g));
    }
    base_lrs_.clear();
    for (std::size_t g = 0; g < n; ++g) base_lrs_.push_back(*optimizer_->group_option(g, "initial_lr"));
    last_epoch_ = last_epoch;
    initial_step();
  }

  void initial_step() {
    step_count_ = 0;
    is_initial_ = true;
    step();
    is_initial_ = false;
  }

  void step() override {
    ++step_count_;
    update_lr(std::nullopt);
  }

  // LRScheduler._update_lr: the recursive rule, or the closed form when jumped to `epoch`.
  void update_lr(std::optional<std::int64_t> epoch) {
    std::vector<double> values;
    if (!epoch) {
      ++last_epoch_;
      values = get_lr();
    } else {
      last_epoch_ = *epoch;
      auto closed = closed_form_lr();
      values = closed ? *closed : get_lr();
    }
    for (std::size_t g = 0; g < values.size(); ++g) optimizer_->set_learning_rate(g, values[g]);
    last_lr_ = optimizer_->learning_rates();
  }

  std::vector<double> last_lrs() const override { return last_lr_; }

  StateDict state_dict() const override {
    StateDict out;
    out.emplace("last_epoch", int_tensor(last_epoch_));
    out.emplace("_step_count", int_tensor(step_count_));
    out.emplace("base_lrs", doubles_tensor(base_lrs_));
    out.emplace("_last_lr", doubles_tensor(last_lr_));
    add_attributes(out);
    return out;
  }

  // Like PyTorch's __dict__.update: every attribute, hyper-parameters included, comes from the state.
  void load_state_dict(const StateDict& state) override {
    const StateDict own = state_dict();
    for (const auto& [key, _] : state)
      MODALITIES_CHECK(own.contains(key), "scheduler state dict: unexpected key '{}' (is it from another variant?)",
                       key);
    const std::size_t n = optimizer_->num_param_groups();
    last_epoch_ = int_entry(state, "last_epoch");
    step_count_ = int_entry(state, "_step_count");
    base_lrs_ = doubles_entry(state, "base_lrs", n);
    last_lr_ = doubles_entry(state, "_last_lr", n);
    load_attributes(state);
  }

  std::int64_t last_epoch() const { return last_epoch_; }
  void set_last_epoch(std::int64_t e) { last_epoch_ = e; }

 protected:
  // get_lr() of the subclass; reads last_epoch_, is_initial_, the groups' current rates.
  virtual std::vector<double> get_lr() = 0;
  // _get_closed_form_lr(), where PyTorch defines one.
  virtual std::optional<std::vector<double>> closed_form_lr() { return std::nullopt; }
  virtual void add_attributes(StateDict&) const {}
  virtual void load_attributes(const StateDict&) {}

  std::vector<double> group_lrs() const { return optimizer_->learning_rates(); }
  std::size_t num_groups() const { return optimizer_->num_param_groups(); }

  std::shared_ptr<Optimizer> optimizer_;
  std::int64_t last_epoch_ = -1;
  std::int64_t step_count_ = 0;
  std::vector<double> base_lrs_;
  std::vector<double> last_lr_;
  bool is_initial_ = false;
};

template <class S, class... Args>
std::shared_ptr<S> make_started(std::int64_t last_epoch, Args&&... args) {
  auto s = std::make_shared<S>(std::forward<Args>(args)...);
  s->start(last_epoch);
  return s;
}

// --- dummy_lr -------------------------------------------------------------------------------------

class DummyLR final : public Scheduler {
 public:
  using Scheduler::Scheduler;

 protected:
  std::vector<double> get_lr() override { return group_lrs(); }
  std::optional<std::vector<double>> closed_form_lr() override { return base_lrs_; }
};

// --- step_lr --------------------------------------------------------------------------------------

class StepLR final : public Scheduler {
 public:
  StepLR(std::shared_ptr<Optimizer> o, std::int64_t step_size, double gamma)
      : Scheduler(std::move(o)), step_size_(step_size), gamma_(gamma) {}

 protected:
  std::vector<double> get_lr() override {
    std::vector<double> lrs = group_lrs();
    if (last_epoch_ == 0 || last_epoch_ % step_size_ != 0) return lrs;
    for (double& lr : lrs) lr = lr * gamma_;
    return lrs;
  }
  std::optional<std::vector<double>> closed_form_lr() override {
    std::vector<double> out;
    for (double base : base_lrs_) out.push_back(base * std::pow(gamma_, static_cast<double>(last_epoch_ / step_size_)));
    return out;
  }
  void add_attributes(StateDict& s) const override {
    s.emplace("step_size", int_tensor(step_size_));
    s.emplace("gamma", double_tensor(gamma_));
  }
  void load_attributes(const StateDict& s) override {
    step_size_ = int_entry(s, "step_size");
    gamma_ = double_entry(s, "gamma");
  }

 private:
  std::int64_t step_size_;
  double gamma_;
};

// --- constant_lr ----------------------------------------------------------------------------------

class ConstantLR final : public Scheduler {
 public:
  ConstantLR(std::shared_ptr<Optimizer> o, double factor, std::int64_t total_iters)
      : Scheduler(std::move(o)), factor_(factor), total_iters_(total_iters) {}

 protected:
  std::vector<double> get_lr() override {
    std::vector<double> lrs = group_lrs();
    if (last_epoch_ == 0) {
      for (double& lr : lrs) lr = lr * factor_;
      return lrs;
    }
    if (last_epoch_ != total_iters_) return lrs;
    // factor 0: PyTorch divides by zero here; the closed form gives the base rate back instead.
    if (factor_ == 0.0) return *closed_form_lr();
    for (double& lr : lrs) lr = lr * (1.0 / factor_);
    return lrs;
  }
  std::optional<std::vector<double>> closed_form_lr() override {
    std::vector<double> out;
    for (double base : base_lrs_)
      out.push_back(base * (factor_ + static_cast<double>(last_epoch_ >= total_iters_) * (1 - factor_)));
    return out;
  }
  void add_attributes(StateDict& s) const override {
    s.emplace("factor", double_tensor(factor_));
    s.emplace("total_iters", int_tensor(total_iters_));
  }
  void load_attributes(const StateDict& s) override {
    factor_ = double_entry(s, "factor");
    total_iters_ = int_entry(s, "total_iters");
  }

 private:
  double factor_;
  std::int64_t total_iters_;
};

// --- linear_lr ------------------------------------------------------------------------------------

class LinearLR final : public Scheduler {
 public:
  LinearLR(std::shared_ptr<Optimizer> o, double start_factor, double end_factor, std::int64_t total_iters)
      : Scheduler(std::move(o)), start_(start_factor), end_(end_factor), total_iters_(total_iters) {}

 protected:
  std::vector<double> get_lr() override {
    std::vector<double> lrs = group_lrs();
    if (last_epoch_ == 0) {
      for (double& lr : lrs) lr = lr * start_;
      return lrs;
    }
    if (is_initial_ || last_epoch_ > total_iters_) return lrs;
    for (double& lr : lrs)
      lr = lr * (1.0 + (end_ - start_) / (static_cast<double>(total_iters_) * start_ +
                                          static_cast<double>(last_epoch_ - 1) * (end_ - start_)));
    return lrs;
  }
  std::optional<std::vector<double>> closed_form_lr() override {
    std::vector<double> out;
    for (double base : base_lrs_)
      out.push_back(base * (start_ + (end_ - start_) * static_cast<double>(std::min(total_iters_, last_epoch_)) /
                                         static_cast<double>(total_iters_)));
    return out;
  }
  void add_attributes(StateDict& s) const override {
    s.emplace("start_factor", double_tensor(start_));
    s.emplace("end_factor", double_tensor(end_));
    s.emplace("total_iters", int_tensor(total_iters_));
  }
  void load_attributes(const StateDict& s) override {
    start_ = double_entry(s, "start_factor");
    end_ = double_entry(s, "end_factor");
    total_iters_ = int_entry(s, "total_iters");
  }

 private:
  double start_, end_;
  std::int64_t total_iters_;
};

// --- cosine_annealing_lr --------------------------------------------------------------------------

class CosineAnnealingLR final : public Scheduler {
 public:
  CosineAnnealingLR(std::shared_ptr<Optimizer> o, std::int64_t t_max, double eta_min)
      : Scheduler(std::move(o)), t_max_(t_max), eta_min_(eta_min) {}

 protected:
  std::vector<double> get_lr() override {
    std::vector<double> lrs = group_lrs();
    const double e = static_cast<double>(last_epoch_), T = static_cast<double>(t_max_);
    if (is_initial_) return lrs;
    if (step_count_ == 1 && last_epoch_ > 0) {  // unreachable after the initial step; kept as in PyTorch
      for (std::size_t g = 0; g < lrs.size(); ++g)
        lrs[g] = eta_min_ + (base_lrs_[g] - eta_min_) * (1 + std::cos(e * kPi / T)) / 2;
      return lrs;
    }
    if ((last_epoch_ - 1 - t_max_) % (2 * t_max_) == 0) {  // Python's % is never negative; only == 0 matters
      for (std::size_t g = 0; g < lrs.size(); ++g)
        lrs[g] = lrs[g] + (base_lrs_[g] - eta_min_) * (1 - std::cos(kPi / T)) / 2;
      return lrs;
    }
    for (double& lr : lrs)
      lr = (1 + std::cos(kPi * e / T)) / (1 + std::cos(kPi * (e - 1) / T)) * (lr - eta_min_) + eta_min_;
    return lrs;
  }
  std::optional<std::vector<double>> closed_form_lr() override {
    std::vector<double> out;
    const double e = static_cast<double>(last_epoch_), T = static_cast<double>(t_max_);
    for (double base : base_lrs_) out.push_back(eta_min_ + (base - eta_min_) * (1 + std::cos(kPi * e / T)) / 2);
    return out;
  }
  // PyTorch's attribute name is T_max.
  void add_attributes(StateDict& s) const override {
    s.emplace("T_max", int_tensor(t_max_));
    s.emplace("eta_min", double_tensor(eta_min_));
  }
  void load_attributes(const StateDict& s) override {
    t_max_ = int_entry(s, "T_max");
    eta_min_ = double_entry(s, "eta_min");
  }

 private:
  std::int64_t t_max_;
  double eta_min_;
};

// --- onecycle_lr ----------------------------------------------------------------------------------

struct Phase {
  double end_step;
  const char* start_lr;
  const char* end_lr;
  const char* start_momentum;
  const char* end_momentum;
};

class OneCycleLR final : public Scheduler {
 public:
  OneCycleLR(std::shared_ptr<Optimizer> o, std::int64_t total_steps, double pct_start, bool cos, bool three_phase,
             bool cycle_momentum, std::string momentum_key)
      : Scheduler(std::move(o)),
        total_steps_(total_steps),
        cos_(cos),
        cycle_momentum_(cycle_momentum),
        momentum_key_(std::move(momentum_key)) {
    const double total = static_cast<double>(total_steps);
    if (three_phase)
      phases_ = {{pct_start * total - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"},
                 {2 * pct_start * total - 2, "max_lr", "initial_lr", "base_momentum", "max_momentum"},
                 {total - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum"}};
    else
      phases_ = {{pct_start * total - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"},
                 {total - 1, "max_lr", "min_lr", "base_momentum", "max_momentum"}};
  }

 protected:
  double anneal(double start, double end, double pct) const {
    if (cos_) {
      const double cos_out = std::cos(kPi * pct) + 1;
      return end + (start - end) / 2.0 * cos_out;
    }
    return (end - start) * pct + start;
  }

  double option(std::size_t g, const char* name) const {
    auto v = optimizer_->group_option(g, name);
    MODALITIES_CHECK(v.has_value(),
                     "onecycle_lr: optimizer group {} has no '{}' (resuming with last_epoch >= 0 "
                     "needs the optimizer state of the original run)",
                     g, name);
    return *v;
  }

  std::vector<double> get_lr() override {
    const std::int64_t step_num = last_epoch_;
    MODALITIES_CHECK(step_num <= total_steps_,
                     "onecycle_lr: tried to step {} times; the specified number of total "
                     "steps is {}",
                     step_num, total_steps_);
    std::vector<double> lrs;
    for (std::size_t g = 0; g < num_groups(); ++g) {
      double start_step = 0.0, lr = 0.0, momentum = 0.0;
      for (std::size_t i = 0; i < phases_.size(); ++i) {
        const Phase& phase = phases_[i];
        if (static_cast<double>(step_num) <= phase.end_step || i + 1 == phases_.size()) {
          // A phase of zero length: PyTorch divides by zero. It can only be the last phase
          // (pct_start = 1), reached at step total_steps, whose rate no optimizer step uses.
          const double pct = phase.end_step == start_step
                                 ? 1.0
                                 : (static_cast<double>(step_num) - start_step) / (phase.end_step - start_step);
          lr = anneal(option(g, phase.start_lr), option(g, phase.end_lr), pct);
          if (cycle_momentum_) momentum = anneal(option(g, phase.start_momentum), option(g, phase.end_momentum), pct);
          break;
        }
        start_step = phase.end_step;
      }
      lrs.push_back(lr);
      if (cycle_momentum_) optimizer_->set_group_option(g, momentum_key_, momentum);
    }
    return lrs;
  }

  void add_attributes(StateDict& s) const override {
    s.emplace("total_steps", int_tensor(total_steps_));
    std::vector<double> ends;
    for (const Phase& p : phases_) ends.push_back(p.end_step);
    s.emplace("_schedule_phases.end_step", doubles_tensor(ends));
    s.emplace("cycle_momentum", at::scalar_tensor(cycle_momentum_, at::kBool));
  }
  void load_attributes(const StateDict& s) override {
    total_steps_ = int_entry(s, "total_steps");
    const std::vector<double> ends = doubles_entry(s, "_schedule_phases.end_step", phases_.size());
    for (std::size_t i = 0; i < phases_.size(); ++i) phases_[i].end_step = ends[i];
    cycle_momentum_ = entry(s, "cycle_momentum").item<bool>();
    MODALITIES_CHECK(!cycle_momentum_ || !momentum_key_.empty(),
                     "onecycle_lr: the state cycles momentum, but the optimizer has neither betas nor momentum");
  }

 private:
  std::int64_t total_steps_;
  bool cos_;
  bool cycle_momentum_;
  std::string momentum_key_;  // "betas.0" (Adam) or "momentum"
  std::vector<Phase> phases_;
};

// --- linear_warmup_cosine_annealing_lr: SequentialLR([LinearLR, CosineAnnealingLR], [W]) ---------

class SequentialLR final : public LRScheduler {
 public:
  // PyTorch's SequentialLR.__init__ over already constructed sub-schedulers.
  SequentialLR(std::shared_ptr<Optimizer> optimizer, std::vector<std::shared_ptr<Scheduler>> schedulers,
               std::vector<std::int64_t> milestones, std::int64_t last_epoch)
      : optimizer_(std::move(optimizer)), schedulers_(std::move(schedulers)), milestones_(std::move(milestones)) {
    last_epoch_ = last_epoch + 1;
    for (std::size_t g = 0; g < optimizer_->num_param_groups(); ++g)
      optimizer_->set_learning_rate(g, *optimizer_->group_option(g, "initial_lr"));
    for (auto& s : schedulers_) s->set_last_epoch(s->last_epoch() - 1);  // recursive_undo
    const std::size_t idx = index_for(0);
    schedulers_[idx]->initial_step();
    last_lr_ = schedulers_[idx]->last_lrs();
  }

  void step() override {
    ++last_epoch_;
    const std::size_t idx = index_for(last_epoch_);
    Scheduler& s = *schedulers_[idx];
    if (idx > 0 && milestones_[idx - 1] == last_epoch_) s.update_lr(0);
    else s.step();
    last_lr_ = s.last_lrs();
  }

  std::vector<double> last_lrs() const override { return last_lr_; }

  StateDict state_dict() const override {
    StateDict out;
    out.emplace("last_epoch", int_tensor(last_epoch_));
    out.emplace("_last_lr", doubles_tensor(last_lr_));
    out.emplace("_milestones", at::tensor(at::ArrayRef<std::int64_t>(milestones_), at::kLong).clone());
    for (std::size_t i = 0; i < schedulers_.size(); ++i)
      for (auto& [key, value] : schedulers_[i]->state_dict())
        out.emplace(fmt::format("schedulers.{}.{}", i, key), value);
    return out;
  }

  void load_state_dict(const StateDict& state) override {
    std::vector<StateDict> children(schedulers_.size());
    for (const auto& [key, value] : state) {
      if (key == "last_epoch" || key == "_last_lr" || key == "_milestones") continue;
      bool placed = false;
      for (std::size_t i = 0; i < schedulers_.size() && !placed; ++i) {
        const std::string prefix = fmt::format("schedulers.{}.", i);
        if (key.starts_with(prefix)) {
          children[i].emplace(key.substr(prefix.size()), value);
          placed = true;
        }
      }
      MODALITIES_CHECK(placed, "scheduler state dict: unexpected key '{}' (is it from another variant?)", key);
    }
    const at::Tensor milestones = entry(state, "_milestones").to(at::kLong).contiguous().reshape(-1);
    MODALITIES_CHECK(static_cast<std::size_t>(milestones.numel()) == milestones_.size(),
                     "scheduler state dict: '_milestones' has {} values, expected {}", milestones.numel(),
                     milestones_.size());
    for (std::size_t i = 0; i < milestones_.size(); ++i)
      milestones_[i] = milestones[static_cast<std::int64_t>(i)].item<std::int64_t>();
    last_epoch_ = int_entry(state, "last_epoch");
    last_lr_ = doubles_entry(state, "_last_lr", optimizer_->num_param_groups());
    for (std::size_t i = 0; i < schedulers_.size(); ++i) schedulers_[i]->load_state_dict(children[i]);
  }

 private:
  // bisect_right(milestones, e)
  std::size_t index_for(std::int64_t e) const {
    return static_cast<std::size_t>(std::upper_bound(milestones_.begin(), milestones_.end(), e) - milestones_.begin());
  }

  std::shared_ptr<Optimizer> optimizer_;
  std::vector<std::shared_ptr<Scheduler>> schedulers_;
  std::vector<std::int64_t> milestones_;
  std::int64_t last_epoch_ = 0;
  std::vector<double> last_lr_;
};

// --- configs --------------------------------------------------------------------------------------

template <class C>
void optimizer_and_last_epoch(Schema<C>& s) {
  s.field("optimizer", &C::optimizer, "Optimizer whose group learning rates are scheduled.").required();
  s.field("last_epoch", &C::last_epoch,
          "Index of the last step taken; -1 starts fresh. >= 0 resumes (FSDP1 warm start: the last completed step) "
          "and needs 'initial_lr' in the optimizer's groups.")
      .at_least(-1);
}

struct DummyConfig {
  Ref<Optimizer> optimizer;
  std::int64_t last_epoch = -1;
  static void describe(Schema<DummyConfig>& s) { optimizer_and_last_epoch(s); }
};

struct StepConfig {
  Ref<Optimizer> optimizer;
  std::int64_t step_size = 0;
  double gamma = 0.1;
  std::int64_t last_epoch = -1;
  static void describe(Schema<StepConfig>& s) {
    optimizer_and_last_epoch(s);
    s.field("step_size", &StepConfig::step_size, "Multiply the rate by gamma every step_size steps.")
        .required()
        .positive();
    s.field("gamma", &StepConfig::gamma, "Multiplicative decay factor.").required().non_negative();
  }
};

struct ConstantConfig {
  Ref<Optimizer> optimizer;
  double factor = 1.0 / 3;
  std::int64_t total_iters = 5;
  std::int64_t last_epoch = -1;
  static void describe(Schema<ConstantConfig>& s) {
    optimizer_and_last_epoch(s);
    s.field("factor", &ConstantConfig::factor, "The rate is multiplied by factor until total_iters.")
        .required()
        .in_closed(0.0, 1.0);
    s.field("total_iters", &ConstantConfig::total_iters, "Steps at the reduced rate.").required().positive();
  }
};

struct LinearConfig {
  Ref<Optimizer> optimizer;
  double start_factor = 1.0 / 3;
  double end_factor = 1.0;
  std::int64_t total_iters = 5;
  std::int64_t last_epoch = -1;
  static void describe(Schema<LinearConfig>& s) {
    optimizer_and_last_epoch(s);
    s.field("start_factor", &LinearConfig::start_factor, "Factor of the base rate at step 0.")
        .required()
        .greater_than(0.0)
        .at_most(1.0);
    s.field("end_factor", &LinearConfig::end_factor, "Factor of the base rate from total_iters on.")
        .required()
        .in_closed(0.0, 1.0);
    s.field("total_iters", &LinearConfig::total_iters, "Steps over which the factor changes linearly.")
        .required()
        .positive();
  }
};

struct CosineConfig {
  Ref<Optimizer> optimizer;
  std::int64_t t_max = 0;
  double eta_min = 0.0;
  std::int64_t last_epoch = -1;
  static void describe(Schema<CosineConfig>& s) {
    optimizer_and_last_epoch(s);
    s.field("t_max", &CosineConfig::t_max,
            "Steps from the base rate down to eta_min (then back up: the cosine is periodic, period 2 t_max).")
        .required()
        .positive();
    s.field("eta_min", &CosineConfig::eta_min, "Minimum rate.").required().non_negative();
  }
};

struct OneCycleConfig {
  Ref<Optimizer> optimizer;
  FloatOrList max_lr;
  std::optional<std::int64_t> total_steps;
  std::optional<std::int64_t> epochs;
  std::optional<std::int64_t> steps_per_epoch;
  double pct_start = 0.3;
  std::string anneal_strategy = "cos";
  bool cycle_momentum = false;
  FloatOrList base_momentum{{0.85}, false};
  FloatOrList max_momentum{{0.95}, false};
  double div_factor = 25.0;
  double final_div_factor = 1e4;
  bool three_phase = false;
  std::int64_t last_epoch = -1;

  static void describe(Schema<OneCycleConfig>& s) {
    optimizer_and_last_epoch(s);
    s.field("max_lr", &OneCycleConfig::max_lr, "Peak rate (> 0), or one per optimizer group.").required();
    s.field("total_steps", &OneCycleConfig::total_steps, "Steps in the cycle (or give epochs and steps_per_epoch).")
        .positive();
    s.field("epochs", &OneCycleConfig::epochs, "With steps_per_epoch: total_steps = epochs * steps_per_epoch.")
        .positive();
    s.field("steps_per_epoch", &OneCycleConfig::steps_per_epoch, "See epochs.").positive();
    s.field("pct_start", &OneCycleConfig::pct_start, "Fraction of the cycle spent increasing the rate.")
        .required()
        .greater_than(0.0)
        .at_most(1.0);
    s.field("anneal_strategy", &OneCycleConfig::anneal_strategy, "Annealing shape.")
        .required()
        .one_of({"cos", "linear"});
    s.field("cycle_momentum", &OneCycleConfig::cycle_momentum,
            "Cycle beta1 (or momentum) inversely to the rate between max_momentum and base_momentum. Modalities' "
            "default false (PyTorch's is true).");
    s.field("base_momentum", &OneCycleConfig::base_momentum, "Lowest momentum (> 0, at max_lr), or one per group.");
    s.field("max_momentum", &OneCycleConfig::max_momentum, "Highest momentum (> 0), or one per group.");
    s.field("div_factor", &OneCycleConfig::div_factor, "initial_lr = max_lr / div_factor.").required().positive();
    s.field("final_div_factor", &OneCycleConfig::final_div_factor, "min_lr = initial_lr / final_div_factor.")
        .required()
        .positive();
    s.field("three_phase", &OneCycleConfig::three_phase,
            "Three phases (up, back down to initial_lr, then to min_lr) instead of two.");
    s.rule([](const OneCycleConfig& c, ParseContext& ctx) {
      if (!c.total_steps && !(c.epochs && c.steps_per_epoch))
        ctx.fail("total_steps", "give either total_steps or both epochs and steps_per_epoch");
      for (auto [name, x] : {std::pair{"max_lr", &c.max_lr}, std::pair{"base_momentum", &c.base_momentum},
                             std::pair{"max_momentum", &c.max_momentum}})
        for (std::size_t i = 0; i < x->values.size(); ++i)
          if (!(x->values[i] > 0))
            ctx.fail(x->is_list ? fmt::format("{}[{}]", name, i) : std::string(name),
                     fmt::format("must be > 0, got {}", format_float(x->values[i])));
    });
  }

  std::int64_t steps() const { return total_steps ? *total_steps : *epochs * *steps_per_epoch; }
};

struct WarmupCosineConfig {
  Ref<Optimizer> optimizer;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 0;
  double initial_lr = 0.0;
  double final_lr = 0.0;
  double max_lr = 0.0;
  std::int64_t last_epoch = -1;
  static void describe(Schema<WarmupCosineConfig>& s) {
    optimizer_and_last_epoch(s);
    s.field("warmup_steps", &WarmupCosineConfig::warmup_steps, "Steps of linear warmup from initial_lr to max_lr.")
        .required()
        .positive();
    s.field("total_steps", &WarmupCosineConfig::total_steps,
            "Warmup plus cosine steps; the cosine reaches final_lr at total_steps.")
        .required()
        .positive();
    s.field("initial_lr", &WarmupCosineConfig::initial_lr, "Rate at step 0.").required().non_negative();
    s.field("final_lr", &WarmupCosineConfig::final_lr, "Rate at total_steps (cosine eta_min).")
        .required()
        .non_negative();
    s.field("max_lr", &WarmupCosineConfig::max_lr, "Rate after warmup; must equal the optimizer's lr.")
        .required()
        .non_negative();
    s.rule([](const WarmupCosineConfig& c, ParseContext& ctx) {
      if (c.total_steps <= c.warmup_steps)
        ctx.fail("total_steps", fmt::format("must be > warmup_steps ({}), got {}", c.warmup_steps, c.total_steps));
      // LinearLR's start_factor = initial_lr / max_lr must be in (0, 1].
      if (!(c.initial_lr > 0 && c.initial_lr <= c.max_lr))
        ctx.fail("initial_lr", fmt::format("must be in (0, max_lr = {}] (the warmup's start factor initial_lr / max_lr "
                                           "must be in (0, 1]), got {}",
                                           format_float(c.max_lr), format_float(c.initial_lr)));
    });
  }
};

// Expands a float-or-list parameter to one value per group (PyTorch's _format_param).
std::vector<double> per_group(const FloatOrList& x, const char* name, std::size_t groups) {
  if (!x.is_list) return std::vector<double>(groups, x.values.at(0));
  if (x.values.size() != groups)
    throw ConfigError(name, fmt::format("has {} values, but the optimizer has {} parameter group(s): give one value "
                                        "per group or a single number",
                                        x.values.size(), groups));
  return x.values;
}

std::shared_ptr<LRScheduler> make_onecycle(const OneCycleConfig& c) {
  Optimizer& opt = *c.optimizer;
  const std::size_t groups = opt.num_param_groups();
  const std::int64_t total = c.steps();
  // The first phase ends at pct_start * total - 1; with pct_start * total == 1 it has length 0 and
  // PyTorch divides by zero already at step 0.
  if (c.pct_start * static_cast<double>(total) - 1 == 0.0)
    throw ConfigError("pct_start", fmt::format("pct_start * total_steps must not be 1 (the warm-up phase would have "
                                               "length 0; PyTorch divides by zero): pct_start = {}, total_steps = {}",
                                               format_float(c.pct_start), total));
  const std::vector<double> max_lrs = per_group(c.max_lr, "max_lr", groups);
  if (c.last_epoch == -1) {
    for (std::size_t g = 0; g < groups; ++g) {
      opt.set_group_option(g, "initial_lr", max_lrs[g] / c.div_factor);
      opt.set_group_option(g, "max_lr", max_lrs[g]);
      opt.set_group_option(g, "min_lr", *opt.group_option(g, "initial_lr") / c.final_div_factor);
    }
  }
  std::string momentum_key;
  if (opt.group_option(0, "betas.0")) momentum_key = "betas.0";
  else if (opt.group_option(0, "momentum")) momentum_key = "momentum";
  if (c.cycle_momentum) {
    if (momentum_key.empty())
      throw ConfigError("cycle_momentum", fmt::format("the optimizer ({}) has neither betas nor momentum to cycle",
                                                      c.optimizer.origin()));
    const std::vector<double> max_m = per_group(c.max_momentum, "max_momentum", groups);
    const std::vector<double> base_m = per_group(c.base_momentum, "base_momentum", groups);
    if (c.last_epoch == -1) {
      for (std::size_t g = 0; g < groups; ++g) {
        opt.set_group_option(g, momentum_key, max_m[g]);
        opt.set_group_option(g, "max_momentum", max_m[g]);
        opt.set_group_option(g, "base_momentum", base_m[g]);
      }
    }
  }
  return make_started<OneCycleLR>(c.last_epoch, c.optimizer.shared(), total, c.pct_start, c.anneal_strategy == "cos",
                                  c.three_phase, c.cycle_momentum, momentum_key);
}

std::shared_ptr<LRScheduler> make_warmup_cosine(const WarmupCosineConfig& c) {
  Optimizer& opt = *c.optimizer;
  const std::vector<double> lrs = opt.learning_rates();
  for (std::size_t g = 0; g < lrs.size(); ++g)
    if (lrs[g] != c.max_lr)
      throw ConfigError("max_lr", fmt::format("must equal the learning rate of every optimizer group, but group {} has "
                                              "lr = {} and max_lr = {} (set the optimizer's lr to max_lr)",
                                              g, format_float(lrs[g]), format_float(c.max_lr)));
  auto linear = make_started<LinearLR>(-1, c.optimizer.shared(), c.initial_lr / c.max_lr, 1.0, c.warmup_steps);
  auto cosine = make_started<CosineAnnealingLR>(-1, c.optimizer.shared(), c.total_steps - c.warmup_steps, c.final_lr);
  return std::make_shared<SequentialLR>(c.optimizer.shared(), std::vector<std::shared_ptr<Scheduler>>{linear, cosine},
                                        std::vector<std::int64_t>{c.warmup_steps}, c.last_epoch);
}

}  // namespace

void register_components(Registrar& r) {
  r.add<LRScheduler, DummyConfig>(
      "dummy_lr", "Keeps the optimizer's learning rates (Modalities' DummyLRScheduler).",
      [](const DummyConfig& c) { return make_started<DummyLR>(c.last_epoch, c.optimizer.shared()); });
  r.add<LRScheduler, StepConfig>(
      "step_lr", "Multiplies the rate by gamma every step_size steps (PyTorch StepLR).", [](const StepConfig& c) {
        return make_started<StepLR>(c.last_epoch, c.optimizer.shared(), c.step_size, c.gamma);
      });
  r.add<LRScheduler, ConstantConfig>(
      "constant_lr", "Rate times factor until total_iters, then the base rate (PyTorch ConstantLR).",
      [](const ConstantConfig& c) {
        return make_started<ConstantLR>(c.last_epoch, c.optimizer.shared(), c.factor, c.total_iters);
      });
  r.add<LRScheduler, LinearConfig>(
      "linear_lr", "Factor of the base rate changes linearly from start_factor to end_factor (PyTorch LinearLR).",
      [](const LinearConfig& c) {
        return make_started<LinearLR>(c.last_epoch, c.optimizer.shared(), c.start_factor, c.end_factor, c.total_iters);
      });
  r.add<LRScheduler, OneCycleConfig>("onecycle_lr", "The 1cycle policy (PyTorch OneCycleLR).", make_onecycle);
  r.add<LRScheduler, CosineConfig>(
      "cosine_annealing_lr", "Cosine from the base rate to eta_min over t_max steps (PyTorch CosineAnnealingLR).",
      [](const CosineConfig& c) {
        return make_started<CosineAnnealingLR>(c.last_epoch, c.optimizer.shared(), c.t_max, c.eta_min);
      });
  r.add<LRScheduler, WarmupCosineConfig>(
      "linear_warmup_cosine_annealing_lr",
      "Linear warmup from initial_lr to max_lr, then cosine to final_lr at total_steps (Modalities' factory: LinearLR "
      "and CosineAnnealingLR in a SequentialLR).",
      make_warmup_cosine);
}

}  // namespace modalities::plugins::schedulers

MODALITIES_PLUGIN(schedulers, MODALITIES_PLUGIN_VERSION, modalities::plugins::schedulers::register_components)
