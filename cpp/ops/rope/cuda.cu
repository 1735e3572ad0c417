#include "ops/rope/rope.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/rope_math.cuh"

namespace llaisys::ops::cuda {

struct RopeDims {
    int64_t seq, heads;
    int half;            // pairs (i, i + half) that turn: inv_freq's size, <= head_dim / 2
    int pass;            // dims [2 * half, 2 * half + pass) copied unchanged (0 when out is x or none are left)
    int64_t xs, xh;      // x strides over seq and heads (last dim contiguous)
    int64_t os, oh;      // out strides over seq and heads
};

// One thread per (position, head, VEC consecutive pairs or VEC copied dims), grid-stride: pair i turns
// (x[i], x[i + half]) by angle = float(pos) * inv_freq[i] in f32; the dims past 2 * half are copied.
// Block: 256 threads; inv_freq staged in shared memory first. A thread reads its pairs before writing
// them, so out may alias x.
template <typename T, typename I, int VEC>
__global__ void rope_kernel(T *out, const T *x, const I *pos, const RopeFreqs freqs, const RopeDims d) {
    __shared__ float inv_freq[kMaxRopePairs];
    for (int i = threadIdx.x; i < d.half; i += blockDim.x) inv_freq[i] = freqs.v[i];
    __syncthreads();
    const int64_t turns = d.half / VEC, chunks = turns + d.pass / VEC, total = d.seq * d.heads * chunks;
    for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
        const int64_t sh = t / chunks, s = sh / d.heads, head = sh - s * d.heads; // two 64-bit divisions
        const int c = int(t - sh * chunks), i0 = c * VEC;
        const T *xr = x + s * d.xs + head * d.xh; // [head_dim]
        T *orow = out + s * d.os + head * d.oh;   // [head_dim]
        if (c >= turns) { // a copied piece of a partial rotary
            const int e0 = 2 * d.half + (c - int(turns)) * VEC;
            store_vec(orow + e0, load_vec<VEC>(xr + e0));
            continue;
        }
        const float p = float(pos[s]);
        const Vec<T, VEC> a = load_vec<VEC>(xr + i0), b = load_vec<VEC>(xr + i0 + d.half);
        Vec<T, VEC> oa, ob;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            float cs, sn;
            rope_cos_sin(p, inv_freq[i0 + j], cs, sn);
            const float2 o = rope_turn(to_f32(a.v[j]), to_f32(b.v[j]), cs, sn);
            oa.v[j] = from_f32<T>(o.x);
            ob.v[j] = from_f32<T>(o.y);
        }
        store_vec(orow + i0, oa);
        store_vec(orow + i0 + d.half, ob);
    }
}

void rope(const Tensor &out, const Tensor &x, const Tensor &pos_ids, const std::vector<float> &inv_freq) {
    const int64_t half = int64_t(inv_freq.size()); // <= head_dim / 2 <= kMaxRopePairs: op.cpp checks both
    const RopeFreqs freqs = rope_freqs(inv_freq, half);
    const bool in_place = out.data() == x.data() && out.stride(0) == x.stride(0) && out.stride(1) == x.stride(1);
    const int pass = in_place ? 0 : int(x.size(2) - 2 * half);
    const RopeDims d{x.size(0), x.size(1), int(half), pass, x.stride(0), x.stride(1), out.stride(0), out.stride(1)};
    detail::dispatch_float("rope", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const bool wide = rope_rows_aligned<T>(x, half) && rope_rows_aligned<T>(out, half);
        detail::dispatch_index("rope", pos_ids.dtype(), pos_ids.device(), [&](auto itag) {
            using I = typename decltype(itag)::type;
            dispatch_vec<T>(wide, [&](auto vec) {
                constexpr int V = decltype(vec)::value;
                const int threads = 256;
                const int64_t total = d.seq * d.heads * (half / V + pass / V);
                const int blocks = int(std::min<int64_t>(ceil_div(total, threads), 65535));
                rope_kernel<device_t<T>, I, V><<<blocks, threads, 0, stream_of(out)>>>(
                    dptr<T>(out), dptr<T>(x), pos_ids.data_as<I>(), freqs, d);
                CUDA_CHECK_LAUNCH();
            });
        });
    });
}

} // namespace llaisys::ops::cuda
