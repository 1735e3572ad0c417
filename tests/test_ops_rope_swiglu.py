"""rope and swiglu against float64 NumPy formulas (and CUDA against the CPU on the same inputs)."""
import numpy as np
import pytest

import llaisys
from llaisys import ops
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, assert_close, poisoned, rand, to_f64

# ---- rope ----------------------------------------------------------------------------------------------


def inv_freq_f32(theta, head_dim):
    """HF's ``1.0 / (theta ** (arange(0, d, 2).float() / d))`` in f32: the exponent is an f32 quotient,
    theta^e is rounded once (correctly) to f32, and the reciprocal is an f32 division. torch 2.x's f32 pow
    gives the same values for thetas 1e4/1e6 and head dims 64/128 except one entry (theta 1e6, hd 128,
    i = 37) that is 1 ulp off: an angle difference below 1e-6 rad even at position 32768."""
    e = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    p = (np.float64(np.float32(theta)) ** e.astype(np.float64)).astype(np.float32)
    return np.float32(1.0) / p


def ref_rope(x, pos, theta):
    """x [seq, heads, hd] float64, pos [seq] ints. The angles are the f32 values the op is specified to use
    (float(pos) * inv_freq, an f32 product): at position 32768 an f32 angle differs from a float64 one by
    up to ~3e-3 rad, which would measure f32 angle rounding rather than the kernel. Everything after
    the angle is float64."""
    h = x.shape[-1] // 2
    angle = (pos.astype(np.float32)[:, None] * inv_freq_f32(theta, x.shape[-1])[None, :]).astype(np.float64)
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]  # [seq, 1, h]
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def positions(kind, seq, seed=0):
    if kind == "arange":
        return np.arange(seq)
    if kind == "offset":  # a decode step or a chunk deep into the context
        return 1000 + np.arange(seq)
    return np.random.default_rng(seed).integers(0, 32769, seq)  # unordered, up to 32768


def rope(x, pos, theta):
    out = poisoned(x.shape, x.dtype, x.device)
    ops.rope(out, x, pos, theta)
    return out


