// Whether the thread pool's workers pay off: the choice behind parallel_tasks' switch between the whole pool
// and the calling thread alone (thread_pool.cpp), free of clocks and threads so that tests can feed it
// timings.
//
// Why: with more runnable threads than cores (a busy process, a second engine), a worker that has claimed
// a task and is then descheduled holds the caller at the join for a scheduler slice, milliseconds against
// jobs of ~100 us: 2-thread decode beside one busy loop ran at 0.87x of one thread. No estimate made from
// parallel jobs alone predicted the caller-alone time on a loaded machine (its wall time counts its own
// descheduling once per task, its CPU time not at all), so the governor measures both: the mode that won
// last (the winner) runs, and now and then (when, below) a comparison runs a reference window in the
// winner's mode and right after it a probe window in the other mode. Jobs repeat (a decode step runs the
// same ops every layer and every token), so the probe's mean time per job (task function, closure, task
// count) stands in for what the reference window's jobs would have taken in the probe's mode. The probe
// takes over only when that is below kWinPercent of the reference, in the mean of that comparison and a
// second one right after it; a probe that loses doubles the back-off,
// so the winner keeps the machine nearly all the time.
//
// Each window times at least kWindowNs of jobs: the scheduler hands out slices of milliseconds, so windows of
// one decode step (~15 ms, the first version, compared with the winner's last time of each job) were decided by
// where a slice fell: beside a busy loop they picked the workers as often as the caller alone, at 0.92x of it.
// A probe costs the jobs it runs in the slower mode, so while the workers win nothing but the sign of
// contention itself starts a comparison: a worker late at the join (late_worker). While the caller alone
// wins, the workers are probed after the back-off, to see the contender leave. Back-offs run 0.25-8 s.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

namespace llaisys::detail {

class PoolGovernor {
  public:
    static constexpr int64_t kWindowNs = 100'000'000;      // timed jobs per window: several scheduler periods
    static constexpr int kMinJobs = 128;                    // and at least this many jobs: ~a 0.5B decode step
    static constexpr int64_t kMaxProbeNs = 2 * kWindowNs;   // a probe that compared too few jobs by then loses
    static constexpr int64_t kMinBackoffNs = 250'000'000;
    static constexpr int64_t kMaxBackoffNs = 8'000'000'000; // probes of the workers while the caller alone wins
    static constexpr int64_t kMaxTriggerGapNs = 1'000'000'000; // the longest back-off of late workers' comparisons
    // The probe must take below this share of the reference's time. The workers must win by more: beside a
    // second engine on its caller alone, our workers took its core's share (measured: 1.05x for us) until it
    // went back to its own workers and both lost to late workers (0.9x): a selfish win that only invites that.
    static constexpr int64_t kWinPercent = 95, kWorkersWinPercent = 85;
    static constexpr int64_t kProbeJobMaxNs = 500'000;      // longer jobs stay on the workers in a probe
    static constexpr int64_t kNever = INT64_MAX;

    // Whether the job `key` starting at now_ns should run on the workers. A probe of the caller alone takes
    // only jobs the workers last ran in at most kProbeJobMaxNs: a prefill's jobs of milliseconds would
    // otherwise spend the probe in the slower mode (measured: 128-token prefill at idle 233 -> 171 tok/s), and
    // decode's jobs are what the comparison is for. A probe of the workers takes every job: workers left idle
    // through a long job on the caller go to sleep, and waking them slowed the short jobs after it (measured
    // at idle: such probes lost, 8.5 against 7.3 ms, and kept the caller alone at 0.7x of the workers).
    bool parallel(int64_t now_ns, uint64_t key) {
        if (phase_ == Phase::steady && now_ns >= next_probe_) start(Phase::reference);
        if (phase_ != Phase::probe) return winner_parallel_;
        if (!winner_parallel_) return true;
        const Slot &s = slot(key);
        const int64_t t = s.key == key ? s.last_on_workers : 0;
        return !(t > 0 && t <= kProbeJobMaxNs);
    }

    // Records a job that ended at now_ns after wall_ns, on the workers or not; key names the job (two jobs
    // with one key do the same work).
    void record(int64_t now_ns, uint64_t key, bool on_workers, int64_t wall_ns) {
        Slot &s = slot(key);
        if (s.key != key) s = Slot{key};
        const bool first = !s.seen; // a job's first run pays its page faults: not a measure of the mode
        s.seen = true;
        if (on_workers) s.last_on_workers = wall_ns;
        if (phase_ == Phase::steady || first) return;
        if (phase_ == Phase::reference) {
            s.ref_ns += wall_ns, ++s.ref_jobs;
            window_ns_ += wall_ns, ++window_jobs_;
            if (window_ns_ >= kWindowNs && window_jobs_ >= kMinJobs) start(Phase::probe);
            return;
        }
        window_ns_ += wall_ns; // every job: a prefill's long jobs, left on the workers, end the probe in time
        if (on_workers == winner_parallel_) return;
        s.probe_ns += wall_ns, ++s.probe_jobs;
        if (s.ref_jobs > 0) {
            ++compared_;
            compared_ns_ += wall_ns, compared_ref_ns_ += s.ref_ns / s.ref_jobs;
        }
        if ((window_ns_ >= kWindowNs && compared_ >= kMinJobs) || window_ns_ >= kMaxProbeNs || losing())
            end_probe(now_ns);
    }

