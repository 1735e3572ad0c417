// The CUDA row kernels behind rms_norm and add_rms_norm (one set of templates, two ops); quant_linear's
// fused add_rms_norm uses their vector pieces (sum_squares, normalized) to get the same bits.
// FUSED: first residual [rows, D] += x, stored rounded to T; the norm then reads the rounded sum, exactly
// what add() followed by rms_norm() computes. Otherwise the norm reads x. out may alias x: a thread reads
// every element it writes, and all reads of a row precede the reduction that any write waits for.
#pragma once
#include "ops/common/rms_norm_rows.hpp"
#include "ops/common/row_reduce.cuh"

namespace llaisys::ops::cuda {

// Where row r of x or out starts: r * D for dense rows; through the RowMap (rms_norm_rows.hpp) when STRIDED,
// with a 32-bit division (rows < 2^31: launch_rms_norm checks it).
template <bool STRIDED>
__device__ __forceinline__ int64_t row_start(int64_t r, int D, const RowMap &m) {
    if constexpr (STRIDED) {
        const uint32_t inner = uint32_t(m.inner), o = uint32_t(r) / inner, i = uint32_t(r) - o * inner;
        return int64_t(o) * m.s_outer + int64_t(i) * m.s_inner;
    } else {
        return r * D;
    }
}

template <typename T, int VEC>
__device__ __forceinline__ float sum_squares(const Vec<T, VEC> &a) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += to_f32(a.v[j]) * to_f32(a.v[j]);
    return s;
}

// a * scale * w, rounded once.
template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> normalized(const Vec<T, VEC> &a, const Vec<T, VEC> &w, float scale) {
    Vec<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) o.v[j] = from_f32<T>(to_f32(a.v[j]) * scale * to_f32(w.v[j]));
    return o;
}

// One row of [rows, D] per group of threads. WARP (short rows): a group is one warp and a block holds
// blockDim.x / 32 rows; otherwise the group is the whole block and blockIdx.x is the row. Threads stride
// over the row in VEC-element vectors (D % VEC == 0; 16-byte aligned rows when VEC > 1) in two passes:
// sum of squares (adding the residual first when FUSED), group reduction, then normalise. The second pass
// re-reads the row, which the first has just pulled into L1/L2. (rms_norm_reg_kernel below holds the
// row in registers instead; the fused op measured slower that way.) STRIDED (not FUSED): the rows of x and
// out start where om and xm say (row_start), else they are dense.
template <typename T, int VEC, bool WARP, bool FUSED, bool STRIDED = false>
__global__ void rms_norm_kernel(T *out, T *residual, const T *x, const T *weight, int64_t rows, int D, float eps,
                                RowMap om, RowMap xm) {
    static_assert(!(FUSED && STRIDED), "add_rms_norm takes dense rows");
    __shared__ float scratch[32];
    const int64_t row = WARP ? blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32 : int64_t(blockIdx.x);
    const int lane = WARP ? int(threadIdx.x % 32) : int(threadIdx.x), group = WARP ? 32 : int(blockDim.x);
    pdl_trigger(); // launched with PDL (cuda.cuh): nothing is read before the previous kernel is done
    pdl_wait();
    if (row >= rows) return; // a whole warp (WARP) or never (one block per row)
    const int64_t base = row_start<STRIDED>(row, D, xm), obase = row_start<STRIDED>(row, D, om);
    const int nvec = D / VEC;
    const T *src = FUSED ? residual + base : x + base; // what the second pass normalises
    float ss = 0.f;
    for (int v = lane; v < nvec; v += group) {
        const int64_t off = int64_t(v) * VEC;
        Vec<T, VEC> a = load_vec<VEC>(x + base + off);
        if constexpr (FUSED) {
            a = add_rounded(load_vec<VEC>(residual + base + off), a);
            store_vec(residual + base + off, a);
        }
        ss += sum_squares(a);
    }
    ss = group_sum<WARP>(ss, scratch);
    const float scale = rsqrtf(ss / float(D) + eps);
    for (int v = lane; v < nvec; v += group) {
        const int64_t off = int64_t(v) * VEC;
        const Vec<T, VEC> a = load_vec<VEC>(src + off), w = load_vec<VEC>(weight + off);
        store_vec(out + obase + off, normalized(a, w, scale));
    }
}

// rms_norm (not fused) for rows of at most 256 vectors: one warp per row, 4 rows per block, the row
// held in registers. Lane l holds vectors l, l + 32, ... (NV of them, the last ones guarded), all
// loaded before the warp reduction, so a warp has its whole row in flight at once; the weight (never
// written) is loaded before pdl_wait. On an H100 at 2048 rows of 1536 it takes 6.1 us against 6.5 us
// for rms_norm_kernel; the fused op measured slower this way (12.0 against 10.4 us) and keeps
// rms_norm_kernel.
template <typename T, int VEC, int NV, bool STRIDED = false>
__global__ void rms_norm_reg_kernel(T *out, const T *x, const T *weight, int64_t rows, int D, float eps, RowMap om,
                                    RowMap xm) {
    const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = int(threadIdx.x % 32), nvec = D / VEC;
    const auto held = [&](int j) { return lane + 32 * j < nvec; };
    const auto at = [&](int j) { return int64_t(lane + 32 * j) * VEC; };
    Vec<T, VEC> w[NV], a[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j)
        if (held(j)) w[j] = load_vec<VEC>(weight + at(j));
    pdl_trigger(); // launched with PDL (cuda.cuh): x only after pdl_wait
    pdl_wait();
    if (row >= rows) return; // a whole warp
    const int64_t base = row_start<STRIDED>(row, D, xm), obase = row_start<STRIDED>(row, D, om);
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j)
        if (held(j)) a[j] = load_vec<VEC>(x + base + at(j));
