#pragma once
#include "llaisys/tensor.hpp"
#include "ops/common/rms_norm_rows.hpp"

// Backends receive validated tensors, weight [D] contiguous: rms_norm takes x/out [rows, D] contiguous
// (flattened); rms_norm_rows takes x and out of one shape [..., D] whose rows start where their RowMaps
// say (distinct rows of out, and x either out's very view or not sharing its memory).
namespace llaisys::ops::cpu {
void rms_norm(const Tensor &out, const Tensor &x, const Tensor &weight, float eps);
void rms_norm_rows(const Tensor &out, const Tensor &x, const Tensor &weight, float eps, const RowMap &om,
                   const RowMap &xm);
} // namespace llaisys::ops::cpu
namespace llaisys::ops::cuda {
void rms_norm(const Tensor &out, const Tensor &x, const Tensor &weight, float eps);
void rms_norm_rows(const Tensor &out, const Tensor &x, const Tensor &weight, float eps, const RowMap &om,
                   const RowMap &xm);
}
