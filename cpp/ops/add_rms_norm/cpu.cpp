#include "ops/add_rms_norm/add_rms_norm.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"
#include "ops/common/rms_norm_rows.hpp"

#include <vector>

namespace llaisys::ops::cpu {

// Per row: residual += x (rounded to T, as add() does), then the shared rms_norm_row reads the rounded
// row, so the result equals add() then rms_norm() bit for bit. With x_weight, x is first normed into a
// scratch row by that same rms_norm_row: rms_norm() ahead of it, bit for bit too.
template <typename T>
static void add_rms_norm_kernel(T *out, T *residual, const T *x, const T *weight, int64_t rows, int64_t D,
                                float eps, const T *x_weight) {
    parallel_for(rows, x_weight ? 3 * D : 2 * D, [&](int64_t r) {
        T *res = residual + r * D;  // [D]
        const T *xr = x + r * D;    // [D]
        std::vector<T> normed(x_weight ? size_t(D) : 0);
        if (x_weight) {
            rms_norm_row(normed.data(), xr, x_weight, D, eps);
            xr = normed.data();
        }
        for (int64_t i = 0; i < D; ++i) store(res, i, load(res, i) + load(xr, i));
        rms_norm_row(out + r * D, res, weight, D, eps);
    });
}

void add_rms_norm(const Tensor &out, const Tensor &residual, const Tensor &x, const Tensor &weight, float eps,
                  const Tensor &x_weight) {
    const int64_t D = x.shape().back(), rows = x.numel() / D;
    detail::dispatch_float("add_rms_norm", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        add_rms_norm_kernel(out.data_as<T>(), residual.data_as<T>(), x.data_as<T>(), weight.data_as<T>(), rows, D,
                            eps, x_weight.defined() ? x_weight.data_as<T>() : nullptr);
    });
}

} // namespace llaisys::ops::cpu
