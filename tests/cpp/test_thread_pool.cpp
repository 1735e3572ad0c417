// The CPU thread pool: every task runs exactly once, errors reach the caller, nested and concurrent
// calls are safe, and no task waits for a thread that is busy elsewhere.
#include "llaisys/thread_pool.hpp"

#include <gtest/gtest.h>

#include <atomic>
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
    constexpr int64_t n = 64;
    std::atomic<int64_t> finished{0};
    parallel_tasks(n, [&](int64_t i) {
        if (i == 0)
            while (finished.load() != n - 1) std::this_thread::yield();
        finished.fetch_add(1);
    });
    EXPECT_EQ(finished.load(), n);
}
