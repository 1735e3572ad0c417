#pragma once
#include "llaisys/tensor.hpp"

// Backends receive validated tensors: logits [B, V] with any strides (updated in place), seen [S, W] (i32,
// contiguous, W = ceil(V / 32)), rows [B] (i32, contiguous), penalty [B] (f32, contiguous), ids [B] (i64,
// contiguous). On the host every row index, penalty and id has been checked; on a device (no sync) a row index
// outside [0, S) or an id outside [0, 32 W) is skipped like -1.
namespace llaisys::ops::cpu {
void seen_penalty(const Tensor &logits, const Tensor &seen, const Tensor &rows, const Tensor &penalty);
void seen_mark(const Tensor &seen, const Tensor &rows, const Tensor &ids);
}
namespace llaisys::ops::cuda {
void seen_penalty(const Tensor &logits, const Tensor &seen, const Tensor &rows, const Tensor &penalty);
void seen_mark(const Tensor &seen, const Tensor &rows, const Tensor &ids);
}
