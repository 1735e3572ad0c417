#include "ops/rms_norm/rms_norm.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {

namespace {

// t's rows as a RowMap (ops/common/rms_norm_rows.hpp): a unit last stride (or D == 1) and leading dims
// that collapse into at most two with positive strides; false otherwise.
bool row_map(const Tensor &t, RowMap &m) {
    const int nd = t.ndim();
    if (t.size(nd - 1) != 1 && t.stride(nd - 1) != 1) return false;
    int64_t size[2] = {1, 1}, stride[2] = {0, 0};
    int n = 0; // collapsed dims, innermost first
    for (int d = nd - 2; d >= 0; --d) {
        if (t.size(d) == 1) continue;
        if (t.stride(d) <= 0) return false;
        if (n > 0 && t.stride(d) == stride[n - 1] * size[n - 1]) {
            size[n - 1] *= t.size(d);
            continue;
        }
        if (n == 2) return false;
        size[n] = t.size(d);
        stride[n] = t.stride(d);
        ++n;
    }
    m = RowMap{size[0], stride[1], stride[0]};
    return true;
}

// The rows of out never overlap one another: inner rows at least D apart, outer groups past the inner.
bool distinct_rows(const RowMap &m, int64_t rows, int64_t D) {
    const bool inner_ok = m.inner == 1 || m.s_inner >= D;
    const bool outer_ok = rows <= m.inner || m.s_outer >= m.s_inner * (m.inner - 1) + D;
    return inner_ok && outer_ok;
}

} // namespace

void rms_norm(const Tensor &out, const Tensor &x, const Tensor &weight, float eps) {
    constexpr const char *op = "rms_norm";
    detail::check_rms_norm_args(op, out, x, weight, eps);
    if (x.numel() == 0) return;
    const Tensor wc = weight.contiguous();
    // Strided rows in place (q/k norm on views of a fused QKV output) or between views: no copies, when
    // out's rows are distinct and x is out's very view or shares no memory with it.
    const int64_t D = x.shape().back(), rows = x.numel() / D;
    RowMap om{}, xm{};
    if (!(out.is_contiguous() && x.is_contiguous()) && row_map(out, om) && row_map(x, xm) &&
        distinct_rows(om, rows, D) &&
        (out.storage() != x.storage() ||
         (out.data() == x.data() && om.inner == xm.inner && om.s_inner == xm.s_inner && om.s_outer == xm.s_outer))) {
        LLAISYS_DEVICE_DISPATCH(op, out.device(), cpu::rms_norm_rows(out, x, wc, eps, om, xm),
                                cuda::rms_norm_rows(out, x, wc, eps, om, xm));
        return;
    }
    const Tensor xc = x.contiguous();
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::rms_norm(dst, xc, wc, eps), cuda::rms_norm(dst, xc, wc, eps));
    });
}

} // namespace llaisys::ops
