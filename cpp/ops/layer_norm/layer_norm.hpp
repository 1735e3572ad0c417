#pragma once
#include "llaisys/tensor.hpp"

namespace llaisys::ops::detail {
// The argument checks layer_norm and add_layer_norm share: x [..., H] (named x_name in messages), weight
// [H], bias [H] or undefined, out like x, all one float dtype on one device, eps finite and >= 0. names: what
// messages call out, weight and bias (add_layer_norm's second output: out2, weight2, bias2).
struct NormNames {
    const char *out = "out", *weight = "weight", *bias = "bias";
};
void check_layer_norm_args(const char *op, const Tensor &out, const char *x_name, const Tensor &x,
                           const Tensor &weight, const Tensor &bias, float eps, NormNames names = {});
} // namespace llaisys::ops::detail

// Backends receive validated, contiguous tensors: out/x (and residual, delta, delta2) [rows, H] flattened,
// weight/bias [H]; bias and delta2 may be undefined. residual is read and written. out2 (with weight2, bias2)
// is undefined or a second output like out.
namespace llaisys::ops::cpu {
void layer_norm(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, float eps);
void add_layer_norm(const Tensor &out, const Tensor &residual, const Tensor &delta, const Tensor &delta2,
                    const Tensor &weight, const Tensor &bias, float eps, const Tensor &out2, const Tensor &weight2,
                    const Tensor &bias2);
} // namespace llaisys::ops::cpu
namespace llaisys::ops::cuda {
void layer_norm(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, float eps);
void add_layer_norm(const Tensor &out, const Tensor &residual, const Tensor &delta, const Tensor &delta2,
                    const Tensor &weight, const Tensor &bias, float eps, const Tensor &out2, const Tensor &weight2,
                    const Tensor &bias2);
} // namespace llaisys::ops::cuda
