#include "llaisys/linear_weight.hpp"

#include "llaisys/ops.hpp"

#include <algorithm>

namespace llaisys::models {

std::string LinearWeight::format() const {
    if (quant.defined()) return quant_format_info(quant.format()).name;
    return dense.defined() ? dtype_name(dense.dtype()) : "none";
}

int64_t LinearWeight::nbytes() const {
    if (quant.defined()) return quant.nbytes();
    return dense.defined() ? dense.numel() * int64_t(dtype_size(dense.dtype())) : 0;
}

namespace {
// The dense weight the dense kernels read for x: w's dense tensor, or a quantized w decoded into scratch
// when there is one and x has more rows than the quantized GEMV takes (and the op's tensor-core GEMM, which
// decodes W tiles itself, does not take them); undefined when the quantized op runs.
Tensor dense_for(const LinearWeight &w, const Tensor &x, const Tensor &scratch) {
    if (!w.quantized()) return w.dense;
    const int64_t N = w.quant.rows(), K = w.quant.cols(), rows = x.numel() / K;
    if (!scratch.defined() || rows <= kQuantGemvMaxRows) return Tensor();
    if (ops::quant_linear_tc(x.dtype(), x.device(), rows, w.quant.format())) return Tensor();
    LLAISYS_CHECK(scratch.numel() >= N * K, std::invalid_argument, "linear: the decode scratch holds ",
                  scratch.numel(), " elements, the ", quant_format_info(w.quant.format()).name, " weight [", N, ", ",
                  K, "] needs ", N * K);
    const Tensor decoded = scratch.slice(0, 0, N * K).view({N, K});
    ops::quant_dequantize(decoded, w.quant);
    return decoded;
}
} // namespace

// constant_weight: a loaded dense weight is never written again; the scratch is, by the next decode (and
// this call's own decode was just enqueued), so the dense op must not read it early.
void linear(const Tensor &out, const Tensor &x, const LinearWeight &w, const Tensor &scratch, const Tensor &bias) {
    if (const Tensor d = dense_for(w, x, scratch); d.defined())
        ops::linear(out, x, d, bias, /*constant_weight=*/!w.quantized());
    else ops::quant_linear(out, x, w.quant, bias);
}

void linear_swiglu(const Tensor &out, const Tensor &x, const LinearWeight &w_gate_up, const Tensor &scratch) {
    if (const Tensor d = dense_for(w_gate_up, x, scratch); d.defined())
        ops::linear_swiglu(out, x, d, /*constant_weight=*/!w_gate_up.quantized());
    else ops::quant_linear_swiglu(out, x, w_gate_up.quant);
}

// The quantized GEMV has no GeGLU epilogue: a quantized W runs its two halves and the geglu op (the decoder
// fuses GeGLU's gate/up only for dense weights, so only a caller holding a stacked quantized W gets here).
void linear_geglu(const Tensor &out, const Tensor &x, const LinearWeight &w_gate_up, const Tensor &scratch,
                  bool tanh_approx) {
    if (const Tensor d = dense_for(w_gate_up, x, scratch); d.defined())
        return ops::linear_geglu(out, x, d, tanh_approx, /*constant_weight=*/!w_gate_up.quantized());
    const int64_t I = w_gate_up.quant.rows() / 2;
    const Tensor up = Tensor::empty(out.shape(), out.dtype(), out.device());
    ops::quant_linear(out, x, w_gate_up.quant.slice_rows(0, I), Tensor());
    ops::quant_linear(up, x, w_gate_up.quant.slice_rows(I, 2 * I), Tensor());
    ops::geglu(out, out, up, tanh_approx);
}

// A quantized W: quant_linear, then the gelu op.
void linear_gelu(const Tensor &out, const Tensor &x, const LinearWeight &w, const Tensor &scratch, const Tensor &bias,
                 bool tanh_approx) {
    if (const Tensor d = dense_for(w, x, scratch); d.defined())
        return ops::linear_gelu(out, x, d, bias, tanh_approx, /*constant_weight=*/!w.quantized());
    ops::quant_linear(out, x, w.quant, bias);
    ops::gelu(out, out, tanh_approx);
}

void embedding(const Tensor &out, const Tensor &ids, const LinearWeight &w) {
    if (w.quantized()) ops::quant_embedding(out, ids, w.quant);
    else ops::embedding(out, ids, w.dense);
}

Tensor decode_scratch(const std::vector<const LinearWeight *> &weights, DType dtype, Device device) {
    if (!device.is_cuda()) return Tensor();
    int64_t elems = 0;
    for (const LinearWeight *w : weights)
        if (w->quantized()) elems = std::max(elems, w->quant.rows() * w->quant.cols());
    return elems ? Tensor::empty({elems}, dtype, device) : Tensor();
}

} // namespace llaisys::models
