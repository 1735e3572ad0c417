"""linear_geglu and linear_gelu, the MLP projections with their GELU fused in: Gemma 3's gate/up + GeGLU
(out = gelu(x @ w[:I]^T) * (x @ w[I:]^T) for w_gate_up [2I, K]) and GPT-NeoX's up + bias + GELU
(out = gelu(x @ w^T + b)), against NumPy float64 formulas and bit for bit against the unfused ops they replace
(linear + linear + geglu, linear + gelu).

On CUDA, M <= 8 runs the GEMV with the GELU in its epilogue (M = 1, 2, 4, 8 are its four row-block kernels, 3
a partly used one), larger M cuBLASLt then the geglu / gelu kernel; the CPU composes linear and the geglu / gelu
op. Both GELU forms: erf (GPT-NeoX's "gelu") and tanh (Gemma's "gelu_pytorch_tanh").
"""
import numpy as np
import pytest

import llaisys
from test_ops_gelu import ref_gelu
from test_ops_linear import GEMV_MAX_M, by_path, tol
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, TOL, assert_close, bits, poisoned, rand, to_f64

TANH = pytest.mark.parametrize("tanh_approx", [False, True], ids=["erf", "tanh"])

# (M, K, I): every GEMV row block (M = 1, 2, 3, 4, 8) and cuBLASLt's side (9, 64); K in {1, 19, 896, 1152};
# I in {1, 111, 1152} (1152: a multiple of no warp group, the Gemma-3-1B hidden size), not their whole product.
GEGLU_SHAPES = [
    (1, 1, 1), (2, 19, 111), (3, 19, 111), (4, 896, 111), (8, 19, 1), (9, 1, 111), (64, 19, 111),
    (1, 1152, 1152), (2, 896, 300), (8, 896, 111), (9, 1152, 111),
]
# (M, K, N) for linear_gelu: the same paths.
GELU_SHAPES = [
    (1, 1, 1), (1, 19, 111), (2, 111, 19), (3, 989, 5), (4, 896, 300), (8, 1030, 77), (9, 67, 100), (64, 19, 111),
    (1, 2048, 300), (1, 896, 1152),
]


def ref_linear_geglu(x, w, dtype, tanh_approx):
    """g and u in float64, rounded to the dtype as the unfused path stores them, then gelu(g) * u in float64."""
    I = w.shape[0] // 2
    g = (x @ w[:I].T).astype(NP_DTYPE[dtype]).astype(np.float64)
    u = (x @ w[I:].T).astype(NP_DTYPE[dtype]).astype(np.float64)
    return ref_gelu(g, tanh_approx) * u


def ref_linear_gelu(x, w, b, dtype, tanh_approx):
    """x @ w^T + b in float64, rounded to the dtype as linear stores it, then gelu in float64."""
    y = x @ w.T if b is None else x @ w.T + b
    return ref_gelu(y.astype(NP_DTYPE[dtype]).astype(np.float64), tanh_approx)


def tol_act(dtype, K, w_scale):
    """tol() of the projections, carried through the GELU.

    Reason: an error e in g or u moves gelu(g) * u by up to 1.13 |u| e + |gelu(g)| e (|gelu'| <= 1.13 in both
    forms); with w scaled by 1 / sqrt(K) the projections are standard normal here (|g|, |u| < 5 in every test),
    so the atol of their f32 accumulation is widened 10-fold (as test_ops_linear's tol_swiglu). The op and the
    reference round g (or y) to the dtype alike except where the f32 and float64 sums straddle a rounding
    boundary: one unit in the last place of g moves gelu(g) by under 4 such units for g > -2 (|g gelu'(g) /
    gelu(g)| < 4), within TOL's rtol, and by less than TOL's atol below (|gelu(g)| < 0.046 there, 16 units at
    g = -4 on |gelu| = 1.3e-4).
    """
    t = tol(dtype, K, 1.0, w_scale)
    t["atol"] = max(TOL[dtype]["atol"], 10 * t["atol"])
    return t


