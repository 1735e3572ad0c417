// HF's repetition penalty for a batch of rows, each with its own penalty and ids: one repetition_penalty
// call per distinct penalty value, each covering the rows using that value (ids [B, n] padded with -1,
// so the other rows are untouched). Row: anything with repetition_penalty and penalty_ids (RowSampling).
#pragma once
#include "llaisys/ops.hpp"
#include "runtime/staging.hpp"

#include <algorithm>
#include <set>
#include <vector>

namespace llaisys::runtime {

template <class Row>
void apply_repetition_penalties(const Tensor &logits, const std::vector<Row> &rows, InputStaging &staging) {
    std::set<float> penalties;
    size_t width = 0;
    for (const Row &r : rows)
        if (r.repetition_penalty != 1.f && !r.penalty_ids.empty()) {
            penalties.insert(r.repetition_penalty);
            width = std::max(width, r.penalty_ids.size());
        }
    const int64_t B = int64_t(rows.size());
    for (float penalty : penalties) {
        std::vector<int64_t> ids(size_t(B) * width, -1);
        for (size_t b = 0; b < rows.size(); ++b)
            if (rows[b].repetition_penalty == penalty)
                std::copy(rows[b].penalty_ids.begin(), rows[b].penalty_ids.end(), ids.begin() + int64_t(b * width));
        ops::repetition_penalty(logits, staging.upload(ids, DType::I64).view({B, int64_t(width)}), penalty);
    }
}

} // namespace llaisys::runtime
