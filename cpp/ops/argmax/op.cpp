#include "ops/argmax/argmax.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

#include <cstdint>

namespace llaisys::ops {

void argmax(const Tensor &max_idx, const Tensor &max_val, const Tensor &x) {
    constexpr const char *op = "argmax";
    detail::check_operands(op, {{"max_idx", max_idx}, {"max_val", max_val}, {"x", x}});
    detail::check_float(op, "x", x);
    detail::check_dtype(op, "max_idx", max_idx, DType::I64);
    detail::check_same_dtype(op, "max_val", max_val, x);
    LLAISYS_CHECK(x.ndim() >= 1, std::invalid_argument, op, ": x must have at least 1 dim, got a scalar");
    const int64_t V = x.shape().back();
    LLAISYS_CHECK(V >= 1, std::invalid_argument, op, ": the last dim of x must be >= 1, got shape ",
                  shape_str(x.shape()));
    // Kernels index within a row with 32-bit ints.
    LLAISYS_CHECK(V <= INT32_MAX, std::invalid_argument, op, ": the last dim of x must be < 2^31, got ", V);
    const Shape lead(x.shape().begin(), x.shape().end() - 1);
    detail::check_shape(op, "max_idx", max_idx, lead);
    detail::check_shape(op, "max_val", max_val, lead);
    if (x.numel() == 0) return;
    const Tensor xc = x.contiguous();
    detail::with_contiguous_out(max_idx, [&](const Tensor &idx) {
        detail::with_contiguous_out(max_val, [&](const Tensor &val) {
            LLAISYS_DEVICE_DISPATCH(op, xc.device(), cpu::argmax(idx, val, xc), cuda::argmax(idx, val, xc));
        });
    });
}

} // namespace llaisys::ops
