#include "ops/token_mask/token_mask.hpp"

#include "ops/common/cuda.cuh"

namespace llaisys::ops::cuda {

namespace {
// Grid-stride over the B * V logits; one thread per logit reads its row's mask word (neighbouring threads
// share it, so the loads coalesce) and writes -inf where the bit is 0. Allowed logits are not touched.
template <typename T>
__global__ void token_mask_kernel(T *logits, int64_t s0, int64_t s1, int64_t V, const uint32_t *mask, int64_t W,
                                  int64_t total) {
    for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total; k += int64_t(gridDim.x) * blockDim.x) {
        const int64_t b = k / V, v = k % V;
        if (!((mask[b * W + (v >> 5)] >> (v & 31)) & 1u)) logits[b * s0 + v * s1] = from_f32<T>(-INFINITY);
    }
}
} // namespace

// logits [B, V] (any strides) in place, mask [B, W = ceil(V / 32)] i32 (llguidance's bit layout).
void token_mask(const Tensor &logits, const Tensor &mask) {
    const int64_t V = logits.size(1), total = logits.numel();
    detail::dispatch_float("token_mask", logits.dtype(), logits.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const int threads = 256;
        const int blocks = int(std::min<int64_t>(ceil_div(total, threads), 8192));
        token_mask_kernel<<<blocks, threads, 0, stream_of(logits)>>>(
            dptr<T>(logits), logits.stride(0), logits.stride(1), V,
            reinterpret_cast<const uint32_t *>(mask.data_as<int32_t>()), mask.size(1), total);
        CUDA_CHECK_LAUNCH();
    });
}

} // namespace llaisys::ops::cuda
