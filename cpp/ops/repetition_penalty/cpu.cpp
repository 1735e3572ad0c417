#include "ops/repetition_penalty/repetition_penalty.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

namespace llaisys::ops::cpu {

// Every id must be -1 (padding) or in [0, V); checked before any logit changes.
static void check_ids(const int64_t *ids, int64_t B, int64_t n, int64_t V) {
    for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < n; ++j) {
            const int64_t id = ids[b * n + j];
            LLAISYS_CHECK(id >= -1 && id < V, std::out_of_range, "repetition_penalty: id ", id, " at [", b, ", ", j,
                          "] is out of range for a vocabulary of ", V, " (use -1 for padding)");
        }
}

// logits [B, V] (strides s0, s1), ids [B, n]: HF's RepetitionPenaltyLogitsProcessor, rounded once.
template <typename T>
static void penalty_kernel(T *logits, int64_t s0, int64_t s1, const int64_t *ids, int64_t B, int64_t n,
                           float penalty) {
    parallel_for(B, n, [&](int64_t b) {
        for (int64_t j = 0; j < n; ++j) {
            const int64_t id = ids[b * n + j];
            if (id < 0) continue;
            T *p = logits + b * s0 + id * s1;
            const float l = to_float(*p);
            *p = from_float<T>(l > 0.f ? l / penalty : l * penalty);
        }
    });
}

void repetition_penalty(const Tensor &logits, const Tensor &ids, float penalty) {
    const int64_t B = ids.size(0), n = ids.size(1);
    check_ids(ids.data_as<int64_t>(), B, n, logits.size(1));
    detail::dispatch_float("repetition_penalty", logits.dtype(), logits.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        penalty_kernel(logits.data_as<T>(), logits.stride(0), logits.stride(1), ids.data_as<int64_t>(), B, n, penalty);
    });
}

} // namespace llaisys::ops::cpu
