#pragma once
#include "llaisys/tensor.hpp"
#include "ops/common/row_stride.hpp"

// Backends receive validated 2-D operands whose rows are dense (unit column stride) but may sit a
// row stride apart, so a column slice of a wider weight is used in place rather than copied:
//   out [M, N] contiguous, x [M, K] (row stride ld(x)), weight [N, K] (row stride ld(weight)),
//   bias [N] contiguous or an undefined Tensor. M, N >= 1; K may be 0 (out = bias or 0).
// ld is detail::ld (ops/common/row_stride.hpp), which quant_linear's backends use too.
// linear_swiglu / linear_geglu get the same with weight [2I, K] (gate rows, then up rows), out [M, I] and no
// bias; linear_gelu gets linear's operands.
namespace llaisys::ops::cpu {
void linear(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias);
void linear_swiglu(const Tensor &out, const Tensor &x, const Tensor &w_gate_up);
void linear_geglu(const Tensor &out, const Tensor &x, const Tensor &w_gate_up, bool tanh_approx);
void linear_gelu(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, bool tanh_approx);
}
// constant_weight (ops.hpp): no kernel writes weight any more, so the GEMV may read it before pdl_wait.
namespace llaisys::ops::cuda {
void linear(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, bool constant_weight);
void linear_swiglu(const Tensor &out, const Tensor &x, const Tensor &w_gate_up, bool constant_weight);
void linear_geglu(const Tensor &out, const Tensor &x, const Tensor &w_gate_up, bool tanh_approx, bool constant_weight);
void linear_gelu(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, bool tanh_approx,
                 bool constant_weight);
}
