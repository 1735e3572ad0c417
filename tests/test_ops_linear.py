"""linear: out [..., N] = x [..., K] @ weight [N, K]^T (+ bias [N]) against a NumPy float64 formula.

On CUDA, M <= 8 runs our GEMV kernel and larger M runs cuBLASLt, so the shapes below cover both
(M = 1, 2, 3, 7, 8 and M = 9, 64), K that is not a multiple of any vector width (1, 19, 111, 989),
K long enough for the GEMV kernel to stage x in several chunks (8961), and the LLM decode shapes.
"""
import numpy as np
import pytest

import llaisys
from utils import (DEVICES, FLOAT_DTYPES, NP_DTYPE, TOL, assert_close, bits, needs_caching_allocator, poisoned, rand,
                   to_f64)

# Cases with M > GEMV_MAX_M carry the `cublas` mark: on CUDA they run cuBLASLt, not a llaisys kernel. The racecheck
# step of bench/gpu_check.sh leaves them out (`-m "cuda and not cublas"`): racecheck reports shared-memory
# hazards inside cuBLAS's own sm90 kernels with no llaisys code involved (bench/cublas_racecheck.py
# shows it with torch alone), and excluding those kernels by name crashes the sanitizer. memcheck runs all.
CUBLAS = pytest.mark.cublas
GEMV_MAX_M = 8  # kGemvMaxM of cpp/ops/linear/cuda.cu: the largest M the CUDA GEMV takes


def by_path(cases):
    """Marks the cases (M or (M, ...) tuples) that run cuBLASLt on CUDA with `cublas`."""
    out = []
    for c in cases:
        args = c if isinstance(c, tuple) else (c,)
        out.append(c if args[0] <= GEMV_MAX_M else pytest.param(*args, marks=CUBLAS))
    return out


SHAPES = [  # (M, K, N)
    (1, 1, 1), (1, 19, 111), (7, 111, 19), (3, 989, 5),
    (1, 896, 4864), (1, 1536, 256), (64, 896, 896),  # decode (Qwen2-0.5B MLP up, 1.5B k/v) and prefill-ish
    (8, 1030, 77), (9, 67, 100), (2, 8961, 13),  # the GEMV's last M, cuBLASLt's first, a multi-chunk K
    (1, 4104, 1111),  # M = 1, x loaded next to W in 3 batches on a lane (9 vectors; 2 warps per row on an H100)
    (1, 896, 1152), (1, 2048, 300),  # M = 1, 3.5 and 8 vectors a lane (test_linear_constant_weight has them too)
    (256, 32, 512), (9, 64, 19), (8, 8, 3),  # f32 at K <= 64 with M >= 8: the CPU's small-K path (N along vectors)
]


def ref_linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def tol(dtype, K, x_scale=1.0, w_scale=1.0):
    """TOL[dtype], with atol widened for the f32 accumulation over K products.

    Reason: the op sums K products of typical size x_scale * w_scale in f32 and in another order than
    the float64 reference; that rounding error random-walks to about eps_f32 * K * |x||w| / 3 (one
    rounding of the running sum per product). It matters only for outputs that cancel to near zero,
    where TOL's atol (1e-5 for f32) is below it once K is in the thousands; 2 * eps_f32 * K * |x||w|
    (5.8e-4 at K = 4864, against outputs of typical size 70) keeps a safe margin. The dtype's own
    rounding of the output is relative and stays covered by TOL's rtol.
    """
    t = dict(TOL[dtype])
    t["atol"] = max(t["atol"], 2 * 2.0**-24 * K * x_scale * w_scale)
    return t


def run_linear(x, w, b, out_shape, dtype, device):
    out = poisoned(out_shape, dtype, device)
    llaisys.ops.linear(out, x, w, b)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M,K,N", by_path(SHAPES))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_matches_float64(device, dtype, M, K, N, with_bias):
    x, x64 = rand((M, K), dtype, device, seed=1)
    w, w64 = rand((N, K), dtype, device, seed=2)
    b, b64 = rand((N,), dtype, device, seed=3) if with_bias else (None, None)
    out = run_linear(x, w, b, (M, N), dtype, device)
    assert_close(out, ref_linear(x64, w64, b64), dtype, **tol(dtype, K))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@CUBLAS
