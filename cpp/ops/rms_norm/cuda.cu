#include "ops/rms_norm/rms_norm.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/rms_norm_rows.cuh"

namespace llaisys::ops::cuda {

void rms_norm(const Tensor &out, const Tensor &x, const Tensor &weight, float eps) {
    detail::dispatch_float("rms_norm", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        launch_rms_norm<T, false>(out, nullptr, x, weight, eps);
    });
}

void rms_norm_rows(const Tensor &out, const Tensor &x, const Tensor &weight, float eps, const RowMap &om,
                   const RowMap &xm) {
    const RowMap maps[2] = {om, xm};
    detail::dispatch_float("rms_norm", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        launch_rms_norm<T, false>(out, nullptr, x, weight, eps, maps);
    });
}

} // namespace llaisys::ops::cuda