    // The pool saw a worker arrive late (thread_pool.cpp: note_join) at now_ns: while the workers are the
    // winner, compare with the caller alone at the next job, unless the last comparison ended less than a
    // back-off ago, at most kMaxTriggerGapNs: false alarms at idle cost one probe (~5 ms lost: losing())
    // a second, and a contender that comes after a long idle time is seen within a second.
    void late_worker(int64_t now_ns) {
        const int64_t gap = std::min(backoff_, kMaxTriggerGapNs);
        if (winner_parallel_ && phase_ == Phase::steady && now_ns - last_end_ >= gap) next_probe_ = now_ns;
    }

    bool winner_parallel() const { return winner_parallel_; }
    int64_t backoff_ns() const { return backoff_; }
    int64_t switches_to_serial() const { return switches_; }
    int64_t probes() const { return probes_; }

  private:
    enum class Phase { steady, reference, probe };

    // A probe that after kMinJobs compared jobs takes more than this share of their reference time ends at
    // once: at idle the caller alone takes ~150%, and a false alarm then costs ~15 ms instead of a whole
    // window; beside a busy process the workers take ~115%, far from kWorkersWinPercent (when the contender
    // leaves they take ~65%).
    static constexpr int64_t kLosingPercent = 125, kWorkersLosingPercent = 100;
    bool losing() const {
        const int64_t percent = winner_parallel_ ? kLosingPercent : kWorkersLosingPercent;
        return compared_ >= kMinJobs && compared_ns_ * 100 > compared_ref_ns_ * percent;
    }

    void start(Phase phase) {
        phase_ = phase;
        window_ns_ = window_jobs_ = compared_ = compared_ns_ = compared_ref_ns_ = 0;
        probes_ += phase == Phase::probe;
        if (phase == Phase::reference)
            for (Slot &s : slots_) s.ref_ns = s.ref_jobs = s.probe_ns = s.probe_jobs = 0;
    }

    // The reference window's jobs, timed at the probe's mean time per job, against their own time.
    void end_probe(int64_t now_ns) {
        double reference = 0, as_probe = 0;
        for (const Slot &s : slots_)
            if (s.ref_jobs > 0 && s.probe_jobs > 0) {
                reference += double(s.ref_ns);
                as_probe += double(s.probe_ns) / double(s.probe_jobs) * double(s.ref_jobs);
            }
        phase_ = Phase::steady;
        last_end_ = now_ns;
        const double ratio = compared_ >= kMinJobs && reference > 0 ? as_probe / reference : 2.0; // 2: lost
        const double limit = double(winner_parallel_ ? kWinPercent : kWorkersWinPercent) / 100;
        if (!confirming_ && ratio < limit) { // a second comparison at once: one lucky window does not switch
            confirming_ = true, first_ratio_ = ratio;
            next_probe_ = now_ns;
            return;
        }
        // the two comparisons' mean decides: windows beside a busy loop ranged 0.57-1.0 (mean ~0.9), and
        // two wins in a row took seconds to come
        const bool won = confirming_ && (first_ratio_ + ratio) / 2 < limit;
        confirming_ = false;
        if (won) {
            winner_parallel_ = !winner_parallel_;
            switches_ += !winner_parallel_;
            backoff_ = kMinBackoffNs;
        } else {
            backoff_ = std::min(2 * backoff_, kMaxBackoffNs);
        }
        next_probe_ = winner_parallel_ ? kNever : now_ns + backoff_;
    }

    struct Slot {
        uint64_t key = 0;
        bool seen = false;
        int64_t last_on_workers = 0;         // the job's last wall time on the workers; 0: none yet
        int64_t ref_ns = 0, ref_jobs = 0;     // in this comparison's reference window
        int64_t probe_ns = 0, probe_jobs = 0; // in its probe window
    };
    Slot &slot(uint64_t key) { return slots_[size_t((key * 0x9E3779B97F4A7C15ull) >> 56)]; }
    std::array<Slot, 256> slots_{};
    bool winner_parallel_ = true; // the workers start as the winner
    Phase phase_ = Phase::steady;
    int64_t next_probe_ = kNever, backoff_ = kMinBackoffNs, last_end_ = INT64_MIN / 2;
    int64_t window_ns_ = 0, window_jobs_ = 0, compared_ = 0;  // of the current window
    int64_t compared_ns_ = 0, compared_ref_ns_ = 0;           // the probe's compared jobs, their reference means
    bool confirming_ = false; // the last comparison won: the next one confirms it
    double first_ratio_ = 0;  // that comparison's probe time / reference time
    int64_t switches_ = 0, probes_ = 0;
};

} // namespace llaisys::detail
