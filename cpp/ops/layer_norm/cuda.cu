#include "ops/layer_norm/layer_norm.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/row_reduce.cuh"

#include <initializer_list>

namespace llaisys::ops::cuda {

namespace {

template <typename T, int VEC>
__device__ __forceinline__ float vec_sum(const Vec<T, VEC> &a) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += to_f32(a.v[j]);
    return s;
}

// Adds the deviations d = a - m of a vector to s1 and their squares to s2.
template <typename T, int VEC>
__device__ __forceinline__ void add_deviations(const Vec<T, VEC> &a, float m, float &s1, float &s2) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const float d = to_f32(a.v[j]) - m;
        s1 += d;
        s2 += d * d;
    }
}

// (a - m - c) * rstd * w (+ b), rounded once; w and b are the vectors at element `off` (b may be null).
template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> normalized(const Vec<T, VEC> &a, const T *weight, const T *bias,
                                                  int64_t off, float m, float c, float rstd) {
    const Vec<T, VEC> w = load_vec<VEC>(weight + off);
    Vec<T, VEC> b;
    if (bias) b = load_vec<VEC>(bias + off);
    Vec<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) { // _rn intrinsics: nvcc may not contract y + b into an FMA in one
        // instantiation and not in another (add_layer_norm's out2 must have the bits of a call of its own)
        const float y = __fmul_rn(__fmul_rn(__fsub_rn(__fsub_rn(to_f32(a.v[j]), m), c), rstd), to_f32(w.v[j]));
        o.v[j] = from_f32<T>(bias ? __fadd_rn(y, to_f32(b.v[j])) : y);
    }
    return o;
}

// The mean correction c and 1 / sqrt(var + eps) from the group's sums of deviations from the first mean.
struct Moments {
    float c, rstd;
};
__device__ __forceinline__ Moments moments(float s1, float s2, int D, float eps) {
    const float c = s1 / float(D);
    return {c, rsqrtf(fmaxf(s2 / float(D) - c * c, 0.f) + eps)};
}

// One row of [rows, D] per group of threads. WARP (short rows): a group is one warp and a block holds
// blockDim.x / 32 rows; otherwise the group is the whole block and blockIdx.x is the row. Threads take the
// row's VEC-element vectors lane, lane + group, ... (D % VEC == 0; 16-byte aligned rows when VEC > 1).
// Pass 1 loads the row - FUSED: residual + x (+ x2), rounded after each add and stored back, exactly what
// add() twice computes - and sums it for a first mean m; pass 2 sums d = x - m and d^2 (the corrected
// two-pass algorithm of cpu.cpp: c = mean(d) corrects m, var = mean(d^2) - c^2); pass 3 writes. NV > 0: a
// thread holds its (at most NV) vectors in registers between the passes, all loaded before any is used;
// NV == 0 (rows longer than that): passes 2 and 3 re-read the row, which pass 1 has just pulled into L1/L2.
// out may alias x or x2: every read of a row precedes the reduction that any write waits for. The second
// output (add_layer_norm's out2, with weight2 and bias2; null when not asked) is the same row normed again.
struct Second {
    void *out;
    const void *weight, *bias;
};
template <typename T, int VEC, int NV, bool WARP, bool FUSED>
__global__ void layer_norm_kernel(T *out, T *residual, const T *x, const T *x2, const T *weight, const T *bias,
                                  int64_t rows, int D, float eps, Second second) {
    __shared__ float scratch[32];
    const int64_t row = WARP ? blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32 : int64_t(blockIdx.x);
    const int lane = WARP ? int(threadIdx.x % 32) : int(threadIdx.x), group = WARP ? 32 : int(blockDim.x);
    pdl_trigger(); // launched with PDL (cuda.cuh): nothing is read before the previous kernel is done
    pdl_wait();
    if (row >= rows) return; // a whole warp (WARP) or never (one block per row)
    const int64_t base = row * D;
    const int nvec = D / VEC;
    T *out2 = static_cast<T *>(second.out);
    const T *weight2 = static_cast<const T *>(second.weight), *bias2 = static_cast<const T *>(second.bias);
    const T *src = FUSED ? residual + base : x + base; // the row being normalised, once pass 1 has run
    const auto reduce = [&](float v) { return group_sum<WARP>(v, scratch); };
    const auto at = [&](int v) { return int64_t(v) * VEC; };
    // Pass 1's value of vector v, before the residual (FUSED) is stored.
    const auto load_input = [&](int v) {
        Vec<T, VEC> a = load_vec<VEC>(src + at(v));
        if constexpr (FUSED) {
            a = add_rounded(a, load_vec<VEC>(x + base + at(v)));
            if (x2) a = add_rounded(a, load_vec<VEC>(x2 + base + at(v)));
        }
        return a;
    };
    float sum = 0.f, s1 = 0.f, s2 = 0.f;
    if constexpr (NV > 0) {
        Vec<T, VEC> held[NV > 0 ? NV : 1];
#pragma unroll
        for (int j = 0; j < NV; ++j)
            if (lane + j * group < nvec) held[j] = load_input(lane + j * group);
#pragma unroll
        for (int j = 0; j < NV; ++j)
            if (lane + j * group < nvec) {
                if constexpr (FUSED) store_vec(residual + base + at(lane + j * group), held[j]);
                sum += vec_sum(held[j]);
            }
        const float m = reduce(sum) / float(D);
#pragma unroll
        for (int j = 0; j < NV; ++j)
            if (lane + j * group < nvec) add_deviations(held[j], m, s1, s2);
        const Moments mo = moments(reduce(s1), reduce(s2), D, eps);
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int v = lane + j * group;
            if (v < nvec) {
                store_vec(out + base + at(v), normalized(held[j], weight, bias, at(v), m, mo.c, mo.rstd));
                if (FUSED && second.out)
                    store_vec(out2 + base + at(v), normalized(held[j], weight2, bias2, at(v), m, mo.c, mo.rstd));
            }
        }
    } else {
        for (int v = lane; v < nvec; v += group) {
            const Vec<T, VEC> a = load_input(v);
            if constexpr (FUSED) store_vec(residual + base + at(v), a);
            sum += vec_sum(a);
        }
        const float m = reduce(sum) / float(D);
        for (int v = lane; v < nvec; v += group) add_deviations(load_vec<VEC>(src + at(v)), m, s1, s2);
        const Moments mo = moments(reduce(s1), reduce(s2), D, eps);
        for (int v = lane; v < nvec; v += group) {
            const Vec<T, VEC> a = load_vec<VEC>(src + at(v));
            store_vec(out + base + at(v), normalized(a, weight, bias, at(v), m, mo.c, mo.rstd));
            if (FUSED && second.out)
                store_vec(out2 + base + at(v), normalized(a, weight2, bias2, at(v), m, mo.c, mo.rstd));
        }
    }
}

