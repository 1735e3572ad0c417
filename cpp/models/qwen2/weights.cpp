// Weight names (as in HF checkpoints) -> the model's tensors, with strict shape checks.
#include "llaisys/ops.hpp"
#include "llaisys/graph.hpp"
#include "models/qwen2/layer.hpp"

#include <cstdlib>

namespace llaisys::models {

namespace {
struct Field {
    const char *name; // after "model.layers.N."
    Tensor Qwen2::Layer::*member;
    Shape shape;
};

// Every per-layer weight with its expected shape: the one table both lookup and completeness use.
std::vector<Field> layer_fields(const Qwen2Config &c) {
    using L = Qwen2::Layer;
    const int64_t H = c.hidden_size, I = c.intermediate_size;
    const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
    return {
        {"input_layernorm.weight", &L::input_norm, {H}},
        {"self_attn.q_proj.weight", &L::wq, {q, H}},
        {"self_attn.q_proj.bias", &L::bq, {q}},
        {"self_attn.k_proj.weight", &L::wk, {kv, H}},
        {"self_attn.k_proj.bias", &L::bk, {kv}},
        {"self_attn.v_proj.weight", &L::wv, {kv, H}},
        {"self_attn.v_proj.bias", &L::bv, {kv}},
        {"self_attn.o_proj.weight", &L::wo, {H, q}},
        {"post_attention_layernorm.weight", &L::post_norm, {H}},
        {"mlp.gate_proj.weight", &L::w_gate, {I, H}},
        {"mlp.up_proj.weight", &L::w_up, {I, H}},
        {"mlp.down_proj.weight", &L::w_down, {H, I}},
    };
}

// "model.layers.12.mlp.up_proj.weight" -> (12, "mlp.up_proj.weight"); index -1 if not a layer name.
std::pair<long, std::string> split_layer_name(const std::string &name) {
    const std::string prefix = "model.layers.";
    if (name.rfind(prefix, 0) != 0) return {-1, ""};
    const char *digits = name.c_str() + prefix.size();
    char *end = nullptr;
    const long index = std::strtol(digits, &end, 10);
    if (end == digits || *end != '.') return {-1, ""};
    return {index, std::string(end + 1)};
}
} // namespace

// The tensor `name` refers to, with its expected shape; null when the name is unknown.
Tensor *Qwen2::weight_slot(const std::string &name, Shape &shape) {
    const int64_t H = config_.hidden_size, V = config_.vocab_size;
    auto found = [&shape](Tensor &t, Shape s) {
        shape = std::move(s);
        return &t;
    };
    if (name == "model.embed_tokens.weight") return found(embed_, {V, H});
    if (name == "model.norm.weight") return found(final_norm_, {H});
    if (name == "lm_head.weight") return config_.tie_word_embeddings ? nullptr : found(lm_head_, {V, H});
    const auto [index, field] = split_layer_name(name);
    if (index < 0 || index >= long(layers_.size())) return nullptr;
    for (const Field &f : layer_fields(config_))
        if (field == f.name) return found(layers_[size_t(index)].*f.member, f.shape);
    return nullptr;
}

void Qwen2::load_weight(const std::string &name, const Tensor &value) {
    graph_.reset(); // a captured decode step holds the old weights' addresses
    ready_ = false;
    Shape shape;
    Tensor *slot = weight_slot(name, shape);
    LLAISYS_CHECK(slot, std::invalid_argument, "Qwen2: unexpected weight '", name, "'",
                  config_.tie_word_embeddings && name == "lm_head.weight" ? " (the model ties its embeddings)" : "");
    LLAISYS_CHECK(value.defined() && value.shape() == shape, std::invalid_argument, "Qwen2: weight '", name,
                  "' has shape ", value.defined() ? shape_str(value.shape()) : "undefined", ", expected ",
                  shape_str(shape));
    LLAISYS_CHECK(is_float(value.dtype()), TypeError, "Qwen2: weight '", name, "' has dtype ",
                  dtype_name(value.dtype()), ", expected a float dtype");
    if (value.device() == device_ && value.dtype() == dtype_ && value.is_contiguous()) {
        *slot = value; // zero-copy: e.g. a bf16 CPU model straight from the memory-mapped checkpoint
        return;
    }
    const Tensor on_device = value.device() == device_ ? value : value.contiguous().to(device_);
    Tensor dst = Tensor::empty(shape, dtype_, device_);
    ops::cast(dst, on_device); // same dtype: a copy
    *slot = dst;
}

std::vector<std::string> Qwen2::missing_weights() const {
    std::vector<std::string> missing;
    if (!embed_.defined()) missing.push_back("model.embed_tokens.weight");
    if (!final_norm_.defined()) missing.push_back("model.norm.weight");
    if (!config_.tie_word_embeddings && !lm_head_.defined()) missing.push_back("lm_head.weight");
    const std::vector<Field> fields = layer_fields(config_);
    for (size_t i = 0; i < layers_.size(); ++i)
        for (const Field &f : fields)
            if (!(layers_[i].*f.member).defined())
                missing.push_back("model.layers." + std::to_string(i) + "." + f.name);
    return missing;
}

} // namespace llaisys::models