#pragma unroll
    for (int j = 0; j < NV; ++j)
        if (held(j)) ss += sum_squares(a[j]);
    const float scale = rsqrtf(warp_sum(ss) / float(D) + eps);
#pragma unroll
    for (int j = 0; j < NV; ++j)
        if (held(j)) store_vec(out + obase + at(j), normalized(a[j], w[j], scale));
}

// Picks the vector width (16 bytes when every row is aligned) and the kernel: rms_norm_reg_kernel for
// rms_norm with 16-byte vectors and rows of at most 256 of them; else rms_norm_kernel with a warp per
// row for rows of at most 64 vectors, 4 rows per block, or a block of up to 1024 threads, one vector
// per thread where possible. Launches on out's stream. T is the host storage type; residual is null
// unless FUSED. maps: null for dense rows, else {om, xm} (STRIDED kernels; not FUSED).
template <typename T, bool FUSED>
void launch_rms_norm(const Tensor &out, const Tensor *residual, const Tensor &x, const Tensor &weight, float eps,
                     const RowMap *maps = nullptr) {
    using DT = device_t<T>;
    const char *op = FUSED ? "add_rms_norm" : "rms_norm";
    const int64_t D = x.shape().back(), rows = x.numel() / D;
    LLAISYS_CHECK(D <= (int64_t(1) << 30) && rows < (int64_t(1) << 31), std::invalid_argument, op, ": ", rows,
                  " rows of ", D, " elements are too many for the CUDA kernel");
    DT *res = FUSED ? dptr<T>(*residual) : nullptr;
    const auto map_ok = [](const RowMap &m) { return m.s_inner % kVec16<T> == 0 && m.s_outer % kVec16<T> == 0; };
    const bool wide = D % kVec16<T> == 0 && is_aligned(out.data(), 16) && is_aligned(x.data(), 16) &&
                      is_aligned(weight.data(), 16) && (!FUSED || is_aligned(res, 16)) &&
                      (!maps || (map_ok(maps[0]) && map_ok(maps[1])));
    const RowMap om = maps ? maps[0] : RowMap{1, 0, 0}, xm = maps ? maps[1] : RowMap{1, 0, 0};
    const cudaStream_t s = stream_of(out);
    // the STRIDED kernel of `kernel` (a template of one bool after the others) when maps are given
    const auto pick = [&](auto dense, auto strided) { return maps ? strided : dense; };
    dispatch_vec<T>(wide, [&](auto vec) {
        constexpr int V = decltype(vec)::value;
        const int64_t nvec = D / V;
        constexpr int rows_per_block = 4; // of the one-warp-per-row kernels
        if constexpr (!FUSED && V > 1) {
            if (nvec <= 32 * 8) {
                const auto go = [&](auto kernel) {
                    launch_pdl(kernel, unsigned(ceil_div(rows, rows_per_block)), 32 * rows_per_block, 0, s,
                               out.device().index, dptr<T>(out), dptr<T>(x), dptr<T>(weight), rows, int(D), eps, om,
                               xm);
                };
                if (nvec <= 32 * 2) go(pick(rms_norm_reg_kernel<DT, V, 2>, rms_norm_reg_kernel<DT, V, 2, true>));
                else if (nvec <= 32 * 4) go(pick(rms_norm_reg_kernel<DT, V, 4>, rms_norm_reg_kernel<DT, V, 4, true>));
                else if (nvec <= 32 * 6) go(pick(rms_norm_reg_kernel<DT, V, 6>, rms_norm_reg_kernel<DT, V, 6, true>));
                else go(pick(rms_norm_reg_kernel<DT, V, 8>, rms_norm_reg_kernel<DT, V, 8, true>));
                return;
            }
        }
        if (nvec <= 64) {
            const unsigned blocks = unsigned(ceil_div(rows, rows_per_block));
            launch_pdl(pick(rms_norm_kernel<DT, V, true, FUSED>, rms_norm_kernel<DT, V, true, FUSED, !FUSED>), blocks,
                       32 * rows_per_block, 0, s, out.device().index, dptr<T>(out), res, dptr<T>(x), dptr<T>(weight),
                       rows, int(D), eps, om, xm);
        } else {
            const int threads = int(std::min<int64_t>(1024, ceil_div(nvec, 32) * 32));
            launch_pdl(pick(rms_norm_kernel<DT, V, false, FUSED>, rms_norm_kernel<DT, V, false, FUSED, !FUSED>),
                       unsigned(rows), threads, 0, s, out.device().index, dptr<T>(out), res, dptr<T>(x),
                       dptr<T>(weight), rows, int(D), eps, om, xm);
        }
    });
}

} // namespace llaisys::ops::cuda
