"""Q5_0 in the split row layout (QuantLayout::Q5Split, cpp/quant/formats.hpp): the same weights as the file's
blocks, bit for bit through every op and every CPU path (kernels.inc: dot_q5_split, KQ5_0S), and what a CPU
model keeps. References: gguf-py's dequantization, and the file layout's results on the portable path (itself
checked against gguf-py and float64 in test_quant.py)."""
import numpy as np
import pytest

import llaisys
from llaisys import quant
from utils import bits, poisoned

gguf = pytest.importorskip("gguf")
from test_quant import PATHS, cpu_path  # noqa: F401 (the fixture: each CPU path this machine can run)


def q5_blocks(rows, cols, seed, from_floats=True):
    """uint8 [rows, row_bytes]: gguf-py's Q5_0 of normal floats, or random bytes (every code and fifth-bit
    pattern) with f16 scales in [1e-3, 0.05]."""
    rng = np.random.default_rng(seed)
    if from_floats:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), gguf.GGMLQuantizationType.Q5_0)
    blocks = rng.integers(0, 256, (rows, cols // 32, 22), dtype=np.uint8)
    blocks[:, :, 0:2] = rng.uniform(1e-3, 0.05, (rows, cols // 32)).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def pair(data):
    """(file-layout matrix, its split copy) of uint8 Q5_0 rows."""
    rows, cols = data.shape[0], data.shape[1] // 22 * 32
    w = quant.from_numpy("q5_0", rows, cols, np.ascontiguousarray(data))
    return w, w.with_layout("q5_split")


# nb = K / 32 blocks a row: 1 (a lone unpaired block), odd (a tail block after pairs), even; 28 = the 0.5B's K
SHAPES = [(1, 32), (13, 96), (37, 224), (8, 256), (19, 896), (3, 32 * 41)]


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("from_floats", [True, False], ids=["quantized", "random_bytes"])
def test_split_holds_the_same_weights(rows, cols, from_floats):
    data = q5_blocks(rows, cols, seed=rows + cols, from_floats=from_floats)
    w, s = pair(data)
    assert (w.layout, s.layout) == ("file", "q5_split")
    assert (s.rows, s.cols, s.row_bytes, s.format) == (w.rows, w.cols, w.row_bytes, "q5_0")
    assert not np.array_equal(s.bytes.numpy(), data) or cols == 32  # the bytes did move
    np.testing.assert_array_equal(s.with_layout("file").bytes.numpy(), data)
    ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q5_0)
    np.testing.assert_array_equal(bits(llaisys.tensor(s.dequantize())), bits(llaisys.tensor(ref)))
    np.testing.assert_array_equal(s.dequantize(2 % rows, 1), ref[2 % rows:2 % rows + 1])
    np.testing.assert_array_equal(bits(quant.dequantize(s)), bits(llaisys.tensor(ref)))


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 9, 17, 33])
def test_split_linear_bits_each_cpu_path(cpu_path, rows, cols, M):
    """Decode (M = 1: dot_q5_split), the tiles and, on AVX2/VNNI, the packed prefill kernel (column_u8) give
    the file layout's bits on the same path and the portable path's; rows not a multiple of 8, odd block
    counts (the unpaired last block keeps the file's qh)."""
    w, s = pair(q5_blocks(rows, cols, seed=M * 7 + rows, from_floats=M % 2 == 0))
    rng = np.random.default_rng(M)
    x = llaisys.tensor(rng.standard_normal((M, cols)).astype(np.float32))
    bias = llaisys.tensor(rng.standard_normal(rows).astype(np.float32))
    out = poisoned((M, rows))
    quant.linear_(out, x, s, bias)
    np.testing.assert_array_equal(bits(out), bits(quant.linear(x, w, bias)))
    quant.set_cpu_path("portable")
    np.testing.assert_array_equal(bits(out), bits(quant.linear(x, w, bias)))


@pytest.mark.parametrize("M", [1, 5])
def test_split_linear_swiglu_and_embedding(cpu_path, M):
    w, s = pair(q5_blocks(2 * 40, 224, seed=M))
    x = llaisys.tensor(np.random.default_rng(M).standard_normal((M, 224)).astype(np.float32))
    np.testing.assert_array_equal(bits(quant.linear_swiglu(x, s)), bits(quant.linear_swiglu(x, w)))
    ids = llaisys.tensor(np.array([79, 0, 41, 41], np.int64))
    np.testing.assert_array_equal(bits(quant.embedding(ids, s)), bits(quant.embedding(ids, w)))


def test_split_decode_reads_nothing_past_the_matrix(cpu_path):
    """The decode kernel reads 8 blocks' scales at a time and the fifth bits 8 bytes a pair: with the split
    rows ending just before an unreadable page (as test_quant.py's guarded_bytes), it still gives the bits."""
    import ctypes, mmap  # noqa: E401
    N, K = 21, 32 * 5  # nb = 5: a tail block, and the last scale group reads past the row's scales
    w, s = pair(q5_blocks(N, K, seed=3))
    split = s.bytes.numpy()
    page = mmap.PAGESIZE
    pages = -(-split.nbytes // page)
    m = mmap.mmap(-1, (pages + 1) * page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    guard = ctypes.addressof(ctypes.c_char.from_buffer(m)) + pages * page
    assert libc.mprotect(guard, page, 0) == 0
    try:
        view = np.frombuffer(m, np.uint8, split.nbytes, pages * page - split.nbytes)
        view[:] = split.reshape(-1)
        x = llaisys.tensor(np.random.default_rng(4).standard_normal((1, K)).astype(np.float32))
        got = quant.linear(x, quant.from_numpy("q5_0", N, K, view, layout="q5_split"))
        np.testing.assert_array_equal(bits(got), bits(quant.linear(x, w)))
    finally:
        libc.mprotect(guard, page, mmap.PROT_READ | mmap.PROT_WRITE)


def test_split_rows_slices_and_devices():
    w, s = pair(q5_blocks(30, 96, seed=9))
    x = llaisys.tensor(np.random.default_rng(9).standard_normal((1, 96)).astype(np.float32))
    part = s.slice_rows(7, 19)
    assert part.layout == "q5_split"
    np.testing.assert_array_equal(bits(quant.linear(x, part)), bits(quant.linear(x, w.slice_rows(7, 19))))
    both = quant.QuantMatrix.concat_rows([s.slice_rows(0, 4), s.slice_rows(20, 30)])
    assert both.layout == "q5_split"
    np.testing.assert_array_equal(both.dequantize(), np.concatenate([w.dequantize(0, 4), w.dequantize(20, 10)]))
    assert s.to("cpu") is not None and s.to("cpu").layout == "q5_split"
    assert s.with_layout("q5_split").layout == "q5_split"
    with pytest.raises(ValueError, match="layout"):
        quant.QuantMatrix.concat_rows([s, w])
    with pytest.raises(ValueError, match="layout must be"):
        s.with_layout("interleaved")
    q8 = quant.from_numpy("q8_0", 2, 32, np.zeros((2, 34), np.uint8))
    with pytest.raises(ValueError, match="only a Q5_0"):
        q8.with_layout("q5_split")
    with pytest.raises(ValueError, match="split layout is for Q5_0"):
        quant.from_numpy("q8_0", 2, 32, np.zeros((2, 34), np.uint8), layout="q5_split")


def test_cpu_layout_by_best_path_and_width():
    """A CPU model keeps Q5_0 rows of up to 2048 columns split where AVX2 is the best path (AVX-512 VNNI keeps
    its own, file-layout kernel: one masked add for the fifth bit; longer rows ran slower split), and every
    other format as the file has it."""
    avx2_only = quant.cpu_path_supported("avx2") and not quant.cpu_path_supported("avx512vnni")
    assert quant.cpu_layout("q5_0", 896) == quant.cpu_layout("q5_0", 2048) == ("q5_split" if avx2_only else "file")
    assert quant.cpu_layout("q5_0", 4864) == "file"
    for fmt in ["q4_0", "q4_k", "q5_k", "q6_k", "q8_0"]:
        assert quant.cpu_layout(fmt, 896) == "file"
