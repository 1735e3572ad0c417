"""layer_norm and add_layer_norm against float64 NumPy formulas (and CUDA against the CPU on the same inputs;
add_layer_norm with delta2 also against torch.nn.functional.layer_norm)."""
import numpy as np
import pytest

import llaisys
from llaisys import functional as F
from llaisys import ops
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, assert_close, bits, poisoned, rand, to_f64


def ref_layer_norm(x, w, b, eps):
    """x [..., H] float64, w/b [H] (b may be None): (x - mean) / sqrt(var + eps) * w + b, biased variance."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * w
    return y if b is None else y + b


def round_to(a, dtype):
    """Round float64 values to `dtype` (what storing into a tensor of that dtype does) and back."""
    return a.astype(NP_DTYPE[dtype]).astype(np.float64)


def layer_norm(x, w, b, eps):
    out = poisoned(x.shape, x.dtype, x.device)
    ops.layer_norm(out, x, w, b, eps)
    return out


def add_layer_norm(res, d, d2, w, b, eps):
    """out; res is updated in place."""
    out = poisoned(d.shape, d.dtype, d.device)
    ops.add_layer_norm(out, res, d, d2, w, b, eps)
    return out


def unaligned(shape, dtype, device, seed, scale=1.0):
    """A contiguous tensor starting one element into its buffer: 16-byte vector loads are impossible."""
    n = int(np.prod(shape))
    buf, ref = rand((n + 1,), dtype, device, seed, scale)
    return buf.slice(0, 1, n + 1).view(*shape), ref[1:].reshape(shape)


def weight_bias(H, dtype, device, seed, bias=True):
    """Weights around 1 and biases around 0, moved off the initial values (1, 0) as a trained model's are."""
    w, wr = rand((H,), dtype, device, seed, scale=0.5)
    w1 = round_to(wr + 1.0, dtype)
    w = llaisys.tensor(w1.astype(NP_DTYPE[dtype]), device)
    if not bias:
        return w, w1, None, None
    b, br = rand((H,), dtype, device, seed + 1000, scale=0.3)
    return w, w1, b, br


# H covers every CUDA kernel choice: 1 and 19 (one warp a row: rows of at most 64 vectors), 111 and 989 (a
# block a row, 1 vector a thread; 111 unaligned), 2048 (a block of 256 16-byte vectors in bf16/f16, a decode
# row of Pythia-1.4B), 2050 (a block, up to 4 vectors a thread), 4099 (longer than a block holds in registers:
# re-read).
HS = [1, 19, 111, 989, 2048, 2050, 4099]


# ---- layer_norm ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("H", HS)
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_reference(device, dtype, H, rows, bias):
    x, xr = rand((rows, H), dtype, device, seed=1, scale=2.0)
    w, wr, b, br = weight_bias(H, dtype, device, seed=2, bias=bias)
    out = layer_norm(x, w, b, 1e-5)
    assert_close(out, ref_layer_norm(xr, wr, br, 1e-5), dtype)
    if device == "cuda":  # the same inputs through the CPU kernel
        cpu_b = None if b is None else b.to("cpu")
        assert_close(out, to_f64(layer_norm(x.to("cpu"), w.to("cpu"), cpu_b, 1e-5)), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 19), (3, 5, 896), (2, 8200)])
