#include "ops/quant_linear/quant_linear.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/rms_norm_rows.hpp"

#include <algorithm>
#include <cstdlib>
#include <string>

namespace llaisys::ops {

namespace {

void check_weight(const char *op, const char *name, const QuantMatrix &w, Device device) {
    LLAISYS_CHECK(w.defined(), std::invalid_argument, op, ": ", name, " is an undefined QuantMatrix");
    LLAISYS_CHECK(w.device() == device, std::invalid_argument, op, ": ", name, " is on ", w.device().str(),
                  " but the tensors are on ", device.str());
}

// t [..., K] as [rows, K] with dense rows (a view when possible, else a contiguous copy).
Tensor dense_rows(const Tensor &t, int64_t rows, int64_t cols) {
    Tensor r = t.reshape({rows, cols});
    const bool ok = (cols <= 1 || r.stride(1) == 1) && (rows <= 1 || r.stride(0) >= cols);
    return ok ? r : r.contiguous();
}

// x [..., K] and out [..., N] for a weight of N rows and K cols; returns M.
int64_t check_x_out(const char *op, const Tensor &out, const Tensor &x, int64_t N, int64_t K, const char *wname,
                    const QuantMatrix &w) {
    detail::check_defined(op, "out", out);
    detail::check_defined(op, "x", x);
    detail::check_same_device(op, {&out, &x});
    check_weight(op, wname, w, x.device());
    detail::check_float(op, "x", x);
    detail::check_same_dtype(op, "out", out, x);
    LLAISYS_CHECK(x.ndim() >= 1 && x.size(-1) == K, std::invalid_argument, op, ": x's last dim must equal ", wname,
                  "'s cols K = ", K, " (", wname, " is ", quant_format_info(w.format()).name, " [", w.rows(), ", ",
                  w.cols(), "]), got x of shape ", shape_str(x.shape()));
    Shape want = x.shape();
    want.back() = N;
    detail::check_shape(op, "out", out, want);
    detail::check_no_overlap(op, "out", out, "x", x);
    return x.numel() / K;
}

} // namespace

void quant_linear(const Tensor &out, const Tensor &x, const QuantMatrix &weight, const Tensor &bias) {
    constexpr const char *op = "quant_linear";
    check_weight(op, "weight", weight, x.defined() ? x.device() : weight.device());
    const int64_t N = weight.rows(), K = weight.cols();
    const int64_t M = check_x_out(op, out, x, N, K, "weight", weight);
    if (bias.defined()) {
        detail::check_same_device(op, {&x, &bias});
        detail::check_same_dtype(op, "bias", bias, x);
        detail::check_shape(op, "bias", bias, {N});
        detail::check_no_overlap(op, "out", out, "bias", bias);
    }
    if (M == 0 || N == 0) return;
    const Tensor x2 = dense_rows(x, M, K), b = bias.defined() ? bias.contiguous() : Tensor();
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        const Tensor o2 = dst.view({M, N});
        LLAISYS_DEVICE_DISPATCH(op, o2.device(), cpu::quant_linear(o2, x2, weight, b),
                                cuda::quant_linear(o2, x2, weight, b));
    });
}

void quant_linear_swiglu(const Tensor &out, const Tensor &x, const QuantMatrix &w_gate_up) {
    constexpr const char *op = "quant_linear_swiglu";
    check_weight(op, "w_gate_up", w_gate_up, x.defined() ? x.device() : w_gate_up.device());
    LLAISYS_CHECK(w_gate_up.rows() % 2 == 0, std::invalid_argument, op,
                  ": w_gate_up must have 2I rows (I gate rows, then I up rows), got ", w_gate_up.rows());
    const int64_t I = w_gate_up.rows() / 2, K = w_gate_up.cols();
    const int64_t M = check_x_out(op, out, x, I, K, "w_gate_up", w_gate_up);
    if (M == 0 || I == 0) return;
    const Tensor x2 = dense_rows(x, M, K);
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        const Tensor o2 = dst.view({M, I});
        LLAISYS_DEVICE_DISPATCH(op, o2.device(), cpu::quant_linear_swiglu(o2, x2, w_gate_up),
                                cuda::quant_linear_swiglu(o2, x2, w_gate_up));
    });
}

static int64_t quant_tc_max_rows() {
    static const int64_t rows = [] {
        const char *e = std::getenv("LLAISYS_QUANT_TC_MAX_ROWS");
        return e != nullptr && *e != '\0' ? std::max<int64_t>(0, std::atoll(e)) : kQuantTcMaxRows;
    }();
    return rows;
}

bool quant_linear_tc(DType dtype, Device device, int64_t rows, QuantFormat format) {
    const bool kquant = format == QuantFormat::Q4_K || format == QuantFormat::Q5_K || format == QuantFormat::Q6_K;
    return device.is_cuda() && dtype_size(dtype) == 2 && kquant && rows > kQuantGemvMaxRows &&
           rows <= quant_tc_max_rows();
}

bool add_rms_norm_quant_linear_fused(DType dtype, Device device, int64_t rows, int64_t cols) {
    const int64_t nvec = cols / 8;
    return device.is_cuda() && dtype_size(dtype) == 2 && rows >= 1 && rows <= kQuantGemvMaxRows && cols % 8 == 0 &&
           nvec >= 1 && nvec <= 256 && !(nvec > 32 && nvec <= 64);
}

