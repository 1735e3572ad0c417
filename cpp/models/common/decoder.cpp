// The decoder's construction, its weight slots (from the family's weight table), loading with strict
// shape checks, fusion of the q/k/v and gate/up projections and the once-per-load readiness check. The
// layer math of a step is in decoder_step.cpp.
#include "models/common/decoder.hpp"

#include "core/runtime.hpp"
#include "llaisys/ops.hpp"
#include "llaisys/stream.hpp"

#include <cmath>

namespace llaisys::models {

// A model's weights are written once (load_weight), then only read: linear() tells the dense kernels so
// (constant_weight), which lets the M = 1 GEMV start reading them early. check_ready() synchronizes the
// device once after loading so no kernel that wrote a weight is still running. A weight taken zero-copy
// from the caller must not be changed in place afterwards without load_weight again.

namespace {
// Row slices [start, end) of a fused weight, dense or quantized.
LinearWeight rows_of(const LinearWeight &w, int64_t start, int64_t end) {
    if (w.quantized()) return {Tensor(), w.quant.slice_rows(start, end)};
    return {w.dense.slice(0, start, end), QuantMatrix()};
}

// RoPE's table of a layer: the global layers' base and scaling, or the windowed layers' own base unscaled
// (Gemma 3's rope_local_base_freq, as HF computes its local rotary embedding).
std::vector<float> inv_freq_of(const ModelConfig &c, bool local) {
    ops::RopeScaling s;
    if (local && c.rope_local_theta > 0) return ops::rope_inv_freq(c.rope_local_theta, c.rotary_dim(), s);
    s.type = c.rope_scaling == RopeScalingType::llama3   ? ops::RopeScaling::Type::llama3
             : c.rope_scaling == RopeScalingType::linear ? ops::RopeScaling::Type::linear
                                                         : ops::RopeScaling::Type::none;
    s.factor = c.rope_factor;
    s.low_freq_factor = c.rope_low_freq_factor;
    s.high_freq_factor = c.rope_high_freq_factor;
    s.original_max_position_embeddings = c.rope_original_max_position_embeddings;
    return ops::rope_inv_freq(c.rope_theta, c.rotary_dim(), s);
}
} // namespace

// With a communicator of more than one rank the decoder is that rank's share (tensor_parallel_config): its
// heads, KV heads and MLP width, the whole embedding and its rows of the LM head; the o and down
// projections' partial outputs are summed over the ranks (reduce), and so are the logits' slices gathered.
Decoder::Decoder(const ModelConfig &config, DType dtype, Device device, std::optional<bool> fused,
                 std::shared_ptr<Communicator> comm)
    : config_(comm && comm->world() > 1 ? tensor_parallel_config(config, comm->world()) : config), dtype_(dtype),
      device_(device), comm_(comm && comm->world() > 1 ? std::move(comm) : nullptr) {
    config_.validate();
    LLAISYS_CHECK(!comm_ || comm_->device() == device, std::invalid_argument, "model: rank ",
                  comm_ ? comm_->rank() : 0, "'s communicator is on ", comm_ ? comm_->device().str() : "",
                  ", the model on ", device.str());
    vocab_part_ = comm_ ? tensor_parallel_vocab(config, comm_->world()) : config.vocab_size;
    LLAISYS_CHECK(is_float(dtype), TypeError, "model: compute dtype must be f32, f16 or bf16, got ", dtype_name(dtype));
    check_device_available(device);
    layers_.resize(size_t(config_.num_hidden_layers));
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
        Layer &L = layers_[size_t(l)];
        const bool local = config_.layer_has_window(l);
        L.window = local ? config_.sliding_window : 0;
        L.inv_freq = inv_freq_of(config_, local);
    }
    // On the CPU the checkpoint's memory-mapped tensors are used in place, which fusing would copy.
    fused_ = fused.value_or(device.is_cuda());
    table_ = architecture(config_.arch).weights(config_);
    bind_slots();
    if (fused_ && config_.qkv_bias) allocate_fused_biases();
    if (config_.scale_embeddings) { // HF: embeddings * sqrt(hidden) in the weights' dtype
        Tensor s = Tensor::empty({1}, DType::F32, Device::cpu()), r = Tensor::empty({1}, dtype_, Device::cpu());
        *static_cast<float *>(s.data()) = std::sqrt(float(config_.hidden_size));
        ops::cast(r, s);
        ops::cast(s, r);
        embed_scale_ = *static_cast<float *>(s.data());
    }
}

