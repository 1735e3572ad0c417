#include "ops/token_mask/token_mask.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {

void token_mask(const Tensor &logits, const Tensor &mask) {
    constexpr const char *op = "token_mask";
    detail::check_operands(op, {{"logits", logits}, {"mask", mask}});
    detail::check_float(op, "logits", logits);
    detail::check_ndim(op, "logits", logits, 2);
    detail::check_dtype(op, "mask", mask, DType::I32);
    detail::check_shape(op, "mask", mask, {logits.size(0), (logits.size(1) + 31) / 32});
    if (logits.numel() == 0) return;
    const Tensor mc = mask.contiguous();
    LLAISYS_DEVICE_DISPATCH(op, logits.device(), cpu::token_mask(logits, mc), cuda::token_mask(logits, mc));
}

} // namespace llaisys::ops
