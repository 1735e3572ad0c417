// Vectorised global loads/stores shared by the elementwise and row kernels (rms_norm, add_rms_norm, rope,
// swiglu, layer_norm, add_layer_norm, gelu, geglu).
#pragma once
#include "ops/common/cuda.cuh"

#include <cstdint>
#include <type_traits>

namespace llaisys::ops::cuda {

// N elements of T moved as one transaction (16 bytes for the widest N); the address must be aligned to
// sizeof(Vec<T, N>).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
    T v[N];
};

template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load_vec(const T *p) {
    return *reinterpret_cast<const Vec<T, N> *>(p);
}
template <int N, typename T>
__device__ __forceinline__ void store_vec(T *p, const Vec<T, N> &v) {
    *reinterpret_cast<Vec<T, N> *>(p) = v;
}

// Elements of T in 16 bytes: 4 for f32, 8 for f16/bf16.
template <typename T>
constexpr int kVec16 = int(16 / sizeof(T));

inline bool is_aligned(const void *p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Calls fn(std::integral_constant<int, kVec16<T>>{}) when `wide` holds, else with 1: one switch from a
// run-time alignment test to a compile-time vector width.
template <typename T, typename Fn>
void dispatch_vec(bool wide, Fn &&fn) {
    if (wide) return fn(std::integral_constant<int, kVec16<T>>{});
    fn(std::integral_constant<int, 1>{});
}

} // namespace llaisys::ops::cuda
