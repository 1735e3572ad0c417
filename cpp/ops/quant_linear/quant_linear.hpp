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
// add_rms_norm_quant_linear as one GEMV that computes the norm itself, when it can reproduce add_rms_norm's
// bits for these operands (all contiguous [M, K] / [K], out [M, N]); false (nothing launched) otherwise.
bool add_rms_norm_quant_linear(const Tensor &out, const Tensor &residual_out, const Tensor &residual,
                               const Tensor &delta, const Tensor &norm_weight, float eps, const QuantMatrix &weight,
                               const Tensor &bias, bool swiglu);
} // namespace llaisys::ops::cuda
