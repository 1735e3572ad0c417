#pragma once
#include "llaisys/tensor.hpp"

// Backends receive validated tensors: x contiguous [rows, V] (V >= 1) viewed through its last dim,
// max_idx [rows] (i64) and max_val [rows] (x's dtype) contiguous.
namespace llaisys::ops::cpu {
void argmax(const Tensor &max_idx, const Tensor &max_val, const Tensor &x);
} // namespace llaisys::ops::cpu

namespace llaisys::ops::cuda {
void argmax(const Tensor &max_idx, const Tensor &max_val, const Tensor &x);
}
