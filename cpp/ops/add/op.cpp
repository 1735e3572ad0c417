#include "ops/add/add.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {

void add(const Tensor &out, const Tensor &a, const Tensor &b) {
    constexpr const char *op = "add";
    detail::check_elementwise(op, {"out", out}, {"a", a}, {"b", b});
    const Tensor ac = a.contiguous(), bc = b.contiguous();
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::add(dst, ac, bc), cuda::add(dst, ac, bc));
    });
}

} // namespace llaisys::ops
