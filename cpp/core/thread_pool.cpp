// The pool behind llaisys::parallel_tasks (thread_pool.hpp says why it replaces OpenMP).
//
// One job at a time: the caller holding caller_mu_ writes the job's fields, then publishes
// state_ = epoch << 32 | n. Every thread, the caller included, claims task n - r by decrementing the
// unclaimed count r with a CAS that also compares the epoch, so a worker waking late can never claim a
// task of a later job. A claim pins its job (the caller returns only when done_ == n), so the fields a
// thread reads after claiming are those of the job it claimed from. Before publishing, the caller asks the
// governor (pool_governor.hpp) whether the workers pay off now; when they don't, it runs the job alone.
#include "llaisys/thread_pool.hpp"

#include "core/pool_governor.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace llaisys {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

// How long an idle worker spins for the next job before it sleeps: the ops of a decode step follow
// each other within microseconds, so a short spin keeps workers awake through a step without taking
// a busy machine's cores between steps.
constexpr auto kWorkerSpin = std::chrono::microseconds(100);
// Pauses the caller spins waiting for tasks that workers have started, before it yields its core
// (which a descheduled worker may be waiting for).
constexpr int kCallerSpins = 2000;

constexpr int64_t kMaxIntervalNs = 20'000'000;
constexpr int64_t kLateJoinNs = 200'000; // a wait at the join that means a descheduled worker (note_join)

int threads_from_environment() {
    if (const char *s = std::getenv("LLAISYS_NUM_THREADS")) { // A/B runs only: read here and nowhere else
        const int n = std::atoi(s);
        if (n > 0) return n;
    }
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
    return int(std::max(1u, std::thread::hardware_concurrency()));
}

thread_local bool t_in_task = false; // true on workers, and on a caller while it runs its own job

// Marks the caller as inside its job until the scope ends (a task's exception included).
struct InTask {
    InTask() { t_in_task = true; }
    ~InTask() { t_in_task = false; }
};

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

void run_inline(int64_t n, void (*task)(void *, int64_t), void *ctx) {
    for (int64_t i = 0; i < n; ++i) task(ctx, i);
}

// Names a job for the governor: the task count alone is capped (parallel_ranges makes at most 8 per thread),
// so one task function (a copy, a norm) runs jobs of very different sizes under one count; ctx, the caller's
// closure on its stack, tells the call paths apart (measured: without it one 5.7 ms copy job stood for
// jobs of 30-250 us and decided a probe at idle).
uint64_t job_key(void (*task)(void *, int64_t), void *ctx, int64_t n) {
    return (uint64_t(reinterpret_cast<uintptr_t>(task)) * 31 + uint64_t(reinterpret_cast<uintptr_t>(ctx))) * 31 +
           uint64_t(n);
}

std::atomic<PoolMode> g_mode{PoolMode::adaptive}; // outside the pool, so a forked child keeps it

class Pool {
  public:
    explicit Pool(int threads) {
        for (int t = 1; t < threads; ++t) workers_.emplace_back([this] { worker_loop(); });
    }
    void run(int64_t n, void (*task)(void *, int64_t), void *ctx);
    void restart_governor() {
        std::lock_guard<std::mutex> g(caller_mu_);
        governor_ = detail::PoolGovernor{};
    }
    PoolStats stats() const {
        return {parallel_jobs_.load(std::memory_order_relaxed), serial_jobs_.load(std::memory_order_relaxed),
                switches_.load(std::memory_order_relaxed), probes_.load(std::memory_order_relaxed)};
    }

  private:
    static constexpr uint64_t kCountMask = 0xffffffffu;
    void publish(int64_t n, void (*task)(void *, int64_t), void *ctx);
    void record_interval(int64_t start, uint64_t key, bool on_workers);
    void note_join(int64_t start, int64_t joined, int64_t done);
    void join(int64_t n);
    void work(uint64_t epoch);
    void worker_loop();
    void sleep_until_job(uint64_t seen);
    void record_error();

