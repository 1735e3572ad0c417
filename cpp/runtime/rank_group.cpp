#include "llaisys/rank_group.hpp"

#include "llaisys/common.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

namespace llaisys::runtime {

// One rank's driver thread: runs the jobs run_all hands it, one at a time. Its state is guarded by the
// group's mutex, and it tells the group's condition variable when a job ends (so a rank's failure is seen
// at once, not after the others' timeout).
struct RankGroup::Worker {
    std::shared_ptr<Sync> sync;    // the group's, kept alive by every worker
    std::mutex &m;
    std::condition_variable &done; // the group's: a job ended
    std::condition_variable cv;     // this worker's: a job (or stop, or an abort) arrived
    std::function<void()> job;
    bool busy = false, stop = false, aborted = false;
    std::string fault; // inject_fault: "raise" / "stall" for the next job
    std::exception_ptr error;
    std::thread thread;

    explicit Worker(std::shared_ptr<Sync> s) : sync(std::move(s)), m(sync->mu), done(sync->done) {}

    // The thread holds its Worker: joined at close it is gone before the group is; detached (a rank stuck in
    // a job the group gave up on) it frees the Worker itself, and the Sync with the last one, if it ever returns.
    static std::shared_ptr<Worker> start(const std::shared_ptr<Sync> &s) {
        auto w = std::make_shared<Worker>(s);
        w->thread = std::thread([w] { w->loop(); });
        return w;
    }

    void loop() {
        for (;;) {
            std::function<void()> j;
            std::string f;
            {
                std::unique_lock<std::mutex> lock(m);
                cv.wait(lock, [&] { return stop || job; });
                if (!job) return;
                j = std::move(job);
                job = nullptr;
                f = std::move(fault);
                fault.clear();
            }
            std::exception_ptr e;
            try {
                if (f == "stall") { // a rank that hangs: until the group gives up on it
                    std::unique_lock<std::mutex> lock(m);
                    cv.wait(lock, [&] { return aborted || stop; });
                    throw std::runtime_error("injected stall, ended by the group's abort");
                }
                if (f == "hang") { // a rank the abort does not reach (a driver call that never returns)
                    std::unique_lock<std::mutex> lock(m);
                    cv.wait(lock, [&] { return stop; });
                    throw std::runtime_error("injected hang, ended by the group's end");
                }
                if (f == "raise") throw std::runtime_error("injected fault");
                j();
            } catch (...) {
                e = std::current_exception();
            }
            {
                std::lock_guard<std::mutex> lock(m);
                error = e;
                busy = false;
            }
            done.notify_all();
        }
    }
};

namespace {
std::string message_of(const std::exception_ptr &e) {
    try {
        std::rethrow_exception(e);
    } catch (const std::exception &x) {
        return x.what();
    } catch (...) {
        return "unknown error";
    }
}
} // namespace

RankGroup::RankGroup(std::vector<Runner *> runners, double timeout_s) : runners_(std::move(runners)), timeout_s_(timeout_s) {
    const int world = int(runners_.size());
    LLAISYS_CHECK(world >= 1, std::invalid_argument, "RankGroup: no ranks");
    LLAISYS_CHECK(timeout_s > 0, std::invalid_argument, "RankGroup: timeout_s must be > 0, got ", timeout_s);
    std::set<std::string> devices;
    // the ranks of this process: consecutive, first.. (0.. when the group is all here; a group spanning
    // processes, engine/nodes.py, has the others elsewhere)
    const auto &first_comm = runners_[0] ? runners_[0]->model().communicator() : nullptr;
    const int first = first_comm ? first_comm->rank() : 0;
    for (int r = 0; r < world; ++r) {
        LLAISYS_CHECK(runners_[size_t(r)] != nullptr, std::invalid_argument, "RankGroup: runner ", r, " is None");
        const models::Model &m = runners_[size_t(r)]->model();
        const auto &comm = m.communicator();
        LLAISYS_CHECK(world == 1 || (comm && comm->rank() == first + r && comm->world() >= first + world),
                      std::invalid_argument, "RankGroup: runner ", r, "'s model must be rank ", first + r,
                      " of a group of at least ", first + world, " (it is ",
                      comm ? detail::concat("rank ", comm->rank(), " of ", comm->world()) : std::string("unsplit"), ")");
        LLAISYS_CHECK(m.device().is_cpu() || devices.insert(m.device().str()).second, std::invalid_argument,
                      "RankGroup: two ranks on ", m.device().str());
    }
    for (int r = 0; r < world; ++r) workers_.push_back(Worker::start(sync_));
}

RankGroup::~RankGroup() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto &w : workers_) w->stop = true;
    }
    for (auto &w : workers_) w->cv.notify_all();
    for (auto &w : workers_) {
        bool busy;
        {
            std::lock_guard<std::mutex> lock(mu_);
            busy = w->busy;
        }
        // a rank still stuck in a job the group gave up on (broken) is left behind rather than waited for
        if (busy && !broken_.empty()) w->thread.detach();
        else w->thread.join();
    }
}

