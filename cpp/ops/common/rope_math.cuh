// Device pieces shared by the rope kernels (rope, rope_qkv_cache), so that they agree bit for bit; the
// CPU pieces are in rope_math.hpp.
#pragma once
#include "ops/common/rope_table.hpp"
#include "ops/common/vec.cuh"

#include <cstring>
#include <vector>

namespace llaisys::ops::cuda {

// inv_freq travels as a kernel parameter (no host-to-device copy, nothing to allocate); 512 pairs cover
// head_dim <= 1024, 2 KiB of parameter space.
constexpr int kMaxRopePairs = 512;
static_assert(2 * kMaxRopePairs == kRopeMaxCudaHeadDim, "the parameter array must hold every pair");
struct RopeFreqs {
    float v[kMaxRopePairs];
};

// inv_freq [half] as a kernel parameter; half <= kMaxRopePairs (op.cpp checks kRopeMaxCudaHeadDim and
// half <= head_dim / 2).
inline RopeFreqs rope_freqs(const std::vector<float> &inv_freq, int64_t half) {
    RopeFreqs freqs{};
    std::memcpy(freqs.v, inv_freq.data(), size_t(half) * sizeof(float));
    return freqs;
}

// cos and sin of the angle p * inv_freq: the exact f32 product (as on the CPU), then sincosf.
__device__ __forceinline__ void rope_cos_sin(float p, float inv_freq, float &cs, float &sn) {
    sincosf(__fmul_rn(p, inv_freq), &sn, &cs);
}

// Turns the pair (x1, x2) by the angle with cosine cs and sine sn in f32. The roundings are spelled out
// (no contraction left to the compiler) so that every kernel rounds alike.
__device__ __forceinline__ float2 rope_turn(float x1, float x2, float cs, float sn) {
    return make_float2(__fmaf_rn(x1, cs, -__fmul_rn(x2, sn)), __fmaf_rn(x2, cs, __fmul_rn(x1, sn)));
}

// VEC pairs (i0 + k, i0 + k + half) of one head turned: dst[..] = src[..] rotated by the shared cos/sin
// (dst may be src). The inner step of rope_qkv_cache and kv_shift.
template <int VEC, typename T>
__device__ __forceinline__ void rope_turn_vec(T *dst, const T *src, int i0, int half, const float *cos_s,
                                              const float *sin_s) {
    const Vec<T, VEC> a = load_vec<VEC>(src + i0), b = load_vec<VEC>(src + i0 + half);
    Vec<T, VEC> oa, ob;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
        const float2 o = rope_turn(to_f32(a.v[k]), to_f32(b.v[k]), cos_s[i0 + k], sin_s[i0 + k]);
        oa.v[k] = from_f32<T>(o.x);
        ob.v[k] = from_f32<T>(o.y);
    }
    store_vec(dst + i0, oa);
    store_vec(dst + i0 + half, ob);
}

// 16-byte vectors when every row start (base, seq and head strides), the pair offset `half` (the number of
// pairs) and the head dim (where the copied dims of a partial rotary end) are aligned to them.
template <typename T>
bool rope_rows_aligned(const Tensor &t, int64_t half) {
    const int64_t v = kVec16<T>;
    auto ok = [&](int dim) { return t.size(dim) == 1 || t.stride(dim) % v == 0; };
    return half % v == 0 && t.size(2) % v == 0 && ok(0) && ok(1) && is_aligned(t.data(), 16);
}

} // namespace llaisys::ops::cuda
