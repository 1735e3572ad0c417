// CUDA quantized linear, linear + SwiGLU and embedding over GGUF block weights (readers: blocks.cuh).
//   M <= 8 (decode): x is turned into 8-bit blocks of the weight's block size, as the CPU op defines them
//   (d = max|x| / 127 in f32, q = round(x / d)), held in shared memory, and quant_gemv_kernel dots each
//   W row with them in integer arithmetic (__dp4a), scaling each sub-block's sum in f32. While x is short
//   (M K <= 4096) each block of the GEMV quantizes it itself (one launch per linear: at batch 1 a
//   separate quantize kernel cost about as much as a small GEMV); else quantize_x_kernel does it once,
//   ahead. Launched with PDL; the GEMV loads its first W sub-blocks before it waits for x. Large K-quant
//   matrices (Q4_K, Q5_K, Q6_K) take quant_gemv_kq_kernel, which reads whole blocks in contiguous spans.
//   M > 8, K-quants, 2-byte x, up to kQuantTcMaxRows (64) rows (ops::quant_linear_tc): a tensor-core GEMM
//   that decodes W tiles in shared memory (tc_gemm.cuh); the weight is read as its blocks, no dense copy.
//   Other M > 8 cases (prefill chunks, Q4_0/Q5_0/Q8_0, f32): the whole weight is decoded into a dense
//   [N, K] of x's dtype and the dense linear (cuBLASLt) runs on it with the unquantized x. The op decodes
//   into a transient tensor (N * K * sizeof(T) for the call, handed back to the caching allocator after it);
//   a model decodes into one buffer of its own with quant_dequantize instead
//   (models/common/linear_weight.cpp), so a captured graph holds no copy.
// quant_embedding and quant_dequantize decode rows with the M > 8 path's kernel.
#include "ops/quant_linear/quant_linear.hpp"

#include "core/runtime.hpp"
#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/cuda.cuh"
#include "ops/common/rms_norm_rows.cuh"
#include "ops/common/row_stride.hpp"
#include "ops/common/swiglu_math.cuh"
#include "ops/quant_linear/blocks.cuh"
#include "ops/quant_linear/tc_gemm.cuh"

#include <algorithm>

namespace llaisys::ops::cuda {
namespace {

using namespace qblocks;

constexpr int64_t kMaxGemvM = kQuantGemvMaxRows; // larger batches take the dequantize + cuBLASLt path
constexpr int kGemvThreads = 256; // threads per block of the GEMV
constexpr int kIdOutOfRange = 1; // the device error code embedding uses (synchronize raises IndexError)

// x quantized on the device: q int8 [M, K], d f32 [M, K / BK] (one scale per block of BK elements).
struct QuantX {
    const int8_t *q;
    const float *d;
};

// v = elements [k0, k0 + 8) of x row m -> q, d (q int8 [M, K], d f32 [M, K / BK]), as cpu.cpp's quantize_row
// (same f32 operations, so the same bits): the BK / 8 threads of a block of x (<= 32, within one warp)
// reduce max|x| and finiteness by shuffles, so every lane of the warp must call it; lanes with
// valid == false take part in the shuffles only. A block holding NaN or Inf gets d = NaN and q = 0.
template <int BK>
__device__ __forceinline__ void quantize_vals(int8_t *q, float *d, const float (&v)[8], int64_t K, int64_t m,
                                              int64_t k0, bool valid) {
    float amax = 0.f;
    int bad = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        bad |= !isfinite(v[j]);
        amax = fmaxf(amax, fabsf(v[j]));
    }
#pragma unroll
    for (int o = 1; o < BK / 8; o <<= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    }
    if (!valid) return;
    const float dd = amax / 127.f, id = dd != 0.f && !bad ? 1.f / dd : 0.f;
    uint32_t packed[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int qj = bad ? 0 : int(roundf(__fmul_rn(v[j], id))); // halves away from zero, as std::round
        packed[j / 4] |= uint32_t(uint8_t(int8_t(qj))) << (8 * (j % 4));
    }
    *reinterpret_cast<uint2 *>(q + m * K + k0) = make_uint2(packed[0], packed[1]);
    if (k0 % BK == 0) d[m * (K / BK) + k0 / BK] = bad ? __int_as_float(0x7fc00000) : dd;
}

// Elements [8 (g % (K / 8)), + 8) of x row g / (K / 8) (rows ldx apart) -> q, d by quantize_vals (every lane
// of the warp must call it).
template <typename T, int BK>
__device__ __forceinline__ void quantize_group(int8_t *q, float *d, const T *__restrict__ x, int64_t ldx, int64_t K,
                                               int64_t g, bool valid) {
    const int64_t per_row = K / 8, m = valid ? g / per_row : 0, k0 = valid ? g % per_row * 8 : 0;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = valid ? to_f32(x[m * ldx + k0 + j]) : 0.f;
    quantize_vals<BK>(q, d, v, K, m, k0, valid);
}

// x given as the add_rms_norm that makes it (add_rms_norm_quant_linear): x = rms_norm(residual + delta) *
// weight over rows of K elements, rows K apart; residual + delta, rounded, goes to residual_out. Used for
// 2-byte T, 16-byte aligned rows and K / 8 <= the threads of a block (ops::add_rms_norm_quant_linear_fused).
// residual null: x is given as it is.
template <typename T>
struct NormX {
    const T *residual, *delta, *weight;
    T *residual_out;
    float eps;
};

// Row m of x from nx, quantized into q, d as quantize_vals does; `writer` also stores the row's rounded
// residual + delta. The same f32 operations as add_rms_norm's block kernel (common/rms_norm_rows.cuh):
// thread t holds elements [8t, 8t + 8) (one vector, as that kernel's threads do for rows of up to 1024
// vectors), the sum of squares by block_sum (threads past K / 8 add zeros, which changes no bit), so x has
// that op's bits.
// Every thread of the block must call it.
template <typename T, int BK>
__device__ __forceinline__ void norm_quantize_row(int8_t *q, float *d, const NormX<T> &nx, int64_t m, int64_t K,
                                                  bool writer) {
    if constexpr (sizeof(T) != 2) {
        __trap(); // never launched so (ops::add_rms_norm_quant_linear_fused)
    } else {
        // the rounded sums wait here for the block's sum of squares (in registers they would stay live
        // beside the GEMV's weight words in flight, past the register budget of quant_gemv_kq_kernel)
        __shared__ Vec<T, 8> held[kGemvThreads];
        __shared__ float scratch[32];
        const int64_t k0 = 8 * int64_t(threadIdx.x), off = m * K + k0;
        const bool valid = k0 < K;
        float ss = 0.f, v[8] = {};
        if (valid) {
            const Vec<T, 8> a = add_rounded(load_vec<8>(nx.residual + off), load_vec<8>(nx.delta + off));
            if (writer) store_vec(nx.residual_out + off, a);
            held[threadIdx.x] = a;
            ss += sum_squares(a);
        }
        ss = block_sum(ss, scratch);
        const float scale = rsqrtf(ss / float(K) + nx.eps);
        if (valid) {
            const Vec<T, 8> xn = normalized(held[threadIdx.x], load_vec<8>(nx.weight + k0), scale);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = to_f32(xn.v[j]);
        }
        quantize_vals<BK>(q, d, v, K, m, valid ? k0 : 0, valid);
    }
}

// x [M, K] -> q, d in global memory, one group of 8 elements per thread (whole BK-blocks are in or out
// of range, and every lane reaches the shuffles). Launch: ceil(M K / 8 / 256) blocks of 256 threads.
template <typename T, int BK>
__global__ void quantize_x_kernel(int8_t *__restrict__ q, float *__restrict__ d, const T *__restrict__ x,
                                  int64_t ldx, int64_t M, int64_t K) {
    pdl_trigger();
    pdl_wait();
    const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    quantize_group<T, BK>(q, d, x, ldx, K, g, g < M * (K / 8));
}

// quantize_x_kernel for x given by nx: block m makes row m (and stores its residual_out row). Launch: M
// blocks of K / 8 threads rounded up to a warp.
template <typename T, int BK>
__global__ void norm_quantize_x_kernel(int8_t *__restrict__ q, float *__restrict__ d, NormX<T> nx, int64_t K) {
    pdl_trigger();
    pdl_wait();
    norm_quantize_row<T, BK>(q, d, nx, blockIdx.x, K, true);
}

// One sub-block of W dotted with 32 x codes, in f32: exact integer sums, then the scales. The codes'
// offsets and the mins multiply the sums of the x codes of each 16 (xs_lo, xs_hi).
__device__ __forceinline__ float sub_dot(const Sub32 &w, const int (&x)[8], int xs_lo, int xs_hi) {
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) lo = __dp4a(w.q[i], x[i], lo), hi = __dp4a(w.q[4 + i], x[4 + i], hi);
    const int isum = w.isc[0] * (lo - w.off * xs_lo) + w.isc[1] * (hi - w.off * xs_hi);
    return w.d * float(isum) - w.dm * float(xs_lo + xs_hi);
}

