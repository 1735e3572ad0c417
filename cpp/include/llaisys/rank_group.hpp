// Tensor parallelism's runtime (issue 30): the runners of the ranks of one group, each with its own model
// shard, KV pool and CUDA graphs, driven as one. Every call runs the same step on every rank at once, each
// on a thread of its own (one driver thread per GPU: a rank's host work, uploads and graph replay overlap
// the others', and each thread keeps its device and NCCL communicator to itself, so no ncclGroupStart
// spans ranks). Every rank gets the same host arrays and samples from the same gathered logits with the
// same (seed, step), so all agree on every token without a broadcast; the group checks that they do.
//
// Faults: a call that some ranks fail and others do not, or that a rank does not finish within the
// timeout (a rank that died or stalled in a collective), aborts the group's communicators (which ends the
// others' waits) and breaks the group: the call and every later one raise, naming the rank. A failure of
// every rank (a bad argument, non-finite logits) leaves the group usable, as it would a single Runner.
#pragma once
#include "llaisys/runner.hpp"

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace llaisys::runtime {

class RankGroup {
public:
    // runners[r] runs the model whose communicator is rank first + r (each on its own device): first = 0 and
    // the world runners.size() when the whole group is here; the ranks of one process of a wider group else.
    RankGroup(std::vector<Runner *> runners, double timeout_s);
    ~RankGroup();
    RankGroup(const RankGroup &) = delete;
    RankGroup &operator=(const RankGroup &) = delete;

    int world() const { return int(runners_.size()); }
    // What Runner does, on every rank; the tokens (and logits) are rank 0's, which every rank shares.
    std::vector<int64_t> step(const HostBatch &batch, const std::vector<RowSampling> &rows);
    void launch(const HostBatch &batch, const std::vector<RowSampling> &rows, bool chain,
                const std::vector<int64_t> &chain_rows = {});
    void set_seen(int64_t row, const std::vector<int32_t> &words);
    std::vector<int64_t> finish();
    // A broken group finishes nothing more: 0 then, so a caller draining launched steps stops.
    size_t launched() const { return broken_.empty() ? runners_.front()->launched() : 0; }
    Tensor logits(const HostBatch &batch, bool all_logits);
    const Tensor &last_logits() const { return runners_.front()->last_logits(); }
    void shift_kv(const std::vector<int64_t> &src, const std::vector<int64_t> &dst, int64_t delta);
    std::vector<int64_t> captured_batch_sizes() const { return runners_.front()->captured_batch_sizes(); }
    uint64_t steps_sampled_in_graph() const { return runners_.front()->steps_sampled_in_graph(); }
    // Why the group is broken ("" while it is not).
    std::string broken() const;
    // Ranks still inside a job the broken group gave up on (0 while it is not broken). Such a rank may return
    // into its runner at any time: the owner must keep the runners (models, KV pools) alive for good.
    int left_behind() const;
    // For fault tests: rank `rank`'s next call raises ("raise"), stalls until the group is aborted ("stall"), or
    // until the group is destroyed ("hang": left behind).
    void inject_fault(int rank, const std::string &mode);

private:
    struct Worker;
    void run_all(const char *what, std::function<void(int)> fn);
    void breakdown(const std::string &why);
    std::vector<int64_t> agreed(const char *what, std::vector<std::vector<int64_t>> &ids);

    struct Sync {
        std::mutex mu;                // guards every worker's state
        std::condition_variable done; // a worker finished a job
    };

    std::vector<Runner *> runners_;
    // Shared with the workers: a rank the group gave up on is detached at close, and its thread (with its
    // Worker) must find these alive whenever it comes back.
    std::shared_ptr<Sync> sync_ = std::make_shared<Sync>();
    std::mutex &mu_ = sync_->mu;
    std::condition_variable &done_ = sync_->done;
    std::vector<std::shared_ptr<Worker>> workers_;
    double timeout_s_;
    std::string broken_;
};

} // namespace llaisys::runtime