    std::vector<std::thread> workers_; // never joined: the pool lives until the process ends
    std::mutex caller_mu_;             // held by the caller whose job is running
    detail::PoolGovernor governor_;    // under caller_mu_, as the previous job's fields:
    int64_t last_start_ = 0;
    uint64_t last_key_ = 0;
    bool last_on_workers_ = false;
    std::atomic<int64_t> parallel_jobs_{0}, serial_jobs_{0}, switches_{0}, probes_{0};
    // The current job, written by its caller before state_ publishes it.
    void (*task_)(void *, int64_t) = nullptr;
    void *ctx_ = nullptr;
    int64_t n_ = 0;
    uint64_t epoch_ = 0;
    std::mutex error_mu_;
    std::exception_ptr error_;
    alignas(64) std::atomic<uint64_t> state_{0}; // epoch << 32 | tasks not yet claimed
    alignas(64) std::atomic<int64_t> done_{0};   // tasks of the current job finished or skipped
    std::atomic<bool> failed_{false};
    alignas(64) std::atomic<int> sleepers_{0};
    std::mutex sleep_mu_;
    std::condition_variable wake_;
};

void Pool::run(int64_t n, void (*task)(void *, int64_t), void *ctx) {
    std::unique_lock<std::mutex> caller(caller_mu_, std::defer_lock);
    if (t_in_task || !caller.try_lock()) return run_inline(n, task, ctx); // nested, or another caller's job runs
    InTask in_task;
    const bool adaptive = g_mode.load(std::memory_order_relaxed) == PoolMode::adaptive;
    const int64_t start = adaptive ? now_ns() : 0;
    const uint64_t key = adaptive ? job_key(task, ctx, n) : 0;
    const bool on_workers = adaptive ? governor_.parallel(start, key) : g_mode.load() == PoolMode::parallel;
    (on_workers ? parallel_jobs_ : serial_jobs_).fetch_add(1, std::memory_order_relaxed);
    if (on_workers) {
        publish(n, task, ctx);
        work(epoch_ & kCountMask);
        const int64_t joined = adaptive ? now_ns() : 0;
        join(n);
        if (adaptive) note_join(start, joined, now_ns());
    } else {
        run_inline(n, task, ctx); // a task's exception leaves the job untimed
    }
    if (adaptive) record_interval(start, key, on_workers);
    if (on_workers && failed_.load(std::memory_order_relaxed)) { // an inline job's exception is already out
        std::exception_ptr e;
        std::swap(e, error_); // the pool keeps no reference to the exception
        std::rethrow_exception(e);
    }
}

// A caller that waited at the join longer than it worked, and for more than kLateJoinNs, waited for a worker
// the scheduler had parked with a claimed task (at idle the wait is at most one task's tail): only then does
// the governor compare the workers with the caller alone, so an idle machine pays (almost) no probes.
void Pool::note_join(int64_t start, int64_t joined, int64_t done) {
    if (done - joined > kLateJoinNs && done - joined > joined - start) governor_.late_worker(done);
}

// Hands the governor the time from the previous job's start to this one's: the job and the caller's own work
// after it, which a worker spinning for the next job slows down when the machine has no core to spare (a
// job's time alone missed that: beside a busy loop it kept the workers at 0.8x of the caller alone).
// Intervals over kMaxIntervalNs span idle time or a long serial section and are not compared.
void Pool::record_interval(int64_t start, uint64_t key, bool on_workers) {
    if (last_start_ > 0 && start - last_start_ < kMaxIntervalNs) {
        const int64_t switches = governor_.switches_to_serial(), probes = governor_.probes();
        governor_.record(start, last_key_, last_on_workers_, start - last_start_);
        switches_.fetch_add(governor_.switches_to_serial() - switches, std::memory_order_relaxed);
        probes_.fetch_add(governor_.probes() - probes, std::memory_order_relaxed);
    }
    last_start_ = start, last_key_ = key, last_on_workers_ = on_workers;
}