std::string RankGroup::broken() const { return broken_; }

void RankGroup::inject_fault(int rank, const std::string &mode) {
    LLAISYS_CHECK(rank >= 0 && rank < world(), std::out_of_range, "RankGroup.inject_fault: no rank ", rank);
    LLAISYS_CHECK(mode == "raise" || mode == "stall" || mode == "hang", std::invalid_argument,
                  "RankGroup.inject_fault: mode must be 'raise', 'stall' or 'hang', got '", mode, "'");
    std::lock_guard<std::mutex> lock(mu_);
    workers_[size_t(rank)]->fault = mode;
}

// Aborts every rank's communicator (ending waits in collectives) and remembers why.
void RankGroup::breakdown(const std::string &why) {
    if (broken_.empty()) broken_ = why;
    for (Runner *r : runners_)
        if (const auto &comm = r->model().communicator()) comm->abort(why);
    {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto &w : workers_) w->aborted = true;
    }
    for (auto &w : workers_) w->cv.notify_all();
}

// fn must own (by value or shared_ptr) everything it reads and writes: a rank this call gives up on may
// return from it after the caller's frame is gone (the callers below copy the step's arrays into a Call).
void RankGroup::run_all(const char *what, std::function<void(int)> fn) {
    LLAISYS_CHECK(broken_.empty(), std::runtime_error, "tensor-parallel group is broken: ", broken_);
    const int world = this->world();
    if (world == 1) return fn(0);
    const auto job = std::make_shared<const std::function<void(int)>>(std::move(fn));
    {
        std::lock_guard<std::mutex> lock(mu_);
        for (int r = 0; r < world; ++r) {
            Worker &w = *workers_[size_t(r)];
            w.job = [job, r] { (*job)(r); };
            w.busy = true;
            w.error = nullptr;
        }
    }
    for (auto &w : workers_) w->cv.notify_all();
    const auto busy = [&] {
        return std::count_if(workers_.begin(), workers_.end(), [](const auto &w) { return w->busy; });
    };
    const auto failed = [&] {
        return std::count_if(workers_.begin(), workers_.end(), [](const auto &w) { return bool(w->error); });
    };
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    std::unique_lock<std::mutex> lock(mu_);
    // all done; or a rank failed while others still run (they may wait for it in a collective: fail fast)
    done_.wait_until(lock, deadline, [&] { return busy() == 0 || failed() > 0; });
    const bool alike = busy() == 0 && failed() == world; // every rank failed the same way: as one Runner would
    if (busy() == 0 && (failed() == 0 || alike)) {
        lock.unlock();
        if (alike) std::rethrow_exception(workers_[0]->error);
        return;
    }
    std::string why;
    if (failed() > 0) {
        const auto first = std::find_if(workers_.begin(), workers_.end(), [](const auto &w) { return bool(w->error); });
        why = detail::concat("rank ", first - workers_.begin(), " failed in ", what, " and the others did not: ",
                             message_of((*first)->error));
    } else {
        std::string late;
        for (int r = 0; r < world; ++r)
            if (workers_[size_t(r)]->busy) late += (late.empty() ? "" : ", ") + std::to_string(r);
        why = detail::concat("rank(s) ", late, " did not finish ", what, " within ", timeout_s_,
                             " s (a rank that died or stalled, e.g. in a collective)");
    }
    lock.unlock();
    breakdown(why);
    // the abort ends waits in collectives: give the other ranks a moment to return before fn's captures go
    lock.lock();
    done_.wait_until(lock, std::chrono::steady_clock::now() + std::chrono::seconds(10), [&] { return busy() == 0; });
    throw std::runtime_error("tensor-parallel group is broken: " + broken_);
}

