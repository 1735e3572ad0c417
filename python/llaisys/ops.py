"""Operators in their out-parameter form: ``ops.linear(out, x, weight, bias)``.

Every op validates its arguments (raising TypeError/ValueError/IndexError naming the op), runs on
the tensors' device, enqueues on its current stream and never synchronizes. Semantics are documented
in cpp/include/llaisys/ops.hpp; :mod:`llaisys.functional` has forms that allocate the output.

``rope_qkv_cache`` takes an optional ``slots`` (the cache rows of the tokens in a paged cache viewed
as ``[num_blocks * block_size, nkvh, hd]``; by default the rows are the positions), and keyword-only
``q_norm``, ``k_norm`` (``[hd]`` weights, both or neither) and ``eps``: each q and k head is rms-normed
first, in the same launch, exactly as ``rms_norm`` on the head views would (Qwen3 / Gemma 3 q/k norm).

``add_rms_norm`` takes a keyword-only ``x_weight`` (``[D]``): ``residual += rms_norm(x, x_weight)`` before the
norm, exactly as ``rms_norm`` then ``add_rms_norm`` would (Gemma 3's sandwich norms).

``rope`` and ``rope_qkv_cache`` take either ``theta`` or a frequency table ``inv_freq`` (a list of floats,
r <= head_dim / 2 of them: the first 2r dims of each head turn, the rest pass through, as GPT-NeoX's
partial rotary). ``rope_inv_freq(theta, rotary_dim, rope_type="default"|"linear"|"llama3", factor=...,
low_freq_factor=..., high_freq_factor=..., original_max_position_embeddings=...)`` returns the table HF
computes for those settings.

``linear``, ``linear_swiglu``, ``linear_geglu`` (out, x, w_gate_up, tanh_approx=False) and ``linear_gelu``
(out, x, weight, bias=None, tanh_approx=False) take ``constant_weight=False``. Pass True only for a weight that
every kernel that wrote it has finished with (synchronize after writing it) and that none will write
again, e.g. a loaded model's weights. On CUDA, the M = 1 GEMV may then read the weight while the
kernels ahead of it on the stream are still running. If the weight was computed on the device since
the last synchronize, the result may use its old contents.
"""
from ._core import ops as _ops

add = _ops.add
cast = _ops.cast
rearrange = _ops.rearrange
index_copy = _ops.index_copy
argmax = _ops.argmax
embedding = _ops.embedding
linear = _ops.linear
linear_swiglu = _ops.linear_swiglu
linear_geglu = _ops.linear_geglu
linear_gelu = _ops.linear_gelu
rms_norm = _ops.rms_norm
add_rms_norm = _ops.add_rms_norm
rope = _ops.rope
rope_qkv_cache = _ops.rope_qkv_cache
rope_inv_freq = _ops.rope_inv_freq
kv_shift = _ops.kv_shift
self_attention = _ops.self_attention
self_attention_cached = _ops.self_attention_cached
paged_attention = _ops.paged_attention
swiglu = _ops.swiglu
sample = _ops.sample
repetition_penalty = _ops.repetition_penalty
seen_penalty = _ops.seen_penalty
seen_mark = _ops.seen_mark
logit_bias = _ops.logit_bias
token_mask = _ops.token_mask
scale = _ops.scale  # (out, x, alpha)
sample_rows = _ops.sample_rows
logprobs = _ops.logprobs  # (chosen_lp, top_ids, top_lp, logits, temperature, chosen, rows)
# LayerNorm and GELU (GPT-NeoX / Pythia, Gemma 3): bias and delta2 may be None.
layer_norm = _ops.layer_norm  # (out, x, weight, bias, eps)
add_layer_norm = _ops.add_layer_norm  # (out, residual, delta, delta2, weight, bias, eps, out2=, weight2=, bias2=)
gelu = _ops.gelu  # (out, x, tanh_approx=False)
geglu = _ops.geglu  # (out, gate, up, tanh_approx=False)

__all__ = ["add", "scale", "cast", "rearrange", "index_copy", "argmax", "embedding", "linear", "rms_norm", "add_rms_norm", "rope",
           "rope_qkv_cache", "rope_inv_freq", "kv_shift",
           "self_attention", "self_attention_cached", "paged_attention", "swiglu", "sample", "sample_rows", "repetition_penalty", "logit_bias", "logprobs",
           "token_mask", "seen_penalty", "seen_mark", "linear_swiglu", "linear_geglu", "linear_gelu",
           "layer_norm", "add_layer_norm", "gelu", "geglu"]
