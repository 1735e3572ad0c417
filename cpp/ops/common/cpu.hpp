// Helpers for CPU kernels: float conversion for every storage type and OpenMP loops.
#pragma once
#include "llaisys/dtype.hpp"

#include <cstdint>

namespace llaisys::ops::cpu {

template <typename T>
inline float load(const T *p, int64_t i) { return to_float(p[i]); }
template <typename T>
inline void store(T *p, int64_t i, float v) { p[i] = from_float<T>(v); }

// Parallel for over [0, n) when OpenMP is available and the work is large enough to pay for threads.
template <typename Fn>
void parallel_for(int64_t n, int64_t work_per_item, Fn &&fn) {
#ifdef LLAISYS_WITH_OPENMP
    const bool parallel = n > 1 && n * work_per_item >= (1 << 15);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < n; ++i) fn(i);
#else
    for (int64_t i = 0; i < n; ++i) fn(i);
#endif
}

} // namespace llaisys::ops::cpu