def operands(M, K, rows, dtype, device, seed, bias=False):
    ws = 1.0 / np.sqrt(max(K, 1))
    x, x64 = rand((M, K), dtype, device, seed=seed)
    w, w64 = rand((rows, K), dtype, device, seed=seed + 1, scale=ws)
    b, b64 = rand((rows,), dtype, device, seed=seed + 2, scale=0.5) if bias else (None, None)
    return x, x64, w, w64, b, b64, ws


# ---- linear_geglu ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M,K,I", by_path(GEGLU_SHAPES))
@TANH
def test_linear_geglu_matches_float64(device, dtype, M, K, I, tanh_approx):
    x, x64, w, w64, _, _, ws = operands(M, K, 2 * I, dtype, device, seed=50)
    out = poisoned((M, I), dtype, device)
    llaisys.ops.linear_geglu(out, x, w, tanh_approx)
    assert_close(out, ref_linear_geglu(x64, w64, dtype, tanh_approx), dtype, **tol_act(dtype, K, ws))


def unfused_geglu(x, w, M, I, dtype, device, tanh_approx, constant_weight=False):
    """linear(gate); linear(up); geglu(gate, gate, up), as the decoder runs a GeGLU MLP unfused."""
    gate, up = poisoned((M, I), dtype, device), poisoned((M, I), dtype, device)
    llaisys.ops.linear(gate, x, w.slice(0, 0, I), constant_weight=constant_weight)
    llaisys.ops.linear(up, x, w.slice(0, I, 2 * I), constant_weight=constant_weight)
    llaisys.ops.geglu(gate, gate, up, tanh_approx)
    return gate


def check_geglu_equals_unfused(device, dtype, M, K, I, tanh_approx, constant_weight=False):
    x, _, w, _, _, _, ws = operands(M, K, 2 * I, dtype, device, seed=60)
    fused = poisoned((M, I), dtype, device)
    llaisys.ops.linear_geglu(fused, x, w, tanh_approx, constant_weight=constant_weight)
    unfused = unfused_geglu(x, w, M, I, dtype, device, tanh_approx, constant_weight)
    if device == "cpu" or M <= GEMV_MAX_M:
        np.testing.assert_array_equal(bits(fused), bits(unfused))
    else:  # cuBLASLt may pick another algorithm for the up half (test_linear_swiglu_equals_unfused says why)
        assert_close(fused, to_f64(unfused), dtype, **tol_act(dtype, K, ws))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M,K,I", by_path([(1, 1152, 111), (2, 19, 111), (3, 896, 111), (4, 19, 1), (8, 896, 19),
                                           (9, 111, 19), (64, 896, 111), (1, 2048, 300), (1, 896, 300)]))
@pytest.mark.parametrize("constant_weight", [False, True], ids=["written", "constant"])
@TANH
def test_linear_geglu_equals_unfused(device, dtype, M, K, I, constant_weight, tanh_approx):
    """The fusion changes no bit: g and u are summed in linear's order, rounded to the dtype as linear stores
    them and combined with the geglu op's formula (ops/common/gelu_math.cuh on CUDA)."""
    check_geglu_equals_unfused(device, dtype, M, K, I, tanh_approx, constant_weight)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", [1, 2, 4, 8])
@pytest.mark.parametrize("K,I", [(1152, 6912), (640, 2048)], ids=["gemma-3-1b", "gemma-3-270m"])
@TANH
def test_linear_geglu_cuda_decode_equals_unfused(dtype, M, K, I, tanh_approx):
    """Gemma 3's MLP shapes at decode, each GEMV row block, bit for bit."""
    check_geglu_equals_unfused("cuda", dtype, M, K, I, tanh_approx)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", by_path([1, 12]))
