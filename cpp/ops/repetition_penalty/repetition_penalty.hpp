#pragma once
#include "llaisys/tensor.hpp"

// Backends receive validated tensors: logits [B, V] with any strides (updated in place), ids [B, n]
// (i64) contiguous, and penalty > 0.
namespace llaisys::ops::cpu {
void repetition_penalty(const Tensor &logits, const Tensor &ids, float penalty);
}
namespace llaisys::ops::cuda {
void repetition_penalty(const Tensor &logits, const Tensor &ids, float penalty);
}
