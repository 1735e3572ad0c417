"""Quantized weights: block decoding against gguf-py, and the CPU quantized linear against float64.

Decoding must equal ``gguf.quants.dequantize`` bit for bit, on random blocks and on the default
model's tensors. The linear's reference is float64 arithmetic on the dequantized weights and on x
quantized to 8-bit blocks with the formula the op documents (d = max|x| / 127 in f32, q = round(x / d)
halves away from zero), so its tolerance covers only the op's f32 accumulation.
"""
import glob
import os
import sys

import ml_dtypes
import numpy as np
import pytest

import llaisys
from llaisys import quant
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, TOL, bits, poisoned

gguf = pytest.importorskip("gguf")
GQT = gguf.GGMLQuantizationType

FORMATS = ["q4_0", "q4_k", "q5_0", "q5_k", "q6_k", "q8_0"]
GGUF_QUANTIZES = {"q4_0", "q5_0", "q8_0"}  # gguf-py has no quantizer for the K-quants
PATHS = ["portable", "avx2", "avx512vnni"]
# Bytes of each block holding the codes (not d, dmin or the sub-block scales): zeroing them leaves a
# block whose decoded values are the offsets/mins alone (see weight_magnitude).
CODE_BYTES = {"q4_0": (2, 18), "q5_0": (2, 22), "q8_0": (2, 34), "q4_k": (16, 144), "q5_k": (16, 176),
              "q6_k": (0, 192)}
# Where the f16 scales d (and dmin) sit in a block.
SCALE_OFFSETS = {"q4_0": [0], "q5_0": [0], "q8_0": [0], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}


def gtype(fmt):
    return getattr(GQT, fmt.upper())


def block_elems(fmt):
    return quant.format_info(fmt)["block_elems"]


def random_blocks(fmt, rows, cols, seed, from_floats=True):
    """uint8 [rows, row_bytes]: gguf-py's quantization of normal floats where it has one, else random
    bytes (every code and sub-block scale value occurs) with f16 scales d, dmin in [1e-3, 0.05]."""
    rng = np.random.default_rng(seed)
    if from_floats and fmt in GGUF_QUANTIZES:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), gtype(fmt))
    info = quant.format_info(fmt)
    nb = cols // info["block_elems"]
    blocks = rng.integers(0, 256, (rows, nb, info["block_bytes"]), dtype=np.uint8)
    for off in SCALE_OFFSETS[fmt]:
        d = rng.uniform(1e-3, 0.05, (rows, nb)).astype(np.float16)
        blocks[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, nb, 2)
    return blocks.reshape(rows, -1)


def matrix(fmt, data):
    rows = data.shape[0]
    cols = data.shape[1] // quant.format_info(fmt)["block_bytes"] * block_elems(fmt)
    return quant.from_numpy(fmt, rows, cols, np.ascontiguousarray(data))


# ---- decoding ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("from_floats", [True, False], ids=["quantized", "random_bytes"])
def test_dequantize_bit_equal_to_gguf(fmt, from_floats):
    data = random_blocks(fmt, 37, 4 * 256, seed=11, from_floats=from_floats)
    w = matrix(fmt, data)
    assert (w.rows, w.cols, w.row_bytes) == (37, 1024, data.shape[1])
    ref = gguf.quants.dequantize(data, gtype(fmt))
    np.testing.assert_array_equal(w.dequantize().view(np.uint32), ref.view(np.uint32))
    np.testing.assert_array_equal(w.dequantize(5, 3).view(np.uint32), ref[5:8].view(np.uint32))


