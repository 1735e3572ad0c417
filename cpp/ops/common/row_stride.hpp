// The row stride of the 2-D operands that linear's and quant_linear's backends take (rows dense but maybe
// a stride apart, as detail::dense_rows makes them: a column slice of a wider matrix is used in place).
#pragma once
#include "llaisys/tensor.hpp"

#include <algorithm>
#include <cstdint>

namespace llaisys::ops::detail {
// Distance between rows in elements; a single row reports its width so it is always >= cols.
inline int64_t ld(const Tensor &t) { return t.size(0) > 1 ? t.stride(0) : std::max<int64_t>(t.size(1), 1); }
} // namespace llaisys::ops::detail
