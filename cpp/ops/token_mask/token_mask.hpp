#pragma once
#include "llaisys/tensor.hpp"

// Backends receive validated tensors: logits [B, V] with any strides (updated in place) and mask
// [B, ceil(V / 32)] (i32, contiguous).
namespace llaisys::ops::cpu {
void token_mask(const Tensor &logits, const Tensor &mask);
}
namespace llaisys::ops::cuda {
void token_mask(const Tensor &logits, const Tensor &mask);
}
