#include "ops/logit_bias/logit_bias.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {

void logit_bias(const Tensor &logits, const Tensor &ids, const Tensor &bias) {
    constexpr const char *op = "logit_bias";
    detail::check_operands(op, {{"logits", logits}, {"ids", ids}, {"bias", bias}});
    detail::check_logits_ids(op, logits, ids);
    detail::check_dtype(op, "bias", bias, DType::F32);
    detail::check_shape(op, "bias", bias, ids.shape());
    if (ids.numel() == 0) return;
    const Tensor idc = ids.contiguous(), bc = bias.contiguous();
    LLAISYS_DEVICE_DISPATCH(op, logits.device(), cpu::logit_bias(logits, idc, bc), cuda::logit_bias(logits, idc, bc));
}

} // namespace llaisys::ops
