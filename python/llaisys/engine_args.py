"""Checks of the Engine's arguments, run before any file is read or any token is generated, so a wrong
argument fails at once with a message naming it (not minutes into loading, not deep in the bindings)."""
from __future__ import annotations

import ctypes
import numbers
import os
import re
from collections.abc import Sequence

import numpy as np

from ._runtime import build_info, cuda_device_count

# "auto" and "quantized" are decided once the file is read (Engine.__init__)
_DTYPES = {"auto": "auto", "quantized": "quantized", "bf16": "bf16", "bfloat16": "bf16", "f16": "f16", "float16": "f16", "f32": "f32",
           "float32": "f32"}


def resolve_dtype(dtype) -> str:
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str (auto, quantized, bf16, f16 or f32), got {type(dtype).__name__} {dtype!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, quantized, bf16, f16, f32; got {dtype!r}")
    return _DTYPES[dtype]


def weight_policy(dtype: str, device: str, has_blocks: bool, source: str = "the model") -> tuple[bool, str]:
    """(keep the file's quantized blocks, compute dtype) for a resolve_dtype'd dtype on a resolve_device'd
    device, once the file is read: has_blocks says whether it holds GGUF quantized tensors. "auto" and
    "quantized" keep the blocks on either device, computing in f32 on the CPU (activations are a small part
    of the bytes moved there) and bf16 on CUDA. On CUDA that holds the file's bytes plus one decode scratch
    (the largest matrix in bf16) instead of a bf16 model, and batch-1 decode is faster than bf16 (H100,
    1.5B shape, bench/RESULTS.md 2026-11-25 late: 554 against 487 tok/s); steps of more than 8 rows decode
    each weight into the scratch before cuBLASLt (with a decoded copy of every weight they ran at 0.99x
    bf16; the scratch path's at 0.90x, bench/RESULTS.md 2026-11-26). Other dtypes always
    dequantize."""
    if dtype == "quantized" and not has_blocks:
        raise ValueError(f"dtype='quantized' keeps a GGUF file's quantized tensors, but {source} has none (use auto, "
                         f"bf16, f16 or f32)")
    keep = has_blocks and dtype in ("auto", "quantized")
    if dtype in ("auto", "quantized"):
        dtype = "f32" if keep and device == "cpu" else "bf16"
    return keep, dtype


def resolve_device(device) -> str:
    """"auto" | "cpu" | "cuda" | "cuda:N" -> "cpu" or "cuda:N", checked against this build and machine."""
    if not isinstance(device, str):
        raise TypeError(f"device must be a str (auto, cpu, cuda or cuda:N), got {type(device).__name__} "
                        f"{device!r}")
    m = re.fullmatch(r"auto|cpu|cuda(?::(\d+))?", device)
    if m is None:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    has_cuda = bool(build_info()["cuda"])
    count = cuda_device_count() if has_cuda else 0
    if device == "auto":
        return "cuda:0" if count else "cpu"
    if device == "cpu":
        return device
    if not has_cuda:
        raise RuntimeError(f"device {device!r}: this llaisys build has no CUDA backend (a CPU-only build); "
                           f"use device='cpu', or reinstall with a CUDA toolkit (LLAISYS_CUDA=ON pip install .)")
    index = int(m.group(1) or 0)
    if index >= count:
        raise RuntimeError(f"device {device!r}: " + (f"only {count} CUDA device(s) are visible" if count
                                                     else "no CUDA GPU is visible on this machine"))
    return f"cuda:{index}"


def check_max_seq_len(max_seq_len, limit: int | None = None) -> None:
    """Type and sign; with `limit` (the model's max_position_embeddings, read from its config alone before
    any weight: loader.header.context_length), the upper bound too."""
    if max_seq_len is None:
        return
    if not isinstance(max_seq_len, numbers.Integral) or isinstance(max_seq_len, bool):
        raise TypeError(f"max_seq_len must be an int or None, got {type(max_seq_len).__name__} {max_seq_len!r}")
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if limit is not None and max_seq_len > limit:
        raise ValueError(f"max_seq_len must be at most {limit} for this model (its max_position_embeddings), "
                         f"got {max_seq_len}")


def check_model_arg(model) -> str:
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a str or path (catalog name, HF directory, .gguf file or repo id), "
                        f"got {type(model).__name__}")
    return os.fspath(model)


def check_text(name: str, text: str) -> None:
    """Lone surrogates (e.g. from surrogateescape'd bytes) are not text the tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode: lone surrogate {text[e.start]!r} at position "
                         f"{e.start}") from None


def token_sequence(name: str, value) -> list:
    """A list or tuple of ints, a range, or a 1-D numpy integer array -> a list (elements checked later)."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
            raise TypeError(f"{name}: a numpy array of token ids must be 1-D with an integer dtype, got "
                            f"{value.ndim}-D {value.dtype}")
        return value.tolist()
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a str or a sequence of token ids (list/tuple of ints, 1-D integer "
                        f"numpy array), got {type(value).__name__}"
                        + (" (decode bytes to str first)" if isinstance(value, (bytes, bytearray)) else ""))
    return list(value)


def trim_heap() -> None:
    """Hand freed heap pages back to the OS. glibc keeps what the loader's temporary arrays freed, which
    would otherwise stay in the process's RSS; elsewhere (no malloc_trim) this does nothing."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    malloc_trim(0)


def freeze_heap() -> None:
    """Moves every object alive now (the interpreter's, torch's or transformers' modules if imported, the
    engine's own) out of the garbage collector's reach (gc.freeze). A full collection walks every tracked
    object; while steps make many small containers (logprobs entries: ~1,800 a step at 256 rows) those
    collections ran often enough to cost more than the step itself (bench/RESULTS.md, session 31:
    logprobs=5 on 256 rows 5.8 -> 2.2 ms a step on the CPU proxy). Later objects are collected as before.
    vLLM freezes its heap after start-up the same way. Only the young generations are collected first (a
    full collection takes ~0.2 s with torch loaded, and a test run makes hundreds of engines): garbage
    already old is kept until thaw_heap."""
    import gc
    import os

    if os.environ.get("LLAISYS_GC_FREEZE", "1") == "0":  # the A/B
        return
    gc.collect(1)
    gc.freeze()


def thaw_heap() -> None:
    """Engine.close(): gives frozen objects back to the collector (the closed engine's parts are freed by
    their reference counts: the engine keeps no cycle that holds its runner or KV pool). Other engines'
    objects are collected normally again until one is made."""
    import gc
    import os

    if os.environ.get("LLAISYS_GC_FREEZE", "1") == "0":  # nothing of ours frozen: leave the caller's heap as is
        return
    gc.unfreeze()
