// The layout of a step's inputs on the device: the host arrays of a batch (and, for a CUDA graph that
// samples, each row's sampling fields) packed into one i64 and one i32 buffer, each uploaded in one copy,
// and the views of a StepBatch into them.
#pragma once
#include "llaisys/runner.hpp"

#include <cstdint>
#include <vector>

namespace llaisys::runtime {

// [ids | pos | slots | last] (i64) and [q_start | kv_len | block_tables] (i32), padded to P sequences of
// block-table width W.
void pack(const HostBatch &b, int64_t P, int64_t W, std::vector<int64_t> &h64, std::vector<int32_t> &h32);
// Appends seed, step [P] to h64 and top_k, temperature, top_p, min_p, seen_row, repetition_penalty [P] to
// h32 (rows past `rows` greedy, without a penalty).
void pack_sampling(const std::vector<RowSampling> *rows, int64_t P, std::vector<int64_t> &h64,
                   std::vector<int32_t> &h32);
// The sampling fields of a decode batch of P sequences (one token each) that pack_sampling appended, [P].
struct SamplingFields {
    Tensor temperature, top_k, top_p, min_p, seeds, steps, seen_row, penalty;
};
SamplingFields sampling_views(const Tensor &buf64, const Tensor &buf32, int64_t P, int64_t W);
// The StepBatch over packed buffers of P sequences, Tp tokens and table width W.
StepBatch views(const Tensor &buf64, const Tensor &buf32, int64_t P, int64_t Tp, int64_t W, int64_t max_q);
int64_t max_q_len(const HostBatch &b);

} // namespace llaisys::runtime
