// The M > 8 path for K-quant weights (Q4_K, Q5_K, Q6_K): a tensor-core GEMM that decodes W tiles into
// shared memory, so the weight is read once, as its blocks, instead of being decoded into a dense [N, K]
// copy that cuBLASLt then reads back (session 33: the copy was 2.2 ms of a 6.4 ms decode step at 256 rows
// of the 1.5B Q4_K_M; bench/RESULTS.md).
//
// out [M, N] = x [M, K] @ W^T (+ bias), or with kSwiglu out [M, I] = swiglu(x @ W[:I]^T, x @ W[I:]^T):
// the same products as the dense path (W decoded to x's dtype by decode(), 16-bit x as it is, f32 sums;
// g and u rounded to the dtype before the SwiGLU), summed in another order.
//
// A block of 8 warps (WM along M x WN along N, each warp MT m16 tiles x 32 W rows) owns BM = 16 WM MT rows
// of x and BN = 32 WN W rows (kSwiglu: BN / 2 gate rows and the up rows of the same outputs), and walks its
// share of K in steps of 128: x's tile comes by cp.async; each thread loads WN / 2 K-quant chunks of W
// (blocks.cuh: two runs of 16 weights of one row) into registers one step ahead, and decodes them into the
// W tile after the step's MMAs. Two stages of both tiles. Shapes: WM = 2 (BN 128) for up to 32 rows of x,
// WM = 4 (BN 64) above. Past 64 rows the dense copy + cuBLASLt is faster (kQuantTcMaxRows): at 256 rows
// this kernel took ~5 us a block step, 2x cuBLASLt on the copy (bench/RESULTS.md, session 34). When the N tiles alone leave SMs idle, K is split over blockIdx.y: each split writes f32 partial
// sums, and quant_tc_reduce_kernel adds them (then the bias, the rounding and the SwiGLU).
#pragma once
#include "ops/common/cuda.cuh"
#include "ops/common/mma.cuh"
#include "ops/common/swiglu_math.cuh"
#include "ops/quant_linear/blocks.cuh"

#include <cstdint>

