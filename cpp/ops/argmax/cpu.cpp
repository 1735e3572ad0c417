#include "ops/argmax/argmax.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

namespace llaisys::ops::cpu {

// x [rows, V] -> max_idx [rows], max_val [rows]; the value is copied, not re-rounded (NaN stays NaN).
template <typename T>
static void argmax_kernel(int64_t *max_idx, T *max_val, const T *x, int64_t rows, int64_t V) {
    parallel_for(rows, V, [&](int64_t r) {
        const T *row = x + r * V;
        const int64_t i = argmax_row(row, V);
        max_idx[r] = i;
        max_val[r] = row[i];
    });
}

void argmax(const Tensor &max_idx, const Tensor &max_val, const Tensor &x) {
    const int64_t V = x.shape().back();
    detail::dispatch_float("argmax", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        argmax_kernel(max_idx.data_as<int64_t>(), max_val.data_as<T>(), x.data_as<T>(), x.numel() / V, V);
    });
}

} // namespace llaisys::ops::cpu
