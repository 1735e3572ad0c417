// The CPU row maximum shared by argmax and sample (the device one is in argmax_rows.cuh), so that greedy
// sampling picks argmax's token.
#pragma once
#include "ops/common/cpu.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace llaisys::ops::cpu {

// Max of row [V] ignoring NaN (-inf if none) and whether it holds a NaN. The max is taken over
// order-preserving integer keys (NaN -> 0) so the compiler can vectorize the reduction.
template <typename T>
float row_max(const T *row, int64_t V, bool &any_nan) {
    uint32_t kmax = 0, nan = 0;
    for (int64_t i = 0; i < V; ++i) {
        uint32_t u;
        const float v = load(row, i);
        std::memcpy(&u, &v, 4);
        const uint32_t is_nan = (u & 0x7fffffffu) > 0x7f800000u;
        const uint32_t k = ((u >> 31) ? ~u : (u | 0x80000000u)) & (is_nan - 1u); // branch-free: NaN -> 0
        kmax = k > kmax ? k : kmax;
        nan |= is_nan;
    }
    any_nan = nan != 0;
    if (kmax == 0) return -INFINITY;
    const uint32_t u = (kmax & 0x80000000u) ? (kmax & 0x7fffffffu) : ~kmax;
    float m;
    std::memcpy(&m, &u, 4);
    return m;
}

// Whether a row with max m (NaN ignored) and any_nan has a finite maximum: else argmax and sample give -1.
inline bool finite_max(float m, bool any_nan) { return !any_nan && std::isfinite(m); }

// The first index of row [V] holding m (-1 if none: the callers pass the row's own max). f32 rows are
// compared 8 at a time: the scalar scan, half a row on average, cost more than the vectorised max.
template <typename T>
int64_t first_index_of(const T *row, int64_t V, float m) {
    int64_t i = 0;
#if defined(__AVX2__)
    if constexpr (std::is_same_v<T, float>) {
        const __m256 mv = _mm256_set1_ps(m);
        for (; i + 8 <= V; i += 8)
            if (const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), mv, _CMP_EQ_OQ)))
                return i + __builtin_ctz(unsigned(hit));
    }
#endif
    for (; i < V; ++i)
        if (load(row, i) == m) return i;
    return -1;
}

} // namespace llaisys::ops::cpu
