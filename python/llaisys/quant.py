"""Quantized weights (GGUF block formats Q4_0, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0) and the ops that read them.

``QuantMatrix.from_numpy(format, rows, cols, data)`` wraps the raw blocks of an [N, K] matrix (a uint8
array of rows * row_bytes(format, K) bytes, e.g. a tensor of a memory-mapped GGUF file) without
copying; the matrix keeps the array alive. Semantics of the ops: cpp/include/llaisys/quant.hpp.
``set_cpu_path`` forces the CPU kernels ('portable', 'avx2', 'avx512vnni', or 'auto'): for A/B runs
and tests, not for users.
"""
from __future__ import annotations

import numpy as np

from . import _core
from ._tensor import Tensor, _wrap, empty

_q = _core.quant
QuantMatrix = _q.QuantMatrix
row_bytes = _q.row_bytes
format_info = _q.format_info
format_from_gguf = _q.format_from_gguf
set_cpu_path = _q.set_cpu_path
cpu_path = _q.cpu_path
cpu_path_supported = _q.cpu_path_supported
cpu_layout = _q.cpu_layout  # (format, cols) -> 'file' or 'q5_split': how a CPU model keeps such a weight
set_cpu_split = _q.set_cpu_split  # (on): A/B switch for models loaded afterwards, not a user setting
linear_ = _q.linear  # out-parameter forms
linear_swiglu_ = _q.linear_swiglu
embedding_ = _q.embedding
add_rms_norm_linear_ = _q.add_rms_norm_linear  # (out, residual_out, residual, delta, norm_weight, eps, weight,
# bias=None, swiglu=False): add_rms_norm then linear (or linear_swiglu), residual out of place (quant.hpp)
add_rms_norm_linear_fused = _q.add_rms_norm_linear_fused  # (dtype, device, rows, cols): one kernel there?
dequantize_ = _q.dequantize


def from_numpy(format: str, rows: int, cols: int, data: np.ndarray, layout: str = "file") -> QuantMatrix:
    """A QuantMatrix viewing ``data`` (uint8, C-contiguous: [rows, row_bytes(format, cols)], or flat), whose
    rows are in ``layout`` ('file', or 'q5_split': what QuantMatrix.with_layout('q5_split') makes)."""
    if data.dtype != np.uint8 or not data.flags.c_contiguous:
        raise TypeError(f"QuantMatrix.from_numpy: data must be a C-contiguous uint8 array, got {data.dtype}"
                        f"{'' if data.flags.c_contiguous else ' (not contiguous)'}")
    return QuantMatrix(format, rows, cols, _wrap(data if data.ndim == 2 else data.reshape(rows, -1)), layout)


QuantMatrix.from_numpy = staticmethod(from_numpy)


def linear(x: Tensor, weight: QuantMatrix, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ dequant(weight)[N, K]^T (+ bias [N]) -> [..., N] in x's dtype."""
    out = empty([*x.shape[:-1], weight.rows], x.dtype, x.device)
    _q.linear(out, x, weight, bias)
    return out


def linear_swiglu(x: Tensor, w_gate_up: QuantMatrix) -> Tensor:
    """swiglu(x @ w_gate_up[:I]^T, x @ w_gate_up[I:]^T) -> [..., I]."""
    out = empty([*x.shape[:-1], w_gate_up.rows // 2], x.dtype, x.device)
    _q.linear_swiglu(out, x, w_gate_up)
    return out


def embedding(ids: Tensor, weight: QuantMatrix, dtype: str = "f32") -> Tensor:
    """Dequantized rows of weight picked by ids -> [*ids.shape, cols] in ``dtype``."""
    out = empty([*ids.shape, weight.cols], dtype, ids.device)
    _q.embedding(out, ids, weight)
    return out


def dequantize(weight: QuantMatrix, dtype: str = "f32") -> Tensor:
    """The whole weight decoded -> [rows, cols] in ``dtype`` on the weight's device (any device, unlike
    QuantMatrix.dequantize, which returns a NumPy array of a host matrix's rows)."""
    out = empty([weight.rows, weight.cols], dtype, weight.device)
    _q.dequantize(out, weight)
    return out


__all__ = ["QuantMatrix", "from_numpy", "row_bytes", "format_info", "format_from_gguf", "set_cpu_path", "cpu_path",
           "cpu_path_supported", "cpu_layout", "set_cpu_split", "linear", "linear_swiglu", "embedding", "dequantize", "linear_", "linear_swiglu_",
           "embedding_", "dequantize_", "add_rms_norm_linear_", "add_rms_norm_linear_fused"]
