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
    bool fusable = false; // a row slice of wqkv / bqkv / w_gate_up when projections are fused
};

// Every per-layer weight with its expected shape: the one table both lookup and completeness use.
std::vector<Field> layer_fields(const Qwen2Config &c) {
    using L = Qwen2::Layer;
    const int64_t H = c.hidden_size, I = c.intermediate_size;
    const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
    return {
        {"input_layernorm.weight", &L::input_norm, {H}},
        {"self_attn.q_proj.weight", &L::wq, {q, H}, true},
        {"self_attn.q_proj.bias", &L::bq, {q}, true},
        {"self_attn.k_proj.weight", &L::wk, {kv, H}, true},
        {"self_attn.k_proj.bias", &L::bk, {kv}, true},
        {"self_attn.v_proj.weight", &L::wv, {kv, H}, true},
        {"self_attn.v_proj.bias", &L::bv, {kv}, true},
        {"self_attn.o_proj.weight", &L::wo, {H, q}},
        {"post_attention_layernorm.weight", &L::post_norm, {H}},
        {"mlp.gate_proj.weight", &L::w_gate, {I, H}, true},
        {"mlp.up_proj.weight", &L::w_up, {I, H}, true},
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

// With fused projections, each layer's q/k/v and gate/up weights live in one matrix apiece; the
// per-projection tensors are row slices of it that load_weight fills in place.
void Qwen2::allocate_fused_weights() {
    const int64_t H = config_.hidden_size, I = config_.intermediate_size;
    const int64_t q = config_.num_heads * config_.head_dim, kv = config_.num_kv_heads * config_.head_dim;
    for (Layer &L : layers_) {
        L.wqkv = Tensor::empty({q + 2 * kv, H}, dtype_, device_);
        L.bqkv = Tensor::empty({q + 2 * kv}, dtype_, device_);
        L.w_gate_up = Tensor::empty({2 * I, H}, dtype_, device_);
        L.wq = L.wqkv.slice(0, 0, q);
        L.wk = L.wqkv.slice(0, q, q + kv);
        L.wv = L.wqkv.slice(0, q + kv, q + 2 * kv);
        L.bq = L.bqkv.slice(0, 0, q);
        L.bk = L.bqkv.slice(0, q, q + kv);
        L.bv = L.bqkv.slice(0, q + kv, q + 2 * kv);
        L.w_gate = L.w_gate_up.slice(0, 0, I);
        L.w_up = L.w_gate_up.slice(0, I, 2 * I);
    }
}

// The tensor `name` refers to, with its expected shape; null when the name is unknown. in_place: the
// tensor is a slice of a fused matrix, to be filled rather than replaced.
Tensor *Qwen2::weight_slot(const std::string &name, Shape &shape, bool &in_place) {
    const int64_t H = config_.hidden_size, V = config_.vocab_size;
    in_place = false;
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
        if (field == f.name) {
            in_place = fused_ && f.fusable;
            return found(layers_[size_t(index)].*f.member, f.shape);
        }
    return nullptr;
}

void Qwen2::load_weight(const std::string &name, const Tensor &value) {
    graph_.reset(); // a captured decode step holds the old weights' addresses
    ready_ = false;
    Shape shape;
    bool in_place = false;
    Tensor *slot = weight_slot(name, shape, in_place);
    LLAISYS_CHECK(slot, std::invalid_argument, "Qwen2: unexpected weight '", name, "'",
                  config_.tie_word_embeddings && name == "lm_head.weight" ? " (the model ties its embeddings)" : "");
    LLAISYS_CHECK(value.defined() && value.shape() == shape, std::invalid_argument, "Qwen2: weight '", name,
                  "' has shape ", value.defined() ? shape_str(value.shape()) : "undefined", ", expected ",
                  shape_str(shape));
    LLAISYS_CHECK(is_float(value.dtype()), TypeError, "Qwen2: weight '", name, "' has dtype ",
                  dtype_name(value.dtype()), ", expected a float dtype");
    if (!in_place && value.device() == device_ && value.dtype() == dtype_ && value.is_contiguous()) {
        *slot = value; // zero-copy: e.g. a bf16 CPU model straight from the memory-mapped checkpoint
    } else {
        const Tensor on_device = value.device() == device_ ? value : value.contiguous().to(device_);
        Tensor dst = in_place ? *slot : Tensor::empty(shape, dtype_, device_);
        ops::cast(dst, on_device); // same dtype: a copy
        *slot = dst;
    }
    loaded_.insert(name);
}

std::vector<std::string> Qwen2::missing_weights() const {
    std::vector<std::string> expected{"model.embed_tokens.weight", "model.norm.weight"};
    if (!config_.tie_word_embeddings) expected.push_back("lm_head.weight");
    const std::vector<Field> fields = layer_fields(config_);
    for (size_t i = 0; i < layers_.size(); ++i)
        for (const Field &f : fields) expected.push_back("model.layers." + std::to_string(i) + "." + f.name);
    std::vector<std::string> missing;
    for (std::string &name : expected)
        if (!loaded_.count(name)) missing.push_back(std::move(name));
    return missing;
}

} // namespace llaisys::models