HEADS = [(14, 64), (2, 64), (12, 128), (2, 128)]  # Qwen2-0.5B / 1.5B q and k heads x head_dim


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads,hd", HEADS)
@pytest.mark.parametrize("kind", ["arange", "offset", "large"])
@pytest.mark.parametrize("theta", [1e4, 1e6])
def test_rope_matches_reference(device, dtype, heads, hd, kind, theta):
    seq = 33
    x, xr = rand((seq, heads, hd), dtype, device, seed=1)
    p = positions(kind, seq)
    pos = llaisys.tensor(p.astype(np.int64), device)
    out = rope(x, pos, theta)
    assert_close(out, ref_rope(xr, p, theta), dtype)
    if device == "cuda":  # the same inputs through the CPU kernel
        assert_close(out, to_f64(rope(x.to("cpu"), pos.to("cpu"), theta)), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("ids", ["i32", "i64"])
@pytest.mark.parametrize("seq", [1, 7, 111])
@pytest.mark.parametrize("hd", [2, 6, 64])  # 2 and 6: fewer pairs than one 16-byte vector
def test_rope_index_dtypes_odd_lengths(device, dtype, ids, seq, hd):
    x, xr = rand((seq, 3, hd), dtype, device, seed=2)
    p = positions("large", seq, seed=seq)
    out = rope(x, llaisys.tensor(p.astype(NP_DTYPE[ids]), device), 1e6)
    assert_close(out, ref_rope(xr, p, 1e6), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rope_in_place(device, dtype):
    x, xr = rand((9, 14, 64), dtype, device, seed=3)
    p = positions("offset", 9)
    ops.rope(x, x, llaisys.tensor(p, device), 1e6)
    assert_close(x, ref_rope(xr, p, 1e6), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,hd", [(14, 2, 64), (12, 2, 128)])
def test_rope_in_place_on_fused_qkv_views(device, dtype, heads, kv_heads, hd):
    seq, width = 13, (heads + 2 * kv_heads) * hd
    qkv, qkvr = rand((seq, width), dtype, device, seed=4)
    q = qkv.slice(1, 0, heads * hd).view(seq, heads, hd)  # seq stride = width > heads * hd
    k = qkv.slice(1, heads * hd, (heads + kv_heads) * hd).view(seq, kv_heads, hd)
    p = positions("large", seq, seed=5)
    pos = llaisys.tensor(p, device)
    ops.rope(q, q, pos, 1e6)
    ops.rope(k, k, pos, 1e6)
    got = to_f64(qkv)
    assert_close(got[:, : heads * hd], ref_rope(qkvr[:, : heads * hd].reshape(seq, heads, hd), p, 1e6)
                 .reshape(seq, -1), dtype)
    kr = qkvr[:, heads * hd: (heads + kv_heads) * hd].reshape(seq, kv_heads, hd)
    assert_close(got[:, heads * hd: (heads + kv_heads) * hd], ref_rope(kr, p, 1e6).reshape(seq, -1), dtype)
    np.testing.assert_array_equal(got[:, (heads + kv_heads) * hd:], qkvr[:, (heads + kv_heads) * hd:])  # v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rope_strided_last_dim_unaligned_and_strided_out(device, dtype):
    seq, heads, hd = 5, 3, 64
    xt, xtr = rand((hd, heads, seq), dtype, device, seed=6)
    x, xr = xt.permute(2, 1, 0), xtr.transpose(2, 1, 0)  # last dim has stride heads * seq
    p = positions("offset", seq)
    pos = llaisys.tensor(p.astype(np.int32), device)
    buf = poisoned((seq, heads, 2 * hd), dtype, device)
    out = buf.slice(2, 0, hd)  # dense last dim, head stride 2 * hd
    ops.rope(out, x, pos, 1e4)
    assert_close(out, ref_rope(xr, p, 1e4), dtype)
    assert np.isnan(to_f64(buf)[..., hd:]).all(), "wrote outside the output view"
    outt = poisoned((hd, heads, seq), dtype, device).permute(2, 1, 0)  # strided last dim: through a copy
    ops.rope(outt, x, pos, 1e4)
    assert_close(outt, ref_rope(xr, p, 1e4), dtype)
    n = seq * heads * hd  # a dense x starting one element into its buffer: no 16-byte vectors on CUDA
    flat, flatr = rand((n + 1,), dtype, device, seed=7)
    xu = flat.slice(0, 1, n + 1).view(seq, heads, hd)
    assert_close(rope(xu, pos, 1e4), ref_rope(flatr[1:].reshape(seq, heads, hd), p, 1e4), dtype)


def test_rope_errors():
    x, _ = rand((4, 2, 64), "f32")
    pos = llaisys.tensor(np.arange(4))
    with pytest.raises(ValueError, match="rope: head_dim must be even, got 63"):
        ops.rope(poisoned((4, 2, 63)), rand((4, 2, 63))[0], pos, 1e4)
    with pytest.raises(ValueError, match=r"rope: pos_ids must have shape \[4\], got \[5\]"):
        ops.rope(poisoned((4, 2, 64)), x, llaisys.tensor(np.arange(5)), 1e4)
    with pytest.raises(TypeError, match="rope: pos_ids must be i64 or i32, got f32"):
        ops.rope(poisoned((4, 2, 64)), x, llaisys.tensor(np.arange(4, dtype=np.float32)), 1e4)
    with pytest.raises(ValueError, match="rope: x must be 3-D"):
        ops.rope(poisoned((4, 128)), rand((4, 128))[0], pos, 1e4)
    with pytest.raises(ValueError, match="rope: out must have shape"):
        ops.rope(poisoned((4, 2, 32)), x, pos, 1e4)
    with pytest.raises(TypeError, match="rope: out must have dtype f32"):
        ops.rope(poisoned((4, 2, 64), "bf16"), x, pos, 1e4)
    with pytest.raises(ValueError, match="rope: theta must be finite and > 0"):
        ops.rope(poisoned((4, 2, 64)), x, pos, 0.0)


@pytest.mark.cuda
def test_rope_device_mismatch():
    x, _ = rand((4, 2, 64), "f32", "cuda")
    with pytest.raises(ValueError, match="rope: all tensors must be on one device"):
        ops.rope(poisoned((4, 2, 64), "f32", "cuda"), x, llaisys.tensor(np.arange(4)), 1e4)


@pytest.mark.cuda
def test_rope_cuda_head_dim_limit():
    wide, _ = rand((1, 1, 1026), "f32", "cuda")  # inv_freq travels as a 512-entry kernel parameter
    with pytest.raises(ValueError, match="rope: head_dim 1026 is not supported on CUDA"):
        ops.rope(poisoned((1, 1, 1026), "f32", "cuda"), wide, llaisys.tensor(np.arange(1), "cuda"), 1e4)


# ---- swiglu --------------------------------------------------------------------------------------------


def ref_swiglu(gate, up):
    """float64: up * gate * sigmoid(gate)."""
    with np.errstate(over="ignore"):
        return up * gate / (1.0 + np.exp(-gate))


def swiglu(gate, up):
    out = poisoned(gate.shape, gate.dtype, gate.device)
    ops.swiglu(out, gate, up)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [1, 19, 989, 4864, 8960])
@pytest.mark.parametrize("rows", [1, 7])
def test_swiglu_matches_reference(device, dtype, n, rows):
    gate, gr = rand((rows, n), dtype, device, seed=1, scale=3.0)
    up, ur = rand((rows, n), dtype, device, seed=2)
    out = swiglu(gate, up)
    assert_close(out, ref_swiglu(gr, ur), dtype)
    if device == "cuda":
        assert_close(out, to_f64(swiglu(gate.to("cpu"), up.to("cpu"))), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_swiglu_prefill_shape_3d(device, dtype):
    gate, gr = rand((2, 256, 4864), dtype, device, seed=3)
    up, ur = rand((2, 256, 4864), dtype, device, seed=4)
    assert_close(swiglu(gate, up), ref_swiglu(gr, ur), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_swiglu_saturation_and_nan(device, dtype):
    rng = np.random.default_rng(5)
    gn = np.concatenate([np.linspace(-80, 80, 161), [-1e4 if dtype != "f16" else -6e4, 1e4, np.nan, 0.0, 1.0]])
    gn = gn.astype(NP_DTYPE[dtype]).astype(np.float64)  # sigmoid saturates to 0/1 at the ends
    un = rng.standard_normal(gn.size).astype(NP_DTYPE[dtype]).astype(np.float64)
    un[-1] = np.nan  # NaN in up propagates too
    gate = llaisys.tensor(gn.astype(NP_DTYPE[dtype]), device)
    up = llaisys.tensor(un.astype(NP_DTYPE[dtype]), device)
    got = to_f64(swiglu(gate, up))
    ref = ref_swiglu(gn, un)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert np.isnan(got).sum() == 2
    assert_close(got, ref, dtype)


def test_swiglu_f32_relative_error_near_the_exp_clamps():
    """The CPU's vectorised e^-g (a polynomial clamped to [-87, 88], swiglu/cpu.cpp) against float64 with
    no absolute tolerance: every g where the clamps switch, tiny and huge |g|, both signs. A clamp applied
    where f32 would not saturate shows as a relative error of order 1 (e.g. -1e30 / e^88 instead of -0)."""
    g = np.concatenate([np.linspace(-90, 90, 3601), [-88.01, -87.99, -87.01, -86.99, 86.99, 87.01, 87.99, 88.01],
                        [-1e30, -1e38, 1e30, 1e38, -1e-30, 1e-30, 0.0, -0.0], np.geomspace(1e-8, 80, 500),
                        -np.geomspace(1e-8, 80, 500)]).astype(np.float32)
    u = np.random.default_rng(8).uniform(0.5, 2.0, g.size).astype(np.float32)
    got = to_f64(swiglu(llaisys.tensor(g, "cpu"), llaisys.tensor(u, "cpu")))
    ref = ref_swiglu(g.astype(np.float64), u.astype(np.float64))
    tiny = np.abs(ref) < 1e-30  # below f32's normal range: f32 gives (-)0 or a denormal
    np.testing.assert_allclose(got[~tiny], ref[~tiny], rtol=4e-7, atol=0)
    assert np.all(np.abs(got[tiny]) < 1e-30)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_swiglu_strided_unaligned_and_in_place(device, dtype):
    gt, gtr = rand((896, 7), dtype, device, seed=6, scale=4.0)
    gate, gr = gt.transpose(0, 1), gtr.T
    n = 7 * 896
    flat, flatr = rand((n + 1,), dtype, device, seed=7)
    up, ur = flat.slice(0, 1, n + 1).view(7, 896), flatr[1:].reshape(7, 896)  # not 16-byte aligned
    buf = poisoned((7, 2 * 896), dtype, device)
    out = buf.slice(1, 896, 2 * 896)
    ops.swiglu(out, gate, up)
    assert_close(out, ref_swiglu(gr, ur), dtype)
    assert np.isnan(to_f64(buf)[:, :896]).all(), "wrote outside the output view"
    g2, g2r = rand((5, 4864), dtype, device, seed=8)
    u2, u2r = rand((5, 4864), dtype, device, seed=9)
    ops.swiglu(g2, g2, u2)  # out is gate, as the model calls it
    assert_close(g2, ref_swiglu(g2r, u2r), dtype)


def test_swiglu_errors():
    g, _ = rand((4, 19), "f32")
    with pytest.raises(ValueError, match=r"swiglu: up must have shape \[4, 19\], got \[4, 18\]"):
        ops.swiglu(poisoned((4, 19)), g, rand((4, 18))[0])
    with pytest.raises(TypeError, match="swiglu: up must have dtype f32"):
        ops.swiglu(poisoned((4, 19)), g, rand((4, 19), "bf16")[0])
    with pytest.raises(TypeError, match="swiglu: out must have dtype f32"):
        ops.swiglu(poisoned((4, 19), "f16"), g, g)
    with pytest.raises(ValueError, match="swiglu: out must have shape"):
        ops.swiglu(poisoned((19, 4)), g, g)
    gi = llaisys.tensor(np.zeros((4, 19), np.int32))
    with pytest.raises(TypeError, match="swiglu: gate must be f32, f16 or bf16, got i32"):
        ops.swiglu(poisoned((4, 19), "i32"), gi, gi)


@pytest.mark.cuda
def test_swiglu_device_mismatch():
    g, _ = rand((4, 19), "f32", "cuda")
    with pytest.raises(ValueError, match="swiglu: all tensors must be on one device"):
        ops.swiglu(poisoned((4, 19), "f32", "cuda"), g, rand((4, 19), "f32", "cpu")[0])
