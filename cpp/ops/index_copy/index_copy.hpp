#pragma once
#include "llaisys/tensor.hpp"

// Backends receive contiguous out/src viewed as [rows, row_bytes] and a contiguous index [n].
namespace llaisys::ops::cpu {
void index_copy(const Tensor &out, const Tensor &index, const Tensor &src, int64_t row_bytes);
}
namespace llaisys::ops::cuda {
void index_copy(const Tensor &out, const Tensor &index, const Tensor &src, int64_t row_bytes);
}
