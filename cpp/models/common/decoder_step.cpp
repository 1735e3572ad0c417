// The decoder's layer math for one step of a batch over the paged KV cache. The step's description (ids,
// positions, slots, block tables, lengths) lives in device tensors only, so the same code runs eagerly and
// under CUDA-graph capture. Every op enqueues on the device's current stream; nothing here syncs.
#include "llaisys/ops.hpp"
#include "llaisys/stream.hpp"
#include "models/common/decoder.hpp"

#include <cmath>
#include <cstdlib>
#include <string>

namespace llaisys::models {

// The input x of an attention or MLP block: made ahead (norm null), or still to be made by each projection
// that reads it as x = rms_norm(residual + delta) * norm, which also stores residual + delta to residual_out
// (ops::add_rms_norm_quant_linear: on CUDA a decode step's GEMV does the norm in its prologue, a launch
// less per norm).
struct Decoder::BlockIn {
    Tensor x;
    Tensor residual, delta, residual_out;
    const Tensor *norm = nullptr;
};

void Decoder::project_in(const Tensor &out, const BlockIn &in, const LinearWeight &w, const Tensor &bias, bool swiglu) {
    if (in.norm != nullptr)
        ops::add_rms_norm_quant_linear(out, in.residual_out, in.residual, in.delta, *in.norm, config_.norm_eps,
                                       w.quant, bias, swiglu);
    else if (swiglu) linear_swiglu(out, in.x, w, decode_scratch_);
    else linear(out, in.x, w, decode_scratch_, bias);
}

// Whether the norms ahead of layer L's attention and MLP blocks run inside their projections for a step of
// T tokens: RMSNorm blocks whose every projection reads them quantized, and one kernel for it there (SwiGLU
// MLPs: the quantized GEMV's fused epilogue is SwiGLU's).
bool Decoder::norm_in_projections(const Layer &L, int64_t T) const {
    if (config_.norm != NormKind::rms || config_.sandwich_norm || !config_.gated_mlp || config_.mlp_bias ||
        config_.activation != Activation::silu)
        return false;
    if (!ops::add_rms_norm_quant_linear_fused(dtype_, device_, T, config_.hidden_size)) return false;
    const bool qkv = L.fused_qkv ? L.wqkv.quantized() : L.wq.quantized() && L.wk.quantized() && L.wv.quantized();
    const bool mlp = L.fused_gate_up ? L.w_gate_up.quantized() : L.w_gate.quantized() && L.w_up.quantized();
    return qkv && mlp;
}

// out = norm(x) with the family's norm (RMSNorm, or LayerNorm with its bias).
void Decoder::norm(const Tensor &out, const Tensor &x, const Tensor &w, const Tensor &b) {
    if (config_.norm == NormKind::layer) ops::layer_norm(out, x, w, b, config_.norm_eps);
    else ops::rms_norm(out, x, w, config_.norm_eps);
}

// Whether the q/k norms run inside rope_qkv_cache and the sandwich norms inside add_rms_norm (one launch each
// instead of two, the same bits): only with LLAISYS_NORM_FUSED=1 (read once). Off by default: on an H200 the
// fused kernels took less device time (Gemma-3-1B, PDL off: 70 us a step less, 352 -> 222 launches), but the
// one same-call A/B of batch-1 decode (PDL on, one run each) had both models slower fused (Gemma-3-1B 715 ->
// 696 tok/s, Qwen3-0.6B 1,026 -> 943; bench/RESULTS.md, session 41), so it waits for repeated runs.
static bool norms_fused() {
    static const bool on = [] {
        const char *e = std::getenv("LLAISYS_NORM_FUSED");
        return e != nullptr && std::string(e) == "1";
    }();
    return on;
}

// h += delta (+ delta2); out = norm(h): one pass (LayerNorm: out2 = norm(h) with w2, b2 in the same one).
// delta_w (Gemma's sandwich norm of the block that gave delta): h += rms_norm(delta, delta_w), in that pass
// when norms_fused(), else a launch before it.
void Decoder::add_norm(const Tensor &out, const Tensor &h, const Tensor &delta, const Tensor &delta2,
                       const Tensor &w, const Tensor &b, const Tensor &out2, const Tensor &w2, const Tensor &b2,
                       const Tensor &delta_w) {
    if (config_.norm == NormKind::layer) {
        LLAISYS_CHECK(!delta_w.defined(), std::logic_error, "model: a sandwich norm is an RMSNorm fusion");
        return ops::add_layer_norm(out, h, delta, delta2, w, b, config_.norm_eps, out2, w2, b2);
    }
    LLAISYS_CHECK(!out2.defined(), std::logic_error, "model: a second norm output is a LayerNorm fusion");
    if (delta_w.defined() && !norms_fused()) {
        Tensor normed = Tensor::empty(delta.shape(), dtype_, device_);
        ops::rms_norm(normed, delta, delta_w, config_.norm_eps);
        ops::add_rms_norm(out, h, normed, w, config_.norm_eps);
    } else {
        ops::add_rms_norm(out, h, delta, w, config_.norm_eps, delta_w);
    }
    if (delta2.defined()) ops::add_rms_norm(out, h, delta2, w, config_.norm_eps); // (no family needs this today)
}

// q [T, nh, hd] = rope(q-projection), this step's keys/values to the cache: one fused kernel when q/k/v are
// one matrix, else three projections, RoPE and two cache writes. q/k norms (Qwen3, Gemma 3) run per head
// before RoPE.
void Decoder::qkv_rope_cache(const Layer &L, int l, const BlockIn &in, const Tensor &q, const StepBatch &b,
                             const KVView &kv) {
    const int64_t T = b.num_tokens(), nh = config_.num_attention_heads, nkvh = config_.num_key_value_heads,
                  hd = config_.head_dim;
    if (L.fused_qkv) {
        Tensor qkv = Tensor::empty({T, (nh + 2 * nkvh) * hd}, dtype_, device_);
        project_in(qkv, in, L.wqkv, L.bqkv, false);
        // q/k norm (Qwen3, Gemma 3): inside rope_qkv_cache's launch (norms_fused), or on the head views first
        const bool inside = config_.qk_norm && norms_fused();
        if (config_.qk_norm && !inside) {
            const Tensor heads = qkv.view({T, nh + 2 * nkvh, hd});
            const Tensor qh = heads.slice(1, 0, nh), kh = heads.slice(1, nh, nh + nkvh);
            ops::rms_norm(qh, qh, L.q_norm, config_.norm_eps);
            ops::rms_norm(kh, kh, L.k_norm, config_.norm_eps);
        }
        ops::rope_qkv_cache(q, kv.key_rows(l), kv.value_rows(l), qkv, b.pos, L.inv_freq, b.slots,
                            inside ? L.q_norm : Tensor(), inside ? L.k_norm : Tensor(), config_.norm_eps);
        return;
    }
    Tensor k = Tensor::empty({T, nkvh, hd}, dtype_, device_), v = Tensor::empty({T, nkvh, hd}, dtype_, device_);
    project_in(q.view({T, nh * hd}), in, L.wq, L.bq, false);
    project_in(k.view({T, nkvh * hd}), in, L.wk, L.bk, false);
    project_in(v.view({T, nkvh * hd}), in, L.wv, L.bv, false);
    if (config_.qk_norm) {
        ops::rms_norm(q, q, L.q_norm, config_.norm_eps);
        ops::rms_norm(k, k, L.k_norm, config_.norm_eps);
    }
    ops::rope(q, q, b.pos, L.inv_freq);
    ops::rope(k, k, b.pos, L.inv_freq);
    ops::index_copy(kv.key_rows(l), b.slots, k);
    ops::index_copy(kv.value_rows(l), b.slots, v);
}

// in [T, H] -> attention output projected back to [T, H]; this step's keys/values go to the cache first.
Tensor Decoder::attention(int l, const BlockIn &in, const StepBatch &b, const KVView &kv) {
    const Layer &L = layers_[size_t(l)];
    const int64_t T = b.num_tokens(), nh = config_.num_attention_heads, hd = config_.head_dim;
    Tensor q = Tensor::empty({T, nh, hd}, dtype_, device_);
    qkv_rope_cache(L, l, in, q, b, kv);
    Tensor attn = Tensor::empty({T, nh, hd}, dtype_, device_);
    const float pre = config_.query_pre_attn_scalar > 0 ? config_.query_pre_attn_scalar : float(hd);
    // Settled history: the step's metadata comes from host uploads and the keys before the step's own from
    // earlier steps, so the decode kernel may read them while rope_qkv_cache still runs.
    ops::paged_attention(attn, q, kv.keys(l), kv.values(l), b.block_tables, b.q_start, b.kv_len,
                         1.f / std::sqrt(pre), b.max_q_len, /*settled_history=*/true, L.window);
    Tensor out = Tensor::empty({T, config_.hidden_size}, dtype_, device_);
    linear(out, attn.view({T, nh * hd}), L.wo, decode_scratch_, first_rank() ? L.bo : Tensor());
    reduce(out); // tensor parallel: each rank's heads gave a partial sum (the bias added once, by rank 0)
    return out;
}

// in [T, H] -> down(act(gate(x)) * up(x)) [T, H], or down(act(up(x))) for a plain MLP (GPT-NeoX). Fused
// (fused_projections): gate/up and SwiGLU or GeGLU in one op, a plain MLP's GELU inside its up projection (at
// decode the GEMV's epilogue, a launch less per layer); the same bits as the unfused ops.
Tensor Decoder::mlp(int l, const BlockIn &in) {
    const Layer &L = layers_[size_t(l)];
    const int64_t T = in.residual.defined() ? in.residual.size(0) : in.x.size(0), I = config_.intermediate_size;
    const bool tanh = config_.activation == Activation::gelu_tanh;
    Tensor act = Tensor::empty({T, I}, dtype_, device_);
    if (L.fused_gate_up && config_.activation == Activation::silu) {
        project_in(act, in, L.w_gate_up, Tensor(), true);
    } else if (L.fused_gate_up) { // GeGLU: dense weights only (fuse_layer), never a norm inside (norm_in_projections)
        linear_geglu(act, in.x, L.w_gate_up, decode_scratch_, tanh);
    } else if (!config_.gated_mlp && fused_) {
        linear_gelu(act, in.x, L.w_up, decode_scratch_, L.b_up, tanh);
    } else if (!config_.gated_mlp) {
        project_in(act, in, L.w_up, L.b_up, false);
        ops::gelu(act, act, tanh);
    } else {
        Tensor up = Tensor::empty({T, I}, dtype_, device_);
        project_in(act, in, L.w_gate, L.b_gate, false);
        project_in(up, in, L.w_up, L.b_up, false);
        if (config_.activation == Activation::silu) ops::swiglu(act, act, up);
        else ops::geglu(act, act, up, tanh);
    }
    Tensor out = Tensor::empty({T, config_.hidden_size}, dtype_, device_);
    linear(out, act, L.w_down, decode_scratch_, first_rank() ? L.b_down : Tensor());
    reduce(out);
    return out;
}

// x [T, H] (final-normed) -> logits of each sequence's last token [B, V], or of every token.
Tensor Decoder::logits(const Tensor &x, const StepBatch &b, bool all_logits) {
    Tensor rows = x;
    if (!all_logits) { // each sequence's last token: a row gather the graph can replay (embedding by row ids)
        rows = Tensor::empty({b.num_seqs(), config_.hidden_size}, dtype_, device_);
        ops::embedding(rows, b.last, x);
    }
    const int64_t R = rows.size(0), V = config_.vocab_size;
    Tensor part = Tensor::empty({R, vocab_part_}, dtype_, device_);
    if (lm_head_decoded_.defined() && R > kQuantGemvMaxRows &&
        !ops::quant_linear_tc(rows.dtype(), rows.device(), R, lm_head().quant.format()))
        ops::linear(part, rows, lm_head_decoded_, Tensor(), /*constant_weight=*/true);
    else linear(part, rows, lm_head(), decode_scratch_);
    if (!comm_) return part;
    // tensor parallel: every rank gets every rank's slice ([world * R, V / world], rank-major) and lays them
    // side by side, so each holds the same [R, V] logits and samples the same tokens (no broadcast)
    const int world = comm_->world();
    Tensor gathered = Tensor::empty({world * R, vocab_part_}, dtype_, device_);
    comm_->all_gather(gathered, part);
    Tensor out = Tensor::empty({R, V}, dtype_, device_);
    for (int r = 0; r < world; ++r)
        out.slice(1, r * vocab_part_, (r + 1) * vocab_part_).copy_(gathered.slice(0, r * R, (r + 1) * R));
    return out;
}

// Serial residual: h += attn(norm(h)); h += mlp(norm(h)) (Gemma: each block's output normed again first, by
// add_norm's delta_w).
void Decoder::forward_serial(Tensor &h, const Tensor &x, const StepBatch &b, const KVView &kv) {
    const int64_t T = b.num_tokens(), H = config_.hidden_size;
    Tensor h_next; // where a norm inside the projections writes the residual (it reads h meanwhile)
    Tensor mlp_out, mlp_post; // the last MLP's output and its sandwich norm (undefined without)
    // x = norm(h += delta) ahead of a block, or left to the block's projections; then h is h_next. delta_w:
    // delta's sandwich norm (never with a norm in the projections: norm_in_projections excludes sandwich norms).
    const auto block_in = [&](const Layer &L, const Tensor &delta, const Tensor &w, const Tensor &bias,
                              const Tensor &delta_w) {
        if (!norm_in_projections(L, T)) {
            add_norm(x, h, delta, Tensor(), w, bias, Tensor(), Tensor(), Tensor(), delta_w);
            return BlockIn{x, {}, {}, {}, nullptr};
        }
        LLAISYS_CHECK(!delta_w.defined(), std::logic_error, "model: a sandwich norm inside the projections");
        if (!h_next.defined()) h_next = Tensor::empty({T, H}, dtype_, device_);
        BlockIn in{{}, h, delta, h_next, &w};
        std::swap(h, h_next);
        return in;
    };
    for (int l = 0; l < int(layers_.size()); ++l) {
        const Layer &L = layers_[size_t(l)];
        BlockIn in{x, {}, {}, {}, nullptr};
        if (l == 0) norm(x, h, L.attn_norm, L.attn_norm_bias);
        else in = block_in(L, mlp_out, L.attn_norm, L.attn_norm_bias, mlp_post);
        const Tensor attn_out = attention(l, in, b, kv);
        mlp_out = mlp(l, block_in(L, attn_out, L.mlp_norm, L.mlp_norm_bias,
                                  config_.sandwich_norm ? L.post_attn_norm : Tensor()));
        mlp_post = config_.sandwich_norm ? L.post_mlp_norm : Tensor();
    }
    add_norm(x, h, mlp_out, Tensor(), final_norm_, final_norm_bias_, Tensor(), Tensor(), Tensor(), mlp_post);
}

// Parallel residual (GPT-NeoX): h += attn(ln1(h)) + mlp(ln2(h)); the two adds and the next layer's two
// norms are one pass (add_layer_norm with both deltas and a second output; unfused: ln2 on its own).
void Decoder::forward_parallel(Tensor &h, const Tensor &x, const StepBatch &b, const KVView &kv) {
    const int64_t T = b.num_tokens(), H = config_.hidden_size;
    Tensor x2 = Tensor::empty({T, H}, dtype_, device_), attn_out, mlp_out;
    for (int l = 0; l < int(layers_.size()); ++l) {
        const Layer &L = layers_[size_t(l)];
        if (l == 0) {
            norm(x, h, L.attn_norm, L.attn_norm_bias);
            norm(x2, h, L.mlp_norm, L.mlp_norm_bias);
        } else if (fused_) {
            add_norm(x, h, attn_out, mlp_out, L.attn_norm, L.attn_norm_bias, x2, L.mlp_norm, L.mlp_norm_bias);
        } else {
            add_norm(x, h, attn_out, mlp_out, L.attn_norm, L.attn_norm_bias);
            norm(x2, h, L.mlp_norm, L.mlp_norm_bias);
        }
        attn_out = attention(l, BlockIn{x, {}, {}, {}, nullptr}, b, kv);
        mlp_out = mlp(l, BlockIn{x2, {}, {}, {}, nullptr});
    }
    add_norm(x, h, attn_out, mlp_out, final_norm_, final_norm_bias_);
}

Tensor Decoder::forward_step(const StepBatch &b, const KVView &kv, bool all_logits) {
    check_ready();
    LLAISYS_CHECK(kv.num_layers() == config_.num_hidden_layers && kv.dtype() == dtype_ && kv.device() == device_,
                  std::invalid_argument, "model: the KV cache does not match the model (layers, dtype or device)");
    DeviceGuard guard(device_);
    const int64_t T = b.num_tokens(), H = config_.hidden_size;
    Tensor h = Tensor::empty({T, H}, dtype_, device_); // the residual stream
    Tensor x = Tensor::empty({T, H}, dtype_, device_); // its normalised copy, input of each block
    embedding(h, b.ids, embed_);
    if (config_.scale_embeddings) ops::scale(h, h, embed_scale_);
    if (config_.parallel_residual) forward_parallel(h, x, b, kv);
    else forward_serial(h, x, b, kv);
    if (!all_logits && !b.last.defined()) return Tensor(); // no row wants its logits (HostBatch::logits)
    return logits(x, b, all_logits);
}

// Each layer turns its own keys: its RoPE table (base, scaling, partial rotary, Gemma 3's local base) is
// what wrote them.
void Decoder::shift_kv(const KVView &kv, const Tensor &src, const Tensor &dst, int64_t delta) {
    for (int64_t l = 0; l < int64_t(layers_.size()); ++l)
        ops::kv_shift(kv.key_rows(l), kv.value_rows(l), src, dst, delta, layers_[size_t(l)].inv_freq);
}

} // namespace llaisys::models
