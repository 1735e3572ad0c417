#include "ops/gelu/gelu.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {

void gelu(const Tensor &out, const Tensor &x, bool tanh_approx) {
    constexpr const char *op = "gelu";
    detail::check_operands(op, {{"out", out}, {"x", x}});
    detail::check_float(op, "x", x);
    detail::check_same_dtype(op, "out", out, x);
    detail::check_shape(op, "out", out, x.shape());
    if (x.numel() == 0) return;
    const Tensor xc = x.contiguous();
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::gelu(dst, xc, Tensor(), tanh_approx),
                                cuda::gelu(dst, xc, Tensor(), tanh_approx));
    });
}

void geglu(const Tensor &out, const Tensor &gate, const Tensor &up, bool tanh_approx) {
    constexpr const char *op = "geglu";
    detail::check_elementwise(op, {"out", out}, {"gate", gate}, {"up", up});
    if (gate.numel() == 0) return;
    const Tensor gc = gate.contiguous(), uc = up.contiguous();
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::gelu(dst, gc, uc, tanh_approx),
                                cuda::gelu(dst, gc, uc, tanh_approx));
    });
}

} // namespace llaisys::ops
