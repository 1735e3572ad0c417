// Qwen3 (dense): a Llama-style decoder with an RMSNorm over each head of q and k before RoPE, no q/k/v bias,
// and a head_dim of its own (not hidden / heads).
#include "models/arch/common_keys.hpp"
#include "models/common/table.hpp"

namespace llaisys::models {

Architecture qwen3_architecture() {
    Architecture a;
    a.name = "qwen3";
    a.hf_architectures = {"Qwen3ForCausalLM"};
    a.gguf_arch = "qwen3";
    a.defaults.arch = "qwen3";
    a.defaults.qk_norm = true;
    a.keys = arch::llama_style_keys();
    a.keys.push_back({"qkv_bias", "attention_bias", ""});
    a.keys.push_back({"o_bias", "attention_bias", ""});
    a.weights = table::llama_style;
    return a;
}

} // namespace llaisys::models