void Pool::publish(int64_t n, void (*task)(void *, int64_t), void *ctx) {
    task_ = task, ctx_ = ctx, n_ = n, ++epoch_;
    done_.store(0, std::memory_order_relaxed);
    failed_.store(false, std::memory_order_relaxed);
    state_.store((epoch_ & kCountMask) << 32 | uint64_t(n), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) { // pairs with the increment in sleep_until_job
        { std::lock_guard<std::mutex> g(sleep_mu_); }
        wake_.notify_all();
    }
}

// Waits until every task of the current job has finished or been skipped.
void Pool::join(int64_t n) {
    for (int spins = 0; done_.load(std::memory_order_acquire) != n; ++spins) {
        if (spins < kCallerSpins) cpu_relax();
        else std::this_thread::yield();
    }
}

// Claims and runs tasks of job `epoch` until none is left unclaimed (or a later job is published).
void Pool::work(uint64_t epoch) {
    uint64_t s = state_.load(std::memory_order_acquire);
    while ((s >> 32) == epoch && (s & kCountMask) != 0) {
        if (!state_.compare_exchange_weak(s, s - 1, std::memory_order_acquire, std::memory_order_acquire)) continue;
        if (!failed_.load(std::memory_order_relaxed)) {
            try {
                task_(ctx_, n_ - int64_t(s & kCountMask));
            } catch (...) {
                record_error();
            }
        }
        done_.fetch_add(1, std::memory_order_release);
        s = state_.load(std::memory_order_acquire);
    }
}

void Pool::record_error() {
    std::lock_guard<std::mutex> g(error_mu_);
    if (!error_) error_ = std::current_exception();
    failed_.store(true, std::memory_order_relaxed);
}

void Pool::worker_loop() {
    t_in_task = true;
    uint64_t seen = 0; // the epoch of the last job this worker looked at
    for (;;) {
        const auto deadline = std::chrono::steady_clock::now() + kWorkerSpin;
        for (int i = 1; (state_.load(std::memory_order_acquire) >> 32) == seen; ++i) {
            cpu_relax();
            if (i % 64 == 0 && std::chrono::steady_clock::now() > deadline) {
                sleep_until_job(seen);
                break;
            }
        }
        seen = state_.load(std::memory_order_acquire) >> 32;
        work(seen);
    }
}

void Pool::sleep_until_job(uint64_t seen) {
    std::unique_lock<std::mutex> lk(sleep_mu_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    wake_.wait(lk, [&] { return (state_.load(std::memory_order_seq_cst) >> 32) != seen; });
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
}

std::atomic<Pool *> g_pool{nullptr};

Pool &pool() {
    static std::mutex create_mu;
    Pool *p = g_pool.load(std::memory_order_acquire);
    if (p) return *p;
    std::lock_guard<std::mutex> g(create_mu);
    if (!g_pool.load(std::memory_order_relaxed)) {
#ifdef __linux__
        // A forked child has none of the workers: it builds a new pool when it first needs one (the
        // old one is leaked; destroying its std::thread objects would terminate).
        static const bool registered =
            pthread_atfork(nullptr, nullptr, [] { g_pool.store(nullptr, std::memory_order_relaxed); }) == 0;
        (void)registered;
#endif
        g_pool.store(new Pool(cpu_threads()), std::memory_order_release);
    }
    return *g_pool.load(std::memory_order_relaxed);
}

} // namespace

int cpu_threads() {
    static const int threads = threads_from_environment();
    return threads;
}

void set_pool_mode(PoolMode mode, bool restart) {
    g_mode.store(mode, std::memory_order_relaxed);
    if (restart && cpu_threads() > 1) pool().restart_governor();
}

PoolStats pool_stats() { return cpu_threads() > 1 ? pool().stats() : PoolStats{}; }

void parallel_tasks(int64_t n, void (*task)(void *ctx, int64_t i), void *ctx) {
    if (n <= 0) return;
    if (uint64_t(n) > 0xffffffffu)
        throw std::invalid_argument("parallel_tasks: " + std::to_string(n) + " tasks (at most 2^32 - 1)");
    if (n == 1 || cpu_threads() == 1) return run_inline(n, task, ctx);
    pool().run(n, task, ctx);
}

} // namespace llaisys
