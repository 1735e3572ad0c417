#include "ops/logprobs/logprobs.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

#include <cmath>
#include <cstdint>

namespace llaisys::ops {

static void check_logprobs_args(const Tensor &chosen_lp, const Tensor &top_ids, const Tensor &top_lp,
                                const Tensor &logits, const Tensor &temperature, const Tensor &chosen,
                                const Tensor &rows) {
    constexpr const char *op = "logprobs";
    detail::check_operands(op, {{"logits", logits}, {"temperature", temperature}, {"chosen", chosen},
                                {"rows", rows}, {"chosen_lp", chosen_lp}, {"top_ids", top_ids}, {"top_lp", top_lp}});
    detail::check_float(op, "logits", logits);
    detail::check_dtype(op, "temperature", temperature, DType::F32);
    detail::check_dtype(op, "chosen", chosen, DType::I64);
    detail::check_dtype(op, "rows", rows, DType::I64);
    detail::check_dtype(op, "chosen_lp", chosen_lp, DType::F32);
    detail::check_dtype(op, "top_ids", top_ids, DType::I64);
    detail::check_dtype(op, "top_lp", top_lp, DType::F32);
    detail::check_ndim(op, "logits", logits, 2);
    detail::check_ndim(op, "rows", rows, 1);
    detail::check_ndim(op, "top_ids", top_ids, 2);
    const int64_t B = logits.size(0), V = logits.size(1), R = rows.size(0), k = top_ids.size(1);
    LLAISYS_CHECK(V >= 1, std::invalid_argument, op, ": logits must have at least one column, got shape ",
                  shape_str(logits.shape()));
    LLAISYS_CHECK(V <= INT32_MAX, std::invalid_argument, op, ": vocabulary must be < 2^31, got ", V);
    LLAISYS_CHECK(k <= logprobs_rule::kMaxTopK, std::invalid_argument, op, ": top_ids may have at most ",
                  logprobs_rule::kMaxTopK, " columns (k), got shape ", shape_str(top_ids.shape()));
    detail::check_shape(op, "temperature", temperature, {B});
    detail::check_shape(op, "chosen", chosen, {B});
    detail::check_shape(op, "chosen_lp", chosen_lp, {R});
    detail::check_shape(op, "top_ids", top_ids, {R, k});
    detail::check_shape(op, "top_lp", top_lp, {R, k});
}

// Index values, when they live on the host (on a device reading them would cost a sync: there the kernel
// writes NaN logprobs for a row index or a chosen id out of range).
static void check_logprobs_values(const Tensor &logits, const Tensor &temperature, const Tensor &chosen,
                                  const Tensor &rows) {
    if (!rows.device().is_cpu()) return;
    const int64_t B = logits.size(0), V = logits.size(1);
    const int64_t *row = rows.data_as<int64_t>(), *id = chosen.data_as<int64_t>();
    const float *t = temperature.data_as<float>();
    for (int64_t r = 0; r < rows.size(0); ++r) {
        const int64_t b = row[r];
        LLAISYS_CHECK(b >= 0 && b < B, std::out_of_range, "logprobs: rows[", r, "] = ", b,
                      " is out of range for logits with ", B, " rows");
        LLAISYS_CHECK(id[b] >= 0 && id[b] < V, std::out_of_range, "logprobs: chosen[", b, "] = ", id[b],
                      " is out of range for a vocabulary of ", V);
        LLAISYS_CHECK(t[b] >= 0 && std::isfinite(t[b]), std::invalid_argument,
                      "logprobs: temperature must be a finite number >= 0 (0 = 1), got ", t[b], " in row ", b);
    }
}

void logprobs(const Tensor &chosen_lp, const Tensor &top_ids, const Tensor &top_lp, const Tensor &logits,
              const Tensor &temperature, const Tensor &chosen, const Tensor &rows) {
    check_logprobs_args(chosen_lp, top_ids, top_lp, logits, temperature, chosen, rows);
    if (rows.size(0) == 0) return;
    const Tensor lc = logits.contiguous(), tc = temperature.contiguous(), cc = chosen.contiguous(),
                 rc = rows.contiguous();
    check_logprobs_values(lc, tc, cc, rc);
    detail::with_contiguous_out(chosen_lp, [&](const Tensor &clp) {
        detail::with_contiguous_out(top_ids, [&](const Tensor &ids) {
            detail::with_contiguous_out(top_lp, [&](const Tensor &tlp) {
                LLAISYS_DEVICE_DISPATCH("logprobs", lc.device(), cpu::logprobs(clp, ids, tlp, lc, tc, cc, rc),
                                        cuda::logprobs(clp, ids, tlp, lc, tc, cc, rc));
            });
        });
    });
}

} // namespace llaisys::ops
