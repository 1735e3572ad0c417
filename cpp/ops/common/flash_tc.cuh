// Flash-attention-2 on tensor cores (mma.sync m16n8k16, f32 accumulators), shared by the contiguous prefill
// kernel (self_attention) and the paged one (paged_attention): a block of 4 warps owns 64 query rows of one
// head (16 a warp, Q fragments in registers) and walks K/V tiles of 64 keys staged in shared memory. Both
// kernels run the same pieces below (Q fragments, the key loop, the row store); they differ only in how a
// K/V tile is fetched: rows of a contiguous tensor, or cache slots found through the block table.
#pragma once
#include "ops/common/mma.cuh"
#include "ops/common/split_kv.cuh"

#include <cstddef>
#include <cstdint>

namespace llaisys::ops::cuda::flash_tc {

constexpr int kTcWarps = 4;             // warps per block, 16 query rows each
constexpr int kTcBQ = 16 * kTcWarps;    // query rows per block
constexpr int kTcBK = 64;               // keys per K/V tile
constexpr int kTcMinQueries = 16;       // below this the split-KV kernel is used (decode, short chunks)

// Shared-memory row pitch in elements: +8 (16 bytes) puts the 8 rows of each ldmatrix in 8 distinct
// 16-byte bank groups, so the fragment loads are conflict-free without swizzling.
template <int HD>
constexpr int tc_pitch() { return HD + 8; }
template <int HD>
constexpr size_t tc_smem_bytes() { return size_t(kTcBQ + 2 * kTcBK) * tc_pitch<HD>() * 2; }

// Fragment layouts are those of mma.m16n8k16: a thread holds rows lane/4 and lane/4 + 8 of its warp's 16
// rows, columns 8n + 2 * (lane % 4) + {0, 1} of n-tile n.

// s [16 rows x 64 keys] = Q_warp [16, HD] @ K_tile [64, HD]^T. K rows are B's columns, so the plain
// (non-transposed) ldmatrix of K rows yields B fragments: matrices (keys 0-7 | 8-15) x (dims 0-7 | 8-15).
template <typename T, int HD>
__device__ __forceinline__ void qk_tile(float (&s)[kTcBK / 8][4], const uint32_t (&qf)[HD / 16][4], const T *ks,
                                        int lane) {
#pragma unroll
    for (int n = 0; n < kTcBK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < kTcBK / 16; ++np) {
            uint32_t b[4];
            ldmatrix_x4(b, ks + (np * 16 + (lane % 8) + (lane / 16) * 8) * tc_pitch<HD>() + kk * 16 +
                               ((lane / 8) % 2) * 8);
            mma16816<T>(s[2 * np], qf[kk], b[0], b[1]);
            mma16816<T>(s[2 * np + 1], qf[kk], b[2], b[3]);
        }
    }
}

// Scales the thread's scores to base-2 units and sets keys its rows may not see (key > lim) to -inf.
__device__ __forceinline__ void scale_and_mask(float (&s)[kTcBK / 8][4], int j0, int lane, const int (&lim)[2],
                                               bool need_mask, float scale_log2) {
#pragma unroll
    for (int n = 0; n < kTcBK / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = j0 + n * 8 + (lane % 4) * 2 + (e & 1);
            s[n][e] = need_mask && key > lim[e / 2] ? -INFINITY : s[n][e] * scale_log2;
        }
}

// Online softmax over one tile for the thread's two rows: updates the running max m and the thread's
// partial row sums l (quad-reduced at the end), rescales o, and turns s into probabilities P.
template <int HD>
__device__ __forceinline__ void softmax_tile(float (&s)[kTcBK / 8][4], float (&o)[HD / 8][4], float (&m)[2],
                                             float (&l)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY; // fmaxf skips NaN scores; exp2f below turns them into NaN probabilities
#pragma unroll
        for (int n = 0; n < kTcBK / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1)); // the 4 threads of a quad share a row
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[r], mx);
        const float m_ref = m_new == -INFINITY ? 0.f : m_new; // no key seen yet: avoid -inf - -inf
        const float corr = exp2f(m[r] - m_ref);
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < kTcBK / 8; ++n)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
                s[n][e] = exp2f(s[n][e] - m_ref);
                sum += s[n][e];
            }
        m[r] = m_new;
        l[r] = l[r] * corr + sum;
#pragma unroll
        for (int d = 0; d < HD / 8; ++d) {
            o[d][2 * r] *= corr;
            o[d][2 * r + 1] *= corr;
        }
    }
}