def test_linear_3d_input(device, dtype, with_bias):
    B, S, K, N = 2, 5, 111, 19  # M = 10 rows: the cuBLASLt path on CUDA
    x, x64 = rand((B, S, K), dtype, device, seed=4)
    w, w64 = rand((N, K), dtype, device, seed=5)
    b, b64 = rand((N,), dtype, device, seed=6) if with_bias else (None, None)
    out = run_linear(x, w, b, (B, S, N), dtype, device)
    assert_close(out, ref_linear(x64, w64, b64), dtype, **tol(dtype, K))
    one = run_linear(x.slice(0, 1, 2).slice(1, 2, 3), w, b, (1, 1, N), dtype, device)  # [1, 1, K]: GEMV
    assert_close(one, ref_linear(x64[1:2, 2:3], w64, b64), dtype, **tol(dtype, K))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", by_path([1, 3, 12]))
def test_linear_noncontiguous_operands(device, dtype, M):
    K, N, pad = 37, 21, 7
    xt, xt64 = rand((K, M), dtype, device, seed=7)
    x, x64 = xt.transpose(0, 1), xt64.T  # x [M, K] with strides (1, M): copied before the kernel
    wide, wide64 = rand((N, K + pad), dtype, device, seed=8)
    # A column slice: rows K + 7 elements apart and starting 3 elements in, so on CUDA neither the
    # base nor the row starts are 16-byte aligned (the kernels' scalar fallback, or cuBLASLt's
    # alignment preferences); used in place, not copied.
    w, w64 = wide.slice(1, 3, 3 + K), wide64[:, 3:3 + K]
    b, b64 = rand((N,), dtype, device, seed=9)
    out = llaisys.empty((N, M), dtype, device).transpose(0, 1)  # a non-contiguous out [M, N]
    out.fill_(float("nan"))
    llaisys.ops.linear(out, x, w, b)
    assert_close(out, ref_linear(x64, w64, b64), dtype, **tol(dtype, K))
    # A transposed weight view (unit stride along N, not K) is copied before the kernel.
    wt, wt64 = rand((K, N), dtype, device, seed=10)
    out2 = run_linear(x, wt.transpose(0, 1), None, (M, N), dtype, device)
    assert_close(out2, ref_linear(x64, wt64.T), dtype, **tol(dtype, K))


