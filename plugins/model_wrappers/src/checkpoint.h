// Activation checkpointing of one block: LibTorch has no torch.utils.checkpoint, so this is the
// autograd node that does it (Note [Recomputing a block] in checkpoint.cpp).
#pragma once

#include <modalities/sdk/interfaces/module.h>

#include <ATen/core/Tensor.h>

namespace modalities::plugins::model_wrappers {

/// run(input) without keeping its activations: under grad mode the block runs without autograd
/// and its output gets a node that, in backward, runs the block again (with the random state of
/// the first run, so dropout draws the same masks) and back-propagates through it. Without grad
/// mode just run(input). Usable as a BlockRunner.
at::Tensor checkpointed(const at::Tensor& input, const BlockFunction& run);

}  // namespace modalities::plugins::model_wrappers