// o [16, HD] += P [16, 64] @ V_tile [64, HD]. The S accumulators of key n-tiles 2ks, 2ks+1 are exactly
// the A fragment of key step ks; V is row-major [key][dim], so ldmatrix.trans yields B fragments.
// Causally masked keys of a diagonal tile enter with P = 0, so a NaN/Inf in such a key's V row would
// still reach the row (0 * NaN), as in flash-attention; keys past kvlen are never loaded (zero-filled).
template <typename T, int HD>
__device__ __forceinline__ void pv_tile(float (&o)[HD / 8][4], const float (&p)[kTcBK / 8][4], const T *vs,
                                        int lane) {
#pragma unroll
    for (int ks = 0; ks < kTcBK / 16; ++ks) {
        const uint32_t a[4] = {pack2<T>(p[2 * ks][0], p[2 * ks][1]), pack2<T>(p[2 * ks][2], p[2 * ks][3]),
                               pack2<T>(p[2 * ks + 1][0], p[2 * ks + 1][1]),
                               pack2<T>(p[2 * ks + 1][2], p[2 * ks + 1][3])};
#pragma unroll
        for (int dp = 0; dp < HD / 16; ++dp) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, vs + (ks * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * tc_pitch<HD>() + dp * 16 +
                                     (lane / 16) * 8);
            mma16816<T>(o[2 * dp], a, b[0], b[1]);
            mma16816<T>(o[2 * dp + 1], a, b[2], b[3]);
        }
    }
}

// Waits for the copies in flight (the Q tile and the first K tile) and loads this warp's Q fragments: rows
// 16 warp .. 16 warp + 15 of the Q tile qs, all HD dims, kept in registers for the whole key loop.
template <typename T, int HD>
__device__ __forceinline__ void load_q_frags(uint32_t (&qf)[HD / 16][4], const T *qs, int warp, int lane) {
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
        ldmatrix_x4(qf[kk], qs + (warp * 16 + lane % 16) * tc_pitch<HD>() + kk * 16 + (lane / 16) * 8);
}

// The key loop of the thread's two rows, whose queries see keys up to key0 and key0 + 8 (their position;
// the last key of the sequence, kv - 1, at most): ntiles tiles of 64 keys from key 0, K_0 already staged in
// ks. load_k(j0) / load_v(j0) start copying the K / V rows of keys [j0, j0 + 64) into ks / vs (the caller
// knows where a key's row lives). V_t streams in during S = Q K_t^T and K_{t+1} during softmax and
// O += P V_t; the barriers around each copy keep every smem reuse race-free. Returns the unnormalised
// rows in o and the thread's partial row sums in l (store_rows reduces them).
template <typename T, int HD, typename LoadK, typename LoadV>
__device__ __forceinline__ void attend_tiles(float (&o)[HD / 8][4], float (&l)[2], const uint32_t (&qf)[HD / 16][4],
                                             const T *ks, const T *vs, int ntiles, int key0, int kv,
                                             float scale_log2, int lane, LoadK load_k, LoadV load_v) {
    const int lim[2] = {min(key0, kv - 1), min(key0 + 8, kv - 1)};
    float m[2] = {-INFINITY, -INFINITY}, s[kTcBK / 8][4];
#pragma unroll
    for (int d = 0; d < HD / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    l[0] = l[1] = 0.f;
    for (int t = 0; t < ntiles; ++t) {
        const int j0 = t * kTcBK;
        if (t > 0) {
            cp_async_wait_all();
            __syncthreads(); // K_t has landed; every warp is done reading V_{t-1}
        }
        load_v(j0);
        cp_async_commit();
        qk_tile<T, HD>(s, qf, ks, lane);
        cp_async_wait_all();
        __syncthreads(); // V_t has landed; every warp is done reading K_t
        if (t + 1 < ntiles) {
            load_k(j0 + kTcBK);
            cp_async_commit();
        }
        scale_and_mask(s, j0, lane, lim, j0 + kTcBK - 1 > lim[0], scale_log2);
        softmax_tile<HD>(s, o, m, l);
        pv_tile<T, HD>(o, s, vs, lane);
    }
}

// Normalises the thread's two rows (row0, row0 + 8 of the queries; those >= nrows are padding) and stores
// them as pairs of 16-bit values; query qi's row of this head starts at out + qi * s0.
template <typename T, int HD>
__device__ __forceinline__ void store_rows(T *out, int64_t s0, int row0, int nrows, int lane,
                                           const float (&o)[HD / 8][4], float (&l)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        const int qi = row0 + 8 * r;
        if (qi >= nrows) continue;
        const float inv = 1.f / l[r];
        T *dst = out + qi * s0 + (lane % 4) * 2;
#pragma unroll
        for (int d = 0; d < HD / 8; ++d)
            *reinterpret_cast<uint32_t *>(dst + d * 8) = pack2<T>(o[d][2 * r] * inv, o[d][2 * r + 1] * inv);
    }
}

} // namespace llaisys::ops::cuda::flash_tc
