// GPT-NeoX (Pythia): LayerNorm with biases, a parallel residual x + attn(ln1(x)) + mlp(ln2(x)) (serial when
// use_parallel_residual is false), a plain GELU MLP with biases, partial rotary (rotary_pct), and one fused
// q/k/v matrix whose rows are interleaved per head ([q_h; k_h; v_h] for each head h: role "qkv_heads").
#include "models/common/table.hpp"

namespace llaisys::models {

namespace {
std::vector<WeightSpec> gpt_neox_weights(const ModelConfig &c) {
    using namespace table;
    static const std::vector<Entry> globals = {
        {"embed", "gpt_neox.embed_in.weight", "token_embd.weight", Dim::V, Dim::H, "", 0},
        {"final_norm", "gpt_neox.final_layer_norm.weight", "output_norm.weight", Dim::H, Dim::none},
        {"final_norm_bias", "gpt_neox.final_layer_norm.bias", "output_norm.bias", Dim::H, Dim::none},
        {"lm_head", "embed_out.weight", "output.weight", Dim::V, Dim::H, "", 0, When::untied},
    };
    static const std::vector<Entry> layer = {
        {"attn_norm", "input_layernorm.weight", "attn_norm.weight", Dim::H, Dim::none},
        {"attn_norm_bias", "input_layernorm.bias", "attn_norm.bias", Dim::H, Dim::none},
        {"qkv_heads", "attention.query_key_value.weight", "attn_qkv.weight", Dim::QKV, Dim::H, "qkv", 0},
        {"qkv_heads_bias", "attention.query_key_value.bias", "attn_qkv.bias", Dim::QKV, Dim::none, "qkv", 0},
        {"o", "attention.dense.weight", "attn_output.weight", Dim::H, Dim::Q, "", 1},
        {"o_bias", "attention.dense.bias", "attn_output.bias", Dim::H, Dim::none},
        {"mlp_norm", "post_attention_layernorm.weight", "ffn_norm.weight", Dim::H, Dim::none},
        {"mlp_norm_bias", "post_attention_layernorm.bias", "ffn_norm.bias", Dim::H, Dim::none},
        {"up", "mlp.dense_h_to_4h.weight", "ffn_up.weight", Dim::I, Dim::H, "", 0},
        {"up_bias", "mlp.dense_h_to_4h.bias", "ffn_up.bias", Dim::I, Dim::none, "", 0},
        {"down", "mlp.dense_4h_to_h.weight", "ffn_down.weight", Dim::H, Dim::I, "", 1},
        {"down_bias", "mlp.dense_4h_to_h.bias", "ffn_down.bias", Dim::H, Dim::none},
    };
    return expand(c, globals, "gpt_neox.layers.", layer);
}
} // namespace

Architecture gpt_neox_architecture() {
    Architecture a;
    a.name = "gpt_neox";
    a.hf_architectures = {"GPTNeoXForCausalLM"};
    a.gguf_arch = "gptneox";
    ModelConfig &d = a.defaults;
    d.arch = "gpt_neox";
    d.norm = NormKind::layer;
    d.norm_eps = 1e-5f;
    d.activation = Activation::gelu;
    d.gated_mlp = false;
    d.parallel_residual = true;
    d.qkv_bias = d.o_bias = d.mlp_bias = true;
    d.partial_rotary_factor = 0.25f;
    a.keys = {
        {"vocab_size", "vocab_size", "{arch}.vocab_size"},
        {"hidden_size", "hidden_size", "{arch}.embedding_length"},
        {"intermediate_size", "intermediate_size", "{arch}.feed_forward_length"},
        {"num_hidden_layers", "num_hidden_layers", "{arch}.block_count"},
        {"num_attention_heads", "num_attention_heads", "{arch}.attention.head_count"},
        {"norm_eps", "layer_norm_eps", "{arch}.attention.layer_norm_epsilon"},
        {"rope_theta", "rotary_emb_base", "{arch}.rope.freq_base"},
        {"partial_rotary_factor", "rotary_pct", ""},
        {"parallel_residual", "use_parallel_residual", "{arch}.use_parallel_residual"},
        {"tie_word_embeddings", "tie_word_embeddings", ""},
    };
    a.weights = gpt_neox_weights;
    return a;
}

} // namespace llaisys::models
