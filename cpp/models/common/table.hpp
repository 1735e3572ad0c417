// Writing a family's weight table once: whole-model entries and per-layer entries with their shapes in
// terms of the config (H hidden, I intermediate, Q = heads * head_dim, KV = kv heads * head_dim, D head_dim,
// V vocab, QKV = Q + 2 KV) and the trait they depend on; expand() turns them into the WeightSpecs of a concrete config.
#pragma once
#include "llaisys/model.hpp"

#include <vector>

namespace llaisys::models::table {

enum class Dim { none, H, I, Q, KV, D, V, QKV }; // QKV: (heads + 2 kv heads) * head_dim
enum class When { always, untied, qkv_bias, o_bias, mlp_bias, qk_norm, layer_norm, gated, sandwich };

struct Entry {
    const char *role;
    const char *hf;   // after the layer prefix for layer entries
    const char *gguf; // after "blk.N." for layer entries
    Dim rows, cols;   // cols none: a vector [rows]
    const char *group = "";
    int split_dim = -1;
    When when = When::always;
};

// layer_prefix: the HF name of layer N's weights starts with layer_prefix + N + "."
std::vector<WeightSpec> expand(const ModelConfig &c, const std::vector<Entry> &globals,
                               const char *layer_prefix, const std::vector<Entry> &layer);

// The weights of a Llama-style decoder (Llama, Mistral, Qwen2, Qwen3): HF's LlamaForCausalLM names and
// llama.cpp's GGUF names, biases and q/k norms where the config has them.
std::vector<WeightSpec> llama_style(const ModelConfig &c);

} // namespace llaisys::models::table