// Every rank's tokens must be the same (they sample the same gathered logits): rank 0's, or the group breaks.
std::vector<int64_t> RankGroup::agreed(const char *what, std::vector<std::vector<int64_t>> &ids) {
    for (int r = 1; r < world(); ++r)
        if (ids[size_t(r)] != ids[0]) {
            breakdown(detail::concat("ranks 0 and ", r, " sampled different tokens in ", what,
                                     " (their logits differ: a rank computed something else)"));
            throw std::runtime_error("tensor-parallel group is broken: " + broken_);
        }
    return std::move(ids[0]);
}

namespace {
// One call's inputs and outputs, owned by its jobs (run_all: a rank given up on may return after the caller).
// Copies of the step's host arrays: KBs for a decode step, ~100 KB for a 4096-token prefill.
struct Call {
    HostBatch batch;
    std::vector<RowSampling> rows;
    std::vector<std::vector<int64_t>> ids; // [world] each rank's tokens
    std::vector<Tensor> logits;            // [world]
};
} // namespace

std::vector<int64_t> RankGroup::step(const HostBatch &b, const std::vector<RowSampling> &rows) {
    auto c = std::make_shared<Call>(Call{b, rows, std::vector<std::vector<int64_t>>(size_t(world())), {}});
    run_all("a step", [c, rs = runners_](int r) { c->ids[size_t(r)] = rs[size_t(r)]->step(c->batch, c->rows); });
    return agreed("a step", c->ids);
}

void RankGroup::launch(const HostBatch &b, const std::vector<RowSampling> &rows, bool chain,
                       const std::vector<int64_t> &chain_rows) {
    auto c = std::make_shared<Call>(Call{b, rows, {}, {}});
    run_all("a launch", [c, rs = runners_, chain, chain_rows](int r) {
        rs[size_t(r)]->launch(c->batch, c->rows, chain, false, chain_rows);
    });
}

void RankGroup::set_seen(int64_t row, const std::vector<int32_t> &words) {
    run_all("set_seen", [rs = runners_, row, words](int r) { rs[size_t(r)]->set_seen(row, words); });
}

std::vector<int64_t> RankGroup::finish() {
    auto c = std::make_shared<Call>(Call{{}, {}, std::vector<std::vector<int64_t>>(size_t(world())), {}});
    run_all("a step's finish", [c, rs = runners_](int r) { c->ids[size_t(r)] = rs[size_t(r)]->finish(); });
    return agreed("a step", c->ids);
}

Tensor RankGroup::logits(const HostBatch &b, bool all_logits) {
    auto c = std::make_shared<Call>(Call{b, {}, {}, std::vector<Tensor>(size_t(world()))});
    run_all("logits", [c, rs = runners_, all_logits](int r) {
        c->logits[size_t(r)] = rs[size_t(r)]->logits(c->batch, all_logits);
    });
    return c->logits[0];
}

void RankGroup::shift_kv(const std::vector<int64_t> &src, const std::vector<int64_t> &dst, int64_t delta) {
    run_all("a K-shift", [rs = runners_, src, dst, delta](int r) { rs[size_t(r)]->shift_kv(src, dst, delta); });
}

int RankGroup::left_behind() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.empty()) return 0;
    return int(std::count_if(workers_.begin(), workers_.end(), [](const auto &w) { return w->busy; }));
}

} // namespace llaisys::runtime
