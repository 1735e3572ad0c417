// Qwen2's layer math for one step of a batch over the paged KV pool. The step's description (ids,
// positions, slots, block tables, lengths) lives in device tensors only, so the same code runs eagerly
// and under CUDA-graph capture. Every op enqueues on the device's current stream; nothing here syncs.
#include "llaisys/kv_pool.hpp"
#include "llaisys/ops.hpp"
#include "llaisys/qwen2.hpp"
#include "llaisys/stream.hpp"
#include "models/qwen2/layer.hpp"

#include <cmath>

namespace llaisys::models {

// attn [T, nh, hd] -> o_proj -> [T, H]
Tensor Qwen2::project_out(const Layer &L, const Tensor &attn, int64_t T) {
    Tensor out = Tensor::empty({T, config_.hidden_size}, dtype_, device_);
    linear(out, attn.view({T, config_.num_heads * config_.head_dim}), L.wo, decode_scratch_);
    return out;
}

// x [T, H] -> attention output projected back to [T, H]; this step's keys/values go to the pool first.
Tensor Qwen2::attention(int l, const Tensor &x, const runtime::StepBatch &b, const runtime::KVPool &pool) {
    const Layer &L = layers_[size_t(l)];
    const int64_t T = x.size(0), nh = config_.num_heads, nkvh = config_.num_kv_heads, hd = config_.head_dim;
    Tensor q = Tensor::empty({T, nh, hd}, dtype_, device_);
    if (L.fused_qkv) {
        Tensor qkv = Tensor::empty({T, (nh + 2 * nkvh) * hd}, dtype_, device_);
        linear(qkv, x, L.wqkv, decode_scratch_, L.bqkv);
        ops::rope_qkv_cache(q, pool.key_rows(l), pool.value_rows(l), qkv, b.pos, config_.rope_theta, b.slots);
    } else {
        Tensor k = Tensor::empty({T, nkvh, hd}, dtype_, device_), v = Tensor::empty({T, nkvh, hd}, dtype_, device_);
        linear(q.view({T, nh * hd}), x, L.wq, decode_scratch_, L.bq);
        linear(k.view({T, nkvh * hd}), x, L.wk, decode_scratch_, L.bk);
        linear(v.view({T, nkvh * hd}), x, L.wv, decode_scratch_, L.bv);
        ops::rope(q, q, b.pos, config_.rope_theta);
        ops::rope(k, k, b.pos, config_.rope_theta);
        ops::index_copy(pool.key_rows(l), b.slots, k);
        ops::index_copy(pool.value_rows(l), b.slots, v);
    }
    Tensor attn = Tensor::empty({T, nh, hd}, dtype_, device_);
    // Settled history: the step's metadata comes from host uploads and the keys before the step's own from
    // earlier steps, so the decode kernel may read them while rope_qkv_cache still runs.
    ops::paged_attention(attn, q, pool.keys(l), pool.values(l), b.block_tables, b.q_start, b.kv_len,
                         1.f / std::sqrt(float(hd)), b.max_q_len, /*settled_history=*/true);
    return project_out(L, attn, T);
}

// x [T, H] -> down(swiglu(gate(x), up(x))) [T, H]
Tensor Qwen2::mlp(int l, const Tensor &x) {
    const Layer &L = layers_[size_t(l)];
    const int64_t T = x.size(0), I = config_.intermediate_size;
    Tensor act = Tensor::empty({T, I}, dtype_, device_);
    if (L.fused_gate_up) {
        linear_swiglu(act, x, L.w_gate_up, decode_scratch_);
    } else {
        Tensor up = Tensor::empty({T, I}, dtype_, device_);
        linear(act, x, L.w_gate, decode_scratch_);
        linear(up, x, L.w_up, decode_scratch_);
        ops::swiglu(act, act, up);
    }
    Tensor out = Tensor::empty({T, config_.hidden_size}, dtype_, device_);
    linear(out, act, L.w_down, decode_scratch_);
    return out;
}

Tensor Qwen2::forward_step(const runtime::StepBatch &b, const runtime::KVPool &pool, bool all_logits) {
    check_ready();
    LLAISYS_CHECK(pool.num_layers() == config_.num_layers && pool.dtype() == dtype_ && pool.device() == device_,
                  std::invalid_argument, "Qwen2: the KV pool does not match the model (layers, dtype or device)");
    DeviceGuard guard(device_);
    const int64_t T = b.num_tokens(), H = config_.hidden_size;
    Tensor h = Tensor::empty({T, H}, dtype_, device_); // the residual stream
    Tensor x = Tensor::empty({T, H}, dtype_, device_); // its normalised copy, input of each block
    embedding(h, b.ids, embed_);
    Tensor mlp_out;
    for (int l = 0; l < int(layers_.size()); ++l) {
        const Layer &L = layers_[size_t(l)];
        if (l == 0) ops::rms_norm(x, h, L.input_norm, config_.rms_norm_eps);
        else ops::add_rms_norm(x, h, mlp_out, L.input_norm, config_.rms_norm_eps);
        const Tensor attn_out = attention(l, x, b, pool);
        ops::add_rms_norm(x, h, attn_out, L.post_norm, config_.rms_norm_eps);
        mlp_out = mlp(l, x);
    }
    ops::add_rms_norm(x, h, mlp_out, final_norm_, config_.rms_norm_eps);
    Tensor rows = x;
    if (!all_logits) { // each sequence's last token: a row gather the graph can replay (embedding by row ids)
        rows = Tensor::empty({b.num_seqs(), H}, dtype_, device_);
        ops::embedding(rows, b.last, x);
    }
    Tensor logits = Tensor::empty({rows.size(0), config_.vocab_size}, dtype_, device_);
    linear(logits, rows, lm_head(), decode_scratch_);
    return logits;
}

} // namespace llaisys::models
