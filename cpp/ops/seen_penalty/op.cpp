#include "ops/seen_penalty/seen_penalty.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

#include <cmath>

namespace llaisys::ops {

namespace {
// Host tensors only (a device's values would need a sync): row indices in [-1, S), penalties finite > 0.
void check_rows(const char *op, const Tensor &rows, int64_t S) {
    if (!rows.device().is_cpu()) return;
    const int32_t *r = rows.data_as<int32_t>();
    for (int64_t b = 0; b < rows.numel(); ++b)
        LLAISYS_CHECK(r[b] >= -1 && r[b] < S, std::out_of_range, op, ": rows[", b, "] = ", r[b],
                      " is outside the ", S, " rows of seen (use -1 for none)");
}

void check_seen(const char *op, const Tensor &seen, const Tensor &rows, int64_t B) {
    detail::check_dtype(op, "seen", seen, DType::I32);
    detail::check_ndim(op, "seen", seen, 2);
    LLAISYS_CHECK(seen.is_contiguous(), std::invalid_argument, op, ": seen must be contiguous (updated in place)");
    detail::check_dtype(op, "rows", rows, DType::I32);
    detail::check_shape(op, "rows", rows, {B});
}
} // namespace

void seen_penalty(const Tensor &logits, const Tensor &seen, const Tensor &rows, const Tensor &penalty) {
    constexpr const char *op = "seen_penalty";
    detail::check_operands(op, {{"logits", logits}, {"seen", seen}, {"rows", rows}, {"penalty", penalty}});
    detail::check_float(op, "logits", logits);
    detail::check_ndim(op, "logits", logits, 2);
    const int64_t B = logits.size(0);
    check_seen(op, seen, rows, B);
    detail::check_shape(op, "seen", seen, {seen.size(0), (logits.size(1) + 31) / 32});
    detail::check_dtype(op, "penalty", penalty, DType::F32);
    detail::check_shape(op, "penalty", penalty, {B});
    if (B == 0 || logits.size(1) == 0) return;
    const Tensor rc = rows.contiguous(), pc = penalty.contiguous();
    check_rows(op, rc, seen.size(0));
    if (pc.device().is_cpu())
        for (int64_t b = 0; b < B; ++b) {
            const float p = pc.data_as<float>()[b];
            LLAISYS_CHECK(p > 0.f && std::isfinite(p), std::invalid_argument, op, ": penalty[", b,
                          "] must be a finite number > 0, got ", p);
        }
    LLAISYS_DEVICE_DISPATCH(op, logits.device(), cpu::seen_penalty(logits, seen, rc, pc),
                            cuda::seen_penalty(logits, seen, rc, pc));
}

void seen_mark(const Tensor &seen, const Tensor &rows, const Tensor &ids) {
    constexpr const char *op = "seen_mark";
    detail::check_operands(op, {{"seen", seen}, {"rows", rows}, {"ids", ids}});
    detail::check_dtype(op, "ids", ids, DType::I64);
    detail::check_ndim(op, "ids", ids, 1);
    const int64_t B = ids.size(0);
    check_seen(op, seen, rows, B);
    if (B == 0) return;
    const Tensor rc = rows.contiguous(), ic = ids.contiguous();
    check_rows(op, rc, seen.size(0));
    if (ic.device().is_cpu())
        for (int64_t b = 0; b < B; ++b) {
            const int64_t id = ic.data_as<int64_t>()[b];
            LLAISYS_CHECK(id >= -1 && id < 32 * seen.size(1), std::out_of_range, op, ": ids[", b, "] = ", id,
                          " is outside the ", 32 * seen.size(1), " tokens of seen (-1: no token)");
        }
    LLAISYS_DEVICE_DISPATCH(op, seen.device(), cpu::seen_mark(seen, rc, ic), cuda::seen_mark(seen, rc, ic));
}

} // namespace llaisys::ops
