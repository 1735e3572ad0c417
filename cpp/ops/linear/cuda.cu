// CUDA linear: out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]), accumulated in f32.
//   M <= 8 (decode): gemv_kernel, which streams W once at memory bandwidth; for M = 1 and a small W the
//   caller declared constant, gemv_preload_kernel, which loads W before the kernel ahead has finished.
//   M > 8 (prefill, decode batches): cuBLASLt with f32 compute (no TF32; for bf16/f16 outputs only split-K
//   algorithms whose partial sums stay f32) and the bias fused as an epilogue; the
//   GEMV also serves as the fallback if cuBLASLt offers no algorithm (and for K = 0).
// linear_swiglu / linear_geglu: the same GEMV with an epilogue that pairs gate row n with up row I + n for
// M <= 8; two cuBLASLt GEMMs and the swiglu / geglu kernel for M > 8. linear_gelu: the GEMV with linear's
// rows and a GELU after the bias for M <= 8; linear then the gelu kernel for M > 8.
#include "ops/linear/linear.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/cuda.cuh"
#include "ops/common/gelu_math.cuh"
#include "ops/common/swiglu_math.cuh"

#include <cublasLt.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

namespace llaisys::ops::cuda {
namespace {

// ============================================ GEMV ============================================

constexpr int kGemvWarps = 8; // 256 threads per block
constexpr int kGemvMaxM = 8;  // the largest M sent to the GEMV on purpose
// 16-byte vectors per lane and W row prefetched into L2 before pdl_wait (the head of each row: 2 KiB per
// warp and row). Prefetching whole rows instead let a 27.5 MB weight (8960->1536) fight the GEMV
// before it for L2: 14.8 us against 12.9 us with 4 on an H100; 2, 3 and 6 measured no better.
constexpr int kGemvPrefetch = 4;
// gemv_preload_kernel: 16-byte vectors of its row each lane holds at most, and warps per block.
constexpr int kGemvPreVectors = 8;
constexpr int kGemvPreWarps = 16;
// Nanoseconds a lane of the paced gemv_preload_kernel sleeps between two of its W loads (~6 loads a lane
// on the 1.5B shapes: ~1 us in all). Tuned on an H100 only (as is the half-the-SMs rule in launch_gemv):
// 100, 300 and 600 measured slower there.
constexpr unsigned kGemvPrePaceNs = 200;

// Widens 16 bytes (4 f32 or 8 f16/bf16) to f32.
__device__ __forceinline__ void unpack(const uint4 &u, const float *, float (&f)[4]) {
    f[0] = __uint_as_float(u.x), f[1] = __uint_as_float(u.y), f[2] = __uint_as_float(u.z), f[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void unpack(const uint4 &u, const __nv_bfloat16 *, float (&f)[8]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) { // bf16 is the top half of an f32
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void unpack(const uint4 &u, const __half *, float (&f)[8]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        __half2 h;
        memcpy(&h, &w[i], 4);
        const float2 p = __half22float2(h);
        f[2 * i] = p.x, f[2 * i + 1] = p.y;
    }
}

// V consecutive elements of a row: one 16-byte load (V = 16 / sizeof(T)), or one element when the
// rows are not 16-byte aligned (V = 1). W streams past once, so its loads are marked evict-first
// (__ldcs) to leave L1/L2 to x, which every warp rereads (__ldg).
template <typename T, int V>
struct Chunk {
    uint4 raw;
    __device__ __forceinline__ void load_stream(const T *p) { raw = __ldcs(reinterpret_cast<const uint4 *>(p)); }
    __device__ __forceinline__ void load_cached(const T *p) { raw = __ldg(reinterpret_cast<const uint4 *>(p)); }
    __device__ __forceinline__ void get(float (&f)[V]) const { unpack(raw, static_cast<const T *>(nullptr), f); }
};
template <typename T>
struct Chunk<T, 1> {
    T raw;
    __device__ __forceinline__ void load_stream(const T *p) { raw = *p; }
    __device__ __forceinline__ void load_cached(const T *p) { raw = *p; }
    __device__ __forceinline__ void get(float (&f)[1]) const { f[0] = to_f32(raw); }
};

struct GemvArgs {
    int64_t M, N, K, ldx, ldw; // N: columns of out (linear_swiglu: I, with W [2I, K])
    int split; // warps sharing one group of W rows, each taking every split-th vector (1, 2, 4 or 8)
};

// ---- Epilogues: which W rows a group of warps reads and how their sums become outputs. ----
// kRows: W rows per group; kOuts: outputs per group; kUnroll: loads in flight per lane and row (8
// 16-byte loads per lane in all; registers bound it; at most 4 where x is loaded next to W).
// w_row(group, r, a) is the group's r-th W row, groups past the end repeating the last row (computed,
// never stored). store(...) writes output o of the group for x row m; sum(r, init) is init plus the
// group's f32 total for its r-th row, lanes and split warps reduced in a fixed order.

// linear: group g owns W rows g*R .. g*R + R-1, one output column each (+ bias). More rows per group
// when M is larger: each x load then feeds R rows.
template <int MR>
struct PlainEpilogue {
    static constexpr int kRows = MR >= 4 ? 2 : 1, kOuts = kRows, kUnroll = MR >= 4 ? 4 : 8;
    static constexpr int kXBlocks = 4; // blocks per SM the M = 1 x-with-W kernel is compiled for (gemv_kernel)
    __device__ static int64_t w_row(int64_t group, int r, const GemvArgs &a) { return min(group * kRows + r, a.N - 1); }
    template <typename T, class Sum>
    __device__ static void store(T *out, const T *bias, int64_t group, int o, int64_t m, const GemvArgs &a,
                                 const Sum &sum) {
        const int64_t n = group * kRows + o;
        if (n < a.N) out[m * a.N + n] = from_f32<T>(sum(o, bias ? to_f32(bias[n]) : 0.f));
    }
};

// linear_gelu: PlainEpilogue's rows and sums; each output is rounded to T (bias included) as linear stores
// it, then goes through the gelu op's formula (common/gelu_math.cuh) and is rounded again: linear + gelu.
template <int MR, bool TANH>
struct GeluEpilogue : PlainEpilogue<MR> {
    template <typename T, class Sum>
    __device__ static void store(T *out, const T *bias, int64_t group, int o, int64_t m, const GemvArgs &a,
                                 const Sum &sum) {
        const int64_t n = group * PlainEpilogue<MR>::kRows + o;
        if (n >= a.N) return;
        const float y = to_f32(from_f32<T>(sum(o, bias ? to_f32(bias[n]) : 0.f)));
        out[m * a.N + n] = from_f32<T>(gelu_f32<TANH>(y));
    }
};
template <int MR>
using GeluTanhEpilogue = GeluEpilogue<MR, true>;
template <int MR>
using GeluErfEpilogue = GeluEpilogue<MR, false>;

// The gated activations, act(g, u) in f32 from g and u already rounded to T: the swiglu and geglu ops'
// formulas (common/swiglu_math.cuh, common/gelu_math.cuh; geglu does not round gelu(g) before the product).
struct SwigluAct {
    __device__ static float apply(float g, float u) { return swiglu_f32(g, u); }
};
template <bool TANH>
struct GegluAct {
    __device__ static float apply(float g, float u) { return gelu_f32<TANH>(g) * u; }
};

// linear_swiglu / linear_geglu: group j owns the gate rows n = j * O + o (o < O outputs) and the up rows
// I + n of W [2I, K] (I = a.N; W rows r < O gate, r >= O up) and writes out[m, n] = Act(g, u), g and u first
// rounded to T as linear stores them for the swiglu / geglu op. O = 2 for M <= 2 halves the grid (at I = 4864
// one output per warp made 1.15 waves); larger M keeps O = 1, where 4 rows would spill registers.
template <int MR, class Act>
struct GatedEpilogue {
    static constexpr int kOuts = MR >= 4 ? 1 : 2, kRows = 2 * kOuts, kUnroll = MR >= 4 ? 4 : 2;
    // 3, not 4: with room for 72 registers 896->2x4864 took 8.4 us on an H100 (graph replay; the same
    // at 2 blocks per SM), against 9.6 us under the 64-register cap of 4 blocks per SM.
    static constexpr int kXBlocks = 3;
    __device__ static int64_t w_row(int64_t group, int r, const GemvArgs &a) {
        return min(group * kOuts + r % kOuts, a.N - 1) + (r / kOuts) * a.N;
    }
    template <typename T, class Sum>
    __device__ static void store(T *out, const T *, int64_t group, int o, int64_t m, const GemvArgs &a, const Sum &sum) {
        const int64_t n = group * kOuts + o;
        if (n >= a.N) return;
        const float g = to_f32(from_f32<T>(sum(o, 0.f))), u = to_f32(from_f32<T>(sum(kOuts + o, 0.f)));
        out[m * a.N + n] = from_f32<T>(Act::apply(g, u));
    }
};
template <int MR>
using SwigluEpilogue = GatedEpilogue<MR, SwigluAct>;
template <int MR>
using GegluTanhEpilogue = GatedEpilogue<MR, GegluAct<true>>;
template <int MR>
using GegluErfEpilogue = GatedEpilogue<MR, GegluAct<false>>;

// acc[m][r] += x[m] . w[r] over the vectors v = first, first + step, ... < nvec. Each lane issues up
// to U loads per W row before using any (a row of K = 1536 bf16 is 6 vectors per lane: all in flight
// at once), so even a partly filled last wave keeps the memory busy. With XW the batch's x vectors are
// loaded next to W's too; otherwise each x vector is loaded where it is used, which the compiler, short
// of registers, leaves one L2 round trip after another. Vectors past nvec are neither loaded nor used
// (multiplying by a zero weight would turn an Inf in x into NaN).
template <typename T, int MR, int R, int V, int U, bool XW>
__device__ __forceinline__ void gemv_rows(float (&acc)[MR][R], const T *const (&xr)[MR], const T *const (&wr)[R],
                                          int64_t first, int64_t step, int64_t nvec) {
    for (int64_t v = first; v < nvec; v += U * step) {
        Chunk<T, V> wv[U][R];
        Chunk<T, V> xw[XW ? U : 1][MR];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (v + u * step < nvec) {
#pragma unroll
                for (int r = 0; r < R; ++r) wv[u][r].load_stream(wr[r] + (v + u * step) * V);
                if constexpr (XW)
#pragma unroll
                    for (int m = 0; m < MR; ++m) xw[u][m].load_cached(xr[m] + (v + u * step) * V);
            }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (v + u * step >= nvec) break;
            float wf[R][V];
#pragma unroll
            for (int r = 0; r < R; ++r) wv[u][r].get(wf[r]);
#pragma unroll
            for (int m = 0; m < MR; ++m) {
                Chunk<T, V> xv;
                if constexpr (XW) xv = xw[u][m];
                else xv.load_cached(xr[m] + (v + u * step) * V);
                float xf[V];
                xv.get(xf);
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int e = 0; e < V; ++e) acc[m][r] = fmaf(xf[e], wf[r][e], acc[m][r]);
            }
        }
    }
}

// out [M, N] from x [M, K] and w for MR rows of x per block: x @ w[N, K]^T (+ bias [N]) with
// PlainEpilogue (GeluEpilogue: its gelu), act(x @ w[:N]^T, x @ w[N:]^T) with GatedEpilogue.
// Launch: grid (ceil(N / outputs_per_block), ceil(M / MR)), 256 threads. The 8 warps form 8 / split
// groups; each group owns Epi's R W rows, and the split warps of a group interleave over the rows'
// 16-byte vectors (lane l of warp s takes vectors s * 32 + l, + 32 * split, ...), so the group reads
// its rows coalesced. x is read straight from global memory next to W: it is small and stays in L1/L2
// while W streams past, and no barrier stands between a block's start and its W loads. Partial sums
// are reduced across the warp by shuffles, then across the group's warps through shared memory, where
// Epi turns them into outputs. Rows of x past M repeat the last row (computed, never stored), so
// every warp runs the same code. A row's f32 sum runs in an order set by K, V and split alone (not
// by R, MR or U), which is what lets linear_swiglu reproduce linear exactly.
// XW (M = 1 only): x loaded next to W in batches of at most 4 vectors per lane (gemv_x_with_w).
template <typename T, int MR, int V, class Epi, bool XW>
__global__ void __launch_bounds__(kGemvWarps * 32, MR == 1 ? (XW ? Epi::kXBlocks : 4) : 2)
    gemv_kernel(T *__restrict__ out, const T *__restrict__ x, const T *__restrict__ w, const T *__restrict__ bias,
                GemvArgs a) {
    constexpr int R = Epi::kRows;
    __shared__ float partial[kGemvWarps][MR][R];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups = kGemvWarps / a.split, group = warp / a.split, sub = warp % a.split;
    const int64_t g0 = int64_t(blockIdx.x) * groups; // first group of this block
    const int64_t m0 = int64_t(blockIdx.y) * MR;     // first x row of this block
    const T *xr[MR];
    const T *wr[R];
#pragma unroll
    for (int m = 0; m < MR; ++m) xr[m] = x + min(m0 + m, a.M - 1) * a.ldx;
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = w + Epi::w_row(g0 + group, r, a) * a.ldw;
    float acc[MR][R] = {};
    const int64_t nvec = a.K / V, step = int64_t(a.split) * 32;
    // Launched with PDL: the head of this block's W rows starts streaming into L2 while the kernel before
    // it (which writes x) is still finishing. A prefetch hands back no data, so this is safe even for a W
    // that kernel writes; x, W's values and out only after pdl_wait().
    for (int64_t v = sub * 32 + lane; v < nvec && v < sub * 32 + lane + kGemvPrefetch * step; v += step)
#pragma unroll
        for (int r = 0; r < R; ++r) asm volatile("prefetch.global.L2 [%0];" ::"l"(wr[r] + v * V));
    pdl_trigger();
    pdl_wait();
    constexpr int U = XW && Epi::kUnroll > 4 ? 4 : Epi::kUnroll; // x's registers come out of W's
    gemv_rows<T, MR, R, V, U, XW>(acc, xr, wr, sub * 32 + lane, step, nvec);
    for (int64_t k = nvec * V + sub * 32 + lane; k < a.K; k += step) // columns past the last full vector
#pragma unroll
        for (int m = 0; m < MR; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r) acc[m][r] = fmaf(to_f32(xr[m][k]), to_f32(wr[r][k]), acc[m][r]);
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float s = warp_sum(acc[m][r]);
            if (lane == 0) partial[warp][m][r] = s;
        }
    __syncthreads();
    for (int t = threadIdx.x; t < groups * Epi::kOuts * MR; t += blockDim.x) {
        const int g = t / (Epi::kOuts * MR), o = t / MR % Epi::kOuts, m = t % MR;
        if (m0 + m >= a.M) continue;
        const auto sum = [&](int r, float s) {
            for (int j = 0; j < a.split; ++j) s += partial[g * a.split + j][m][r];
            return s;
        };
        Epi::template store<T>(out, bias, g0 + g, o, m0 + m, a, sum);
    }
}

// M = 1 GEMV for a small, constant W (gemv_preload; linear's constant_weight): one warp per W row and
// kGemvPreWarps warps per block, at most one block per SM, which takes half its registers. So the next
// kernel's blocks fit beside this one's. It triggers the next kernel at its start; each lane then loads
// its whole share of its row (at most kGemvPreVectors 16-byte vectors) into registers before pdl_wait,
// so W streams while the kernel before is still running. x goes through shared memory: one load per
// thread after pdl_wait, so a single L2 round trip stands between pdl_wait and the math. Each row's sum
// runs in gemv_kernel's order at split 1.
// PACED (with PDL, on grids of at least half the SMs): a lane sleeps kGemvPrePaceNs between its W
// loads, so the chip's W requests reach the memory system over about a microsecond instead of in one
// burst from every SM at once. Why the burst is slower is not established; spreading it is what measured faster. On an
// H100 (graph replay, bf16; bench/RESULTS.md, 2026-11-25, fourth session), against the unpaced kernel
// that triggered after its loads: 1536->2048 3.18 -> 2.49 us, 1536->1536 2.30 -> 2.17, 896->1152
// 1.70 -> 1.51; unpaced with the early trigger (small grids) 896->896 1.47 -> 1.46, 1536->256 1.46 -> 1.42.
// Sleeping 100 / 300 / 600 ns measured 2.83 / 2.65 / 3.66 us on 1536->2048; 200 ns without the early
// trigger 2.36 us, but 2.34 us on 1536->1536 and 1.84 on 1536->256. Issuing the block's loads in column
// order (a barrier after each vector), delaying only the trigger, or staggering the warps' first loads
// each did less.
template <typename T, int V, bool PACED>
__global__ void __launch_bounds__(kGemvPreWarps * 32, 2)
    gemv_preload_kernel(T *__restrict__ out, const T *__restrict__ x, const T *__restrict__ w,
                        const T *__restrict__ bias, GemvArgs a) {
    __shared__ uint4 xs[32 * kGemvPreVectors];
    pdl_trigger();
    const int lane = threadIdx.x & 31;
    const int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int nvec = int(a.K / V); // K = nvec * V <= 32 * kGemvPreVectors * V
    const T *wr = w + min(n, a.N - 1) * a.ldw, *wl = wr + lane * V;
    Chunk<T, V> wv[kGemvPreVectors];
#pragma unroll
    for (int u = 0; u < kGemvPreVectors; ++u) {
        if constexpr (PACED)
            if (u > 0 && u * 32 < nvec) __nanosleep(kGemvPrePaceNs);
        if (lane + u * 32 < nvec) wv[u].load_stream(wl + u * 32 * V);
    }
    pdl_wait();
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) xs[i] = __ldg(reinterpret_cast<const uint4 *>(x) + i);
    __syncthreads();
    float acc = 0.f;
#pragma unroll
    for (int u = 0; u < kGemvPreVectors; ++u)
        if (lane + u * 32 < nvec) {
            Chunk<T, V> xv;
            xv.raw = xs[lane + u * 32];
            float xf[V], wf[V];
            xv.get(xf);
            wv[u].get(wf);
#pragma unroll
            for (int e = 0; e < V; ++e) acc = fmaf(xf[e], wf[e], acc);
        }
    const float s = warp_sum(acc);
    if (lane == 0 && n < a.N) out[n] = from_f32<T>((bias ? to_f32(bias[n]) : 0.f) + s);
}

