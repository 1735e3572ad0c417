// What the CUDA norm kernels share (rms_norm_rows.cuh: rms_norm, add_rms_norm and quant_linear's fused
// norm; layer_norm/cuda.cu: layer_norm, add_layer_norm): they give each row to a group of threads, one warp
// (WARP, short rows) or the whole block, sum over that group, and round a residual add the way add() does.
#pragma once
#include "ops/common/vec.cuh"

namespace llaisys::ops::cuda {

// Sum over the row's group: the warp (WARP) or the block; every thread of it gets the result. scratch holds
// 32 floats (block_sum's); blockDim.x % 32 == 0.
template <bool WARP>
__device__ __forceinline__ float group_sum(float v, float *scratch) {
    return WARP ? warp_sum(v) : block_sum(v, scratch);
}

// r + x on one vector, rounded to T: one add() of the residual, which the norm then reads.
template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> add_rounded(const Vec<T, VEC> &r, const Vec<T, VEC> &x) {
    Vec<T, VEC> s;
#pragma unroll
    for (int j = 0; j < VEC; ++j) s.v[j] = from_f32<T>(to_f32(r.v[j]) + to_f32(x.v[j]));
    return s;
}

} // namespace llaisys::ops::cuda