def test_linear_geglu_noncontiguous_and_3d(device, dtype, M):
    K, I, pad = 37, 21, 5
    ws = 1.0 / np.sqrt(K)
    wide, wide64 = rand((M, K + pad), dtype, device, seed=62)
    x, x64 = wide.slice(1, 3, 3 + K), wide64[:, 3:3 + K]  # rows K + 5 apart, starting 3 in: unaligned on CUDA
    w, w64 = rand((2 * I, K), dtype, device, seed=63, scale=ws)
    out = llaisys.empty((I, M), dtype, device).transpose(0, 1)  # a non-contiguous out [M, I]
    out.fill_(float("nan"))
    llaisys.ops.linear_geglu(out, x, w, True)
    t = tol_act(dtype, K, ws)
    assert_close(out, ref_linear_geglu(x64, w64, dtype, True), dtype, **t)
    xt, xt64 = rand((K, M, 1), dtype, device, seed=64)  # a permuted 3-D x [1, M, K] (copied before the kernel)
    out3 = poisoned((1, M, I), dtype, device)
    llaisys.ops.linear_geglu(out3, xt.permute(2, 1, 0), w, True)
    assert_close(out3, ref_linear_geglu(xt64[:, :, 0].T, w64, dtype, True)[None], dtype, **t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", by_path([3, 9]))
@TANH
def test_linear_geglu_nan_reaches_only_its_row(device, dtype, M, tanh_approx):
    K, I = 40, 24
    x64 = np.random.default_rng(65).standard_normal((M, K))
    x64[1, 5] = np.nan  # poisons out row 1
    x64[2, 7] = 1e30 if dtype != "f16" else 3e4  # row 2: |g| huge, gelu(g) is g or -0 (never NaN for finite g)
    x = llaisys.tensor(x64.astype(NP_DTYPE[dtype]), device)
    w, w64 = rand((2 * I, K), dtype, device, seed=66, scale=K**-0.5)
    x64 = to_f64(x)
    got = to_f64(llaisys.functional.linear_geglu(x, w, "tanh" if tanh_approx else "none"))
    assert np.isnan(got[1]).all()
    assert not np.isnan(got[2]).any()
    rows = np.delete(np.arange(M), [1, 2])
    assert_close(got[rows], ref_linear_geglu(x64[rows], w64, dtype, tanh_approx), dtype,
                 **tol_act(dtype, K, K**-0.5))


# ---- linear_gelu ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M,K,N", by_path(GELU_SHAPES))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@TANH
def test_linear_gelu_matches_float64(device, dtype, M, K, N, with_bias, tanh_approx):
    x, x64, w, w64, b, b64, ws = operands(M, K, N, dtype, device, seed=70, bias=with_bias)
    out = poisoned((M, N), dtype, device)
    llaisys.ops.linear_gelu(out, x, w, b, tanh_approx)
    assert_close(out, ref_linear_gelu(x64, w64, b64, dtype, tanh_approx), dtype, **tol_act(dtype, K, ws))


def check_gelu_equals_unfused(device, dtype, M, K, N, with_bias, tanh_approx, constant_weight=False):
    x, _, w, _, b, _, ws = operands(M, K, N, dtype, device, seed=80, bias=with_bias)
    fused = poisoned((M, N), dtype, device)
    llaisys.ops.linear_gelu(fused, x, w, b, tanh_approx, constant_weight=constant_weight)
    unfused = poisoned((M, N), dtype, device)  # linear, then gelu in place: the decoder's unfused plain MLP
    llaisys.ops.linear(unfused, x, w, b, constant_weight=constant_weight)
    llaisys.ops.gelu(unfused, unfused, tanh_approx)
    # M > 8 runs the very calls of the unfused path on CUDA too
    np.testing.assert_array_equal(bits(fused), bits(unfused))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M,K,N", by_path([(1, 1536, 256), (2, 19, 111), (3, 896, 111), (4, 1536, 300),
                                           (8, 896, 19), (9, 111, 19), (64, 896, 111), (1, 896, 1152)]))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("constant_weight", [False, True], ids=["written", "constant"])
