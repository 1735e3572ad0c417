// What rms_norm shares with the ops that fuse it (add_rms_norm, add_rms_norm_quant_linear): the argument
// checks, the RowMap of strided rows, and the CPU row kernel (rms_norm_rows.cpp). The CUDA row kernels are
// in rms_norm_rows.cuh.
#pragma once
#include "llaisys/tensor.hpp"

#include <cstdint>

namespace llaisys::ops::detail {
// The argument checks rms_norm and add_rms_norm share: x [..., D], weight [D], out like x, eps >= 0.
void check_rms_norm_args(const char *op, const Tensor &out, const Tensor &x, const Tensor &weight, float eps);
} // namespace llaisys::ops::detail

namespace llaisys::ops {
// Where each row of a view [..., D] with a unit last stride starts: its leading dims collapse into at most
// two, (outer, inner), and row r = (r / inner, r % inner) starts s_outer * (r / inner) + s_inner * (r %
// inner) elements past the view's data. E.g. q/k of a fused QKV row viewed as [T, heads, hd]: inner =
// heads, s_inner = hd, s_outer = the QKV row stride.
struct RowMap {
    int64_t inner, s_outer, s_inner;
};
} // namespace llaisys::ops

namespace llaisys::ops::cpu {
// One row: out [D] = x [D] * rsqrt(mean(x^2) + eps) * weight [D]. Shared with add_rms_norm so that the
// fused op runs the very same machine code as rms_norm (bit-identical results). T in {float, f16_t, bf16_t}.
template <typename T>
void rms_norm_row(T *out, const T *x, const T *weight, int64_t D, float eps);
} // namespace llaisys::ops::cpu
