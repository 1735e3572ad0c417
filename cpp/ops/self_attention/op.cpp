// TEMPORARY STUB: replaced by the real op in this change set.
#include "llaisys/ops.hpp"

namespace llaisys::ops {
void self_attention(const Tensor &, const Tensor &, const Tensor &, const Tensor &, float) { throw std::runtime_error("self_attention: not implemented yet"); }
} // namespace llaisys::ops
