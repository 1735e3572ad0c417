#include "ops/rms_norm/rms_norm.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

#include <cmath>

namespace llaisys::ops {

void detail::check_rms_norm_args(const char *op, const Tensor &out, const Tensor &x, const Tensor &weight,
                                 float eps) {
    check_operands(op, {{"out", out}, {"x", x}, {"weight", weight}});
    check_float(op, "x", x);
    check_same_dtype(op, "weight", weight, x);
    check_same_dtype(op, "out", out, x);
    LLAISYS_CHECK(x.ndim() >= 1, std::invalid_argument, op, ": x must have at least 1 dim, got a scalar");
    check_shape(op, "weight", weight, {x.shape().back()});
    check_shape(op, "out", out, x.shape());
    LLAISYS_CHECK(eps >= 0.f && std::isfinite(eps), std::invalid_argument, op,
                  ": eps must be finite and >= 0, got ", eps);
}

void rms_norm(const Tensor &out, const Tensor &x, const Tensor &weight, float eps) {
    constexpr const char *op = "rms_norm";
    detail::check_rms_norm_args(op, out, x, weight, eps);
    if (x.numel() == 0) return;
    const Tensor xc = x.contiguous(), wc = weight.contiguous();
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::rms_norm(dst, xc, wc, eps), cuda::rms_norm(dst, xc, wc, eps));
    });
}

} // namespace llaisys::ops
