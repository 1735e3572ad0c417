#include "ops/rms_norm/rms_norm.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

namespace llaisys::ops::cpu {

void rms_norm(const Tensor &out, const Tensor &x, const Tensor &weight, float eps) {
    const int64_t D = x.shape().back(), rows = x.numel() / D;
    detail::dispatch_float("rms_norm", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        T *o = out.data_as<T>();             // [rows, D]
        const T *xp = x.data_as<T>();        // [rows, D]
        const T *w = weight.data_as<T>();    // [D]
        parallel_for(rows, D, [&](int64_t r) { rms_norm_row(o + r * D, xp + r * D, w, D, eps); });
    });
}

void rms_norm_rows(const Tensor &out, const Tensor &x, const Tensor &weight, float eps, const RowMap &om,
                   const RowMap &xm) {
    const int64_t D = x.shape().back(), rows = x.numel() / D;
    const auto at = [](const RowMap &m, int64_t r) { return r / m.inner * m.s_outer + r % m.inner * m.s_inner; };
    detail::dispatch_float("rms_norm", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        T *o = out.data_as<T>();
        const T *xp = x.data_as<T>();
        const T *w = weight.data_as<T>();
        parallel_for(rows, D, [&](int64_t r) { rms_norm_row(o + at(om, r), xp + at(xm, r), w, D, eps); });
    });
}

} // namespace llaisys::ops::cpu
