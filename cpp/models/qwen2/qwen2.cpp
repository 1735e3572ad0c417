// The Qwen2 forward pass. Every op enqueues on the device's current stream; the only host syncs are
// the ones the caller asks for (reading sampled ids back, or synchronizing before reading logits).
#include "llaisys/qwen2.hpp"

#include "core/runtime.hpp"
#include "llaisys/graph.hpp"
#include "llaisys/ops.hpp"
#include "llaisys/stream.hpp"
#include "models/qwen2/layer.hpp"
#include "models/qwen2/penalties.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>

namespace llaisys::models {

// A model's weights are written once (load_weight), then only read: linear() tells the dense kernels
// so (constant_weight), which lets the M = 1 GEMV start reading them early. check_ready() synchronizes
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

Qwen2::Qwen2(const Qwen2Config &config, DType dtype, Device device, int64_t max_seq_len, int num_slots,
             std::optional<bool> fused)
    : config_(config), dtype_(dtype), device_(device) {
    config_.validate();
    LLAISYS_CHECK(is_float(dtype), TypeError, "Qwen2: compute dtype must be f32, f16 or bf16, got ", dtype_name(dtype));
    check_device_available(device);
    layers_.resize(size_t(config.num_layers));
    cache_ = std::make_unique<KVCache>(config.num_layers, num_slots, max_seq_len, config.num_kv_heads, config.head_dim,
                                       dtype, device);
    staging_ = std::make_unique<Staging>(device);
    const char *env = std::getenv("LLAISYS_CUDA_GRAPHS");
    set_cuda_graphs(!(env && std::string(env) == "0"));
    const char *fused_env = std::getenv("LLAISYS_FUSED");
    fused_ = fused ? *fused : fused_env && *fused_env ? std::string(fused_env) != "0" : device.is_cuda();
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
    for (Layer &L : layers_) {
        fuse_layer(L);
        // quantized weights on CUDA: their decoded copies for multi-row steps (LinearWeight::gemm_copy)
        if (L.fused_qkv) L.wqkv.prepare_gemm(dtype_);
        else for (LinearWeight *w : {&L.wq, &L.wk, &L.wv}) w->prepare_gemm(dtype_);
        if (L.fused_gate_up) L.w_gate_up.prepare_gemm(dtype_);
        else for (LinearWeight *w : {&L.w_gate, &L.w_up}) w->prepare_gemm(dtype_);
        L.wo.prepare_gemm(dtype_);
        L.w_down.prepare_gemm(dtype_);
    }
    (config_.tie_word_embeddings ? embed_ : lm_head_).prepare_gemm(dtype_);
    if (device_.is_cuda()) synchronize(device_); // constant weights: every weight-writing kernel is done
    ready_ = true;
}

void Qwen2::check_step(const std::vector<int> &slots, const std::vector<std::vector<int64_t>> &tokens) {
    check_ready();
    LLAISYS_CHECK(!slots.empty() && slots.size() == tokens.size(), std::invalid_argument,
                  "Qwen2: need one token list per slot, got ", slots.size(), " slots and ", tokens.size(), " lists");
    std::set<int> seen;
    for (size_t i = 0; i < slots.size(); ++i) {
        const int slot = slots[i];
        LLAISYS_CHECK(seen.insert(slot).second, std::invalid_argument, "Qwen2: slot ", slot, " appears twice in a step");
        LLAISYS_CHECK(!tokens[i].empty(), std::invalid_argument, "Qwen2: empty token list for slot ", slot);
        const int64_t total = cache_->length(slot) + int64_t(tokens[i].size());
        LLAISYS_CHECK(total <= cache_->capacity(), std::invalid_argument, "Qwen2: slot ", slot, " would hold ", total,
                      " tokens, more than max_seq_len ", cache_->capacity());
        for (int64_t id : tokens[i])
            LLAISYS_CHECK(id >= 0 && id < config_.vocab_size, std::out_of_range, "Qwen2: token id ", id,
                          " out of range [0, ", config_.vocab_size, ")");
    }
}

// attn [T, nh, hd] -> o_proj -> [T, H]
Tensor Qwen2::project_out(const Layer &L, const Tensor &attn, int64_t T) {
    Tensor out = Tensor::empty({T, config_.hidden_size}, dtype_, device_);
    linear(out, attn.view({T, config_.num_heads * config_.head_dim}), L.wo);
    return out;
}

// x [T, H] -> attention output projected back to [T, H]; writes this step's keys/values into the cache.
Tensor Qwen2::attention(int l, const Tensor &x, const Tensor &pos, const std::vector<int> &slots,
                        const std::vector<std::vector<int64_t>> &tokens, const Tensor &kv_len) {
    const Layer &L = layers_[size_t(l)];
    const int64_t T = x.size(0), nh = config_.num_heads, nkvh = config_.num_kv_heads, hd = config_.head_dim;
    const int64_t cap = cache_->capacity();
    Tensor q = Tensor::empty({T, nh, hd}, dtype_, device_);
    Tensor qkv, k, v; // fused: qkv [T, (nh + 2 nkvh) hd]; else k, v [T, nkvh, hd]
    if (L.fused_qkv) {
        qkv = Tensor::empty({T, (nh + 2 * nkvh) * hd}, dtype_, device_);
        linear(qkv, x, L.wqkv, L.bqkv);
    } else {
        k = Tensor::empty({T, nkvh, hd}, dtype_, device_);
        v = Tensor::empty({T, nkvh, hd}, dtype_, device_);
        linear(q.view({T, nh * hd}), x, L.wq, L.bq);
        linear(k.view({T, nkvh * hd}), x, L.wk, L.bk);
        linear(v.view({T, nkvh * hd}), x, L.wv, L.bv);
        ops::rope(q, q, pos, config_.rope_theta);
        ops::rope(k, k, pos, config_.rope_theta);
    }
    // Rotates this step's rows [begin, end) of q and k and stores k/v at their positions in the slot.
    auto store = [&](int slot, int64_t begin, int64_t end) {
        const Tensor p = pos.slice(0, begin, end);
        if (L.fused_qkv)
            ops::rope_qkv_cache(q.slice(0, begin, end), cache_->keys(l, slot, 0, cap), cache_->values(l, slot, 0, cap),
                                qkv.slice(0, begin, end), p, config_.rope_theta);
        else cache_->write(l, slot, p, k.slice(0, begin, end), v.slice(0, begin, end));
    };
    Tensor attn = Tensor::empty({T, nh, hd}, dtype_, device_);
    const float scale = 1.f / std::sqrt(float(hd));
    if (kv_len.defined()) { // one sequence; its length is read on the device (graph-safe)
        const int slot = slots[0];
        store(slot, 0, T);
        ops::self_attention_cached(attn, q, cache_->keys(l, slot, 0, cap), cache_->values(l, slot, 0, cap), kv_len,
                                   scale);
        return project_out(L, attn, T);
    }
    int64_t offset = 0;
    for (size_t i = 0; i < slots.size(); ++i) { // each sequence attends to its own cached context
        const int64_t n = int64_t(tokens[i].size()), start = cache_->length(slots[i]);
        store(slots[i], offset, offset + n);
        ops::self_attention(attn.slice(0, offset, offset + n), q.slice(0, offset, offset + n),
                            cache_->keys(l, slots[i], 0, start + n), cache_->values(l, slots[i], 0, start + n), scale);
        offset += n;
    }
    return project_out(L, attn, T);
}

// x [T, H] -> down(swiglu(gate(x), up(x))) [T, H]
Tensor Qwen2::mlp(int l, const Tensor &x) {
    const Layer &L = layers_[size_t(l)];
    const int64_t T = x.size(0), I = config_.intermediate_size;
    Tensor act = Tensor::empty({T, I}, dtype_, device_);
    if (L.fused_gate_up) {
        linear_swiglu(act, x, L.w_gate_up);
    } else {
        Tensor up = Tensor::empty({T, I}, dtype_, device_);
        linear(act, x, L.w_gate);
        linear(up, x, L.w_up);
        ops::swiglu(act, act, up);
    }
    Tensor out = Tensor::empty({T, config_.hidden_size}, dtype_, device_);
    linear(out, act, L.w_down);
    return out;
}

// The hidden state of each sequence's last token: x [T, H] -> [B, H].
Tensor Qwen2::last_rows(const Tensor &x, const std::vector<std::vector<int64_t>> &tokens) {
    if (tokens.size() == 1) return x.slice(0, x.size(0) - 1, x.size(0));
    Tensor out = Tensor::empty({int64_t(tokens.size()), x.size(1)}, dtype_, device_);
    int64_t end = 0;
    for (size_t i = 0; i < tokens.size(); ++i) {
        end += int64_t(tokens[i].size());
        out.slice(0, int64_t(i), int64_t(i) + 1).copy_(x.slice(0, end - 1, end));
    }
    return out;
}

Tensor Qwen2::run(const Tensor &ids, const Tensor &pos, const std::vector<int> &slots,
                  const std::vector<std::vector<int64_t>> &tokens, const Tensor &kv_len, bool all_logits) {
    const int64_t T = ids.size(0), H = config_.hidden_size;
    Tensor h = Tensor::empty({T, H}, dtype_, device_); // the residual stream
    Tensor x = Tensor::empty({T, H}, dtype_, device_); // its normalised copy, input of each block
    embedding(h, ids, embed_);
    Tensor mlp_out;
    for (int l = 0; l < int(layers_.size()); ++l) {
        const Layer &L = layers_[size_t(l)];
        if (l == 0) ops::rms_norm(x, h, L.input_norm, config_.rms_norm_eps);
        else ops::add_rms_norm(x, h, mlp_out, L.input_norm, config_.rms_norm_eps);
        const Tensor attn_out = attention(l, x, pos, slots, tokens, kv_len);
        ops::add_rms_norm(x, h, attn_out, L.post_norm, config_.rms_norm_eps);
        mlp_out = mlp(l, x);
    }
    ops::add_rms_norm(x, h, mlp_out, final_norm_, config_.rms_norm_eps);
    const Tensor last = all_logits ? x : last_rows(x, tokens);
    Tensor logits = Tensor::empty({last.size(0), config_.vocab_size}, dtype_, device_);
    linear(logits, last, config_.tie_word_embeddings ? embed_ : lm_head_);
    return logits;
}

Tensor Qwen2::forward(const std::vector<int> &slots, const std::vector<std::vector<int64_t>> &tokens,
                      bool all_logits) {
    check_step(slots, tokens);
    DeviceGuard guard(device_);
    std::vector<int64_t> ids, pos;
    for (size_t i = 0; i < slots.size(); ++i) {
        const int64_t start = cache_->length(slots[i]);
        for (size_t j = 0; j < tokens[i].size(); ++j) {
            ids.push_back(tokens[i][j]);
            pos.push_back(start + int64_t(j));
        }
    }
    const Tensor ids_d = staging_->upload(ids, DType::I64), pos_d = staging_->upload(pos, DType::I64);
    const Tensor logits = run(ids_d, pos_d, slots, tokens, Tensor(), all_logits);
    for (size_t i = 0; i < slots.size(); ++i) cache_->advance(slots[i], int64_t(tokens[i].size()));
    return logits;
}

void Qwen2::set_cuda_graphs(bool enabled) {
    graphs_enabled_ = enabled && device_.is_cuda();
    if (!graphs_enabled_) graph_.reset();
}

void Qwen2::upload_step(DecodeGraph &g, int64_t token, int64_t pos, int64_t len) {
    staging_->upload_into(g.ids, &token, sizeof token);
    staging_->upload_into(g.pos, &pos, sizeof pos);
    staging_->upload_into(g.kv_len, &len, sizeof len);
}

Tensor Qwen2::decode_graphed(int slot, int64_t token) {
    const std::vector<int> slots{slot};
    const std::vector<std::vector<int64_t>> tokens{{token}};
    check_step(slots, tokens);
    DeviceGuard guard(device_);
    const int64_t pos = cache_->length(slot), len = pos + 1;
    if (!graph_ || graph_->slot != slot) {
        // Built aside and installed only once captured: a failure (OOM, a deferred device error) leaves
        // no half-built graph behind, and the next step simply tries again.
        graph_.reset();
        auto g = std::make_unique<DecodeGraph>();
        g->slot = slot;
        g->ids = Tensor::empty({1}, DType::I64, device_);
        g->pos = Tensor::empty({1}, DType::I64, device_);
        g->kv_len = Tensor::empty({1}, DType::I64, device_);
        upload_step(*g, token, pos, len);
        // Run once for real (fills the allocator's cache and library handles), then capture the same
        // step; replaying it below recomputes this step identically.
        g->logits = run(g->ids, g->pos, slots, tokens, g->kv_len, false);
        g->graph = std::make_unique<Graph>(device_);
        g->graph->capture([&] { g->logits = run(g->ids, g->pos, slots, tokens, g->kv_len, false); });
        graph_ = std::move(g);
    } else {
        upload_step(*graph_, token, pos, len);
    }
    graph_->graph->replay();
    cache_->advance(slot, 1);
    return graph_->logits;
}

std::vector<int64_t> Qwen2::forward_sample(const std::vector<int> &slots,
                                           const std::vector<std::vector<int64_t>> &tokens,
                                           const std::vector<SamplingParams> &params, uint64_t seed, uint64_t offset) {
    LLAISYS_CHECK(params.size() == slots.size(), std::invalid_argument, "Qwen2: need sampling parameters per slot, got ",
                  params.size(), " for ", slots.size(), " slots");
    const bool graphed = graphs_enabled_ && slots.size() == 1 && tokens[0].size() == 1;
    const Tensor logits = graphed ? decode_graphed(slots[0], tokens[0][0]) : forward(slots, tokens);
    DeviceGuard guard(device_);
    const int64_t B = int64_t(slots.size());
    apply_repetition_penalties(logits, params, *staging_);
    Tensor out = Tensor::empty({B}, DType::I64, device_);
    const bool greedy = std::all_of(params.begin(), params.end(), [](const SamplingParams &p) {
        return !(p.temperature > 0.f); // the sampler's own test: 0, negative and NaN mean greedy
    });
    if (greedy) { // the multi-block argmax kernel; sample() would give the same ids with one block per row
        Tensor max_val = Tensor::empty({B}, dtype_, device_);
        ops::argmax(out, max_val, logits);
    } else {
        sample_into(out, logits, params, seed, offset);
    }
    std::vector<int64_t> result(static_cast<size_t>(B));
    runtime::memcpy(result.data(), Device::cpu(), out.data(), device_, size_t(B) * sizeof(int64_t));
    // The kernels mark a row without a finite max logit with -1 (ops.hpp): checked here, with no extra sync.
    for (size_t b = 0; b < result.size(); ++b)
        LLAISYS_CHECK(result[b] >= 0, std::runtime_error, "Qwen2: non-finite logits (NaN or Inf) at generation step ",
                      offset, " of sequence row ", b, " (slot ", slots[b],
                      "): the model produced NaN/Inf, no token was sampled (check the weights and the dtype)");
    return result;
}

void Qwen2::sample_into(const Tensor &out, const Tensor &logits, const std::vector<SamplingParams> &params,
                        uint64_t seed, uint64_t offset) {
    std::vector<float> temperature, top_p, min_p;
    std::vector<int32_t> top_k;
    for (const SamplingParams &p : params) {
        temperature.push_back(p.temperature);
        top_k.push_back(p.top_k);
        top_p.push_back(p.top_p);
        min_p.push_back(p.min_p);
    }
    ops::sample(out, logits, staging_->upload(temperature, DType::F32), staging_->upload(top_k, DType::I32),
                staging_->upload(top_p, DType::F32), staging_->upload(min_p, DType::F32), seed, offset);
}

} // namespace llaisys::models