// GPT-NeoX stores q/k/v as [heads, 3, head_dim] rows; the fused matrix (and bias) is q | k | v.
Tensor Decoder::to_qkv_order(const Tensor &value) const {
    const int64_t nh = config_.num_attention_heads, hd = config_.head_dim;
    const Tensor src = value.device() == device_ ? value.contiguous() : value.contiguous().to(device_);
    Tensor src_cast = src;
    if (src.dtype() != dtype_) {
        src_cast = Tensor::empty(src.shape(), dtype_, device_);
        ops::cast(src_cast, src);
    }
    Tensor out = Tensor::empty(value.shape(), dtype_, device_);
    for (int64_t h = 0; h < nh; ++h)
        for (int64_t p = 0; p < 3; ++p)
            out.slice(0, p * nh * hd + h * hd, p * nh * hd + (h + 1) * hd)
                .copy_(src_cast.slice(0, (3 * h + p) * hd, (3 * h + p + 1) * hd));
    return out;
}

void Decoder::load_heads(const Slot &s, const Tensor &value) {
    const int64_t q = config_.num_attention_heads * config_.head_dim, kv = config_.num_key_value_heads * config_.head_dim;
    Layer &L = *s.layer;
    const Tensor t = to_qkv_order(value);
    if (s.linear) {
        L.wqkv = {t, QuantMatrix()};
        L.wq = rows_of(L.wqkv, 0, q);
        L.wk = rows_of(L.wqkv, q, q + kv);
        L.wv = rows_of(L.wqkv, q + kv, q + 2 * kv);
    } else {
        L.bqkv = t;
        L.bq = t.slice(0, 0, q);
        L.bk = t.slice(0, q, q + kv);
        L.bv = t.slice(0, q + kv, q + 2 * kv);
    }
}

void Decoder::bind_slots() {
    auto layer_slot = [](Layer &L, const std::string &role) -> Slot {
        static const std::map<std::string, Tensor Layer::*> tensors = {
            {"attn_norm", &Layer::attn_norm}, {"attn_norm_bias", &Layer::attn_norm_bias},
            {"q_norm", &Layer::q_norm}, {"k_norm", &Layer::k_norm}, {"post_attn_norm", &Layer::post_attn_norm},
            {"mlp_norm", &Layer::mlp_norm}, {"mlp_norm_bias", &Layer::mlp_norm_bias},
            {"post_mlp_norm", &Layer::post_mlp_norm}, {"q_bias", &Layer::bq}, {"k_bias", &Layer::bk},
            {"v_bias", &Layer::bv}, {"o_bias", &Layer::bo}, {"gate_bias", &Layer::b_gate},
            {"up_bias", &Layer::b_up}, {"down_bias", &Layer::b_down}, {"qkv_heads_bias", &Layer::bqkv}};
        static const std::map<std::string, LinearWeight Layer::*> linears = {
            {"q", &Layer::wq}, {"k", &Layer::wk}, {"v", &Layer::wv}, {"o", &Layer::wo},
            {"gate", &Layer::w_gate}, {"up", &Layer::w_up}, {"down", &Layer::w_down}, {"qkv_heads", &Layer::wqkv}};
        Slot s;
        if (auto t = tensors.find(role); t != tensors.end()) s.tensor = &(L.*(t->second));
        else if (auto w = linears.find(role); w != linears.end()) s.linear = &(L.*(w->second));
        s.norm = role.find("norm") != std::string::npos && role.find("bias") == std::string::npos;
        s.heads = role.rfind("qkv_heads", 0) == 0;
        return s;
    };
    for (const WeightSpec &w : table_) {
        Slot s;
        if (w.layer >= 0) {
            s = layer_slot(layers_[size_t(w.layer)], w.role);
            s.layer = &layers_[size_t(w.layer)];
        } else if (w.role == "embed") s.linear = &embed_;
        else if (w.role == "lm_head") s.linear = &lm_head_;
        else if (w.role == "final_norm") s.tensor = &final_norm_, s.norm = true;
        else if (w.role == "final_norm_bias") s.tensor = &final_norm_bias_;
        LLAISYS_CHECK(s.tensor || s.linear, std::logic_error, "model: the weight table of '", config_.arch,
                      "' names an unknown role '", w.role, "' (", w.hf_name, ")");
        s.shape = w.shape;
        if (w.role == "lm_head") s.shape[0] = vocab_part_; // tensor parallel: this rank's rows
        // fusion groups are what the decoder fuses: q/k/v (with biases) and gate/up (without biases; SwiGLU,
        // or GeGLU whose dense parts fuse: fuse_layer)
        const bool fusable = (w.group == "qkv" && !s.heads) || (w.group == "gate_up" && !config_.mlp_bias);
        if (fused_ && fusable) s.group = w.group;
        slots_[w.hf_name] = s;
    }
}

