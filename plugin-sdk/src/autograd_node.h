// Internal to the SDK library: an op computed without autograd, given a backward of our own (the
// differentiable collectives of tensor_parallel.cpp and collectives.cpp). Not installed.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace modalities::detail {

using Backward = std::function<at::Tensor(const at::Tensor& grad)>;

/// A graph node with one input and one output, whose backward is a function. An undefined
/// incoming gradient gives an undefined result, or, for a collective (whose every rank must take
/// part), zeros of the output's shape passed through the backward.
class FunctionNode final : public torch::autograd::Node {
 public:
  FunctionNode(std::string name, Backward backward, bool collective, std::vector<std::int64_t> sizes,
               at::TensorOptions options)
      : name_(std::move(name)),
        backward_(std::move(backward)),
        collective_(collective),
        sizes_(std::move(sizes)),
        options_(options) {}
  std::string name() const override { return name_; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (grads[0].defined()) return {backward_(grads[0])};
    if (!collective_) return {at::Tensor()};
    return {backward_(at::zeros(sizes_, options_))};
  }
  void release_variables() override { backward_ = nullptr; }

 private:
  std::string name_;
  Backward backward_;
  bool collective_;
  std::vector<std::int64_t> sizes_;  // of the output
  at::TensorOptions options_;
};

/// `output` (computed without autograd) as the result of an op on `input` with this backward.
/// `collective`: the backward communicates, so it runs also when the output gets no gradient.
inline at::Tensor attach(const at::Tensor& input, at::Tensor output, const char* name, Backward backward,
                         bool collective = false) {
  if (!at::GradMode::is_enabled() || !input.requires_grad()) return output;
  auto node = std::shared_ptr<FunctionNode>(
      new FunctionNode(name, std::move(backward), collective, output.sizes().vec(), output.options()),
      torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  torch::autograd::create_gradient_edge(output, node);
  return output;
}

}  // namespace modalities::detail
