#pragma once
#include "llaisys/tensor.hpp"

// Backends receive validated tensors: ids [n] (i64 or i32) and weight [V, D] contiguous, out [n, D]
// contiguous with weight's dtype.
namespace llaisys::ops::cpu {
void embedding(const Tensor &out, const Tensor &ids, const Tensor &weight);
}
namespace llaisys::ops::cuda {
void embedding(const Tensor &out, const Tensor &ids, const Tensor &weight);
}