const Decoder::Slot &Decoder::slot(const std::string &name) const {
    static const Slot none;
    auto it = slots_.find(name);
    if (it != slots_.end()) return it->second;
    LLAISYS_CHECK(false, std::invalid_argument, "model: unexpected weight '", name, "'",
                  config_.tie_word_embeddings && name == "lm_head.weight" ? " (the model ties its embeddings)" : "",
                  " for architecture '", config_.arch, "'");
    return none;
}

// With fused projections the q/k/v biases live in one [(nh + 2 nkvh) hd] tensor per layer that load_weight
// fills in place (the weights' fused matrices are made when their first part arrives).
void Decoder::allocate_fused_biases() {
    const int64_t q = config_.num_attention_heads * config_.head_dim, kv = config_.num_key_value_heads * config_.head_dim;
    for (Layer &L : layers_) {
        L.bqkv = Tensor::empty({q + 2 * kv}, dtype_, device_);
        L.bq = L.bqkv.slice(0, 0, q);
        L.bk = L.bqkv.slice(0, q, q + kv);
        L.bv = L.bqkv.slice(0, q + kv, q + 2 * kv);
    }
}

// The fused matrix a fusable projection belongs to, and its first row there.
std::pair<LinearWeight *, int64_t> Decoder::fused_home(Layer &L, const LinearWeight *part) const {
    const int64_t q = config_.num_attention_heads * config_.head_dim, kv = config_.num_key_value_heads * config_.head_dim;
    if (part == &L.wq) return {&L.wqkv, 0};
    if (part == &L.wk) return {&L.wqkv, q};
    if (part == &L.wv) return {&L.wqkv, q + kv};
    if (part == &L.w_gate) return {&L.w_gate_up, 0};
    return {&L.w_gate_up, config_.intermediate_size};
}

void Decoder::load_weight(const std::string &name, const Tensor &value) {
    ready_ = false;
    ++weights_version_; // a captured step holds the old weights' addresses
    Slot s = slot(name);
    LLAISYS_CHECK(value.defined() && value.shape() == s.shape, std::invalid_argument, "model: weight '", name,
                  "' has shape ", value.defined() ? shape_str(value.shape()) : "undefined", ", expected ",
                  shape_str(s.shape));
    LLAISYS_CHECK(is_float(value.dtype()), TypeError, "model: weight '", name, "' has dtype ",
                  dtype_name(value.dtype()), ", expected a float dtype");
    if (s.heads) {
        load_heads(s, value);
        loaded_.insert(name);
        return;
    }
    Tensor *dst = s.tensor;
    // a slot has a group only when fused: a q/k/v or gate/up part, or a q/k/v bias (which exists only with
    // qkv_bias, when allocate_fused_biases made the fused bias it is a slice of)
    const bool in_place = !s.group.empty();
    if (s.linear) {
        s.linear->quant = QuantMatrix(); // a quantized weight loaded before is replaced
        if (in_place) { // a dense part of a fused matrix: its row slice, filled in place
            auto [fused, start] = fused_home(*s.layer, s.linear);
            const int64_t rows = fused == &s.layer->wqkv
                                     ? (config_.num_attention_heads + 2 * config_.num_key_value_heads) * config_.head_dim
                                     : 2 * config_.intermediate_size;
            if (!fused->dense.defined())
                *fused = {Tensor::empty({rows, config_.hidden_size}, dtype_, device_), QuantMatrix()};
            *s.linear = rows_of(*fused, start, start + s.shape[0]);
        }
        dst = &s.linear->dense;
    }
    if (s.norm && config_.norm_plus_one) { // stored w, applied as 1 + w: made once here, in f32 then cast
        Tensor w32 = Tensor::empty(s.shape, DType::F32, Device::cpu());
        ops::cast(w32, value.device().is_cpu() ? value : value.to(Device::cpu()));
        for (int64_t i = 0; i < w32.numel(); ++i) static_cast<float *>(w32.data())[i] += 1.f;
        Tensor target = Tensor::empty(s.shape, dtype_, device_);
        ops::cast(target, w32.to(device_));
        *dst = target;
    } else if (!in_place && value.device() == device_ && value.dtype() == dtype_ && value.is_contiguous()) {
        *dst = value; // zero-copy: e.g. a bf16 CPU model straight from the memory-mapped checkpoint
    } else {
        const Tensor on_device = value.device() == device_ ? value : value.contiguous().to(device_);
        Tensor target = in_place ? *dst : Tensor::empty(s.shape, dtype_, device_);
        ops::cast(target, on_device); // same dtype: a copy
        *dst = target;
    }
    loaded_.insert(name);
}