// Lanes that share one output row in the GEMV (N outputs, K inputs): at batch 1 the GEMVs of a decode
// step are latency-bound (a 2 MB matrix is under a microsecond of bandwidth), so the lanes of a row grow
// until ~64K threads read the matrix at once or each lane has one sub-block of 32 weights (8..256).
// N and K alone decide it, so linear_swiglu's g and u are summed in linear's order. 1.5B shapes: q/k/v
// 32, o and down 64, gate/up and LM head 8. Swept on the H100 (bench_ops, 2026-11-26): against
// (128K, from 16) this takes q/k/v 3.49 -> 2.60 us, Q4_K down 8.25 -> 6.93, Q6_K down 10.3 -> 8.34, the
// LM head 101 -> 90.7, Q8_0 4864 -> 896 5.22 -> 3.61; 32K or from 4 lose on some shapes.
inline int gemv_group(int64_t N, int64_t K) {
    int g = 8;
    while (g < 256 && g < K / 32 && N * g < 64 * 1024) g *= 2;
    return g;
}

// Whether the GEMV quantizes x itself: every block then does it again, which pays (one launch less)
// only while x is short.
inline bool gemv_fused(int64_t M, int64_t K) { return M * K <= 4096; }

// x [M, K] (rows ldx apart) -> q, d in shared memory: the block's threads take groups of 8 elements in
// rounds (every lane of a warp takes each round, for quantize_group's shuffles).
template <typename T, int BK>
__device__ __forceinline__ void quantize_x(int8_t *q, float *d, const T *__restrict__ x, int64_t ldx, int64_t M,
                                           int64_t K) {
    const int64_t total = M * (K / 8);
    for (int64_t g0 = 0; g0 < total; g0 += blockDim.x)
        quantize_group<T, BK>(q, d, x, ldx, K, g0 + threadIdx.x, g0 + threadIdx.x < total);
}

// Where both GEMVs find x after pdl_wait: its codes and scales from (norm_)quantize_x_kernel (xq), or, when
// xq.q is null, made here in shared memory by the whole block, from x or (nx.residual set) by the norm
// that makes x (block 0 then stores residual_out); and where the partial sums of wide groups go
// ([warps][MR][R] floats, after x's codes if those are here). Every thread must call it.
struct GemvX {
    const int8_t *q;
    const float *d;
    float *red;
};
template <typename T, int BK>
__device__ __forceinline__ GemvX gemv_x(QuantX xq, const NormX<T> &nx, uint8_t *smem, const T *__restrict__ x,
                                       int64_t ldx, int64_t M, int64_t K) {
    if (xq.q != nullptr) return GemvX{xq.q, xq.d, reinterpret_cast<float *>(smem)};
    int8_t *sq = reinterpret_cast<int8_t *>(smem);
    float *sd = reinterpret_cast<float *>(smem + M * K);
    if (nx.residual != nullptr)
        for (int64_t m = 0; m < M; ++m) norm_quantize_row<T, BK>(sq, sd, nx, m, K, blockIdx.x == 0);
    else quantize_x<T, BK>(sq, sd, x, ldx, M, K);
    __syncthreads();
    return GemvX{sq, sd, sd + M * (K / BK)};
}

