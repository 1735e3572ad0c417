// The Qwen2 model: its config checks, construction and the once-per-load readiness check. The layer
// math of a step is in step.cpp, the weight table in weights.cpp.
#include "llaisys/qwen2.hpp"

#include "core/runtime.hpp"
#include "llaisys/stream.hpp"
#include "models/qwen2/layer.hpp"

namespace llaisys::models {

// A model's weights are written once (load_weight), then only read: linear() tells the dense kernels
// so (constant_weight), which lets the M = 1 GEMV start reading them early (not so the decode scratch
// quantized weights are decoded into on CUDA, rewritten weight after weight). check_ready() synchronizes
// the device once after loading so no kernel that wrote a weight is still running. A weight taken
// zero-copy from the caller must not be changed in place afterwards without load_weight again.

void Qwen2Config::validate() const {
    auto positive = [](int64_t v, const char *name) {
        LLAISYS_CHECK(v > 0, std::invalid_argument, "Qwen2Config: ", name, " must be positive, got ", v);
    };
    positive(vocab_size, "vocab_size");
    positive(hidden_size, "hidden_size");
    positive(intermediate_size, "intermediate_size");
    positive(num_layers, "num_hidden_layers");
    positive(num_heads, "num_attention_heads");
    positive(num_kv_heads, "num_key_value_heads");
    positive(head_dim, "head_dim");
    LLAISYS_CHECK(num_heads % num_kv_heads == 0, std::invalid_argument, "Qwen2Config: num_attention_heads (",
                  num_heads, ") must be a multiple of num_key_value_heads (", num_kv_heads, ")");
    LLAISYS_CHECK(head_dim % 2 == 0, std::invalid_argument, "Qwen2Config: head_dim must be even, got ", head_dim);
    LLAISYS_CHECK(rms_norm_eps > 0 && rope_theta > 0, std::invalid_argument,
                  "Qwen2Config: rms_norm_eps and rope_theta must be positive");
}

Qwen2::Qwen2(const Qwen2Config &config, DType dtype, Device device, std::optional<bool> fused)
    : config_(config), dtype_(dtype), device_(device) {
    config_.validate();
    LLAISYS_CHECK(is_float(dtype), TypeError, "Qwen2: compute dtype must be f32, f16 or bf16, got ", dtype_name(dtype));
    check_device_available(device);
    layers_.resize(size_t(config.num_layers));
    // On the CPU the checkpoint's memory-mapped tensors are used in place, which fusing would copy.
    fused_ = fused.value_or(device.is_cuda());
    if (fused_) allocate_fused_biases();
}

Qwen2::~Qwen2() = default;

void Qwen2::check_ready() {
    if (ready_) return; // checked once after the last load_weight, not on every decode step
    const auto missing = missing_weights();
    LLAISYS_CHECK(missing.empty(), std::invalid_argument, "Qwen2: ", missing.size(), " weight(s) not loaded, e.g. '",
                  missing.empty() ? "" : missing.front(), "'");
    LLAISYS_CHECK(!device_.is_cuda() || !current_stream(device_).capturing(), std::logic_error,
                  "Qwen2: the first step after load_weight waits for the weights to be written and cannot be "
                  "captured into a CUDA graph; run one step before capturing");
    for (Layer &L : layers_) fuse_layer(L);
    // CUDA, quantized: the one buffer multi-row steps decode each weight into (linear's scratch), taken
    // now so that a KV cache sized from the free memory afterwards leaves room for it. After a reload the
    // old one is released first (graphs that held its address are dropped: weights_version).
    decode_scratch_ = Tensor();
    decode_scratch_ = decode_scratch(projections(), dtype_, device_);
    if (device_.is_cuda()) synchronize(device_); // constant weights: every weight-writing kernel is done
    ready_ = true;
}

std::vector<const LinearWeight *> Qwen2::projections() const {
    std::vector<const LinearWeight *> out{&lm_head()};
    for (const Layer &L : layers_) {
        if (L.fused_qkv) out.push_back(&L.wqkv);
        else out.insert(out.end(), {&L.wq, &L.wk, &L.wv});
        if (L.fused_gate_up) out.push_back(&L.w_gate_up);
        else out.insert(out.end(), {&L.w_gate, &L.w_up});
        out.insert(out.end(), {&L.wo, &L.w_down});
    }
    return out;
}

int64_t Qwen2::decode_scratch_bytes() const {
    return decode_scratch_.defined() ? decode_scratch_.numel() * int64_t(decode_scratch_.element_size()) : 0;
}

} // namespace llaisys::models
