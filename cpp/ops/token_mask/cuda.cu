#include "ops/token_mask/token_mask.hpp"

#include "ops/common/cuda.cuh"

namespace llaisys::ops::cuda {

namespace {
// Block (x, row): 256 consecutive logits of one row, one thread each; neighbouring threads share a mask word
// (one broadcast load) and a thread writes -inf where its bit is 0. Allowed logits are not touched. (It replaced
// a flat grid-stride over B * V with a 64-bit division and remainder per logit; both took ~27.5 us for 64 rows
// of a 152k vocabulary on an H200, session 36: the time is the writes, not the index arithmetic.)
template <typename T>
__global__ void token_mask_kernel(T *logits, int64_t s0, int64_t s1, int V, const uint32_t *mask, int64_t W) {
    const int64_t b = blockIdx.y;
    const int v = int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x);
    if (v >= V) return;
    if (!((mask[b * W + (v >> 5)] >> (v & 31)) & 1u)) logits[b * s0 + int64_t(v) * s1] = from_f32<T>(-INFINITY);
}
} // namespace

// logits [B, V] (any strides) in place, mask [B, W = ceil(V / 32)] i32 (llguidance's bit layout).
void token_mask(const Tensor &logits, const Tensor &mask) {
    const int64_t B = logits.size(0), V = logits.size(1);
    if (B == 0 || V == 0) return;
    LLAISYS_CHECK(B <= 65535 && V <= INT32_MAX, std::invalid_argument, "token_mask: ", B, " rows of ", V,
                  " logits exceed one launch (65535 rows)");
    detail::dispatch_float("token_mask", logits.dtype(), logits.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const int threads = 256;
        const dim3 grid(unsigned(ceil_div(V, int64_t(threads))), unsigned(B));
        token_mask_kernel<<<grid, threads, 0, stream_of(logits)>>>(
            dptr<T>(logits), logits.stride(0), logits.stride(1), int(V),
            reinterpret_cast<const uint32_t *>(mask.data_as<int32_t>()), mask.size(1));
        CUDA_CHECK_LAUNCH();
    });
}

} // namespace llaisys::ops::cuda
