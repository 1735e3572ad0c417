#include "ops/logit_bias/logit_bias.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cuda.cuh"

namespace llaisys::ops::cuda {

// Grid-stride over ids [B, n], one thread per id; logits [B, V] with strides (s0, s1). Padding (-1) and
// ids outside [0, V) are skipped (a host check would need a sync). Ids are distinct per row, so no two
// threads touch one logit.
template <typename T>
__global__ void bias_kernel(T *logits, int64_t s0, int64_t s1, int64_t V, const int64_t *ids, const float *bias,
                            int64_t n, int64_t total) {
    for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total; k += int64_t(gridDim.x) * blockDim.x) {
        const int64_t id = ids[k];
        if (id < 0 || id >= V) continue;
        T *p = logits + (k / n) * s0 + id * s1;
        *p = from_f32<T>(to_f32(*p) + bias[k]);
    }
}

void logit_bias(const Tensor &logits, const Tensor &ids, const Tensor &bias) {
    const int64_t total = ids.numel(), n = ids.size(1);
    detail::dispatch_float("logit_bias", logits.dtype(), logits.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const int threads = 256;
        const int blocks = int(std::min<int64_t>(ceil_div(total, threads), 4096));
        bias_kernel<<<blocks, threads, 0, stream_of(logits)>>>(dptr<T>(logits), logits.stride(0), logits.stride(1),
                                                               logits.size(1), ids.data_as<int64_t>(),
                                                               bias.data_as<float>(), n, total);
        CUDA_CHECK_LAUNCH();
    });
}

} // namespace llaisys::ops::cuda
