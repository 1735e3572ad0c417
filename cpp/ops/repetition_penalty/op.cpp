#include "ops/repetition_penalty/repetition_penalty.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

#include <cmath>

namespace llaisys::ops {

void repetition_penalty(const Tensor &logits, const Tensor &ids, float penalty) {
    constexpr const char *op = "repetition_penalty";
    detail::check_operands(op, {{"logits", logits}, {"ids", ids}});
    detail::check_logits_ids(op, logits, ids);
    LLAISYS_CHECK(penalty > 0.f && std::isfinite(penalty), std::invalid_argument, op,
                  ": penalty must be a finite number > 0, got ", penalty);
    if (ids.numel() == 0) return;
    // The kernels follow logits' strides: it is updated in place, so no contiguous copy is made.
    const Tensor idc = ids.contiguous();
    LLAISYS_DEVICE_DISPATCH(op, logits.device(), cpu::repetition_penalty(logits, idc, penalty),
                            cuda::repetition_penalty(logits, idc, penalty));
}

} // namespace llaisys::ops