@TANH
def test_linear_gelu_equals_unfused(device, dtype, M, K, N, with_bias, constant_weight, tanh_approx):
    """No bit changes: the GEMV sums in linear's order (at M = 1 with a constant weight of N <= 2112 rows
    linear takes the preloading GEMV, whose order is the GEMV's at split 1, which linear_gelu takes too),
    rounds to the dtype with the bias as linear stores it, then applies the gelu op's formula."""
    check_gelu_equals_unfused(device, dtype, M, K, N, with_bias, tanh_approx, constant_weight)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", [1, 2, 4, 8])
@pytest.mark.parametrize("K,N", [(2048, 8192), (512, 2048)], ids=["pythia-1.4b", "pythia-70m"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@TANH
def test_linear_gelu_cuda_decode_equals_unfused(dtype, M, K, N, with_bias, tanh_approx):
    """GPT-NeoX's MLP up projection at decode, each GEMV row block, bit for bit."""
    check_gelu_equals_unfused("cuda", dtype, M, K, N, with_bias, tanh_approx)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", by_path([1, 12]))
def test_linear_gelu_noncontiguous_and_3d(device, dtype, M):
    K, N, pad = 37, 21, 5
    ws = 1.0 / np.sqrt(K)
    wide, wide64 = rand((M, K + pad), dtype, device, seed=82)
    x, x64 = wide.slice(1, 3, 3 + K), wide64[:, 3:3 + K]
    w, w64 = rand((N, K), dtype, device, seed=83, scale=ws)
    b, b64 = rand((N,), dtype, device, seed=84, scale=0.5)
    out = llaisys.empty((N, M), dtype, device).transpose(0, 1)
    out.fill_(float("nan"))
    llaisys.ops.linear_gelu(out, x, w, b)
    t = tol_act(dtype, K, ws)
    assert_close(out, ref_linear_gelu(x64, w64, b64, dtype, False), dtype, **t)
    xt, xt64 = rand((K, M, 1), dtype, device, seed=85)
    out3 = poisoned((1, M, N), dtype, device)
    llaisys.ops.linear_gelu(out3, xt.permute(2, 1, 0), w, b)
    assert_close(out3, ref_linear_gelu(xt64[:, :, 0].T, w64, b64, dtype, False)[None], dtype, **t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", by_path([3, 9]))
@TANH
def test_linear_gelu_nan_reaches_only_its_row(device, dtype, M, tanh_approx):
    K, N = 40, 24
    x64 = np.random.default_rng(86).standard_normal((M, K))
    x64[1, 5] = np.nan
    x64[2, 7] = 1e30 if dtype != "f16" else 3e4  # huge pre-activations: gelu is y or -0
    x = llaisys.tensor(x64.astype(NP_DTYPE[dtype]), device)
    w, w64 = rand((N, K), dtype, device, seed=87, scale=K**-0.5)
    x64 = to_f64(x)
    got = to_f64(llaisys.functional.linear_gelu(x, w, None, "tanh" if tanh_approx else "none"))
    assert np.isnan(got[1]).all()
    assert not np.isnan(got[2]).any()
    rows = np.delete(np.arange(M), [1, 2])
    assert_close(got[rows], ref_linear_gelu(x64[rows], w64, None, dtype, tanh_approx), dtype,
                 **tol_act(dtype, K, K**-0.5))


# ---- both: empty shapes, the functional forms and argument errors ----

@pytest.mark.parametrize("device", DEVICES)
def test_empty_rows_write_nothing(device):
    x = llaisys.empty((0, 8), "f32", device)
    w, _ = rand((10, 8), "f32", device)
    llaisys.ops.linear_geglu(llaisys.empty((0, 5), "f32", device), x, w)
    llaisys.ops.linear_gelu(llaisys.empty((0, 10), "f32", device), x, w)


@pytest.mark.parametrize("device", DEVICES)
def test_functional_forms(device):
    x, x64 = rand((2, 3, 33), "f32", device, seed=90)
    w, w64 = rand((20, 33), "f32", device, seed=91, scale=33**-0.5)
    b, b64 = rand((20,), "f32", device, seed=92)
    t = tol_act("f32", 33, 33**-0.5)
    out = llaisys.functional.linear_geglu(x, w, "tanh")
    assert out.shape == (2, 3, 10) and out.device.startswith(device)
    assert_close(out, ref_linear_geglu(x64, w64, "f32", True), "f32", **t)
    out = llaisys.functional.linear_gelu(x, w, b)
    assert out.shape == (2, 3, 20)
    assert_close(out, ref_linear_gelu(x64, w64, b64, "f32", False), "f32", **t)
    with pytest.raises(ValueError, match="linear_geglu: approximate must be 'none' or 'tanh'"):
        llaisys.functional.linear_geglu(x, w, "erf")
    with pytest.raises(ValueError, match="linear_gelu: approximate must be 'none' or 'tanh'"):
        llaisys.functional.linear_gelu(x, w, None, "fast")


@pytest.mark.parametrize("device", DEVICES)
def test_argument_errors(device):
    x, _ = rand((3, 8), "f32", device)
    w, _ = rand((10, 8), "f32", device)  # linear_geglu: I = 5; linear_gelu: N = 10
    out5, out10 = llaisys.empty((3, 5), "f32", device), llaisys.empty((3, 10), "f32", device)
    with pytest.raises(TypeError, match=r"linear_geglu: w_gate_up must have dtype f32 like the other .*, got bf16"):
        llaisys.ops.linear_geglu(out5, x, rand((10, 8), "bf16", device)[0])
    with pytest.raises(ValueError, match=r"linear_geglu: w_gate_up must be 2-D \[2I, K\] .*, got shape \[9, 8\]"):
        llaisys.ops.linear_geglu(out5, x, rand((9, 8), "f32", device)[0])
    with pytest.raises(ValueError, match=r"linear_geglu: x's last dim \(7\) must equal w_gate_up's K"):
        llaisys.ops.linear_geglu(out5, rand((3, 7), "f32", device)[0], w)
    with pytest.raises(ValueError, match=r"linear_geglu: out must have shape \[3, 5\], got \[3, 10\]"):
        llaisys.ops.linear_geglu(out10, x, w)
    with pytest.raises(TypeError, match=r"linear_gelu: out must have dtype f32 like the other operands, got f16"):
        llaisys.ops.linear_gelu(llaisys.empty((3, 10), "f16", device), x, w)
    with pytest.raises(ValueError, match=r"linear_gelu: bias must have shape \[10\], got \[5\]"):
        llaisys.ops.linear_gelu(out10, x, w, rand((5,), "f32", device)[0])
    with pytest.raises(ValueError, match=r"linear_gelu: x's last dim \(7\) must equal weight's in_features K"):
        llaisys.ops.linear_gelu(out10, rand((3, 7), "f32", device)[0], w)
    with pytest.raises(ValueError, match=r"linear_gelu: out must have shape \[3, 10\], got \[3, 5\]"):
        llaisys.ops.linear_gelu(out5, x, w)
    xi = llaisys.tensor(np.ones((3, 8), np.int32), device)
    with pytest.raises(TypeError, match=r"linear_gelu: x must be f32, f16 or bf16, got i32"):
        llaisys.ops.linear_gelu(llaisys.empty((3, 10), "i32", device), xi, llaisys.tensor(np.ones((10, 8), np.int32),
                                                                                          device))
    with pytest.raises(TypeError):  # constant_weight is keyword-only, as linear's
        llaisys.ops.linear_geglu(out5, x, w, True, True)
    with pytest.raises(TypeError):
        llaisys.ops.linear_gelu(out10, x, w, None, True, True)
