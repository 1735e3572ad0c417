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

// One output vector: out[m, n0 .. n0 + 8) from x row xm [K] and W's columns n0 .. n0 + 8 transposed, wT [K, 8].
inline __m256 dot8(const float *xm, const float *wT, int64_t K) {
    __m256 lane[8];
    for (int l = 0; l < 8; ++l) lane[l] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += 8)
        for (int l = 0; l < 8; ++l)
            lane[l] = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + k0 + l), _mm256_loadu_ps(wT + (k0 + l) * 8), lane[l]);
    const __m256 a = _mm256_add_ps(lane[0], lane[4]), b = _mm256_add_ps(lane[2], lane[6]);
    const __m256 c = _mm256_add_ps(lane[1], lane[5]), d = _mm256_add_ps(lane[3], lane[7]);
    return _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d));
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
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t n0 = g * 8, valid = std::min<int64_t>(8, nc - n0);
        const __m256 bg = _mm256_loadu_ps(b + n0);
        for (int64_t m = m_begin; m < m_end; ++m) {
            const __m256 y = _mm256_add_ps(dot8(x + m * ldx, wT + g * 8 * K, K), bg);
            float *om = out + m * N + n_begin + n0;
            if (valid == 8) {
                _mm256_storeu_ps(om, y);
            } else { // the last, partial group
                alignas(32) float tail[8];
                _mm256_store_ps(tail, y);
                std::copy(tail, tail + valid, om);
            }
        }
    }
}

} // namespace llaisys::ops::cpu::small_k
#endif