// Warps per group of W rows: more when N alone gives too few warps to fill the GPU (N = 256 rows is
// 256 warps), as long as each lane still gets 2+ vectors of a row and the grid still fits in one wave
// (4 blocks of 8 warps per SM): a second, partly filled wave cost the 8960->1536 GEMV a third of its
// bandwidth (split 4 made 1.45 waves).
int gemv_split(int64_t rows_of_groups, int64_t vectors_per_row, int device) {
    const int64_t one_wave = int64_t(sm_count(device)) * 4 * kGemvWarps;
    int split = 1;
    while (split < kGemvWarps && rows_of_groups * split * 2 <= one_wave && vectors_per_row >= 2 * 32 * 2 * split)
        split *= 2;
    return split;
}

// Whether the M = 1 GEMV loads x next to W (XW): when a lane's vectors of a row fit one batch of 4, or
// take several batches either way (more than 8). Between 5 and 8 the plain kernel's single batch of 8
// wins (1536->8960 and 4864->896 measured slower with XW). On an H100 (graph replay, bf16) XW took
// 896->128 from 1.97 to 1.52 us, 1536->1536 3.36 -> 3.18, 896->1152 2.58 -> 2.32 and 8960->1536
// 12.7 -> 10.8. linear_swiglu (2 loads per lane and row either way) follows linear's choice.
bool gemv_x_with_w(int64_t vectors_per_row, int split) {
    const int64_t per_lane = ceil_div(vectors_per_row, int64_t(split) * 32);
    return per_lane <= 4 || per_lane > 8;
}

