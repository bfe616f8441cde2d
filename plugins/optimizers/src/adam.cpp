// optimizer/adam and optimizer/adam_w (README.md): PyTorch's Adam (L2
// weight decay) and AdamW (decoupled) over the parameter groups of Modalities' weight-decay
// split. The update is written on ATen ops in exactly torch.optim's order instead of
// torch::optim (whose state layout and rounding differ): the single-tensor path op for op, the
// foreach path (at::_foreach_*, a few multi-tensor kernels on CUDA) like PyTorch's foreach path,
// and `fused = true` calls PyTorch's own fused kernels. Same library, same machine: bit-identical
// to torch.optim's algorithm; against Python torch.optim run elsewhere: within a few ulps (the
// vectorised kernels may round differently on another CPU; tests/optimizers_test.cpp). State per parameter is PyTorch's: step (float32 0-dim), exp_avg, exp_avg_sq.
#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/optimizer.h>
#include <modalities/sdk/model_parts.h>
#include <modalities/sdk/plugin.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace modalities::plugins::optimizers {
namespace {

// Note [Model parts]
// `wrapped_model` is one Module or a list of model parts (the pipeline stages of this rank,
// modalities/sdk/model_parts.h). Modalities registers the optimizers with a "maybe list"
// wrapper: a list of model parts gets one optimizer per part behind one OptimizersList. Here
// one Optimizer holds the groups of all parts, part by part; the state dict is keyed by
// parameter FQN, so it is the union of the per-part state dicts as in Modalities.
struct AdamConfig {
  ModelParts wrapped_model;
  double lr = 0.0;
  std::array<double, 2> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
  std::vector<std::string> weight_decay_groups_excluded;
  std::optional<bool> foreach;
  std::optional<bool> fused;

