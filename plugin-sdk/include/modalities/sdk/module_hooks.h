// The hook list behind Module::add_hook, for model authors: LibTorch has no module hooks, so a
// model that wants to be wrapped (FSDP, debugging hooks, later TP and activation checkpointing)
// calls them itself around its hookable submodules (the root "" and its blocks):
//
//   class MyModel final : public modalities::Module {
//     modalities::ModuleHooks hooks_;
//     TensorMap forward(const TensorMap& in) override {
//       ...
//       for (std::size_t i = 0; i < blocks_.size(); ++i) h = hooks_.around(fqn_[i], "MyBlock", h,
//                                                                          [&](const at::Tensor& x) { return blocks_[i](x); });
//     }
//     std::shared_ptr<RemovableHandle> add_hook(ModuleHook hook, std::span<const std::string> fqns) override {
//       return hooks_.add(std::move(hook), fqns, block_fqns(), "mymodel");
//     }
//   };
//
// Hooks are added and removed between steps; kBackward hooks run on autograd's threads, so the
// list must not change during a step. Used by the bundled gpt2 and by the test model of
// plugins/fsdp/tests (a second model that model/fsdp2_wrapped shards without knowing it).
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace modalities {

class MODALITIES_SDK_API ModuleHooks {
 public:
  struct Entry {
    std::uint64_t id;
    ModuleHook hook;
    std::unordered_set<std::string> fqns;  // empty: every hookable submodule
  };

  bool empty() const { return entries_->empty(); }
  /// Whether a hook listens to `fqn`.
  bool wants(std::string_view fqn) const;
  /// Calls the hooks of `fqn` at `point`.
  void call(HookPoint point, std::string_view fqn, std::string_view class_name, std::span<const at::Tensor> inputs,
            std::span<const at::Tensor> outputs) const;
  /// Registers the kBackward call of `fqn` on `output` (fires when its gradient is known).
  void on_backward(const at::Tensor& output, std::string fqn, std::string class_name) const;

  /// kPreForward, `f(input)`, kForward and the kBackward registration around one submodule with
  /// one input and one output. Without hooks just `f(input)`.
  at::Tensor around(const std::string& fqn, const std::string& class_name, const at::Tensor& input,
                    const std::function<at::Tensor(const at::Tensor&)>& f) const;

  /// Module::add_hook: checks every requested fqn is "" or one of `hookable` (an Error naming
  /// `model` otherwise) and returns the handle that removes the hook.
  std::shared_ptr<RemovableHandle> add(ModuleHook hook, std::span<const std::string> fqns,
                                       const std::vector<std::string>& hookable, std::string_view model);

 private:
  std::shared_ptr<std::vector<Entry>> entries_ = std::make_shared<std::vector<Entry>>();
  std::uint64_t next_id_ = 1;
};

}  // namespace modalities