// Adds sub-block s of W's row(s) dotted with the M x rows (codes and scales in shared memory) to acc.
// Rows past M repeat row M - 1 (computed, never stored). qx/dx: x's codes and scales, in shared or
// global memory.
template <class F, int MR, int R>
__device__ __forceinline__ void gemv_accumulate(float (&acc)[MR][R], const Sub32 (&sub)[R], const int8_t *qx,
                                                const float *dx, int64_t s, int64_t M, int64_t K) {
    const int64_t b = s / F::kSubs, nb = K / F::kBK;
#pragma unroll
    for (int m = 0; m < MR; ++m) {
        const int64_t row = m < M ? m : M - 1;
        const int4 *xp = reinterpret_cast<const int4 *>(qx + row * K + s * 32);
        const int4 x0 = xp[0], x1 = xp[1];
        const int xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        int xs_lo = 0, xs_hi = 0;
        if constexpr (F::kOffsets)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                xs_lo = __dp4a(xv[i], 0x01010101, xs_lo), xs_hi = __dp4a(xv[4 + i], 0x01010101, xs_hi);
        const float d = dx[row * nb + b];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] += d * sub_dot(sub[r], xv, xs_lo, xs_hi);
    }
}

template <class F, int R>
__device__ __forceinline__ void load_sub(Sub32 (&sub)[R], const uint8_t *w, int64_t row_bytes, int64_t n, int64_t N,
                                         int64_t s) {
#pragma unroll
    for (int r = 0; r < R; ++r) sub[r] = F::sub(w + (n + r * N) * row_bytes + s / F::kSubs * F::kBytes, int(s % F::kSubs));
}

// The end of both GEMVs: the G lanes' f32 sums of a row reduced by shuffles (then through shared memory
// `red` for G > 32, added in warp order), and lane m of the group stores x row m's output. Every thread of
// the block must call it (the shuffles and the barrier).
template <typename T, int MR, int R, bool kSwiglu>
__device__ __forceinline__ void gemv_reduce_store(float (&acc)[MR][R], T *__restrict__ out, const T *__restrict__ bias,
                                                  float *red, int64_t M, int64_t N, int64_t n, bool live, int G,
                                                  int gl, int grp) {
    const int width = G < 32 ? G : 32;
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r)
            for (int o = 1; o < width; o <<= 1) acc[m][r] += __shfl_xor_sync(0xffffffffu, acc[m][r], o);
    if (G > 32) { // the group's warps: partial sums through shared memory, added in warp order
        const int warp = threadIdx.x >> 5, per = G / 32;
        if ((threadIdx.x & 31) == 0)
#pragma unroll
            for (int m = 0; m < MR; ++m)
#pragma unroll
                for (int r = 0; r < R; ++r) red[(warp * MR + m) * R + r] = acc[m][r];
        __syncthreads();
#pragma unroll
        for (int m = 0; m < MR; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float v = 0.f;
                for (int i = 0; i < per; ++i) v += red[((grp * per + i) * MR + m) * R + r];
                acc[m][r] = v;
            }
    }
    if (!live) return;
#pragma unroll
    for (int m = 0; m < MR; ++m) {
        if (m >= M || gl != m) continue; // lane m of the group stores row m
        if constexpr (kSwiglu) { // the swiglu op's formula (common/swiglu_math.cuh)
            const float g = to_f32(from_f32<T>(acc[m][0])), u = to_f32(from_f32<T>(acc[m][1]));
            out[m * N + n] = from_f32<T>(swiglu_f32(g, u));
        } else {
            out[m * N + n] = from_f32<T>(acc[m][0] + (bias ? to_f32(bias[n]) : 0.f));
        }
    }
}

// out [M, N] = x @ W^T (+ bias [N]) with W [N, K], or with kSwiglu out = swiglu(x @ W[:N]^T, x @ W[N:]^T)
// with W [2N, K], g and u rounded to T first as linear + swiglu would. M <= MR.
// Work: G lanes (gemv_group) per output row, kGemvThreads / G rows per block, one block per such tile.
// Lane l of a row takes sub-blocks l, l + G, ... (32 weights each, two at a time), dots them with the M
// x rows, and the group's f32 sums are reduced by shuffles (then through shared memory for G > 32). A
// row's summation order depends on N and K alone, so linear_swiglu's g and u equal linear's outputs bit
// for bit. W is constant, so each lane loads its first two sub-blocks before waiting for the kernel
// ahead: at batch 1 most lanes have no others, and the read is hidden behind that kernel's tail.
// x arrives raw (xq.q null, gemv_fused: each block quantizes it into shared memory) or as codes and
// scales from quantize_x_kernel (read from global memory, where L1 keeps them).
template <class F, typename T, int MR, bool kSwiglu>
__global__ void __launch_bounds__(kGemvThreads)
    quant_gemv_kernel(T *__restrict__ out, const uint8_t *__restrict__ w, int64_t row_bytes, const T *__restrict__ x,
                      int64_t ldx, QuantX xq, NormX<T> nx, const T *__restrict__ bias, int64_t M, int64_t N, int64_t K,
                      int G) {
    constexpr int R = kSwiglu ? 2 : 1;
    extern __shared__ __align__(16) uint8_t smem[];
    const int64_t nsub = K / 32;
    const int rows = kGemvThreads / G, gl = threadIdx.x % G, grp = threadIdx.x / G;
    const int64_t n = int64_t(blockIdx.x) * rows + grp;
    const bool live = n < N;
    int64_t s = gl;
    Sub32 a[R], b[R];
    if (live && s < nsub) load_sub<F, R>(a, w, row_bytes, n, N, s);
    if (live && s + G < nsub) load_sub<F, R>(b, w, row_bytes, n, N, s + G);
    pdl_trigger();
    pdl_wait();
    const GemvX gx = gemv_x<T, F::kBK>(xq, nx, smem, x, ldx, M, K);
    const int8_t *qx = gx.q;
    const float *dx = gx.d;
    float *red = gx.red;
    float acc[MR][R] = {};
    if (live)
        while (s < nsub) {
            gemv_accumulate<F, MR, R>(acc, a, qx, dx, s, M, K);
            if (s + G >= nsub) break;
            gemv_accumulate<F, MR, R>(acc, b, qx, dx, s + G, M, K);
            s += 2 * int64_t(G);
            if (s < nsub) load_sub<F, R>(a, w, row_bytes, n, N, s);
            if (s + G < nsub) load_sub<F, R>(b, w, row_bytes, n, N, s + G);
        }
    gemv_reduce_store<T, MR, R, kSwiglu>(acc, out, bias, red, M, N, n, live, G, gl, grp);
}

