// Activation checkpointing of one block: LibTorch has no torch.utils.checkpoint, so this is the
// autograd node that does it (Note [Recomputing a block] in activation_checkpointing.cpp).
#pragma once

#include <modalities/sdk/interfaces/module.h>

#include <modalities/sdk/selective_checkpoint.h>

#include <ATen/core/Tensor.h>

#include <set>

namespace modalities::plugins::model_wrappers {

/// run(input) without keeping its activations: under grad mode the block runs without autograd
/// and its output gets a node that, in backward, runs the block again (with the random state of
/// the first run, so dropout draws the same masks) and back-propagates through it. Without grad
/// mode just run(input). Usable as a BlockRunner.
at::Tensor checkpointed(const at::Tensor& input, const BlockFunction& run);

/// checkpointed() that keeps the outputs of the ops `save` names from the first run and reuses
/// them in the recomputation (Modalities' selective_op_activation_checkpointing;
/// modalities/sdk/selective_checkpoint.h). Gradients are those of the unchecked block, bit for bit.
at::Tensor selectively_checkpointed(const at::Tensor& input, const BlockFunction& run,
                                    const std::set<selective_checkpoint::Op>& save);

}  // namespace modalities::plugins::model_wrappers