namespace llaisys::ops::cuda::qtc {

using namespace qblocks;

constexpr int kThreads = 256;   // 8 warps
constexpr int kBK = 128;        // K a step: 4 chunks of a row
constexpr int kPitch = kBK + 8; // shared row pitch in elements: ldmatrix's 8 rows hit 8 distinct 16-byte banks

template <int WM, int MT>
constexpr int bm() { return 16 * WM * MT; } // x rows a block
template <int WM>
constexpr int bn() { return 32 * (8 / WM); } // W rows a block
template <int WM, int MT>
constexpr size_t smem_bytes() { return size_t(2) * (bm<WM, MT>() + bn<WM>()) * kPitch * 2; }

struct Args {
    const uint8_t *w;
    int64_t row_bytes;
    const void *x; // [M, K], rows ldx apart
    int64_t ldx;
    const void *bias; // [N] or null (never with kSwiglu)
    void *out;        // [M, cols] contiguous (cols: N, or I with kSwiglu)
    float *part;      // [splits, M, N or 2I] f32 partial sums when split, else null
    int64_t M, cols, K;
    int steps_per_split; // K steps (of kBK) per blockIdx.y
};

// The W row behind shared row r (0..BN-1) of N-tile `tile`: plain, row tile * BN + r; kSwiglu, warp column
// r / 32 holds 16 gate rows then the 16 up rows of outputs tile * BN / 2 + 16 (r / 32) + (r % 16).
template <int BN, bool kSwiglu>
__device__ __forceinline__ int64_t w_row(int64_t tile, int r, int64_t cols, bool &valid) {
    if constexpr (kSwiglu) {
        const int64_t col = tile * (BN / 2) + (r / 32) * 16 + r % 16;
        valid = col < cols;
        return (r % 32 < 16 ? 0 : cols) + col;
    } else {
        const int64_t row = tile * BN + r;
        valid = row < cols;
        return row;
    }
}

// 16 weights of a chunk's run (0: A, 1: B) in T, as decode() makes them (the dense path's bits).
template <typename T>
__device__ __forceinline__ void store_run(T *dst, const Chunk &k, int run) {
    uint32_t packed[8];
    const float scale = __fmul_rn(k.d, float(k.isc[run]));
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
        float v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const uint32_t byte = (uint32_t(k.q[run][(j + e) / 4]) >> (8 * ((j + e) % 4))) & 0xFFu;
            v[e] = __fsub_rn(__fmul_rn(scale, float(int(byte) - k.off)), k.dm[run]);
        }
        packed[j / 2] = pack2<T>(v[0], v[1]);
    }
    reinterpret_cast<uint4 *>(dst)[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    reinterpret_cast<uint4 *>(dst)[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

template <class F, typename T, int WM, int MT, bool kSwiglu, bool kV16>
__global__ void __launch_bounds__(kThreads) quant_tc_kernel(Args a) {
    using C = typename KChunkOf<F>::type;
    constexpr int BM = bm<WM, MT>(), BN = bn<WM>(), kChunks = BN * 4 / kThreads;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *xs = reinterpret_cast<T *>(smem_raw); // [2][BM][kPitch]
    T *ws = xs + 2 * BM * kPitch;            // [2][BN][kPitch]
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wm = warp % WM, wn = warp / WM;
    const int64_t tile = blockIdx.x, m0 = int64_t(blockIdx.z) * BM;
    const int64_t steps = a.K / kBK, s0 = int64_t(blockIdx.y) * a.steps_per_split;
    const int64_t s1 = s0 + a.steps_per_split < steps ? s0 + a.steps_per_split : steps;
    const T *x = static_cast<const T *>(a.x);

    // this thread's W chunks each step: chunk i is shared row wr[i], chunk cc of the step's four
    int wr[kChunks];
    bool wvalid[kChunks];
    const uint8_t *wbase[kChunks];
    const int cc = tid % 4;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
        wr[i] = (tid + i * kThreads) / 4;
        const int64_t row = w_row<BN, kSwiglu>(tile, wr[i], a.cols, wvalid[i]);
        wbase[i] = a.w + (wvalid[i] ? row : 0) * a.row_bytes;
    }
    // a step covers 128 weights of one 256-weight block: chunks 4 (s % 2) + cc
    const auto chunk_of = [&](int64_t s) { return int(4 * (s % 2) + cc); };
    const auto load_w = [&](typename C::Raw (&raw)[kChunks], int64_t s) {
#pragma unroll
        for (int i = 0; i < kChunks; ++i)
            if (wvalid[i]) C::template load<kV16>(raw[i], wbase[i] + (s / 2) * F::kBytes, chunk_of(s));
    };
    const auto store_w = [&](int stage, const typename C::Raw (&raw)[kChunks], int64_t s) {
        // the chunk's run A within the step (both formats: run_a less the step's start), run B kRunGap further
        const int c = chunk_of(s), ra = C::run_a(c) - 128 * (c / 4);
#pragma unroll
        for (int i = 0; i < kChunks; ++i) {
            T *dst = ws + (stage * BN + wr[i]) * kPitch;
            if (wvalid[i]) {
                const Chunk k = C::decode(raw[i], c);
                store_run<T>(dst + ra, k, 0);
                store_run<T>(dst + ra + C::kRunGap, k, 1);
            } else {
                const uint4 z = make_uint4(0, 0, 0, 0);
                reinterpret_cast<uint4 *>(dst + ra)[0] = z, reinterpret_cast<uint4 *>(dst + ra)[1] = z;
                reinterpret_cast<uint4 *>(dst + ra + C::kRunGap)[0] = z;
                reinterpret_cast<uint4 *>(dst + ra + C::kRunGap)[1] = z;
            }
        }
    };
    // x's tile: BM rows x 16 pieces of 16 bytes; rows past M are zeros
    const auto load_x = [&](int stage, int64_t s) {
#pragma unroll
        for (int i = 0; i < BM * 16 / kThreads; ++i) {
            const int p = tid + i * kThreads, r = p / 16, c16 = p % 16;
            const bool ok = m0 + r < a.M;
            const T *src = x + (ok ? (m0 + r) * a.ldx + s * kBK + c16 * 8 : 0);
            cp_async16(xs + (stage * BM + r) * kPitch + c16 * 8, src, ok);
        }
    };

    float acc[MT][4][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int n = 0; n < 4; ++n) acc[i][n][0] = acc[i][n][1] = acc[i][n][2] = acc[i][n][3] = 0.f;
    const bool rows_live = m0 + wm * 16 * MT < a.M; // warp-uniform: this warp's rows hold any of x

    typename C::Raw raw[kChunks];
    load_x(0, s0);
    cp_async_commit();
    load_w(raw, s0);
    store_w(0, raw, s0);
    for (int64_t s = s0; s < s1; ++s) {
        const int cur = int((s - s0) % 2), nxt = cur ^ 1;
        const bool more = s + 1 < s1;
        cp_async_wait_all();
        __syncthreads(); // step s's tiles are in; everyone is done with stage nxt (step s - 1)
        if (more) {
            load_x(nxt, s + 1);
            cp_async_commit();
            load_w(raw, s + 1); // in flight during this step's MMAs
        }
        if (rows_live) {
            const T *xt = xs + (cur * BM + wm * 16 * MT) * kPitch;
            const T *wt = ws + (cur * BN + wn * 32) * kPitch;
#pragma unroll
            for (int kk = 0; kk < kBK / 16; ++kk) {
                uint32_t b[2][4];
#pragma unroll
                for (int np = 0; np < 2; ++np)
                    ldmatrix_x4(b[np], wt + (np * 16 + (lane % 8) + (lane / 16) * 8) * kPitch + kk * 16 +
                                           ((lane / 8) % 2) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    uint32_t af[4];
                    ldmatrix_x4(af, xt + (mt * 16 + lane % 16) * kPitch + kk * 16 + (lane / 16) * 8);
#pragma unroll
                    for (int np = 0; np < 2; ++np) {
                        mma16816<T>(acc[mt][2 * np], af, b[np][0], b[np][1]);
                        mma16816<T>(acc[mt][2 * np + 1], af, b[np][2], b[np][3]);
                    }
                }
            }
        }
        if (more) store_w(nxt, raw, s + 1);
    }
    if (!rows_live) return;

    // Fragment (mt, n): rows lane / 4 and + 8 of the warp's m-tile mt, columns 8 n + 2 (lane % 4) + {0, 1} of
    // the warp's 32 shared W rows: plain, outputs tile * BN + 32 wn + ...; kSwiglu, n = 0, 1 are gate rows and
    // n = 2, 3 the up rows of outputs tile * BN / 2 + 16 wn + 8 (n % 2) + ...
    const int64_t r_base = m0 + wm * 16 * MT + lane / 4;
    const auto out_col = [&](int n, int e) -> int64_t {
        return kSwiglu ? tile * (BN / 2) + wn * 16 + (n % 2) * 8 + 2 * (lane % 4) + e
                       : tile * BN + wn * 32 + n * 8 + 2 * (lane % 4) + e;
    };
    if (a.part != nullptr) { // split K: f32 partials [split][M][N], or [split][M][g of I | u of I]
        const int64_t width = kSwiglu ? 2 * a.cols : a.cols;
        float *part = a.part + int64_t(blockIdx.y) * a.M * width;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int64_t r = r_base + mt * 16 + 8 * h;
                if (r >= a.M) continue;
#pragma unroll
                for (int n = 0; n < 4; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int64_t c = out_col(n, e);
                        if (c >= a.cols) continue;
                        part[r * width + (kSwiglu && n >= 2 ? a.cols : 0) + c] = acc[mt][n][2 * h + e];
                    }
            }
        return;
    }
    T *out = static_cast<T *>(a.out);
    const T *bias = static_cast<const T *>(a.bias);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int64_t r = r_base + mt * 16 + 8 * h;
            if (r >= a.M) continue;
            if constexpr (kSwiglu) {
#pragma unroll
                for (int n = 0; n < 2; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int64_t c = out_col(n, e);
                        if (c >= a.cols) continue;
                        const float g = to_f32(from_f32<T>(acc[mt][n][2 * h + e]));
                        const float u = to_f32(from_f32<T>(acc[mt][n + 2][2 * h + e]));
                        out[r * a.cols + c] = from_f32<T>(swiglu_f32(g, u));
                    }
            } else {
#pragma unroll
                for (int n = 0; n < 4; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int64_t c = out_col(n, e);
                        if (c >= a.cols) continue;
                        float v = acc[mt][n][2 * h + e];
                        if (bias != nullptr) v = __fadd_rn(v, to_f32(bias[c]));
                        out[r * a.cols + c] = from_f32<T>(v);
                    }
            }
        }
}

// out [M, cols] = the sum of the splits' partials (+ bias), rounded; kSwiglu: swiglu of the rounded g and u.
template <typename T, bool kSwiglu>
__global__ void quant_tc_reduce_kernel(T *__restrict__ out, const float *__restrict__ part, const T *__restrict__ bias,
                                       int64_t M, int64_t cols, int splits) {
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= M * cols) return;
    const int64_t r = i / cols, c = i % cols, width = kSwiglu ? 2 * cols : cols, plane = M * width;
    float v = 0.f, u = 0.f;
    for (int s = 0; s < splits; ++s) {
        v += part[s * plane + r * width + c];
        if constexpr (kSwiglu) u += part[s * plane + r * width + cols + c];
    }
    if constexpr (kSwiglu) {
        out[i] = from_f32<T>(swiglu_f32(to_f32(from_f32<T>(v)), to_f32(from_f32<T>(u))));
    } else {
        if (bias != nullptr) v = __fadd_rn(v, to_f32(bias[c]));
        out[i] = from_f32<T>(v);
    }
}

} // namespace llaisys::ops::cuda::qtc
