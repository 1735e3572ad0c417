// The CPU ops' threads: one persistent pool per process, shared by every parallel call.
//
// Why not OpenMP: its regions end in a barrier that waits for every thread, and its idle threads spin.
// When another process takes a core, a descheduled thread stalls every op (decode fell 4x beside one
// busy process, 50x beside a second engine). Here tasks are claimed one at a time from an atomic
// counter and the calling thread claims too, so the caller only ever waits for a task that a worker
// has already started; idle workers spin briefly, then sleep.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>

namespace llaisys {

// Threads a parallel call may use, the caller included: the cores this process may run on
// (sched_getaffinity), or LLAISYS_NUM_THREADS when set (an A/B switch for benchmarks, not a user setting).
int cpu_threads();

// Calls task(ctx, i) exactly once for every i in [0, n) on the pool's threads and the calling thread,
// and returns when all have finished. The first exception a task throws is rethrown here (the tasks
// not yet started are skipped). Nested calls (from inside a task) and calls made while another thread
// is using the pool run inline on the calling thread, so any thread may call at any time.
// Keep tasks small (a few microseconds or more, many per thread): a task a descheduled worker has
// started is the only thing the caller can be left waiting for.
// When other processes leave the workers arriving late, jobs run on the calling thread alone for a while
// (core/pool_governor.hpp says when and why); which threads run a task never changes what it computes.
void parallel_tasks(int64_t n, void (*task)(void *ctx, int64_t i), void *ctx);

// For tests and benchmarks, not a user setting: adaptive (the default) lets the pool choose per job;
// serial runs every job on its caller; parallel always hands jobs to the workers. With restart, setting a
// mode restarts the adaptive choice from parallel; without, adaptive goes on from what it had measured
// (a benchmark that interleaves the modes measures the adaptive pool of a long-running engine).
enum class PoolMode { adaptive, serial, parallel };
void set_pool_mode(PoolMode mode, bool restart = true);

// Jobs since the process started (or forked) that ran on the workers and on the caller alone, how often the
// adaptive choice switched to the caller alone, and how many probe windows it opened (pool_governor.hpp).
struct PoolStats {
    int64_t parallel_jobs = 0, serial_jobs = 0, switches_to_serial = 0, probes = 0;
};
PoolStats pool_stats();

template <typename Fn>
void parallel_tasks(int64_t n, Fn &&fn) {
    using F = std::remove_reference_t<Fn>;
    parallel_tasks(n, [](void *ctx, int64_t i) { (*static_cast<F *>(ctx))(i); },
                   const_cast<void *>(static_cast<const void *>(std::addressof(fn))));
}

// Calls fn(begin, end) over ranges that cover [0, n) once. Work of at least 2^15 (n * work_per_item, in
// rough element operations) is split into up to 8 ranges per thread, none under 2^13: small enough that
// a thread another process has descheduled holds up little, large enough to pay for claiming it.
template <typename Fn>
void parallel_ranges(int64_t n, int64_t work_per_item, Fn &&fn) {
    const int64_t work = n * std::max<int64_t>(work_per_item, 1);
    if (n <= 0) return;
    const int64_t tasks = std::max<int64_t>(1, std::min({n, int64_t(8) * cpu_threads(), work >> 13}));
    auto range = [&](int64_t t) { fn(n * t / tasks, n * (t + 1) / tasks); };
    if (work >= (1 << 15)) parallel_tasks(tasks, range);
    else for (int64_t t = 0; t < tasks; ++t) range(t);
}

// Calls fn(i) for every i in [0, n), in parallel_ranges' ranges.
template <typename Fn>
void parallel_for(int64_t n, int64_t work_per_item, Fn &&fn) {
    parallel_ranges(n, work_per_item, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) fn(i);
    });
}

} // namespace llaisys
