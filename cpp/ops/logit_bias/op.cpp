#include "ops/logit_bias/logit_bias.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {

void logit_bias(const Tensor &logits, const Tensor &ids, const Tensor &bias) {
    constexpr const char *op = "logit_bias";
    detail::check_defined(op, "logits", logits);
    detail::check_defined(op, "ids", ids);
    detail::check_defined(op, "bias", bias);
    detail::check_same_device(op, {&logits, &ids, &bias});
    detail::check_float(op, "logits", logits);
    detail::check_dtype(op, "ids", ids, DType::I64);
    detail::check_dtype(op, "bias", bias, DType::F32);
    detail::check_ndim(op, "logits", logits, 2);
    detail::check_ndim(op, "ids", ids, 2);
    LLAISYS_CHECK(ids.size(0) == logits.size(0), std::invalid_argument, op, ": ids must have ", logits.size(0),
                  " rows like logits, got shape ", shape_str(ids.shape()));
    detail::check_shape(op, "bias", bias, ids.shape());
    if (ids.numel() == 0) return;
    const Tensor idc = ids.contiguous(), bc = bias.contiguous();
    LLAISYS_DEVICE_DISPATCH(op, logits.device(), cpu::logit_bias(logits, idc, bc), cuda::logit_bias(logits, idc, bc));
}

} // namespace llaisys::ops
