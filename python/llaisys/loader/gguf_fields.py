"""A faster GGUF metadata parse for gguf.GGUFReader, whose own one costs several views per array element.

gguf-py builds every metadata value from numpy views, two per string and one per number, each through
`_get` (a slice, a dtype view and a byte-order view). A 262,144-token SentencePiece vocabulary (Gemma 3:
tokens, scores and token types) is ~800k elements and took most of a minute on a loaded 2-core machine.
Here the lengths and scalars are read with struct, each string is one plain slice of the file, and each
numeric array is one view of all its values. The fields keep gguf-py's shape (ReaderField: parts, data
indices, types), so ReaderField.contents() and gguf's own alignment/tensor handling work unchanged; the
one difference is that a numeric array's values are one part (data is [that part]), not one part each.
"""
from __future__ import annotations

import struct

import numpy as np
from gguf import GGUFValueType, ReaderField

_STRUCT = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
           GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
           GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
           GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?"}


class FieldParser:
    """Parses the key/value section of `data` (the file as a uint8 ndarray) in byte order `order` ('<' or
    '>'). Truncated or malformed input raises ValueError/struct.error/IndexError, which the caller reports."""

    def __init__(self, data: np.ndarray, order: str):
        self.data, self.buf, self.order = data, memoryview(data), order

    def _u(self, fmt: str, offs: int):
        return struct.unpack_from(self.order + fmt, self.buf, offs)[0]

    def _view(self, offs: int, fmt: str, count: int = 1) -> np.ndarray:
        dtype = np.dtype(self.order + fmt)
        end = offs + dtype.itemsize * count
        if end > len(self.data):
            raise ValueError(f"metadata runs past the end of the file (offset {end})")
        return self.data[offs:end].view(dtype)

    def _string(self, offs: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(length part, bytes part, offset after the string)"""
        n = self._u("Q", offs)
        if offs + 8 + n > len(self.data):
            raise ValueError(f"a metadata string at offset {offs} runs past the end of the file")
        return self._view(offs, "Q"), self.data[offs + 8:offs + 8 + n], offs + 8 + n

    def field(self, offs: int) -> tuple[ReaderField, int]:
        """The key/value pair at offs and the offset after it."""
        start = offs
        klen, kdata, offs = self._string(offs)
        raw_type = self._view(offs, "I")
        offs += 4
        gtype = GGUFValueType(int(raw_type[0]))
        parts = [klen, kdata, raw_type]
        if gtype == GGUFValueType.ARRAY:
            raw_itype, alen = self._view(offs, "I"), self._view(offs + 4, "Q")
            offs += 12
            itype, count = GGUFValueType(int(raw_itype[0])), int(alen[0])
            parts += [raw_itype, alen]
            types = [gtype, itype]
            if itype == GGUFValueType.STRING:
                data, offs = self._strings(offs, count, parts)
            elif itype in _STRUCT:
                parts.append(self._view(offs, _STRUCT[itype], count))
                offs += parts[-1].nbytes
                data = [len(parts) - 1]
            else:  # arrays of arrays: no tokenizer or config key uses them
                raise ValueError(f"metadata key {_text(kdata)!r}: arrays of {itype.name} are not supported")
        elif gtype == GGUFValueType.STRING:
            slen, sdata, offs = self._string(offs)
            parts += [slen, sdata]
            types, data = [gtype], [len(parts) - 1]
        else:
            parts.append(self._view(offs, _STRUCT[gtype]))
            offs += parts[-1].nbytes
            types, data = [gtype], [len(parts) - 1]
        return ReaderField(start, _text(kdata), parts, data, types), offs

    def _strings(self, offs: int, count: int, parts: list) -> tuple[list[int], int]:
        """Appends each string's bytes (one slice each; the length parts are left out, since contents()
        reads only the data indices) and returns their indices and the offset after the array."""
        unpack, data, size = struct.Struct(self.order + "Q").unpack_from, self.data, len(self.data)
        first = len(parts)
        for _ in range(count):
            n = unpack(self.buf, offs)[0]
            if offs + 8 + n > size:
                raise ValueError(f"a metadata string at offset {offs} runs past the end of the file")
            parts.append(data[offs + 8:offs + 8 + n])
            offs += 8 + n
        return list(range(first, first + count)), offs


def _text(b: np.ndarray) -> str:
    return b.tobytes().decode("utf-8")
