#pragma once
#include "llaisys/tensor.hpp"

// Backends receive validated tensors: logits [B, V] with any strides (updated in place), ids [B, n] (i64)
// and bias [B, n] (f32), both contiguous.
namespace llaisys::ops::cpu {
void logit_bias(const Tensor &logits, const Tensor &ids, const Tensor &bias);
}
namespace llaisys::ops::cuda {
void logit_bias(const Tensor &logits, const Tensor &ids, const Tensor &bias);
}
