#include "ops/scale/scale.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cuda.cuh"

namespace llaisys::ops::cuda {

// Grid-stride out = x * alpha (f32 product, rounded once); one thread per element, 256 threads per block.
template <typename T>
__global__ void scale_kernel(T *out, const T *x, float alpha, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        out[i] = from_f32<T>(__fmul_rn(to_f32(x[i]), alpha));
}

void scale(const Tensor &out, const Tensor &x, float alpha) {
    const int64_t n = x.numel();
    if (n == 0) return;
    detail::dispatch_float("scale", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const int threads = 256;
        const int blocks = int(std::min<int64_t>(ceil_div(n, threads), 65535));
        scale_kernel<<<blocks, threads, 0, stream_of(out)>>>(dptr<T>(out), dptr<T>(x), alpha, n);
        CUDA_CHECK_LAUNCH();
    });
}

} // namespace llaisys::ops::cuda
