#include "ops/argmax/argmax.hpp"

#include "ops/argmax/argmax.cuh"
#include "ops/common/checks.hpp"

namespace llaisys::ops::cuda {

// One block per row of x [rows, V]; blockDim.x threads (32..1024) read VEC-wide packs. The value is
// copied from x, so NaN stays NaN and nothing is re-rounded.
template <int VEC, typename T>
__global__ void __launch_bounds__(1024) argmax_kernel(int64_t *max_idx, T *max_val, const T *x, int V) {
    __shared__ ArgmaxSmem sm;
    const T *row = x + int64_t(blockIdx.x) * V;
    const int i = block_argmax<VEC>(row, V, sm);
    if (threadIdx.x == 0) {
        max_idx[blockIdx.x] = i;
        max_val[blockIdx.x] = row[i];
    }
}

// Threads per block: enough for one pass of packs over the row, a power of two in [32, 1024].
static int argmax_threads(int64_t packs) {
    int t = 32;
    while (t < 1024 && t < packs) t <<= 1;
    return t;
}

void argmax(const Tensor &max_idx, const Tensor &max_val, const Tensor &x) {
    const int64_t V = x.shape().back(), rows = x.numel() / V;
    LLAISYS_CHECK(rows <= INT32_MAX, std::invalid_argument, "argmax: too many rows for one launch: ", rows);
    detail::dispatch_float("argmax", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        using D = device_t<T>;
        const bool wide = rows_vectorizable<D>(x.data(), V);
        const int vec = wide ? kRowVec<D> : 1;
        const dim3 grid{unsigned(rows)}, block{unsigned(argmax_threads(ceil_div(V, vec)))};
        cudaStream_t s = stream_of(max_idx);
        if (wide)
            argmax_kernel<kRowVec<D>><<<grid, block, 0, s>>>(max_idx.data_as<int64_t>(), dptr<T>(max_val), dptr<T>(x), int(V));
        else
            argmax_kernel<1><<<grid, block, 0, s>>>(max_idx.data_as<int64_t>(), dptr<T>(max_val), dptr<T>(x), int(V));
        CUDA_CHECK_LAUNCH();
    });
}

} // namespace llaisys::ops::cuda