void Decoder::load_quant_weight(const std::string &name, const QuantMatrix &value) {
    ready_ = false;
    ++weights_version_;
    Slot s = slot(name);
    LLAISYS_CHECK(s.linear, TypeError, "model: weight '", name,
                  "' is a norm or a bias, which the model keeps dense: load it with load_weight");
    LLAISYS_CHECK(value.defined() && value.rows() == s.shape[0] && value.cols() == s.shape[1], std::invalid_argument,
                  "model: quantized weight '", name, "' is [", value.rows(), ", ", value.cols(), "], expected ",
                  shape_str(s.shape));
    if (s.heads) { // whole blocks rows: reorder them by head into q | k | v
        const int64_t nh = config_.num_attention_heads, hd = config_.head_dim;
        std::vector<QuantMatrix> rows;
        for (int64_t p = 0; p < 3; ++p)
            for (int64_t h = 0; h < nh; ++h) rows.push_back(value.slice_rows((3 * h + p) * hd, (3 * h + p + 1) * hd));
        Layer &L = *s.layer;
        const int64_t q = nh * hd, kv = config_.num_key_value_heads * hd;
        L.wqkv = {Tensor(), on_device(QuantMatrix::concat_rows(rows))};
        L.wq = rows_of(L.wqkv, 0, q);
        L.wk = rows_of(L.wqkv, q, q + kv);
        L.wv = rows_of(L.wqkv, q + kv, q + 2 * kv);
        loaded_.insert(name);
        return;
    }
    // The part stands alone until fuse_layer stacks it with its siblings; a dense fused matrix it was a slice
    // of stays for its other parts.
    // An untied embedding is only ever read a few rows a step (quant_embedding): it stays as it is, so that a
    // mapped file's pages of it are read only where a token asks for them.
    const bool lookup_only = s.linear == &embed_ && !config_.tie_word_embeddings;
    *s.linear = {Tensor(), lookup_only ? value.to(device_) : on_device(value)};
    loaded_.insert(name);
}

// A quantized weight as this model keeps it: on its device; on the CPU in the layout the CPU kernels run
// fastest (quant_cpu_layout: a host copy where that is not the file's).
QuantMatrix Decoder::on_device(const QuantMatrix &value) const {
    if (!device_.is_cpu()) return value.to(device_);
    return value.to(device_).with_layout(quant_cpu_layout(value.format(), value.cols()));
}

