#pragma once
#include "llaisys/tensor.hpp"

// Backends receive validated, contiguous tensors.
namespace llaisys::ops::cpu {
void add(const Tensor &out, const Tensor &a, const Tensor &b);
}
namespace llaisys::ops::cuda {
void add(const Tensor &out, const Tensor &a, const Tensor &b);
}
