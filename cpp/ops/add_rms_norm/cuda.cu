#include "ops/add_rms_norm/add_rms_norm.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/rms_norm_rows.cuh"

namespace llaisys::ops::cuda {

// How rms_norm(t, x, x_weight) (x dense) sums a row's squares, so that the fused op can repeat it: vectors of
// `wide` 16-byte or single elements, split over a group of `group` threads (thread g sums vectors g, g +
// group, ... in order; the group sums its warps' warp_sums as block_sum does). rms_norm's one-warp kernels
// are group 32 (block_sum over one warp adds only zeros to the warp_sum), its block kernel the block it
// launches (launch_rms_norm).
struct XNorm {
    bool wide;
    int group;
};

// rsqrt(mean(x^2) + eps) of row x [D], the summation of XNorm with vectors of XV, computed by one warp
// (every lane gets it): the scale rms_norm computes for that row, bit for bit.
template <int XV, typename T>
__device__ __forceinline__ float x_norm_scale(const T *x, int D, float eps, int group, int lane) {
    const int nvec = D / XV;
    float part = 0.f; // lane w: the sum of the group's warp w (block_sum's scratch[w])
    for (int w = 0; w < group / 32; ++w) {
        float s = 0.f;
        for (int v = 32 * w + lane; v < nvec; v += group) s += sum_squares(load_vec<XV>(x + int64_t(v) * XV));
        s = warp_sum(s);
        if (lane == w) part = s;
    }
    return rsqrtf(warp_sum(part) / float(D) + eps);
}

// rms_norm_kernel<T, VEC, WARP, FUSED = true> (rms_norm_rows.cuh) with x replaced by rms_norm(x, x_weight):
// the row's x scale first (x_norm_scale; a block's first warp computes it and shares it), then the same two
// passes, each x vector normed and rounded (normalized(), elementwise: the vector width does not matter)
// before add_rounded. Same launch geometry as the FUSED kernel, so the residual norm sums as it does.
template <typename T, int VEC, bool WARP>
__global__ void add_rms_norm_xnorm_kernel(T *out, T *residual, const T *x, const T *weight, const T *x_weight,
                                          int64_t rows, int D, float eps, XNorm xn) {
    __shared__ float scratch[32];
    __shared__ float x_scale_s;
    const int64_t row = WARP ? blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32 : int64_t(blockIdx.x);
    const int lane = WARP ? int(threadIdx.x % 32) : int(threadIdx.x), group = WARP ? 32 : int(blockDim.x);
    pdl_trigger(); // launched with PDL (cuda.cuh): nothing is read before the previous kernel is done
    pdl_wait();
    if (row >= rows) return; // a whole warp (WARP) or never (one block per row)
    const int64_t base = row * D;
    constexpr int kWide = 16 / int(sizeof(T));
    const auto scale_of_x = [&] {
        const int l = int(threadIdx.x % 32);
        return xn.wide ? x_norm_scale<kWide>(x + base, D, eps, xn.group, l)
                       : x_norm_scale<1>(x + base, D, eps, xn.group, l);
    };
    float xscale;
    if constexpr (WARP) {
        xscale = scale_of_x();
    } else {
        if (threadIdx.x < 32) {
            const float s = scale_of_x();
            if (threadIdx.x == 0) x_scale_s = s;
        }
        __syncthreads();
        xscale = x_scale_s;
    }
    const int nvec = D / VEC;
    float ss = 0.f;
    for (int v = lane; v < nvec; v += group) {
        const int64_t off = int64_t(v) * VEC;
        const Vec<T, VEC> t = normalized(load_vec<VEC>(x + base + off), load_vec<VEC>(x_weight + off), xscale);
        const Vec<T, VEC> a = add_rounded(load_vec<VEC>(residual + base + off), t);
        store_vec(residual + base + off, a);
        ss += sum_squares(a);
    }
    ss = group_sum<WARP>(ss, scratch);
    const float scale = rsqrtf(ss / float(D) + eps);
    for (int v = lane; v < nvec; v += group) {
        const int64_t off = int64_t(v) * VEC;
        const Vec<T, VEC> a = load_vec<VEC>(residual + base + off), w = load_vec<VEC>(weight + off);
        store_vec(out + base + off, normalized(a, w, scale));
    }
}

void add_rms_norm(const Tensor &out, const Tensor &residual, const Tensor &x, const Tensor &weight, float eps,
                  const Tensor &x_weight) {
    detail::dispatch_float("add_rms_norm", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        if (!x_weight.defined()) return launch_rms_norm<T, true>(out, &residual, x, weight, eps);
        using DT = device_t<T>;
        const int64_t D = x.shape().back(), rows = x.numel() / D;
        LLAISYS_CHECK(D <= (int64_t(1) << 30) && rows < (int64_t(1) << 31), std::invalid_argument, "add_rms_norm: ",
                      rows, " rows of ", D, " elements are too many for the CUDA kernel");
        // launch_rms_norm's choices for the two ops this one stands for: rms_norm(t, x, x_weight) into a fresh
        // (16-byte aligned) t picks its vectors by x and x_weight, then rms_norm_reg_kernel (a warp per row) up
        // to 256 wide vectors, a warp per row up to 64 single elements, else a block per row
        const bool x_wide = D % kVec16<T> == 0 && is_aligned(x.data(), 16) && is_aligned(x_weight.data(), 16);
        const int64_t x_nvec = x_wide ? D / kVec16<T> : D;
        const bool x_warp = x_wide ? x_nvec <= 32 * 8 : x_nvec <= 64;
        const XNorm xn{x_wide, x_warp ? 32 : int(std::min<int64_t>(1024, ceil_div(x_nvec, 32) * 32))};
        // ... and add_rms_norm(out, residual, t, weight) picks its own by out, residual and weight (t aligned)
        const bool wide = D % kVec16<T> == 0 && is_aligned(out.data(), 16) && is_aligned(residual.data(), 16) &&
                          is_aligned(weight.data(), 16);
        const cudaStream_t s = stream_of(out);
        dispatch_vec<T>(wide, [&](auto vec) {
            constexpr int V = decltype(vec)::value;
            const int64_t nvec = D / V;
            constexpr int rows_per_block = 4;
            if (nvec <= 64)
                launch_pdl(add_rms_norm_xnorm_kernel<DT, V, true>, unsigned(ceil_div(rows, rows_per_block)),
                           32 * rows_per_block, 0, s, out.device().index, dptr<T>(out), dptr<T>(residual), dptr<T>(x),
                           dptr<T>(weight), dptr<T>(x_weight), rows, int(D), eps, xn);
            else
                launch_pdl(add_rms_norm_xnorm_kernel<DT, V, false>, unsigned(rows),
                           int(std::min<int64_t>(1024, ceil_div(nvec, 32) * 32)), 0, s, out.device().index,
                           dptr<T>(out), dptr<T>(residual), dptr<T>(x), dptr<T>(weight), dptr<T>(x_weight), rows,
                           int(D), eps, xn);
        });
    });
}

} // namespace llaisys::ops::cuda
