"""The frames nodes send each other (engine/nodes.py): the rendezvous' hellos and node 0's runner calls.

A frame is a 4-byte big-endian length and one encoded value. A value is a 1-byte tag and its body:
  N None   T True   F False   i int64   f float64   s str (u32 length, UTF-8)   b bytes (u32 length)
  l list (u32 count, values; a tuple is sent as a list)   d dict (u32 count, str keys and values)
  a numpy array: a dtype code (u8), ndim (u8), each dim (u64), then the C-order bytes (the host's order)
Only these: never pickle, so a frame from the network cannot make this process run anything. A frame that
is malformed (an unknown tag or dtype, a length past its end, bytes left over, too deep) raises WireError.
"""
from __future__ import annotations

import socket
import struct

import numpy as np

MAX_FRAME = 1 << 30  # a step's arrays are kilobytes; a length beyond this is garbage, not a step
MAX_DEPTH = 16
_DTYPES = [np.dtype(t) for t in ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float32", "float64",
                                 "bool")]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_I64, _F64, _U32, _U64 = struct.Struct("<q"), struct.Struct("<d"), struct.Struct("<I"), struct.Struct("<Q")


class WireError(ValueError):
    """A frame that does not decode (or a value that cannot be encoded)."""


def encode(value) -> bytes:
    out: list[bytes] = []
    _encode(value, out, 0)
    return b"".join(out)


def _encode(v, out: list, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise WireError(f"a value nested deeper than {MAX_DEPTH}")
    if v is None:
        out.append(b"N")
    elif v is True or v is False:
        out.append(b"T" if v else b"F")
    elif isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        if not -2**63 <= int(v) < 2**63:
            raise WireError(f"int {v} does not fit in 64 bits")
        out += [b"i", _I64.pack(int(v))]
    elif isinstance(v, (float, np.floating)):
        out += [b"f", _F64.pack(float(v))]
    elif isinstance(v, str):
        raw = v.encode("utf-8")
        out += [b"s", _U32.pack(len(raw)), raw]
    elif isinstance(v, (bytes, bytearray)):
        out += [b"b", _U32.pack(len(v)), bytes(v)]
    elif isinstance(v, np.ndarray):
        code = _DTYPE_CODE.get(v.dtype) if v.dtype.isnative else None
        if code is None:
            raise WireError(f"arrays of {v.dtype} are not sent")
        out += [b"a", bytes([code, v.ndim]), *(_U64.pack(n) for n in v.shape), np.ascontiguousarray(v).tobytes()]
    elif isinstance(v, (list, tuple)):
        out += [b"l", _U32.pack(len(v))]
        for item in v:
            _encode(item, out, depth + 1)
    elif isinstance(v, dict):
        out += [b"d", _U32.pack(len(v))]
        for key, item in v.items():
            if not isinstance(key, str):
                raise WireError(f"dict keys must be str, got {type(key).__name__}")
            _encode(key, out, depth + 1)
            _encode(item, out, depth + 1)
    else:
        raise WireError(f"a {type(v).__name__} is not sent (None, bool, int, float, str, bytes, list, dict, "
                        f"numpy arrays only)")


def decode(data: bytes):
    """The value of one frame's body; WireError where it is malformed."""
    reader = _Reader(memoryview(data))
    value = reader.value(0)
    if reader.pos != len(data):
        raise WireError(f"{len(data) - reader.pos} bytes left over after the value")
    return value


class _Reader:
    def __init__(self, data: memoryview):
        self.data, self.pos = data, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise WireError(f"the frame ends at byte {len(self.data)} but a field needs bytes up to {self.pos + n}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, s: struct.Struct):
        return s.unpack(self.take(s.size))[0]

    def value(self, depth: int):
        if depth > MAX_DEPTH:
            raise WireError(f"a value nested deeper than {MAX_DEPTH}")
        tag = bytes(self.take(1))
        if tag in (b"N", b"T", b"F"):
            return {b"N": None, b"T": True, b"F": False}[tag]
        if tag == b"i":
            return self.unpack(_I64)
        if tag == b"f":
            return self.unpack(_F64)
        if tag == b"s":
            try:
                return str(self.take(self.unpack(_U32)), "utf-8")
            except UnicodeDecodeError as e:
                raise WireError(f"a string that is not UTF-8 ({e})") from None
        if tag == b"b":
            return bytes(self.take(self.unpack(_U32)))
        if tag == b"l":
            return [self.value(depth + 1) for _ in range(self.unpack(_U32))]
        if tag == b"d":
            out = {}
            for _ in range(self.unpack(_U32)):
                key = self.value(depth + 1)
                if not isinstance(key, str):
                    raise WireError(f"a dict key that is a {type(key).__name__}, not a str")
                out[key] = self.value(depth + 1)
            return out
        if tag == b"a":
            return self.array()
        raise WireError(f"unknown tag {tag!r} at byte {self.pos - 1}")

    def array(self) -> np.ndarray:
        code, ndim = bytes(self.take(2))
        if code >= len(_DTYPES):
            raise WireError(f"unknown array dtype code {code}")
        if ndim > 8:
            raise WireError(f"an array of {ndim} dims")
        shape = tuple(self.unpack(_U64) for _ in range(ndim))
        count = int(np.prod(shape, dtype=object)) if shape else 1
        raw = self.take(count * _DTYPES[code].itemsize)  # raises before anything that large is allocated
        return np.frombuffer(raw, dtype=_DTYPES[code]).reshape(shape).copy()  # writable, owns its memory


def send_frame(sock: socket.socket, value) -> None:
    body = encode(value)
    if len(body) > MAX_FRAME:
        raise WireError(f"a frame of {len(body)} bytes (at most {MAX_FRAME})")
    sock.sendall(struct.pack(">I", len(body)) + body)


def recv_frame(sock: socket.socket):
    """The next frame's value; ConnectionError when the peer closed the connection (between frames or in
    one), socket.timeout past the socket's timeout, WireError for a malformed frame."""
    (n,) = struct.unpack(">I", _recv_exactly(sock, 4))
    if n > MAX_FRAME:
        raise WireError(f"a frame of {n} bytes announced (at most {MAX_FRAME})")
    return decode(_recv_exactly(sock, n))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)
