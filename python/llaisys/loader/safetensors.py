"""Reading .safetensors files without the safetensors package (its numpy path cannot return bf16).

Format: an 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}} (plus an
optional "__metadata__"), then the raw data; offsets are relative to the end of the header. Each tensor comes
back as a read-only np.frombuffer view of one read-only mmap of the file (zero-copy; the mapping stays alive
as long as any view does).
"""
from __future__ import annotations

import json
import mmap
import os
import struct

import ml_dtypes
import numpy as np

from . import FileSpan

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one file, validated against the file's size. Raises ValueError naming the file."""
    return _read(os.fspath(path))[0]


def _read(path: str) -> tuple[dict[str, np.ndarray], dict[str, FileSpan]]:
    """read_safetensors, plus where each tensor lies in the mapping (to release its pages after use)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes, shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path}: corrupt safetensors header: header length {n} is beyond the file's "
                             f"{size} bytes (truncated or not a safetensors file)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header: invalid JSON ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: corrupt safetensors header: expected a JSON object")
        header.pop("__metadata__", None)
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else b""
    spans, file_spans = [], {}
    tensors = {}
    for name, info in header.items():
        dtype, shape, (begin, end) = _tensor_info(path, name, info)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if 8 + n + end > size:
            raise ValueError(f"{path}: tensor {name!r} ends at byte {8 + n + end}, beyond the end of the file "
                             f"({size} bytes): the file is truncated")
        if end - begin != nbytes:
            raise ValueError(f"{path}: tensor {name!r} has {end - begin} bytes of data, but its shape {list(shape)} "
                             f"and dtype {info['dtype']} need {nbytes}")
        spans.append((begin, end, name))
        tensors[name] = np.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize,
                                      offset=8 + n + begin).reshape(shape)
        file_spans[name] = FileSpan(buf, 8 + n + begin, nbytes)
    _check_no_overlap(path, spans)
    return tensors, file_spans


def _tensor_info(path: str, name: str, info) -> tuple[np.dtype, tuple[int, ...], tuple[int, int]]:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise ValueError(f"{path}: corrupt safetensors header: entry {name!r} needs dtype, shape and data_offsets")
    dtype = DTYPES.get(info["dtype"])
    if dtype is None:
        raise ValueError(f"{path}: tensor {name!r} has unknown dtype {info['dtype']!r}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError(f"{path}: corrupt safetensors header: tensor {name!r} has invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"{path}: corrupt safetensors header: tensor {name!r} has invalid data_offsets {offsets!r}")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def _check_no_overlap(path: str, spans: list) -> None:
    spans.sort()
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise ValueError(f"{path}: corrupt safetensors header: tensors {a!r} and {b!r} overlap")


def read_checkpoint_dir(path: str) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, FileSpan]]:
    """Every tensor of an HF checkpoint directory, the file each came from and where it lies in that file's
    mapping. Sharded checkpoints are read through model.safetensors.index.json; without an index, every
    *.safetensors file is read."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        files, expected_in = _read_index(index_path)
    else:
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        expected_in = {}
    if not files:
        other = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".gguf"))]
        hint = f" (found {', '.join(sorted(other))}; only safetensors checkpoints are read)" if other else ""
        raise FileNotFoundError(f"{path}: no *.safetensors weights{hint}")
    tensors, file_of, spans = {}, {}, {}
    for file in files:
        arrays, file_spans = _read(file)
        for name, array in arrays.items():
            if name in tensors:
                raise ValueError(f"{file}: tensor {name!r} is also in {file_of[name]}")
            tensors[name], file_of[name], spans[name] = array, file, file_spans[name]
    for name, file in expected_in.items():
        if file_of.get(name) != file:
            raise ValueError(f"{index_path}: tensor {name!r} is listed in {os.path.basename(file)} but "
                             f"{'is in ' + file_of[name] if name in file_of else 'is not in any shard'}")
    return tensors, file_of, spans


def _read_index(index_path: str) -> tuple[list[str], dict[str, str]]:
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        folder = os.path.dirname(index_path)
        expected_in = {name: os.path.join(folder, file) for name, file in weight_map.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index_path}: invalid index ({type(e).__name__}: {e})") from None
    files = sorted(set(expected_in.values()))
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{index_path}: shard {os.path.basename(file)} is missing")
    return files, expected_in