def default_model_path():
    hits = glob.glob(os.path.expanduser("~/.cache/llaisys/models/*/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    return hits[0] if hits else None


@pytest.fixture(scope="module")
def model_tensors():
    """{format: [tensors]} of the default model's GGUF (memory-mapped by gguf.GGUFReader)."""
    path = default_model_path()
    if path is None:
        pytest.skip("the default model's GGUF (qwen2.5-coder-0.5b-instruct-q4_k_m.gguf) is not in ~/.cache/llaisys; "
                    "`llaisys generate` downloads it")
    by_format = {}
    for t in gguf.GGUFReader(path).tensors:
        name = t.tensor_type.name.lower()
        if name in FORMATS:
            by_format.setdefault(name, []).append(t)
    return by_format


def test_default_model_has_the_expected_formats(model_tensors):
    assert set(model_tensors) == {"q4_k", "q5_0", "q6_k", "q8_0"}  # issue 19: what the Q4_K_M file holds


@pytest.mark.parametrize("fmt", ["q4_k", "q5_0", "q6_k", "q8_0"])
def test_dequantize_real_tensors(model_tensors, fmt):
    # Up to 3 tensors per format, at most 1024 rows each (the 151936-row embedding is Q5_0 or Q8_0).
    for t in model_tensors.get(fmt, [])[:3]:
        data = np.asarray(t.data)[:1024]  # uint8 [rows, row_bytes], a view of the mapped file
        w = quant.from_numpy(fmt, data.shape[0], int(t.shape[0]), data)
        ref = gguf.quants.dequantize(data, t.tensor_type)
        np.testing.assert_array_equal(w.dequantize().view(np.uint32), ref.view(np.uint32), err_msg=t.name)


# ---- the quantized linear -----------------------------------------------------------------------

def quantized_x(x32, bk):
    """float64 values of x after the op's 8-bit block quantization (x32: f32 [M, K])."""
    M, K = x32.shape
    xb = x32.reshape(M, K // bk, bk)
    d = np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127)  # f32, as in the op
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    v = (xb * inv).astype(np.float64)  # the f32 product, then rounded half away from zero exactly
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)
    return (q * d.astype(np.float64)).reshape(M, K)


def weight_magnitude(fmt, data):
    """Per weight |w| + 2 |offset part| (f64 [N, K]): a bound that holds however the op splits code and
    offset parts (it folds the offsets of Q4_0/Q5_0/Q8_0/Q6_K into the integer sums, but sums Q4_K/Q5_K's
    d * sc * q and dmin * m separately), so their sizes, not |w|, bound its rounding. The offset part is what decodes from the block with its code bytes zeroed."""
    lo, hi = CODE_BYTES[fmt]
    bb = quant.format_info(fmt)["block_bytes"]
    z = data.reshape(data.shape[0], -1, bb).copy()
    z[:, :, lo:hi] = 0
    off = gguf.quants.dequantize(z.reshape(data.shape), gtype(fmt)).astype(np.float64)
    w = gguf.quants.dequantize(data, gtype(fmt)).astype(np.float64)
    return np.abs(w) + 2 * np.abs(off)


def linear_tol(fmt, dtype, xq, data):
    """TOL[dtype] with atol widened by a bound on the f32 accumulation.

    Reason: per x row and W row the op adds one f32 term per block (nb of them, into 8 lanes, then a
    horizontal sum and the offset correction): each rounding is at most 2^-24 of a partial sum, and
    every partial sum is at most S = sum_k |xq_k| * (|w_k| + 2 |offset_k|). (nb + 8) * 2^-24 * S bounds
    the total; it matters where the output cancels to near zero. The output's own rounding to the
    dtype stays in TOL's rtol."""
    K = xq.shape[1]
    nb = K // block_elems(fmt)
    S = np.abs(xq) @ weight_magnitude(fmt, data).T
    t = dict(TOL[dtype])
    return t["rtol"], t["atol"] + (nb + 8) * 2.0**-24 * S


# CUDA runs batches of up to 8 rows through the quantized GEMV (x quantized as on the CPU); larger ones
# decode the weight to x's dtype and run the dense linear on the unquantized x (quant_linear/cuda.cu).
CUDA_GEMV_MAX_M = 8


def dense_tol(dtype, x64, wd64):
    """TOL[dtype] for CUDA's M > 8 path (the weight decoded to the dtype, then the dense linear).

    Reason for the wider atol: as in test_ops_linear.tol, the dense GEMM sums K products in f32 in an
    order of its own; that error random-walks to about eps_f32 * K * |x||w| / 3 and matters only for
    outputs that cancel to near zero, so atol gets 2 * eps_f32 * K * mean|x| * mean|w|. The weight's
    rounding to the dtype is part of the op here and sits in the reference (wd64 holds the rounded
    values), not in the tolerance."""
    t = dict(TOL[dtype])
    t["atol"] = max(t["atol"], 2 * 2.0**-24 * x64.shape[1] * np.abs(x64).mean() * np.abs(wd64).mean())
    return t["rtol"], t["atol"]


def run_linear(fmt, dtype, M, N, K, seed, with_bias=False, device="cpu"):
    data = random_blocks(fmt, N, K, seed=seed)
    w = matrix(fmt, data).to(device)
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((M, K)).astype(NP_DTYPE[dtype])
    b = rng.standard_normal(N).astype(NP_DTYPE[dtype]) if with_bias else None
    out = poisoned((M, N), dtype, device)
    quant.linear_(out, llaisys.tensor(x, device), w, llaisys.tensor(b, device) if with_bias else None)
    if device != "cpu" and M > CUDA_GEMV_MAX_M:  # CUDA's dequantize + dense path: x is not quantized
        wd = gguf.quants.dequantize(data, gtype(fmt)).astype(NP_DTYPE[dtype]).astype(np.float64)
        ref = x.astype(np.float64) @ wd.T
        tol = dense_tol(dtype, x.astype(np.float64), wd)
    else:
        xq = quantized_x(x.astype(np.float32), block_elems(fmt))
        ref = xq @ gguf.quants.dequantize(data, gtype(fmt)).astype(np.float64).T
        tol = linear_tol(fmt, dtype, xq, data)
    if with_bias:
        ref = ref + b.astype(np.float64)
    return out, ref, tol


def check(out, ref, tol):
    rtol, atol = tol
    got = np.asarray(out.to("cpu").numpy()).astype(np.float64)
    assert not np.isnan(got).any(), "output has NaN (an element was not written?)"
    err = np.abs(got - ref)
    bad = err > atol + rtol * np.abs(ref)
    assert not bad.any(), f"{bad.sum()} outputs off; worst error {err.max():.3g} (ref {np.abs(ref).max():.3g})"


@pytest.fixture(params=PATHS)
def cpu_path(request):
    if not quant.cpu_path_supported(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} path")
    quant.set_cpu_path(request.param)
    yield request.param
    quant.set_cpu_path("auto")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", [1, 2, 7, 8, 9, 64])
@pytest.mark.parametrize("N", [19, 111])
def test_linear_matches_float64(fmt, dtype, M, N):
    out, ref, tol = run_linear(fmt, dtype, M, N, 512, seed=M * 1000 + N)
    check(out, ref, tol)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", [1, 2, 7, 8, 9, 17, 64, 200])
def test_linear_each_cpu_path(cpu_path, fmt, dtype, M):
    """Every path matches the reference, and the SIMD paths give the portable path's bits (isa.hpp);
    M covers the decode kernel, every tile height with leftovers, and the 16-row packed tiles, full and
    partial (VNNI: the 32-element formats; AVX2: Q4_0 and Q5_0, in passes of 8 rows)."""
    out, ref, tol = run_linear(fmt, dtype, M, 111, 768, seed=M, with_bias=True)
    check(out, ref, tol)
    quant.set_cpu_path("portable")
    portable, _, _ = run_linear(fmt, dtype, M, 111, 768, seed=M, with_bias=True)
    np.testing.assert_array_equal(bits(out), bits(portable))


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0", "q8_0"])
@pytest.mark.parametrize("M", [1, 9, 19])
def test_linear_extreme_codes_each_cpu_path(cpu_path, fmt, M):
    """The largest products the integer paths form: every weight code at its lowest or highest value and
    every x code at +-127 (x = +-1, so each block's d is 1/127). AVX2's prefill
    kernel sums two (x code + 128) * (weight code - offset) products in int16 (isa.hpp: u8_format_ok);
    this is where it would saturate. The portable path's bits and the float64 reference."""
    rng = np.random.default_rng(M)
    K, N = 19 * 32, 23
    info = quant.format_info(fmt)
    lo, hi = CODE_BYTES[fmt]
    data = np.zeros((N, K // 32, info["block_bytes"]), np.uint8)
    data[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    fill = {"q4_0": (0x00, 0xFF), "q5_0": (0x00, 0xFF), "q8_0": (0x80, 0x7F)}[fmt]  # codes all min / all max
    data[:, :, lo:hi] = np.where(rng.random((N, K // 32, 1)) < 0.5, *fill).astype(np.uint8)
    data = data.reshape(N, -1)
    x = np.where(rng.random((M, K)) < 0.5, -1.0, 1.0).astype(np.float32)
    out = poisoned((M, N))
    quant.linear_(out, llaisys.tensor(x), matrix(fmt, data))
    xq = quantized_x(x, 32)
    check(out, xq @ gguf.quants.dequantize(data, gtype(fmt)).astype(np.float64).T, linear_tol(fmt, "f32", xq, data))
    quant.set_cpu_path("portable")
    portable = quant.linear(llaisys.tensor(x), matrix(fmt, data))
    np.testing.assert_array_equal(bits(out), bits(portable))


@pytest.fixture
def guarded_bytes():
    """make(nbytes) -> a uint8 array whose last byte is the last one before a page the process may not read
    (PROT_NONE): a kernel that reads past it crashes the test. Linux only (mprotect through ctypes)."""
    import ctypes
    import mmap

    if not sys.platform.startswith("linux"):
        pytest.skip("mprotect through ctypes: Linux only")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    maps = []

    def make(nbytes):
        page = mmap.PAGESIZE
        data_pages = -(-nbytes // page)
        m = mmap.mmap(-1, (data_pages + 1) * page)
        guard = ctypes.addressof(ctypes.c_char.from_buffer(m)) + data_pages * page
        maps.append((m, guard, page))
        assert libc.mprotect(guard, page, 0) == 0, os.strerror(ctypes.get_errno())  # PROT_NONE
        return np.frombuffer(m, np.uint8, nbytes, data_pages * page - nbytes)

    yield make
    for m, guard, page in maps:
        libc.mprotect(guard, page, mmap.PROT_READ | mmap.PROT_WRITE)  # the numpy views may outlive m.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_reads_nothing_past_the_matrix(cpu_path, guarded_bytes, fmt):
    """Decode (M = 1) asks for the bytes ahead of each W row (kernels.inc: rows prefetches 4 KiB ahead):
    with W ending just before an unreadable page, every path still runs and gives the portable bits."""
    N, K = 37, 256 * 3
    data = random_blocks(fmt, N, K, seed=5)
    w = guarded_bytes(data.nbytes)
    w[:] = data.reshape(-1)
    x = llaisys.tensor(np.random.default_rng(6).standard_normal((1, K)).astype(np.float32))
    out = quant.linear(x, quant.from_numpy(fmt, N, K, w))
    quant.set_cpu_path("portable")
    np.testing.assert_array_equal(bits(out), bits(quant.linear(x, matrix(fmt, data))))


@pytest.mark.parametrize("fmt", ["q5_0", "q4_k"])
def test_linear_nan_input_makes_its_row_nan(fmt):
    data = random_blocks(fmt, 19, 512, seed=3)
    x = np.random.default_rng(4).standard_normal((3, 512)).astype(np.float32)
    x[1, 300] = np.nan
    out = poisoned((3, 19))
    quant.linear_(out, llaisys.tensor(x), matrix(fmt, data))
    got = out.numpy()
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_real_weights(model_tensors, fmt):
    if fmt not in model_tensors:
        pytest.skip(f"the default model has no {fmt} tensor")
    t = model_tensors[fmt][0]
    data = np.asarray(t.data)[:256]
    w = quant.from_numpy(fmt, data.shape[0], int(t.shape[0]), data)
    x = np.random.default_rng(5).standard_normal((2, w.cols)).astype(np.float32)
    xq = quantized_x(x, block_elems(fmt))
    out = quant.linear(llaisys.tensor(x), w)
    check(out, xq @ gguf.quants.dequantize(data, t.tensor_type).astype(np.float64).T, linear_tol(fmt, "f32", xq, data))


@pytest.mark.parametrize("fmt", ["q5_0", "q6_k"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", [1, 9])
@pytest.mark.parametrize("I", [37, 301])  # 301: decode's fused path (M = 1) over several tasks and a partial chunk
def test_linear_swiglu_equals_linear_then_swiglu(fmt, dtype, M, I):
    data = random_blocks(fmt, 2 * I, 512, seed=8)
    w = matrix(fmt, data)
    x = llaisys.tensor(np.random.default_rng(9).standard_normal((M, 512)).astype(NP_DTYPE[dtype]))
    out = poisoned((M, I), dtype)
    quant.linear_swiglu_(out, x, w)
    g, u = quant.linear(x, w.slice_rows(0, I)), quant.linear(x, w.slice_rows(I, 2 * I))
    ref = poisoned((M, I), dtype)
    llaisys.ops.swiglu(ref, g, u)
    np.testing.assert_array_equal(bits(out), bits(ref))


def test_x_quantization_rounds_halves_away_from_zero(cpu_path):
    """x's 8-bit codes, read back exactly through one-hot Q8_0 rows (d = 1, one code 1): d_x = 1 here, so
    each output is a code; halves round away from zero, and the float just below a half rounds down."""
    below = float(np.nextafter(np.float32(0.5), np.float32(0)))
    vals = [127, 2.5, -2.5, 0.5, -0.5, below, -below, 1.5, -1.5, 126.5, -126.5, 0, 3.25, -3.75, 1e-8, -127]
    x = np.array([vals + [v / 2 for v in vals]], np.float32)  # amax 127 -> d = 1 (the second half: halves of them)
    data = np.zeros((32, 34), np.uint8)
    data[:, 0:2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    data[np.arange(32), 2 + np.arange(32)] = 1
    out = quant.linear(llaisys.tensor(x), matrix("q8_0", data)).numpy()
    v = x.astype(np.float64)
    np.testing.assert_array_equal(out, np.sign(v) * np.floor(np.abs(v) + 0.5))


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_row_independent_of_batch(cpu_path, fmt):
    """A row's output has the same bits alone and in a batch (at every tile position), with an odd
    number of blocks per row (the kernels pair blocks), more than the 32 whose scales the packed-x
    kernel computes ahead at a time."""
    K = 37 * 32 if block_elems(fmt) == 32 else 768
    data = random_blocks(fmt, 23, K, seed=11)
    w = matrix(fmt, data)
    x = np.random.default_rng(12).standard_normal((37, K)).astype(np.float32)  # two full 16-row tiles + 5
    alone = np.concatenate([quant.linear(llaisys.tensor(x[m:m + 1].copy()), w).numpy() for m in range(37)])
    for M in (2, 9, 16, 37):  # the decode kernel's bits (M = 1) at every row of every batch height
        batch = quant.linear(llaisys.tensor(x[:M].copy()), w).numpy()
        np.testing.assert_array_equal(batch.view(np.uint32), alone[:M].view(np.uint32), err_msg=f"M = {M}")


def test_concat_rows_stacks_blocks():
    parts = [random_blocks("q8_0", n, 64, seed=n) for n in (3, 5, 2)]
    cat = quant.QuantMatrix.concat_rows([matrix("q8_0", p) for p in parts])
    assert cat.shape == (10, 64)
    np.testing.assert_array_equal(np.asarray(cat.bytes.numpy()), np.concatenate(parts))


@pytest.mark.parametrize("fmt", ["q5_0", "q6_k"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_embedding_picks_dequantized_rows(fmt, dtype):
    data = random_blocks(fmt, 50, 256, seed=12)
    w = matrix(fmt, data)
    ids = np.array([[3, 49], [0, 3]], np.int64)
    out = poisoned((2, 2, 256), dtype)
    quant.embedding_(out, llaisys.tensor(ids), w)
    ref = gguf.quants.dequantize(data, gtype(fmt))[ids].astype(NP_DTYPE[dtype])
    np.testing.assert_array_equal(bits(out), ref.view(f"u{ref.itemsize}"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_dequantize_op_bit_equal_to_gguf(device, fmt, dtype):
    """quant.dequantize_, what a CUDA model's multi-row steps decode each quantized weight with: the whole
    matrix as gguf-py decodes it, then one rounding to the dtype, into the caller's tensor (a strided one
    too, whose other elements stay as they were)."""
    data = random_blocks(fmt, 37, 512, seed=13, from_floats=False)
    w = matrix(fmt, data).to(device)
    ref = gguf.quants.dequantize(data, gtype(fmt)).astype(NP_DTYPE[dtype])
    ref_bits = ref.view(f"u{ref.itemsize}")
    out = poisoned((37, 512), dtype, device)
    quant.dequantize_(out, w)
    np.testing.assert_array_equal(bits(out), ref_bits)
    np.testing.assert_array_equal(bits(quant.dequantize(w, dtype)), ref_bits)
    wide = poisoned((37, 520), dtype, device)
    quant.dequantize_(wide.slice(1, 8, 520), w)
    got = bits(wide)
    np.testing.assert_array_equal(got[:, 8:], ref_bits)
    assert np.isnan(wide.slice(1, 0, 8).to("cpu").to("f32").numpy()).all()


# ---- error paths ------------------------------------------------------------------------------

def test_errors():
    with pytest.raises(ValueError, match="multiple of 256"):
        quant.row_bytes("q4_k", 896)  # Qwen2-0.5B's width: why that model's file uses Q5_0/Q8_0 there
    with pytest.raises(ValueError, match="unknown quantized format"):
        quant.row_bytes("q3_k", 256)
    with pytest.raises(ValueError, match="needs contiguous bytes of shape"):
        quant.from_numpy("q8_0", 2, 64, np.zeros((2, 60), np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        quant.from_numpy("q8_0", 2, 64, np.zeros((2, 68), np.int8))
    assert quant.format_from_gguf(14) == "q6_k"
    with pytest.raises(ValueError, match="GGML type 1 "):
        quant.format_from_gguf(1)  # F16 is not a quantized format

    w = matrix("q8_0", random_blocks("q8_0", 4, 64, seed=1))
    x = llaisys.tensor(np.ones((2, 64), np.float32))
    with pytest.raises(TypeError, match="quant_linear: x must be f32, f16 or bf16, got i32"):
        quant.linear_(llaisys.empty([2, 4], "i32"), llaisys.tensor(np.ones((2, 64), np.int32)), w)
    with pytest.raises(TypeError, match="quant_linear: out must have dtype f32"):
        quant.linear_(llaisys.empty([2, 4], "bf16"), x, w)
    with pytest.raises(ValueError, match="quant_linear: x's last dim must equal weight's cols K = 64"):
        quant.linear_(llaisys.empty([2, 4]), llaisys.tensor(np.ones((2, 32), np.float32)), w)
    with pytest.raises(ValueError, match="quant_linear: out must have shape"):
        quant.linear_(llaisys.empty([2, 5]), x, w)
    with pytest.raises(ValueError, match="quant_linear: bias must have shape"):
        quant.linear_(llaisys.empty([2, 4]), x, w, llaisys.empty([5]))
    with pytest.raises(ValueError, match="quant_linear_swiglu: w_gate_up must have 2I rows"):
        quant.linear_swiglu_(llaisys.empty([2, 1]), x, w.slice_rows(0, 3))
    with pytest.raises(IndexError, match="quant_embedding: id 4 at position 1"):
        quant.embedding_(llaisys.empty([2, 64]), llaisys.tensor(np.array([0, 4], np.int64)), w)
    with pytest.raises(ValueError, match="quant_dequantize: out must have shape"):
        quant.dequantize_(llaisys.empty([3, 32]), w)
    with pytest.raises(TypeError, match="quant_dequantize: out"):
        quant.dequantize_(llaisys.empty([w.rows, w.cols], "i64"), w)
    with pytest.raises(ValueError, match="unknown quantized CPU path"):
        quant.set_cpu_path("sse")


# ---- CUDA (quant_linear/cuda.cu): run by `pytest -m cuda` on a GPU machine -----------------------

cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", [1, 2, 7, 8, 9, 64])
@pytest.mark.parametrize("N", [19, 111])
def test_cuda_linear_matches_float64(fmt, dtype, M, N):
    """M <= 8: the GEMV against the quantized-x reference; M > 8: the dense path against dequantized W
    (rounded to the dtype) times the unquantized x (run_linear picks the reference)."""
    out, ref, tol = run_linear(fmt, dtype, M, N, 512, seed=M * 1000 + N, with_bias=N == 111, device="cuda")
    check(out, ref, tol)


@cuda
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("M,N,K", [(9, 64, 256), (17, 200, 2048), (64, 1000, 512), (65, 129, 1536),
                                   (128, 96, 4096), (129, 300, 768), (200, 2100, 256), (256, 77, 1024),
                                   (300, 150, 512)])
def test_cuda_tensor_core_path_matches_float64(fmt, dtype, M, N, K):
    """M > 8 with a K-quant weight and a 16-bit x: the tensor-core GEMM that decodes W tiles in shared memory
    (quant_linear/tc_gemm.cuh) for M <= kQuantTcMaxRows (64), the dense copy + cuBLASLt above; both held to
    the dense path's reference (W decoded and rounded to the dtype, unquantized x). The kernel's two tile
    shapes by default (32 rows x 128 W rows up to M = 32, 64 x 64 up to 64; with LLAISYS_QUANT_TC_MAX_ROWS=256
    in the environment also its 128- and 256-row tiles for M = 65-256), partial m16 tiles and idle warps
    (M = 9, 17), partial N tiles (N not a multiple of 64 or 128), one K step (K = 256 with two splits, or
    one), long K split over many blocks (K = 4096) and no split at all (N = 2100: enough tiles for a wave);
    with a bias at odd N."""
    out, ref, tol = run_linear(fmt, dtype, M, N, K, seed=M + N + K, with_bias=N % 2 == 1, device="cuda")
    check(out, ref, tol)


@cuda
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_cuda_tensor_core_path_strided_x_and_nan(fmt):
    """x as a column slice of a wider tensor (rows ld elements apart, 16-byte aligned) goes through the
    tensor-core GEMM as a dense x does; a NaN in one row of x makes only that row NaN."""
    M, N, K = 40, 70, 512
    data = random_blocks(fmt, N, K, seed=31)
    w = matrix(fmt, data).to("cuda")
    wide = np.random.default_rng(32).standard_normal((M, K + 64)).astype(NP_DTYPE["bf16"])
    wide[5, 17] = np.nan
    x = llaisys.tensor(wide, "cuda").slice(1, 0, K)
    out = poisoned((M, N), "bf16", "cuda")
    quant.linear_(out, x, w)
    got = np.asarray(out.to("cpu").numpy()).astype(np.float64)
    assert np.isnan(got[5]).all() and np.isfinite(np.delete(got, 5, axis=0)).all()
    x64 = np.delete(wide[:, :K].astype(np.float64), 5, axis=0)
    wd = gguf.quants.dequantize(data, gtype(fmt)).astype(NP_DTYPE["bf16"]).astype(np.float64)
    ref, (rtol, atol) = x64 @ wd.T, dense_tol("bf16", x64, wd)
    err = np.abs(np.delete(got, 5, axis=0) - ref)
    assert (err <= atol + rtol * np.abs(ref)).all(), f"worst error {err.max():.3g}"


@cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 2, 8])
@pytest.mark.parametrize("K", [512, 4096])
def test_cuda_gemv_many_rows_and_long_x(fmt, M, K):
    """More than one wave of GEMV blocks, an odd row count (a partial last block), and at K = 4096
    with M = 8 an x too long to quantize in every block (quantize_x_kernel runs ahead)."""
    out, ref, tol = run_linear(fmt, "bf16", M, 12289 if K == 512 else 2049, K, seed=M + K, with_bias=True, device="cuda")
    check(out, ref, tol)


@cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", [1, 3, 8])
def test_cuda_gemv_agrees_with_cpu(fmt, dtype, M):
    """Both devices quantize x the same way (the same bits), so they differ by accumulation order only:
    each is within linear_tol of the reference, so they are within twice it of each other."""
    cpu, ref, (rtol, atol) = run_linear(fmt, dtype, M, 333, 1536, seed=M + 40, with_bias=True)
    gpu, _, _ = run_linear(fmt, dtype, M, 333, 1536, seed=M + 40, with_bias=True, device="cuda")
    check(cpu, ref, (rtol, atol))
    check(gpu, np.asarray(cpu.numpy()).astype(np.float64), (2 * rtol, 2 * atol))


def device_matrix_at(fmt, data, offset):
    """The blocks of `data` on CUDA, starting `offset` bytes past a 256-byte aligned allocation."""
    rows, rb = data.shape
    buf = np.zeros(rows * rb + 32, np.uint8)
    buf[offset:offset + rows * rb] = data.ravel()
    flat = llaisys.tensor(buf, "cuda").slice(0, offset, offset + rows * rb)
    cols = rb // quant.format_info(fmt)["block_bytes"] * block_elems(fmt)
    return quant.QuantMatrix(fmt, rows, cols, flat.view(rows, rb))


@cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("N", [37, 8195])
def test_cuda_gemv_and_decode_same_bits_at_any_alignment(fmt, M, N):
    """The device readers load the 2-byte-aligned formats (Q4_0, Q5_0, Q8_0, Q6_K) in funnel-shifted
    4-byte words whose shift depends on where a block starts (blocks.cuh), and Q4_K/Q5_K in 16-byte
    words only where the matrix is 16-byte aligned: every start the format allows gives the same bits,
    and the decode stays gguf-py's. Blocks of the 2-byte formats alternate between the two 4-byte
    phases within a row. N = 8195 (x 512 >= 4M weights) takes the K-quants' chunked GEMV."""
    data = random_blocks(fmt, N, 512, seed=21)
    x = llaisys.tensor(np.random.default_rng(22).standard_normal((M, 512)).astype(np.float32), "cuda")
    step = 4 if fmt in ("q4_k", "q5_k") else 2  # the format's alignment (blocks.cuh's kAlign)
    outs, decoded = [], []
    for offset in (0, step, 16 - step):
        w = device_matrix_at(fmt, data, offset)
        out = poisoned((M, N), "f32", "cuda")
        quant.linear_(out, x, w)
        outs.append(bits(out))
        dense = poisoned((N, 512), "f32", "cuda")
        quant.dequantize_(dense, w)
        decoded.append(bits(dense))
    for o, d in zip(outs[1:], decoded[1:]):
        np.testing.assert_array_equal(o, outs[0])
        np.testing.assert_array_equal(d, decoded[0])
    ref = gguf.quants.dequantize(data, gtype(fmt))
    np.testing.assert_array_equal(decoded[0], ref.view(np.uint32))


@cuda
@pytest.mark.parametrize("fmt", ["q4_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("M", [3, 9])
def test_cuda_linear_nan_input_makes_its_row_nan(fmt, M):
    data = random_blocks(fmt, 19, 512, seed=3)
    x = np.random.default_rng(4).standard_normal((M, 512)).astype(np.float32)
    x[1, 300] = np.nan
    out = poisoned((M, 19), "f32", "cuda")
    quant.linear_(out, llaisys.tensor(x, "cuda"), matrix(fmt, data).to("cuda"))
    got = out.to("cpu").numpy()
    assert np.isnan(got[1]).all() and np.isfinite(np.delete(got, 1, axis=0)).all()


@cuda
@pytest.mark.parametrize("fmt", ["q4_k", "q5_0", "q6_k", "q8_0"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", [1, 5, 9, 100, 256])
@pytest.mark.parametrize("I", [37, 6007, 8209])
def test_cuda_linear_swiglu_equals_linear_then_swiglu(fmt, dtype, M, I):
    """Bit for bit on CUDA too: the fused GEMV sums g and u in linear's order (M <= 8); M = 9-64 runs, for
    the K-quants in 16 bits, the tensor-core GEMM with linear's split of K (so g and u are linear's sums),
    else the dense linear_swiglu on the same decoded weight. I = 6007: several waves of blocks, a partial last
    one; I = 8209: enough weights (I x 512 >= 4M) for the K-quants' chunked GEMV; I = 37 splits K."""
    w = matrix(fmt, random_blocks(fmt, 2 * I, 512, seed=8)).to("cuda")
    x = llaisys.tensor(np.random.default_rng(9).standard_normal((M, 512)).astype(NP_DTYPE[dtype]), "cuda")
    out = poisoned((M, I), dtype, "cuda")
    quant.linear_swiglu_(out, x, w)
    g, u = quant.linear(x, w.slice_rows(0, I)), quant.linear(x, w.slice_rows(I, 2 * I))
    ref = poisoned((M, I), dtype, "cuda")
    llaisys.ops.swiglu(ref, g, u)
    np.testing.assert_array_equal(bits(out), bits(ref))


@cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("id_dtype", ["i64", "i32"])
def test_cuda_embedding_bit_equal_to_gguf(fmt, dtype, id_dtype):
    """The device decode is gguf-py's f32 arithmetic (blocks.cuh), then one rounding to the dtype."""
    data = random_blocks(fmt, 50, 512, seed=12, from_floats=False)
    w = matrix(fmt, data).to("cuda")
    ids = np.array([[3, 49, 0], [0, 3, 17]], NP_DTYPE[id_dtype])
    out = poisoned((2, 3, 512), dtype, "cuda")
    quant.embedding_(out, llaisys.tensor(ids, "cuda"), w)
    ref = gguf.quants.dequantize(data, gtype(fmt))[ids].astype(NP_DTYPE[dtype])
    np.testing.assert_array_equal(bits(out), ref.view(f"u{ref.itemsize}"))


@cuda
def test_cuda_two_weights_decoded_into_one_scratch_inside_a_graph():
    """What a CUDA model's multi-row step does per quantized weight (models::linear): decode it into the
    model's one scratch (a view of a flat buffer sized for its largest weight), then the dense linear on
    it. Two weights of different formats and shapes back to back, captured into one CUDA graph (torch's,
    on llaisys' stream) and replayed with new x: the second decode must not overwrite the scratch before
    the first GEMM has read it, and the capture allocates nothing. Both outputs are held to the dense
    path's reference (weights rounded to the dtype, unquantized x), eagerly and at every replay."""
    torch = pytest.importorskip("torch")
    dtype, M = "bf16", 16
    specs = [("q4_k", 96, 512, 21), ("q6_k", 160, 256, 22)]  # format, N, K, seed: the second is larger
    data = [random_blocks(fmt, N, K, seed=seed) for fmt, N, K, seed in specs]
    weights = [matrix(fmt, d).to("cuda") for (fmt, *_), d in zip(specs, data)]
    dense = [gguf.quants.dequantize(d, gtype(fmt)).astype(NP_DTYPE[dtype]).astype(np.float64)
             for (fmt, *_), d in zip(specs, data)]
    scratch = llaisys.empty([max(N * K for _, N, K, _ in specs)], dtype, "cuda")
    xs = [llaisys.empty([M, K], dtype, "cuda") for _, _, K, _ in specs]
    outs = [llaisys.empty([M, N], dtype, "cuda") for _, N, _, _ in specs]
    rng = np.random.default_rng(23)

    def step():
        for w, x, out in zip(weights, xs, outs):
            decoded = scratch.slice(0, 0, w.rows * w.cols).view(w.rows, w.cols)
            quant.dequantize_(decoded, w)
            llaisys.ops.linear(out, x, decoded)

    def new_inputs():
        values = [rng.standard_normal((M, x.shape[1])).astype(NP_DTYPE[dtype]) for x in xs]
        for x, v in zip(xs, values):
            x.copy_(llaisys.tensor(v, "cuda"))
        for out in outs:
            out.fill_(float("nan"))
        llaisys.synchronize("cuda")
        return [v.astype(np.float64) for v in values]

    def check_outputs(x64):
        llaisys.synchronize("cuda")
        for out, x, wd in zip(outs, x64, dense):
            check(out, x @ wd.T, dense_tol(dtype, x, wd))

    x64 = new_inputs()
    step()  # eagerly first: cuBLASLt's handle, workspace and algorithms are made outside the capture
    check_outputs(x64)
    stream = torch.cuda.ExternalStream(llaisys.current_stream("cuda").handle)
    graph = torch.cuda.CUDAGraph()
    llaisys.reset_peak_memory_stats("cuda")
    before = llaisys.memory_stats("cuda")["allocated"]
    with torch.cuda.graph(graph, stream=stream):
        step()
    assert llaisys.memory_stats("cuda")["peak"] == before  # nothing allocated while capturing
    for _ in range(2):
        x64 = new_inputs()
        with torch.cuda.stream(stream):
            graph.replay()
        check_outputs(x64)


@cuda
def test_cuda_embedding_id_out_of_range_raises_at_synchronize():
    data = random_blocks("q8_0", 10, 64, seed=2)
    w = matrix("q8_0", data).to("cuda")
    out = poisoned((3, 64), "f32", "cuda")
    quant.embedding_(out, llaisys.tensor(np.array([2, 10, 3], np.int64), "cuda"), w)  # no host sync: no raise yet
    with pytest.raises(IndexError, match="embedding: an id is out of range"):
        llaisys.synchronize("cuda")
    got = out.to("cpu").numpy()
    np.testing.assert_array_equal(got[1], 0.0)  # the bad row is zero-filled, so the output is defined
    np.testing.assert_array_equal(got[[0, 2]], gguf.quants.dequantize(data, GQT.Q8_0)[[2, 3]])


@cuda
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rows, cols", [(5, 256), (37, 512), (3, 1280)])
def test_cuda_kquant_decode_placements(fmt, dtype, rows, cols):
    """The K-quants' decode kernel (8 lanes a block, 16-byte loads and stores where aligned) at every
    placement its paths split on: weight bytes on a 16-byte boundary or only on their format's alignment
    (4 bytes; Q6_K's 210-byte blocks put odd rows 2 bytes off), the output on a 16-byte boundary or one
    element off, one block a row or several; and ids outside [0, V) zero-filling their row."""
    data = random_blocks(fmt, rows, cols, seed=31, from_floats=False)
    ref = gguf.quants.dequantize(data, gtype(fmt)).astype(NP_DTYPE[dtype])
    ref_bits = ref.view(f"u{ref.itemsize}")
    row_bytes = data.shape[1]
    align = 2 if fmt == "q6_k" else 4
    for shift in (0, align):  # weight bytes 16-byte aligned, then only on the format's alignment
        raw = llaisys.tensor(np.zeros((rows * row_bytes + 16,), np.uint8), "cuda")
        raw.slice(0, shift, shift + rows * row_bytes).copy_(llaisys.tensor(data.reshape(-1), "cuda"))
        w = quant.QuantMatrix(fmt, rows, cols, raw.slice(0, shift, shift + rows * row_bytes).view(rows, row_bytes))
        for off in (0, 1):  # output 16-byte aligned, then one element off
            flat = poisoned((rows * cols + 8,), dtype, "cuda")
            out = flat.slice(0, off, off + rows * cols).view(rows, cols)
            quant.dequantize_(out, w)
            np.testing.assert_array_equal(bits(out), ref_bits, err_msg=f"shift {shift}, off {off}")
    ids = np.array([rows - 1, rows, 0, -1], np.int64)
    emb = poisoned((4, cols), dtype, "cuda")
    quant.embedding_(emb, llaisys.tensor(ids, "cuda"), w)
    with pytest.raises(IndexError, match="embedding: an id is out of range"):
        llaisys.synchronize("cuda")
    got = bits(emb)
    np.testing.assert_array_equal(got[[0, 2]], ref_bits[[rows - 1, 0]])
    assert not got[[1, 3]].any()  # the bad rows are zero-filled (+0.0 in every dtype)


@cuda
def test_cuda_errors():
    w = matrix("q4_k", random_blocks("q4_k", 4, 256, seed=1))
    x = llaisys.tensor(np.ones((2, 256), np.float32), "cuda")
    with pytest.raises(ValueError, match="quant_linear: weight is on cpu but the tensors are on cuda:0"):
        quant.linear_(llaisys.empty([2, 4], "f32", "cuda"), x, w)
    # Q4_K's reader loads 4-byte words: bytes starting 1 byte into an allocation are refused.
    raw = llaisys.empty([1, 145], "u8", "cuda").slice(1, 1, 145)
    odd = quant.QuantMatrix("q4_k", 1, 256, raw)
    with pytest.raises(ValueError, match="quant_linear: q4_k weight bytes must start on a 4-byte boundary"):
        quant.linear_(llaisys.empty([2, 1], "f32", "cuda"), x, odd)
