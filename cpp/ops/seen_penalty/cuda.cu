#include "ops/seen_penalty/seen_penalty.hpp"

#include "ops/common/cuda.cuh"

namespace llaisys::ops::cuda {

namespace {
// Grid (ceil(W / 256), B): one thread per 32-token word of row b's bitmask; most words are 0 (a context
// holds a few thousand of a vocabulary's ~150k tokens), so a thread usually reads one word and stops.
template <typename T>
__global__ void seen_penalty_kernel(T *logits, int64_t s0, int64_t s1, int64_t V, const uint32_t *seen, int64_t S,
                                    int64_t W, const int32_t *rows, const float *penalty) {
    const int64_t b = blockIdx.y, w = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    const int32_t r = rows[b];
    const float p = penalty[b];
    if (w >= W || r < 0 || r >= S || p == 1.f) return;
    for (uint32_t bits = seen[int64_t(r) * W + w]; bits != 0; bits &= bits - 1) {
        const int64_t v = w * 32 + (__ffs(int(bits)) - 1);
        if (v >= V) break;
        T *x = logits + b * s0 + v * s1;
        const float l = to_f32(*x);
        *x = from_f32<T>(l > 0.f ? l / p : l * p);
    }
}

__global__ void seen_mark_kernel(uint32_t *seen, int64_t S, int64_t W, const int32_t *rows, const int64_t *ids,
                                 int64_t B) {
    const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (b >= B) return;
    const int32_t r = rows[b];
    const int64_t id = ids[b];
    if (r >= 0 && r < S && id >= 0 && id < 32 * W) atomicOr(seen + int64_t(r) * W + (id >> 5), 1u << (id & 31));
}
} // namespace

void seen_penalty(const Tensor &logits, const Tensor &seen, const Tensor &rows, const Tensor &penalty) {
    const int64_t B = logits.size(0), W = seen.size(1);
    detail::dispatch_float("seen_penalty", logits.dtype(), logits.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const dim3 grid(unsigned(ceil_div(W, 256)), unsigned(B));
        seen_penalty_kernel<<<grid, 256, 0, stream_of(logits)>>>(
            dptr<T>(logits), logits.stride(0), logits.stride(1), logits.size(1),
            reinterpret_cast<const uint32_t *>(seen.data_as<int32_t>()), seen.size(0), W, rows.data_as<int32_t>(),
            penalty.data_as<float>());
        CUDA_CHECK_LAUNCH();
    });
}

void seen_mark(const Tensor &seen, const Tensor &rows, const Tensor &ids) {
    const int64_t B = ids.size(0);
    seen_mark_kernel<<<unsigned(ceil_div(B, 256)), 256, 0, stream_of(seen)>>>(
        reinterpret_cast<uint32_t *>(seen.data_as<int32_t>()), seen.size(0), seen.size(1), rows.data_as<int32_t>(),
        ids.data_as<int64_t>(), B);
    CUDA_CHECK_LAUNCH();
}

} // namespace llaisys::ops::cuda