  static void describe(Schema<AdamConfig>& s) {
    s.field("wrapped_model", &AdamConfig::wrapped_model,
            "Model (or list of model parts) whose parameters are optimized; FSDP-wrapped or not.")
        .required();
    s.field("lr", &AdamConfig::lr, "Learning rate of every group (schedulers change it later).")
        .required()
        .non_negative();
    s.field("betas", &AdamConfig::betas, "(beta1, beta2), each in [0, 1): decay rates of the first and second moments.")
        .required()
        .non_negative();
    s.field("eps", &AdamConfig::eps, "Added to the denominator sqrt(v_hat).").required().non_negative();
    s.field("weight_decay", &AdamConfig::weight_decay,
            "Weight decay of the decayed group (L2 for adam, decoupled for adam_w).")
        .required()
        .non_negative();
    s.field("weight_decay_groups_excluded", &AdamConfig::weight_decay_groups_excluded,
            "Names of the model's weight-decay groups that get weight decay 0 (e.g. [\"embedding\", "
            "\"layernorm\"]); empty: one group with all parameters.")
        .required();
    s.field("foreach", &AdamConfig::foreach,
            "Multi-tensor (at::_foreach_*) update; null or true: foreach, false: one parameter at a time. "
            "Both give the same bits on CPU.");
    s.field("fused", &AdamConfig::fused,
            "PyTorch's fused Adam kernel (CPU and CUDA; rounding differs slightly from the unfused paths).");
    s.rule([](const AdamConfig& c, ParseContext& ctx) {
      for (std::size_t i = 0; i < 2; ++i)
        if (c.betas[i] >= 1.0)
          ctx.fail(fmt::format("betas[{}]", i), fmt::format("must be in [0, 1), got {}", format_float(c.betas[i])));
      if (c.fused.value_or(false) && c.foreach.value_or(false))
        ctx.fail("fused", "`fused` and `foreach` cannot both be true (as in PyTorch); drop one of them");
    });
  }
};

enum class Impl { kSingleTensor, kForeach, kFused };

struct Param {
  std::string fqn;
  at::Tensor tensor;
  std::size_t group = 0;
  // PyTorch's per-parameter state; undefined until the parameter's first gradient.
  at::Tensor step;        // float32, 0-dim (on CPU; on the parameter's device with fused)
  at::Tensor exp_avg;     // like the parameter
  at::Tensor exp_avg_sq;  // like the parameter
};

struct Group {
  std::string name;  // "all", "with_weight_decay", "without_weight_decay" (for messages)
  std::vector<std::size_t> params;
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  std::map<std::string, double, std::less<>> extra;  // options set by others (initial_lr, max_lr, ...)
};

constexpr std::array<std::string_view, 5> kOptions = {"lr", "betas.0", "betas.1", "eps", "weight_decay"};
constexpr std::array<std::string_view, 3> kStateNames = {"step", "exp_avg", "exp_avg_sq"};

std::string count_with_commas(std::int64_t n) {
  std::string digits = std::to_string(n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// Groups of one model part, as Modalities' get_optimizer_groups (README.md). Returns
// (group name, weight decay, named parameters) triples.
struct PartGroup {
  std::string name;
  double weight_decay;
  NamedTensors params;
  std::string if_empty;  // the config error when the group is empty on every rank
};

// A part's groups, empty ones included: a pipeline stage may lack a group (the embeddings alone have
// no decayed parameter), and so may a rank whose FSDP shards of a group are all empty. Such a group
// is kept (Modalities drops it), so every rank has the same groups and the per-group scheduler state
// has one shape everywhere. Only a group that is empty on every rank is a config error (Adam's
// constructor checks that once all parts are grouped).
std::vector<PartGroup> split_by_weight_decay(const Module& model, const std::string& origin, double weight_decay,
                                             const std::vector<std::string>& excluded, BuildContext& ctx) {
  NamedTensors trainable;
  std::int64_t trainable_numel = 0;
  for (auto& [name, p] : model.named_parameters()) {
    // Under FSDP2 a parameter whose local shard is empty is skipped, as in Modalities.
    if (!p.requires_grad() || p.numel() == 0) continue;
    trainable_numel += p.numel();
    trainable.emplace_back(name, p);
  }
  if (weight_decay == 0.0 || excluded.empty()) return {{"all", weight_decay, std::move(trainable), {}}};

  // Note: Modalities requires an FSDP1/FSDP2-wrapped model here; any Module is accepted.
  const auto declared = model.weight_decay_groups();
  std::vector<std::string> declared_names;
  for (const auto& [name, _] : declared) declared_names.push_back(name);
  for (const auto& name : excluded)
    if (!declared.contains(name))
      ctx.warn(
          fmt::format("weight_decay_groups_excluded: group '{}' is not a weight-decay group of {} (its groups: "
                      "{}); this can be fine for a pipeline stage",
                      name, origin, declared_names.empty() ? "none" : quoted_list(declared_names)));
  if (trainable.empty()) throw ConfigError("wrapped_model", fmt::format("{} has no trainable parameters", origin));

  // Declared groups in the model's order (std::map: by name). Order inside a group only decides
  // the order of the update, never its result.
  PartGroup decayed{"with_weight_decay", weight_decay, {}, {}}, not_decayed{"without_weight_decay", 0.0, {}, {}};
  std::map<std::string, int> hits;
  for (const auto& [group, patterns] : declared) {
    std::vector<std::regex> regexes;
    for (const auto& pattern : patterns) {
      try {
        regexes.emplace_back(pattern, std::regex::ECMAScript);
      } catch (const std::regex_error& e) {
        throw Error(
            fmt::format("{}: weight-decay group '{}' has an invalid regex '{}': {}", origin, group, pattern, e.what()));
      }
    }
    const bool is_excluded = std::find(excluded.begin(), excluded.end(), group) != excluded.end();
    for (const auto& [name, p] : trainable) {
      bool match = false;
      for (const auto& re : regexes) match = match || std::regex_search(name, re);
      if (!match) continue;
      ++hits[name];
      (is_excluded ? not_decayed : decayed).params.emplace_back(name, p);
    }
  }
  for (PartGroup* g : {&decayed, &not_decayed})
    g->if_empty = fmt::format(
        "optimizer group '{}' of {} is empty: no trainable parameter falls into a {} "
        "weight-decay group (model groups: {}; excluded: {})",
        g->name, origin, g == &decayed ? "non-excluded" : "excluded",
        declared_names.empty() ? "none" : quoted_list(declared_names), quoted_list(excluded));
  std::int64_t grouped = 0;
  for (const PartGroup* g : {&decayed, &not_decayed})
    for (const auto& [_, p] : g->params) grouped += p.numel();
  if (grouped != trainable_numel) {
    std::vector<std::string> unmatched, twice;
    for (const auto& [name, _] : trainable) {
      const int n = hits.contains(name) ? hits[name] : 0;
      if (n == 0) unmatched.push_back(name);
      if (n > 1) twice.push_back(name);
    }
    throw ConfigError(
        "weight_decay_groups_excluded",
        fmt::format("inconsistent number of parameters after the split into optimizer groups of {}: "
                    "found {}, should be {}; matched by no weight-decay group: {}; matched by several: {}",
                    origin, count_with_commas(grouped), count_with_commas(trainable_numel),
                    unmatched.empty() ? "none" : quoted_list(unmatched), twice.empty() ? "none" : quoted_list(twice)));
  }
  return {std::move(decayed), std::move(not_decayed)};
}

// Groups (by index) in first-appearance order of (device, dtype), like PyTorch's
// _group_tensors_by_device_and_dtype.
template <class Item, class Key>
std::vector<std::vector<Item*>> bucket(const std::vector<Item*>& items, Key key) {
  std::vector<std::pair<std::pair<c10::Device, c10::ScalarType>, std::vector<Item*>>> buckets;
  for (Item* item : items) {
    const auto k = key(*item);
    auto it = std::find_if(buckets.begin(), buckets.end(), [&](const auto& b) { return b.first == k; });
    if (it == buckets.end()) buckets.push_back({k, {item}});
    else it->second.push_back(item);
  }
  std::vector<std::vector<Item*>> out;
  for (auto& b : buckets) out.push_back(std::move(b.second));
  return out;
}

class Adam final : public Optimizer {
 public:
  Adam(const AdamConfig& c, bool decoupled, BuildContext& ctx) : decoupled_(decoupled) {
    impl_ = c.fused.value_or(false) ? Impl::kFused : c.foreach.value_or(true) ? Impl::kForeach : Impl::kSingleTensor;
    std::unordered_map<std::string, std::string> owner;  // fqn -> part origin, for duplicate FQNs
    std::set<const c10::TensorImpl*> seen;
    std::vector<std::string> if_empty;  // per group
    for (const auto& part : c.wrapped_model.parts) {
      parts_.push_back(part.shared());
      for (const auto& [name, tensor] : part->named_parameters())
        if (tensor.numel() == 0) empty_.insert(name);
      for (auto& pg :
           split_by_weight_decay(*part, part.origin(), c.weight_decay, c.weight_decay_groups_excluded, ctx)) {
        // Several parts (a pipeline rank's stages) share their groups: the same group of every part is
        // one group, so every layout (one process, PP2, two stages per rank, ...) has the same groups,
        // and optimizer and scheduler state continue across layouts. The update is per parameter, so
        // grouping changes no value.
        auto same = std::find_if(groups_.begin(), groups_.end(), [&](const Group& g) { return g.name == pg.name; });
        if (same == groups_.end()) {
          Group g;
          g.name = pg.name;
          g.lr = c.lr;
          g.beta1 = c.betas[0];
          g.beta2 = c.betas[1];
          g.eps = c.eps;
          g.weight_decay = pg.weight_decay;
          groups_.push_back(std::move(g));
          if_empty.push_back(pg.if_empty);
          same = groups_.end() - 1;
        }
        const std::size_t group_index = static_cast<std::size_t>(same - groups_.begin());
        for (auto& [name, tensor] : pg.params) {
          if (!seen.insert(tensor.unsafeGetTensorImpl()).second) {
            ctx.warn(
                fmt::format("parameter '{}' of {} is the same tensor as an earlier parameter (tied weights); "
                            "it is optimized once",
                            name, part.origin()));
            continue;
          }
          if (auto [it, fresh] = owner.emplace(name, part.origin()); !fresh)
            throw ConfigError("wrapped_model", fmt::format("parameter name '{}' occurs in two model parts ({} and {}); "
                                                           "optimizer state is keyed by name",
                                                           name, it->second, part.origin()));
          if (impl_ == Impl::kFused && (!tensor.is_floating_point() ||
                                        (tensor.device().type() != c10::kCPU && tensor.device().type() != c10::kCUDA)))
            throw ConfigError("fused", fmt::format("fused = true needs floating-point parameters on CPU or CUDA; "
                                                   "'{}' is {} on {}",
                                                   name, c10::toString(tensor.scalar_type()), tensor.device().str()));
          if (tensor.is_complex())
            throw ConfigError("wrapped_model", fmt::format("parameter '{}' is complex; not supported", name));
          index_.emplace(name, params_.size());
          groups_[group_index].params.push_back(params_.size());
          params_.push_back(Param{name, tensor, group_index, {}, {}, {}});
        }
      }
    }
    // A group may be empty on this rank (a pipeline stage, empty shards), not on every rank. A
    // collective when several ranks build the optimizer (every rank, at the same point of the graph).
    for (std::size_t k = 0; k < groups_.size(); ++k)
      if (!dist::any_rank(!groups_[k].params.empty()) && !if_empty[k].empty())
        throw ConfigError("weight_decay_groups_excluded", if_empty[k]);
  }

  void step() override {
    at::NoGradGuard no_grad;
    for (Group& g : groups_) {
      std::vector<Param*> active;  // parameters with a gradient; the others are skipped (PyTorch)
      for (std::size_t i : g.params) {
        Param& p = params_[i];
        const at::Tensor& grad = p.tensor.grad();
        if (!grad.defined()) continue;
        MODALITIES_CHECK(!grad.is_sparse(),
                         "optimizer: parameter '{}' has a sparse gradient; Adam does not support "
                         "sparse gradients",
                         p.fqn);
        if (!p.step.defined()) init_state(p);
        active.push_back(&p);
      }
      if (active.empty()) continue;
      switch (impl_) {
        case Impl::kSingleTensor: single_tensor_step(g, active); break;
        case Impl::kForeach: foreach_step(g, active); break;
        case Impl::kFused: fused_step(g, active); break;
      }
    }
  }

  void zero_grad(bool set_to_none = true) override {
    for (Param& p : params_) {
      at::Tensor& grad = p.tensor.mutable_grad();
      if (!grad.defined()) continue;
      if (set_to_none) {
        grad.reset();
      } else {
        if (grad.grad_fn()) grad = grad.detach();
        else grad.requires_grad_(false);
        grad.zero_();
      }
    }
  }

  std::size_t num_param_groups() const override { return groups_.size(); }

  std::vector<double> learning_rates() const override {
    std::vector<double> out;
    for (const Group& g : groups_) out.push_back(g.lr);
    return out;
  }

  void set_learning_rate(std::size_t group, double lr) override { group_at(group).lr = lr; }

  std::optional<double> group_option(std::size_t group, std::string_view name) const override {
    const Group& g = group_at(group);
    if (const double* known = known_option(g, name)) return *known;
    if (auto it = g.extra.find(name); it != g.extra.end()) return it->second;
    return std::nullopt;
  }

  void set_group_option(std::size_t group, std::string_view name, double value) override {
    Group& g = group_at(group);
    if (double* known = known_option(g, name)) *known = value;
    else g.extra.insert_or_assign(std::string(name), value);
  }

  // See Note [Optimizer state dict keys] in optimizer.h. State tensors alias the live state.
  StateDict state_dict() const override {
    StateDict out;
    for (const Param& p : params_) {
      const Group& g = groups_[p.group];
      if (p.step.defined()) {
        out.emplace(fmt::format("state.{}.step", p.fqn), p.step);
        out.emplace(fmt::format("state.{}.exp_avg", p.fqn), p.exp_avg);
        out.emplace(fmt::format("state.{}.exp_avg_sq", p.fqn), p.exp_avg_sq);
      }
      for (std::string_view name : kOptions)
        out.emplace(fmt::format("param_groups.{}.{}", p.fqn, name),
                    at::scalar_tensor(*known_option(g, name), at::kDouble));
      for (const auto& [name, value] : g.extra)
        out.emplace(fmt::format("param_groups.{}.{}", p.fqn, name), at::scalar_tensor(value, at::kDouble));
    }
    return out;
  }

  void load_state_dict(const StateDict& state) override {
    struct Loaded {
      std::map<std::string, at::Tensor, std::less<>> state;
      std::map<std::string, double, std::less<>> options;
    };
    std::vector<Loaded> loaded(params_.size());
    std::vector<std::string> unknown;
    for (const auto& [key, value] : state) {
      const bool is_state = key.starts_with("state.");
      const bool is_group = key.starts_with("param_groups.");
      auto split = (is_state || is_group) ? split_key(std::string_view(key).substr(is_state ? 6 : 13)) : std::nullopt;
      if (!split) {
        // A checkpoint of another layout holds the state of parameters whose shard is empty on this
        // rank (a tensor of fewer rows than FSDP ranks): they are not optimized here.
        if ((is_state || is_group) && of_empty_shard(std::string_view(key).substr(is_state ? 6 : 13))) continue;
        unknown.push_back(key);
        continue;
      }
      auto [index, name] = *split;
      if (is_state) {
        if (std::find(kStateNames.begin(), kStateNames.end(), name) == kStateNames.end()) {
          unknown.push_back(key);
          continue;
        }
        MODALITIES_CHECK(value.defined(), "optimizer state dict: '{}' is an undefined tensor", key);
        loaded[index].state.emplace(std::string(name), value);
      } else {
        MODALITIES_CHECK(value.defined() && value.numel() == 1,
                         "optimizer state dict: '{}' must hold one number, got a tensor of shape {}", key,
                         value.defined() ? fmt::format("{}", value.sizes()) : "undefined");
        loaded[index].options.emplace(std::string(name), value.item<double>());
      }
    }
    if (!unknown.empty())
      throw Error(fmt::format("optimizer state dict: {} key(s) name no parameter or entry of this optimizer, e.g. {}",
                              unknown.size(),
                              quoted_list(std::span(unknown).first(std::min<std::size_t>(3, unknown.size())))));
    std::vector<std::string> missing;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const Param& p = params_[i];
      if (!loaded[i].options.contains("lr")) missing.push_back(fmt::format("param_groups.{}.lr", p.fqn));
      const std::size_t n = loaded[i].state.size();
      MODALITIES_CHECK(n == 0 || n == kStateNames.size(),
                       "optimizer state dict: parameter '{}' has {} of the state entries step, exp_avg, exp_avg_sq",
                       p.fqn, n);
      for (const char* name : {"exp_avg", "exp_avg_sq"})
        if (n > 0 && !loaded[i].state.at(name).sizes().equals(p.tensor.sizes()))
          throw Error(fmt::format("optimizer state dict: state.{}.{} has shape {}, the parameter has shape {}", p.fqn,
                                  name, loaded[i].state.at(name).sizes(), p.tensor.sizes()));
      if (n > 0)
        MODALITIES_CHECK(loaded[i].state.at("step").numel() == 1,
                         "optimizer state dict: state.{}.step must hold one number", p.fqn);
    }
    if (!missing.empty())
      throw Error(fmt::format("optimizer state dict: {} parameter(s) of this optimizer are missing, e.g. {}",
                              missing.size(),
                              quoted_list(std::span(missing).first(std::min<std::size_t>(3, missing.size())))));
    for (const Group& g : groups_) {
      if (g.params.empty()) continue;
      const auto& first = loaded[g.params.front()].options;
      for (std::size_t i : g.params)
        if (loaded[i].options != first)
          throw Error(
              fmt::format("optimizer state dict: parameters '{}' and '{}' are in one group ('{}') here but "
                          "have different group options in the state dict",
                          params_[g.params.front()].fqn, params_[i].fqn, g.name));
    }
    // Everything checked: apply.
    at::NoGradGuard no_grad;
    for (Group& g : groups_) {
      if (g.params.empty()) continue;
      for (const auto& [name, value] : loaded[g.params.front()].options)
        set_group_option(&g - groups_.data(), name, value);
    }
    for (std::size_t i = 0; i < params_.size(); ++i) {
      Param& p = params_[i];
      if (loaded[i].state.empty()) {
        p.step = p.exp_avg = p.exp_avg_sq = at::Tensor();
        continue;
      }
      const auto& s = loaded[i].state;
      const c10::Device step_device = impl_ == Impl::kFused ? p.tensor.device() : c10::Device(c10::kCPU);
      p.step = s.at("step").reshape({}).to(step_device, at::kFloat, /*non_blocking=*/false, /*copy=*/true);
      p.exp_avg = s.at("exp_avg").to(p.tensor.device(), p.tensor.scalar_type(), false, /*copy=*/true);
      p.exp_avg_sq = s.at("exp_avg_sq").to(p.tensor.device(), p.tensor.scalar_type(), false, /*copy=*/true);
    }
  }

 private:
  const Group& group_at(std::size_t group) const {
    MODALITIES_CHECK(group < groups_.size(), "optimizer: parameter group {} does not exist ({} group(s))", group,
                     groups_.size());
    return groups_[group];
  }
  Group& group_at(std::size_t group) { return const_cast<Group&>(std::as_const(*this).group_at(group)); }

  static const double* known_option(const Group& g, std::string_view name) {
    if (name == "lr") return &g.lr;
    if (name == "betas.0") return &g.beta1;
    if (name == "betas.1") return &g.beta2;
    if (name == "eps") return &g.eps;
    if (name == "weight_decay") return &g.weight_decay;
    return nullptr;
  }
  static double* known_option(Group& g, std::string_view name) {
    return const_cast<double*>(known_option(std::as_const(g), name));
  }

  // "<fqn>.<name>" -> (parameter index, name), taking the longest FQN prefix (names may contain dots).
  // Whether `rest` ("<fqn>.<name>") belongs to a parameter this rank skipped for its empty shard.
  bool of_empty_shard(std::string_view rest) const {
    for (std::size_t dot = rest.rfind('.'); dot != std::string_view::npos && dot > 0; dot = rest.rfind('.', dot - 1))
      if (empty_.contains(std::string(rest.substr(0, dot)))) return true;
    return false;
  }

  std::optional<std::pair<std::size_t, std::string_view>> split_key(std::string_view rest) const {
    for (std::size_t dot = rest.rfind('.'); dot != std::string_view::npos && dot > 0; dot = rest.rfind('.', dot - 1)) {
      if (auto it = index_.find(std::string(rest.substr(0, dot))); it != index_.end())
        return std::pair{it->second, rest.substr(dot + 1)};
    }
    return std::nullopt;
  }

  void init_state(Param& p) const {
    // PyTorch hosts `step` on the CPU unless fused (or capturable).
    const c10::Device step_device = impl_ == Impl::kFused ? p.tensor.device() : c10::Device(c10::kCPU);
    p.step = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(step_device));
    p.exp_avg = at::zeros_like(p.tensor, at::MemoryFormat::Preserve);
    p.exp_avg_sq = at::zeros_like(p.tensor, at::MemoryFormat::Preserve);
  }

  // torch.optim.adam._single_tensor_adam, op for op (the Python scalars are doubles here too).
  void single_tensor_step(const Group& g, const std::vector<Param*>& active) const {
    for (Param* p : active) {
      at::Tensor param = p->tensor;
      at::Tensor grad = param.grad();
      p->step.add_(1);
      if (g.weight_decay != 0) {
        if (decoupled_) param.mul_(1 - g.lr * g.weight_decay);
        else grad = grad.add(param, g.weight_decay);
      }
      p->exp_avg.lerp_(grad, 1 - g.beta1);
      p->exp_avg_sq.mul_(g.beta2).addcmul_(grad, grad, 1 - g.beta2);
      const double step = p->step.item<double>();
      const double bias_correction1 = 1 - std::pow(g.beta1, step);
      const double bias_correction2 = 1 - std::pow(g.beta2, step);
      const double step_size = g.lr / bias_correction1;
      const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
      at::Tensor denom = (p->exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(g.eps);
      param.addcdiv_(p->exp_avg, denom, -step_size);
    }
  }

  // torch.optim.adam._multi_tensor_adam (capturable = false), one bucket per (device, dtype).
  void foreach_step(const Group& g, const std::vector<Param*>& active) const {
    for (const auto& b : bucket(active, [](const Param& p) {
           return std::pair{p.tensor.device(), p.tensor.scalar_type()};
         })) {
      std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
      for (Param* p : b) {
        params.push_back(p->tensor);
        grads.push_back(p->tensor.grad());
        exp_avgs.push_back(p->exp_avg);
        exp_avg_sqs.push_back(p->exp_avg_sq);
        steps.push_back(p->step);
      }
      increment_steps(steps);
      if (g.weight_decay != 0) {
        if (decoupled_) at::_foreach_mul_(params, 1 - g.lr * g.weight_decay);
        else grads = at::_foreach_add(grads, params, g.weight_decay);
      }
      at::_foreach_lerp_(exp_avgs, grads, 1 - g.beta1);
      at::_foreach_mul_(exp_avg_sqs, g.beta2);
      at::_foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - g.beta2);
      std::vector<at::Scalar> step_sizes, bias_correction2_sqrts;
      for (const at::Tensor& s : steps) {
        const double step = step_value(s);
        const double bias_correction1 = 1 - std::pow(g.beta1, step);
        const double bias_correction2 = 1 - std::pow(g.beta2, step);
        step_sizes.emplace_back((g.lr / bias_correction1) * -1);
        bias_correction2_sqrts.emplace_back(std::pow(bias_correction2, 0.5));
      }
      std::vector<at::Tensor> denoms = at::_foreach_sqrt(exp_avg_sqs);
      at::_foreach_div_(denoms, bias_correction2_sqrts);
      at::_foreach_add_(denoms, g.eps);
      at::_foreach_addcdiv_(params, exp_avgs, denoms, step_sizes);
    }
  }

  // steps += 1, as _foreach_add_(steps, 1) computes it. Steps on the CPU (float32 0-dim: always
  // so unless fused on an accelerator) are bumped in place through their data pointer: on the
  // CPU _foreach_add_ is a loop of dispatched add_ calls, ~2 us per parameter per step for one
  // float addition (the same float addition, so the values are bit-identical).
  static void increment_steps(std::vector<at::Tensor>& steps) {
    if (!std::all_of(steps.begin(), steps.end(), on_host)) {
      at::_foreach_add_(steps, 1);
      return;
    }
    for (at::Tensor& t : steps) *t.data_ptr<float>() += 1.0f;
  }
  // step.item() (PyTorch's _get_value), read directly for a step on the CPU.
  static double step_value(const at::Tensor& step) {
    return on_host(step) ? static_cast<double>(*step.data_ptr<float>()) : step.item<double>();
  }
  static bool on_host(const at::Tensor& t) {
    return t.is_cpu() && t.scalar_type() == at::kFloat && t.numel() == 1 && t.is_contiguous();
  }

  // torch.optim.adam._fused_adam: PyTorch's fused kernels.
  void fused_step(const Group& g, const std::vector<Param*>& active) const {
    for (const auto& b : bucket(active, [](const Param& p) {
           return std::pair{p.tensor.device(), p.tensor.scalar_type()};
         })) {
      std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
      for (Param* p : b) {
        params.push_back(p->tensor);
        grads.push_back(p->tensor.grad());
        exp_avgs.push_back(p->exp_avg);
        exp_avg_sqs.push_back(p->exp_avg_sq);
        steps.push_back(p->step);
      }
      increment_steps(steps);
      if (decoupled_)
        at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, {}, steps, g.lr, g.beta1, g.beta2, g.weight_decay,
                          g.eps,
                          /*amsgrad=*/false, /*maximize=*/false);
      else
        at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, {}, steps, g.lr, g.beta1, g.beta2, g.weight_decay, g.eps,
                         /*amsgrad=*/false, /*maximize=*/false);
    }
  }

  bool decoupled_;
  Impl impl_ = Impl::kForeach;
  std::vector<std::shared_ptr<Module>> parts_;  // keeps the parameters' owners alive
  std::vector<Param> params_;
  std::vector<Group> groups_;
  std::unordered_map<std::string, std::size_t> index_;  // fqn -> params_ index
  std::unordered_set<std::string> empty_;               // parameters whose shard is empty on this rank (not optimized)
};

}  // namespace

void register_components(Registrar& r) {
  r.add<Optimizer, AdamConfig>(
      "adam",
      "Adam (weight decay as L2 on the gradient) over Modalities' weight-decay groups; torch.optim.Adam's "
      "update, op for op.",
      [](const AdamConfig& c, BuildContext& ctx) { return std::make_shared<Adam>(c, /*decoupled=*/false, ctx); });
  r.add<Optimizer, AdamConfig>(
      "adam_w",
      "AdamW (decoupled weight decay) over Modalities' weight-decay groups; torch.optim.AdamW's update, "
      "op for op.",
      [](const AdamConfig& c, BuildContext& ctx) { return std::make_shared<Adam>(c, /*decoupled=*/true, ctx); });
}

}  // namespace modalities::plugins::optimizers

MODALITIES_PLUGIN(optimizers, MODALITIES_PLUGIN_VERSION, modalities::plugins::optimizers::register_components)
