// Llama (Llama 2, 3, 3.1/3.2 with rope_type llama3; TinyLlama, SmolLM shapes) and Mistral, whose checkpoints
// may set a sliding window. Biases where the config asks for them (attention_bias, mlp_bias).
#include "models/arch/common_keys.hpp"
#include "models/common/table.hpp"

namespace llaisys::models {

namespace {
Architecture llama_like(const char *name, std::vector<std::string> hf, const char *gguf) {
    Architecture a;
    a.name = name;
    a.hf_architectures = std::move(hf);
    a.gguf_arch = gguf;
    a.defaults.arch = name;
    a.defaults.norm_eps = 1e-6f;
    a.keys = arch::llama_style_keys();
    a.keys.push_back({"qkv_bias", "attention_bias", ""});
    a.keys.push_back({"o_bias", "attention_bias", ""});
    a.keys.push_back({"mlp_bias", "mlp_bias", ""});
    a.weights = table::llama_style;
    a.gguf_permuted_qk = true;
    return a;
}
} // namespace

Architecture llama_architecture() { return llama_like("llama", {"LlamaForCausalLM"}, "llama"); }

// llama.cpp writes Mistral checkpoints as general.architecture "llama": a GGUF file reaches the llama entry.
Architecture mistral_architecture() {
    Architecture a = llama_like("mistral", {"MistralForCausalLM"}, "");
    a.keys.push_back({"sliding_window", "sliding_window", ""});
    return a;
}

} // namespace llaisys::models
