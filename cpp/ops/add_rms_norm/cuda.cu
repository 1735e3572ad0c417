#include "ops/add_rms_norm/add_rms_norm.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/rms_norm_rows.cuh"

namespace llaisys::ops::cuda {

void add_rms_norm(const Tensor &out, const Tensor &residual, const Tensor &x, const Tensor &weight, float eps) {
    detail::dispatch_float("add_rms_norm", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        launch_rms_norm<T, true>(out, &residual, x, weight, eps);
    });
}

} // namespace llaisys::ops::cuda