// Whether the M = 1 GEMV (16-byte rows) for N outputs and rows of `vectors` 16-byte vectors (no partial
// one) runs gemv_preload_kernel: each lane's share of a row fits its registers and the grid is at most
// one block per SM (N <= 2112 on an H100: the 1.5B q/k/v and o projections, the 0.5B ones).
bool gemv_preload(int64_t N, int64_t vectors, int device) {
    return vectors >= 1 && vectors <= 32 * kGemvPreVectors && N <= int64_t(sm_count(device)) * kGemvPreWarps;
}

template <typename T, int MR, class Epi>
void launch_gemv(const Tensor &out, const Tensor &x, const Tensor &w, const Tensor &bias, GemvArgs a, bool vec,
                 bool constant_weight) {
    constexpr int VW = int(16 / sizeof(T));
    // The split linear's GEMV takes for N outputs at this M, whatever the epilogue: every output's
    // sum then runs in the same order as linear's.
    constexpr int plain_rows = PlainEpilogue<MR>::kRows;
    const int64_t plain_groups = (a.N + plain_rows - 1) / plain_rows;
    const int dev = out.device().index;
    // The preload kernel reads W before pdl_wait, so only a constant W may take it. linear runs at split 1
    // there, and so does linear_swiglu for the same N and flag.
    const bool pre = constant_weight && MR == 1 && vec && a.K % VW == 0 && gemv_preload(a.N, a.K / VW, dev);
    a.split = pre ? 1 : gemv_split(plain_groups, (a.K + VW - 1) / VW, dev);
    using D = device_t<T>;
    D *o = dptr<T>(out);
    const D *xp = dptr<T>(x), *wp = dptr<T>(w), *bp = bias.defined() ? dptr<T>(bias) : nullptr;
    if constexpr (std::is_same_v<Epi, PlainEpilogue<1>>) // linear at M = 1
        if (pre) {
            const unsigned blocks = unsigned(ceil_div(a.N, int64_t(kGemvPreWarps)));
            // Pacing only pays while the kernel ahead still runs (PDL); a small grid has no burst to spread.
            const bool paced = pdl_enabled(dev) && int64_t(blocks) * 2 >= sm_count(dev);
            launch_pdl(paced ? gemv_preload_kernel<D, VW, true> : gemv_preload_kernel<D, VW, false>, blocks,
                       kGemvPreWarps * 32, 0, stream_of(out), dev, o, xp, wp, bp, a);
            return;
        }
    const int64_t outs_per_block = int64_t(kGemvWarps / a.split) * Epi::kOuts;
    const dim3 grid(unsigned((a.N + outs_per_block - 1) / outs_per_block), unsigned((a.M + MR - 1) / MR));
    auto kernel = vec ? gemv_kernel<D, MR, VW, Epi, false> : gemv_kernel<D, MR, 1, Epi, false>;
    if constexpr (MR == 1) // the x-with-W kernel is only built for M = 1 with 16-byte rows
        if (vec && gemv_x_with_w(a.K / VW, a.split)) kernel = gemv_kernel<D, MR, VW, Epi, true>;
    launch_pdl(kernel, grid, kGemvWarps * 32, 0, stream_of(out), dev, o, xp, wp, bp, a);
}