// Adds chunk c of W's block b (one Raw per W row) dotted with the M x rows to acc (see Chunk in
// blocks.cuh): per run, exact integer sums, then the block's scales, then x's scale for the block.
template <class C, int MR, int R>
__device__ __forceinline__ void kq_accumulate(float (&acc)[MR][R], const typename C::Raw (&raw)[R], int c,
                                              const int8_t *qx, const float *dx, int64_t b, int64_t M, int64_t K) {
    Chunk k[R];
#pragma unroll
    for (int r = 0; r < R; ++r) k[r] = C::decode(raw[r], c);
    const int64_t nb = K / 256, e = 256 * b + C::run_a(c);
#pragma unroll
    for (int m = 0; m < MR; ++m) {
        const int64_t row = m < M ? m : M - 1;
        const int4 xa = *reinterpret_cast<const int4 *>(qx + row * K + e);
        const int4 xb = *reinterpret_cast<const int4 *>(qx + row * K + e + C::kRunGap);
        const int va[4] = {xa.x, xa.y, xa.z, xa.w}, vb[4] = {xb.x, xb.y, xb.z, xb.w};
        int sa = 0, sb = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) sa = __dp4a(va[i], 0x01010101, sa), sb = __dp4a(vb[i], 0x01010101, sb);
        const float d = dx[row * nb + b];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            int da = 0, db = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) da = __dp4a(k[r].q[0][i], va[i], da), db = __dp4a(k[r].q[1][i], vb[i], db);
            const int isum = k[r].isc[0] * (da - k[r].off * sa) + k[r].isc[1] * (db - k[r].off * sb);
            acc[m][r] += d * (k[r].d * float(isum) - (k[r].dm[0] * float(sa) + k[r].dm[1] * float(sb)));
        }
    }
}

// The K-quants' GEMV (Q4_K, Q5_K, Q6_K; 256-weight blocks): quant_gemv_kernel's work, outputs and
// reduction, but lane l of a row's G takes chunk l % 8 of blocks l / 8, l / 8 + G / 8, ... (Chunk in
// blocks.cuh): the 8 lanes of a block read it as one contiguous span. Each lane keeps kKqDepth blocks'
// raw words in flight (all loads issued before any is used; the first ones before pdl_wait, W being
// constant); addresses past the row are clamped to its last block rather than branched around, so the
// loads stay in one straight run of code.
constexpr int kKqDepth = 2;
// Smaller K-quant matrices (N outputs x K, so linear_swiglu's halves choose as linear does) take
// quant_gemv_kernel: latency-bound, they gain more from its finer split (a lane per 32-weight sub-block)
// than from whole-block reads (measured on the H100 both ways: bench/RESULTS.md, session 20).
constexpr int64_t kKqMinWeights = int64_t(4) << 20;
// Blocks an SM must hold (__launch_bounds__): at batch 1, 3 (<= 80 registers a thread) where the raw words
// in flight leave room for it without spilling, so that gate/up's 280 blocks run in one wave on 132 SMs.
template <class F, int MR, bool kSwiglu>
constexpr int kq_min_blocks() {
    constexpr size_t raw = sizeof(typename KChunkOf<F>::type::Raw) * (kSwiglu ? 2 : 1) * kKqDepth;
    return MR == 1 && raw <= 160 ? 3 : 1;
}
template <class F, typename T, int MR, bool kSwiglu, bool kV16>
__global__ void __launch_bounds__(kGemvThreads, kq_min_blocks<F, MR, kSwiglu>())
    quant_gemv_kq_kernel(T *__restrict__ out, const uint8_t *__restrict__ w, int64_t row_bytes,
                         const T *__restrict__ x, int64_t ldx, QuantX xq, NormX<T> nx, const T *__restrict__ bias,
                         int64_t M, int64_t N, int64_t K, int G) {
    using C = typename KChunkOf<F>::type;
    constexpr int R = kSwiglu ? 2 : 1, D = kKqDepth;
    extern __shared__ __align__(16) uint8_t smem[];
    const int64_t nb = K / 256;
    const int rows = kGemvThreads / G, gl = threadIdx.x % G, grp = threadIdx.x / G, c = gl % 8;
    const int64_t n = int64_t(blockIdx.x) * rows + grp, step = G / 8, b0 = gl / 8;
    const bool live = n < N;
    const uint8_t *wrow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wrow[r] = w + ((live ? n : N - 1) + r * N) * row_bytes;
    typename C::Raw raw[D][R];
#pragma unroll
    for (int i = 0; i < D; ++i)
#pragma unroll
        for (int r = 0; r < R; ++r)
            C::template load<kV16>(raw[i][r], wrow[r] + std::min(b0 + i * step, nb - 1) * F::kBytes, c);
    pdl_trigger();
    pdl_wait();
    const GemvX gx = gemv_x<T, 256>(xq, nx, smem, x, ldx, M, K);
    const int8_t *qx = gx.q;
    const float *dx = gx.d;
    float *red = gx.red;
    float acc[MR][R] = {};
    if (live)
        for (int64_t b = b0; b < nb; b += D * step) {
#pragma unroll
            for (int i = 0; i < D; ++i) {
                const int64_t bi = b + i * step;
                if (bi >= nb) break;
                kq_accumulate<C, MR, R>(acc, raw[i], c, qx, dx, bi, M, K);
                const int64_t next = std::min(bi + D * step, nb - 1);
#pragma unroll
                for (int r = 0; r < R; ++r) C::template load<kV16>(raw[i][r], wrow[r] + next * F::kBytes, c);
            }
        }
    gemv_reduce_store<T, MR, R, kSwiglu>(acc, out, bias, red, M, N, n, live, G, gl, grp);
}

// out [n, K] = rows ids[i] of W [V, K] decoded (embedding; an id outside [0, V) sets the device error
// flag and zero-fills its row), or rows i when ids is null (dequantize, the M > 8 path's dense copy of W), for
// the 32-weight formats (Q4_0, Q5_0, Q8_0); the K-quants take decode_blocks_kernel below. Launch: flat over the n * K / 8 pieces of 8 weights, 256 threads a block (kDecodeThreads): four consecutive
// lanes share a sub-block of 32 (each reads the sub-block's bytes: the same addresses within a warp's load, one
// access for the four) and each writes its 8 weights as one 16-byte store where the row allows, so a warp's
// store covers 512 contiguous bytes. (Before: one block of K/32 threads a row, a thread decoding and writing a
// whole sub-block: a warp's loads touched 32 sub-blocks, its stores a 64-byte stride; at 256 rows of the 1.5B
// Q4_K_M a step's copies took 2.2 ms for ~3.9 GB, and a flat launch of the same per-thread work did not change
// that (session 33, call 4).) A plain launch, never PDL: a model reuses one out buffer for weight after
// weight, so this kernel must not start writing while the GEMM ahead still reads it.
constexpr int kDecodeThreads = 256;

