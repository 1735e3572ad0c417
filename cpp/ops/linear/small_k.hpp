// CPU linear for f32 at small K (a tiny model's projections: K = 32 is 4 AVX2 FMAs per output), AVX2 + FMA.
//
// The dot-product tiles of cpu.cpp end every output with a horizontal sum of its 8-lane accumulator, which
// at K <= 64 costs more than its products. Here outputs run along N instead, 8 to a vector, from a W tile
// transposed once per task ([K, nc], reused by all the task's x rows), so no horizontal sum is needed. Each
// output still keeps the 8 partial sums of the tiles' lanes (lane l: products k = l, l + 8, ... in order,
// FMA from zero) and adds them in hsum's order ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): the result
// equals the tiles' bit for bit, so which path runs depends on nothing a caller could see.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace llaisys::ops::cpu::small_k {

constexpr int64_t kMaxK = 64; // above this the tiles' horizontal sums are a small share of their work

// Whether the path applies: K a multiple of the 8 lanes (no scalar tail to order) and enough x rows to pay
// for transposing W.
inline bool fits(int64_t M, int64_t K) { return K % 8 == 0 && K <= kMaxK && M >= 8; }

// Lane l of G output vectors (G groups of 8 columns, wT [G, K, 8]): the products k = l, l + 8, ... in order.
template <int G>
inline void lane_sums(const float *xm, const float *wT, int64_t K, int l, __m256 (&acc)[G]) {
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t k = l; k < K; k += 8) {
        const __m256 xk = _mm256_broadcast_ss(xm + k);
        for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(xk, _mm256_loadu_ps(wT + (g * K + k) * 8), acc[g]);
    }
}

// (lane a + lane b) of G output vectors, each lane summed by lane_sums.
template <int G>
inline void lane_pair(const float *xm, const float *wT, int64_t K, int a, int b, __m256 (&out)[G]) {
    __m256 la[G], lb[G];
    lane_sums<G>(xm, wT, K, a, la);
    lane_sums<G>(xm, wT, K, b, lb);
    for (int g = 0; g < G; ++g) out[g] = _mm256_add_ps(la[g], lb[g]);
}

// G output vectors of x row xm [K]: out[m, n0 .. n0 + 8G) from W's columns transposed, wT [G, K, 8]. One
// lane at a time (each a chain of K / 8 FMAs), so that few sums are live and each x broadcast feeds G FMAs.
template <int G>
inline void dot8(const float *xm, const float *wT, int64_t K, __m256 (&y)[G]) {
    __m256 p04[G], p26[G], p15[G], p37[G];
    lane_pair<G>(xm, wT, K, 0, 4, p04);
    lane_pair<G>(xm, wT, K, 2, 6, p26);
    lane_pair<G>(xm, wT, K, 1, 5, p15);
    lane_pair<G>(xm, wT, K, 3, 7, p37);
    for (int g = 0; g < G; ++g) y[g] = _mm256_add_ps(_mm256_add_ps(p04[g], p26[g]), _mm256_add_ps(p15[g], p37[g]));
}

// Stores y + bias (valid columns of the last, partial group only).
inline void store8(float *om, __m256 y, int64_t valid) {
    if (valid >= 8) return _mm256_storeu_ps(om, y);
    alignas(32) float tail[8];
    _mm256_store_ps(tail, y);
    std::copy(tail, tail + valid, om);
}

// out [m_begin, m_end) x [n_begin, n_end) = x @ w^T + bias (0 without: the tiles add it too, which turns
// -0 into +0). x [M, K] (ld ldx), w [N, K] (ld ldw), out ld N. W's columns are transposed in groups of 8,
// wT [groups, K, 8] (padding columns 0), each group then passed by every x row of the task.
inline void task(float *out, const float *x, int64_t ldx, const float *w, int64_t ldw, const float *bias, int64_t N,
                 int64_t K, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {
    const int64_t nc = n_end - n_begin, groups = (nc + 7) / 8;
    thread_local std::vector<float> buf;
    if (buf.size() < size_t(groups * 8 * (K + 1))) buf.resize(size_t(groups * 8 * (K + 1)));
    float *wT = buf.data(), *b = wT + groups * 8 * K; // b [groups * 8]
    for (int64_t n = 0; n < groups * 8; ++n) {
        float *col = wT + n / 8 * 8 * K + n % 8; // column n of its group, rows 8 apart
        const float *wn = w + (n_begin + n) * ldw;
        for (int64_t k = 0; k < K; ++k) col[k * 8] = n < nc ? wn[k] : 0.f;
        b[n] = bias && n < nc ? bias[n_begin + n] : 0.f;
    }
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) { // two groups per pass: each x broadcast feeds 2 FMAs
        const __m256 b0 = _mm256_loadu_ps(b + g * 8), b1 = _mm256_loadu_ps(b + g * 8 + 8);
        for (int64_t m = m_begin; m < m_end; ++m) {
            __m256 y[2];
            dot8<2>(x + m * ldx, wT + g * 8 * K, K, y);
            float *om = out + m * N + n_begin + g * 8;
            store8(om, _mm256_add_ps(y[0], b0), 8);
            store8(om + 8, _mm256_add_ps(y[1], b1), nc - g * 8 - 8);
        }
    }
    if (g < groups) {
        const __m256 b0 = _mm256_loadu_ps(b + g * 8);
        for (int64_t m = m_begin; m < m_end; ++m) {
            __m256 y[1];
            dot8<1>(x + m * ldx, wT + g * 8 * K, K, y);
            store8(out + m * N + n_begin + g * 8, _mm256_add_ps(y[0], b0), nc - g * 8);
        }
    }
}

} // namespace llaisys::ops::cpu::small_k
#endif
