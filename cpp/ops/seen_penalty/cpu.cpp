#include "ops/seen_penalty/seen_penalty.hpp"

#include "ops/common/cpu.hpp"

namespace llaisys::ops::cpu {

// HF's RepetitionPenaltyLogitsProcessor over a bitmask: row b's logits at every token whose bit is set in
// seen[rows[b]] [W] (bit v % 32 of word v / 32), each once.
void seen_penalty(const Tensor &logits, const Tensor &seen, const Tensor &rows, const Tensor &penalty) {
    const int64_t B = logits.size(0), V = logits.size(1), W = seen.size(1);
    const int64_t s0 = logits.stride(0), s1 = logits.stride(1);
    const auto *bits = reinterpret_cast<const uint32_t *>(seen.data_as<int32_t>());
    const int32_t *row = rows.data_as<int32_t>();
    const float *pen = penalty.data_as<float>();
    detail::dispatch_float("seen_penalty", logits.dtype(), logits.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        T *const base = logits.data_as<T>();
        parallel_for(B, V, [&](int64_t b) {
            const float p = pen[b];
            if (row[b] < 0 || p == 1.f) return;
            const uint32_t *word = bits + int64_t(row[b]) * W;
            for (int64_t w = 0; w < W; ++w) // most words are 0: a context is a few thousand of ~150k tokens
                for (uint32_t bits = word[w]; bits != 0; bits &= bits - 1) {
                    const int64_t v = w * 32 + __builtin_ctz(bits);
                    if (v >= V) break;
                    T *x = base + b * s0 + v * s1;
                    const float l = to_float(*x);
                    *x = from_float<T>(l > 0.f ? l / p : l * p);
                }
        });
    });
}

// Sets bit ids[b] of seen[rows[b]] (rows[b] -1, or ids[b] outside [0, 32 W), e.g. -1 for "no token": skipped).
void seen_mark(const Tensor &seen, const Tensor &rows, const Tensor &ids) {
    const int64_t B = ids.size(0), W = seen.size(1);
    auto *bits = reinterpret_cast<uint32_t *>(seen.data_as<int32_t>());
    const int32_t *row = rows.data_as<int32_t>();
    const int64_t *id = ids.data_as<int64_t>();
    for (int64_t b = 0; b < B; ++b)
        if (row[b] >= 0 && id[b] >= 0 && id[b] < 32 * W) bits[int64_t(row[b]) * W + (id[b] >> 5)] |= 1u << (id[b] & 31);
}

} // namespace llaisys::ops::cpu
