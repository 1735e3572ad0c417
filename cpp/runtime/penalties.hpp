// HF's repetition penalty for a batch of rows from each sequence's "seen" set: a bitmask row of the runner's
// device tensor seen [S, ceil(vocab / 32)] (RowSampling::seen_row; -1: none). The host writes a row once
// (Runner::set_seen, from the prompt); each sampled token is then added on the device (seen_mark), so a
// chained step, whose input token the host does not know yet, penalises it too. Row: RowSampling.
#pragma once
#include "llaisys/ops.hpp"
#include "runtime/staging.hpp"

#include <algorithm>
#include <vector>

namespace llaisys::runtime {

// The rows' seen rows ([B], -1 for a row without), or empty when no row has one (nothing to do).
template <class Row>
std::vector<int32_t> seen_rows(const std::vector<Row> &rows, int64_t num_seen) {
    std::vector<int32_t> out(rows.size(), -1);
    bool any = false;
    for (size_t b = 0; b < rows.size(); ++b) {
        const int32_t r = rows[b].seen_row;
        if (r < 0) continue;
        LLAISYS_CHECK(r < num_seen, std::out_of_range, "Runner: row ", b, " names seen row ", r, " but only ",
                      num_seen, " were set (set_seen)");
        out[b] = r;
        any = true;
    }
    if (!any) out.clear();
    return out;
}

// Penalises the logits of rows with a seen row; returns those rows on the device for seen_mark (undefined
// Tensor: none).
template <class Row>
Tensor apply_repetition_penalties(const Tensor &logits, const std::vector<Row> &rows, const Tensor &seen,
                                  InputStaging &staging) {
    const std::vector<int32_t> which = seen_rows(rows, seen.defined() ? seen.size(0) : 0);
    if (which.empty()) return Tensor();
    std::vector<float> penalty(rows.size());
    for (size_t b = 0; b < rows.size(); ++b) penalty[b] = rows[b].repetition_penalty;
    const Tensor rows_d = staging.upload(which, DType::I32);
    ops::seen_penalty(logits, seen, rows_d, staging.upload(penalty, DType::F32));
    return rows_d;
}

} // namespace llaisys::runtime
