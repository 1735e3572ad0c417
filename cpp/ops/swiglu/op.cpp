#include "ops/swiglu/swiglu.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {

void swiglu(const Tensor &out, const Tensor &gate, const Tensor &up) {
    constexpr const char *op = "swiglu";
    detail::check_defined(op, "out", out);
    detail::check_defined(op, "gate", gate);
    detail::check_defined(op, "up", up);
    detail::check_same_device(op, {&out, &gate, &up});
    detail::check_float(op, "gate", gate);
    detail::check_same_dtype(op, "up", up, gate);
    detail::check_same_dtype(op, "out", out, gate);
    detail::check_shape(op, "up", up, gate.shape());
    detail::check_shape(op, "out", out, gate.shape());
    if (gate.numel() == 0) return;
    const Tensor gc = gate.contiguous(), uc = up.contiguous();
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::swiglu(dst, gc, uc), cuda::swiglu(dst, gc, uc));
    });
}

} // namespace llaisys::ops