// True when every row of t [rows, cols] starts on a 16-byte boundary.
bool rows_aligned_16(const Tensor &t) {
    return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0 && detail::ld(t) * int64_t(t.element_size()) % 16 == 0;
}

// The GEMV for any M, into out [M, N]: blocks of 8 rows of x when M > 8 (only linear's fallback and
// K = 0 get there).
template <typename T, template <int> class Epi>
void gemv(const Tensor &out, const Tensor &x, const Tensor &w, const Tensor &bias, bool constant_weight) {
    const int64_t M = x.size(0);
    GemvArgs a{M, out.size(1), w.size(1), detail::ld(x), detail::ld(w), 1};
    const bool vec = rows_aligned_16(w) && rows_aligned_16(x);
    LLAISYS_CHECK(M <= int64_t(65535) * kGemvMaxM, std::invalid_argument, "linear: the GEMV fallback takes at most ",
                  std::to_string(int64_t(65535) * kGemvMaxM), " rows of x, got ", std::to_string(M));
    if (M == 1) launch_gemv<T, 1, Epi<1>>(out, x, w, bias, a, vec, constant_weight);
    else if (M == 2) launch_gemv<T, 2, Epi<2>>(out, x, w, bias, a, vec, constant_weight);
    else if (M <= 4) launch_gemv<T, 4, Epi<4>>(out, x, w, bias, a, vec, constant_weight);
    else launch_gemv<T, 8, Epi<8>>(out, x, w, bias, a, vec, constant_weight);
}

