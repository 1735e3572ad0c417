"""Allocating forms of the operators: each returns a new tensor on the inputs' device."""
from __future__ import annotations

from . import ops
from ._tensor import Tensor, empty, tensor


def _like(shape, x: Tensor, dtype: str | None = None) -> Tensor:
    return empty(list(shape), dtype or x.dtype, x.device)


def add(a: Tensor, b: Tensor) -> Tensor:
    out = _like(a.shape, a)
    ops.add(out, a, b)
    return out


def cast(x: Tensor, dtype: str) -> Tensor:
    out = _like(x.shape, x, dtype)
    ops.cast(out, x)
    return out


def _check_finite_rows(op: str, ids: Tensor, what: str) -> None:
    """ValueError naming the first row the op marked -1 (no finite maximum). Reads the ids back, so this
    waits for the device; the model checks the ids it copies anyway instead (ops.hpp)."""
    import numpy as np

    bad = np.argwhere(np.asarray(ids.to("cpu").numpy()) < 0)
    if len(bad):
        row = tuple(int(i) for i in bad[0])
        where = f"row {row[0] if len(row) == 1 else row} of {what}" if row else what
        raise ValueError(f"{op}: {where} has no finite maximum (it holds a NaN or +inf, or only -inf)")


def argmax(x: Tensor) -> tuple[Tensor, Tensor]:
    """(indices i64, values) of the maximum over the last dim. Raises ValueError for a row without a finite
    maximum (a NaN, a +inf, or only -inf), where ops.argmax writes index -1."""
    idx, val = _like(x.shape[:-1], x, "i64"), _like(x.shape[:-1], x)
    ops.argmax(idx, val, x)
    _check_finite_rows("argmax", idx, "x")
    return idx, val


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    out = _like((*ids.shape, weight.shape[-1]), weight)
    ops.embedding(out, ids, weight)
    return out


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, constant_weight: bool = False) -> Tensor:
    """x @ weight^T (+ bias); constant_weight as in :mod:`llaisys.ops`."""
    out = _like((*x.shape[:-1], weight.shape[0]), x)
    ops.linear(out, x, weight, bias, constant_weight=constant_weight)
    return out


def linear_swiglu(x: Tensor, w_gate_up: Tensor, *, constant_weight: bool = False) -> Tensor:
    """swiglu(x @ w_gate_up[:I]^T, x @ w_gate_up[I:]^T) for w_gate_up [2I, K] (gate rows, then up rows)."""
    out = _like((*x.shape[:-1], w_gate_up.shape[0] // 2), x)
    ops.linear_swiglu(out, x, w_gate_up, constant_weight=constant_weight)
    return out


def linear_geglu(x: Tensor, w_gate_up: Tensor, approximate: str = "none", *, constant_weight: bool = False) -> Tensor:
    """geglu(x @ w_gate_up[:I]^T, x @ w_gate_up[I:]^T) for w_gate_up [2I, K] (gate rows, then up rows)."""
    tanh = _tanh_approx("linear_geglu", approximate)
    out = _like((*x.shape[:-1], w_gate_up.shape[0] // 2), x)
    ops.linear_geglu(out, x, w_gate_up, tanh, constant_weight=constant_weight)
    return out


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None = None, approximate: str = "none", *,
                constant_weight: bool = False) -> Tensor:
    """gelu(x @ weight^T (+ bias)), the projection rounded to x's dtype before the GELU."""
    tanh = _tanh_approx("linear_gelu", approximate)
    out = _like((*x.shape[:-1], weight.shape[0]), x)
    ops.linear_gelu(out, x, weight, bias, tanh, constant_weight=constant_weight)
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    out = _like(x.shape, x)
    ops.rms_norm(out, x, weight, eps)
    return out


def add_rms_norm(residual: Tensor, x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """residual += x (in place); returns rms_norm(residual)."""
    out = _like(x.shape, x)
    ops.add_rms_norm(out, residual, x, weight, eps)
    return out


def rope(x: Tensor, pos_ids: Tensor, theta: float = 10000.0, inv_freq=None) -> Tensor:
    """RoPE by theta, or by a frequency table inv_freq (floats, r <= head_dim / 2: the first 2r dims of each
    head turn, the rest pass through; see ``ops.rope_inv_freq``)."""
    out = _like(x.shape, x)
    if inv_freq is None:
        ops.rope(out, x, pos_ids, theta)
    else:
        ops.rope(out, x, pos_ids, [float(f) for f in inv_freq])
    return out


def self_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out = _like((q.shape[0], q.shape[1], v.shape[-1]), q)
    ops.self_attention(out, q, k, v, scale)
    return out


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    out = _like(gate.shape, gate)
    ops.swiglu(out, gate, up)
    return out


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight (+ bias) over the last dim, as torch's LayerNorm."""
    out = _like(x.shape, x)
    ops.layer_norm(out, x, weight, bias, eps)
    return out


def add_layer_norm(residual: Tensor, delta: Tensor, weight: Tensor, bias: Tensor | None = None, eps: float = 1e-5,
                   delta2: Tensor | None = None) -> Tensor:
    """residual += delta (+= delta2) in place, rounded after each add; returns layer_norm(residual)."""
    out = _like(delta.shape, delta)
    ops.add_layer_norm(out, residual, delta, delta2, weight, bias, eps)
    return out


def _tanh_approx(op: str, approximate: str) -> bool:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"{op}: approximate must be 'none' or 'tanh' (as torch's), got {approximate!r}")
    return approximate == "tanh"


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU, exact (erf) or approximate="tanh", as torch.nn.functional.gelu."""
    out = _like(x.shape, x)
    ops.gelu(out, x, _tanh_approx("gelu", approximate))
    return out


def geglu(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """gelu(gate) * up (Gemma's gated MLP uses approximate="tanh")."""
    out = _like(gate.shape, gate)
    ops.geglu(out, gate, up, _tanh_approx("geglu", approximate))
    return out


def sample(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
           seed: int = 0, offset: int = 0) -> Tensor:
    """One token id per row of logits [B, V], with the same parameters for every row. Out-of-range
    parameters raise ValueError naming them, as does a row without a finite maximum (a NaN, a +inf, or only
    -inf: no token to sample)."""
    import numpy as np

    from .sampling import _check  # the Engine's rules and messages

    temperature, top_k, top_p, min_p = (_check(n, v) for n, v in
                                        [("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                                         ("min_p", min_p)])
    rows = logits.shape[0]
    dev = logits.device
    out = _like((rows,), logits, "i64")
    ops.sample(out, logits,
               tensor(np.full(rows, temperature, np.float32), dev), tensor(np.full(rows, top_k, np.int32), dev),
               tensor(np.full(rows, top_p, np.float32), dev), tensor(np.full(rows, min_p, np.float32), dev),
               seed, offset)
    _check_finite_rows("sample", out, "logits")
    return out


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, q_start: Tensor,
                    kv_len: Tensor, max_q_len: int, scale: float | None = None, window: int = 0) -> Tensor:
    """Causal GQA attention of a batch of sequences over a paged KV cache (see ``ops.paged_attention``);
    window > 0: sliding-window attention (the query at position p sees keys p - window < j <= p).

    Rows of the output outside every sequence's query rows are not written (uninitialised).
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out = _like(q.shape, q)
    ops.paged_attention(out, q, k_cache, v_cache, block_tables, q_start, kv_len, scale, max_q_len, window=window)
    return out
