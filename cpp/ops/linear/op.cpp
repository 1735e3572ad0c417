#include "ops/linear/linear.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

#include <string>

namespace llaisys::ops {

static void check_linear_args(const char *op, const Tensor &out, const Tensor &x, const Tensor &weight,
                              const Tensor &bias) {
    detail::check_operands(op, {{"out", out}, {"x", x}, {"weight", weight}});
    if (bias.defined()) detail::check_on_device(op, out.device(), bias);
    detail::check_float(op, "x", x);
    detail::check_same_dtype(op, "weight", weight, x);
    detail::check_same_dtype(op, "out", out, x);
    if (bias.defined()) detail::check_same_dtype(op, "bias", bias, x);
    // Numbers are formatted with std::to_string / shape_str: streaming an integer through concat()
    // crashed (SIGSEGV inside std::ostream) in the CUDA build on the device machine.
    LLAISYS_CHECK(weight.ndim() == 2, std::invalid_argument, op, ": weight must be 2-D [N, K], got shape ",
                  shape_str(weight.shape()));
    LLAISYS_CHECK(x.ndim() >= 1, std::invalid_argument, op, ": x must have at least 1 dim, got a scalar");
    const int64_t N = weight.size(0), K = weight.size(1);
    LLAISYS_CHECK(x.size(-1) == K, std::invalid_argument, op, ": x's last dim (", std::to_string(x.size(-1)),
                  ") must equal weight's in_features K (weight is [N, K] = ", shape_str(weight.shape()),
                  "), got x of shape ", shape_str(x.shape()));
    if (bias.defined()) detail::check_shape(op, "bias", bias, {N});
    Shape want = x.shape();
    want.back() = N;
    detail::check_shape(op, "out", out, want);
    detail::check_no_overlap(op, "out", out, "x", x);
    detail::check_no_overlap(op, "out", out, "weight", weight);
    detail::check_no_overlap(op, "out", out, "bias", bias);
}

// out [..., N] = x [..., K] @ weight [N, K]^T (+ bias [N]), then the GELU where `gelu` (linear_gelu).
static void linear_then(const char *op, bool gelu, bool tanh_approx, const Tensor &out, const Tensor &x,
                        const Tensor &weight, const Tensor &bias, bool constant_weight) {
    check_linear_args(op, out, x, weight, bias);
    const int64_t N = weight.size(0), K = weight.size(1), M = out.numel() / std::max<int64_t>(N, 1);
    if (M == 0 || N == 0) return; // nothing to write
    const Tensor x2 = detail::dense_rows(x, M, K), w2 = detail::dense_rows(weight, N, K);
    const Tensor b = bias.defined() ? bias.contiguous() : Tensor();
    // A copy of the weight was just written by a kernel: not constant for the GEMV that reads it.
    [[maybe_unused]] const bool constant = constant_weight && w2.storage() == weight.storage();
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        const Tensor o2 = dst.view({M, N});
        LLAISYS_DEVICE_DISPATCH(op, o2.device(),
                                gelu ? cpu::linear_gelu(o2, x2, w2, b, tanh_approx) : cpu::linear(o2, x2, w2, b),
                                gelu ? cuda::linear_gelu(o2, x2, w2, b, tanh_approx, constant)
                                     : cuda::linear(o2, x2, w2, b, constant));
    });
}

void linear(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, bool constant_weight) {
    linear_then("linear", false, false, out, x, weight, bias, constant_weight);
}

// linear_swiglu and linear_geglu: x [..., K], w_gate_up [2I, K], out [..., I].
static void check_linear_gated_args(const char *op, const Tensor &out, const Tensor &x, const Tensor &w) {
    detail::check_operands(op, {{"out", out}, {"x", x}, {"w_gate_up", w}});
    detail::check_float(op, "x", x);
    detail::check_same_dtype(op, "w_gate_up", w, x);
    detail::check_same_dtype(op, "out", out, x);
    LLAISYS_CHECK(w.ndim() == 2 && w.size(0) % 2 == 0, std::invalid_argument, op,
                  ": w_gate_up must be 2-D [2I, K] (I gate rows, then I up rows), got shape ", shape_str(w.shape()));
    LLAISYS_CHECK(x.ndim() >= 1, std::invalid_argument, op, ": x must have at least 1 dim, got a scalar");
    LLAISYS_CHECK(x.size(-1) == w.size(1), std::invalid_argument, op, ": x's last dim (",
                  std::to_string(x.size(-1)), ") must equal w_gate_up's K (w_gate_up is [2I, K] = ",
                  shape_str(w.shape()), "), got x of shape ", shape_str(x.shape()));
    Shape want = x.shape();
    want.back() = w.size(0) / 2;
    detail::check_shape(op, "out", out, want);
    detail::check_no_overlap(op, "out", out, "x", x);
    detail::check_no_overlap(op, "out", out, "w_gate_up", w);
}

// out [..., I] = act(x @ w_gate_up[:I]^T, x @ w_gate_up[I:]^T) with act swiglu, or geglu where `geglu`; out must
// not overlap x or w_gate_up.
static void linear_gated(const char *op, bool geglu, bool tanh_approx, const Tensor &out, const Tensor &x,
                         const Tensor &w_gate_up, bool constant_weight) {
    check_linear_gated_args(op, out, x, w_gate_up);
    const int64_t I = w_gate_up.size(0) / 2, K = w_gate_up.size(1), M = out.numel() / std::max<int64_t>(I, 1);
    if (M == 0 || I == 0) return; // nothing to write
    const Tensor x2 = detail::dense_rows(x, M, K), w2 = detail::dense_rows(w_gate_up, 2 * I, K);
    [[maybe_unused]] const bool constant = constant_weight && w2.storage() == w_gate_up.storage(); // as in linear
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        const Tensor o2 = dst.view({M, I});
        LLAISYS_DEVICE_DISPATCH(op, o2.device(),
                                geglu ? cpu::linear_geglu(o2, x2, w2, tanh_approx) : cpu::linear_swiglu(o2, x2, w2),
                                geglu ? cuda::linear_geglu(o2, x2, w2, tanh_approx, constant)
                                      : cuda::linear_swiglu(o2, x2, w2, constant));
    });
}

void linear_swiglu(const Tensor &out, const Tensor &x, const Tensor &w_gate_up, bool constant_weight) {
    linear_gated("linear_swiglu", false, false, out, x, w_gate_up, constant_weight);
}

void linear_geglu(const Tensor &out, const Tensor &x, const Tensor &w_gate_up, bool tanh_approx,
                  bool constant_weight) {
    linear_gated("linear_geglu", true, tanh_approx, out, x, w_gate_up, constant_weight);
}

void linear_gelu(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, bool tanh_approx,
                 bool constant_weight) {
    linear_then("linear_gelu", true, tanh_approx, out, x, weight, bias, constant_weight);
}

} // namespace llaisys::ops
