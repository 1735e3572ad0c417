#include "llaisys/linear_weight.hpp"

#include "llaisys/ops.hpp"

namespace llaisys::models {

std::string LinearWeight::format() const {
    if (quant.defined()) return quant_format_info(quant.format()).name;
    return dense.defined() ? dtype_name(dense.dtype()) : "none";
}

int64_t LinearWeight::nbytes() const {
    if (quant.defined()) return quant.nbytes();
    return dense.defined() ? dense.numel() * int64_t(dtype_size(dense.dtype())) : 0;
}

void linear(const Tensor &out, const Tensor &x, const LinearWeight &w, const Tensor &bias) {
    if (w.quantized()) ops::quant_linear(out, x, w.quant, bias);
    else ops::linear(out, x, w.dense, bias, /*constant_weight=*/true);
}

void linear_swiglu(const Tensor &out, const Tensor &x, const LinearWeight &w_gate_up) {
    if (w_gate_up.quantized()) ops::quant_linear_swiglu(out, x, w_gate_up.quant);
    else ops::linear_swiglu(out, x, w_gate_up.dense, /*constant_weight=*/true);
}

void embedding(const Tensor &out, const Tensor &ids, const LinearWeight &w) {
    if (w.quantized()) ops::quant_embedding(out, ids, w.quant);
    else ops::embedding(out, ids, w.dense);
}

} // namespace llaisys::models