// ========================================== cuBLASLt ==========================================

#define CUBLASLT_CHECK(expr)                                                                           \
    do {                                                                                               \
        const cublasStatus_t st_ = (expr);                                                             \
        if (st_ != CUBLAS_STATUS_SUCCESS)                                                              \
            throw std::runtime_error(::llaisys::detail::concat("linear: cuBLASLt error ",             \
                                                               cublasLtGetStatusName(st_), " at ",     \
                                                               __FILE__, ":", std::to_string(__LINE__))); \
    } while (0)

constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;

// Process-lifetime cuBLASLt state: one handle per device, one workspace per (device, stream) (two
// streams must not share scratch), and the algorithm chosen for each problem. Created on first use,
// never freed (tensors freed after the allocator at exit would be unsafe).
struct LtState {
    std::mutex mu;
    std::map<int, cublasLtHandle_t> handles;
    std::map<std::pair<int, cudaStream_t>, Tensor> workspaces;
    // (device, dtype, M, N, K, ldx, ldw, bias, alignments of w, x, out, bias, batch) -> algorithm, if any
    using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, bool, int, int, int, int, int>;
    std::map<Key, std::pair<bool, cublasLtMatmulAlgo_t>> algos;
};
LtState &lt_state() {
    static LtState *state = new LtState();
    return *state;
}

