// A projection's weight as a model holds it: a dense tensor in the model's dtype, or GGUF blocks kept
// as the file stores them (QuantMatrix). The model's layer code calls linear/linear_swiglu/embedding
// below and never asks which one it has; the weight decides which kernel runs.
#pragma once
#include "llaisys/quant.hpp"
#include "llaisys/tensor.hpp"

#include <string>

namespace llaisys::models {

struct LinearWeight {
    Tensor dense;      // [N, K] in the model dtype, or undefined
    QuantMatrix quant; // [N, K] blocks, or undefined; at most one of the two is defined
    // CUDA, quantized: the weight decoded once into the compute dtype for steps of more than
    // kQuantGemvMaxRows rows, which run cuBLASLt on it. Made by prepare_gemm() when the model is
    // loaded: decoding per call would allocate inside every captured decode graph, each graph keeping
    // its own decoded model alive. (A GEMM that reads the blocks directly would make this unneeded.)
    Tensor gemm_copy;

    bool defined() const { return dense.defined() || quant.defined(); }
    bool quantized() const { return quant.defined(); }
    // "bf16", "q4_k", ...: what the weight is stored as
    std::string format() const;
    int64_t nbytes() const; // including gemm_copy
    void prepare_gemm(DType dtype); // makes gemm_copy for a quantized weight on CUDA (else nothing)
};

// out = x @ W^T (+ bias). Dense weights are constant once loaded (ops::linear's constant_weight).
void linear(const Tensor &out, const Tensor &x, const LinearWeight &w, const Tensor &bias = Tensor());
// out = swiglu(x @ W[:I]^T, x @ W[I:]^T) for W = [gate; up] of 2I rows.
void linear_swiglu(const Tensor &out, const Tensor &x, const LinearWeight &w_gate_up);
// out [n, K] = rows of W picked by ids [n].
void embedding(const Tensor &out, const Tensor &ids, const LinearWeight &w);

} // namespace llaisys::models
