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

    int64_t slice_every = 0, slice_ns = 0; // a scheduler slice lost by whichever job runs every slice_every ns

    // Runs jobs for `duration` ns; a job takes parallel_ns on the workers and serial_ns on the caller alone.
    void run(int64_t duration, int64_t parallel_ns, int64_t serial_ns) {
        parallel_time = serial_time = 0;
        for (const int64_t end = now + duration; now < end;)
            for (uint64_t key = 1; key <= 10; ++key) {
                const bool p = g.parallel(now, key);
                int64_t wall = (p ? parallel_ns : serial_ns) * int64_t(key) / 5; // jobs of different sizes
                if (slice_every > 0 && (now + wall) / slice_every != now / slice_every) wall += slice_ns;
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
    EXPECT_GT(s.serial_share(), 0.995); // the probes of the workers end once they lose
}

TEST(PoolGovernor, FollowsTheMachineBackAndForth) {
    Sim s;
    s.run(3 * kSecond, 120 * kUs, 100 * kUs);
    ASSERT_FALSE(s.g.winner_parallel());
    s.run(PoolGovernor::kMaxBackoffNs + kSecond / 2, 60 * kUs, 100 * kUs); // the contender left
    EXPECT_TRUE(s.g.winner_parallel());
    s.run(kSecond, 120 * kUs, 100 * kUs); // it came back
    EXPECT_FALSE(s.g.winner_parallel());
    EXPECT_EQ(s.g.switches_to_serial(), 2);
}

TEST(PoolGovernor, NeedsAClearWinToSwitch) {
    Sim s;
    s.run(3 * kSecond, 100 * kUs, 97 * kUs); // the caller alone 3% faster: inside the margin
    s.run(10 * kSecond, 100 * kUs, 97 * kUs);
    EXPECT_TRUE(s.g.winner_parallel());
    EXPECT_EQ(s.g.switches_to_serial(), 0);
    EXPECT_EQ(s.g.backoff_ns(), PoolGovernor::kMaxBackoffNs);
}

TEST(PoolGovernor, TheWorkersMustWinByMoreToComeBack) {
    Sim s;
    s.run(3 * kSecond, 120 * kUs, 100 * kUs);
    ASSERT_FALSE(s.g.winner_parallel());
    s.run(3 * PoolGovernor::kMaxBackoffNs, 90 * kUs, 100 * kUs); // the workers 1.11x faster: not enough
    EXPECT_FALSE(s.g.winner_parallel());
    s.run(PoolGovernor::kMaxBackoffNs + kSecond, 80 * kUs, 100 * kUs); // 1.25x faster: back to the workers
    EXPECT_TRUE(s.g.winner_parallel());
}

TEST(PoolGovernor, AProbeLeavesLongJobsInTheWinnersMode) {
    // prefill-like jobs of 2 ms (parallel) / 3.6 ms (alone) beside short ones of 60 / 70 us (alone a little
    // slower: not so much that the probe ends as losing): over seconds of probes the long jobs never run
    // alone, and the short ones still get probed
    PoolGovernor g;
    int64_t now = 0, long_alone = 0, short_alone = 0;
    for (int i = 0; i < 20000; ++i) {
        const uint64_t key = i % 2 ? 1 : 2;
        if (i % 1000 == 999) g.late_worker(now); // false alarms start probes
        const bool p = g.parallel(now, key);
        const int64_t wall = key == 1 ? (p ? 2000 : 3600) * kUs : (p ? 60 : 70) * kUs;
        now += wall;
        g.record(now, key, p, wall);
        (key == 1 ? long_alone : short_alone) += !p;
    }
    EXPECT_EQ(long_alone, 0);
    EXPECT_GT(short_alone, 0);
    // a probe ends after a window of all jobs' time (measured: counting its own jobs alone, a probe took
    // 20% of a 128-token prefill's jobs, at 0.96x)
    EXPECT_LE(short_alone, g.probes() * PoolGovernor::kMinJobs);
    EXPECT_TRUE(g.winner_parallel());
}

TEST(PoolGovernor, ALateWorkerStartsAProbeAtOnceButNotTooOften) {
    Sim s;
    s.run(2 * PoolGovernor::kMaxBackoffNs, 60 * kUs, 100 * kUs); // idle: the workers win, nothing probes
    ASSERT_TRUE(s.g.winner_parallel());
    s.run(kSecond / 2, 120 * kUs, 100 * kUs); // contention: workers come late, the caller alone is faster
    EXPECT_FALSE(s.g.winner_parallel());      // switched within half a second
    EXPECT_EQ(s.g.switches_to_serial(), 1);

    PoolGovernor g; // a stream of false alarms at idle: one probe per back-off, which doubles
    int64_t now = 0, alone_ns = 0;
    while (now < 2 * kSecond) {
        g.late_worker(now);
        const bool p = g.parallel(now, 1);
        const int64_t wall = (p ? 60 : 100) * kUs;
        now += wall;
        g.record(now, 1, p, wall);
        alone_ns += p ? 0 : wall;
    }
    EXPECT_TRUE(g.winner_parallel());
    EXPECT_LE(g.probes(), 3); // at about 0.1, 0.6 and 1.6 s: back-offs of 0.5 and 1 s after each
    EXPECT_LE(alone_ns, g.probes() * (PoolGovernor::kMinJobs + 1) * 100 * kUs); // each ended once it was losing
}

TEST(PoolGovernor, AContenderAfterALongIdleTimeIsSeenWithinASecond) {
    Sim s;
    for (int i = 0; i < 200; ++i) { // 20 s idle, a false alarm every 0.1 s: the back-off grows to its longest
        s.run(kSecond / 10, 60 * kUs, 100 * kUs);
        s.g.late_worker(s.now);
    }
    ASSERT_EQ(s.g.backoff_ns(), PoolGovernor::kMaxBackoffNs);
    s.run(3 * kSecond / 2, 120 * kUs, 100 * kUs);
    EXPECT_FALSE(s.g.winner_parallel());
}

TEST(PoolGovernor, TheMeanOfTwoComparisonsDecides) {
    // the caller alone takes 0.90 of the workers' time in the first comparison and 0.97 in the second (only
    // the first wins alone): their mean, 0.935, switches
    PoolGovernor g;
    int64_t now = 0;
    g.late_worker(now);
    while (now < 600'000 * kUs) { // before the back-off's probe of the workers
        const uint64_t key = 1 + now % 7;
        const bool p = g.parallel(now, key);
        const int64_t wall = (p ? 100 : now < 250'000 * kUs ? 90 : 97) * kUs;
        now += wall;
        g.record(now, key, p, wall);
    }
    EXPECT_EQ(g.probes(), 2);
    EXPECT_FALSE(g.winner_parallel());
}

TEST(PoolGovernor, OneLuckyWindowDoesNotSwitch) {
    // idle; for the first 250 ms the caller alone is faster (a contender paused), and a late worker starts a
    // comparison at once: its probe wins, the confirming one (after 250 ms) loses, and the workers stay
    PoolGovernor g;
    int64_t now = 0;
    g.late_worker(now);
    while (now < 2 * kSecond) {
        const uint64_t key = 1 + now % 7;
        const bool p = g.parallel(now, key);
        const int64_t wall = (p ? 60 : now < 250'000 * kUs ? 40 : 100) * kUs;
        now += wall;
        g.record(now, key, p, wall);
    }
    EXPECT_EQ(g.probes(), 2);
    EXPECT_TRUE(g.winner_parallel());
    EXPECT_EQ(g.switches_to_serial(), 0);
}

TEST(PoolGovernor, AJobsFirstRunDoesNotCount) {
    // at start-up every job's first run page-faults (20 ms) and workers come late: the comparison that the
    // late workers start must not see the caller alone win against those first runs
    PoolGovernor g;
    int64_t now = 0;
    for (int i = 0; i < 100000; ++i) {
        const uint64_t key = 1 + i % 10;
        const bool p = g.parallel(now, key);
        const int64_t wall = i < 10 ? 20'000 * kUs : (p ? 60 : 100) * kUs;
        now += wall;
        if (i < 10) g.late_worker(now);
        g.record(now, key, p, wall);
    }
    EXPECT_GT(g.probes(), 0);
    EXPECT_TRUE(g.winner_parallel());
    EXPECT_EQ(g.switches_to_serial(), 0);
}

TEST(PoolGovernor, AProbeOfTheWorkersTakesLongJobsToo) {
    // while the caller alone wins, a long job (2 ms alone) runs on the workers during probes, and the
    // comparison sees the contender leave through the short and the long jobs alike
    Sim s;
    s.run(3 * kSecond, 120 * kUs, 100 * kUs);
    ASSERT_FALSE(s.g.winner_parallel());
    int64_t long_on_workers = 0;
    for (int i = 0; i < 2000; ++i) { // beside the contender: short and long jobs
        const uint64_t key = i % 2 ? 100 : 101;
        const bool p = s.g.parallel(s.now, key);
        const int64_t wall = key == 100 ? (p ? 2400 : 2000) * kUs : (p ? 120 : 100) * kUs;
        s.now += wall;
        s.g.record(s.now, key, p, wall);
        long_on_workers += p && key == 100;
    }
    EXPECT_GT(long_on_workers, 0);
    EXPECT_FALSE(s.g.winner_parallel());
}

TEST(PoolGovernor, ASchedulerSliceInAWindowDoesNotDecide) {
    // beside a busy process the caller alone is 1.2x faster, and every 12 ms the running job, in either
    // mode, loses a 4 ms slice: windows of one decode step would be decided by where the slices fell
    Sim s;
    s.slice_every = 12'000 * kUs, s.slice_ns = 4'000 * kUs;
    s.run(3 * kSecond, 120 * kUs, 100 * kUs);
    s.run(4 * PoolGovernor::kMaxBackoffNs, 120 * kUs, 100 * kUs);
    EXPECT_FALSE(s.g.winner_parallel());
    EXPECT_EQ(s.g.switches_to_serial(), 1);
    EXPECT_GT(s.serial_share(), 0.97);
}