@pytest.mark.parametrize("eps", [0.0, 1e-6, 1e-5, 0.5])
def test_layer_norm_nd_long_rows_and_eps(device, dtype, shape, eps):
    x, xr = rand(shape, dtype, device, seed=3, scale=3.0)
    w, wr, b, br = weight_bias(shape[-1], dtype, device, seed=4)
    out = layer_norm(x, w, b, eps)
    assert out.shape == shape
    assert_close(out, ref_layer_norm(xr, wr, br, eps), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("H", [19, 2048])
def test_layer_norm_large_mean_small_spread(device, H):
    # mean 1000, spread ~1: E[x^2] - mean^2 in f32 would lose ~2^-24 * 1e6 = 0.06 of a variance of 1, and
    # x - mean with an f32 mean near 1000 would be off by up to half its ulp (3e-5): the op corrects its mean.
    rng = np.random.default_rng(5)
    xr = round_to(1000.0 + rng.standard_normal((4, H)), "f32")
    x = llaisys.tensor(xr.astype(np.float32), device)
    w, wr, b, br = weight_bias(H, "f32", device, seed=6)
    assert_close(layer_norm(x, w, b, 1e-5), ref_layer_norm(xr, wr, br, 1e-5), "f32")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_norm_strided_inputs_and_output(device, dtype):
    H = 896
    xt, xtr = rand((H, 7), dtype, device, seed=7)
    x, xr = xt.transpose(0, 1), xtr.T  # [7, H], column-major
    w_wide, wwr = rand((2 * H,), dtype, device, seed=8)
    w, wr = w_wide.slice(0, H, 2 * H), wwr[H:]
    b_wide, bwr = rand((H, 2), dtype, device, seed=9)
    b, br = b_wide.select(1, 1), bwr[:, 1]  # a stride of 2
    buf = poisoned((7, 2 * H), dtype, device)
    out = buf.slice(1, 0, H)  # rows with a stride of 2H
    ops.layer_norm(out, x, w, b, 1e-5)
    assert_close(out, ref_layer_norm(xr, wr, br, 1e-5), dtype)
    assert np.isnan(to_f64(buf)[:, H:]).all(), "wrote outside the output view"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("H", [896, 2048, 4096])
def test_layer_norm_in_place_and_unaligned(device, dtype, H):
    x, xr = unaligned((5, H), dtype, device, seed=10)
    w, wr = unaligned((H,), dtype, device, seed=11)
    b, br = unaligned((H,), dtype, device, seed=12)
    ops.layer_norm(x, x, w, b, 1e-5)
    assert_close(x, ref_layer_norm(xr, wr, br, 1e-5), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("H", [19, 2048, 4099])
def test_layer_norm_nan_inf_stay_in_their_row(device, dtype, H):
    xn = round_to(np.random.default_rng(13).standard_normal((4, H)), dtype)
    xn[1, 3] = np.nan
    xn[2, 0] = np.inf  # mean inf: inf - inf is NaN, so the whole row's variance and output are NaN
    x = llaisys.tensor(xn.astype(NP_DTYPE[dtype]), device)
    w, wr, b, br = weight_bias(H, dtype, device, seed=14)
    with np.errstate(invalid="ignore"):
        ref = ref_layer_norm(xn, wr, br, 1e-5)
    got = to_f64(layer_norm(x, w, b, 1e-5))
    assert np.isnan(got[1]).all() and np.isnan(got[2]).all()
    assert_close(got[[0, 3]], ref[[0, 3]], dtype)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_norm_constant_row_gives_bias(device, dtype):
    x = llaisys.tensor(np.full((3, 111), 0.5, NP_DTYPE[dtype]), device)  # variance 0: out = bias exactly
    w, _, b, br = weight_bias(111, dtype, device, seed=15)
    np.testing.assert_array_equal(to_f64(layer_norm(x, w, b, 1e-5)), np.broadcast_to(br, (3, 111)))


# ---- add_layer_norm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("H", HS)
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("two", [False, True])
def test_add_layer_norm_matches_reference(device, dtype, H, rows, two):
    res, resr = rand((rows, H), dtype, device, seed=16, scale=4.0)
    d, dr = rand((rows, H), dtype, device, seed=17)
    d2, d2r = rand((rows, H), dtype, device, seed=18) if two else (None, None)
    w, wr, b, br = weight_bias(H, dtype, device, seed=19)
    out = add_layer_norm(res, d, d2, w, b, 1e-5)
    new_res = round_to(resr + dr, dtype)  # stored rounded after each add; the norm reads the rounded sum
    if two:
        new_res = round_to(new_res + d2r, dtype)
    assert_close(res, new_res, dtype)
    assert_close(out, ref_layer_norm(new_res, wr, br, 1e-5), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1, 2048), (7, 19), (64, 2050), (2, 3, 989), (3, 4099)])
