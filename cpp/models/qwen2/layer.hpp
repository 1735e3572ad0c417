#pragma once
#include "llaisys/graph.hpp"
#include "llaisys/qwen2.hpp"
#include "models/qwen2/staging.hpp"

namespace llaisys::models {

// One decoder layer's weights, in the model dtype on the model device.
struct Qwen2::Layer {
    Tensor input_norm;                 // [H]
    Tensor wq, bq, wk, bk, wv, bv;     // [nh*hd, H], [nh*hd]; [nkvh*hd, H], [nkvh*hd] (k and v)
    Tensor wo;                         // [H, nh*hd]
    Tensor post_norm;                  // [H]
    Tensor w_gate, w_up, w_down;       // [I, H], [I, H], [H, I]
    // With fused projections (Qwen2::fused_projections()) the q/k/v weights and biases are row slices
    // of one [(nh + 2 nkvh) hd, H] matrix and [(nh + 2 nkvh) hd] bias, gate/up of one [2I, H] matrix:
    // load_weight copies each checkpoint tensor into its slice, so fusing costs no extra memory.
    Tensor wqkv, bqkv, w_gate_up;
};

struct Qwen2::Staging : InputStaging {
    using InputStaging::InputStaging;
};

// The decode step as one CUDA graph: inputs go to fixed device buffers, the graph replays every kernel
// of the step, and its logits buffer is owned by the graph.
struct Qwen2::DecodeGraph {
    int slot = -1;
    Tensor ids, pos, kv_len, logits; // [1] i64 each; logits [1, V]
    std::unique_ptr<Graph> graph;
};

} // namespace llaisys::models
