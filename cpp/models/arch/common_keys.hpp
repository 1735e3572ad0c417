// The config keys every Llama-style family shares: HF config.json names and llama.cpp's GGUF metadata names.
#pragma once
#include "llaisys/model.hpp"

namespace llaisys::models::arch {

inline std::vector<ConfigKey> llama_style_keys() {
    return {
        {"vocab_size", "vocab_size", "{arch}.vocab_size"},
        {"hidden_size", "hidden_size", "{arch}.embedding_length"},
        {"intermediate_size", "intermediate_size", "{arch}.feed_forward_length"},
        {"num_hidden_layers", "num_hidden_layers", "{arch}.block_count"},
        {"num_attention_heads", "num_attention_heads", "{arch}.attention.head_count"},
        {"num_key_value_heads", "num_key_value_heads", "{arch}.attention.head_count_kv"},
        {"head_dim", "head_dim", "{arch}.attention.key_length"},
        {"norm_eps", "rms_norm_eps", "{arch}.attention.layer_norm_rms_epsilon"},
        {"rope_theta", "rope_theta", "{arch}.rope.freq_base"},
        {"tie_word_embeddings", "tie_word_embeddings", ""},
    };
}

} // namespace llaisys::models::arch
