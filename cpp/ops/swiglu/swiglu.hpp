#pragma once
#include "llaisys/tensor.hpp"

// Backends receive validated, contiguous tensors of one shape; out may alias gate or up.
namespace llaisys::ops::cpu {
void swiglu(const Tensor &out, const Tensor &gate, const Tensor &up);
// out[i] = swiglu(gate[i], up[i]) for i < n on this thread, the op's arithmetic and bits (T: f32, bf16,
// f16): quant_linear_swiglu's decode applies it to each chunk of rows as their g and u come out.
template <typename T>
void swiglu_span(T *out, const T *gate, const T *up, int64_t n);
}
namespace llaisys::ops::cuda {
void swiglu(const Tensor &out, const Tensor &gate, const Tensor &up);
}
