#include "ops/rope/rope.hpp"

#include "ops/common/checks.hpp"
#include "ops/rms_norm/vec.cuh"

#include <cstring>

namespace llaisys::ops::cuda {

// inv_freq travels as a kernel parameter (no host-to-device copy, nothing to allocate); 512 pairs cover
// head_dim <= 1024, 2 KiB of parameter space.
constexpr int kMaxRopePairs = 512;
struct RopeFreqs {
    float v[kMaxRopePairs];
};
struct RopeDims {
    int64_t seq, heads;
    int half;            // head_dim / 2
    int64_t xs, xh;      // x strides over seq and heads (last dim contiguous)
    int64_t os, oh;      // out strides over seq and heads
};

// One thread per (position, head, VEC consecutive pairs), grid-stride: pair i turns (x[i], x[i + half]) by
// angle = float(pos) * inv_freq[i] in f32. Block: 256 threads; inv_freq staged in shared memory first.
// A thread reads its pairs before writing them, so out may alias x.
template <typename T, typename I, int VEC>
__global__ void rope_kernel(T *out, const T *x, const I *pos, const RopeFreqs freqs, const RopeDims d) {
    __shared__ float inv_freq[kMaxRopePairs];
    for (int i = threadIdx.x; i < d.half; i += blockDim.x) inv_freq[i] = freqs.v[i];
    __syncthreads();
    const int64_t chunks = d.half / VEC, total = d.seq * d.heads * chunks;
    for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
        const int64_t sh = t / chunks, s = sh / d.heads, head = sh - s * d.heads; // two 64-bit divisions
        const int i0 = int(t - sh * chunks) * VEC;
        const float p = float(pos[s]);
        const T *xr = x + s * d.xs + head * d.xh; // [2 * half]
        T *orow = out + s * d.os + head * d.oh;   // [2 * half]
        const Vec<T, VEC> a = load_vec<VEC>(xr + i0), b = load_vec<VEC>(xr + i0 + d.half);
        Vec<T, VEC> oa, ob;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            float sn, cs;
            sincosf(__fmul_rn(p, inv_freq[i0 + j]), &sn, &cs); // exact f32 product, as on the CPU
            const float x1 = to_f32(a.v[j]), x2 = to_f32(b.v[j]);
            oa.v[j] = from_f32<T>(x1 * cs - x2 * sn);
            ob.v[j] = from_f32<T>(x2 * cs + x1 * sn);
        }
        store_vec(orow + i0, oa);
        store_vec(orow + i0 + d.half, ob);
    }
}

// 16-byte vectors when every row start (base, seq and head strides, the half offset) is aligned to them.
template <typename T>
static bool rope_rows_aligned(const Tensor &t, int64_t half) {
    const int64_t v = kVec16<T>;
    auto ok = [&](int dim) { return t.size(dim) == 1 || t.stride(dim) % v == 0; };
    return half % v == 0 && ok(0) && ok(1) && is_aligned(t.data(), 16);
}

void rope(const Tensor &out, const Tensor &x, const Tensor &pos_ids, const std::vector<float> &inv_freq) {
    const int64_t half = x.size(2) / 2; // <= kMaxRopePairs: op.cpp checks kRopeMaxCudaHeadDim
    static_assert(2 * kMaxRopePairs == kRopeMaxCudaHeadDim, "the parameter array must hold every pair");
    RopeFreqs freqs{};
    std::memcpy(freqs.v, inv_freq.data(), size_t(half) * sizeof(float));
    const RopeDims d{x.size(0), x.size(1), int(half), x.stride(0), x.stride(1), out.stride(0), out.stride(1)};
    detail::dispatch_float("rope", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const bool wide = rope_rows_aligned<T>(x, half) && rope_rows_aligned<T>(out, half);
        detail::dispatch_index("rope", pos_ids.dtype(), pos_ids.device(), [&](auto itag) {
            using I = typename decltype(itag)::type;
            dispatch_vec<T>(wide, [&](auto vec) {
                constexpr int V = decltype(vec)::value;
                const int threads = 256;
                const int64_t total = d.seq * d.heads * (half / V);
                const int blocks = int(std::min<int64_t>(ceil_div(total, threads), 65535));
                rope_kernel<device_t<T>, I, V><<<blocks, threads, 0, stream_of(out)>>>(
                    dptr<T>(out), dptr<T>(x), pos_ids.data_as<I>(), freqs, d);
                CUDA_CHECK_LAUNCH();
            });
        });
    });
}

} // namespace llaisys::ops::cuda
