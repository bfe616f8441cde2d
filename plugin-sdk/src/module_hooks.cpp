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

template <class E>
class Handle final : public RemovableHandle {
 public:
  Handle(std::weak_ptr<std::vector<E>> list, std::uint64_t id) : list_(std::move(list)), id_(id) {}
  void remove() noexcept override {
    if (auto l = list_.lock()) std::erase_if(*l, [&](const E& e) { return e.id == id_; });
    list_.reset();
  }

 private:
  std::weak_ptr<std::vector<E>> list_;
  std::uint64_t id_;
};

// The fqns of an add()/add_runner() request, each checked against `allowed` ("" too if `root`).
std::unordered_set<std::string> checked_fqns(std::span<const std::string> fqns, const std::vector<std::string>& allowed,
                                             bool root, std::string_view model, std::string_view what) {
  std::unordered_set<std::string> wanted;
  for (const std::string& fqn : fqns) {
    const bool ok = (root && fqn.empty()) || std::find(allowed.begin(), allowed.end(), fqn) != allowed.end();
    if (!ok)
      throw Error(fmt::format("{}: cannot {} '{}': {} ({})", model, what, fqn,
                              root ? "hooks fire on the root (\"\") and the blocks" : "runners run blocks",
                              allowed.empty() ? std::string("none in this part")
                                              : fmt::format("\"{}\" ... \"{}\"", allowed.front(), allowed.back())));
    wanted.insert(fqn);
  }
  return wanted;
}

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
                               const BlockFunction& f) const {
  if (empty()) return f(input);
  const BlockRunner* runner = nullptr;
  for (const RunnerEntry& r : *runners_)
    if (r.fqns.empty() || r.fqns.contains(fqn)) runner = &r.runner;
  const at::Tensor in[] = {input};
  call(HookPoint::kPreForward, fqn, class_name, in, {});
  at::Tensor out = runner != nullptr ? (*runner)(input, f) : f(input);
  const at::Tensor outs[] = {out};
  call(HookPoint::kForward, fqn, class_name, in, outs);
  if (wants(fqn)) on_backward(out, fqn, class_name);
  return out;
}

std::shared_ptr<RemovableHandle> ModuleHooks::add(ModuleHook hook, std::span<const std::string> fqns,
                                                  const std::vector<std::string>& hookable, std::string_view model) {
  if (!hook) throw Error(fmt::format("{}: add_hook needs a callable hook", model));
  std::unordered_set<std::string> wanted = checked_fqns(fqns, hookable, /*root=*/true, model, "hook");
  entries_->push_back({next_id_, std::move(hook), std::move(wanted)});
  return std::make_shared<Handle<Entry>>(entries_, next_id_++);
}

std::shared_ptr<RemovableHandle> ModuleHooks::add_runner(BlockRunner runner, std::span<const std::string> fqns,
                                                         const std::vector<std::string>& blocks,
                                                         std::string_view model) {
  if (!runner) throw Error(fmt::format("{}: add_block_runner needs a callable runner", model));
  std::unordered_set<std::string> wanted = checked_fqns(fqns, blocks, /*root=*/false, model, "run block");
  for (const RunnerEntry& r : *runners_)
    for (const std::string& b : blocks) {
      const bool mine = wanted.empty() || wanted.contains(b);
      const bool theirs = r.fqns.empty() || r.fqns.contains(b);
      if (mine && theirs)
        throw Error(fmt::format("{}: block '{}' already has a block runner (one per block)", model, b));
    }
  runners_->push_back({next_id_, std::move(runner), std::move(wanted)});
  return std::make_shared<Handle<RunnerEntry>>(runners_, next_id_++);
}

}  // namespace modalities
