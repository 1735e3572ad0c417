// Helpers for CPU kernels: float conversion for every storage type, loops over the thread pool, and the
// shared body of the ops that update logits at token ids.
#pragma once
#include "llaisys/dtype.hpp"
#include "llaisys/thread_pool.hpp"
#include "ops/common/checks.hpp"

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

// Calls fn(i) for every i in [0, n) on the pool (thread_pool.hpp: it lives there for core's copies).
using ::llaisys::parallel_for;

// logits [B, V] (any strides, updated in place) at ids [B, n] (contiguous i64, -1 = padding): the logit
// of the id at flat position k becomes f(logit, k), rounded once. Every id is checked to be -1 or in
// [0, V) before any logit changes. The body of logit_bias and repetition_penalty.
template <typename F>
void update_logits_at_ids(const char *op, const Tensor &logits, const Tensor &ids, F &&f) {
    const int64_t B = ids.size(0), n = ids.size(1), V = logits.size(1);
    const int64_t *id = ids.data_as<int64_t>();
    for (int64_t k = 0; k < B * n; ++k)
        LLAISYS_CHECK(id[k] >= -1 && id[k] < V, std::out_of_range, op, ": id ", id[k], " at [", k / n, ", ", k % n,
                      "] is out of range for a vocabulary of ", V, " (use -1 for padding)");
    detail::dispatch_float(op, logits.dtype(), logits.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        T *const base = logits.data_as<T>();
        const int64_t s0 = logits.stride(0), s1 = logits.stride(1);
        parallel_for(B, n, [&](int64_t b) {
            for (int64_t k = b * n; k < (b + 1) * n; ++k) {
                if (id[k] < 0) continue;
                T *p = base + b * s0 + id[k] * s1;
                *p = from_float<T>(f(to_float(*p), k));
            }
        });
    });
}

} // namespace llaisys::ops::cpu
