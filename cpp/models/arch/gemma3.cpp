// Gemma 3 (text): RMSNorm with (1 + w) weights, four norms a layer (before and after attention and the MLP),
// q/k RMSNorm, GeGLU with tanh GELU, embeddings scaled by sqrt(hidden), head_dim 256 with attention scale
// 1/sqrt(query_pre_attn_scalar), tied embeddings; 5 of 6 layers attend within a sliding window with their own
// RoPE base (rope_local_base_freq), every 6th globally.
#include "models/arch/common_keys.hpp"
#include "models/common/table.hpp"

namespace llaisys::models {

namespace {
std::vector<WeightSpec> gemma3_weights(const ModelConfig &c) {
    using namespace table;
    static const std::vector<Entry> globals = {
        {"embed", "model.embed_tokens.weight", "token_embd.weight", Dim::V, Dim::H, "", 0},
        {"final_norm", "model.norm.weight", "output_norm.weight", Dim::H, Dim::none},
        {"lm_head", "lm_head.weight", "output.weight", Dim::V, Dim::H, "", 0, When::untied},
    };
    static const std::vector<Entry> layer = {
        {"attn_norm", "input_layernorm.weight", "attn_norm.weight", Dim::H, Dim::none},
        {"q", "self_attn.q_proj.weight", "attn_q.weight", Dim::Q, Dim::H, "qkv", 0},
        {"k", "self_attn.k_proj.weight", "attn_k.weight", Dim::KV, Dim::H, "qkv", 0},
        {"v", "self_attn.v_proj.weight", "attn_v.weight", Dim::KV, Dim::H, "qkv", 0},
        {"q_norm", "self_attn.q_norm.weight", "attn_q_norm.weight", Dim::D, Dim::none},
        {"k_norm", "self_attn.k_norm.weight", "attn_k_norm.weight", Dim::D, Dim::none},
        {"o", "self_attn.o_proj.weight", "attn_output.weight", Dim::H, Dim::Q, "", 1},
        {"post_attn_norm", "post_attention_layernorm.weight", "post_attention_norm.weight", Dim::H, Dim::none},
        {"mlp_norm", "pre_feedforward_layernorm.weight", "ffn_norm.weight", Dim::H, Dim::none},
        {"post_mlp_norm", "post_feedforward_layernorm.weight", "post_ffw_norm.weight", Dim::H, Dim::none},
        {"gate", "mlp.gate_proj.weight", "ffn_gate.weight", Dim::I, Dim::H, "gate_up", 0},
        {"up", "mlp.up_proj.weight", "ffn_up.weight", Dim::I, Dim::H, "gate_up", 0},
        {"down", "mlp.down_proj.weight", "ffn_down.weight", Dim::H, Dim::I, "", 1},
    };
    return expand(c, globals, "model.layers.", layer);
}
} // namespace

Architecture gemma3_architecture() {
    Architecture a;
    a.name = "gemma3";
    a.hf_architectures = {"Gemma3ForCausalLM", "gemma3_text"};
    a.gguf_arch = "gemma3";
    ModelConfig &d = a.defaults;
    d.arch = "gemma3";
    d.norm_plus_one = true;
    d.activation = Activation::gelu_tanh;
    d.qk_norm = true;
    d.sandwich_norm = true;
    d.scale_embeddings = true;
    d.tie_word_embeddings = true;
    d.sliding_window = 512;
    d.sliding_window_pattern = 6;
    d.rope_local_theta = 10000.f;
    d.rope_theta = 1000000.f;
    a.keys = arch::llama_style_keys();
    a.keys.push_back({"sliding_window", "sliding_window", "{arch}.attention.sliding_window"});
    a.keys.push_back({"sliding_window_pattern", "sliding_window_pattern", ""});
    a.keys.push_back({"rope_local_theta", "rope_local_base_freq", ""});
    a.keys.push_back({"query_pre_attn_scalar", "query_pre_attn_scalar", ""});
    a.weights = gemma3_weights;
    return a;
}

} // namespace llaisys::models