@pytest.mark.parametrize("K,N", [(8, 3), (32, 512), (24, 77), (64, 9), (72, 16), (19, 40)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_cpu_row_bits_independent_of_batch(K, N, with_bias):
    """A row's output bits do not depend on how many rows share the call: on the CPU, f32 at K <= 64 (K a
    multiple of 8) takes another kernel from M = 8 on (outputs along N), which must add each output's
    products exactly as the one-row kernel does. Signed zeros, Inf and NaN included."""
    M = 37
    x, _ = rand((M, K + 3), "f32", seed=11, scale=3.0)
    x = x.slice(1, 2, 2 + K)  # rows K + 3 apart
    xa = x.to("cpu").numpy()
    xa[0, :] = 0.0
    xa[1, :] = -0.0
    xa[2, 1], xa[3, 2] = np.inf, np.nan
    w, _ = rand((N, K), "f32", seed=12)
    b = rand((N,), "f32", seed=13)[0] if with_bias else None
    whole = run_linear(x, w, b, (M, N), "f32", "cpu")
    for m in range(M):
        one = run_linear(x.slice(0, m, m + 1), w, b, (1, N), "f32", "cpu")
        np.testing.assert_array_equal(bits(one)[0], bits(whole)[m], err_msg=f"row {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", by_path([3, 9]))
def test_linear_nan_reaches_only_its_row_and_column(device, dtype, M):
    K, N = 40, 24
    x64 = np.random.default_rng(11).standard_normal((M, K))
    w64 = np.random.default_rng(12).standard_normal((N, K))
    x64[1, 5] = np.nan  # poisons out row 1
    w64[4, 17] = np.inf  # poisons out column 4 (inf * x with mixed signs, summed: inf or nan)
    x = llaisys.tensor(x64.astype(NP_DTYPE[dtype]), device)
    w = llaisys.tensor(w64.astype(NP_DTYPE[dtype]), device)
    x64, w64 = to_f64(x), to_f64(w)
    got = to_f64(run_linear(x, w, None, (M, N), dtype, device))
    assert np.isnan(got[1]).all()
    col = np.delete(got[:, 4], 1)
    assert not np.isfinite(col).any()
    rows, cols = np.delete(np.arange(M), 1), np.delete(np.arange(N), 4)
    clean = got[np.ix_(rows, cols)]
    want = ref_linear(x64[rows], w64[cols])
    np.testing.assert_allclose(clean, want, **tol(dtype, K))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_linear_large_k_f32_accumulation(device, dtype):
    M, K, N = 2, 4864, 64  # the Qwen2-0.5B MLP down projection's K
    x, x64 = rand((M, K), dtype, device, seed=13)
    w, w64 = rand((N, K), dtype, device, seed=14)
    out = run_linear(x, w, None, (M, N), dtype, device)
    assert_close(out, ref_linear(x64, w64), dtype, **tol(dtype, K))


def test_linear_empty_dims():
    """K = 0 leaves out = bias (or 0); M = 0 writes nothing. CPU only: zero-size CUDA buffers are the
    allocator's business, and on CUDA K = 0 runs the GEMV's loops zero times."""
    x = llaisys.tensor(np.zeros((3, 0), np.float32))
    w = llaisys.tensor(np.zeros((4, 0), np.float32))
    b, b64 = rand((4,), "f32", seed=23)
    out = run_linear(x, w, b, (3, 4), "f32", "cpu")
    np.testing.assert_array_equal(to_f64(out), np.broadcast_to(b64, (3, 4)))
    out = run_linear(x, w, None, (3, 4), "f32", "cpu")
    np.testing.assert_array_equal(to_f64(out), np.zeros((3, 4)))
    empty = llaisys.empty((0, 4), "f32")
    llaisys.ops.linear(empty, llaisys.tensor(np.zeros((0, 5), np.float32)), rand((4, 5), "f32")[0])


@pytest.mark.parametrize("device", DEVICES)
def test_linear_functional_form(device):
    x, x64 = rand((4, 33), "f32", device, seed=15)
    w, w64 = rand((10, 33), "f32", device, seed=16)
    out = llaisys.functional.linear(x, w)
    assert out.shape == (4, 10) and out.device.startswith(device)
    assert_close(out, ref_linear(x64, w64), "f32")


@pytest.mark.parametrize("device", DEVICES)
def test_linear_argument_errors(device):
    x, _ = rand((3, 8), "f32", device)
    w, _ = rand((5, 8), "f32", device)
    out = llaisys.empty((3, 5), "f32", device)
    with pytest.raises(ValueError, match=r"linear: x's last dim \(7\) must equal weight's in_features K"):
        llaisys.ops.linear(out, rand((3, 7), "f32", device)[0], w)
    with pytest.raises(ValueError, match=r"linear: bias must have shape \[5\], got \[4\]"):
        llaisys.ops.linear(out, x, w, rand((4,), "f32", device)[0])
    with pytest.raises(ValueError, match=r"linear: out must have shape \[3, 5\], got \[3, 6\]"):
        llaisys.ops.linear(llaisys.empty((3, 6), "f32", device), x, w)
    with pytest.raises(ValueError, match=r"linear: weight must be 2-D \[N, K\], got shape \[5, 8, 1\]"):
        llaisys.ops.linear(out, x, rand((5, 8, 1), "f32", device)[0])
    with pytest.raises(TypeError, match=r"linear: weight must have dtype f32 like the other operands, got bf16"):
        llaisys.ops.linear(out, x, rand((5, 8), "bf16", device)[0])
    with pytest.raises(TypeError, match=r"linear: out must have dtype f32 like the other operands, got f16"):
        llaisys.ops.linear(llaisys.empty((3, 5), "f16", device), x, w)
    with pytest.raises(TypeError, match=r"linear: bias must have dtype f32"):
        llaisys.ops.linear(out, x, w, rand((5,), "f16", device)[0])
    xi = llaisys.tensor(np.ones((3, 8), np.int32), device)
    with pytest.raises(TypeError, match=r"linear: x must be f32, f16 or bf16, got i32"):
        llaisys.ops.linear(llaisys.empty((3, 5), "i32", device), xi, llaisys.tensor(np.ones((5, 8), np.int32), device))


@pytest.mark.cuda
def test_linear_device_mismatch():
    x, _ = rand((3, 8), "f32", "cpu")
    w, _ = rand((5, 8), "f32", "cuda")
    with pytest.raises(ValueError, match=r"linear: all tensors must be on one device, got cpu and cuda:0"):
        llaisys.ops.linear(llaisys.empty((3, 5), "f32", "cpu"), x, w)
    with pytest.raises(ValueError, match=r"linear: all tensors must be on one device, got cuda:0 and cpu"):
        llaisys.ops.linear(llaisys.empty((3, 5), "f32", "cuda"), x.to("cuda"), w, rand((5,), "f32", "cpu")[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M,K,N", [(1, 896, 1152), (1, 2048, 300), (1, 1536, 1536), (1, 1536, 2048), (1, 1536, 256),
                                   (1, 8, 5), (1, 4104, 111), (3, 896, 64)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_constant_weight(device, dtype, M, K, N, with_bias):
    """constant_weight=True, as a model passes for its loaded weights. On CUDA the M = 1 shapes with
    16-byte rows of at most 256 vectors take the GEMV that loads W before the kernel ahead of it ends
    (3.5, 8, 6 vectors a lane; a single vector at K = 8 bf16), its loads paced where its grid of 16-row
    blocks covers half the SMs or more (N > 1040 on an H100's 132; which variant ran is not visible from
    here); (1, 4104, 111) and M = 3 do not."""
    x, x64 = rand((M, K), dtype, device, seed=60)
    w, w64 = rand((N, K), dtype, device, seed=61)
    b, b64 = rand((N,), dtype, device, seed=62) if with_bias else (None, None)
    out = poisoned((M, N), dtype, device)
    llaisys.ops.linear(out, x, w, b, constant_weight=True)
    assert_close(out, ref_linear(x64, w64, b64), dtype, **tol(dtype, K))
    # A transposed weight view: the op copies it first (the GEMV reads a new buffer; the op does not
    # pass the flag on for it). The copy kernel is an ordinary launch, so this checks the result only.
    wt, wt64 = rand((K, N), dtype, device, seed=63)
    out2 = poisoned((M, N), dtype, device)
    llaisys.ops.linear(out2, x, wt.transpose(0, 1), b, constant_weight=True)
    assert_close(out2, ref_linear(x64, wt64.T, b64), dtype, **tol(dtype, K))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("N", [300, 1152])
def test_linear_constant_weight_changes_no_bit(device, dtype, with_bias, N):
    """At K = 448 and N = 300 or 1152 the GEMV runs one warp per row either way (split 1), so the kernel
    that preloads a constant weight (on CUDA, every dtype; at N = 1152 on an H100 the paced variant) must
    sum in the very same order as the other."""
    x, _ = rand((1, 448), dtype, device, seed=66)
    w, _ = rand((N, 448), dtype, device, seed=67)
    b = rand((N,), dtype, device, seed=68)[0] if with_bias else None
    outs = []
    for constant in (False, True):
        out = poisoned((1, N), dtype, device)
        llaisys.ops.linear(out, x, w, b, constant_weight=constant)
        outs.append(bits(out))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_linear_constant_weight_is_keyword_only():
    """A stray positional True must not silently become the promise."""
    x, _ = rand((1, 4), "f32", "cpu", seed=64)
    w, _ = rand((2, 4), "f32", "cpu", seed=65)
    with pytest.raises(TypeError):
        llaisys.ops.linear(llaisys.empty((1, 2), "f32"), x, w, None, True)
    with pytest.raises(TypeError):
        llaisys.ops.linear_swiglu(llaisys.empty((1, 1), "f32"), x, w, True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_linear_weight_written_by_the_kernel_before(dtype):
    """A weight the GEMV just before computed: k = xk @ wk^T (M = 8, a PDL kernel that lets the next one
    start at once), then scores = q @ k^T (M = 1, N = 8, K = 128). With constant_weight left False the
    second GEMV may not read k before the first has written it. 20 rounds of 32 pairs queued without a
    sync, each k poisoned with NaN first (on an H100 the same pairs with constant_weight=True on the
    second GEMV, a broken promise, gave 1 wrong result in 640)."""
    dev = "cuda"
    K1, D, n = 4096, 128, 8
    xk, _ = rand((n, K1), dtype, dev, seed=70)
    wk, _ = rand((D, K1), dtype, dev, seed=71, scale=1.0 / np.sqrt(K1))
    q, q64 = rand((1, D), dtype, dev, seed=72)
    for _ in range(20):
        ks, scores = [], []
        for _ in range(32):
            k = poisoned((n, D), dtype, dev)
            s = poisoned((1, n), dtype, dev)
            llaisys.ops.linear(k, xk, wk)
            llaisys.ops.linear(s, q, k)
            ks.append(k)
            scores.append(s)
        llaisys.synchronize(dev)
        for k, s in zip(ks, scores):
            k64 = to_f64(k)
            assert np.isfinite(k64).all()
            assert_close(s, q64 @ k64.T, dtype, **tol(dtype, D, 1.0, float(np.abs(k64).max())))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M,K,N", by_path([(1, 1536, 256), (4, 1536, 1536), (8, 8960, 64), (2, 19, 111),
                                           (9, 896, 896), (64, 1536, 256), (128, 8960, 128)]))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_cuda_matches_cpu(dtype, M, K, N, with_bias):
    """Identical inputs on both devices (the GEMV for M <= 8, cuBLASLt above): both near float64 and
    near each other (they differ only in f32 summation order and so at most in the output's last bit)."""
    x, x64 = rand((M, K), dtype, "cpu", seed=17, scale=0.5)
    w, w64 = rand((N, K), dtype, "cpu", seed=18, scale=0.5)
    b, b64 = rand((N,), dtype, "cpu", seed=19) if with_bias else (None, None)
    t = tol(dtype, K, 0.5, 0.5)
    cpu = run_linear(x, w, b, (M, N), dtype, "cpu")
    gpu = run_linear(x.to("cuda"), w.to("cuda"), b.to("cuda") if with_bias else None, (M, N), dtype, "cuda")
    ref = ref_linear(x64, w64, b64)
    assert_close(cpu, ref, dtype, **t)
    assert_close(gpu, ref, dtype, **t)
    assert_close(gpu, to_f64(cpu), dtype, **t)


@pytest.mark.cuda
@CUBLAS
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_cuda_half_gemm_sums_in_f32_at_any_alignment(dtype, with_bias):
    """cuBLASLt at decode-batch and prefill sizes (9..513 rows) in bf16/f16, on contiguous operands and on
    column slices at odd element offsets (2-byte alignment): every result near float64. At the slices'
    alignment cuBLASLt's first choice used to be a split-K whose partial sums were rounded to the output dtype
    (0.08 off on outputs near zero); now only split-K summed in f32 is allowed."""
    K, N = 1536, 384
    w, w64 = rand((N, K), dtype, "cuda", seed=31, scale=0.5)
    wide, wide64 = rand((N, K + 8), dtype, "cuda", seed=32, scale=0.5)
    b, b64 = rand((N,), dtype, "cuda", seed=33) if with_bias else (None, None)
    for i, M in enumerate([200, 256, 129, 130, 9, 16, 17, 512, 513, 255]):
        x, x64 = rand((M, K), dtype, "cuda", seed=40 + i, scale=0.5)
        out = run_linear(x, w, b, (M, N), dtype, "cuda")
        assert_close(out, ref_linear(x64, w64, b64), dtype, **tol(dtype, K, 0.5, 0.5))
        xw, xw64 = rand((M, K + 8), dtype, "cuda", seed=60 + i, scale=0.5)
        x_cols, x_cols64 = xw.slice(1, 3, 3 + K), xw64[:, 3:3 + K]  # x and w at odd element offsets
        out = run_linear(x_cols, wide.slice(1, 5, 5 + K), b, (M, N), dtype, "cuda")
        assert_close(out, ref_linear(x_cols64, wide64[:, 5:5 + K], b64), dtype, **tol(dtype, K, 0.5, 0.5))


@pytest.mark.cuda
@needs_caching_allocator
@CUBLAS
def test_linear_cuda_lm_head_and_steady_state():
    """The Qwen2-1.5B LM head shape through the GEMV, then repeated calls of both paths need no new
    device memory (the cuBLASLt handle and workspace are created once)."""
    dev = "cuda"
    x, x64 = rand((1, 1536), "bf16", dev, seed=20)
    w, w64 = rand((151936, 1536), "bf16", dev, seed=21, scale=0.05)
    out = run_linear(x, w, None, (1, 151936), "bf16", dev)
    assert_close(out, ref_linear(x64, w64), "bf16", **tol("bf16", 1536, 1.0, 0.05))
    xs, _ = rand((64, 1536), "bf16", dev, seed=22)
    ws = w.slice(0, 0, 512)
    outs = llaisys.empty((64, 512), "bf16", dev)
    llaisys.ops.linear(outs, xs, ws)  # first cuBLASLt call may create the handle and workspace
    llaisys.synchronize(dev)
    mallocs = llaisys.memory_stats(dev)["device_mallocs"]
    for _ in range(20):
        llaisys.ops.linear(out, x, w)
        llaisys.ops.linear(outs, xs, ws)
    llaisys.synchronize(dev)
    assert llaisys.memory_stats(dev)["device_mallocs"] == mallocs


# ---- linear_swiglu: out [..., I] = swiglu(x @ w[:I]^T, x @ w[I:]^T) for w_gate_up [2I, K] ----
# On CUDA, M <= 8 runs the GEMV with the gate/up pair epilogue and larger M two cuBLASLt GEMMs and the
# swiglu kernel; the CPU composes its linear and swiglu. Shapes cover every M in {1, 3, 8, 9, 64},
# K in {1, 19, 896, 1536} and I in {1, 111, 4864} without taking their whole product (CPU time).
SWIGLU_SHAPES = [  # (M, K, I)
    (1, 1, 1), (3, 19, 111), (8, 19, 1), (9, 1, 111), (64, 19, 111),
    (1, 896, 4864), (1, 1536, 111), (8, 896, 111), (9, 1536, 111), (64, 896, 111), (3, 19, 4864),
]


def silu_f64(g):
    return g / (1.0 + np.exp(-g))


def ref_linear_swiglu(x, w, dtype):
    """g and u in float64, rounded to the dtype as the unfused path stores them, then swiglu in float64."""
    I = w.shape[0] // 2
    g = (x @ w[:I].T).astype(NP_DTYPE[dtype]).astype(np.float64)
    u = (x @ w[I:].T).astype(NP_DTYPE[dtype]).astype(np.float64)
    return u * silu_f64(g)


def tol_swiglu(dtype, K, w_scale):
    """tol() of g and u, carried through the SwiGLU.

    Reason: an error e in g or u moves out by up to (|silu(g)| + 1.1 |u|) e (|silu'| <= 1.1); with w
    scaled by 1 / sqrt(K), g and u are standard normal here (|g|, |u| < 5 in every test), so the atol
    of their f32 accumulation is widened 10-fold. The op and the reference round g and u to the dtype
    alike, except where the f32 and float64 sums straddle a rounding boundary: there g or u differ by
    one unit in their last place, which moves out by under 3 units in its last place for g > -4
    (|g silu'(g) / silu(g)| < 3), within TOL's rtol, and by less than TOL's atol for g < -4.
    """
    t = tol(dtype, K, 1.0, w_scale)
    t["atol"] = max(TOL[dtype]["atol"], 10 * t["atol"])
    return t


def rand_swiglu_operands(M, K, I, dtype, device, seed):
    ws = 1.0 / np.sqrt(max(K, 1))
    x, x64 = rand((M, K), dtype, device, seed=seed)
    w, w64 = rand((2 * I, K), dtype, device, seed=seed + 1, scale=ws)
    return x, x64, w, w64, ws


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M,K,I", by_path(SWIGLU_SHAPES))
def test_linear_swiglu_matches_float64(device, dtype, M, K, I):
    x, x64, w, w64, ws = rand_swiglu_operands(M, K, I, dtype, device, seed=30)
    out = poisoned((M, I), dtype, device)
    llaisys.ops.linear_swiglu(out, x, w)
    assert_close(out, ref_linear_swiglu(x64, w64, dtype), dtype, **tol_swiglu(dtype, K, ws))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", by_path([1, 12]))
def test_linear_swiglu_noncontiguous_and_3d(device, dtype, M):
    K, I, pad = 37, 21, 5
    ws = 1.0 / np.sqrt(K)
    wide, wide64 = rand((M, K + pad), dtype, device, seed=32)
    # x: a column slice (rows K + 5 apart, starting 3 in: used in place, unaligned on CUDA)...
    x, x64 = wide.slice(1, 3, 3 + K), wide64[:, 3:3 + K]
    w, w64 = rand((2 * I, K), dtype, device, seed=33, scale=ws)
    out = llaisys.empty((I, M), dtype, device).transpose(0, 1)  # a non-contiguous out [M, I]
    out.fill_(float("nan"))
    llaisys.ops.linear_swiglu(out, x, w)
    t = tol_swiglu(dtype, K, ws)
    assert_close(out, ref_linear_swiglu(x64, w64, dtype), dtype, **t)
    # ... and a permuted 3-D view x [1, M, K] with strides (1, 1, M) (copied before the kernel).
    xt, xt64 = rand((K, M, 1), dtype, device, seed=34)
    out3 = poisoned((1, M, I), dtype, device)
    llaisys.ops.linear_swiglu(out3, xt.permute(2, 1, 0), w)
    assert_close(out3, ref_linear_swiglu(xt64[:, :, 0].T, w64, dtype)[None], dtype, **t)


def run_unfused(x, w, M, I, dtype, device, constant_weight=False):
    """linear(gate); linear(up); swiglu(gate, gate, up) on the two halves of w, as a model without the fusion."""
    gate, up = poisoned((M, I), dtype, device), poisoned((M, I), dtype, device)
    llaisys.ops.linear(gate, x, w.slice(0, 0, I), constant_weight=constant_weight)
    llaisys.ops.linear(up, x, w.slice(0, I, 2 * I), constant_weight=constant_weight)
    llaisys.ops.swiglu(gate, gate, up)
    return gate


def check_equals_unfused(device, dtype, M, K, I, constant_weight=False):
    x, _, w, _, ws = rand_swiglu_operands(M, K, I, dtype, device, seed=40)
    fused = poisoned((M, I), dtype, device)
    llaisys.ops.linear_swiglu(fused, x, w, constant_weight=constant_weight)
    unfused = run_unfused(x, w, M, I, dtype, device, constant_weight)
    if device == "cpu" or M <= GEMV_MAX_M:
        np.testing.assert_array_equal(bits(fused), bits(unfused))
    else:
        assert_close(fused, to_f64(unfused), dtype, **tol_swiglu(dtype, K, ws))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M,K,I", by_path([(1, 1536, 111), (2, 19, 111), (3, 1536, 111), (4, 19, 1), (8, 896, 19),
                                           (9, 111, 19), (64, 896, 111), (1, 4104, 1111),
                                           (1, 2048, 300), (1, 896, 300)]))
