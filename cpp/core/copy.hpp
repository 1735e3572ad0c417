// Strided copies within one device: what Tensor::copy_, fill_, clone and contiguous run, and what
// ops::rearrange exposes. They live in core because core must not call into ops (ops build on core).
#pragma once
#include "llaisys/tensor.hpp"

#include <cstdint>
#include <vector>

namespace llaisys::runtime {

// A strided copy reduced to its essentials: dims merged where both sides step over them as one run,
// strides in elements. Shared by both backends.
struct CopyPlan {
    std::vector<int64_t> shape, dst_strides, src_strides;
    size_t element_size;
    int64_t numel;
};
constexpr size_t kCopyMaxDims = 8; // the CUDA kernel's fixed arrays
CopyPlan make_copy_plan(const Tensor &dst, const Tensor &src);

// dst = src element by element; both on one device with the same shape and dtype (the caller checks).
// Raises when the strides leave more than kCopyMaxDims dims that cannot be merged. Device copies are
// ordered on the device's current stream and never synchronize.
void copy_strided(const Tensor &dst, const Tensor &src);

#ifdef LLAISYS_WITH_CUDA
namespace cuda {
void copy_strided(void *dst, const void *src, const CopyPlan &plan, Device device); // cuda/copy_cuda.cu
}
#endif

} // namespace llaisys::runtime