// Largest power of two <= 256 dividing the address and the row pitch: what cuBLASLt may assume.
int alignment(const void *p, int64_t pitch_bytes) {
    const uint64_t bits = reinterpret_cast<uintptr_t>(p) | uint64_t(pitch_bytes) | 256u;
    return int(bits & (~bits + 1));
}

template <typename T>
cudaDataType_t lt_type() {
    if constexpr (std::is_same_v<T, float>) return CUDA_R_32F;
    else if constexpr (std::is_same_v<T, f16_t>) return CUDA_R_16F;
    else return CUDA_R_16BF;
}

// The descriptors of one call. Row-major out [M, N] = x [M, K] @ w [N, K]^T is, in cuBLAS's
// column-major terms, D [N, M] = op(A) B with A = w seen as [K, N] (ld ldw, transposed),
// B = x seen as [K, M] (ld ldx) and D = out seen as [N, M] (ld N).
struct LtCall {
    cublasLtMatmulDescOpaque_t desc_storage;
    cublasLtMatrixLayoutOpaque_t a_storage, b_storage, d_storage;
    cublasLtMatmulDesc_t desc() { return &desc_storage; }
    cublasLtMatrixLayout_t a() { return &a_storage; }
    cublasLtMatrixLayout_t b() { return &b_storage; }
    cublasLtMatrixLayout_t d() { return &d_storage; }
};

// batch > 1 (linear_swiglu's gate and up halves in one launch): `batch` problems of N outputs each, weight
// matrix b at w + b N ldw, the same x for all, out [batch, M, N] contiguous.
template <typename T>
void lt_describe(LtCall &c, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldw, const void *bias,
                 int batch = 1) {
    const cudaDataType_t dt = lt_type<T>();
    // f32 compute, never TF32, so f32 results match the CPU's within f32 rounding.
    CUBLASLT_CHECK(cublasLtMatmulDescInit(c.desc(), CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const int32_t trans_a = CUBLAS_OP_T;
    CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(c.desc(), CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
    if (bias) {
        const uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS; // D += bias broadcast over columns (length N)
        CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(c.desc(), CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                      sizeof(epilogue)));
        CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(c.desc(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    }
    CUBLASLT_CHECK(cublasLtMatrixLayoutInit(c.a(), dt, uint64_t(K), uint64_t(N), ldw));
    CUBLASLT_CHECK(cublasLtMatrixLayoutInit(c.b(), dt, uint64_t(K), uint64_t(M), ldx));
    CUBLASLT_CHECK(cublasLtMatrixLayoutInit(c.d(), dt, uint64_t(N), uint64_t(M), N));
    if (batch > 1) {
        const int64_t strides[3] = {N * ldw, 0, N * M}; // A (w), B (x, shared), D (out)
        cublasLtMatrixLayout_t layouts[3] = {c.a(), c.b(), c.d()};
        for (int i = 0; i < 3; ++i) {
            CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch,
                                                            sizeof(batch)));
            CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                            &strides[i], sizeof(strides[i])));
        }
    }
}

