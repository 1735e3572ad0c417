#include "llaisys/linear_weight.hpp"

#include "llaisys/ops.hpp"

namespace llaisys::models {

std::string LinearWeight::format() const {
    if (quant.defined()) return quant_format_info(quant.format()).name;
    return dense.defined() ? dtype_name(dense.dtype()) : "none";
}

namespace {
int64_t tensor_bytes(const Tensor &t) { return t.defined() ? t.numel() * int64_t(dtype_size(t.dtype())) : 0; }

// The weight the dense kernels read for x: the dense tensor, or a quantized weight's decoded copy when x
// has more rows than the quantized GEMV takes; undefined when the quantized kernel runs.
const Tensor &dense_for(const LinearWeight &w, const Tensor &x) {
    static const Tensor none;
    if (!w.quantized()) return w.dense;
    return w.gemm_copy.defined() && x.numel() / w.quant.cols() > kQuantGemvMaxRows ? w.gemm_copy : none;
}
} // namespace

int64_t LinearWeight::nbytes() const {
    return (quant.defined() ? quant.nbytes() : tensor_bytes(dense)) + tensor_bytes(gemm_copy);
}

void LinearWeight::prepare_gemm(DType dtype) {
    if (!quant.defined() || !quant.device().is_cuda() || (gemm_copy.defined() && gemm_copy.dtype() == dtype)) return;
    // rows of the matrix picked in order: the embedding op decodes them
    Tensor ids = Tensor::empty({quant.rows()}, DType::I64, Device::cpu());
    for (int64_t r = 0; r < quant.rows(); ++r) ids.data_as<int64_t>()[r] = r;
    gemm_copy = Tensor::empty({quant.rows(), quant.cols()}, dtype, quant.device());
    ops::quant_embedding(gemm_copy, ids.to(quant.device()), quant);
}

void linear(const Tensor &out, const Tensor &x, const LinearWeight &w, const Tensor &bias) {
    if (const Tensor &d = dense_for(w, x); d.defined()) ops::linear(out, x, d, bias, /*constant_weight=*/true);
    else ops::quant_linear(out, x, w.quant, bias);
}

void linear_swiglu(const Tensor &out, const Tensor &x, const LinearWeight &w_gate_up) {
    if (const Tensor &d = dense_for(w_gate_up, x); d.defined())
        ops::linear_swiglu(out, x, d, /*constant_weight=*/true);
    else ops::quant_linear_swiglu(out, x, w_gate_up.quant);
}

void embedding(const Tensor &out, const Tensor &ids, const LinearWeight &w) {
    if (w.quantized()) ops::quant_embedding(out, ids, w.quant);
    else ops::embedding(out, ids, w.dense);
}

} // namespace llaisys::models
