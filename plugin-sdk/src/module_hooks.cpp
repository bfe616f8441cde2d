// module_hooks.h.
#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/removable_handle.h>
#include <modalities/sdk/module_hooks.h>

#include <ATen/core/Tensor.h>
#include <fmt/format.h>

#include <algorithm>

namespace modalities {
namespace {

void call_entries(const std::vector<ModuleHooks::Entry>& entries, HookPoint point, std::string_view fqn,
                  std::string_view cls, std::span<const at::Tensor> in, std::span<const at::Tensor> out) {
  const ModuleHookCall c{point, fqn, cls, in, out};
  for (const ModuleHooks::Entry& e : entries)
    if (e.fqns.empty() || e.fqns.contains(std::string(fqn))) e.hook(c);
}

class Handle final : public RemovableHandle {
 public:
  Handle(std::weak_ptr<std::vector<ModuleHooks::Entry>> list, std::uint64_t id) : list_(std::move(list)), id_(id) {}
  void remove() noexcept override {
    if (auto l = list_.lock()) std::erase_if(*l, [&](const ModuleHooks::Entry& e) { return e.id == id_; });
    list_.reset();
  }

 private:
  std::weak_ptr<std::vector<ModuleHooks::Entry>> list_;
  std::uint64_t id_;
};

}  // namespace

bool ModuleHooks::wants(std::string_view fqn) const {
  for (const Entry& e : *entries_)
    if (e.fqns.empty() || e.fqns.contains(std::string(fqn))) return true;
  return false;
}

void ModuleHooks::call(HookPoint point, std::string_view fqn, std::string_view class_name,
                       std::span<const at::Tensor> inputs, std::span<const at::Tensor> outputs) const {
  call_entries(*entries_, point, fqn, class_name, inputs, outputs);
}

void ModuleHooks::on_backward(const at::Tensor& output, std::string fqn, std::string class_name) const {
  if (!output.requires_grad()) return;
  auto entries = entries_;  // the list outlives the graph's hook
  output.register_hook([entries, fqn = std::move(fqn), cls = std::move(class_name)](const at::Tensor& grad) {
    const at::Tensor g[] = {grad};
    call_entries(*entries, HookPoint::kBackward, fqn, cls, {}, g);
  });
}

at::Tensor ModuleHooks::around(const std::string& fqn, const std::string& class_name, const at::Tensor& input,
                               const std::function<at::Tensor(const at::Tensor&)>& f) const {
  if (empty()) return f(input);
  const at::Tensor in[] = {input};
  call(HookPoint::kPreForward, fqn, class_name, in, {});
  at::Tensor out = f(input);
  const at::Tensor outs[] = {out};
  call(HookPoint::kForward, fqn, class_name, in, outs);
  if (wants(fqn)) on_backward(out, fqn, class_name);
  return out;
}

std::shared_ptr<RemovableHandle> ModuleHooks::add(ModuleHook hook, std::span<const std::string> fqns,
                                                  const std::vector<std::string>& hookable, std::string_view model) {
  if (!hook) throw Error(fmt::format("{}: add_hook needs a callable hook", model));
  std::unordered_set<std::string> wanted;
  for (const std::string& fqn : fqns) {
    if (!fqn.empty() && std::find(hookable.begin(), hookable.end(), fqn) == hookable.end())
      throw Error(fmt::format("{}: cannot hook '{}': hooks fire on the root (\"\") and the blocks ({})", model, fqn,
                              hookable.empty() ? std::string("none in this part")
                                               : fmt::format("\"{}\" ... \"{}\"", hookable.front(), hookable.back())));
    wanted.insert(fqn);
  }
  entries_->push_back({next_id_, std::move(hook), std::move(wanted)});
  return std::make_shared<Handle>(entries_, next_id_++);
}

}  // namespace modalities
