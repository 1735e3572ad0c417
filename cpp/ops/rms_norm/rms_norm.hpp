#pragma once
#include "llaisys/tensor.hpp"

#include <cstdint>

namespace llaisys::ops::detail {
// The argument checks rms_norm and add_rms_norm share: x [..., D], weight [D], out like x, eps >= 0.
void check_rms_norm_args(const char *op, const Tensor &out, const Tensor &x, const Tensor &weight, float eps);
} // namespace llaisys::ops::detail

// Backends receive validated, contiguous tensors: x/out [rows, D] flattened, weight [D].
namespace llaisys::ops::cpu {
void rms_norm(const Tensor &out, const Tensor &x, const Tensor &weight, float eps);
// One row: out [D] = x [D] * rsqrt(mean(x^2) + eps) * weight [D]. Shared with add_rms_norm so that the
// fused op runs the very same machine code as rms_norm (bit-identical results). T in {float, f16_t, bf16_t}.
template <typename T>
void rms_norm_row(T *out, const T *x, const T *weight, int64_t D, float eps);
} // namespace llaisys::ops::cpu
namespace llaisys::ops::cuda {
void rms_norm(const Tensor &out, const Tensor &x, const Tensor &weight, float eps);
}
