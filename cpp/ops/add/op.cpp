#include "ops/add/add.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {

void add(const Tensor &out, const Tensor &a, const Tensor &b) {
    constexpr const char *op = "add";
    detail::check_defined(op, "out", out);
    detail::check_defined(op, "a", a);
    detail::check_defined(op, "b", b);
    detail::check_same_device(op, {&out, &a, &b});
    detail::check_float(op, "a", a);
    detail::check_same_dtype(op, "b", b, a);
    detail::check_same_dtype(op, "out", out, a);
    detail::check_shape(op, "b", b, a.shape());
    detail::check_shape(op, "out", out, a.shape());
    const Tensor ac = a.contiguous(), bc = b.contiguous();
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::add(dst, ac, bc), cuda::add(dst, ac, bc));
    });
}

} // namespace llaisys::ops
