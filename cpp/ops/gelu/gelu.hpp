#pragma once
#include "llaisys/tensor.hpp"

// Backends receive validated, contiguous tensors of one shape; up is undefined for gelu (no gate); out may
// alias an input.
namespace llaisys::ops::cpu {
void gelu(const Tensor &out, const Tensor &x, const Tensor &up, bool tanh_approx);
}
namespace llaisys::ops::cuda {
void gelu(const Tensor &out, const Tensor &x, const Tensor &up, bool tanh_approx);
}
