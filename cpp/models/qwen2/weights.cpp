// Weight names (as in HF checkpoints) -> the model's tensors, with strict shape checks; fusion of the
// q/k/v and gate/up projections.
#include "llaisys/ops.hpp"
#include "models/qwen2/layer.hpp"

#include <cstdlib>

namespace llaisys::models {

namespace {
using L = Qwen2::Layer;

struct Field {
    const char *name;                 // after "model.layers.N."
    Tensor L::*tensor = nullptr;      // a norm or a bias ...
    LinearWeight L::*linear = nullptr; // ... or a projection (dense or quantized)
    Shape shape;
    bool fusable = false; // part of wqkv / bqkv / w_gate_up when projections are fused
};

// Every per-layer weight with its expected shape: the one table both lookup and completeness use.
std::vector<Field> layer_fields(const Qwen2Config &c) {
    const int64_t H = c.hidden_size, I = c.intermediate_size;
    const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
    return {
        {"input_layernorm.weight", &L::input_norm, nullptr, {H}},
        {"self_attn.q_proj.weight", nullptr, &L::wq, {q, H}, true},
        {"self_attn.q_proj.bias", &L::bq, nullptr, {q}, true},
        {"self_attn.k_proj.weight", nullptr, &L::wk, {kv, H}, true},
        {"self_attn.k_proj.bias", &L::bk, nullptr, {kv}, true},
        {"self_attn.v_proj.weight", nullptr, &L::wv, {kv, H}, true},
        {"self_attn.v_proj.bias", &L::bv, nullptr, {kv}, true},
        {"self_attn.o_proj.weight", nullptr, &L::wo, {H, q}},
        {"post_attention_layernorm.weight", &L::post_norm, nullptr, {H}},
        {"mlp.gate_proj.weight", nullptr, &L::w_gate, {I, H}, true},
        {"mlp.up_proj.weight", nullptr, &L::w_up, {I, H}, true},
        {"mlp.down_proj.weight", nullptr, &L::w_down, {H, I}},
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

// Row slices [start, end) of a fused weight, dense or quantized.
LinearWeight rows_of(const LinearWeight &w, int64_t start, int64_t end) {
    if (w.quantized()) return {Tensor(), w.quant.slice_rows(start, end)};
    return {w.dense.slice(0, start, end), QuantMatrix()};
}

} // namespace

// Where a checkpoint name goes: a plain tensor or a projection, with its expected shape. layer is the
// layer it belongs to (null for whole-model weights); fusable: part of a fused matrix when fused_.
struct Qwen2::Slot {
    Tensor *tensor = nullptr;
    LinearWeight *linear = nullptr;
    Shape shape;
    Layer *layer = nullptr;
    bool fusable = false;
    bool found() const { return tensor || linear; }
};

Qwen2::Slot Qwen2::weight_slot(const std::string &name) {
    const int64_t H = config_.hidden_size, V = config_.vocab_size;
    if (name == "model.embed_tokens.weight") return {nullptr, &embed_, {V, H}};
    if (name == "model.norm.weight") return {&final_norm_, nullptr, {H}};
    if (name == "lm_head.weight") return config_.tie_word_embeddings ? Slot{} : Slot{nullptr, &lm_head_, {V, H}};
    const auto [index, field] = split_layer_name(name);
    if (index < 0 || index >= long(layers_.size())) return {};
    Layer &layer = layers_[size_t(index)];
    for (const Field &f : layer_fields(config_))
        if (field == f.name)
            return {f.tensor ? &(layer.*f.tensor) : nullptr, f.linear ? &(layer.*f.linear) : nullptr, f.shape, &layer,
                    fused_ && f.fusable};
    return {};
}

// With fused projections the q/k/v biases live in one [(nh + 2 nkvh) hd] tensor per layer that
// load_weight fills in place (the weights' fused matrices are made when their first part arrives).
void Qwen2::allocate_fused_biases() {
    const int64_t q = config_.num_heads * config_.head_dim, kv = config_.num_kv_heads * config_.head_dim;
    for (Layer &L : layers_) {
        L.bqkv = Tensor::empty({q + 2 * kv}, dtype_, device_);
        L.bq = L.bqkv.slice(0, 0, q);
        L.bk = L.bqkv.slice(0, q, q + kv);
        L.bv = L.bqkv.slice(0, q + kv, q + 2 * kv);
    }
}

// The fused matrix a fusable projection belongs to, and its first row there.
std::pair<LinearWeight *, int64_t> Qwen2::fused_home(Layer &L, const LinearWeight *part) const {
    const int64_t q = config_.num_heads * config_.head_dim, kv = config_.num_kv_heads * config_.head_dim;
    if (part == &L.wq) return {&L.wqkv, 0};
    if (part == &L.wk) return {&L.wqkv, q};
    if (part == &L.wv) return {&L.wqkv, q + kv};
    if (part == &L.w_gate) return {&L.w_gate_up, 0};
    return {&L.w_gate_up, config_.intermediate_size};
}

int64_t Qwen2::fused_rows(bool qkv) const {
    return qkv ? (config_.num_heads + 2 * config_.num_kv_heads) * config_.head_dim : 2 * config_.intermediate_size;
}

void Qwen2::load_weight(const std::string &name, const Tensor &value) {
    ready_ = false;
    ++weights_version_; // a captured step holds the old weights' addresses
    Slot slot = weight_slot(name);
    LLAISYS_CHECK(slot.found(), std::invalid_argument, "Qwen2: unexpected weight '", name, "'",
                  config_.tie_word_embeddings && name == "lm_head.weight" ? " (the model ties its embeddings)" : "");
    LLAISYS_CHECK(value.defined() && value.shape() == slot.shape, std::invalid_argument, "Qwen2: weight '", name,
                  "' has shape ", value.defined() ? shape_str(value.shape()) : "undefined", ", expected ",
                  shape_str(slot.shape));
    LLAISYS_CHECK(is_float(value.dtype()), TypeError, "Qwen2: weight '", name, "' has dtype ",
                  dtype_name(value.dtype()), ", expected a float dtype");
    Tensor *dst = slot.tensor;
    if (slot.linear) {
        slot.linear->quant = QuantMatrix(); // a quantized weight loaded before is replaced
        if (slot.fusable) { // a dense part of a fused matrix: its row slice, filled in place
            auto [fused, start] = fused_home(*slot.layer, slot.linear);
            if (!fused->dense.defined())
                *fused = {Tensor::empty({fused_rows(fused == &slot.layer->wqkv), config_.hidden_size}, dtype_, device_),
                          QuantMatrix()};
            *slot.linear = rows_of(*fused, start, start + slot.shape[0]);
        }
        dst = &slot.linear->dense;
    }
    const bool in_place = slot.fusable; // biases and projections of a fused matrix are filled in place
    if (!in_place && value.device() == device_ && value.dtype() == dtype_ && value.is_contiguous()) {
        *dst = value; // zero-copy: e.g. a bf16 CPU model straight from the memory-mapped checkpoint
    } else {
        const Tensor on_device = value.device() == device_ ? value : value.contiguous().to(device_);
        Tensor target = in_place ? *dst : Tensor::empty(slot.shape, dtype_, device_);
        ops::cast(target, on_device); // same dtype: a copy
        *dst = target;
    }
    loaded_.insert(name);
}

void Qwen2::load_quant_weight(const std::string &name, const QuantMatrix &value) {
    ready_ = false;
    ++weights_version_;
    Slot slot = weight_slot(name);
    LLAISYS_CHECK(slot.found(), std::invalid_argument, "Qwen2: unexpected weight '", name, "'",
                  config_.tie_word_embeddings && name == "lm_head.weight" ? " (the model ties its embeddings)" : "");
    LLAISYS_CHECK(slot.linear, TypeError, "Qwen2: weight '", name,
                  "' is a norm or a bias, which the model keeps dense: load it with load_weight");
    LLAISYS_CHECK(value.defined() && value.rows() == slot.shape[0] && value.cols() == slot.shape[1],
                  std::invalid_argument, "Qwen2: quantized weight '", name, "' is [", value.rows(), ", ", value.cols(),
                  "], expected ", shape_str(slot.shape));
    // The part stands alone until fuse_layer stacks it with its siblings; a dense fused matrix it was a slice
    // of stays for its other parts.
    *slot.linear = {Tensor(), value.to(device_)};
    loaded_.insert(name);
}

// Runs fused only where every part is in the fused matrix: dense parts are its slices already; quantized
// parts of one block format are stacked into it now (one copy; the parts then become its slices).
void Qwen2::fuse_layer(Layer &L) {
    L.fused_qkv = L.fused_gate_up = false;
    if (!fused_) return;
    const auto fuse = [](LinearWeight &fused, std::initializer_list<LinearWeight *> parts) {
        bool dense = fused.dense.defined(), quant = true;
        for (LinearWeight *p : parts) {
            dense = dense && p->dense.defined();
            quant = quant && p->quantized() && p->quant.format() == (*parts.begin())->quant.format();
        }
        if (dense || !quant) return dense;
        std::vector<QuantMatrix> mats;
        for (LinearWeight *p : parts) mats.push_back(p->quant);
        fused = {Tensor(), QuantMatrix::concat_rows(mats)};
        int64_t r = 0;
        for (LinearWeight *p : parts) {
            const int64_t n = p->quant.rows();
            *p = rows_of(fused, r, r + n);
            r += n;
        }
        return true;
    };
    L.fused_qkv = fuse(L.wqkv, {&L.wq, &L.wk, &L.wv});
    L.fused_gate_up = fuse(L.w_gate_up, {&L.w_gate, &L.w_up});
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

std::vector<std::tuple<std::string, std::string, int64_t>> Qwen2::weight_formats() const {
    auto dense = [](const Tensor &t) {
        return t.defined() ? LinearWeight{t, QuantMatrix()} : LinearWeight{};
    };
    std::vector<std::tuple<std::string, std::string, int64_t>> out;
    auto add = [&out](std::string name, const LinearWeight &w) { out.emplace_back(std::move(name), w.format(), w.nbytes()); };
    add("model.embed_tokens.weight", embed_);
    if (!config_.tie_word_embeddings) add("lm_head.weight", lm_head_);
    add("model.norm.weight", dense(final_norm_));
    for (size_t i = 0; i < layers_.size(); ++i)
        for (const Field &f : layer_fields(config_))
            add("model.layers." + std::to_string(i) + "." + f.name,
                f.linear ? layers_[i].*f.linear : dense(layers_[i].*f.tensor));
    return out;
}

// Bytes the weights occupy: each buffer once (the parts of a fused matrix are its slices).
int64_t Qwen2::weight_bytes() const {
    auto tensor_bytes = [](const Tensor &t) { return t.defined() ? t.numel() * int64_t(t.element_size()) : 0; };
    auto group = [](const LinearWeight &fused, bool is_fused, std::initializer_list<const LinearWeight *> parts) {
        if (is_fused) return fused.nbytes();
        int64_t n = LinearWeight{fused.dense, QuantMatrix()}.nbytes();
        for (const LinearWeight *p : parts)
            if (p->quantized() || !fused.dense.defined()) n += p->nbytes();
        return n;
    };
    int64_t total = embed_.nbytes() + lm_head_.nbytes() + tensor_bytes(final_norm_);
    for (const Layer &L : layers_) {
        total += tensor_bytes(L.input_norm) + tensor_bytes(L.post_norm) + L.wo.nbytes() + L.w_down.nbytes();
        total += group(L.wqkv, L.fused_qkv, {&L.wq, &L.wk, &L.wv});
        total += group(L.w_gate_up, L.fused_gate_up, {&L.w_gate, &L.w_up});
        total += L.bqkv.defined() ? tensor_bytes(L.bqkv) : tensor_bytes(L.bq) + tensor_bytes(L.bk) + tensor_bytes(L.bv);
    }
    return total;
}

} // namespace llaisys::models
