#include "ops/cast/cast.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {

void cast(const Tensor &out, const Tensor &x) {
    constexpr const char *op = "cast";
    detail::check_operands(op, {{"out", out}, {"x", x}});
    detail::check_shape(op, "out", out, x.shape());
    detail::check_float(op, "out", out);
    LLAISYS_CHECK(is_float(x.dtype()) || x.dtype() == DType::I32 || x.dtype() == DType::I64, TypeError, op,
                  ": cannot convert from ", dtype_name(x.dtype()), " (expected f32, f16, bf16, i32 or i64)");
    if (out.dtype() == x.dtype()) return rearrange(out, x);
    const Tensor xc = x.contiguous();
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::cast(dst, xc), cuda::cast(dst, xc));
    });
}

Tensor to_dtype(const Tensor &x, DType dtype) {
    if (dtype == x.dtype()) return x;
    Tensor out = Tensor::empty(x.shape(), dtype, x.device());
    cast(out, x);
    return out;
}

} // namespace llaisys::ops
