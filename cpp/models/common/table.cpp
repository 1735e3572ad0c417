#include "models/common/table.hpp"

#include "llaisys/common.hpp"

namespace llaisys::models::table {

namespace {

int64_t size_of(const ModelConfig &c, Dim d) {
    switch (d) {
    case Dim::H: return c.hidden_size;
    case Dim::I: return c.intermediate_size;
    case Dim::Q: return c.num_attention_heads * c.head_dim;
    case Dim::KV: return c.num_key_value_heads * c.head_dim;
    case Dim::D: return c.head_dim;
    case Dim::V: return c.vocab_size;
    case Dim::QKV: return (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim;
    case Dim::none: break;
    }
    return 0;
}

bool applies(const ModelConfig &c, When w) {
    switch (w) {
    case When::always: return true;
    case When::untied: return !c.tie_word_embeddings;
    case When::qkv_bias: return c.qkv_bias;
    case When::o_bias: return c.o_bias;
    case When::mlp_bias: return c.mlp_bias;
    case When::qk_norm: return c.qk_norm;
    case When::layer_norm: return c.norm == NormKind::layer;
    case When::gated: return c.gated_mlp;
    case When::sandwich: return c.sandwich_norm;
    }
    return false;
}

WeightSpec spec(const ModelConfig &c, const Entry &e, std::string hf, std::string gguf, int64_t layer) {
    Shape shape{size_of(c, e.rows)};
    if (e.cols != Dim::none) shape.push_back(size_of(c, e.cols));
    return {std::move(hf), std::move(gguf), shape, e.group, e.split_dim, e.role, layer};
}

} // namespace

std::vector<WeightSpec> expand(const ModelConfig &c, const std::vector<Entry> &globals, const char *layer_prefix,
                               const std::vector<Entry> &layer) {
    std::vector<WeightSpec> out;
    for (const Entry &e : globals)
        if (applies(c, e.when)) out.push_back(spec(c, e, e.hf, e.gguf, -1));
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
        const std::string hf = layer_prefix + std::to_string(i) + ".", gguf = "blk." + std::to_string(i) + ".";
        for (const Entry &e : layer)
            if (applies(c, e.when)) out.push_back(spec(c, e, hf + e.hf, gguf + e.gguf, i));
    }
    return out;
}

std::vector<WeightSpec> llama_style(const ModelConfig &c) {
    static const std::vector<Entry> globals = {
        {"embed", "model.embed_tokens.weight", "token_embd.weight", Dim::V, Dim::H, "", 0},
        {"final_norm", "model.norm.weight", "output_norm.weight", Dim::H, Dim::none},
        {"lm_head", "lm_head.weight", "output.weight", Dim::V, Dim::H, "", 0, When::untied},
    };
    static const std::vector<Entry> layer = {
        {"attn_norm", "input_layernorm.weight", "attn_norm.weight", Dim::H, Dim::none},
        {"q", "self_attn.q_proj.weight", "attn_q.weight", Dim::Q, Dim::H, "qkv", 0},
        {"q_bias", "self_attn.q_proj.bias", "attn_q.bias", Dim::Q, Dim::none, "qkv", 0, When::qkv_bias},
        {"k", "self_attn.k_proj.weight", "attn_k.weight", Dim::KV, Dim::H, "qkv", 0},
        {"k_bias", "self_attn.k_proj.bias", "attn_k.bias", Dim::KV, Dim::none, "qkv", 0, When::qkv_bias},
        {"v", "self_attn.v_proj.weight", "attn_v.weight", Dim::KV, Dim::H, "qkv", 0},
        {"v_bias", "self_attn.v_proj.bias", "attn_v.bias", Dim::KV, Dim::none, "qkv", 0, When::qkv_bias},
        {"q_norm", "self_attn.q_norm.weight", "attn_q_norm.weight", Dim::D, Dim::none, "", -1, When::qk_norm},
        {"k_norm", "self_attn.k_norm.weight", "attn_k_norm.weight", Dim::D, Dim::none, "", -1, When::qk_norm},
        {"o", "self_attn.o_proj.weight", "attn_output.weight", Dim::H, Dim::Q, "", 1},
        {"o_bias", "self_attn.o_proj.bias", "attn_output.bias", Dim::H, Dim::none, "", -1, When::o_bias},
        {"mlp_norm", "post_attention_layernorm.weight", "ffn_norm.weight", Dim::H, Dim::none},
        {"gate", "mlp.gate_proj.weight", "ffn_gate.weight", Dim::I, Dim::H, "gate_up", 0},
        {"gate_bias", "mlp.gate_proj.bias", "ffn_gate.bias", Dim::I, Dim::none, "", 0, When::mlp_bias},
        {"up", "mlp.up_proj.weight", "ffn_up.weight", Dim::I, Dim::H, "gate_up", 0},
        {"up_bias", "mlp.up_proj.bias", "ffn_up.bias", Dim::I, Dim::none, "", 0, When::mlp_bias},
        {"down", "mlp.down_proj.weight", "ffn_down.weight", Dim::H, Dim::I, "", 1},
        {"down_bias", "mlp.down_proj.bias", "ffn_down.bias", Dim::H, Dim::none, "", -1, When::mlp_bias},
    };
    return expand(c, globals, "model.layers.", layer);
}

} // namespace llaisys::models::table
