// The orderable 64-bit keys with which the argmax kernel combines the parts of a row that several blocks
// read; the block-wide row maximum it shares with sample is in ops/common/argmax_rows.cuh.
#pragma once
#include "ops/common/cuda.cuh"

#include <cstdint>

namespace llaisys::ops::cuda {

// ---- Orderable 64-bit keys: the argmax of any set of elements is the element with the largest key, so
// partial results (threads, blocks) combine with a plain max, in any order.
// High 32 bits: the float mapped to an unsigned int in the same order (-inf lowest, +inf, then every NaN
// above it as one value; -0.0 maps as +0.0 since they compare equal). Low 32 bits: ~index, so of equal
// values the lower index wins. Key 0 is below every element's key (-inf maps to 0x007fffff), so it is the
// identity of the max.
using ArgmaxKey = unsigned long long;

__device__ __forceinline__ uint32_t argmax_order(float v) {
    const uint32_t u = __float_as_uint(v);
    if (v != v) return 0xffffffffu;           // NaN: above +inf (0xff800000), whatever its sign and payload
    if (u == 0x80000000u) return 0x80000000u; // -0.0: same as +0.0
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ ArgmaxKey argmax_key(float v, int i) {
    return (ArgmaxKey(argmax_order(v)) << 32) | ArgmaxKey(~uint32_t(i));
}

// The index a key holds.
__device__ __forceinline__ uint32_t argmax_key_index(ArgmaxKey k) { return ~uint32_t(k); }

__device__ __forceinline__ ArgmaxKey max_key(ArgmaxKey a, ArgmaxKey b) { return a > b ? a : b; }

__device__ __forceinline__ ArgmaxKey warp_max_key(ArgmaxKey k) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) k = max_key(k, __shfl_xor_sync(0xffffffffu, k, o));
    return k;
}

// Max key over the block; every thread gets it. `scratch` holds 32 keys; blockDim.x % 32 == 0.
__device__ __forceinline__ ArgmaxKey block_max_key(ArgmaxKey k, ArgmaxKey *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    k = warp_max_key(k);
    __syncthreads(); // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = k;
    __syncthreads();
    k = lane < nwarps ? scratch[lane] : 0;
    return warp_max_key(k);
}

} // namespace llaisys::ops::cuda
