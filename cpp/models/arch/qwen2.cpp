// Qwen2 (Qwen2, Qwen2.5, Qwen2.5-Coder, DeepSeek-R1-Distill-Qwen): a Llama-style decoder with q/k/v biases.
#include "models/arch/common_keys.hpp"
#include "models/common/table.hpp"

namespace llaisys::models {

Architecture qwen2_architecture() {
    Architecture a;
    a.name = "qwen2";
    a.hf_architectures = {"Qwen2ForCausalLM"};
    a.gguf_arch = "qwen2";
    a.defaults.arch = "qwen2";
    a.defaults.qkv_bias = true;
    a.defaults.rope_theta = 10000.f;
    a.keys = arch::llama_style_keys();
    a.weights = table::llama_style;
    return a;
}

} // namespace llaisys::models
