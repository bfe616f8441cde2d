// Conformance checks per interface (see conformance.h).
#include <modalities/core/conformance.h>
#include <modalities/sdk/interfaces/module.h>

#include <fmt/core.h>
#include <torch/nn/module.h>

namespace modalities::core {

namespace {

// A Module must: expose its parameters by name, round-trip its state dict,
// and switch between train and eval mode.
std::vector<std::string> check_module(Module& m) {
  std::vector<std::string> problems;
  const StateDict state = m.state_dict();
  const NamedTensors params = m.named_parameters();
  for (const auto& [name, p] : params)
    if (state.find(name) == state.end())
      problems.push_back(fmt::format("parameter '{}' is missing from state_dict()", name));
  StateDict perturbed;
  for (const auto& [name, t] : state) perturbed[name] = t.detach().clone().add_(1.0);
  m.load_state_dict(perturbed, /*strict=*/true);
  for (const auto& [name, t] : m.state_dict()) {
    auto it = perturbed.find(name);
    if (it == perturbed.end() || !t.equal(it->second))
      problems.push_back(fmt::format("load_state_dict did not restore '{}'", name));
  }
  m.load_state_dict(state, /*strict=*/true);
  m.train(false);
  if (m.is_training()) problems.push_back("train(false) left the module in training mode");
  m.train(true);
  if (!m.is_training()) problems.push_back("train(true) left the module in eval mode");
  return problems;
}

}  // namespace

std::vector<std::string> check_conformance(const Value& built) {
  if (!built.is_object()) return {};
  const Object& o = built.as_object();
  if (o.interface == Module::kInterface) return check_module(*std::static_pointer_cast<Module>(o.ptr));
  return {};
}

}  // namespace modalities::core