// Runs fused only where every part is in the fused matrix: dense parts are its slices already; quantized
// parts of one block format are stacked into it now (one copy; the parts then become its slices) where the
// quantized GEMV has the fused epilogue: SwiGLU's, not GeGLU's (a quantized GeGLU keeps gate and up apart).
void Decoder::fuse_layer(Layer &L) {
    L.fused_qkv = L.fused_gate_up = false;
    if (!fused_) return;
    const auto fuse = [](LinearWeight &fused, std::initializer_list<LinearWeight *> parts, bool stack_quant) {
        bool dense = fused.dense.defined(), quant = stack_quant;
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
    L.fused_qkv = fuse(L.wqkv, {&L.wq, &L.wk, &L.wv}, true);
    if (config_.gated_mlp && !config_.mlp_bias)
        L.fused_gate_up = fuse(L.w_gate_up, {&L.w_gate, &L.w_up}, config_.activation == Activation::silu);
}

std::vector<std::string> Decoder::missing_weights() const {
    std::vector<std::string> missing;
    for (const WeightSpec &w : table_)
        if (!loaded_.count(w.hf_name)) missing.push_back(w.hf_name);
    return missing;
}

std::vector<std::tuple<std::string, std::string, int64_t>> Decoder::weight_formats() const {
    std::vector<std::tuple<std::string, std::string, int64_t>> out;
    for (const WeightSpec &w : table_) {
        const Slot &s = slots_.at(w.hf_name);
        const LinearWeight lw = s.linear ? *s.linear : s.tensor->defined() ? LinearWeight{*s.tensor, QuantMatrix()}
                                                                            : LinearWeight{};
        out.emplace_back(w.hf_name, lw.format(), lw.nbytes());
    }
    return out;
}

// Bytes the weights occupy: each buffer once (the parts of a fused matrix are its slices).
int64_t Decoder::weight_bytes() const {
    auto tensor_bytes = [](const Tensor &t) { return t.defined() ? t.numel() * int64_t(t.element_size()) : 0; };
    auto group = [](const LinearWeight &fused, bool is_fused, std::initializer_list<const LinearWeight *> parts) {
        if (is_fused) return fused.nbytes();
        int64_t n = LinearWeight{fused.dense, QuantMatrix()}.nbytes();
        for (const LinearWeight *p : parts)
            if (p->quantized() || !fused.dense.defined()) n += p->nbytes();
        return n;
    };
    int64_t total = embed_.nbytes() + lm_head_.nbytes() + tensor_bytes(final_norm_) + tensor_bytes(final_norm_bias_);
    for (const Layer &L : layers_) {
        for (const Tensor *t : {&L.attn_norm, &L.attn_norm_bias, &L.q_norm, &L.k_norm, &L.post_attn_norm, &L.mlp_norm,
                                &L.mlp_norm_bias, &L.post_mlp_norm, &L.bo, &L.b_gate, &L.b_up, &L.b_down})
            total += tensor_bytes(*t);
        total += L.wo.nbytes() + L.w_down.nbytes();
        total += group(L.wqkv, L.fused_qkv, {&L.wq, &L.wk, &L.wv});
        total += group(L.w_gate_up, L.fused_gate_up, {&L.w_gate, &L.w_up});
        total += L.bqkv.defined() ? tensor_bytes(L.bqkv) : tensor_bytes(L.bq) + tensor_bytes(L.bk) + tensor_bytes(L.bv);
    }
    return total;
}

void Decoder::check_ready() {
    if (ready_) return; // checked once after the last load, not on every decode step
    const auto missing = missing_weights();
    LLAISYS_CHECK(missing.empty(), std::invalid_argument, "model: ", missing.size(), " weight(s) not loaded, e.g. '",
                  missing.empty() ? "" : missing.front(), "'");
    LLAISYS_CHECK(!device_.is_cuda() || !current_stream(device_).capturing(), std::logic_error,
                  "model: the first step after load_weight waits for the weights to be written and cannot be "
                  "captured into a CUDA graph; run one step before capturing");
    for (Layer &L : layers_) fuse_layer(L);
    if (comm_ && config_.tie_word_embeddings) { // this rank's rows of the (replicated) embedding
        const int64_t start = comm_->rank() * vocab_part_;
        tied_head_ = rows_of(embed_, start, start + vocab_part_);
    }
    // CUDA, quantized: the one buffer multi-row steps decode each weight into (linear's scratch), taken now so
    // that a KV cache sized from the free memory afterwards leaves room for it. After a reload the old one is
    // released first (graphs that held its address are dropped: weights_version).
    decode_scratch_ = Tensor(), lm_head_decoded_ = Tensor();
    std::vector<const LinearWeight *> decoded = projections();
    // A quantized LM head, the largest matrix, is decoded once into a copy of its own (the scratch then only
    // needs the next largest: about the memory the scratch took for it), so a step of more rows than the
    // quantized kernels take does not decode it again every step (165 us a step at the 1.5B's Q6_K head on an
    // H200; the 1.5B Q4_K_M protocol 22,854 -> 23,387 output tok/s in one call, bench/RESULTS.md session 36).
    if (device_.is_cuda() && lm_head().quantized()) {
        const QuantMatrix &q = lm_head().quant;
        lm_head_decoded_ = Tensor::empty({q.rows(), q.cols()}, dtype_, device_);
        ops::quant_dequantize(lm_head_decoded_, q);
        decoded.erase(decoded.begin()); // projections() lists the LM head first
    }
    decode_scratch_ = decode_scratch(decoded, dtype_, device_);
    if (device_.is_cuda()) synchronize(device_); // constant weights: every weight-writing kernel is done
    ready_ = true;
}

std::vector<const LinearWeight *> Decoder::projections() const {
    std::vector<const LinearWeight *> out{&lm_head()};
    for (const Layer &L : layers_) {
        if (L.fused_qkv) out.push_back(&L.wqkv);
        else out.insert(out.end(), {&L.wq, &L.wk, &L.wv});
        if (L.fused_gate_up) out.push_back(&L.w_gate_up);
        else if (L.w_gate.defined()) out.insert(out.end(), {&L.w_gate, &L.w_up});
        else out.push_back(&L.w_up);
        out.insert(out.end(), {&L.wo, &L.w_down});
    }
    return out;
}

int64_t Decoder::decode_scratch_bytes() const {
    const auto bytes = [](const Tensor &t) { return t.defined() ? t.numel() * int64_t(t.element_size()) : 0; };
    return bytes(decode_scratch_) + bytes(lm_head_decoded_);
}

} // namespace llaisys::models
