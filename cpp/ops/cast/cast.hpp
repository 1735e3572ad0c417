#pragma once
#include "llaisys/tensor.hpp"

// Backends receive validated, contiguous tensors of equal numel.
namespace llaisys::ops::cpu {
void cast(const Tensor &out, const Tensor &x);
}
namespace llaisys::ops::cuda {
void cast(const Tensor &out, const Tensor &x);
}
