"""A model's context length from its config alone: config.json, or the key-value header of a GGUF file,
so the Engine can check max_seq_len before the tokenizer is built or any weight is read (a GGUF header's
full parse takes seconds for a 151k-token vocabulary; this reads only the keys before the one it needs)."""
from __future__ import annotations

import json
import mmap
import os
import struct

# GGUF value types: fixed sizes; 8 = string, 9 = array
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def context_length(path: str) -> int | None:
    """max_position_embeddings of the checkpoint at `path` (an HF directory or a .gguf file), read from its
    config only; None where it cannot be read so (the full load then reports what is wrong)."""
    try:
        if os.path.isdir(path):
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                value = json.load(f).get("max_position_embeddings")
        else:
            value = _gguf_context_length(path)
    except (OSError, ValueError, struct.error, AttributeError, UnicodeDecodeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _gguf_context_length(path: str) -> int | None:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF" or struct.unpack_from("<I", m, 4)[0] not in (2, 3):
            return None  # not a little-endian GGUF v2/v3 file
        (n_kv,) = struct.unpack_from("<Q", m, 16)
        pos, arch = 24, None
        for _ in range(n_kv):
            key, pos = _string(m, pos)
            (vtype,) = struct.unpack_from("<I", m, pos)
            pos += 4
            if key == "general.architecture" and vtype == 8:
                arch, pos = _string(m, pos)
                continue
            if arch is not None and key == f"{arch}.context_length" and vtype in _INTS:
                return struct.unpack_from(_INTS[vtype], m, pos)[0]
            pos = _skip(m, pos, vtype)
    return None


def _string(m, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", m, pos)
    if pos + 8 + n > len(m):
        raise ValueError("string beyond the end of the file")
    return m[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n


def _skip(m, pos: int, vtype: int) -> int:
    if vtype in _SIZES:
        return pos + _SIZES[vtype]
    if vtype == 8:
        return pos + 8 + struct.unpack_from("<Q", m, pos)[0]
    if vtype != 9:
        raise ValueError(f"unknown GGUF value type {vtype}")
    etype, count = struct.unpack_from("<IQ", m, pos)
    pos += 12
    if etype in _SIZES:
        return pos + _SIZES[etype] * count
    for _ in range(count):  # an array of strings (or of arrays): element by element
        pos = _skip(m, pos, etype)
        if pos > len(m):
            raise ValueError("array beyond the end of the file")
    return pos