template <class F, typename T, typename Id>
__global__ void __launch_bounds__(kDecodeThreads) decode_rows_kernel(T *__restrict__ out, const Id *__restrict__ ids,
                                                                   const uint8_t *__restrict__ w, int64_t row_bytes,
                                                                   int64_t n, int64_t V, int64_t K, int *error_flag) {
    const int64_t pieces = K / 8, g = int64_t(blockIdx.x) * kDecodeThreads + threadIdx.x;
    if (g >= n * pieces) return;
    const int64_t i = g / pieces, p = g % pieces, s = p / 4, r = ids ? int64_t(ids[i]) : i;
    const int j0 = int(p % 4) * 8; // this lane's weights j0 .. j0 + 7 of sub-block s
    T *o = out + i * K + p * 8;
    union {
        T v[8];
        uint32_t u[8 * sizeof(T) / 4];
    } vals;
    if (r < 0 || r >= V) {
        if (p == 0) *error_flag = kIdOutOfRange;
#pragma unroll
        for (int j = 0; j < 8; ++j) vals.v[j] = from_f32<T>(0.f);
    } else {
        Sub32 sub = F::sub(w + r * row_bytes + s / F::kSubs * F::kBytes, int(s % F::kSubs));
        // this lane's codes and scale moved to the front by selects, so every index below is a constant and
        // the sub-block stays in registers (an index j0 + j would put it in local memory)
        const int q0 = j0 / 4;
        const int a = q0 == 0 ? sub.q[0] : q0 == 2 ? sub.q[2] : q0 == 4 ? sub.q[4] : sub.q[6];
        const int b = q0 == 0 ? sub.q[1] : q0 == 2 ? sub.q[3] : q0 == 4 ? sub.q[5] : sub.q[7];
        sub.q[0] = a, sub.q[1] = b;
        sub.isc[0] = j0 < 16 ? sub.isc[0] : sub.isc[1];
#pragma unroll
        for (int j = 0; j < 8; ++j) vals.v[j] = from_f32<T>(decode<F>(sub, j));
    }
    if constexpr (sizeof(T) == 2) {
        if (reinterpret_cast<uintptr_t>(o) % 16 == 0) {
            *reinterpret_cast<uint4 *>(o) = make_uint4(vals.u[0], vals.u[1], vals.u[2], vals.u[3]);
            return;
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = vals.v[j];
}

// The same for the K-quants, a 256-weight block by 8 lanes: lane c loads the chunk the GEMV reads (the block's
// 16-byte head and 16 bytes of codes, qblocks::KChunkOf) and writes its two runs of 16 weights, 32 weights a
// lane (a warp writes four whole blocks, 2 KB at 16 bits, through shared memory). Codes become floats by their bits (2^23 + q as a
// float, minus 2^23 + off: exact), not by int-to-float conversions, which run at a quarter of the rate of the
// other arithmetic; each weight is still (d * isc) * (q - off) - dm in f32, gguf-py's operations and order.
// Flat unsigned 32-bit indexing (the host checks the range). H200, bench_ops QuantDequantize, against
// decode_rows_kernel: Q4_K 17920 x 1536 26.4 -> 19.9 us (3.5 TB/s), Q6_K LM head 286 -> 165 us (4.0 TB/s).
template <class F, typename T, typename Id, bool kV16>
__global__ void __launch_bounds__(kDecodeThreads) decode_blocks_kernel(T *__restrict__ out, const Id *__restrict__ ids,
                                                                     const uint8_t *__restrict__ w, int64_t row_bytes,
                                                                     uint32_t n, int64_t V, uint32_t K, int *error_flag) {
    using C = typename KChunkOf<F>::type;
    const uint32_t nb = K / F::kBK, g = blockIdx.x * kDecodeThreads + threadIdx.x;
    // lanes past the end stay for the warp's __syncwarp below (a block's 8 lanes are all live or all not)
    const bool live = g < n * nb * 8u;
    const int c = int(g % 8u);
    const uint32_t bi = g / 8u, i = live ? bi / nb : 0u, b = bi % nb;
    const int64_t r = !live ? 0 : ids ? int64_t(ids[i]) : int64_t(i);
    union {
        T v[2][16];
        uint4 u[2][16 * sizeof(T) / 16];
    } vals;
    if (r < 0 || r >= V) {
        if (live && b == 0 && c == 0) *error_flag = kIdOutOfRange;
#pragma unroll
        for (int j = 0; j < 16; ++j) vals.v[0][j] = vals.v[1][j] = from_f32<T>(0.f);
    } else if (live) {
        typename C::Raw raw;
        C::template load<kV16>(raw, w + r * row_bytes + int64_t(b) * F::kBytes, c);
        const Chunk k = C::decode(raw, c);
        const float base = __fadd_rn(8388608.f, float(k.off));
#pragma unroll
        for (int run = 0; run < 2; ++run) {
            const float s = __fmul_rn(k.d, float(k.isc[run]));
            const float dm = k.dm[run]; // 0 for Q6_K (x - 0 is x, as in decode())
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const float q = __fsub_rn(__int_as_float(int(__byte_perm(uint32_t(k.q[run][j / 4]), 0x4B000000u,
                                                                           0x7540u | unsigned(j % 4)))),
                                          base);
                vals.v[run][j] = from_f32<T>(__fsub_rn(__fmul_rn(s, q), dm));
            }
        }
    }
    // The warp's four blocks are 1,024 consecutive weights of out (row i, block b starts at (i nb + b) 256):
    // staged in shared memory, then written 16 bytes a lane, a warp's instruction filling four whole 128-byte
    // lines. (Stored from the lanes' runs directly, an instruction touched 16 lines: the L2's request rate
    // bound the kernel, call 2.)
    constexpr int kRunGap = C::kRunGap, kWarpElems = 4 * F::kBK;
    __shared__ __align__(16) unsigned char stage[kDecodeThreads / 32][kWarpElems * sizeof(T)];
    const int lane = int(threadIdx.x % 32);
    T *st = reinterpret_cast<T *>(stage[threadIdx.x / 32]);
    if (live) {
        T *s0 = st + (lane / 8) * F::kBK + C::run_a(c);
#pragma unroll
        for (int run = 0; run < 2; ++run)
#pragma unroll
            for (int v = 0; v < int(16 * sizeof(T) / 16); ++v)
                reinterpret_cast<uint4 *>(s0 + run * kRunGap)[v] = vals.u[run][v];
    }
    __syncwarp();
    const uint32_t first = (g - uint32_t(lane)) / 8u; // the warp's first block
    const uint32_t blocks = min(4u, n * nb - min(first, n * nb));
    T *dst = out + int64_t(first) * F::kBK;
    if (reinterpret_cast<uintptr_t>(out) % 16 == 0) {
        constexpr int kPer = 16 / int(sizeof(T));
        for (int p = lane; p < int(blocks) * F::kBK / kPer; p += 32)
            reinterpret_cast<uint4 *>(dst)[p] = reinterpret_cast<const uint4 *>(st)[p];
    } else {
        for (int e = lane; e < int(blocks) * F::kBK; e += 32) dst[e] = st[e];
    }
}

// The readers load 4-byte words at 2- or 4-byte offsets from a row start (F::kAlign): every row starts
// so aligned when the matrix does (row_bytes is a multiple of the block size).
template <class F>
void check_aligned(const char *op, const QuantMatrix &w) {
    LLAISYS_CHECK(reinterpret_cast<uintptr_t>(w.bytes().data()) % F::kAlign == 0, std::invalid_argument, op, ": ",
                  quant_format_info(w.format()).name, " weight bytes must start on a ", F::kAlign,
                  "-byte boundary on ", w.device().str());
}

// The add_rms_norm whose output is the GEMV's x (add_rms_norm_quant_linear): residual [M, K] + delta ->
// residual_out, x = rms_norm of that * weight [K]; all contiguous, 16-byte aligned, 2-byte dtype.
struct NormArgs {
    Tensor residual_out, residual, delta, weight;
    float eps;
};
template <typename T>
NormX<device_t<T>> norm_x(const NormArgs *n) {
    if (n == nullptr) return {nullptr, nullptr, nullptr, nullptr, 0.f};
    return {dptr<T>(n->residual), dptr<T>(n->delta), dptr<T>(n->weight), dptr<T>(n->residual_out), n->eps};
}

// Launches the GEMV for N outputs (see quant_gemv_kernel); unless gemv_fused, quantize_x_kernel (or with a
// norm, norm_quantize_x_kernel) first turns x into codes and scales in a stream-ordered scratch. With a
// norm, x is residual (its shape; the kernels read the norm's operands instead).
template <class F, typename T, int MR, bool kSwiglu>
void launch_gemv(const Tensor &out, const Tensor &x, const QuantMatrix &w, const Tensor &bias, int64_t N,
                 const NormArgs *norm) {
    using D = device_t<T>;
    const int64_t M = x.size(0), K = w.cols(), nb = K / F::kBK;
    const int dev = out.device().index, G = gemv_group(N, K);
    const cudaStream_t stream = stream_of(out);
    const bool fused = gemv_fused(M, K);
    const NormX<D> nx = norm_x<T>(norm);
    QuantX xq{nullptr, nullptr};
    Tensor scratch;
    if (!fused) { // q int8 [M, K], then d f32 [M, nb] (K % 32 == 0 keeps both 16-byte aligned)
        scratch = Tensor::empty({M * K + M * nb * 4}, DType::U8, out.device());
        int8_t *q = reinterpret_cast<int8_t *>(scratch.data());
        float *d = reinterpret_cast<float *>(q + M * K);
        if (norm != nullptr)
            launch_pdl(norm_quantize_x_kernel<D, F::kBK>, dim3(unsigned(M)), dim3(unsigned(ceil_div(K / 8, 32) * 32)),
                       0, stream, dev, q, d, nx, K);
        else
            launch_pdl(quantize_x_kernel<D, F::kBK>, dim3(unsigned(ceil_div(M * K / 8, 256))), dim3(256), 0, stream,
                       dev, q, d, dptr<T>(x), detail::ld(x), M, K);
        xq = QuantX{q, d};
    }
    // x's codes and scales when fused (< 48 KB: M K <= 4096), then the partial sums of wide groups
    const size_t smem = (fused ? size_t(M * K + M * nb * 4) : 0) + (kGemvThreads / 32) * MR * (kSwiglu ? 2 : 1) * 4;
    const auto kernel = [&] {
        if constexpr (F::kBK == 256) { // large K-quant matrices: chunked reads, 16-byte loads where aligned
            const bool v16 = F::kBytes % 16 == 0 && reinterpret_cast<uintptr_t>(w.bytes().data()) % 16 == 0;
            if (N * K >= kKqMinWeights)
                return v16 ? quant_gemv_kq_kernel<F, D, MR, kSwiglu, F::kBytes % 16 == 0>
                           : quant_gemv_kq_kernel<F, D, MR, kSwiglu, false>;
        }
        return quant_gemv_kernel<F, D, MR, kSwiglu>;
    }();
    launch_pdl(kernel, dim3(unsigned(ceil_div(N, int64_t(kGemvThreads / G)))), dim3(kGemvThreads), smem, stream, dev,
               dptr<T>(out), w.bytes().data_as<uint8_t>(), w.row_bytes(), dptr<T>(x),
               norm != nullptr ? K : detail::ld(x), xq, nx, bias.defined() ? dptr<T>(bias) : nullptr, M, N, K,
               G);
}

template <typename T, bool kSwiglu>
void gemv(const char *op, const Tensor &out, const Tensor &x, const QuantMatrix &w, const Tensor &bias,
          const NormArgs *norm = nullptr) {
    const int64_t M = x.size(0), N = out.size(1);
    dispatch_format(w.format(), [&](auto f) {
        using F = decltype(f);
        check_aligned<F>(op, w);
        if (M == 1) launch_gemv<F, T, 1, kSwiglu>(out, x, w, bias, N, norm);
        else if (M == 2) launch_gemv<F, T, 2, kSwiglu>(out, x, w, bias, N, norm);
        else if (M <= 4) launch_gemv<F, T, 4, kSwiglu>(out, x, w, bias, N, norm);
        else launch_gemv<F, T, 8, kSwiglu>(out, x, w, bias, N, norm);
    });
}

// out [n, K] (T, contiguous) = W's rows ids (or all rows when ids is null: no id can be out of range, so no
// error flag, which the first op to use it allocates) decoded by decode_blocks_kernel (K-quants, while its
// lanes fit 32-bit indexing) or decode_rows_kernel.
template <typename T, typename Id>
void decode_rows(const char *op, const Tensor &out, const Id *ids, const QuantMatrix &w) {
    const int64_t n = out.size(0), K = w.cols();
    LLAISYS_CHECK(n <= INT32_MAX, std::invalid_argument, op, ": too many rows for one launch: ", n);
    const int64_t blocks = ceil_div(n * (K / 8), int64_t(kDecodeThreads));
    LLAISYS_CHECK(blocks <= INT32_MAX, std::invalid_argument, op, ": too many weights for one launch: ", n * K);
    int *const flag = ids ? ::llaisys::runtime::cuda::error_flag(out.device()) : nullptr;
    dispatch_format(w.format(), [&](auto f) {
        using F = decltype(f);
        check_aligned<F>(op, w);
        const uint8_t *bytes = w.bytes().data_as<uint8_t>();
        if constexpr (F::kBK == 256) {
            const int64_t lanes = n * (K / F::kBK) * 8;
            if (lanes <= int64_t(UINT32_MAX) - kDecodeThreads) {
                const bool v16 = F::kBytes % 16 == 0 && reinterpret_cast<uintptr_t>(bytes) % 16 == 0 &&
                                 w.row_bytes() % 16 == 0;
                const auto kernel = v16 ? decode_blocks_kernel<F, device_t<T>, Id, true>
                                        : decode_blocks_kernel<F, device_t<T>, Id, false>;
                kernel<<<unsigned(ceil_div(lanes, int64_t(kDecodeThreads))), kDecodeThreads, 0, stream_of(out)>>>(
                    dptr<T>(out), ids, bytes, w.row_bytes(), uint32_t(n), w.rows(), uint32_t(K), flag);
                CUDA_CHECK_LAUNCH();
                return;
            }
        }
        decode_rows_kernel<F, device_t<T>, Id><<<unsigned(blocks), kDecodeThreads, 0, stream_of(out)>>>(
            dptr<T>(out), ids, bytes, w.row_bytes(), n, w.rows(), K, flag);
        CUDA_CHECK_LAUNCH();
    });
}

// W decoded into a new dense tensor [rows, K] of dtype T (the op's M > 8 path).
template <typename T>
Tensor dense_weight(const char *op, const QuantMatrix &w, DType dtype) {
    const Tensor dense = Tensor::empty({w.rows(), w.cols()}, dtype, w.device());
    decode_rows<T, int64_t>(op, dense, nullptr, w);
    return dense;
}

// ---- M > 8, K-quants: the tensor-core GEMM (tc_gemm.cuh) ----

// Blocks of Kernel resident on one SM (its shared memory decides), asked of the runtime once.
template <auto Kernel>
int tc_resident(size_t smem, int device) {
    static const int n = [&] {
        opt_in_smem<Kernel>(smem, device);
        int blocks = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, Kernel, qtc::kThreads, smem));
        return std::max(1, blocks);
    }();
    return n;
}

