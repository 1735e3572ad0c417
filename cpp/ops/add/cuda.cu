#include "ops/add/add.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cuda.cuh"

namespace llaisys::ops::cuda {

// Grid-stride elementwise add; one thread per element, 256 threads per block.
template <typename T>
__global__ void add_kernel(T *out, const T *a, const T *b, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}

void add(const Tensor &out, const Tensor &a, const Tensor &b) {
    const int64_t n = a.numel();
    if (n == 0) return;
    detail::dispatch_float("add", a.dtype(), a.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const int threads = 256;
        const int blocks = int(std::min<int64_t>(ceil_div(n, threads), 65535));
        add_kernel<<<blocks, threads, 0, stream_of(out)>>>(dptr<T>(out), dptr<T>(a), dptr<T>(b), n);
        CUDA_CHECK_LAUNCH();
    });
}

} // namespace llaisys::ops::cuda
