// Block-wide row maximum for the argmax and sample kernels: one block owns one row (the CPU row maximum
// is in argmax_rows.hpp). The orderable keys with which argmax combines the parts of a row that several
// blocks read are argmax's own (ops/argmax/argmax.cuh).
#pragma once
#include "ops/common/cuda.cuh"

#include <climits>
#include <cstdint>

namespace llaisys::ops::cuda {

// VEC elements of T loaded as one 16-byte (or narrower) transaction; p must be aligned to its size.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) RowPack {
    T v[VEC];
};

// Elements of T in 16 bytes: 4 for f32, 8 for f16/bf16.
template <typename T>
constexpr int kRowVec = int(16 / sizeof(T));

// Whether rows of V elements starting at `base` can all be read with kRowVec<T>-wide loads.
template <typename T>
inline bool rows_vectorizable(const void *base, int64_t V) {
    return reinterpret_cast<uintptr_t>(base) % 16 == 0 && V % kRowVec<T> == 0;
}

struct ArgmaxSmem {
    float val[32];
    int idx[32];
};

// The maximum over non-NaN values and its first index (INT_MAX when no value exceeds -inf); whether a
// NaN was seen. Every thread gets the result.
struct RowMax {
    float val;
    int idx;
    bool any_nan;
};

// Keeps the larger value, then the lower index.
__device__ __forceinline__ void merge_max(float &v, int &i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

__device__ __forceinline__ void block_merge_max(float &v, int &i, ArgmaxSmem &sm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) merge_max(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    __syncthreads(); // sm may still be read by a previous call
    if (lane == 0) {
        sm.val[warp] = v;
        sm.idx[warp] = i;
    }
    __syncthreads();
    v = lane < nwarps ? sm.val[lane] : -INFINITY;
    i = lane < nwarps ? sm.idx[lane] : INT_MAX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) merge_max(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
}

// This thread's part of a row scan: packs of VEC elements at first, first + stride, ... < end, UNROLL raw
// packs in flight (one SM may stream a whole row, so it must keep many bytes in flight). The thread sees
// its indices in increasing order, so a strict `>` keeps its first maximum in best / best_i (left at
// -inf / INT_MAX when it sees nothing above -inf); nan records whether it saw a NaN. Only a float compare
// per element: building a 64-bit key per element made the split argmax compute-bound.
// With VEC > 1, every pack that starts below end lies inside the row and is VEC-aligned.
template <int VEC, int UNROLL, typename T>
__device__ __forceinline__ void thread_scan_max(const T *row, int64_t first, int64_t end, int64_t stride, float &best,
                                                int &best_i, bool &nan) {
    for (int64_t base = first; base < end; base += UNROLL * stride) {
        RowPack<T, VEC> raw[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (base + u * stride < end) raw[u] = *reinterpret_cast<const RowPack<T, VEC> *>(row + base + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (base + u * stride >= end) break;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float v = to_f32(raw[u].v[e]);
                nan |= v != v;
                if (v > best) {
                    best = v;
                    best_i = int(base + u * stride + e);
                }
            }
        }
    }
}

// Max of row [V]: thread t scans VEC-wide packs t, t + blockDim, ... (thread_scan_max), then the block
// merges. Needs blockDim.x % 32 == 0; with VEC > 1, row 16-byte aligned and V % VEC == 0.
// own (if given) gets this thread's max (-inf when it saw nothing above -inf; NaN never).
template <int VEC, typename T>
__device__ RowMax block_row_max(const T *row, int V, ArgmaxSmem &sm, float *own = nullptr) {
    float best = -INFINITY;
    int best_i = INT_MAX;
    bool nan = false;
    thread_scan_max<VEC, 4>(row, int64_t(threadIdx.x) * VEC, V, int64_t(blockDim.x) * VEC, best, best_i, nan);
    if (own != nullptr) *own = best;
    nan = __syncthreads_or(nan);
    block_merge_max(best, best_i, sm);
    return {best, best_i == INT_MAX ? 0 : best_i, nan};
}

// Whether a row has a finite maximum (else argmax and sample give -1, ops.hpp).
__device__ __forceinline__ bool finite_max(const RowMax &m) { return !m.any_nan && isfinite(m.val); }

} // namespace llaisys::ops::cuda
