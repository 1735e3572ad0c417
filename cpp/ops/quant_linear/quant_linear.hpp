#pragma once
#include "llaisys/quant.hpp"

// Backends receive validated operands: out [M, N] contiguous, x [M, K] with dense rows ld(x) elements
// apart, weight [N, K] on the same device, bias [N] contiguous or undefined; out, x, bias share a float
// dtype. M, N >= 1. Embedding gets out [n, D] contiguous and ids [n] contiguous, range-checked on the
// CPU; the CUDA kernel checks them itself (device error flag, raised at synchronize). Dequantize gets out
// [rows, cols] contiguous.
namespace llaisys::ops::cpu {
void quant_linear(const Tensor &out, const Tensor &x, const QuantMatrix &weight, const Tensor &bias);
void quant_linear_swiglu(const Tensor &out, const Tensor &x, const QuantMatrix &w_gate_up);
void quant_embedding(const Tensor &out, const Tensor &ids, const QuantMatrix &weight);
void quant_dequantize(const Tensor &out, const QuantMatrix &weight);
} // namespace llaisys::ops::cpu
namespace llaisys::ops::cuda {
void quant_linear(const Tensor &out, const Tensor &x, const QuantMatrix &weight, const Tensor &bias);
void quant_linear_swiglu(const Tensor &out, const Tensor &x, const QuantMatrix &w_gate_up);
void quant_embedding(const Tensor &out, const Tensor &ids, const QuantMatrix &weight);
void quant_dequantize(const Tensor &out, const QuantMatrix &weight);
} // namespace llaisys::ops::cuda
