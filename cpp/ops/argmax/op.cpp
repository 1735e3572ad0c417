// TEMPORARY STUB: replaced by the real op in this change set.
#include "llaisys/ops.hpp"

namespace llaisys::ops {
void argmax(const Tensor &, const Tensor &, const Tensor &) { throw std::runtime_error("argmax: not implemented yet"); }
} // namespace llaisys::ops
