#include "ops/swiglu/swiglu.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {

void swiglu(const Tensor &out, const Tensor &gate, const Tensor &up) {
    constexpr const char *op = "swiglu";
    detail::check_elementwise(op, {"out", out}, {"gate", gate}, {"up", up});
    if (gate.numel() == 0) return;
    const Tensor gc = gate.contiguous(), uc = up.contiguous();
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::swiglu(dst, gc, uc), cuda::swiglu(dst, gc, uc));
    });
}

} // namespace llaisys::ops