@pytest.mark.parametrize("bias", [True, False])
def test_add_layer_norm_equals_add_add_then_layer_norm(device, dtype, shape, bias):
    res, _ = rand(shape, dtype, device, seed=20, scale=4.0)
    d, _ = rand(shape, dtype, device, seed=21)
    d2, _ = rand(shape, dtype, device, seed=22)
    w, _, b, _ = weight_bias(shape[-1], dtype, device, seed=23, bias=bias)
    summed = res.clone()
    ops.add(summed, summed, d)
    ops.add(summed, summed, d2)
    unfused = layer_norm(summed, w, b, 1e-5)
    fused = add_layer_norm(res, d, d2, w, b, 1e-5)
    # The residual sum is rounded the same way on both paths, on every device.
    np.testing.assert_array_equal(bits(res), bits(summed))
    if device == "cpu":  # the CPU shares its row kernel between the two ops: bit for bit
        np.testing.assert_array_equal(bits(fused), bits(unfused))
    else:  # CUDA may reduce in another order in the fused kernel than a separate layer_norm
        assert_close(fused, to_f64(unfused), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_add_layer_norm_parallel_residual_matches_torch(device, dtype):
    # GPT-NeoX's parallel residual: x + attn + mlp, then the next layer's LayerNorm - against torch, whose
    # (x + attn) + mlp in the dtype rounds after each add as the op does.
    torch = pytest.importorskip("torch")
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    shape, H = (9, 2048), 2048
    res, _ = rand(shape, dtype, device, seed=24, scale=4.0)
    d, _ = rand(shape, dtype, device, seed=25)
    d2, _ = rand(shape, dtype, device, seed=26)
    w, _, b, _ = weight_bias(H, dtype, device, seed=27)
    t = [torch.from_numpy(to_f64(a)).to(tdt) for a in (res, d, d2, w, b)]  # exact: the values are of the dtype
    summed = t[0] + t[1] + t[2]
    ref = torch.nn.functional.layer_norm(summed, (H,), t[3], t[4], 1e-5)
    out = add_layer_norm(res, d, d2, w, b, 1e-5)
    np.testing.assert_array_equal(to_f64(res), summed.double().numpy())
    assert_close(out, ref.double().numpy(), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_add_layer_norm_strided_residual_is_written_back(device, dtype):
    H = 896
    buf, bufr = rand((5, 2 * H), dtype, device, seed=28)
    res = buf.slice(1, H, 2 * H)  # [5, H] with a row stride of 2H
    dt, dtr = rand((H, 5), dtype, device, seed=29)
    d, dr = dt.transpose(0, 1), dtr.T
    d2, d2r = rand((5, H), dtype, device, seed=30)
    w, wr, b, br = weight_bias(H, dtype, device, seed=31)
    out = add_layer_norm(res, d, d2, w, b, 1e-5)
    new_res = round_to(round_to(bufr[:, H:] + dr, dtype) + d2r, dtype)
    got = to_f64(buf)
    assert_close(got[:, H:], new_res, dtype)
    np.testing.assert_array_equal(got[:, :H], bufr[:, :H])  # the rest of the buffer is untouched
    assert_close(out, ref_layer_norm(new_res, wr, br, 1e-5), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("H", [1536, 2048, 4099])
def test_add_layer_norm_unaligned_and_out_aliasing_delta(device, dtype, H):
    res, resr = unaligned((3, H), dtype, device, seed=32)
    d, dr = unaligned((3, H), dtype, device, seed=33)
    d2, d2r = rand((3, H), dtype, device, seed=34)
    w, wr, b, br = weight_bias(H, dtype, device, seed=35)
    ops.add_layer_norm(d, res, d, d2, w, b, 1e-5)  # out is delta: each element is read before it is written
    new_res = round_to(round_to(resr + dr, dtype) + d2r, dtype)
    assert_close(res, new_res, dtype)
    assert_close(d, ref_layer_norm(new_res, wr, br, 1e-5), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_add_layer_norm_nan_stays_in_its_row(device):
    res, resr = rand((3, 896), "bf16", device, seed=36)
    d2n = round_to(np.random.default_rng(37).standard_normal((3, 896)), "bf16")
    d2n[1, 100] = np.nan
    d, dr = rand((3, 896), "bf16", device, seed=38)
    d2 = llaisys.tensor(d2n.astype(NP_DTYPE["bf16"]), device)
    w, wr, b, br = weight_bias(896, "bf16", device, seed=39)
    out = add_layer_norm(res, d, d2, w, b, 1e-5)
    got_out, got_res = to_f64(out), to_f64(res)
    assert np.isnan(got_out[1]).all() and np.isnan(got_res[1]).sum() == 1
    new_res = round_to(round_to(resr + dr, "bf16") + d2n, "bf16")
    assert_close(got_out[[0, 2]], ref_layer_norm(new_res[[0, 2]], wr, br, 1e-5), "bf16")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("H", HS)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("bias2", [True, False])
def test_add_layer_norm_second_output(device, dtype, H, rows, bias2):
    """out2 (GPT-NeoX's ln2 of the same residual): float64's LayerNorm of the summed residual with weight2 and
    bias2; bit for bit the out of add_layer_norm called with those weights on the same inputs; and out itself
    unchanged by asking for out2."""
    res0, resr = rand((rows, H), dtype, device, seed=50, scale=4.0)
    d, dr = rand((rows, H), dtype, device, seed=51)
    d2, d2r = rand((rows, H), dtype, device, seed=52)
    w, wr, b, br = weight_bias(H, dtype, device, seed=53)
    w2, w2r, b2, b2r = weight_bias(H, dtype, device, seed=54, bias=bias2)
    res = res0.clone()
    out, out2 = poisoned((rows, H), dtype, device), poisoned((rows, H), dtype, device)
    ops.add_layer_norm(out, res, d, d2, w, b, 1e-5, out2=out2, weight2=w2, bias2=b2)
    new_res = round_to(round_to(resr + dr, dtype) + d2r, dtype)
    assert_close(res, new_res, dtype)
    assert_close(out, ref_layer_norm(new_res, wr, br, 1e-5), dtype)
    assert_close(out2, ref_layer_norm(new_res, w2r, b2r, 1e-5), dtype)
    alone = res0.clone()
    np.testing.assert_array_equal(bits(add_layer_norm(alone, d, d2, w, b, 1e-5)), bits(out))
    alone2 = res0.clone()
    np.testing.assert_array_equal(bits(add_layer_norm(alone2, d, d2, w2, b2, 1e-5)), bits(out2))
    np.testing.assert_array_equal(bits(alone), bits(res))


def test_add_layer_norm_second_output_errors():
    d, _ = rand((4, 896), "f32")
    w, _ = rand((896,), "f32")

    def call(out2=None, w2=None, b2=None):
        return ops.add_layer_norm(poisoned((4, 896)), d.clone(), d, None, w, None, 1e-5, out2=out2, weight2=w2,
                                  bias2=b2)

    with pytest.raises(ValueError, match="add_layer_norm: weight2 is an undefined tensor"):
        call(out2=poisoned((4, 896)))
    with pytest.raises(ValueError, match="add_layer_norm: weight2/bias2 given without out2"):
        call(w2=w)
    with pytest.raises(ValueError, match=r"add_layer_norm: out2 must have shape \[4, 896\]"):
        call(out2=poisoned((4, 895)), w2=w)
    with pytest.raises(TypeError, match="add_layer_norm: out2 must have dtype f32"):
        call(out2=poisoned((4, 896), "bf16"), w2=w)
    with pytest.raises(ValueError, match=r"add_layer_norm: weight2 must have shape \[896\]"):
        call(out2=poisoned((4, 896)), w2=rand((895,), "f32")[0])
    with pytest.raises(TypeError, match="add_layer_norm: bias2 must have dtype f32"):
        call(out2=poisoned((4, 896)), w2=w, b2=rand((896,), "bf16")[0])


def test_functional_forms():
    x, xr = rand((3, 19), "f32", seed=40)
    w, wr, b, br = weight_bias(19, "f32", "cpu", seed=41)
    assert_close(F.layer_norm(x, w, b), ref_layer_norm(xr, wr, br, 1e-5), "f32")
    assert_close(F.layer_norm(x, w), ref_layer_norm(xr, wr, None, 1e-5), "f32")
    res, resr = rand((3, 19), "f32", seed=42)
    out = F.add_layer_norm(res, x, w, b, eps=1e-6, delta2=x)
    new_res = round_to(round_to(resr + xr, "f32") + xr, "f32")
    assert_close(res, new_res, "f32")
    assert_close(out, ref_layer_norm(new_res, wr, br, 1e-6), "f32")


# ---- errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm"])
def test_layer_norm_errors(op):
    x, _ = rand((4, 896), "f32")
    w, _ = rand((896,), "f32")
    b, _ = rand((896,), "f32")

    def call(out=None, x=x, w=w, b=b, eps=1e-5):
        out = poisoned(x.shape, x.dtype) if out is None else out
        if op == "layer_norm":
            return ops.layer_norm(out, x, w, b, eps)
        return ops.add_layer_norm(out, x.clone(), x, None, w, b, eps)

    name = "delta" if op == "add_layer_norm" else "x"
    with pytest.raises(ValueError, match=rf"{op}: weight must have shape \[896\], got \[512\]"):
        call(w=rand((512,), "f32")[0])
    with pytest.raises(ValueError, match=rf"{op}: bias must have shape \[896\], got \[1, 896\]"):
        call(b=rand((1, 896), "f32")[0])
    with pytest.raises(TypeError, match=f"{op}: weight must have dtype f32"):
        call(w=rand((896,), "bf16")[0])
    with pytest.raises(TypeError, match=f"{op}: bias must have dtype f32 like the other operands, got f16"):
        call(b=rand((896,), "f16")[0])
    with pytest.raises(TypeError, match=f"{op}: out must have dtype f32"):
        call(out=poisoned((4, 896), "f16"))
    with pytest.raises(ValueError, match=f"{op}: out must have shape"):
        call(out=poisoned((4, 895), "f32"))
    with pytest.raises(TypeError, match=f"{op}: {name} must be f32, f16 or bf16, got i32"):
        call(x=llaisys.tensor(np.zeros((4, 896), np.int32)), out=poisoned((4, 896), "i32"))
    for eps in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"{op}: eps must be finite and >= 0"):
            call(eps=eps)


def test_add_layer_norm_operand_errors():
    d, _ = rand((4, 896), "f32")
    w, _ = rand((896,), "f32")

    def call(res=None, d2=None):
        res = d.clone() if res is None else res
        return ops.add_layer_norm(poisoned((4, 896)), res, d, d2, w, None, 1e-5)

    with pytest.raises(ValueError, match="add_layer_norm: residual must have shape"):
        call(res=rand((3, 896), "f32")[0])
    with pytest.raises(TypeError, match="add_layer_norm: residual must have dtype f32"):
        call(res=rand((4, 896), "f16")[0])
    with pytest.raises(ValueError, match=r"add_layer_norm: delta2 must have shape \[4, 896\], got \[4, 895\]"):
        call(d2=rand((4, 895), "f32")[0])
    with pytest.raises(TypeError, match="add_layer_norm: delta2 must have dtype f32"):
        call(d2=rand((4, 896), "bf16")[0])


@pytest.mark.cuda
def test_layer_norm_device_mismatch():
    x, _ = rand((4, 896), "f32", "cuda")
    w, _ = rand((896,), "f32", "cuda")
    b_cpu, _ = rand((896,), "f32", "cpu")
    with pytest.raises(ValueError, match="layer_norm: all tensors must be on one device"):
        ops.layer_norm(poisoned((4, 896), "f32", "cuda"), x, w, b_cpu, 1e-5)
    with pytest.raises(ValueError, match="add_layer_norm: all tensors must be on one device"):
        ops.add_layer_norm(poisoned((4, 896), "f32", "cuda"), x.clone(), x, rand((4, 896), "f32", "cpu")[0], w, None,
                           1e-5)
    with pytest.raises(ValueError, match="add_layer_norm: all tensors must be on one device"):
        ops.add_layer_norm(poisoned((4, 896), "f32", "cuda"), rand((4, 896), "f32", "cpu")[0], x, None, w, None, 1e-5)
