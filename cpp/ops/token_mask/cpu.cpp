#include "ops/token_mask/token_mask.hpp"

#include "ops/common/cpu.hpp"

#include <limits>

namespace llaisys::ops::cpu {

// logits [B, V] (any strides): logits[b, v] = -inf where bit v % 32 of mask[b, v / 32] [B, W] is 0.
void token_mask(const Tensor &logits, const Tensor &mask) {
    const int64_t B = logits.size(0), V = logits.size(1), W = mask.size(1);
    const int64_t s0 = logits.stride(0), s1 = logits.stride(1);
    const auto *bits = reinterpret_cast<const uint32_t *>(mask.data_as<int32_t>());
    detail::dispatch_float("token_mask", logits.dtype(), logits.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        T *const base = logits.data_as<T>();
        const T neg_inf = from_float<T>(-std::numeric_limits<float>::infinity());
        parallel_for(B, V, [&](int64_t b) {
            const uint32_t *row = bits + b * W;
            for (int64_t v = 0; v < V; ++v)
                if (!((row[v >> 5] >> (v & 31)) & 1u)) base[b * s0 + v * s1] = neg_inf;
        });
    });
}

} // namespace llaisys::ops::cpu
