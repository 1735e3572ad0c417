// The CPU thread pool: every task runs exactly once, errors reach the caller, nested and concurrent
// calls are safe, and no task waits for a thread that is busy elsewhere.
#include "llaisys/thread_pool.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

using namespace llaisys;

// Four threads even on a one-core machine, so the worker paths always run (and oversubscribed, as on a
// busy machine). Set before main, that is before the pool reads it; an explicit setting wins.
static const bool kThreadsSet = setenv("LLAISYS_NUM_THREADS", "4", /*overwrite=*/0) == 0;

// Runs parallel_tasks over n tasks and returns how many times each index ran.
static std::vector<int> run_counts(int64_t n) {
    std::unique_ptr<std::atomic<int>[]> counts(new std::atomic<int>[size_t(n)]());
    parallel_tasks(n, [&](int64_t i) { counts[size_t(i)].fetch_add(1, std::memory_order_relaxed); });
    std::vector<int> out(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out[size_t(i)] = counts[size_t(i)].load();
    return out;
}

TEST(ThreadPool, ThreadsDefaultToTheEnvironmentOrTheCores) {
    ASSERT_TRUE(kThreadsSet);
    EXPECT_EQ(cpu_threads(), std::atoi(std::getenv("LLAISYS_NUM_THREADS")));
}

TEST(ThreadPool, EveryIndexRunsExactlyOnce) {
    for (int64_t n : {0, 1, 2, 3, 7, 19, 111, 989, 100000}) {
        const std::vector<int> counts = run_counts(n);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(counts[size_t(i)], 1) << "n=" << n << " i=" << i;
    }
    for (int round = 0; round < 2000; ++round) { // back-to-back jobs: a late worker must not run a stale one
        const std::vector<int> counts = run_counts(1 + round % 13);
        for (size_t i = 0; i < counts.size(); ++i) ASSERT_EQ(counts[i], 1) << "round " << round;
    }
}

TEST(ThreadPool, ExceptionReachesTheCallerAndThePoolStaysUsable) {
    for (int round = 0; round < 20; ++round) {
        EXPECT_THROW(parallel_tasks(1000, [](int64_t i) {
                         if (i >= 500) throw std::runtime_error("task failed");
                     }),
                     std::runtime_error);
        const std::vector<int> counts = run_counts(1000);
        for (int c : counts) ASSERT_EQ(c, 1);
    }
    EXPECT_THROW(parallel_tasks(int64_t(1) << 33, [](int64_t) {}), std::invalid_argument);
}

TEST(ThreadPool, NestedCallsRunInline) {
    std::atomic<int64_t> sum{0};
    parallel_tasks(16, [&](int64_t i) {
        parallel_tasks(100, [&](int64_t j) { sum.fetch_add(i * 100 + j, std::memory_order_relaxed); });
    });
    EXPECT_EQ(sum.load(), 1600 * 1599 / 2);
}

TEST(ThreadPool, ConcurrentCallersEachGetTheirOwnResults) {
    constexpr int kCallers = 8, kRounds = 300;
    std::atomic<int> failures{0};
    std::vector<std::thread> callers;
    for (int c = 0; c < kCallers; ++c)
        callers.emplace_back([&, c] {
            for (int r = 0; r < kRounds; ++r) {
                const int64_t n = 1 + (c * 31 + r) % 97;
                std::atomic<int64_t> sum{0};
                parallel_tasks(n, [&](int64_t i) { sum.fetch_add(i + c, std::memory_order_relaxed); });
                if (sum.load() != n * (n - 1) / 2 + n * c) failures.fetch_add(1);
            }
        });
    for (auto &t : callers) t.join();
    EXPECT_EQ(failures.load(), 0);
}

// Task 0 waits until every other task has finished: only possible if the threads not holding task 0
// (the caller included) claim all the rest, however the tasks are first handed out.
TEST(ThreadPool, OtherThreadsFinishTheTasksOfAStalledOne) {
    ASSERT_GE(cpu_threads(), 2);
    set_pool_mode(PoolMode::parallel); // on the caller alone task 0 would wait forever
    constexpr int64_t n = 64;
    std::atomic<int64_t> finished{0};
    parallel_tasks(n, [&](int64_t i) {
        if (i == 0)
            while (finished.load() != n - 1) std::this_thread::yield();
        finished.fetch_add(1);
    });
    EXPECT_EQ(finished.load(), n);
    set_pool_mode(PoolMode::adaptive);
}

// Runs a job of n tasks and returns the ids of the threads that ran them. With `stall`, task 0 waits (up to
// 10 s) for every other task to finish, which only another thread can do: a job handed to the workers shows
// two threads even on a busy machine.
static std::vector<std::thread::id> task_threads(int64_t n, bool stall) {
    std::vector<std::thread::id> ids(static_cast<size_t>(n));
    std::atomic<int64_t> finished{0};
    parallel_tasks(n, [&](int64_t i) {
        ids[size_t(i)] = std::this_thread::get_id();
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (stall && i == 0 && finished.load() != n - 1 && std::chrono::steady_clock::now() < deadline)
            std::this_thread::yield();
        finished.fetch_add(1);
    });
    return ids;
}

static size_t distinct(std::vector<std::thread::id> ids) {
    std::sort(ids.begin(), ids.end());
    return size_t(std::unique(ids.begin(), ids.end()) - ids.begin());
}

TEST(ThreadPool, AdaptivePoolStartsOnTheWorkers) {
    ASSERT_GE(cpu_threads(), 2);
    set_pool_mode(PoolMode::adaptive); // restarts the choice: the first job goes to the workers
    const PoolStats before = pool_stats();
    EXPECT_GE(distinct(task_threads(64, true)), 2u);
    EXPECT_EQ(pool_stats().parallel_jobs, before.parallel_jobs + 1);
}

TEST(ThreadPool, SerialModeRunsEveryTaskOnTheCallerAndStillThrows) {
    set_pool_mode(PoolMode::serial);
    const std::vector<std::thread::id> ids = task_threads(64, false);
    EXPECT_EQ(distinct(ids), 1u);
    EXPECT_EQ(ids[0], std::this_thread::get_id());
    EXPECT_THROW(parallel_tasks(100, [](int64_t i) {
                     if (i == 50) throw std::runtime_error("task failed");
                 }),
                 std::runtime_error);
    const std::vector<int> counts = run_counts(1000); // usable after the throw
    for (int c : counts) ASSERT_EQ(c, 1);
    set_pool_mode(PoolMode::adaptive);
}

// A job on the workers that threw leaves nothing behind for the next jobs, on the caller alone or not.
TEST(ThreadPool, AFailedJobDoesNotFailTheNextInAnyMode) {
    for (PoolMode next : {PoolMode::serial, PoolMode::parallel}) {
        set_pool_mode(PoolMode::parallel);
        EXPECT_THROW(parallel_tasks(64, [](int64_t) { throw std::runtime_error("task failed"); }), std::runtime_error);
        set_pool_mode(next);
        EXPECT_NO_THROW(parallel_tasks(64, [](int64_t) {}));
    }
    set_pool_mode(PoolMode::adaptive);
}

// The tests above in every mode: the adaptive one flips between the other two on this shared machine.
TEST(ThreadPool, EveryModeRunsEveryIndexOnceAndPropagatesErrors) {
    for (PoolMode mode : {PoolMode::serial, PoolMode::parallel, PoolMode::adaptive}) {
        set_pool_mode(mode);
        for (int round = 0; round < 500; ++round) {
            const std::vector<int> counts = run_counts(1 + round % 37);
            for (int c : counts) ASSERT_EQ(c, 1) << "round " << round;
        }
        EXPECT_THROW(parallel_tasks(64, [](int64_t i) {
                         if (i % 7 == 3) throw std::runtime_error("task failed");
                     }),
                     std::runtime_error);
    }
    set_pool_mode(PoolMode::adaptive);
}

#ifdef __linux__
#include <sys/wait.h>
#include <unistd.h>

// A forked child has none of its parent's workers: it builds a pool of its own, in whatever mode was set.
TEST(ThreadPool, ForkedChildRunsJobsOnItsOwnWorkers) {
    ASSERT_GE(cpu_threads(), 2);
    set_pool_mode(PoolMode::parallel);
    ASSERT_EQ(run_counts(100), std::vector<int>(100, 1)); // the parent's pool exists before the fork
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        const bool ok = distinct(task_threads(64, true)) >= 2 && run_counts(1000) == std::vector<int>(1000, 1);
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    set_pool_mode(PoolMode::adaptive);
}
#endif
