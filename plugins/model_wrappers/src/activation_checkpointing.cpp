// Note [Recomputing a block]
// The forward runs the block under NoGradGuard, so nothing inside it is saved, and gives its
// output a hand-made autograd node whose only next edge is the block input's. When the output's
// gradient arrives, the node detaches the saved input, runs the block again with grad mode on and
// calls backward() on the recomputed output from inside the backward pass (a reentrant backward,
// as torch.utils.checkpoint's reentrant variant does): the block's parameter gradients accumulate
// where they always do (their AccumulateGrad nodes and hooks, e.g. fsdp2_wrapped's reduce-scatter)
// and the input's gradient is returned to the outer graph. The random state (CPU generator, and
// the CUDA generator of the input's device) is captured before the first run and swapped in for
// the second, so dropout masks are the same and gradients equal those of the unchecked block bit
// for bit. (Modalities' full_activation_checkpointing does not preserve it; its FSDP1 variant
// does.) Hooks around the block (sharding) are outside: the runner only sees the block itself.
#include "activation_checkpointing.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#if defined(MODALITIES_WITH_CUDA)
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include <cstdint>
#include <mutex>
#include <optional>
#include <utility>

namespace modalities::plugins::model_wrappers {
namespace {

// The generators a block's random ops draw from, and their states at one moment.
struct RandomState {
  at::Generator cpu;
  at::Tensor cpu_state;
  std::optional<at::Generator> device;
  at::Tensor device_state;

  static RandomState capture(const at::Tensor& input) {
    RandomState s;
    s.cpu = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard lock(s.cpu.mutex());
      s.cpu_state = s.cpu.get_state();
    }
#if defined(MODALITIES_WITH_CUDA)
    if (input.is_cuda()) {
      s.device = at::cuda::detail::getDefaultCUDAGenerator(input.device().index());
      std::lock_guard lock(s.device->mutex());
      s.device_state = s.device->get_state();
    }
#else
    (void)input;
#endif
    return s;
  }

  // Sets these states; returns the ones they replaced.
  RandomState swap_in() {
    RandomState before;
    before.cpu = cpu;
    {
      std::lock_guard lock(cpu.mutex());
      before.cpu_state = cpu.get_state();
      cpu.set_state(cpu_state);
    }
    if (device) {
      before.device = device;
      std::lock_guard lock(device->mutex());
      before.device_state = device->get_state();
      device->set_state(device_state);
    }
    return before;
  }
};

// Puts the generators back as they were when it leaves scope (also when the block throws).
class RandomStateScope {
 public:
  explicit RandomStateScope(RandomState& inside) : outside_(inside.swap_in()) {}
  ~RandomStateScope() {
    try {
      outside_.swap_in();
    } catch (...) {  // set_state of a state we just read cannot fail; never throw from here
    }
  }
  RandomStateScope(const RandomStateScope&) = delete;
  RandomStateScope& operator=(const RandomStateScope&) = delete;

 private:
  RandomState outside_;
};

// The outputs a selective block kept in its first run and the policy that chose them (null for a
// fully checkpointed block).
struct Selective {
  std::set<selective_checkpoint::Op> save;
  std::shared_ptr<selective_checkpoint::Kept> kept = std::make_shared<selective_checkpoint::Kept>();
};

class RecomputeBlock final : public torch::autograd::Node {
 public:
  RecomputeBlock(BlockFunction run, at::Tensor input, bool input_requires_grad, RandomState random,
                 std::shared_ptr<Selective> selective)
      : run_(std::move(run)),
        input_(std::move(input)),
        input_version_(input_._version()),
        input_requires_grad_(input_requires_grad),
        random_(std::move(random)),
        selective_(std::move(selective)) {}

  std::string name() const override { return "ActivationCheckpointBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};  // nothing flows back through this block
    TORCH_CHECK(run_,
                "activation checkpointing: the block was already recomputed and released; a second "
                "backward through it needs retain_graph");
    TORCH_CHECK(input_._version() == input_version_,
                "activation checkpointing: a checkpointed block's input was modified in place after its forward "
                "(version ",
                input_version_, " -> ", input_._version(), "); the recomputation would differ");
    at::Tensor x = input_.detach().requires_grad_(input_requires_grad_);
    at::Tensor y;
    {
      RandomStateScope random(random_);
      at::AutoGradMode grad_mode(true);
      std::optional<selective_checkpoint::Pass> pass;
      if (selective_) {
        selective_->kept->next = 0;  // every recomputation reads the kept outputs from the start
        pass.emplace(selective_->save, selective_->kept, /*recompute=*/true);
      }
      y = run_(x);
      TORCH_CHECK(!selective_ || selective_->kept->next == selective_->kept->entries.size(),
                  "selective activation checkpointing: the recomputation of a block did not use every op output its "
                  "first forward kept (the block ran different ops the second time)");
    }
    if (y.requires_grad()) torch::autograd::backward({y}, {grads[0]});
    at::Tensor input_grad = input_requires_grad_ ? x.grad() : at::Tensor();
    return {input_grad};
  }

  void release_variables() override {
    input_ = at::Tensor();
    run_ = nullptr;
    selective_.reset();
  }

 private:
  BlockFunction run_;
  at::Tensor input_;
  std::uint32_t input_version_;
  bool input_requires_grad_;
  RandomState random_;
  std::shared_ptr<Selective> selective_;
};

at::Tensor run_checkpointed(const at::Tensor& input, const BlockFunction& run, std::shared_ptr<Selective> selective) {
  if (!at::GradMode::is_enabled()) return run(input);
  RandomState random = RandomState::capture(input);
  at::Tensor output;
  {
    at::NoGradGuard no_grad;
    std::optional<selective_checkpoint::Pass> pass;
    if (selective) pass.emplace(selective->save, selective->kept, /*recompute=*/false);
    output = run(input);
  }
  auto node = std::shared_ptr<RecomputeBlock>(
      new RecomputeBlock(run, input.detach(), input.requires_grad(), std::move(random), std::move(selective)),
      torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  torch::autograd::create_gradient_edge(output, node);
  return output;
}

}  // namespace

at::Tensor checkpointed(const at::Tensor& input, const BlockFunction& run) {
  return run_checkpointed(input, run, nullptr);
}

at::Tensor selectively_checkpointed(const at::Tensor& input, const BlockFunction& run,
                                    const std::set<selective_checkpoint::Op>& save) {
  auto selective = std::make_shared<Selective>();
  selective->save = save;
  return run_checkpointed(input, run, std::move(selective));
}

}  // namespace modalities::plugins::model_wrappers