void add_rms_norm_quant_linear(const Tensor &out, const Tensor &residual_out, const Tensor &residual,
                               const Tensor &delta, const Tensor &norm_weight, float eps, const QuantMatrix &weight,
                               const Tensor &bias, bool swiglu) {
    constexpr const char *op = "add_rms_norm_quant_linear";
    detail::check_defined(op, "residual", residual);
    detail::check_defined(op, "residual_out", residual_out);
    detail::check_defined(op, "delta", delta);
    detail::check_defined(op, "out", out);
    LLAISYS_CHECK(residual.ndim() == 2, std::invalid_argument, op, ": residual must be [M, K], got shape ",
                  shape_str(residual.shape()));
    const int64_t M = residual.size(0), K = residual.size(1);
    detail::check_same_device(op, {&out, &residual_out, &residual, &delta});
    check_weight(op, "weight", weight, residual.device());
    detail::check_float(op, "residual", residual);
    for (const auto &[name, t] : {std::pair<const char *, const Tensor *>{"residual_out", &residual_out},
                                  {"delta", &delta}, {"out", &out}}) {
        detail::check_same_dtype(op, name, *t, residual);
        if (t != &out) detail::check_shape(op, name, *t, {M, K});
    }
    detail::check_rms_norm_args(op, residual_out, residual, norm_weight, eps); // norm_weight [K], eps >= 0
    LLAISYS_CHECK(weight.cols() == K, std::invalid_argument, op, ": weight's cols K = ", weight.cols(),
                  " must equal residual's width ", K);
    LLAISYS_CHECK(!swiglu || (weight.rows() % 2 == 0 && !bias.defined()), std::invalid_argument, op,
                  ": with swiglu the weight must have 2I rows (gate, then up) and there is no bias");
    detail::check_shape(op, "out", out, {M, swiglu ? weight.rows() / 2 : weight.rows()});
    detail::check_no_overlap(op, "residual_out", residual_out, "residual", residual);
    detail::check_no_overlap(op, "residual_out", residual_out, "delta", delta);
    detail::check_no_overlap(op, "residual_out", residual_out, "out", out);
    detail::check_no_overlap(op, "out", out, "residual", residual);
    detail::check_no_overlap(op, "out", out, "delta", delta);
    if (bias.defined()) {
        detail::check_same_device(op, {&out, &bias});
        detail::check_same_dtype(op, "bias", bias, residual);
        detail::check_shape(op, "bias", bias, {weight.rows()});
    }
    if (M == 0) return;
#ifdef LLAISYS_WITH_CUDA
    if (add_rms_norm_quant_linear_fused(residual.dtype(), residual.device(), M, K) && residual_out.is_contiguous() &&
        residual.is_contiguous() && delta.is_contiguous() && out.is_contiguous() && norm_weight.is_contiguous() &&
        (!bias.defined() || bias.is_contiguous())) {
        DeviceGuard guard(residual.device());
        if (cuda::add_rms_norm_quant_linear(out, residual_out, residual, delta, norm_weight, eps, weight, bias, swiglu))
            return;
    }
#endif
    Tensor(residual_out).copy_(residual);
    const Tensor x = Tensor::empty({M, K}, residual.dtype(), residual.device());
    add_rms_norm(x, residual_out, delta, norm_weight, eps);
    if (swiglu) quant_linear_swiglu(out, x, weight);
    else quant_linear(out, x, weight, bias);
}

void quant_embedding(const Tensor &out, const Tensor &ids, const QuantMatrix &weight) {
    constexpr const char *op = "quant_embedding";
    detail::check_defined(op, "out", out);
    detail::check_defined(op, "ids", ids);
    detail::check_same_device(op, {&out, &ids});
    check_weight(op, "weight", weight, out.device());
    detail::check_float(op, "out", out);
    detail::check_index(op, "ids", ids);
    Shape want = ids.shape();
    want.push_back(weight.cols());
    detail::check_shape(op, "out", out, want);
    const Tensor idc = ids.contiguous();
    if (idc.device().is_cpu()) // device ids are checked by the kernel, without a host sync
        detail::dispatch_index(op, idc.dtype(), idc.device(), [&](auto tag) {
            const auto *id = idc.data_as<typename decltype(tag)::type>();
            for (int64_t i = 0; i < idc.numel(); ++i)
                LLAISYS_CHECK(0 <= id[i] && id[i] < weight.rows(), std::out_of_range, op, ": id ", int64_t(id[i]),
                              " at position ", i, " is outside [0, ", weight.rows(), ")");
        });
    if (idc.numel() == 0) return;
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        const Tensor o2 = dst.view({idc.numel(), weight.cols()}), i1 = idc.view({idc.numel()});
        LLAISYS_DEVICE_DISPATCH(op, o2.device(), cpu::quant_embedding(o2, i1, weight),
                                cuda::quant_embedding(o2, i1, weight));
    });
}

void quant_dequantize(const Tensor &out, const QuantMatrix &weight) {
    constexpr const char *op = "quant_dequantize";
    detail::check_defined(op, "out", out);
    check_weight(op, "weight", weight, out.device());
    detail::check_float(op, "out", out);
    detail::check_shape(op, "out", out, {weight.rows(), weight.cols()});
    if (weight.rows() == 0) return;
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::quant_dequantize(dst, weight),
                                cuda::quant_dequantize(dst, weight));
    });
}

} // namespace llaisys::ops
