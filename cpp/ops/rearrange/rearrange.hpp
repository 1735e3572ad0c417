#pragma once
#include "llaisys/tensor.hpp"

#include <cstdint>
#include <vector>

namespace llaisys::ops {
// A strided copy reduced to its essentials: dims merged where both sides are contiguous across them,
// strides in bytes-free element units. Shared by both backends.
struct CopyPlan {
    std::vector<int64_t> shape, dst_strides, src_strides;
    size_t element_size;
    int64_t numel;
};
CopyPlan make_copy_plan(const Tensor &dst, const Tensor &src);
} // namespace llaisys::ops

namespace llaisys::ops::cpu {
void rearrange(const Tensor &out, const Tensor &x, const CopyPlan &plan);
}
namespace llaisys::ops::cuda {
void rearrange(const Tensor &out, const Tensor &x, const CopyPlan &plan);
}
