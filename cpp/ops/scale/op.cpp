#include "ops/scale/scale.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

#include <cmath>

namespace llaisys::ops {

void scale(const Tensor &out, const Tensor &x, float alpha) {
    constexpr const char *op = "scale";
    detail::check_elementwise(op, {"out", out}, {"x", x}, {"x", x});
    LLAISYS_CHECK(std::isfinite(alpha), std::invalid_argument, op, ": alpha must be finite, got ", alpha);
    const Tensor xc = x.contiguous();
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::scale(dst, xc, alpha), cuda::scale(dst, xc, alpha));
    });
}

} // namespace llaisys::ops
