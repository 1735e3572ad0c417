// TEMPORARY STUB: replaced by the real op in this change set.
#include "llaisys/ops.hpp"

namespace llaisys::ops {
void sample(const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &, uint64_t, uint64_t) { throw std::runtime_error("sample: not implemented yet"); }
} // namespace llaisys::ops
