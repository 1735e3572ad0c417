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
                const bool p = g.parallel(now);
                const int64_t wall = (p ? parallel_ns : serial_ns) * int64_t(key) / 5; // jobs of different sizes
                now += wall;
                g.record(now, key, p, wall);
                (p ? parallel_time : serial_time) += wall;
            }
    }
    double serial_share() const { return double(serial_time) / double(serial_time + parallel_time); }
};

constexpr int64_t kUs = 1000, kSecond = 1'000'000'000;

} // namespace

TEST(PoolGovernor, KeepsTheWorkersWhenTheyPayOffAndBacksItsProbesOff) {
    Sim s;
    s.run(3 * kSecond, 60 * kUs, 100 * kUs); // idle machine: parallel 1.67x faster
    s.run(5 * kSecond, 60 * kUs, 100 * kUs); // once the back-off is longest
    EXPECT_TRUE(s.g.winner_parallel());
    EXPECT_EQ(s.g.switches_to_serial(), 0);
    EXPECT_EQ(s.g.backoff_ns(), PoolGovernor::kMaxBackoffNs);
    EXPECT_LT(s.serial_share(), 0.03); // a probe of ~130 jobs on the caller alone a second is all it costs
}

TEST(PoolGovernor, RunsOnTheCallerAloneWhileWorkersArriveLate) {
    Sim s;
    s.run(3 * kSecond, 120 * kUs, 100 * kUs); // a busy machine: parallel 1.2x slower
    s.run(5 * kSecond, 120 * kUs, 100 * kUs);
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