@pytest.mark.parametrize("constant_weight", [False, True], ids=["written", "constant"])
def test_linear_swiglu_equals_unfused(device, dtype, M, K, I, constant_weight):
    """The fusion changes no bit: g and u are summed in the same order and rounded to the dtype as the
    unfused path stores them. On CUDA that holds for the GEMV (M <= 8); for M > 8 both run cuBLASLt on
    the same problems, but cuBLASLt may pick another algorithm for the up half (its alignment differs
    when K is odd), so there the two only have to agree within the tolerance. With constant_weight the
    unfused linear takes the preloading GEMV for the small M = 1 shapes, and linear_swiglu its order."""
    check_equals_unfused(device, dtype, M, K, I, constant_weight)


@pytest.mark.cuda
@CUBLAS
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M,K,I", [(9, 896, 4864), (64, 1536, 8960), (256, 1536, 8960), (300, 111, 19),
                                   (130, 67, 1111)])
def test_linear_swiglu_cuda_batch_rows_match_float64_and_unfused(dtype, M, K, I):
    """Past 8 rows the gate and up halves run as one batched cuBLASLt launch: the Qwen2 MLP shapes at decode
    batches, and odd K / I (weight halves and outputs at 2-byte alignments). Near float64 and near the unfused
    path's two GEMMs and swiglu."""
    x, x64, w, w64, ws = rand_swiglu_operands(M, K, I, dtype, "cuda", seed=50)
    out = poisoned((M, I), dtype, "cuda")
    llaisys.ops.linear_swiglu(out, x, w)
    assert_close(out, ref_linear_swiglu(x64, w64, dtype), dtype, **tol_swiglu(dtype, K, ws))
    assert_close(out, to_f64(run_unfused(x, w, M, I, dtype, "cuda", False)), dtype, **tol_swiglu(dtype, K, ws))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M,K,I", [(1, 896, 4864), (1, 1536, 8960), (2, 896, 4864), (8, 1536, 8960)])
