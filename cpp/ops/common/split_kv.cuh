// Device pieces shared by the split-KV ("flash-decoding") attention kernels of self_attention and
// paged_attention: the common part of their shared-memory layout, a block's 8
// (query, head) rows, the online-softmax state, and the per-tile softmax and P @ V steps. One copy, so
// both ops score, normalise and sum in the same order. Each kernel keeps its own K/V staging (paged
// reads rows through a block table) and its own output addressing.
#pragma once
#include "ops/common/cuda.cuh"
#include "ops/common/mma.cuh"

#include <cstdint>

namespace llaisys::ops::cuda {

namespace split_kv {

constexpr int kThreads = 128;
constexpr int kRows = 8;  // (query, head) rows per block, all of one GQA group: each K/V row staged serves all
constexpr int kTile = 64; // keys per shared-memory tile; chunks are multiples of it
static_assert(kThreads == 2 * kTile && kRows == 8, "scores: thread = (key, half of the rows)");

// The common head of both kernels' shared memory, in bytes: q f32 [8][hd] (pre-scaled) | red f32 [24] |
// p f32 [8][64]; each kernel lays out its K/V tiles from p_end() on.
struct Layout {
    int hd, hd_v, elem;
    // K rows are read one row per thread in 16-byte pieces: an odd number of 16-byte units per row puts
    // the rows of 8 consecutive threads in distinct bank groups.
    __host__ __device__ int k_pitch() const { return (((hd * elem + 15) / 16) | 1) * 16; }
    __host__ __device__ int v_pitch() const { return (hd_v * elem + 15) / 16 * 16; }
    // P @ V: thread = (key group, dim); dpad threads per key group (a power of two, 32..128).
    __host__ __device__ int dpad() const {
        int d = 32;
        while (d < hd_v && d < kThreads) d *= 2;
        return d;
    }
    __host__ __device__ int groups() const { return kThreads / dpad(); }
    __host__ __device__ int red_off() const { return kRows * hd * 4; }
    __host__ __device__ int p_off() const { return red_off() + 24 * 4; }
    __host__ __device__ int p_end() const { return p_off() + kRows * kTile * 4; }
};

// Rows [first, first + n) of one kv head's qlen * group rows (of one sequence); row rho is query
// rho / group of head kvh * group + rho % group. lim[r]: the last key row r sees (-1 for padding rows).
struct Rows {
    int first, n, group, kvh, last_key;
    int lim[kRows];
    __device__ int qi(int r) const { return (first + r) / group; }
    __device__ int h(int r) const { return kvh * group + (first + r) % group; }
};

// A block's online-softmax state: running max m of all 8 rows (the same in every thread), this thread's
// part of the row sums of its 4 score rows, and its output dims of all 8 rows for its key group.
template <int DPT>
struct State {
    float m[kRows], l[4], acc[kRows][DPT];
    __device__ __forceinline__ void reset() {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            m[r] = -INFINITY;
            if (r < 4) l[r] = 0.f;
#pragma unroll
            for (int i = 0; i < DPT; ++i) acc[r][i] = 0.f;
        }
    }
};

// Four scores of one key: s[r] = q[r] . k for the rows q [4][hd] (f32 in smem) and the key row krow.
template <typename T, bool VEC>
__device__ __forceinline__ void dot4(const float *q, const T *krow, int hd, float (&s)[4]) {
    if constexpr (VEC) {
        constexpr int per16 = 16 / sizeof(T);
        for (int d0 = 0; d0 < hd; d0 += per16) { // q rows are 16-byte aligned too (hd * 4 % 16 == 0 here)
            T kv[per16];
            *reinterpret_cast<uint4 *>(kv) = *reinterpret_cast<const uint4 *>(krow + d0);
#pragma unroll
            for (int e4 = 0; e4 < per16; e4 += 4) {
                float kd[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) kd[e] = to_f32(kv[e4 + e]);
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const float4 qv = *reinterpret_cast<const float4 *>(q + r * hd + d0 + e4);
                    s[r] += qv.x * kd[0] + qv.y * kd[1] + qv.z * kd[2] + qv.w * kd[3];
                }
            }
        }
    } else {
        for (int d = 0; d < hd; ++d) {
            const float kd = to_f32(krow[d]);
#pragma unroll
            for (int r = 0; r < 4; ++r) s[r] += q[r * hd + d] * kd;
        }
    }
}

