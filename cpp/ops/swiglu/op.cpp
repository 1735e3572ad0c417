// TEMPORARY STUB: replaced by the real op in this change set.
#include "llaisys/ops.hpp"

namespace llaisys::ops {
void swiglu(const Tensor &, const Tensor &, const Tensor &) { throw std::runtime_error("swiglu: not implemented yet"); }
} // namespace llaisys::ops
