#include "runtime/packing.hpp"

#include <algorithm>
#include <cstring>

namespace llaisys::runtime {

// Lays the batch out as [ids | pos | slots | last] (i64) and [q_start | kv_len | block_tables] (i32),
// padded to `P` sequences of block-table width `W`: padded sequences are one token at position 0 of
// block 0 (reserved), so they compute finite garbage that nobody reads.
void pack(const HostBatch &b, int64_t P, int64_t W, std::vector<int64_t> &h64, std::vector<int32_t> &h32) {
    const int64_t B = b.num_seqs(), T = int64_t(b.ids.size()), Tp = T + (P - B);
    h64.assign(size_t(3 * Tp + P), 0);
    std::copy(b.ids.begin(), b.ids.end(), h64.begin());
    std::copy(b.pos.begin(), b.pos.end(), h64.begin() + Tp);
    std::copy(b.slots.begin(), b.slots.end(), h64.begin() + 2 * Tp);
    for (int64_t i = 0; i < P; ++i) h64[size_t(3 * Tp + i)] = i < B ? b.q_start[size_t(i + 1)] - 1 : T + (i - B);
    h32.assign(size_t((P + 1) + P + P * W), 0);
    for (int64_t i = 0; i <= P; ++i) h32[size_t(i)] = i <= B ? b.q_start[size_t(i)] : int32_t(T + (i - B));
    for (int64_t i = 0; i < P; ++i) h32[size_t(P + 1 + i)] = i < B ? b.kv_len[size_t(i)] : 1;
    int32_t *tables = h32.data() + 2 * P + 1;
    for (int64_t i = 0; i < B; ++i)
        std::copy_n(b.block_tables.begin() + i * b.max_blocks, std::min(W, b.max_blocks), tables + i * W);
}

// Appends what a graph's sampler reads: seed, step [P] to the i64 fields and top_k, temperature, top_p,
// min_p, seen_row, repetition_penalty [P] to the i32 ones (the floats as their bits). Rows past `rows`
// (padding; all of them without rows) are greedy, without a penalty.
void pack_sampling(const std::vector<RowSampling> *rows, int64_t P, std::vector<int64_t> &h64,
                   std::vector<int32_t> &h32) {
    static const RowSampling greedy{};
    const size_t o64 = h64.size(), o32 = h32.size(), B = rows ? rows->size() : 0;
    h64.resize(o64 + size_t(2 * P));
    h32.resize(o32 + size_t(6 * P));
    for (size_t i = 0; i < size_t(P); ++i) {
        const RowSampling &r = i < B ? (*rows)[i] : greedy;
        h64[o64 + i] = int64_t(r.seed);
        h64[o64 + size_t(P) + i] = int64_t(r.step);
        h32[o32 + i] = r.top_k;
        const float f[3] = {r.temperature, r.top_p, r.min_p};
        for (size_t k = 0; k < 3; ++k) std::memcpy(&h32[o32 + (k + 1) * size_t(P) + i], &f[k], sizeof(float));
        h32[o32 + 4 * size_t(P) + i] = r.seen_row;
        std::memcpy(&h32[o32 + 5 * size_t(P) + i], &r.repetition_penalty, sizeof(float));
    }
}

StepBatch views(const Tensor &buf64, const Tensor &buf32, int64_t P, int64_t Tp, int64_t W, int64_t max_q) {
    StepBatch s;
    s.ids = buf64.slice(0, 0, Tp);
    s.pos = buf64.slice(0, Tp, 2 * Tp);
    s.slots = buf64.slice(0, 2 * Tp, 3 * Tp);
    s.last = buf64.slice(0, 3 * Tp, 3 * Tp + P);
    s.q_start = buf32.slice(0, 0, P + 1);
    s.kv_len = buf32.slice(0, P + 1, 2 * P + 1);
    s.block_tables = buf32.slice(0, 2 * P + 1, 2 * P + 1 + P * W).view({P, W});
    s.max_q_len = max_q;
    return s;
}

// After a decode batch's fields (T = P tokens): 4P i64 and 2P + 1 + P * W i32 values.
SamplingFields sampling_views(const Tensor &buf64, const Tensor &buf32, int64_t P, int64_t W) {
    const int64_t o64 = 4 * P, o32 = 2 * P + 1 + P * W;
    auto f32 = [&](int64_t k) { return buf32.slice(0, o32 + k * P, o32 + (k + 1) * P).view_dtype(DType::F32); };
    SamplingFields f;
    f.seeds = buf64.slice(0, o64, o64 + P);
    f.steps = buf64.slice(0, o64 + P, o64 + 2 * P);
    f.top_k = buf32.slice(0, o32, o32 + P);
    f.temperature = f32(1);
    f.top_p = f32(2);
    f.min_p = f32(3);
    f.seen_row = buf32.slice(0, o32 + 4 * P, o32 + 5 * P);
    f.penalty = f32(5);
    return f;
}

int64_t max_q_len(const HostBatch &b) {
    int64_t m = 1;
    for (size_t i = 0; i + 1 < b.q_start.size(); ++i) m = std::max<int64_t>(m, b.q_start[i + 1] - b.q_start[i]);
    return m;
}

} // namespace llaisys::runtime