// Splits K over blockIdx.y so that the N tiles times the splits fill at most one wave of resident blocks
// (at least one step of kBK a split); with more than one split, f32 partials and quant_tc_reduce_kernel.
// The plan counts the tiles of a plain weight of `cols` rows also for kSwiglu (whose tiles hold BN / 2
// outputs): the same splits for linear_swiglu as for its two halves through quant_linear, hence the same
// sums in the same order, and g and u of the same bits. resident: blocks an SM of the plain kernel of this
// tile shape (also for kSwiglu: the same plan).
template <auto Kernel, typename D, bool kSwiglu>
void launch_tc(const Tensor &out, const Tensor &x, const QuantMatrix &w, const Tensor &bias, int BM, int BN,
               size_t smem, int resident) {
    const int dev = out.device().index;
    opt_in_smem<Kernel>(smem, dev);
    const int64_t M = x.size(0), K = w.cols(), cols = out.size(1), steps = K / qtc::kBK;
    const int64_t plain_tiles = ceil_div(cols, int64_t(BN)), mtiles = ceil_div(M, int64_t(BM));
    const int64_t tiles = kSwiglu ? ceil_div(cols, int64_t(BN / 2)) : plain_tiles;
    const int64_t slots = int64_t(resident) * sm_count(dev);
    int64_t splits = std::clamp<int64_t>(slots / (plain_tiles * mtiles), 1, steps);
    const int64_t per = ceil_div(steps, splits);
    splits = ceil_div(steps, per);
    LLAISYS_CHECK(tiles <= INT32_MAX && mtiles <= 65535, std::invalid_argument,
                  "quant_linear: too many rows or columns for one launch: [", M, ", ", cols, "]");
    const cudaStream_t stream = stream_of(out);
    Tensor part;
    if (splits > 1) part = Tensor::empty({splits * M * (kSwiglu ? 2 * cols : cols)}, DType::F32, out.device());
    const qtc::Args a{w.bytes().data_as<uint8_t>(), w.row_bytes(), x.data(), detail::ld(x),
                      bias.defined() ? bias.data() : nullptr, out.data(),
                      splits > 1 ? reinterpret_cast<float *>(part.data()) : nullptr, M, cols, K, int(per)};
    Kernel<<<dim3(unsigned(tiles), unsigned(splits), unsigned(mtiles)), qtc::kThreads, smem, stream>>>(a);
    CUDA_CHECK_LAUNCH();
    if (splits > 1) {
        qtc::quant_tc_reduce_kernel<D, kSwiglu><<<unsigned(ceil_div(M * cols, int64_t(256))), 256, 0, stream>>>(
            static_cast<D *>(out.data()), reinterpret_cast<const float *>(part.data()),
            bias.defined() ? static_cast<const D *>(bias.data()) : nullptr, M, cols, int(splits));
        CUDA_CHECK_LAUNCH();
    }
}

