#include "ops/embedding/embedding.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {

void embedding(const Tensor &out, const Tensor &ids, const Tensor &weight) {
    constexpr const char *op = "embedding";
    detail::check_operands(op, {{"out", out}, {"ids", ids}, {"weight", weight}});
    detail::check_index(op, "ids", ids);
    detail::check_float(op, "weight", weight);
    detail::check_same_dtype(op, "out", out, weight);
    detail::check_ndim(op, "ids", ids, 1);
    detail::check_ndim(op, "weight", weight, 2);
    detail::check_shape(op, "out", out, {ids.size(0), weight.size(1)});
    if (ids.numel() == 0) return;
    const Tensor idc = ids.contiguous(), wc = weight.contiguous();
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::embedding(dst, idc, wc), cuda::embedding(dst, idc, wc));
    });
}

} // namespace llaisys::ops
