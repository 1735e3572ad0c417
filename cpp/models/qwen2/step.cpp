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

// The input x of an attention or MLP block: made ahead (norm null), or still to be made by each projection
// that reads it as x = rms_norm(residual + delta) * norm, which also stores residual + delta to residual_out
// (ops::add_rms_norm_quant_linear: on CUDA a decode step's GEMV does the norm in its prologue, a launch
// less per norm).
struct Qwen2::BlockIn {
    Tensor x;
    Tensor residual, delta, residual_out;
    const Tensor *norm = nullptr;
};

void Qwen2::project_in(const Tensor &out, const BlockIn &in, const LinearWeight &w, const Tensor &bias, bool swiglu) {
    if (in.norm != nullptr)
        ops::add_rms_norm_quant_linear(out, in.residual_out, in.residual, in.delta, *in.norm, config_.rms_norm_eps,
                                       w.quant, bias, swiglu);
    else if (swiglu) linear_swiglu(out, in.x, w, decode_scratch_);
    else linear(out, in.x, w, decode_scratch_, bias);
}

// Whether the norms ahead of layer L's attention and MLP blocks run inside their projections for a step of
// T tokens: every projection that reads them quantized, and add_rms_norm_quant_linear one kernel there.
bool Qwen2::norm_in_projections(const Layer &L, int64_t T) const {
    if (!ops::add_rms_norm_quant_linear_fused(dtype_, device_, T, config_.hidden_size)) return false;
    const bool qkv = L.fused_qkv ? L.wqkv.quantized() : L.wq.quantized() && L.wk.quantized() && L.wv.quantized();
    const bool mlp = L.fused_gate_up ? L.w_gate_up.quantized() : L.w_gate.quantized() && L.w_up.quantized();
    return qkv && mlp;
}

// attn [T, nh, hd] -> o_proj -> [T, H]
Tensor Qwen2::project_out(const Layer &L, const Tensor &attn, int64_t T) {
    Tensor out = Tensor::empty({T, config_.hidden_size}, dtype_, device_);
    linear(out, attn.view({T, config_.num_heads * config_.head_dim}), L.wo, decode_scratch_);
    return out;
}

// in [T, H] -> attention output projected back to [T, H]; this step's keys/values go to the pool first.
Tensor Qwen2::attention(int l, const BlockIn &in, const runtime::StepBatch &b, const runtime::KVPool &pool) {
    const Layer &L = layers_[size_t(l)];
    const int64_t T = b.num_tokens(), nh = config_.num_heads, nkvh = config_.num_kv_heads, hd = config_.head_dim;
    Tensor q = Tensor::empty({T, nh, hd}, dtype_, device_);
    if (L.fused_qkv) {
        Tensor qkv = Tensor::empty({T, (nh + 2 * nkvh) * hd}, dtype_, device_);
        project_in(qkv, in, L.wqkv, L.bqkv, false);
        ops::rope_qkv_cache(q, pool.key_rows(l), pool.value_rows(l), qkv, b.pos, config_.rope_theta, b.slots);
    } else {
        Tensor k = Tensor::empty({T, nkvh, hd}, dtype_, device_), v = Tensor::empty({T, nkvh, hd}, dtype_, device_);
        project_in(q.view({T, nh * hd}), in, L.wq, L.bq, false);
        project_in(k.view({T, nkvh * hd}), in, L.wk, L.bk, false);
        project_in(v.view({T, nkvh * hd}), in, L.wv, L.bv, false);
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

// in [T, H] -> down(swiglu(gate(x), up(x))) [T, H]
Tensor Qwen2::mlp(int l, const BlockIn &in) {
    const Layer &L = layers_[size_t(l)];
    const int64_t T = in.residual.defined() ? in.residual.size(0) : in.x.size(0), I = config_.intermediate_size;
    Tensor act = Tensor::empty({T, I}, dtype_, device_);
    if (L.fused_gate_up) {
        project_in(act, in, L.w_gate_up, Tensor(), true);
    } else {
        Tensor up = Tensor::empty({T, I}, dtype_, device_);
        project_in(act, in, L.w_gate, Tensor(), false);
        project_in(up, in, L.w_up, Tensor(), false);
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
    Tensor h_next; // where a norm inside the projections writes the residual (it reads h meanwhile)
    embedding(h, b.ids, embed_);
    Tensor mlp_out;
    // x = add_rms_norm(h += delta) ahead of a block, or left to the block's projections; then h is h_next.
    const auto block_in = [&](const Layer &L, const Tensor &delta, const Tensor &norm) {
        if (!norm_in_projections(L, T)) {
            ops::add_rms_norm(x, h, delta, norm, config_.rms_norm_eps);
            return BlockIn{x, {}, {}, {}, nullptr};
        }
        if (!h_next.defined()) h_next = Tensor::empty({T, H}, dtype_, device_);
        BlockIn in{{}, h, delta, h_next, &norm};
        std::swap(h, h_next);
        return in;
    };
    for (int l = 0; l < int(layers_.size()); ++l) {
        const Layer &L = layers_[size_t(l)];
        BlockIn in{x, {}, {}, {}, nullptr};
        if (l == 0) ops::rms_norm(x, h, L.input_norm, config_.rms_norm_eps);
        else in = block_in(L, mlp_out, L.input_norm);
        const Tensor attn_out = attention(l, in, b, pool);
        mlp_out = mlp(l, block_in(L, attn_out, L.post_norm));
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
