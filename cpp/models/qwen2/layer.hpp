#pragma once
#include "llaisys/qwen2.hpp"
#include "llaisys/linear_weight.hpp"

namespace llaisys::models {

// One decoder layer's weights on the model device: norms and biases in the model dtype, projections
// dense in the model dtype or quantized (GGUF blocks as stored in the file).
struct Qwen2::Layer {
    Tensor input_norm;                   // [H]
    LinearWeight wq, wk, wv;             // [nh*hd, H]; [nkvh*hd, H] (k and v)
    Tensor bq, bk, bv;                   // [nh*hd]; [nkvh*hd]
    LinearWeight wo;                     // [H, nh*hd]
    Tensor post_norm;                    // [H]
    LinearWeight w_gate, w_up, w_down;   // [I, H], [I, H], [H, I]
    // Fused projections (Qwen2::fused_projections()): one [(nh + 2 nkvh) hd, H] q/k/v matrix with its
    // bias, one [2I, H] gate/up matrix. Dense: the per-projection weights and biases are row slices of
    // the fused ones, filled in place by load_weight (fusing costs no memory). Quantized: the fused
    // matrix is built once all three (two) parts are loaded, when they share one block format, and the
    // parts become its slices. fused_qkv / fused_gate_up say whether this layer runs fused.
    LinearWeight wqkv, w_gate_up;
    Tensor bqkv;
    bool fused_qkv = false, fused_gate_up = false;
};

} // namespace llaisys::models
