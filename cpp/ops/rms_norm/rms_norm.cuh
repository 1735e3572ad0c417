// The CUDA row kernels behind rms_norm and add_rms_norm (one set of templates, two ops).
// FUSED: first residual [rows, D] += x, stored rounded to T; the norm then reads the rounded sum, exactly
// what add() followed by rms_norm() computes. Otherwise the norm reads x. out may alias x: a thread reads
// every element it writes, and all reads of a row precede the reduction that any write waits for.
#pragma once
#include "ops/rms_norm/vec.cuh"

namespace llaisys::ops::cuda {

// x + residual on one vector, rounded to T: the new residual, which the norm reads.
template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> add_rounded(const Vec<T, VEC> &r, const Vec<T, VEC> &x) {
    Vec<T, VEC> s;
#pragma unroll
    for (int j = 0; j < VEC; ++j) s.v[j] = from_f32<T>(to_f32(r.v[j]) + to_f32(x.v[j]));
    return s;
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
// re-reads the row, which the first has just pulled into L1/L2. (Holding the row in registers instead,
// one warp per row, measured no faster on an H100 at D = 896/1536 and slower for the fused op.)
template <typename T, int VEC, bool WARP, bool FUSED>
__global__ void rms_norm_kernel(T *out, T *residual, const T *x, const T *weight, int64_t rows, int D, float eps) {
    __shared__ float scratch[32];
    const int64_t row = WARP ? blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32 : int64_t(blockIdx.x);
    const int lane = WARP ? int(threadIdx.x % 32) : int(threadIdx.x), group = WARP ? 32 : int(blockDim.x);
    pdl_trigger(); // launched with PDL (cuda.cuh): nothing is read before the previous kernel is done
    pdl_wait();
    if (row >= rows) return; // a whole warp (WARP) or never (one block per row)
    const int64_t base = row * D;
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
    ss = WARP ? warp_sum(ss) : block_sum(ss, scratch);
    const float scale = rsqrtf(ss / float(D) + eps);
    for (int v = lane; v < nvec; v += group) {
        const int64_t off = int64_t(v) * VEC;
        const Vec<T, VEC> a = load_vec<VEC>(src + off), w = load_vec<VEC>(weight + off);
        store_vec(out + base + off, normalized(a, w, scale));
    }
}

// Picks the vector width (16 bytes when every row is aligned) and the group (a warp for rows of at most
// 64 vectors, 4 rows per block; else a block of up to 1024 threads, one vector per thread where possible),
// then launches on out's stream. T is the host storage type; residual is null unless FUSED.
template <typename T, bool FUSED>
void launch_rms_norm(const Tensor &out, const Tensor *residual, const Tensor &x, const Tensor &weight, float eps) {
    using DT = device_t<T>;
    const char *op = FUSED ? "add_rms_norm" : "rms_norm";
    const int64_t D = x.shape().back(), rows = x.numel() / D;
    LLAISYS_CHECK(D <= (int64_t(1) << 30) && rows < (int64_t(1) << 31), std::invalid_argument, op, ": ", rows,
                  " rows of ", D, " elements are too many for the CUDA kernel");
    DT *res = FUSED ? dptr<T>(*residual) : nullptr;
    const bool wide = D % kVec16<T> == 0 && is_aligned(out.data(), 16) && is_aligned(x.data(), 16) &&
                      is_aligned(weight.data(), 16) && (!FUSED || is_aligned(res, 16));
    const cudaStream_t s = stream_of(out);
    dispatch_vec<T>(wide, [&](auto vec) {
        constexpr int V = decltype(vec)::value;
        const int64_t nvec = D / V;
        if (nvec <= 64) {
            constexpr int rows_per_block = 4;
            const unsigned blocks = unsigned(ceil_div(rows, rows_per_block));
            launch_pdl(rms_norm_kernel<DT, V, true, FUSED>, blocks, 32 * rows_per_block, 0, s, out.device().index,
                       dptr<T>(out), res, dptr<T>(x), dptr<T>(weight), rows, int(D), eps);
        } else {
            const int threads = int(std::min<int64_t>(1024, ceil_div(nvec, 32) * 32));
            launch_pdl(rms_norm_kernel<DT, V, false, FUSED>, unsigned(rows), threads, 0, s, out.device().index,
                       dptr<T>(out), res, dptr<T>(x), dptr<T>(weight), rows, int(D), eps);
        }
    });
}

} // namespace llaisys::ops::cuda
