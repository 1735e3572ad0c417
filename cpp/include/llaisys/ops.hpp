// Operators. Each writes into caller-provided outputs, validates its arguments (raising an exception
// that names the op and the problem), enqueues on the current stream of the tensors' device and
// never synchronizes. Float ops take f32, f16 or bf16 and accumulate in f32; ids are i64 or i32.
// Inputs may have any strides; outputs may too unless an op says otherwise.
#pragma once
#include "llaisys/tensor.hpp"

#include <cstdint>

namespace llaisys::ops {

// out = a + b (same shape, dtype and device; out may alias a or b).
void add(const Tensor &out, const Tensor &a, const Tensor &b);
// out = x converted to out's dtype: between f32, f16 and bf16, or from i32/i64 to a float dtype.
void cast(const Tensor &out, const Tensor &x);
// out = x between any strides (what Tensor::contiguous and copy_ use); same dtype, device and shape.
void rearrange(const Tensor &out, const Tensor &x);
// out[index[i]] = src[i] along dim 0 (out [R, ...], src [n, ...], index [n] i64/i32 on the device): how
// a step writes new keys/values into the KV cache at positions held in device memory, so one captured
// CUDA graph serves every position. An index outside [0, R) raises (on CUDA at the next synchronize).
void index_copy(const Tensor &out, const Tensor &index, const Tensor &src);
// Over the last dim of x [..., V]: max_idx [...] (i64) and max_val [...] (x's dtype); ties -> first.
void argmax(const Tensor &max_idx, const Tensor &max_val, const Tensor &x);
// out [n, D] = weight [V, D] rows picked by ids [n]. An id outside [0, V) raises (on CUDA at the next
// synchronize, through a device-side flag, so the op needs no host sync).
void embedding(const Tensor &out, const Tensor &ids, const Tensor &weight);
// out [..., N] = x [..., K] @ weight [N, K]^T (+ bias [N]); bias may be an undefined Tensor.
// constant_weight promises that every kernel that wrote weight has finished (synchronize after writing
// it) and that none writes it again, as for a loaded model's weights: on CUDA the M = 1 GEMV may then
// read it while the kernels ahead of it on the stream are still running. Leave it false for a weight
// computed on the device since the last synchronize, or the result may use the weight's old contents.
void linear(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, bool constant_weight = false);
// The MLP's gate/up projections and SwiGLU in one op: x [..., K], w_gate_up [2I, K] (HF's gate_proj rows
// stacked over up_proj rows), out [..., I] = swiglu(g, u) with g = x @ w_gate_up[:I]^T and
// u = x @ w_gate_up[I:]^T, each summed in f32 and rounded to the dtype before the SwiGLU, so the result
// equals linear + linear + swiglu bit for bit when the sums run in the same order (CPU; CUDA for M <= 8).
// constant_weight as for linear (it picks the same GEMV summation order as linear with that flag).
void linear_swiglu(const Tensor &out, const Tensor &x, const Tensor &w_gate_up, bool constant_weight = false);
// out = x / sqrt(mean(x^2) + eps) * weight over the last dim.
void rms_norm(const Tensor &out, const Tensor &x, const Tensor &weight, float eps);
// residual += x; out = rms_norm(residual). The residual-add fusion the decoder layer needs.
void add_rms_norm(const Tensor &out, const Tensor &residual, const Tensor &x, const Tensor &weight, float eps);
// Rotary embedding on x [seq, heads, head_dim] with positions pos_ids [seq] (i64/i32), non-interleaved
// halves (HF convention). out may alias x.
void rope(const Tensor &out, const Tensor &x, const Tensor &pos_ids, float theta);
// After the fused QKV projection, in one launch: qkv [T, (nh + 2 * nkvh) * hd] (per row q heads, k heads,
// v heads; any row stride), pos_ids [T] (i64/i32, on the device, distinct): q_out [T, nh, hd] = rope(q),
// k_cache[pos[t]] = rope(k), v_cache[pos[t]] = v, with k_cache/v_cache [capacity, nkvh, hd] (contiguous
// last dim). Equals rope + rope + index_copy + index_copy bit for bit; q_out may be qkv's q part. A position
// outside [0, capacity) writes nothing for its token and raises (on CUDA at the next synchronize).
void rope_qkv_cache(const Tensor &q_out, const Tensor &k_cache, const Tensor &v_cache, const Tensor &qkv,
                    const Tensor &pos_ids, float theta);
// Causal GQA attention. q [qlen, nh, hd], k/v [kvlen, nkvh, hd] (v may have its own head dim),
// out [qlen, nh, hd_v]. Query i sees key j iff j <= i + kvlen - qlen.
void self_attention(const Tensor &out, const Tensor &q, const Tensor &k, const Tensor &v, float scale);
// self_attention over a KV cache whose valid length lives in device memory: k_cache/v_cache
// [capacity, nkvh, hd], kv_len [1] (i64 or i32, on the device) = valid rows including this step's; the
// queries q [qlen, nh, hd] are the last qlen positions. Equals self_attention(out, q, k_cache[:len],
// v_cache[:len], scale) — without the host knowing len, so one captured CUDA graph serves every step.
void self_attention_cached(const Tensor &out, const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                           const Tensor &kv_len, float scale);
// out = up * gate * sigmoid(gate), in f32.
void swiglu(const Tensor &out, const Tensor &gate, const Tensor &up);
// Samples one token per row of logits [B, V] into out_ids [B] (i64). Per-row parameters live on the
// logits' device: temperature [B] f32 (0 = greedy), top_k [B] i32 (0 = off), top_p [B] f32 (1 = off),
// min_p [B] f32 (0 = off). The same (seed, offset) gives the same tokens.
void sample(const Tensor &out_ids, const Tensor &logits, const Tensor &temperature, const Tensor &top_k,
            const Tensor &top_p, const Tensor &min_p, uint64_t seed, uint64_t offset);
// HF's repetition penalty in place: for each id in ids [B, n] (i64, -1 = padding, no duplicates per
// row) logits[b, id] is divided by penalty if positive, multiplied if negative.
void repetition_penalty(const Tensor &logits, const Tensor &ids, float penalty);

} // namespace llaisys::ops
