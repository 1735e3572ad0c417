"""gelu and geglu against float64 NumPy formulas (and CUDA against the CPU on the same inputs; gelu also
against torch.nn.functional.gelu)."""
import math

import numpy as np
import pytest

import llaisys
from llaisys import functional as F
from llaisys import ops
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, assert_close, poisoned, rand, to_f64

_erf = np.vectorize(math.erf, otypes=[np.float64])


def ref_gelu(x, tanh_approx):
    """x float64: x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), or torch's tanh approximation
    0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    with np.errstate(invalid="ignore", over="ignore"):
        if tanh_approx:
            return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))
        return 0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)))


def gelu(x, tanh_approx):
    out = poisoned(x.shape, x.dtype, x.device)
    ops.gelu(out, x, tanh_approx)
    return out


def geglu(gate, up, tanh_approx):
    out = poisoned(gate.shape, gate.dtype, gate.device)
    ops.geglu(out, gate, up, tanh_approx)
    return out


def unaligned(shape, dtype, device, seed, scale=1.0):
    """A contiguous tensor starting one element into its buffer: 16-byte vector loads are impossible."""
    n = int(np.prod(shape))
    buf, ref = rand((n + 1,), dtype, device, seed, scale)
    return buf.slice(0, 1, n + 1).view(*shape), ref[1:].reshape(shape)


# 1, odd sizes and non-multiples of the 16-byte vector (4 f32 / 8 f16-bf16 elements): the scalar tail.
NS = [1, 19, 111, 989, 2048 + 3]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("tanh_approx", [False, True])
def test_gelu_matches_reference(device, dtype, n, rows, tanh_approx):
    x, xr = rand((rows, n), dtype, device, seed=1, scale=3.0)
    out = gelu(x, tanh_approx)
    assert_close(out, ref_gelu(xr, tanh_approx), dtype)
    if device == "cuda":  # the same inputs through the CPU kernel
        assert_close(out, to_f64(gelu(x.to("cpu"), tanh_approx)), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("tanh_approx", [False, True])
def test_geglu_matches_reference(device, dtype, n, rows, tanh_approx):
    gate, gr = rand((rows, n), dtype, device, seed=2, scale=3.0)
    up, ur = rand((rows, n), dtype, device, seed=3)
    out = geglu(gate, up, tanh_approx)
    assert_close(out, ref_gelu(gr, tanh_approx) * ur, dtype)  # gelu(gate) is not rounded before the product
    if device == "cuda":
        assert_close(out, to_f64(geglu(gate.to("cpu"), up.to("cpu"), tanh_approx)), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_geglu_prefill_shape_3d(device, dtype):
    gate, gr = rand((2, 65, 6912), dtype, device, seed=4)  # Gemma-3-1B's intermediate size
    up, ur = rand((2, 65, 6912), dtype, device, seed=5)
    assert_close(geglu(gate, up, True), ref_gelu(gr, True) * ur, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_torch(device, dtype, approximate):
    torch = pytest.importorskip("torch")
    x, _ = rand((5, 989), dtype, device, seed=6, scale=4.0)
    tx = torch.from_numpy(to_f64(x)).to({"f32": torch.float32, "bf16": torch.bfloat16}[dtype])
    ref = torch.nn.functional.gelu(tx, approximate=approximate).double().numpy()
    assert_close(F.gelu(x, approximate), ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("tanh_approx", [False, True])
def test_gelu_saturation_nan_inf(device, dtype, tanh_approx):
    big = 6e4 if dtype == "f16" else 1e4
    xn = np.concatenate([np.linspace(-20, 20, 161), [-big, big, np.inf, -np.inf, np.nan, 0.0, -0.0]])
    xn = xn.astype(NP_DTYPE[dtype]).astype(np.float64)
    x = llaisys.tensor(xn.astype(NP_DTYPE[dtype]), device)
    got = to_f64(gelu(x, tanh_approx))
    ref = ref_gelu(xn, tanh_approx)
    assert got[-5] == np.inf  # gelu(+inf) = +inf; gelu(-inf) is NaN (-inf * 0), as torch's formulas give
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert np.isnan(got).sum() == 2
    assert_close(got, ref, dtype)
    # NaN in up propagates through geglu; +-inf in up times a gelu of 0 is NaN, as the formula is
    un = np.ones_like(xn)
    un[0] = np.nan
    gg = to_f64(geglu(x, llaisys.tensor(un.astype(NP_DTYPE[dtype]), device), tanh_approx))
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(np.isnan(gg), np.isnan(ref * un))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("tanh_approx", [False, True])
def test_gelu_geglu_strided_unaligned_and_in_place(device, dtype, tanh_approx):
    gt, gtr = rand((896, 7), dtype, device, seed=7, scale=4.0)
    gate, gr = gt.transpose(0, 1), gtr.T
    up, ur = unaligned((7, 896), dtype, device, seed=8)
    buf = poisoned((7, 2 * 896), dtype, device)
    out = buf.slice(1, 896, 2 * 896)
    ops.geglu(out, gate, up, tanh_approx)
    assert_close(out, ref_gelu(gr, tanh_approx) * ur, dtype)
    assert np.isnan(to_f64(buf)[:, :896]).all(), "wrote outside the output view"
    buf2 = poisoned((7, 2 * 896), dtype, device)
    out2 = buf2.slice(1, 0, 896)
    ops.gelu(out2, gate, tanh_approx)
    assert_close(out2, ref_gelu(gr, tanh_approx), dtype)
    assert np.isnan(to_f64(buf2)[:, 896:]).all(), "wrote outside the output view"
    x, xr = unaligned((5, 4099), dtype, device, seed=9)
    ops.gelu(x, x, tanh_approx)  # in place
    assert_close(x, ref_gelu(xr, tanh_approx), dtype)
    g2, g2r = rand((5, 4864), dtype, device, seed=10)
    u2, u2r = rand((5, 4864), dtype, device, seed=11)
    ops.geglu(g2, g2, u2, tanh_approx)  # out is gate, as a model calls it
    assert_close(g2, ref_gelu(g2r, tanh_approx) * u2r, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_tanh_relative_accuracy_in_the_negative_tail(device):
    """f32 tanh GELU keeps ~1e-5 relative error where the value is tiny: 0.5 x (1 + tanh(u)) in f32 cancels
    (up to 13x off for x in [-6, -3]), so the kernels compute the equal x / (1 + e^(-2u)). The float64
    reference uses that form too: 1 + tanh(u) cancels in float64 as well below ~1e-16 |x|. 48,001 points
    (odd: the last 8-lane block is partial) and values whose x^3 or e^(-2u) overflow."""
    big = [1e15, -1e15, 3e38, -3e38, 100.0, -100.0]
    xn = np.concatenate([np.linspace(-12, 12, 48001), big]).astype(np.float32).astype(np.float64)
    u = np.sqrt(2.0 / np.pi) * (xn + 0.044715 * xn ** 3)
    with np.errstate(over="ignore"):
        ref = xn / (1.0 + np.exp(-2.0 * u))
    ur = np.linspace(0.5, 1.0, xn.size)  # <= 1: gelu(3e38) * up stays finite
    x, up = llaisys.tensor(xn.astype(np.float32), device), llaisys.tensor(ur.astype(np.float32), device)
    # rtol: the f32 rounding of u (~1 ulp) moves e^(-2u) by ~2|u| ulp (|2u| <= 88 before it underflows);
    # atol: results under FLT_MIN (x < -9.4) are subnormal
    assert_close(gelu(x, True), ref, "f32", atol=1e-37, rtol=2e-5)
    assert_close(geglu(x, up, True), ref * ur.astype(np.float32), "f32", atol=1e-37, rtol=2e-5)


def test_gelu_errors():
    g, _ = rand((4, 19), "f32")
    with pytest.raises(ValueError, match=r"geglu: up must have shape \[4, 19\], got \[4, 18\]"):
        ops.geglu(poisoned((4, 19)), g, rand((4, 18))[0], True)
    with pytest.raises(TypeError, match="geglu: up must have dtype f32"):
        ops.geglu(poisoned((4, 19)), g, rand((4, 19), "bf16")[0])
    with pytest.raises(TypeError, match="geglu: out must have dtype f32"):
        ops.geglu(poisoned((4, 19), "f16"), g, g)
    with pytest.raises(ValueError, match=r"gelu: out must have shape \[4, 19\], got \[19, 4\]"):
        ops.gelu(poisoned((19, 4)), g)
    with pytest.raises(TypeError, match="gelu: out must have dtype f32"):
        ops.gelu(poisoned((4, 19), "bf16"), g)
    gi = llaisys.tensor(np.zeros((4, 19), np.int32))
    with pytest.raises(TypeError, match="gelu: x must be f32, f16 or bf16, got i32"):
        ops.gelu(poisoned((4, 19), "i32"), gi)
    with pytest.raises(TypeError, match="geglu: gate must be f32, f16 or bf16, got i32"):
        ops.geglu(poisoned((4, 19), "i32"), gi, gi)
    with pytest.raises(ValueError, match="gelu: approximate must be 'none' or 'tanh'"):
        F.gelu(g, "erf")
    with pytest.raises(ValueError, match="geglu: approximate must be 'none' or 'tanh'"):
        F.geglu(g, g, "fast")


def test_functional_forms():
    g, gr = rand((3, 19), "f32", seed=12)
    u, ur = rand((3, 19), "f32", seed=13)
    assert_close(F.gelu(g), ref_gelu(gr, False), "f32")
    assert_close(F.gelu(g, approximate="tanh"), ref_gelu(gr, True), "f32")
    assert_close(F.geglu(g, u, approximate="tanh"), ref_gelu(gr, True) * ur, "f32")


@pytest.mark.cuda
def test_gelu_device_mismatch():
    g, _ = rand((4, 19), "f32", "cuda")
    with pytest.raises(ValueError, match="gelu: all tensors must be on one device"):
        ops.gelu(poisoned((4, 19), "f32", "cpu"), g)
    with pytest.raises(ValueError, match="geglu: all tensors must be on one device"):
        ops.geglu(poisoned((4, 19), "f32", "cuda"), g, rand((4, 19), "f32", "cpu")[0])
