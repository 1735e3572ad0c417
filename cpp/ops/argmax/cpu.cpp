#include "ops/argmax/argmax.hpp"

#include "ops/common/argmax_rows.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

namespace llaisys::ops::cpu {

// x [rows, V] -> max_idx [rows], max_val [rows]. A finite maximum is copied, not re-rounded; a row
// without one gets -1 and NumPy's max (NaN, +inf or -inf).
template <typename T>
static void argmax_kernel(int64_t *max_idx, T *max_val, const T *x, int64_t rows, int64_t V) {
    parallel_for(rows, V, [&](int64_t r) {
        const T *row = x + r * V;
        bool any_nan = false;
        const float m = row_max(row, V, any_nan);
        const bool finite = finite_max(m, any_nan);
        max_idx[r] = finite ? first_index_of(row, V, m) : -1;
        max_val[r] = finite ? row[max_idx[r]] : from_float<T>(any_nan ? NAN : m);
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
