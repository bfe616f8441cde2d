// LibTorch headers precompiled once and shared by the SDK and every in-tree
// plugin built with modalities_add_plugin(... TORCH). Keep it to headers that
// most tensor code needs; never include this from a public header.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/functional.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>
