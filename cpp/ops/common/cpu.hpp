// Helpers for CPU kernels: float conversion for every storage type and loops over the thread pool.
#pragma once
#include "llaisys/dtype.hpp"
#include "llaisys/thread_pool.hpp"

#include <algorithm>
#include <cstdint>

namespace llaisys::ops::cpu {

template <typename T>
inline float load(const T *p, int64_t i) { return to_float(p[i]); }
template <typename T>
inline void store(T *p, int64_t i, float v) { p[i] = from_float<T>(v); }

inline int max_threads() { return cpu_threads(); }

// Runs fn(t) for t in [0, tasks): on the thread pool when `parallel`, else in order on this thread.
template <typename Fn>
void run_tasks(int64_t tasks, bool parallel, Fn &&fn) {
    if (parallel) parallel_tasks(tasks, fn);
    else for (int64_t t = 0; t < tasks; ++t) fn(t);
}

// Calls fn(i) for every i in [0, n). Work of at least 2^15 (n * work_per_item, in rough element
// operations) is split into up to 8 ranges per thread, none under 2^13: small enough that a thread
// another process has descheduled holds up little, large enough to pay for claiming it.
template <typename Fn>
void parallel_for(int64_t n, int64_t work_per_item, Fn &&fn) {
    const int64_t work = n * std::max<int64_t>(work_per_item, 1);
    if (n <= 0) return;
    const int64_t tasks = std::max<int64_t>(1, std::min({n, int64_t(8) * max_threads(), work >> 13}));
    run_tasks(tasks, work >= (1 << 15), [&](int64_t t) {
        for (int64_t i = n * t / tasks, end = n * (t + 1) / tasks; i < end; ++i) fn(i);
    });
}

} // namespace llaisys::ops::cpu
