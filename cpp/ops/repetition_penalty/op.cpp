#include "ops/repetition_penalty/repetition_penalty.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

#include <cmath>

namespace llaisys::ops {

void repetition_penalty(const Tensor &logits, const Tensor &ids, float penalty) {
    constexpr const char *op = "repetition_penalty";
    detail::check_defined(op, "logits", logits);
    detail::check_defined(op, "ids", ids);
    detail::check_same_device(op, {&logits, &ids});
    detail::check_float(op, "logits", logits);
    detail::check_dtype(op, "ids", ids, DType::I64);
    detail::check_ndim(op, "logits", logits, 2);
    detail::check_ndim(op, "ids", ids, 2);
    LLAISYS_CHECK(ids.size(0) == logits.size(0), std::invalid_argument, op, ": ids must have ", logits.size(0),
                  " rows like logits, got shape ", shape_str(ids.shape()));
    LLAISYS_CHECK(penalty > 0.f && std::isfinite(penalty), std::invalid_argument, op,
                  ": penalty must be a finite number > 0, got ", penalty);
    if (ids.numel() == 0) return;
    // The kernels follow logits' strides: it is updated in place, so no contiguous copy is made.
    const Tensor idc = ids.contiguous();
    LLAISYS_DEVICE_DISPATCH(op, logits.device(), cpu::repetition_penalty(logits, idc, penalty),
                            cuda::repetition_penalty(logits, idc, penalty));
}

} // namespace llaisys::ops