def test_linear_swiglu_cuda_decode_equals_unfused(dtype, M, K, I):
    """The Qwen2-0.5B and 1.5B MLP shapes at decode, bit for bit (on the CPU the small shapes above
    already exercise the same code)."""
    check_equals_unfused("cuda", dtype, M, K, I)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", by_path([3, 9]))
def test_linear_swiglu_nan_reaches_only_its_row(device, dtype, M):
    K, I = 40, 24
    x64 = np.random.default_rng(41).standard_normal((M, K))
    x64[1, 5] = np.nan  # poisons out row 1
    x64[2, 7] = 1e30 if dtype != "f16" else 6e4  # row 2: |g|, |u| huge, u * silu(g) overflows or goes to 0
    x = llaisys.tensor(x64.astype(NP_DTYPE[dtype]), device)
    w, w64 = rand((2 * I, K), dtype, device, seed=42, scale=K**-0.5)
    x64 = to_f64(x)
    got = to_f64(llaisys.functional.linear_swiglu(x, w))
    assert np.isnan(got[1]).all()
    assert not np.isnan(got[2]).any()  # exp(-g) = inf for g << 0 gives silu(g) = -0, not inf / inf
    rows = np.delete(np.arange(M), [1, 2])
    assert_close(got[rows], ref_linear_swiglu(x64[rows], w64, dtype), dtype, **tol_swiglu(dtype, K, K**-0.5))