template <typename T>
device_t<T> *dptr_or_null(const Tensor *t) { return t && t->defined() ? dptr<T>(*t) : nullptr; }

// Picks the vector width (16 bytes when every row is aligned) and the kernel: a warp per row, 4 rows per
// block, for rows of at most 64 vectors (held in registers, 2 a lane); else a block per row of up to 1024
// threads holding 1, 2 or 4 vectors each, or re-reading longer rows (NV = 0), as add_rms_norm does. The
// rule depends on D only, so a row's bits do not depend on the batch. (Until session 35 a warp also took
// rows of up to 256 vectors: at one row of 2048 bf16, a decode step's, one warp read and reduced the row
// alone: 8.34 us against 3.65 for a block on 2560, H100, session 30.) Launches on
// out's stream. T is the host storage type; residual is null unless FUSED; x2 and bias may be undefined.
template <typename T, bool FUSED>
void launch_layer_norm(const char *op, const Tensor &out, const Tensor *residual, const Tensor &x,
                       const Tensor *x2, const Tensor &weight, const Tensor &bias, float eps,
                       const Tensor *out2 = nullptr, const Tensor *weight2 = nullptr, const Tensor *bias2 = nullptr) {
    using DT = device_t<T>;
    const int64_t D = x.shape().back(), rows = x.numel() / D;
    LLAISYS_CHECK(D <= (int64_t(1) << 30) && rows < (int64_t(1) << 31), std::invalid_argument, op, ": ", rows,
                  " rows of ", D, " elements are too many for the CUDA kernel");
    DT *res = dptr_or_null<T>(residual);
    const DT *xp2 = dptr_or_null<T>(x2), *bp = dptr_or_null<T>(&bias);
    bool wide = D % kVec16<T> == 0;
    const Second second{dptr_or_null<T>(out2), dptr_or_null<T>(weight2), dptr_or_null<T>(bias2)};
    for (const void *p : std::initializer_list<const void *>{out.data(), x.data(), weight.data(), res, xp2, bp,
                                                              second.out, second.weight, second.bias})
        wide = wide && is_aligned(p, 16); // null is aligned
    const cudaStream_t s = stream_of(out);
    dispatch_vec<T>(wide, [&](auto vec) {
        constexpr int V = decltype(vec)::value;
        const int64_t nvec = D / V;
        const auto go = [&](auto kernel, int64_t blocks, int64_t threads) {
            launch_pdl(kernel, unsigned(blocks), unsigned(threads), 0, s, out.device().index, dptr<T>(out), res,
                       dptr<T>(x), xp2, dptr<T>(weight), bp, rows, int(D), eps, second);
        };
        constexpr int rows_per_block = 4; // of the one-warp-per-row kernel
        const int64_t warp_blocks = ceil_div(rows, rows_per_block), warp_threads = 32 * rows_per_block;
        if (nvec <= 32 * 2) return go(layer_norm_kernel<DT, V, 2, true, FUSED>, warp_blocks, warp_threads);
        const int64_t per_thread = ceil_div(nvec, 1024); // vectors a thread must take at 1024 threads
        const int nv = per_thread <= 1 ? 1 : per_thread <= 2 ? 2 : per_thread <= 4 ? 4 : 0;
        const int64_t threads = nv ? ceil_div(ceil_div(nvec, nv), 32) * 32 : 1024;
        if (nv == 1) return go(layer_norm_kernel<DT, V, 1, false, FUSED>, rows, threads);
        if (nv == 2) return go(layer_norm_kernel<DT, V, 2, false, FUSED>, rows, threads);
        if (nv == 4) return go(layer_norm_kernel<DT, V, 4, false, FUSED>, rows, threads);
        go(layer_norm_kernel<DT, V, 0, false, FUSED>, rows, threads);
    });
}

} // namespace

void layer_norm(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, float eps) {
    detail::dispatch_float("layer_norm", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        launch_layer_norm<T, false>("layer_norm", out, nullptr, x, nullptr, weight, bias, eps);
    });
}

void add_layer_norm(const Tensor &out, const Tensor &residual, const Tensor &delta, const Tensor &delta2,
                    const Tensor &weight, const Tensor &bias, float eps, const Tensor &out2, const Tensor &weight2,
                    const Tensor &bias2) {
    detail::dispatch_float("add_layer_norm", delta.dtype(), delta.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        launch_layer_norm<T, true>("add_layer_norm", out, &residual, delta, &delta2, weight, bias, eps, &out2, &weight2,
                                   &bias2);
    });
}

} // namespace llaisys::ops::cuda
