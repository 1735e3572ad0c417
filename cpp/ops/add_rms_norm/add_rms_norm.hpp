#pragma once
#include "llaisys/tensor.hpp"

// Backends receive validated, contiguous tensors: out/residual/x [rows, D] flattened, weight [D].
// residual is read and written. x_weight: undefined, or contiguous [D] (x is rms_norm'ed with it first).
namespace llaisys::ops::cpu {
void add_rms_norm(const Tensor &out, const Tensor &residual, const Tensor &x, const Tensor &weight, float eps,
                  const Tensor &x_weight);
}
namespace llaisys::ops::cuda {
void add_rms_norm(const Tensor &out, const Tensor &residual, const Tensor &x, const Tensor &weight, float eps,
                  const Tensor &x_weight);
}
