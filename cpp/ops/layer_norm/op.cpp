#include "ops/layer_norm/layer_norm.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

#include <cmath>

namespace llaisys::ops {

void detail::check_layer_norm_args(const char *op, const Tensor &out, const char *x_name, const Tensor &x,
                                   const Tensor &weight, const Tensor &bias, float eps, NormNames names) {
    check_operands(op, {{names.out, out}, {x_name, x}, {names.weight, weight}});
    check_float(op, x_name, x);
    check_same_dtype(op, names.weight, weight, x);
    check_same_dtype(op, names.out, out, x);
    LLAISYS_CHECK(x.ndim() >= 1, std::invalid_argument, op, ": ", x_name, " must have at least 1 dim, got a scalar");
    check_shape(op, names.weight, weight, {x.shape().back()});
    check_shape(op, names.out, out, x.shape());
    if (bias.defined()) {
        check_on_device(op, x.device(), bias);
        check_same_dtype(op, names.bias, bias, x);
        check_shape(op, names.bias, bias, {x.shape().back()});
    }
    LLAISYS_CHECK(eps >= 0.f && std::isfinite(eps), std::invalid_argument, op,
                  ": eps must be finite and >= 0, got ", eps);
}

namespace {
Tensor contiguous_or_none(const Tensor &t) { return t.defined() ? t.contiguous() : Tensor(); }
} // namespace

void layer_norm(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, float eps) {
    constexpr const char *op = "layer_norm";
    detail::check_layer_norm_args(op, out, "x", x, weight, bias, eps);
    if (x.numel() == 0) return;
    const Tensor xc = x.contiguous(), wc = weight.contiguous(), bc = contiguous_or_none(bias);
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::layer_norm(dst, xc, wc, bc, eps),
                                cuda::layer_norm(dst, xc, wc, bc, eps));
    });
}

void add_layer_norm(const Tensor &out, const Tensor &residual, const Tensor &delta, const Tensor &delta2,
                    const Tensor &weight, const Tensor &bias, float eps, const Tensor &out2, const Tensor &weight2,
                    const Tensor &bias2) {
    constexpr const char *op = "add_layer_norm";
    // delta plays x's part in the shared checks: out, weight and bias are checked against it.
    detail::check_layer_norm_args(op, out, "delta", delta, weight, bias, eps);
    if (out2.defined()) { // the second norm's operands, checked as the first's ("add_layer_norm: weight2 ...")
        detail::check_layer_norm_args(op, out2, "delta", delta, weight2, bias2, eps, {"out2", "weight2", "bias2"});
    } else {
        LLAISYS_CHECK(!weight2.defined() && !bias2.defined(), std::invalid_argument, op,
                      ": weight2/bias2 given without out2");
    }
    const auto check_like_delta = [&](const char *name, const Tensor &t) {
        detail::check_on_device(op, delta.device(), t);
        detail::check_same_dtype(op, name, t, delta);
        detail::check_shape(op, name, t, delta.shape());
    };
    detail::check_defined(op, "residual", residual);
    check_like_delta("residual", residual);
    if (delta2.defined()) check_like_delta("delta2", delta2); // optional
    if (delta.numel() == 0) return;
    const Tensor dc = delta.contiguous(), d2c = contiguous_or_none(delta2), wc = weight.contiguous(),
                 bc = contiguous_or_none(bias), w2c = contiguous_or_none(weight2), b2c = contiguous_or_none(bias2);
    // residual is updated in place: a strided one is worked on as a dense copy and written back.
    const Tensor rc = residual.contiguous();
    const auto run = [&](const Tensor &dst, const Tensor &dst2) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::add_layer_norm(dst, rc, dc, d2c, wc, bc, eps, dst2, w2c, b2c),
                                cuda::add_layer_norm(dst, rc, dc, d2c, wc, bc, eps, dst2, w2c, b2c));
    };
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        if (!out2.defined()) return run(dst, Tensor());
        detail::with_contiguous_out(out2, [&](const Tensor &dst2) { run(dst, dst2); });
    });
    if (!residual.is_contiguous()) Tensor(residual).copy_(rc);
}

} // namespace llaisys::ops