// cuBLASLt's first choice for the described problem, told the real alignments of w, x and out
// (its default assumes 256 bytes, and a kernel picked on that assumption faults on a column slice).
// Split-K partials are summed in f32 only (`exact_reduction`, for bf16/f16 outputs): a partial rounded to bf16
// loses ~2^-9 of its own size, which is much more than the output's rounding where partials cancel (session 38:
// 2-byte-aligned operands at K = 1536 got such an algorithm, 0.08 off on outputs near zero).
bool lt_heuristic(cublasLtHandle_t handle, LtCall &c, const uint32_t (&align)[3], bool exact_reduction,
                  cublasLtMatmulAlgo_t &algo) {
    cublasLtMatmulPreferenceOpaque_t pref_storage;
    cublasLtMatmulPreference_t pref = &pref_storage;
    CUBLASLT_CHECK(cublasLtMatmulPreferenceInit(pref));
    const uint64_t ws_bytes = kLtWorkspaceBytes;
    CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                        sizeof(ws_bytes)));
    const cublasLtMatmulPreferenceAttributes_t which[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i) // C is D (out)
        CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, which[i], &align[std::min(i, 2)], sizeof(uint32_t)));
    if (exact_reduction) {
        const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
        CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask,
                                                            sizeof(mask)));
    }
    cublasLtMatmulHeuristicResult_t result;
    int count = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(handle, c.desc(), c.a(), c.b(), c.d(), c.d(), pref, 1, &result, &count);
    if (st != CUBLAS_STATUS_SUCCESS || count == 0) return false;
    algo = result.algo;
    return true;
}

// Handle, workspace and algorithm for this call, created once per key; false if cuBLASLt has none.
template <typename T>
bool lt_prepare(LtCall &c, const Tensor &out, const Tensor &x, const Tensor &w, const void *bias, int batch,
                cudaStream_t stream, cublasLtHandle_t &handle, Tensor &workspace, cublasLtMatmulAlgo_t &algo) {
    const int64_t M = x.size(0), N = w.size(0) / batch, K = w.size(1);
    const int64_t ldx = detail::ld(x), ldw = detail::ld(w), es = int64_t(sizeof(T));
    const int dev = out.device().index;
    LtState &s = lt_state();
    std::lock_guard<std::mutex> lock(s.mu);
    auto h = s.handles.find(dev);
    if (h == s.handles.end()) {
        cublasLtHandle_t created;
        CUBLASLT_CHECK(cublasLtCreate(&created));
        h = s.handles.emplace(dev, created).first;
    }
    handle = h->second;
    Tensor &ws = s.workspaces[{dev, stream}];
    if (!ws.defined()) ws = Tensor::empty({int64_t(kLtWorkspaceBytes)}, DType::U8, out.device());
    workspace = ws;
    const int align_w = alignment(w.data(), ldw * es), align_x = alignment(x.data(), ldx * es);
    const int align_o = alignment(out.data(), N * es), align_b = bias ? alignment(bias, 0) : 0;
    const LtState::Key key{dev, int(out.dtype()), M, N, K, ldx, ldw, bias != nullptr, align_w, align_x, align_o, align_b,
                           batch};
    auto found = s.algos.find(key);
    if (found == s.algos.end()) {
        cublasLtMatmulAlgo_t chosen{};
        const bool ok = lt_heuristic(handle, c, {uint32_t(align_w), uint32_t(align_x), uint32_t(align_o)},
                                     !std::is_same_v<T, float>, chosen);
        found = s.algos.emplace(key, std::make_pair(ok, chosen)).first;
    }
    algo = found->second.second;
    return found->second.first;
}

// out [M, N] = x @ w^T (+ bias); with batch = 2, out [2, M, N] contiguous = x @ w[:N]^T, x @ w[N:]^T (w [2N, K]).
template <typename T>
bool lt_matmul(const Tensor &out, const Tensor &x, const Tensor &w, const Tensor &bias, int batch = 1) {
    const int64_t M = x.size(0), N = w.size(0) / batch, K = w.size(1);
    const void *bias_ptr = bias.defined() ? bias.data() : nullptr;
    LtCall c;
    lt_describe<T>(c, M, N, K, detail::ld(x), detail::ld(w), bias_ptr, batch);
    const cudaStream_t stream = stream_of(out);
    cublasLtHandle_t handle;
    Tensor workspace;
    cublasLtMatmulAlgo_t algo;
    if (!lt_prepare<T>(c, out, x, w, bias_ptr, batch, stream, handle, workspace, algo)) return false;
    const float alpha = 1.f, beta = 0.f;
    CUBLASLT_CHECK(cublasLtMatmul(handle, c.desc(), &alpha, w.data(), c.a(), x.data(), c.b(), &beta, out.data(), c.d(),
                                  out.data(), c.d(), &algo, workspace.data(), kLtWorkspaceBytes, stream));
    return true;
}

} // namespace

