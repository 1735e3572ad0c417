// A one-shot all-reduce for small messages between the GPUs of one process, over peer memory (issue 30).
//
// Why: at batch 1 a decode step of a 7B model makes 57 all-reduces of a few KB each; NCCL's small-message
// latency (12 us on 2 H200s, 22 us on 4 H100s, session 25/27) is then a quarter of the step at TP 2. Here every
// rank copies its input into its own buffer, meets the others at a flag barrier in peer memory, and sums all
// ranks' buffers itself (NVLink reads), in rank order and in f32: every rank gets the same bits, one kernel,
// no proxy thread. vLLM's custom all-reduce does the same; this one is written from the idea.
//
// Contract: every rank calls all_reduce with the same element count and dtype in the same order (the model's
// all-reduces are), each on its own device's current stream; capturable in CUDA graphs (the barrier's epoch is
// a per-block counter in device memory, not a kernel argument). The kernel always runs kBlocks blocks, so the
// ranks' counters stay in lockstep whatever the size. Two buffers alternate by epoch: a rank writing buffer
// e % 2 at call e has passed call e - 1's barrier, so every peer has finished call e - 2, the last reader of it.
// On by default for 2 to 4 ranks: on 2 H200s (session 28) 8.2 us against NCCL's 12.4 for a [1, 3584] bf16
// message, qwen2-7b TP 2 decode 354.5 -> 370.5 tok/s; on 4 H200s (session 29) 22.6 against 27.0 us, TP 4
// decode 457.3 -> 519.9 tok/s; the TP and comm tests passed at both sizes. More ranks: opt-in
// (LLAISYS_PEER_ALLREDUCE=1; =0 turns it off everywhere) until this kernel is measured there.
// A peer that never arrives: the kernel waits until abort() (a flag in mapped host memory) or kTimeoutNs,
// then leaves, and the group reports it (error()) instead of hanging the GPU.
#pragma once
#include "llaisys/tensor.hpp"

#include <memory>
#include <string>
#include <vector>

namespace llaisys::runtime::cuda {

class PeerAllReduce {
public:
    // The shared state of the group of `devices` (device indices, one rank each), or nullptr where the
    // GPUs cannot all reach each other's memory or the group has one rank. Buffers of max_bytes per rank.
    static std::shared_ptr<PeerAllReduce> create(const std::vector<int> &devices, size_t max_bytes);
    ~PeerAllReduce();
    PeerAllReduce(const PeerAllReduce &) = delete;
    PeerAllReduce &operator=(const PeerAllReduce &) = delete;

    // Whether x (contiguous, f32/f16/bf16, at most max_bytes) can take this path.
    bool takes(const Tensor &x) const;
    size_t max_bytes() const { return max_bytes_; }
    // In place: x = the sum of every rank's x, on the current stream of rank `rank`'s device.
    void all_reduce(int rank, const Tensor &x);
    // Makes waiting kernels leave (a peer died or stalled); later calls must not come (the group is broken).
    void abort();
    // "" or why a kernel left its barrier without its peers (the result of that call is not a sum).
    std::string error() const;

    static constexpr int kBlocks = 16, kThreads = 512, kMaxRanks = 8;
    static constexpr long long kTimeoutNs = 120'000'000'000LL; // past any legitimate skew between ranks

private:
    PeerAllReduce() = default;
    struct Rank;
    std::vector<std::unique_ptr<Rank>> ranks_;
    size_t max_bytes_ = 0;
    int *host_flags_ = nullptr; // mapped pinned host memory: [0] abort, [1] timed out
};

} // namespace llaisys::runtime::cuda
