"""rms_norm and add_rms_norm against float64 NumPy formulas (and CUDA against the CPU on the same inputs)."""
import numpy as np
import pytest

import llaisys
from llaisys import ops
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, TOL, assert_close, bits, poisoned, rand, to_f64


def ref_rms_norm(x, w, eps):
    """x [..., D] float64, w [D]: x / sqrt(mean(x^2) + eps) * w."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def round_to(a, dtype):
    """Round float64 values to `dtype` (what storing into a tensor of that dtype does) and back."""
    return a.astype(NP_DTYPE[dtype]).astype(np.float64)


def rms_norm(x, w, eps):
    out = poisoned(x.shape, x.dtype, x.device)
    ops.rms_norm(out, x, w, eps)
    return out


def add_rms_norm(residual, x, w, eps):
    """(out, residual after the call); residual is updated in place."""
    out = poisoned(x.shape, x.dtype, x.device)
    ops.add_rms_norm(out, residual, x, w, eps)
    return out, residual


def unaligned(shape, dtype, device, seed):
    """A contiguous tensor starting one element into its buffer: 16-byte vector loads are impossible."""
    n = int(np.prod(shape))
    buf, ref = rand((n + 1,), dtype, device, seed)
    return buf.slice(0, 1, n + 1).view(*shape), ref[1:].reshape(shape)


# ---- rms_norm ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("D", [1, 19, 256, 896, 1536, 2048])
@pytest.mark.parametrize("rows", [1, 7, 512])
def test_rms_norm_matches_reference(device, dtype, D, rows):
    x, xr = rand((rows, D), dtype, device, seed=1)
    w, wr = rand((D,), dtype, device, seed=2)
    out = rms_norm(x, w, 1e-6)
    assert_close(out, ref_rms_norm(xr, wr, 1e-6), dtype)
    if device == "cuda":  # the same inputs through the CPU kernel
        assert_close(out, to_f64(rms_norm(x.to("cpu"), w.to("cpu"), 1e-6)), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 19), (3, 5, 896), (3, 8200)])
@pytest.mark.parametrize("eps", [0.0, 1e-6, 1e-5, 0.5])
def test_rms_norm_nd_long_rows_and_eps(device, dtype, shape, eps):
    # 8200 = 1025 vectors of 8: more than one pass of a 1024-thread block on CUDA.
    x, xr = rand(shape, dtype, device, seed=3, scale=3.0)
    w, wr = rand(shape[-1:], dtype, device, seed=4)
    out = rms_norm(x, w, eps)
    assert out.shape == shape
    assert_close(out, ref_rms_norm(xr, wr, eps), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_strided_inputs_and_output(device, dtype):
    D = 896
    xt, xtr = rand((D, 7), dtype, device, seed=5)
    x, xr = xt.transpose(0, 1), xtr.T  # [7, D], column-major
    w_wide, wwr = rand((2 * D,), dtype, device, seed=6)
    w, wr = w_wide.slice(0, D, 2 * D), wwr[D:]
    buf = poisoned((7, 2 * D), dtype, device)
    out = buf.slice(1, 0, D)  # rows with a stride of 2D
    ops.rms_norm(out, x, w, 1e-6)
    assert_close(out, ref_rms_norm(xr, wr, 1e-6), dtype)
    assert np.isnan(to_f64(buf)[:, D:]).all(), "wrote outside the output view"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_in_place_and_unaligned(device, dtype):
    x, xr = unaligned((5, 896), dtype, device, seed=7)
    w, wr = unaligned((896,), dtype, device, seed=8)
    ops.rms_norm(x, x, w, 1e-6)
    assert_close(x, ref_rms_norm(xr, wr, 1e-6), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("D", [19, 1536])
def test_rms_norm_nan_inf_stay_in_their_row(device, dtype, D):
    xn = round_to(np.random.default_rng(9).standard_normal((4, D)), dtype)
    xn[1, 3] = np.nan
    xn[2, 0] = np.inf  # sum of squares inf -> scale 0: finite entries 0, the inf entry inf * 0 = NaN
    x = llaisys.tensor(xn.astype(NP_DTYPE[dtype]), device)
    w, wr = rand((D,), dtype, device, seed=10)
    with np.errstate(invalid="ignore"):
        ref = ref_rms_norm(xn, wr, 1e-6)
    got = to_f64(rms_norm(x, w, 1e-6))
    assert np.isnan(got[1]).all() and np.isnan(got[2, 0]) and (got[2, 1:] == 0).all()
    assert_close(got[[0, 3]], ref[[0, 3]], dtype)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))


def test_rms_norm_zero_row_with_eps_is_zero():
    x = llaisys.tensor(np.zeros((2, 19), np.float32))
    w = llaisys.tensor(np.ones(19, np.float32))
    assert (to_f64(rms_norm(x, w, 1e-6)) == 0).all()


# ---- q/k norm: rms_norm in place on strided 3-D views of a fused QKV output -------------------------------

# (nh, nkvh, hd): Qwen3-0.6B (16 x 8 x 128), Gemma 3 (4 x 1 x 256), odd heads and an odd head dim
QK_SHAPES = [(16, 8, 128), (4, 1, 256), (3, 1, 19), (5, 2, 64)]


def fused_qkv(T, nh, nkvh, hd, dtype, device, layout, seed):
    """(qkv [T, (nh + 2 nkvh) hd], its float64 copy): dense, or the rows of a wider buffer starting one
    element in (row stride width + 5: no 16-byte vector fits, the scalar CUDA path)."""
    width = (nh + 2 * nkvh) * hd
    if layout == "dense":
        return rand((T, width), dtype, device, seed=seed)
    buf, bufr = rand((T, width + 5), dtype, device, seed=seed)
    return buf.slice(1, 1, width + 1), bufr[:, 1: width + 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("nh,nkvh,hd", QK_SHAPES)
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("layout", ["dense", "unaligned"])
def test_rms_norm_in_place_on_qkv_head_views(device, dtype, nh, nkvh, hd, T, layout):
    """How Qwen3 / Gemma 3 norm q and k: q = qkv.view(T, nh + 2 nkvh, hd).slice(1, 0, nh) (rows of hd with
    a head stride hd and a token stride of the QKV row), weight [hd], in place. v and the other part stay
    exactly as they were."""
    qkv, qkvr = fused_qkv(T, nh, nkvh, hd, dtype, device, layout, seed=T + hd)
    wq, wqr = rand((hd,), dtype, device, seed=1)
    wk, wkr = rand((hd,), dtype, device, seed=2)
    heads = qkv.view(T, nh + 2 * nkvh, hd)
    q, k = heads.slice(1, 0, nh), heads.slice(1, nh, nh + nkvh)
    llaisys.reset_peak_memory_stats(device)
    ops.rms_norm(q, q, wq, 1e-6)
    ops.rms_norm(k, k, wk, 1e-6)
    stats = llaisys.memory_stats(device)
    assert stats["peak"] == stats["allocated"], "worked through a temporary copy"
    x = qkvr.reshape(T, nh + 2 * nkvh, hd)
    got = to_f64(qkv).reshape(T, nh + 2 * nkvh, hd)
    assert_close(got[:, :nh], ref_rms_norm(x[:, :nh], wqr, 1e-6), dtype)
    assert_close(got[:, nh: nh + nkvh], ref_rms_norm(x[:, nh: nh + nkvh], wkr, 1e-6), dtype)
    np.testing.assert_array_equal(got[:, nh + nkvh:], x[:, nh + nkvh:])  # v untouched
    # the same values as rms_norm on a dense copy (CPU: the same row function, bit for bit)
    dense = llaisys.tensor(x[:, :nh].astype(NP_DTYPE[dtype]), device)
    want = rms_norm(dense, wq, 1e-6)
    if device == "cpu":
        np.testing.assert_array_equal(bits(want), bits(q))
    else:
        assert_close(q, to_f64(want), dtype)
        cpu = llaisys.tensor(x[:, :nh].astype(NP_DTYPE[dtype]))
        ops.rms_norm(cpu, cpu, wq.to("cpu"), 1e-6)
        assert_close(q, to_f64(cpu), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_between_strided_views(device, dtype):
    """x and out both head views of two fused buffers (no shared memory), then an out that overlaps x
    without being x (heads [1, 4) of the buffer normed from heads [0, 3)): both as from the input."""
    T, nh, nkvh, hd = 5, 4, 2, 64
    a, ar = fused_qkv(T, nh, nkvh, hd, dtype, device, "dense", seed=3)
    b = poisoned((T, (nh + 2 * nkvh) * hd), dtype, device)
    w, wr = rand((hd,), dtype, device, seed=4)
    x = a.view(T, nh + 2 * nkvh, hd).slice(1, 0, nh)
    out = b.view(T, nh + 2 * nkvh, hd).slice(1, nkvh, nkvh + nh)
    ops.rms_norm(out, x, w, 1e-5)
    xr = ar.reshape(T, nh + 2 * nkvh, hd)
    got = to_f64(b).reshape(T, nh + 2 * nkvh, hd)
    assert_close(got[:, nkvh: nkvh + nh], ref_rms_norm(xr[:, :nh], wr, 1e-5), dtype)
    assert np.isnan(got[:, :nkvh]).all() and np.isnan(got[:, nkvh + nh:]).all(), "wrote outside the out view"
    heads = a.view(T, nh + 2 * nkvh, hd)
    ops.rms_norm(heads.slice(1, 1, 4), heads.slice(1, 0, 3), w, 1e-5)
    got = to_f64(a).reshape(T, nh + 2 * nkvh, hd)
    assert_close(got[:, 1:4], ref_rms_norm(xr[:, 0:3], wr, 1e-5), dtype)
    np.testing.assert_array_equal(got[:, 0], xr[:, 0])


# ---- add_rms_norm --------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("D", [1, 19, 256, 896, 1536])
@pytest.mark.parametrize("rows", [1, 7, 512])
def test_add_rms_norm_matches_reference(device, dtype, D, rows):
    res, resr = rand((rows, D), dtype, device, seed=11)
    x, xr = rand((rows, D), dtype, device, seed=12)
    w, wr = rand((D,), dtype, device, seed=13)
    out, res = add_rms_norm(res, x, w, 1e-6)
    new_res = round_to(resr + xr, dtype)  # stored rounded to the dtype; the norm reads the rounded sum
    assert_close(res, new_res, dtype)
    assert_close(out, ref_rms_norm(new_res, wr, 1e-6), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1, 896), (7, 19), (512, 1536), (2, 3, 896)])
def test_add_rms_norm_equals_add_then_rms_norm(device, dtype, shape):
    res, _ = rand(shape, dtype, device, seed=14, scale=4.0)
    x, _ = rand(shape, dtype, device, seed=15)
    w, _ = rand(shape[-1:], dtype, device, seed=16)
    res_unfused = res.clone()
    summed = poisoned(shape, dtype, device)
    ops.add(summed, res_unfused, x)
    unfused = rms_norm(summed, w, 1e-5)
    fused, res = add_rms_norm(res, x, w, 1e-5)
    # The residual sum is rounded the same way on both paths, on every device.
    np.testing.assert_array_equal(bits(res), bits(summed))
    if device == "cpu":  # the CPU shares its row kernel between the two ops: bit for bit
        np.testing.assert_array_equal(bits(fused), bits(unfused))
    else:  # CUDA reduces in another order in the fused kernel than a separate rms_norm may
        assert_close(fused, to_f64(unfused), dtype)
    if device == "cuda":  # and against the CPU on the same inputs
        r_cpu, _ = rand(shape, dtype, "cpu", seed=14, scale=4.0)
        out_cpu, _ = add_rms_norm(r_cpu, x.to("cpu"), w.to("cpu"), 1e-5)
        assert_close(fused, to_f64(out_cpu), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_add_rms_norm_strided_residual_is_written_back(device, dtype):
    D = 896
    buf, bufr = rand((5, 2 * D), dtype, device, seed=17)
    res = buf.slice(1, D, 2 * D)  # [5, D] with a row stride of 2D
    xt, xtr = rand((D, 5), dtype, device, seed=18)
    x, xr = xt.transpose(0, 1), xtr.T
    w, wr = rand((D,), dtype, device, seed=19)
    out, _ = add_rms_norm(res, x, w, 1e-6)
    new_res = round_to(bufr[:, D:] + xr, dtype)
    got = to_f64(buf)
    assert_close(got[:, D:], new_res, dtype)
    np.testing.assert_array_equal(got[:, :D], bufr[:, :D])  # the rest of the buffer is untouched
    assert_close(out, ref_rms_norm(new_res, wr, 1e-6), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_add_rms_norm_unaligned_and_out_aliasing_x(device, dtype):
    res, resr = unaligned((3, 1536), dtype, device, seed=20)
    x, xr = unaligned((3, 1536), dtype, device, seed=21)
    w, wr = rand((1536,), dtype, device, seed=22)
    ops.add_rms_norm(x, res, x, w, 1e-6)  # out is x: each element is read before it is overwritten
    new_res = round_to(resr + xr, dtype)
    assert_close(res, new_res, dtype)
    assert_close(x, ref_rms_norm(new_res, wr, 1e-6), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_nan_stays_in_its_row(device):
    res, resr = rand((3, 896), "bf16", device, seed=23)
    xn = round_to(np.random.default_rng(24).standard_normal((3, 896)), "bf16")
    xn[1, 100] = np.nan
    x = llaisys.tensor(xn.astype(NP_DTYPE["bf16"]), device)
    w, wr = rand((896,), "bf16", device, seed=25)
    out, res = add_rms_norm(res, x, w, 1e-6)
    got_out, got_res = to_f64(out), to_f64(res)
    assert np.isnan(got_out[1]).all() and np.isnan(got_res[1]).sum() == 1
    new_res = round_to(resr + xn, "bf16")
    assert_close(got_out[[0, 2]], ref_rms_norm(new_res[[0, 2]], wr, 1e-6), "bf16")


# ---- add_rms_norm with x_weight (Gemma's sandwich norm folded into the residual add) --------------------


def twins(shape, dtype, device, seed, layout):
    """Two equal tensors laid out alike (CUDA picks its vector width, hence its summation order, by the
    alignment, so the fused op and the two-op reference must see the same layout), and their float64 values."""
    make = (lambda: unaligned(shape, dtype, device, seed)) if layout == "unaligned" else (
        lambda: rand(shape, dtype, device, seed=seed, scale=3.0))
    (a, ar), (b, _) = make(), make()
    return a, b, ar


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
# Gemma 3 1B's hidden size; odd; short rows (a warp per row); long rows (a block per row; past 256 vectors)
@pytest.mark.parametrize("shape", [(1, 1152), (7, 1152), (5, 19), (3, 48), (2, 3, 896), (1, 2304), (2, 8200)])
@pytest.mark.parametrize("layout", ["dense", "unaligned"])
def test_add_rms_norm_x_weight_equals_rms_norm_then_add_rms_norm(device, dtype, shape, layout):
    eps, D = 1e-6, shape[-1]
    res1, res2, _ = twins(shape, dtype, device, 31, layout)
    x1, x2, _ = twins(shape, dtype, device, 32, layout)
    w, _ = rand((D,), dtype, device, seed=33)
    xw, _ = rand((D,), dtype, device, seed=34)
    t = rms_norm(x1, xw, eps)
    unfused, _ = add_rms_norm(res1, t, w, eps)
    fused = poisoned(shape, dtype, device)
    ops.add_rms_norm(fused, res2, x2, w, eps, x_weight=xw)
    np.testing.assert_array_equal(bits(res2), bits(res1))
    np.testing.assert_array_equal(bits(fused), bits(unfused))
    np.testing.assert_array_equal(bits(x2), bits(x1))  # x is only read


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("D", [19, 1152])
def test_add_rms_norm_x_weight_matches_reference(device, dtype, D):
    eps, rows = 1e-6, 6
    res, resr = rand((rows, D), dtype, device, seed=41, scale=4.0)
    x, xr = rand((rows, D), dtype, device, seed=42, scale=10.0)
    w, wr = rand((D,), dtype, device, seed=43)
    xw, xwr = rand((D,), dtype, device, seed=44)
    out = poisoned((rows, D), dtype, device)
    ops.add_rms_norm(out, res, x, w, eps, x_weight=xw)
    # the normed x is stored rounded before the add, the sum rounded before the norm reads it
    new_res = round_to(resr + round_to(ref_rms_norm(xr, xwr, eps), dtype), dtype)
    assert_close(res, new_res, dtype, atol=2 * TOL[dtype]["atol"], rtol=2 * TOL[dtype]["rtol"])
    assert_close(out, ref_rms_norm(to_f64(res), wr, eps), dtype)


def test_add_rms_norm_x_weight_errors():
    x, _ = rand((4, 896), "f32")
    w, _ = rand((896,), "f32")
    out = poisoned((4, 896), "f32")
    with pytest.raises(ValueError, match=r"add_rms_norm: x_weight must have shape \[896\], got \[512\]"):
        ops.add_rms_norm(out, x.clone(), x, w, 1e-6, x_weight=rand((512,), "f32")[0])
    with pytest.raises(TypeError, match="add_rms_norm: x_weight must have dtype f32 like the other operands, got bf16"):
        ops.add_rms_norm(out, x.clone(), x, w, 1e-6, x_weight=rand((896,), "bf16")[0])
    with pytest.raises(TypeError):  # keyword-only
        ops.add_rms_norm(out, x.clone(), x, w, 1e-6, w)
    assert np.isnan(to_f64(out)).all()


@pytest.mark.cuda
def test_add_rms_norm_x_weight_device_mismatch():
    x, _ = rand((4, 896), "f32", "cuda")
    w, _ = rand((896,), "f32", "cuda")
    with pytest.raises(ValueError, match="add_rms_norm: all tensors must be on one device"):
        ops.add_rms_norm(poisoned((4, 896), "f32", "cuda"), x.clone(), x, w, 1e-6, x_weight=rand((896,), "f32")[0])


# ---- errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_norm_errors(op):
    x, _ = rand((4, 896), "f32")
    w, _ = rand((896,), "f32")

    def call(out=None, x=x, w=w, eps=1e-6, res=None):
        out = poisoned(x.shape, x.dtype) if out is None else out
        if op == "rms_norm":
            return ops.rms_norm(out, x, w, eps)
        return ops.add_rms_norm(out, x.clone() if res is None else res, x, w, eps)

    with pytest.raises(ValueError, match=rf"{op}: weight must have shape \[896\], got \[512\]"):
        call(w=rand((512,), "f32")[0])
    with pytest.raises(ValueError, match=rf"{op}: weight must have shape \[896\]"):
        call(w=rand((1, 896), "f32")[0])
    with pytest.raises(TypeError, match=f"{op}: weight must have dtype f32"):
        call(w=rand((896,), "bf16")[0])
    with pytest.raises(TypeError, match=f"{op}: out must have dtype f32"):
        call(out=poisoned((4, 896), "f16"))
    with pytest.raises(ValueError, match=f"{op}: out must have shape"):
        call(out=poisoned((4, 895), "f32"))
    with pytest.raises(TypeError, match=f"{op}: x must be f32, f16 or bf16"):
        call(x=llaisys.tensor(np.zeros((4, 896), np.int32)), out=poisoned((4, 896), "i32"))
    with pytest.raises(ValueError, match=f"{op}: eps must be finite and >= 0"):
        call(eps=-1.0)
    if op == "add_rms_norm":
        with pytest.raises(ValueError, match="add_rms_norm: residual must have shape"):
            call(res=rand((3, 896), "f32")[0])
        with pytest.raises(TypeError, match="add_rms_norm: residual must have dtype f32"):
            call(res=rand((4, 896), "f16")[0])


@pytest.mark.cuda
def test_norm_device_mismatch():
    x, _ = rand((4, 896), "f32", "cuda")
    w, _ = rand((896,), "f32", "cpu")
    with pytest.raises(ValueError, match="rms_norm: all tensors must be on one device"):
        ops.rms_norm(poisoned((4, 896), "f32", "cuda"), x, w, 1e-6)
    with pytest.raises(ValueError, match="add_rms_norm: all tensors must be on one device"):
        ops.add_rms_norm(poisoned((4, 896), "f32", "cuda"), rand((4, 896), "f32", "cpu")[0], x,
                         rand((896,), "f32", "cuda")[0], 1e-6)