@pytest.mark.parametrize("device", DEVICES)
def test_linear_swiglu_functional_form(device):
    x, x64 = rand((2, 3, 33), "f32", device, seed=43)
    w, w64 = rand((20, 33), "f32", device, seed=44, scale=33**-0.5)
    out = llaisys.functional.linear_swiglu(x, w)
    assert out.shape == (2, 3, 10) and out.device.startswith(device)
    assert_close(out, ref_linear_swiglu(x64, w64, "f32"), "f32", **tol_swiglu("f32", 33, 33**-0.5))


@pytest.mark.parametrize("device", DEVICES)
def test_linear_swiglu_argument_errors(device):
    x, _ = rand((3, 8), "f32", device)
    w, _ = rand((10, 8), "f32", device)  # I = 5
    out = llaisys.empty((3, 5), "f32", device)
    with pytest.raises(TypeError, match=r"linear_swiglu: w_gate_up must have dtype f32 like the other .*, got bf16"):
        llaisys.ops.linear_swiglu(out, x, rand((10, 8), "bf16", device)[0])
    with pytest.raises(TypeError, match=r"linear_swiglu: out must have dtype f32 like the other operands, got f16"):
        llaisys.ops.linear_swiglu(llaisys.empty((3, 5), "f16", device), x, w)
    with pytest.raises(ValueError, match=r"linear_swiglu: w_gate_up must be 2-D \[2I, K\] .*, got shape \[9, 8\]"):
        llaisys.ops.linear_swiglu(out, x, rand((9, 8), "f32", device)[0])  # odd rows: no gate/up halves
    with pytest.raises(ValueError, match=r"linear_swiglu: w_gate_up must be 2-D \[2I, K\] .*, got shape \[10, 8, 1\]"):
        llaisys.ops.linear_swiglu(out, x, rand((10, 8, 1), "f32", device)[0])
    with pytest.raises(ValueError, match=r"linear_swiglu: x's last dim \(7\) must equal w_gate_up's K"):
        llaisys.ops.linear_swiglu(out, rand((3, 7), "f32", device)[0], w)
    with pytest.raises(ValueError, match=r"linear_swiglu: out must have shape \[3, 5\], got \[3, 10\]"):
        llaisys.ops.linear_swiglu(llaisys.empty((3, 10), "f32", device), x, w)  # out sized like [g, u]
    xi = llaisys.tensor(np.ones((3, 8), np.int32), device)
    with pytest.raises(TypeError, match=r"linear_swiglu: x must be f32, f16 or bf16, got i32"):
        llaisys.ops.linear_swiglu(llaisys.empty((3, 5), "i32", device), xi,
                                  llaisys.tensor(np.ones((10, 8), np.int32), device))


