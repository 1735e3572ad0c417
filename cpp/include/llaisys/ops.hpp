// Operators. Each writes into caller-provided outputs, validates its arguments (raising an exception
// that names the op and the problem), enqueues on the current stream of the tensors' device and
// never synchronizes. Float ops take f32, f16 or bf16 and accumulate in f32; ids are i64 or i32.
// Inputs may have any strides; outputs may too unless an op says otherwise.
#pragma once
#include "llaisys/tensor.hpp"

#include <cstdint>
#include <vector>

namespace llaisys {
class Communicator;
}

namespace llaisys::ops {

// out = a + b (same shape, dtype and device; out may alias a or b).
void add(const Tensor &out, const Tensor &a, const Tensor &b);
// out = x * alpha: the f32 product rounded once to the dtype (Gemma's embedding scale; out may alias x).
void scale(const Tensor &out, const Tensor &x, float alpha);
// out = x converted to out's dtype: between f32, f16 and bf16, or from i32/i64 to a float dtype.
void cast(const Tensor &out, const Tensor &x);
// x converted to `dtype` (as cast) in a new tensor on x's device; x itself when it has that dtype already.
Tensor to_dtype(const Tensor &x, DType dtype);
// out = x between any strides (what Tensor::contiguous and copy_ use); same dtype, device and shape.
void rearrange(const Tensor &out, const Tensor &x);
// out[index[i]] = src[i] along dim 0 (out [R, ...], src [n, ...], index [n] i64/i32 on the device): how
// a step writes new keys/values into the KV cache at positions held in device memory, so one captured
// CUDA graph serves every position. An index outside [0, R) raises (on CUDA at the next synchronize).
void index_copy(const Tensor &out, const Tensor &index, const Tensor &src);
// Over the last dim of x [..., V]: max_idx [...] (i64) and max_val [...] (x's dtype); ties -> first.
// max_val is NumPy's max (NaN if the row holds one). A row without a finite maximum (a NaN, a +inf, or
// nothing above -inf) gets max_idx -1: as logits such a row has no token to pick, and the -1 travels
// with the ids the caller copies anyway, so the check costs no extra host sync.
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
// The same for GeGLU (Gemma's gated MLP: tanh_approx): out [..., I] = geglu(g, u) = gelu(g) * u with g and u
// summed in f32 and rounded to the dtype first, gelu(g) not rounded before the product: linear + linear +
// geglu bit for bit under linear_swiglu's conditions (CPU; CUDA for M <= 8).
void linear_geglu(const Tensor &out, const Tensor &x, const Tensor &w_gate_up, bool tanh_approx,
                  bool constant_weight = false);
// A plain MLP's up projection and its GELU in one op (GPT-NeoX): out [..., N] = gelu(x @ weight^T (+ bias)),
// the projection rounded to the dtype (bias included) before the GELU, so it equals linear + gelu bit for bit
// under linear_swiglu's conditions. bias may be undefined; constant_weight as for linear.
void linear_gelu(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, bool tanh_approx,
                 bool constant_weight = false);
// out = x / sqrt(mean(x^2) + eps) * weight over the last dim. out may be x. Rows of strided views (a unit
// last stride, leading dims that collapse into two) are read and written where they lie, in place too:
// q/k norm as rms_norm(q, q, w, eps) on q = qkv.view({T, nh + 2 * nkvh, hd}).slice(1, 0, nh), w [hd]
// (Qwen3, Gemma 3), with no copies; other layouts go through dense copies.
void rms_norm(const Tensor &out, const Tensor &x, const Tensor &weight, float eps);
// residual += x; out = rms_norm(residual). The residual-add fusion the decoder layer needs. With x_weight [D]
// (Gemma's sandwich norm of a block's output): residual += rms_norm(x, x_weight) first (that norm rounded
// to the dtype as rms_norm stores it), equal to rms_norm(t, x, x_weight, eps); add_rms_norm(out, residual, t,
// weight, eps) bit for bit (on CUDA for a dense x).
void add_rms_norm(const Tensor &out, const Tensor &residual, const Tensor &x, const Tensor &weight, float eps,
                  const Tensor &x_weight = Tensor());
// Rotary embedding on x [seq, heads, head_dim] with positions pos_ids [seq] (i64/i32), non-interleaved
// halves (HF convention). out may alias x.
void rope(const Tensor &out, const Tensor &x, const Tensor &pos_ids, float theta);
// After the fused QKV projection, in one launch: qkv [T, (nh + 2 * nkvh) * hd] (per row q heads, k heads,
// v heads; any row stride), pos_ids [T] (i64/i32, on the device): q_out [T, nh, hd] = rope(q),
// k_cache[row[t]] = rope(k), v_cache[row[t]] = v, with k_cache/v_cache [capacity, nkvh, hd] (contiguous
// last dim) and row = slots [T] (i64/i32, on the device, distinct) when given, else pos_ids (then distinct).
// A paged cache [num_blocks, block_size, nkvh, hd] is passed viewed as [num_blocks * block_size, nkvh, hd]
// with slots[t] = block * block_size + offset, while RoPE still turns by pos_ids[t]. Equals rope + rope +
// index_copy + index_copy bit for bit; q_out may be qkv's q part. A row outside [0, capacity) writes
// nothing for its token and raises (on CUDA at the next synchronize).
// Qwen3 / Gemma 3 q/k norm in the same launch: with q_norm and k_norm [hd] (both or neither; qkv's dtype and
// device), each q and k head is first rms_norm'ed over hd with its weight and eps and rounded to the dtype,
// then turned: equal to rms_norm(qh, qh, q_norm, eps); rms_norm(kh, kh, k_norm, eps); rope_qkv_cache(...) on
// the head views of qkv bit for bit (qkv's k heads are left as they were). v heads are never normed.
void rope_qkv_cache(const Tensor &q_out, const Tensor &k_cache, const Tensor &v_cache, const Tensor &qkv,
                    const Tensor &pos_ids, float theta, const Tensor &slots = Tensor(),
                    const Tensor &q_norm = Tensor(), const Tensor &k_norm = Tensor(), float eps = 0.f);
// RoPE from an explicit frequency table (partial rotary, scaled frequencies). inv_freq [r] (host floats,
// 1 <= r <= head_dim / 2, finite): rotates the first rotary_dim = 2r dims of each head as the pairs
// (i, i + r), i < r, by the f32 angle float(pos) * inv_freq[i] (HF's rotate_half on x[..., :rotary_dim]);
// dims [rotary_dim, head_dim) pass through unchanged (GPT-NeoX's partial rotary; head_dim may be odd
// there). The theta overloads equal these with rope_inv_freq(theta, head_dim, {}) bit for bit. On CUDA
// the table travels as a kernel parameter: no upload, nothing allocated.
void rope(const Tensor &out, const Tensor &x, const Tensor &pos_ids, const std::vector<float> &inv_freq);
// rope_qkv_cache (above) with the table of rope(..., inv_freq): q and k heads turn their first 2r dims, the
// rest of each q head goes to q_out and of each k head to the cache unchanged.
void rope_qkv_cache(const Tensor &q_out, const Tensor &k_cache, const Tensor &v_cache, const Tensor &qkv,
                    const Tensor &pos_ids, const std::vector<float> &inv_freq, const Tensor &slots = Tensor(),
                    const Tensor &q_norm = Tensor(), const Tensor &k_norm = Tensor(), float eps = 0.f);
// StreamingLLM's K-shift on a paged cache viewed as rows [capacity, nkvh, hd] (contiguous last dims): for
// each i, k_cache[dst[i]] = k_cache[src[i]] turned by the f32 angles float(delta) * inv_freq (rope's own
// rotation of the first 2r dims; the rest copied), v_cache[dst[i]] = v_cache[src[i]]. RoPE is a pure
// rotation, so a key cached at position p becomes the key at p + delta. src == dst turns a row in place;
// otherwise no dst may be another entry's src. src/dst [n] i64/i32 on the device; |delta| < 2^24. A row
// outside [0, capacity) raises (on CUDA at the next synchronize).
void kv_shift(const Tensor &k_cache, const Tensor &v_cache, const Tensor &src, const Tensor &dst, int64_t delta,
              const std::vector<float> &inv_freq);
// HF config "rope_scaling" / "rope_parameters" (rope_type default, linear or llama3; the fields of the
// other types are not read).
struct RopeScaling {
    enum class Type { none, linear, llama3 } type = Type::none;
    float factor = 1.f, low_freq_factor = 1.f, high_freq_factor = 4.f;
    int64_t original_max_position_embeddings = 8192;
};
// The table HF computes (transformers.modeling_rope_utils: the model's default, "linear", "llama3") for
// rotary_dim dims (even, >= 2; HF's int(head_dim * partial_rotary_factor)): rotary_dim / 2 entries,
// 1 / theta^(2i / rotary_dim) with theta^e rounded correctly to f32 (torch's f32 pow is up to 1 ulp off
// it), then HF's f32 steps one by one in its order and roundings (x / y as torch evaluates a scalar over a
// tensor: reciprocal, then a product). Bit-equal to HF's own code fed that pow (tests/test_ops_rope_freqs.py).
// linear: inv_freq / factor. llama3: wavelen = 2 pi / inv_freq; kept where wavelen < orig / high_freq_factor,
// divided by factor where wavelen > orig / low_freq_factor, smoothed in between. Raises on a non-positive
// or non-finite theta/factor, high_freq_factor <= low_freq_factor, or an odd rotary_dim.
std::vector<float> rope_inv_freq(float theta, int64_t rotary_dim, const RopeScaling &scaling);
// Causal GQA attention. q [qlen, nh, hd], k/v [kvlen, nkvh, hd] (v may have its own head dim),
// out [qlen, nh, hd_v]. Query i sees key j iff j <= i + kvlen - qlen.
void self_attention(const Tensor &out, const Tensor &q, const Tensor &k, const Tensor &v, float scale);
// self_attention over a KV cache whose valid length lives in device memory: k_cache/v_cache
// [capacity, nkvh, hd], kv_len [1] (i64 or i32, on the device) = valid rows including this step's; the
// queries q [qlen, nh, hd] are the last qlen positions. Equals self_attention(out, q, k_cache[:len],
// v_cache[:len], scale) — without the host knowing len, so one captured CUDA graph serves every step.
void self_attention_cached(const Tensor &out, const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                           const Tensor &kv_len, float scale);
// Causal GQA attention of a batch of sequences over a paged KV cache. q [T, nh, hd] (the step's query
// tokens, sequences concatenated; any seq/head strides), k_cache/v_cache [num_blocks, block_size, nkvh, hd]
// (contiguous), block_tables [B, max_blocks] i32 (the cache block of each sequence's j-th block of
// positions; entries past a sequence's length are ignored), q_start [B + 1] i32 (sequence b's queries are
// rows q_start[b] .. q_start[b+1]-1 of q), kv_len [B] i32 (context length of sequence b INCLUDING this
// step's tokens, whose keys/values are already in the cache) -> out [T, nh, hd] (unit last stride). Query i
// of sequence b (qlen_b = q_start[b+1] - q_start[b]) sees keys j <= kv_len[b] - qlen_b + i. max_q_len: a
// host-side upper bound of qlen_b (sizes the CUDA grid; all the per-sequence metadata stays on the device,
// so one captured CUDA graph serves every decode step of a batch). A sequence with qlen_b = 0 writes
// nothing, and rows of out outside every sequence are left as they were. Metadata is i32 and contiguous.
// Requires 0 <= q_start[b] <= q_start[b+1] <= T, qlen_b <= max_q_len, qlen_b <= kv_len[b] <=
// max_blocks * block_size and the used block ids in [0, num_blocks): violations raise on the CPU; on CUDA
// the kernels clamp (never reading out of bounds, a bad sequence's rows may be left unwritten) and raise
// at the next synchronize. settled_history: a promise that no kernel still running on the stream writes
// the metadata or the keys/values before this step's (positions < kv_len[b] - qlen_b), as in a model step
// (they come from host uploads and earlier steps); the CUDA decode kernel then reads them while the kernel
// ahead of it still runs, instead of after it (ignored elsewhere; false is always safe).
// window (sliding-window attention, Mistral / Gemma 3): 0 = full causal attention; window > 0: the query at
// absolute position p = kv_len[b] - qlen_b + i sees key j iff p - window < j <= p, i.e. itself and the
// window - 1 keys before it (HF masking_utils: sliding_window_causal_mask_function = causal and
// sliding_window_overlay's kv_idx > q_idx - sliding_window). Table entries of blocks that hold only keys
// no query of the step sees are not read (any value; such blocks may have been reused). A window >=
// max_blocks * block_size is full attention, bit for bit; window < 0 raises.
void paged_attention(const Tensor &out, const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                     const Tensor &block_tables, const Tensor &q_start, const Tensor &kv_len, float scale,
                     int64_t max_q_len, bool settled_history = false, int64_t window = 0);
// out = up * gate * sigmoid(gate), in f32.
void swiglu(const Tensor &out, const Tensor &gate, const Tensor &up);
// Samples one token per row of logits [B, V] into out_ids [B] (i64). Per-row parameters live on the
// logits' device: temperature [B] f32 (0 = greedy), top_k [B] i32 (0 = off), top_p [B] f32 (1 = off),
// min_p [B] f32 (0 = off). The same (seed, offset) gives the same tokens. A row whose logits hold a NaN
// or a +inf, or nothing above -inf, gets the id -1 at any temperature (as argmax); -inf alone is a mask.
// Parameters must be in range: temperature finite and >= 0, top_k >= 0, top_p in (0, 1], min_p in
// [0, 1]; the op checks those on the host when they live there (on the device it cannot without a sync,
// and the kernels read out-of-range values safely: NaN temperature = greedy, top_p >= 1 = off).
void sample(const Tensor &out_ids, const Tensor &logits, const Tensor &temperature, const Tensor &top_k,
            const Tensor &top_p, const Tensor &min_p, uint64_t seed, uint64_t offset);
// sample() with each row's own random stream: seeds [B] and steps [B] (i64, on the logits' device). Row b
// draws exactly what sample() draws for that row alone with (seed, offset) = (seeds[b], steps[b]), so a
// request's tokens never depend on its row in a batch.
void sample_rows(const Tensor &out_ids, const Tensor &logits, const Tensor &temperature, const Tensor &top_k,
                 const Tensor &top_p, const Tensor &min_p, const Tensor &seeds, const Tensor &steps);
// Log-probabilities of a step's sampled tokens, for the rows that asked (OpenAI's logprobs): for output row
// r, logits row b = rows[r] ([R] i64) of logits [B, V] (float) after the temperature (temperature [B] f32;
// 0 means 1), lp = log_softmax(logits[b] / t) accumulated in f32 (double on the CPU). chosen_lp [R] f32 =
// lp[chosen[b]] (chosen [B] i64, the sampled ids); top_ids [R, k] i64 and top_lp [R, k] f32 = the k
// (<= 20) largest, highest first, ties to the lower id (slots past V: id -1, -inf). A row without a finite
// max (a NaN, a +inf, only -inf) gets NaN logprobs. On the host, rows, chosen ids and temperatures out of
// range raise; on a device (no sync) they give NaN logprobs (and id -1 for a bad row index).
void logprobs(const Tensor &chosen_lp, const Tensor &top_ids, const Tensor &top_lp, const Tensor &logits,
              const Tensor &temperature, const Tensor &chosen, const Tensor &rows);
// HF's repetition penalty in place: for each id in ids [B, n] (i64, -1 = padding, no duplicates per
// row) logits[b, id] is divided by penalty if positive, multiplied if negative.
void repetition_penalty(const Tensor &logits, const Tensor &ids, float penalty);
// The same over bitmasks kept on the device (the runner's per-sequence "seen" sets): row b's logits [B, V]
// (float, any strides) at every token v whose bit v % 32 of word v / 32 is set in seen[rows[b]] ([S, W = ceil(V
// / 32)] i32), each once, by penalty[b] ([B] f32, finite > 0); rows[b] = -1 ([B] i32): the row is untouched.
void seen_penalty(const Tensor &logits, const Tensor &seen, const Tensor &rows, const Tensor &penalty);
// Adds ids[b] ([B] i64) to the set seen[rows[b]] in place (rows[b] = -1 or ids[b] = -1, no token: skipped):
// a sampled token joins its sequence's set on the device, so a chained step penalises it unseen by the host.
void seen_mark(const Tensor &seen, const Tensor &rows, const Tensor &ids);
// Adds bias [B, n] (f32) to logits [B, V] at ids [B, n] (i64, -1 = padding, no duplicates per row), in
// place: OpenAI's presence/frequency penalties and logit_bias, and -inf to ban a token (min_tokens).
void logit_bias(const Tensor &logits, const Tensor &ids, const Tensor &bias);
// Sets logits [B, V] (float, any strides) to -inf in place wherever bit v % 32 of mask[b, v / 32] is 0:
// mask [B, ceil(V / 32)] (i32) is llguidance's allowed-token bitmask of a constrained row (structured output).
void token_mask(const Tensor &logits, const Tensor &mask);

// ---- LayerNorm and GELU (GPT-NeoX / Pythia, Gemma 3) ----
// out = (x - mean) / sqrt(var + eps) * weight + bias over the last dim (biased variance, as torch's
// LayerNorm), in f32; bias may be an undefined Tensor (no bias). x [..., H], weight/bias [H]. out may
// alias x. The corrected two-pass algorithm (a first mean, then the deviations from it): no E[x^2] - mean^2
// cancellation, and rows whose mean is large against their spread keep their precision.
void layer_norm(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, float eps);
// residual += delta (+ delta2 when defined); out = layer_norm(residual). The residual-add fusion of a
// LayerNorm decoder; with delta2, GPT-NeoX's parallel residual x + attn(ln1(x)) + mlp(ln2(x)) and the next
// layer's LayerNorm in one pass. The sum is rounded to the dtype (as a separate add would) before the norm:
// residual becomes add(add(residual, delta), delta2) bit for bit, rounded after each add. residual, delta,
// delta2 and out [..., H] (residual is updated in place, any strides; out may alias delta or delta2).
// out2, when defined, also gets layer_norm(residual) with weight2 and bias2 (bias2 may be undefined) from the
// same pass: GPT-NeoX's ln2 beside the next layer's ln1; the bits of a separate layer_norm of the residual.
void add_layer_norm(const Tensor &out, const Tensor &residual, const Tensor &delta, const Tensor &delta2,
                    const Tensor &weight, const Tensor &bias, float eps, const Tensor &out2 = Tensor(),
                    const Tensor &weight2 = Tensor(), const Tensor &bias2 = Tensor());
// out = gelu(x): exact erf form, or the tanh approximation (torch's approximate="tanh"), in f32.
// x * Phi(x), Phi written with erfc for accuracy in the negative tail; tanh: 0.5 x (1 + tanh(sqrt(2/pi)
// (x + 0.044715 x^3))). -inf gives NaN, as torch's formulas do. out may alias x.
void gelu(const Tensor &out, const Tensor &x, bool tanh_approx);
// out = gelu(gate) * up, in f32 (GeGLU: Gemma's gated MLP, tanh approximation there). gelu(gate) is not
// rounded before the product. out may alias gate or up.
void geglu(const Tensor &out, const Tensor &gate, const Tensor &up, bool tanh_approx);
// ---- end LayerNorm and GELU ----

// ---- collectives of a tensor-parallel group (llaisys/comm.hpp; every rank calls, each with its own tensor) ----
// x = the sum of every rank's x, in place (contiguous, f32/f16/bf16, on the communicator's device).
void all_reduce(const Tensor &x, Communicator &comm);
// out [world * n] = every rank's x [n] in rank order (contiguous, one dtype, on the communicator's device).
void all_gather(const Tensor &out, const Tensor &x, Communicator &comm);

} // namespace llaisys::ops
