// A projection's weight as a model holds it: a dense tensor in the model's dtype, or GGUF blocks kept
// as the file stores them (QuantMatrix). The model's layer code calls linear, linear_swiglu, linear_geglu,
// linear_gelu and embedding below and never asks which one it has; the weight decides which kernel runs.
#pragma once
#include "llaisys/quant.hpp"
#include "llaisys/tensor.hpp"

#include <string>
#include <vector>

namespace llaisys::models {

struct LinearWeight {
    Tensor dense;      // [N, K] in the model dtype, or undefined
    QuantMatrix quant; // [N, K] blocks, or undefined; at most one of the two is defined

    bool defined() const { return dense.defined() || quant.defined(); }
    bool quantized() const { return quant.defined(); }
    // "bf16", "q4_k", ...: what the weight is stored as
    std::string format() const;
    int64_t nbytes() const; // of what it is stored as: the dense tensor or the blocks
};

// out = x @ W^T (+ bias). Dense weights are constant once loaded (ops::linear's constant_weight).
// scratch: where a quantized weight is decoded when x has more than kQuantGemvMaxRows rows, for the dense
// op (cuBLASLt on CUDA) to run on: a flat tensor of the compute dtype with at least N * K elements, shared
// by every weight of a model (decode_scratch below). CUDA models pass one; undefined (the CPU, whose
// quantized kernels take any number of rows), the quantized op runs for every x.
void linear(const Tensor &out, const Tensor &x, const LinearWeight &w, const Tensor &scratch,
            const Tensor &bias = Tensor());
// out = swiglu(x @ W[:I]^T, x @ W[I:]^T) for W = [gate; up] of 2I rows; scratch as for linear.
void linear_swiglu(const Tensor &out, const Tensor &x, const LinearWeight &w_gate_up, const Tensor &scratch);
// out = geglu(x @ W[:I]^T, x @ W[I:]^T) (gelu(gate) * up, tanh or erf GELU); scratch as for linear.
void linear_geglu(const Tensor &out, const Tensor &x, const LinearWeight &w_gate_up, const Tensor &scratch,
                  bool tanh_approx);
// out = gelu(x @ W^T (+ bias)); scratch as for linear.
void linear_gelu(const Tensor &out, const Tensor &x, const LinearWeight &w, const Tensor &scratch, const Tensor &bias,
                 bool tanh_approx);
// out [n, K] = rows of W picked by ids [n].
void embedding(const Tensor &out, const Tensor &ids, const LinearWeight &w);

// The buffer linear/linear_swiglu decode quantized weights into on CUDA: [max N * K] of dtype, for the
// largest quantized weight among `weights` (those the model passes to linear); undefined when none is
// quantized or the device is not CUDA. One per model: its steps run on one stream, so each decode waits
// for the GEMM that read the previous weight, eagerly and inside a captured graph alike.
Tensor decode_scratch(const std::vector<const LinearWeight *> &weights, DType dtype, Device device);

} // namespace llaisys::models
