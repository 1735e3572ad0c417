// TEMPORARY STUB: replaced by the real op in this change set.
#include "llaisys/ops.hpp"

namespace llaisys::ops {
void repetition_penalty(const Tensor &, const Tensor &, float) { throw std::runtime_error("repetition_penalty: not implemented yet"); }
} // namespace llaisys::ops
