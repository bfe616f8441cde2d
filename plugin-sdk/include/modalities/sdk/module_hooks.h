// The hook list behind Module::add_hook, for model authors: LibTorch has no module hooks, so a
// model that wants to be wrapped (FSDP, debugging hooks, later TP and activation checkpointing)
// calls them itself around its hookable submodules (the root "" and its blocks):
//
//   class MyModel final : public modalities::Module {
//     modalities::ModuleHooks hooks_;
//     TensorMap forward(const TensorMap& in) override {
//       ...
//       for (std::size_t i = 0; i < blocks_.size(); ++i)  // capture by value: a runner may call it in backward
//         h = hooks_.around(fqn_[i], "MyBlock", h, [block = blocks_[i]](const at::Tensor& x) { return block->forward(x); });
//     }
//     std::shared_ptr<RemovableHandle> add_hook(ModuleHook hook, std::span<const std::string> fqns) override {
//       return hooks_.add(std::move(hook), fqns, block_fqns(), "mymodel");
//     }
//     std::shared_ptr<RemovableHandle> add_block_runner(BlockRunner r, std::span<const std::string> fqns) override {
//       return hooks_.add_runner(std::move(r), fqns, block_fqns(), "mymodel");
//     }
//   };
//
// Hooks and runners are added and removed between steps; kBackward hooks run on autograd's
// threads, so the lists must not change during a step. Used by the bundled gpt2 and by the test model of
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

  struct RunnerEntry {
    std::uint64_t id;
    BlockRunner runner;
    std::unordered_set<std::string> fqns;  // empty: every block
  };

  /// No hooks and no runners: the model may call its blocks directly.
  bool empty() const { return entries_->empty() && runners_->empty(); }
  /// Whether a hook listens to `fqn`.
  bool wants(std::string_view fqn) const;
  /// Whether a runner runs block `fqn` (around() then hands it the block function).
  bool has_runner(const std::string& fqn) const {
    for (const RunnerEntry& r : *runners_)
      if (r.fqns.empty() || r.fqns.contains(fqn)) return true;
    return false;
  }
  /// Calls the hooks of `fqn` at `point`.
  void call(HookPoint point, std::string_view fqn, std::string_view class_name, std::span<const at::Tensor> inputs,
            std::span<const at::Tensor> outputs) const;
  /// Registers the kBackward call of `fqn` on `output` (fires when its gradient is known).
  void on_backward(const at::Tensor& output, std::string fqn, std::string class_name) const;

  /// kPreForward, `f(input)` (through the block's runner if it has one), kForward and the
  /// kBackward registration around one submodule with one input and one output. Without hooks
  /// and runners just `f(input)`. `f` must stay valid until backward (see BlockFunction).
  at::Tensor around(const std::string& fqn, const std::string& class_name, const at::Tensor& input,
                    const BlockFunction& f) const;

  /// Module::add_hook: checks every requested fqn is "" or one of `hookable` (an Error naming
  /// `model` otherwise) and returns the handle that removes the hook.
  std::shared_ptr<RemovableHandle> add(ModuleHook hook, std::span<const std::string> fqns,
                                       const std::vector<std::string>& hookable, std::string_view model);

  /// Module::add_block_runner: every requested fqn must be one of `blocks` (empty: all of them),
  /// and none may have a runner already (an Error naming `model` otherwise).
  std::shared_ptr<RemovableHandle> add_runner(BlockRunner runner, std::span<const std::string> fqns,
                                              const std::vector<std::string>& blocks, std::string_view model);

 private:
  std::shared_ptr<std::vector<Entry>> entries_ = std::make_shared<std::vector<Entry>>();
  std::shared_ptr<std::vector<RunnerEntry>> runners_ = std::make_shared<std::vector<RunnerEntry>>();
  std::uint64_t next_id_ = 1;
};

}  // namespace modalities