template <class F, typename D, int WM, int MT, bool kSwiglu>
void launch_tc_shape(const Tensor &out, const Tensor &x, const QuantMatrix &w, const Tensor &bias, bool v16) {
    constexpr size_t smem = qtc::smem_bytes<WM, MT>();
    constexpr int BM = qtc::bm<WM, MT>(), BN = qtc::bn<WM>();
    constexpr bool kV16 = F::kBytes % 16 == 0;
    const int dev = out.device().index;
    if (v16 && kV16) {
        const int resident = tc_resident<qtc::quant_tc_kernel<F, D, WM, MT, false, kV16>>(smem, dev);
        launch_tc<qtc::quant_tc_kernel<F, D, WM, MT, kSwiglu, kV16>, D, kSwiglu>(out, x, w, bias, BM, BN, smem, resident);
    } else {
        const int resident = tc_resident<qtc::quant_tc_kernel<F, D, WM, MT, false, false>>(smem, dev);
        launch_tc<qtc::quant_tc_kernel<F, D, WM, MT, kSwiglu, false>, D, kSwiglu>(out, x, w, bias, BM, BN, smem, resident);
    }
}

// The tensor-core GEMM where quant_linear_tc says so and x's rows are 16-byte aligned; false (nothing
// launched) otherwise. The tile height follows M (the fewest m16 tiles a warp that cover it).
template <typename T, bool kSwiglu>
bool tc_gemm(const char *op, const Tensor &out, const Tensor &x, const QuantMatrix &w, const Tensor &bias) {
    if constexpr (sizeof(T) != 2) {
        return false;
    } else {
        using D = device_t<T>;
        const int64_t M = x.size(0);
        if (!::llaisys::ops::quant_linear_tc(x.dtype(), x.device(), M, w.format())) return false;
        if (reinterpret_cast<uintptr_t>(x.data()) % 16 != 0 || detail::ld(x) * 2 % 16 != 0) return false;
        bool launched = false;
        dispatch_format(w.format(), [&](auto f) {
            using F = decltype(f);
            if constexpr (F::kBK == 256) {
                check_aligned<F>(op, w);
                const bool v16 = reinterpret_cast<uintptr_t>(w.bytes().data()) % 16 == 0;
                // the tile shape by M (bench_ops, H200, session 34): up to 32 rows two warps along M and
                // 128 W rows a block (four along M left three idle: 1536 -> 2 x 8960 at M = 16, 34.1 ->
                // 25.9 us); up to 64, four along M and 64 W rows; past kQuantTcMaxRows (only where
                // LLAISYS_QUANT_TC_MAX_ROWS raises it) taller tiles, W decoded once for up to 256 rows
                if (M <= 32) launch_tc_shape<F, D, 2, 1, kSwiglu>(out, x, w, bias, v16);
                else if (M <= 64) launch_tc_shape<F, D, 4, 1, kSwiglu>(out, x, w, bias, v16);
                else if (M <= 128) launch_tc_shape<F, D, 4, 2, kSwiglu>(out, x, w, bias, v16);
                else launch_tc_shape<F, D, 4, 4, kSwiglu>(out, x, w, bias, v16);
                launched = true;
            }
        });
        return launched;
    }
}

} // namespace