@pytest.mark.parametrize("device", DEVICES)
def test_linear_output_overlapping_an_input_raises(device):
    """A GEMV reads x while other threads write out: sharing bytes would be a silent wrong answer."""
    x, _ = rand((3, 8), "f32", device, seed=3)
    w, _ = rand((8, 8), "f32", device, seed=4)
    keep = x.to("cpu").numpy().copy()
    with pytest.raises(ValueError, match=r"linear: out must not overlap x \(they share memory\)"):
        llaisys.ops.linear(x, x, w)
    with pytest.raises(ValueError, match=r"linear: out must not overlap weight"):
        llaisys.ops.linear(w.slice(0, 0, 3), x, w)
    np.testing.assert_array_equal(x.to("cpu").numpy(), keep)  # nothing was written
    wg, _ = rand((16, 8), "f32", device, seed=5)
    with pytest.raises(ValueError, match=r"linear_swiglu: out must not overlap x"):
        llaisys.ops.linear_swiglu(x.slice(1, 0, 8), x, wg)
    with pytest.raises(ValueError, match=r"linear_swiglu: out must not overlap w_gate_up"):
        llaisys.ops.linear_swiglu(wg.slice(0, 0, 3), x, wg)
    # disjoint rows of one buffer are fine
    buf, buf64 = rand((6, 8), "f32", device, seed=6)
    llaisys.ops.linear(buf.slice(0, 3, 6), buf.slice(0, 0, 3), w)
    assert_close(buf.slice(0, 3, 6), ref_linear(buf64[:3], w.to("cpu").numpy().astype(np.float64)), "f32")


@pytest.mark.cuda
def test_linear_swiglu_device_mismatch():
    x, _ = rand((3, 8), "f32", "cpu")
    w, _ = rand((10, 8), "f32", "cuda")
    with pytest.raises(ValueError, match=r"linear_swiglu: all tensors must be on one device, got cpu and cuda:0"):
        llaisys.ops.linear_swiglu(llaisys.empty((3, 5), "f32", "cpu"), x, w)
    with pytest.raises(ValueError, match=r"linear_swiglu: all tensors must be on one device, got cuda:0 and cpu"):
        llaisys.ops.linear_swiglu(llaisys.empty((3, 5), "f32", "cuda"), x, w.to("cpu"))
