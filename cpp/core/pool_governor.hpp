// Whether the thread pool's workers pay off: the choice behind parallel_tasks' switch between the whole pool
// and the calling thread alone (thread_pool.cpp), free of clocks and threads so that tests can feed it
// timings.
//
// Why: with more runnable threads than cores (a busy process, a second engine), a worker that has claimed
// a task and is then descheduled holds the caller at the join for a scheduler slice, milliseconds against
// jobs of ~100 us: 2-thread decode beside one busy loop ran at 0.87x of one thread. No estimate made from
// parallel jobs alone predicted the caller-alone time on a loaded machine (its wall time counts its own
// descheduling once per task, its CPU time not at all), so the governor measures both: the mode that won
// last (the winner) runs, and a probe window now and then runs the other mode (when, below). Jobs repeat (a decode
// step runs the same ops every layer and every token), so each probe job is compared with the winner's
// recent time for the same job: its task function and task count. The probe takes over only when it wins by
// kWinPercent; a probe that loses doubles the back-off, so the winner keeps the machine nearly all the time.
// A probe costs the jobs it runs in the slower mode (at idle, a 128-token prefill lost 6-27% to them), so
// while the workers win nothing but the sign of contention itself starts a probe of the caller alone: a
// worker late at the join (late_worker). While the caller alone wins, the workers are probed after the
// back-off (1-8 s), to see the contender leave. A probe takes only short jobs.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

namespace llaisys::detail {

class PoolGovernor {
  public:
    static constexpr int kProbeJobs = 128;                // compared jobs per probe: ~a 0.5B decode step
    static constexpr int kProbeMaxJobs = 4 * kProbeJobs;  // a probe ends here even if few jobs compared
    static constexpr int64_t kMinBackoffNs = 1'000'000'000;  // while the caller alone wins: ~60 decode steps
    static constexpr int64_t kMaxBackoffNs = 8'000'000'000; // a losing probe (~7 ms lost when idle) costs < 0.1%
    static constexpr int64_t kWinPercent = 95;            // the probe must take < 95% of the winner's time
    static constexpr int64_t kProbeJobMaxNs = 500'000;    // longer jobs run in the winner's mode, even in a probe
    static constexpr int64_t kMinTriggerGapNs = 250'000'000; // between probes that late workers start
    static constexpr int64_t kNever = INT64_MAX;

    // Whether the job `key` starting at now_ns should run on the workers. A probe takes only jobs the winner
    // ran in at most kProbeJobMaxNs: a prefill's jobs of milliseconds would otherwise spend a whole probe
    // window in the slower mode (measured: 128-token prefill at idle 233 -> 171 tok/s), and decode's jobs
    // are what the comparison is for.
    bool parallel(int64_t now_ns, uint64_t key) {
        if (next_probe_ < 0) next_probe_ = kNever; // the workers start as the winner
        if (!probing_ && now_ns >= next_probe_) {
            probing_ = true;
            probe_sum_ = winner_sum_ = 0;
            probe_jobs_ = compared_ = 0;
        }
        if (!probing_) return winner_parallel_;
        const Slot &s = slot(key);
        const int64_t t = s.key == key ? s.last[winner_parallel_] : 0;
        return (t > 0 && t <= kProbeJobMaxNs) != winner_parallel_;
    }

    // Records a job that ended at now_ns after wall_ns, on the workers or not; key names the job (its task
    // function and task count: two jobs with one key do the same work).
    void record(int64_t now_ns, uint64_t key, bool on_workers, int64_t wall_ns) {
        Slot &s = slot(key);
        if (s.key != key) s = Slot{key, {0, 0}};
        const bool probe = probing_ && on_workers != winner_parallel_;
        if (probe && s.last[winner_parallel_] > 0) {
            probe_sum_ += wall_ns;
            winner_sum_ += s.last[winner_parallel_];
            ++compared_;
        }
        // The last time, not an average: a job that runs once a token (the LM head) would keep an average
        // of its first, page-faulting runs for dozens of tokens and alone decide every probe.
        s.last[on_workers] = std::max<int64_t>(wall_ns, 1);
        if (probe && (compared_ >= kProbeJobs || ++probe_jobs_ >= kProbeMaxJobs)) end_probe(now_ns);
    }

    // The pool saw a worker arrive late (thread_pool.cpp: note_join) at now_ns: while the workers are the
    // winner, probe the caller alone at the next job rather than after the back-off, at most once per
    // kMinTriggerGapNs (a false alarm costs one probe).
    void late_worker(int64_t now_ns) {
        if (!winner_parallel_ || probing_ || now_ns - last_trigger_ < kMinTriggerGapNs) return;
        last_trigger_ = now_ns;
        next_probe_ = now_ns;
    }

    bool winner_parallel() const { return winner_parallel_; }
    int64_t backoff_ns() const { return backoff_; }
    int64_t switches_to_serial() const { return switches_; }

  private:
    void end_probe(int64_t now_ns) {
        probing_ = false;
        if (compared_ >= kProbeJobs && probe_sum_ * 100 < winner_sum_ * kWinPercent) {
            winner_parallel_ = !winner_parallel_;
            switches_ += !winner_parallel_;
            backoff_ = kMinBackoffNs;
        } else {
            backoff_ = std::min(2 * backoff_, kMaxBackoffNs);
        }
        next_probe_ = winner_parallel_ ? kNever : now_ns + backoff_;
    }

    struct Slot {
        uint64_t key;
        int64_t last[2]; // last wall time of this job on the caller alone / on the workers; 0: none yet
    };
    Slot &slot(uint64_t key) { return slots_[size_t((key * 0x9E3779B97F4A7C15ull) >> 56)]; }
    std::array<Slot, 256> slots_{};
    bool winner_parallel_ = true, probing_ = false;
    int64_t next_probe_ = -1, backoff_ = kMinBackoffNs, last_trigger_ = INT64_MIN / 2;
    int64_t probe_sum_ = 0, winner_sum_ = 0; // over the probe's compared jobs
    int probe_jobs_ = 0, compared_ = 0;
    int64_t switches_ = 0;
};

} // namespace llaisys::detail
