#pragma once
#include "llaisys/tensor.hpp"

// Backends receive validated, contiguous tensors.
namespace llaisys::ops::cpu {
void scale(const Tensor &out, const Tensor &x, float alpha);
}
namespace llaisys::ops::cuda {
void scale(const Tensor &out, const Tensor &x, float alpha);
}