void quant_linear(const Tensor &out, const Tensor &x, const QuantMatrix &weight, const Tensor &bias) {
    constexpr const char *op = "quant_linear";
    detail::dispatch_float(op, x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        if (x.size(0) > kMaxGemvM) {
            if (tc_gemm<T, false>(op, out, x, weight, bias)) return;
            return ::llaisys::ops::linear(out, x, dense_weight<T>(op, weight, x.dtype()), bias, false);
        }
        gemv<T, false>(op, out, x, weight, bias);
    });
}

void quant_linear_swiglu(const Tensor &out, const Tensor &x, const QuantMatrix &w_gate_up) {
    constexpr const char *op = "quant_linear_swiglu";
    detail::dispatch_float(op, x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        if (x.size(0) > kMaxGemvM) {
            if (tc_gemm<T, true>(op, out, x, w_gate_up, Tensor())) return;
            return ::llaisys::ops::linear_swiglu(out, x, dense_weight<T>(op, w_gate_up, x.dtype()), false);
        }
        gemv<T, true>(op, out, x, w_gate_up, Tensor());
    });
}

// x = add_rms_norm's output computed inside the GEMV (NormX). The caller (op.cpp) has checked the shapes
// for which that gives the op's bits (ops::add_rms_norm_quant_linear_fused: a 2-byte dtype, M <= 8, and rows
// whose add_rms_norm block kernel gives each thread one vector of 8, 64 < K / 8 <= kGemvThreads, or is one
// warp of one vector each, K / 8 <= 32); what is left is the 16-byte alignment of the vector loads.
bool add_rms_norm_quant_linear(const Tensor &out, const Tensor &residual_out, const Tensor &residual,
                               const Tensor &delta, const Tensor &norm_weight, float eps, const QuantMatrix &weight,
                               const Tensor &bias, bool swiglu) {
    constexpr const char *op = "add_rms_norm_quant_linear";
    static_assert(kGemvThreads == 256, "ops::add_rms_norm_quant_linear_fused assumes K / 8 <= 256 threads");
    const auto aligned = [](const Tensor &t) { return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; };
    if (!aligned(residual_out) || !aligned(residual) || !aligned(delta) || !aligned(norm_weight)) return false;
    const NormArgs norm{residual_out, residual, delta, norm_weight, eps};
    detail::dispatch_float(op, residual.dtype(), residual.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        if constexpr (sizeof(T) == 2) {
            if (swiglu) gemv<T, true>(op, out, residual, weight, Tensor(), &norm);
            else gemv<T, false>(op, out, residual, weight, bias, &norm);
        }
    });
    return true;
}

void quant_embedding(const Tensor &out, const Tensor &ids, const QuantMatrix &weight) {
    constexpr const char *op = "quant_embedding";
    detail::dispatch_float(op, out.dtype(), out.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        detail::dispatch_index(op, ids.dtype(), ids.device(), [&](auto itag) {
            using Id = typename decltype(itag)::type;
            decode_rows<T, Id>(op, out, ids.data_as<Id>(), weight);
        });
    });
}

void quant_dequantize(const Tensor &out, const QuantMatrix &weight) {
    constexpr const char *op = "quant_dequantize";
    detail::dispatch_float(op, out.dtype(), out.device(), [&](auto tag) {
        decode_rows<typename decltype(tag)::type, int64_t>(op, out, nullptr, weight);
    });
}

} // namespace llaisys::ops::cuda
