// The pool's choice between the workers and the caller alone, fed simulated timings: it keeps the faster
// mode, probes the other one rarely, and follows a change of conditions within its longest back-off.
#include "core/pool_governor.hpp"

#include <gtest/gtest.h>

using llaisys::detail::PoolGovernor;

namespace {

// A caller that runs a decode-like cycle of 10 distinct jobs back to back on simulated time.
struct Sim {
    PoolGovernor g;
    int64_t now = 0, parallel_time = 0, serial_time = 0;

    // Runs jobs for `duration` ns; a job takes parallel_ns on the workers and serial_ns on the caller alone.
    void run(int64_t duration, int64_t parallel_ns, int64_t serial_ns) {
        parallel_time = serial_time = 0;
        for (const int64_t end = now + duration; now < end;)
            for (uint64_t key = 1; key <= 10; ++key) {
                const bool p = g.parallel(now, key);
                const int64_t wall = (p ? parallel_ns : serial_ns) * int64_t(key) / 5; // jobs of different sizes
                now += wall;
                if (p && parallel_ns > serial_ns) g.late_worker(now); // contention shows as late workers
                g.record(now, key, p, wall);
                (p ? parallel_time : serial_time) += wall;
            }
    }
    double serial_share() const { return double(serial_time) / double(serial_time + parallel_time); }
};

constexpr int64_t kUs = 1000, kSecond = 1'000'000'000;

} // namespace

TEST(PoolGovernor, KeepsTheWorkersAndNeverProbesWhileNoWorkerIsLate) {
    Sim s;
    s.run(3 * PoolGovernor::kMaxBackoffNs, 60 * kUs, 100 * kUs); // idle machine: parallel 1.67x faster
    EXPECT_TRUE(s.g.winner_parallel());
    EXPECT_EQ(s.g.switches_to_serial(), 0);
    EXPECT_EQ(s.serial_share(), 0.0); // an idle machine pays no probe at all
}

TEST(PoolGovernor, RunsOnTheCallerAloneWhileWorkersArriveLate) {
    Sim s;
    s.run(3 * kSecond, 120 * kUs, 100 * kUs); // a busy machine: parallel 1.2x slower
    s.run(2 * PoolGovernor::kMaxBackoffNs, 120 * kUs, 100 * kUs);
    EXPECT_FALSE(s.g.winner_parallel());
    EXPECT_EQ(s.g.switches_to_serial(), 1);
    EXPECT_EQ(s.g.backoff_ns(), PoolGovernor::kMaxBackoffNs);
    EXPECT_GT(s.serial_share(), 0.97);
}

TEST(PoolGovernor, FollowsTheMachineBackAndForth) {
    Sim s;
    s.run(3 * kSecond, 120 * kUs, 100 * kUs);
    ASSERT_FALSE(s.g.winner_parallel());
    s.run(PoolGovernor::kMaxBackoffNs + kSecond / 10, 60 * kUs, 100 * kUs); // the contender left
    EXPECT_TRUE(s.g.winner_parallel());
    s.run(PoolGovernor::kMaxBackoffNs + kSecond / 10, 120 * kUs, 100 * kUs); // it came back
    EXPECT_FALSE(s.g.winner_parallel());
    EXPECT_EQ(s.g.switches_to_serial(), 2);
}

TEST(PoolGovernor, NeedsAClearWinToSwitch) {
    Sim s;
    s.run(3 * kSecond, 100 * kUs, 97 * kUs); // the caller alone 3% faster: inside the margin
    s.run(5 * kSecond, 100 * kUs, 97 * kUs);
    EXPECT_TRUE(s.g.winner_parallel());
    EXPECT_EQ(s.g.switches_to_serial(), 0);
    EXPECT_EQ(s.g.backoff_ns(), PoolGovernor::kMaxBackoffNs);
}

TEST(PoolGovernor, AProbeLeavesLongJobsInTheWinnersMode) {
    // prefill-like jobs of 2 ms (parallel) / 3.6 ms (alone) beside decode-like ones of 60 / 100 us: over
    // seconds of probes the long jobs never run alone, and the short ones still get probed
    PoolGovernor g;
    int64_t now = 0, long_alone = 0, short_alone = 0;
    for (int i = 0; i < 20000; ++i) {
        const uint64_t key = i % 2 ? 1 : 2;
        if (i % 1000 == 999) g.late_worker(now); // false alarms start probes
        const bool p = g.parallel(now, key);
        const int64_t wall = key == 1 ? (p ? 2000 : 3600) * kUs : (p ? 60 : 100) * kUs;
        now += wall;
        g.record(now, key, p, wall);
        (key == 1 ? long_alone : short_alone) += !p;
    }
    EXPECT_EQ(long_alone, 0);
    EXPECT_GT(short_alone, 0);
    EXPECT_TRUE(g.winner_parallel());
}

TEST(PoolGovernor, ALateWorkerStartsAProbeAtOnceButNotTooOften) {
    Sim s;
    s.run(2 * PoolGovernor::kMaxBackoffNs, 60 * kUs, 100 * kUs); // idle: the workers win, nothing probes
    ASSERT_TRUE(s.g.winner_parallel());
    s.run(kSecond / 2, 120 * kUs, 100 * kUs); // contention: workers come late, the caller alone is faster
    EXPECT_FALSE(s.g.winner_parallel());      // switched within half a second
    EXPECT_EQ(s.g.switches_to_serial(), 1);

    PoolGovernor g; // a stream of false alarms at idle: at most one probe per kMinTriggerGapNs
    int64_t now = 0, alone = 0, jobs = 0;
    for (; now < 2 * kSecond; ++jobs) {
        g.late_worker(now);
        const bool p = g.parallel(now, 1);
        const int64_t wall = (p ? 60 : 100) * kUs;
        now += wall;
        g.record(now, 1, p, wall);
        alone += !p;
    }
    EXPECT_TRUE(g.winner_parallel());
    EXPECT_LE(alone, (2 * kSecond / PoolGovernor::kMinTriggerGapNs + 1) * PoolGovernor::kProbeJobs);
}
