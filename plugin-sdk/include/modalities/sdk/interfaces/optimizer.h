// The optimizer interface: the update rule for a fixed set of parameters, with
// per-group options (learning rate first of all) that schedulers adjust, and a
// flat, name-keyed state dict that checkpoints store. Maps torch.optim.Optimizer
// as Modalities uses it, including the list form for pipeline parallelism.
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <cstddef>
#include <optional>
#include <string_view>
#include <vector>

namespace modalities {

/// An optimizer owns the update rule for a fixed set of parameters.
///
/// Built once per run, after the `model` it references (`optimizer/adam_w`
/// groups the model's named_parameters() by its weight_decay_groups()). The
/// gym calls, from one thread, zero_grad() and (after backward and gradient
/// clipping) step() once per optimizer step; the scheduler calls
/// set_learning_rate() after each step. With pipeline parallelism one
/// implementation may combine one optimizer per local stage (Modalities'
/// OptimizersList) behind this interface; its groups are then concatenated.
///
/// \code
///   opt->zero_grad();
///   loss.backward();
///   clipper->clip_gradients();
///   opt->step();
///   scheduler->step();  // calls opt->set_learning_rate(g, lr) for each group
/// \endcode
///
/// Note [Optimizer state dict keys]
/// state_dict() is flat and keyed by parameter FQN, like Modalities' flattened
/// distributed state dict, so it is independent of group order and merges
/// across pipeline parts:
///   "state.<param_fqn>.<name>"            per-parameter state, e.g. exp_avg,
///                                         exp_avg_sq, step (as PyTorch stores them)
///   "param_groups.<param_fqn>.<option>"   the option of the group holding that
///                                         parameter, as a 0-dim float64 tensor:
///                                         lr, weight_decay, eps, betas.0, betas.1,
///                                         initial_lr, ... (every group_option()).
/// Keys are parsed by prefix against the optimizer's own parameter FQNs, so
/// dots inside FQNs and option names are fine. Under sharding, state tensors
/// are local shards placed like their parameter (Module::shard_placements()).
///
/// Ownership: the host owns the instance (std::shared_ptr); parameters are
/// borrowed from the model and must not outlive it.
/// Errors: throw modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API Optimizer {
 public:
  static constexpr std::string_view kInterface = "Optimizer";
  static constexpr std::string_view kComponentKey = "optimizer";

  Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;
  virtual ~Optimizer();  // defined in the SDK library: one vtable, one typeinfo

  /// Applies one update from the current gradients.
  virtual void step() = 0;

  /// Clears gradients; set_to_none releases them (PyTorch's default) instead
  /// of zero-filling. Overrides must keep the default argument `true`.
  virtual void zero_grad(bool set_to_none = true) = 0;

  /// Number of parameter groups (e.g. 2 with weight-decay grouping: decayed
  /// and not decayed).
  virtual std::size_t num_param_groups() const = 0;

  /// Current learning rate of every group, in group order. Read by schedulers
  /// and the warmup-cosine check (all groups must start at max_lr).
  virtual std::vector<double> learning_rates() const = 0;

  /// Sets the learning rate of group `group` (< num_param_groups(), else Error).
  virtual void set_learning_rate(std::size_t group, double lr) = 0;

  /// Any numeric group option by name ("lr", "weight_decay", "eps", "betas.0",
  /// "momentum", ...), or std::nullopt when the group has no such option.
  /// Schedulers read e.g. "betas.0" (OneCycle's momentum cycling) and their
  /// own bookkeeping ("initial_lr").
  virtual std::optional<double> group_option(std::size_t group, std::string_view name) const = 0;

  /// Sets a group option. Names the optimizer does not use itself are kept as
  /// extra entries and round-trip through state_dict(), like the keys PyTorch
  /// schedulers add to param_groups ("initial_lr", "max_lr", "min_lr").
  virtual void set_group_option(std::size_t group, std::string_view name, double value) = 0;

  /// The full optimizer state. See Note [Optimizer state dict keys].
  virtual StateDict state_dict() const = 0;

  /// Restores a state produced by state_dict() of an optimizer of the same
  /// kind over the same parameter FQNs. Unknown or missing parameter keys are
  /// an error; group options found under "param_groups." overwrite the current
  /// ones (so a resumed run continues with the checkpointed learning rates).
  virtual void load_state_dict(const StateDict& state) = 0;
};

}  // namespace modalities