void linear(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, bool constant_weight) {
    detail::dispatch_float("linear", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const bool gemm = x.size(0) > kGemvMaxM && weight.size(1) > 0;
        if (!(gemm && lt_matmul<T>(out, x, weight, bias)))
            gemv<T, PlainEpilogue>(out, x, weight, bias, constant_weight);
    });
}

// LLAISYS_GATED_GEMM=halves: linear_swiglu / linear_geglu past 8 rows run two GEMMs (as before session 38),
// not one batched launch (an A/B switch, read once).
bool gated_batched() {
    static const bool on = [] {
        const char *e = std::getenv("LLAISYS_GATED_GEMM");
        return !(e && std::string(e) == "halves");
    }();
    return on;
}

// M > 8 of linear_swiglu / linear_geglu: g and u as [2, M, I], each half contiguous for the swiglu / geglu op
// that `combine` runs. One cuBLASLt launch of two batched problems (w_gate_up's halves, the same x): at
// decode batches a GEMM of I = 8960 outputs is too short to fill the GPU on its own; else two GEMMs.
template <class Combine>
void gated_halves(const Tensor &out, const Tensor &x, const Tensor &w_gate_up, bool constant_weight,
                  Combine &&combine) {
    const int64_t M = out.size(0), I = out.size(1);
    const Tensor gu = Tensor::empty({2, M, I}, out.dtype(), out.device()); // [g; u], each [M, I]
    const Tensor g = gu.select(0, 0), u = gu.select(0, 1);
    bool done = false;
    if (gated_batched() && w_gate_up.size(1) > 0)
        detail::dispatch_float("linear_swiglu", x.dtype(), x.device(), [&](auto tag) {
            done = lt_matmul<typename decltype(tag)::type>(gu, x, w_gate_up, Tensor(), 2);
        });
    if (!done) {
        linear(g, x, w_gate_up.slice(0, 0, I), Tensor(), constant_weight);     // w_gate_up[:I]  [I, K]
        linear(u, x, w_gate_up.slice(0, I, 2 * I), Tensor(), constant_weight); // w_gate_up[I:]  [I, K]
    }
    combine(g, u);
}

void linear_swiglu(const Tensor &out, const Tensor &x, const Tensor &w_gate_up, bool constant_weight) {
    const int64_t M = out.size(0);
    if (M <= kGemvMaxM) {
        detail::dispatch_float("linear_swiglu", x.dtype(), x.device(), [&](auto tag) {
            gemv<typename decltype(tag)::type, SwigluEpilogue>(out, x, w_gate_up, Tensor(), constant_weight);
        });
        return;
    }
    gated_halves(out, x, w_gate_up, constant_weight,
                 [&](const Tensor &g, const Tensor &u) { ::llaisys::ops::swiglu(out, g, u); });
}

// linear_swiglu's paths with the GeGLU epilogue, and for M > 8 the geglu op.
void linear_geglu(const Tensor &out, const Tensor &x, const Tensor &w_gate_up, bool tanh_approx, bool constant_weight) {
    const int64_t M = out.size(0);
    if (M <= kGemvMaxM) {
        detail::dispatch_float("linear_geglu", x.dtype(), x.device(), [&](auto tag) {
            using T = typename decltype(tag)::type;
            if (tanh_approx) gemv<T, GegluTanhEpilogue>(out, x, w_gate_up, Tensor(), constant_weight);
            else gemv<T, GegluErfEpilogue>(out, x, w_gate_up, Tensor(), constant_weight);
        });
        return;
    }
    gated_halves(out, x, w_gate_up, constant_weight,
                 [&](const Tensor &g, const Tensor &u) { ::llaisys::ops::geglu(out, g, u, tanh_approx); });
}

// M <= 8: the GEMV with the GELU after the bias in its epilogue (no gelu launch at decode); M > 8: linear
// (cuBLASLt with its bias epilogue) and the gelu op in place.
void linear_gelu(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, bool tanh_approx,
                 bool constant_weight) {
    if (x.size(0) <= kGemvMaxM) {
        detail::dispatch_float("linear_gelu", x.dtype(), x.device(), [&](auto tag) {
            using T = typename decltype(tag)::type;
            if (tanh_approx) gemv<T, GeluTanhEpilogue>(out, x, weight, bias, constant_weight);
            else gemv<T, GeluErfEpilogue>(out, x, weight, bias, constant_weight);
        });
        return;
    }
    linear(out, x, weight, bias, constant_weight);
    ::llaisys::ops::gelu(out, out, tanh_approx); // the gelu op (llaisys/ops.hpp)
}

} // namespace llaisys::ops::cuda