// Softmax step of one tile of n keys from key t0 (K rows in ks). Thread t scores key t % 64 for rows
// 4 * (t / 64) + 0..3; the block max of each row goes through red; the probabilities land in ps [8][64];
// the state is rescaled to the new max. A row sees key j <= its lim; with WINDOW (a sliding window of win
// keys) also j > lim - win (without, win is not read).
template <typename T, int DPT, bool VEC, bool WINDOW = false>
__device__ __forceinline__ void softmax_tile(const Layout &lay, const Rows &rows, const float *qs,
                                             const unsigned char *ks, float *red, float *ps, int t0, int n,
                                             State<DPT> &st, int win = 0) {
    const int key = threadIdx.x % kTile, half = threadIdx.x / kTile, warp = threadIdx.x / 32;
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    if (key < n) dot4<T, VEC>(qs + half * 4 * lay.hd, reinterpret_cast<const T *>(ks + key * lay.k_pitch()), lay.hd, s);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int lim = half ? rows.lim[4 + r] : rows.lim[r]; // a select: dynamic indexing would spill to local memory
        s[r] = key < n && t0 + key <= lim && (!WINDOW || lim - (t0 + key) < win) ? s[r] : -INFINITY;
        const float mx = warp_max(s[r]); // fmaxf skips NaN scores; exp2f below turns them into NaN
        if (threadIdx.x % 32 == 0) red[warp * 4 + r] = mx;
    }
    __syncthreads();
    float m_ref[kRows], corr[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) { // rows 0-3 were scored by warps 0-1, rows 4-7 by warps 2-3
        const float tile_max = fmaxf(red[(r / 4) * 8 + r % 4], red[(r / 4) * 8 + 4 + r % 4]);
        const float m_new = fmaxf(st.m[r], tile_max);
        m_ref[r] = m_new == -INFINITY ? 0.f : m_new; // nothing seen yet: avoid -inf - -inf
        corr[r] = exp2f(st.m[r] - m_ref[r]);
        st.m[r] = m_new;
#pragma unroll
        for (int i = 0; i < DPT; ++i) st.acc[r][i] *= corr[r];
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const float p = exp2f(s[r] - (half ? m_ref[4 + r] : m_ref[r]));
        st.l[r] = st.l[r] * (half ? corr[4 + r] : corr[r]) + p;
        ps[(half * 4 + r) * kTile + key] = p;
    }
    __syncthreads();
}

// acc[r][i] += sum over the tile's keys of this thread's key group of P[r][key] * V[key][dim i] (V rows in vs),
// over the keys each row sees (as softmax_tile).
template <typename T, int DPT, bool WINDOW = false>
__device__ __forceinline__ void pv_tile(const Layout &lay, const Rows &rows, const unsigned char *vs, const float *ps,
                                        int t0, int n, State<DPT> &st, int win = 0) {
    const int dpad = lay.dpad(), groups = kThreads / dpad, d0 = threadIdx.x % dpad;
    for (int c = threadIdx.x / dpad; c < n; c += groups) {
        const T *vrow = reinterpret_cast<const T *>(vs + c * lay.v_pitch());
        float v[DPT];
#pragma unroll
        for (int i = 0; i < DPT; ++i) v[i] = d0 + kThreads * i < lay.hd_v ? to_f32(vrow[d0 + kThreads * i]) : 0.f;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            if (t0 + c > rows.lim[r]) continue; // masked keys add nothing, not even 0 * NaN
            if (WINDOW && rows.lim[r] - (t0 + c) >= win) continue;
            const float p = ps[r * kTile + c];
#pragma unroll
            for (int i = 0; i < DPT; ++i) st.acc[r][i] += p * v[i];
        }
    }
}

// After the key loop (and a barrier that ended every tile read): the key groups' accumulators go to
// merge [groups][8][hd_v] (space of the K/V tiles), each warp's row sums to red [0, 16) and the row maxima
// to red [16, 24). Ends on a barrier; then row_sum, row_max and row_acc read a row's totals.
template <int DPT>
__device__ __forceinline__ void merge_groups(const Layout &lay, const State<DPT> &st, float *red, float *merge) {
    const int warp = threadIdx.x / 32, dpad = lay.dpad(), group = threadIdx.x / dpad, d0 = threadIdx.x % dpad;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const float l = warp_sum(st.l[r]);
        if (threadIdx.x % 32 == 0) red[warp * 4 + r] = l; // red's maxima were consumed before the last barrier
    }
    if (threadIdx.x == 0)
#pragma unroll
        for (int r = 0; r < kRows; ++r) red[16 + r] = st.m[r];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int i = 0; i < DPT; ++i)
            if (d0 + kThreads * i < lay.hd_v) merge[(group * kRows + r) * lay.hd_v + d0 + kThreads * i] = st.acc[r][i];
    __syncthreads();
}

// Row r's softmax sum (rows 0-3 were summed by warps 0-1, rows 4-7 by warps 2-3) and running max.
__device__ __forceinline__ float row_sum(const float *red, int r) {
    return red[(r / 4) * 8 + r % 4] + red[(r / 4) * 8 + 4 + r % 4];
}
__device__ __forceinline__ float row_max(const float *red, int r) { return red[16 + r]; }
// Row r's unnormalised output dim d: the key groups' accumulators summed in group order.
__device__ __forceinline__ float row_acc(const Layout &lay, const float *merge, int r, int d) {
    float acc = 0.f;
    for (int g = 0; g < lay.groups(); ++g) acc += merge[(g * kRows + r) * lay.hd_v + d];
    return acc;
}

} // namespace split_kv
} // namespace llaisys::ops::cuda
