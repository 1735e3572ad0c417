// One-shot all-reduces for small messages between the GPUs of one process, over peer memory (issue 30).
//
// Why: at batch 1 a decode step of a 7B model makes 57 all-reduces of a few KB each; NCCL's small-message
// latency (12 us on 2 H200s, 22 us on 4 H100s, session 25/27) is then a quarter of the step at TP 2. Both
// kernels here sum the ranks' inputs in rank order and in f32, so every rank gets the same bits (and both
// kernels the same bits as each other), in one kernel and without a proxy thread.
//
// Two kernels:
// - push (the default up to kPushMaxBytes; LLAISYS_PEER_ALLREDUCE_PUSH=0 turns it off): each rank WRITES its
//   input into a slot of every peer's receive buffer (16-byte stores over NVLink, posted: one-way latency) and
//   then polls its own buffer until every peer's slot holds data. An empty slot holds a sentinel, -0.0 in every
//   element; inputs have -0.0 replaced by +0.0 (a sum cannot tell them apart), so data never looks empty and
//   no flag is needed: the data is its own flag. The reader writes the sentinel back after summing. Three
//   buffers (phases) rotate by call; why that is race-free is argued at the kernel. TensorRT-LLM calls this
//   idea "Lamport" all-reduce; the code here is written from the idea. It replaces the pull kernel's two NVLink
//   round trips (flag handshake, then remote reads: 8-9 us at 2 ranks, 22 us at 4, sessions 28-29) by one
//   one-way trip.
// - pull (larger messages up to max_bytes, and every size with LLAISYS_PEER_ALLREDUCE_PUSH=0, the A/B): every
//   rank copies its input into its own buffer, meets the others at a flag barrier in peer memory, and reads
//   every rank's buffer (NVLink reads). vLLM's custom all-reduce does the same. Two buffers alternate by epoch:
//   a rank writing buffer e % 2 at call e has passed call e - 1's barrier, so every peer has finished call
//   e - 2, the last reader of it.
//
// Contract: every rank calls all_reduce with the same element count and dtype in the same order (the model's
// all-reduces are), each on its own device's current stream (one stream per rank: the push kernel's race
// argument needs a rank's calls to run one after another), so every rank picks the same kernel; capturable in
// CUDA graphs (each kernel's epoch/phase is a per-block counter in device memory, not a kernel argument, so
// replays advance it). Each kernel always runs its fixed number of blocks, so the ranks' counters stay in
// lockstep whatever the size.
// On by default for 2 to 4 ranks: pull measured on 2 H200s (session 28) 8.2 us against NCCL's 12.4 for a
// [1, 3584] bf16 message, qwen2-7b TP 2 decode 354.5 -> 370.5 tok/s; on 4 H200s (session 29) 22.6 against
// 27.0 us, TP 4 decode 457.3 -> 519.9 tok/s. More ranks: opt-in (LLAISYS_PEER_ALLREDUCE=1; =0 turns both
// kernels off everywhere) until measured there.
// A peer that never arrives: a waiting kernel leaves once abort() (a flag in mapped host memory) is raised or
// after kTimeoutNs, and the group reports it (error()) instead of hanging the GPU.
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
    // The largest message the push kernel takes (0: push off); larger ones up to max_bytes() pull.
    size_t push_max_bytes() const { return push_max_bytes_; }
    // In place: x = the sum of every rank's x, on the current stream of rank `rank`'s device. Returns the
    // kernel it enqueued: "push" or "pull" (the same on every rank for the same call).
    const char *all_reduce(int rank, const Tensor &x);
    // Makes waiting kernels leave (a peer died or stalled); later calls must not come (the group is broken).
    void abort();
    // "" or why a kernel left its barrier without its peers (the result of that call is not a sum).
    std::string error() const;

    static constexpr int kBlocks = 16, kThreads = 512, kMaxRanks = 8; // the pull kernel's grid
    // The push kernel's grid: a [1, 3584] bf16 message (448 16-byte units) runs on two blocks, a [64, 3584]
    // one (28672 units) spreads over all, two units a thread.
    static constexpr int kPushBlocks = 64, kPushThreads = 256;
    // Receive buffers per rank: 2 dtype widths x 3 phases x world slots x this (12 MiB at 4 ranks).
    static constexpr size_t kPushMaxBytes = 512 * 1024;
    static constexpr long long kTimeoutNs = 120'000'000'000LL; // past any legitimate skew between ranks

private:
    PeerAllReduce() = default;
    struct Rank;
    std::vector<std::unique_ptr<Rank>> ranks_;
    size_t max_bytes_ = 0, push_max_bytes_ = 0;
    int *host_flags_ = nullptr; // mapped pinned host memory: [0] abort, [1] timed out
};

} // namespace llaisys::runtime::cuda
