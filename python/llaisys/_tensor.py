"""Tensor creation and zero-copy exchange with NumPy and DLPack producers."""
from __future__ import annotations

import numpy as np

from . import _core

Tensor = _core.Tensor


def empty(shape, dtype: str = "f32", device: str = "cpu", pin_memory: bool = False) -> Tensor:
    return _core.empty(list(shape), dtype, device, pin_memory)


def zeros(shape, dtype: str = "f32", device: str = "cpu") -> Tensor:
    return _core.zeros(list(shape), dtype, device)


def _is_bf16(dtype) -> bool:
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - a dependency
        return False
    return dtype == np.dtype(ml_dtypes.bfloat16)


def tensor(array, device: str = "cpu") -> Tensor:
    """A tensor sharing memory with a NumPy array (no copy), moved to ``device`` if not "cpu".

    bf16 arrays use ``ml_dtypes.bfloat16``. Arrays with negative strides are rejected: pass
    ``numpy.ascontiguousarray(a)``; read-only arrays too (a tensor is writable). Python scalars and lists
    are converted with ``numpy.asarray``.
    """
    if not isinstance(array, np.ndarray):
        array = np.asarray(array)
    if not array.flags.writeable:
        raise ValueError("llaisys.tensor: the array is read-only, but a tensor is a writable view of its memory; "
                         "pass a writable array (or numpy.array(a) to copy it)")
    return _wrap(array, device)


def _wrap(array: np.ndarray, device: str = "cpu") -> Tensor:
    """Zero-copy wrap without the read-only check: for memory llaisys never writes (model weights)."""
    if _is_bf16(array.dtype):
        t = _core._import(array.view(np.uint16), "bf16")
    else:
        t = _core._import(array)
    return t if device == "cpu" else t.to(device)


def from_dlpack(obj) -> Tensor:
    """Wrap any DLPack producer (torch, cupy, numpy, jax) without copying.

    For CUDA producers, the producer is asked to order its pending work before llaisys' current
    stream, so the data is ready for llaisys ops.
    """
    if hasattr(obj, "__dlpack_device__") and hasattr(obj, "__dlpack__"):
        dev_type, dev_id = obj.__dlpack_device__()
        if int(dev_type) == 2:  # kDLCUDA
            stream = _core.current_stream(f"cuda:{int(dev_id)}").handle
            return _core._import(obj.__dlpack__(stream=stream))
        return _core._import(obj.__dlpack__())
    if type(obj).__name__ == "PyCapsule":
        return _core._import(obj)
    raise TypeError(f"from_dlpack: {type(obj).__name__} is not a DLPack producer (no __dlpack__ method)")
