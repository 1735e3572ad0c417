"""kv_shift (StreamingLLM's K-shift on a paged cache) against a float64 NumPy formula: a key turned by the
f32 angles float(delta) * inv_freq (partial rotary: dims [2r, hd) untouched), its value copied; in place and
into other rows; rows it is not given stay as they were; rope then kv_shift equals rope at the shifted
position; the error paths."""
import numpy as np
import pytest

import llaisys
from llaisys import ops
from utils import DEVICES, FLOAT_DTYPES, assert_close, bits, rand, to_f64


def ref_turn(x, delta, inv):
    """x [n, heads, hd] float64: pairs (i, i + r) turn by the f32 angle float32(delta) * inv[i]."""
    r = len(inv)
    angle = (np.float32(delta) * np.asarray(inv, np.float32)).astype(np.float64)
    c, s = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., :r], x[..., r:2 * r]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * r:]], axis=-1)


def table(kind, hd):
    if kind == "full":
        return np.array(ops.rope_inv_freq(1e6, hd), np.float32)
    if kind == "quarter":  # Pythia's rotary_pct 0.25
        return np.array(ops.rope_inv_freq(1e4, hd // 4), np.float32)
    if kind == "llama3":
        return np.array(ops.rope_inv_freq(5e5, hd, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=64), np.float32)
    return np.array(ops.rope_inv_freq(1e4, 6), np.float32)  # "odd": 3 pairs, no 16-byte vector fits


def cache(rows, heads, hd, dtype, device, seed):
    k, kr = rand((rows, heads, hd), dtype, device, seed=seed)
    v, vr = rand((rows, heads, hd), dtype, device, seed=seed + 1)
    return k, kr, v, vr


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads,hd", [(2, 64), (3, 128), (1, 24), (5, 80)])
@pytest.mark.parametrize("kind", ["full", "quarter", "llama3", "odd"])
@pytest.mark.parametrize("delta", [-16, -4096, 7, 1])
def test_kv_shift_in_place_and_copy(device, dtype, heads, hd, kind, delta):
    inv = table(kind, hd)
    rows = 64
    k, kr, v, vr = cache(rows, heads, hd, dtype, device, seed=hd + len(inv))
    rng = np.random.default_rng(abs(delta))
    perm = rng.permutation(rows)
    same = np.sort(perm[:19])            # turned in place
    src, dst = perm[19:30], perm[30:41]  # turned into other rows (copy on write)
    s_all, d_all = np.concatenate([same, src]), np.concatenate([same, dst])
    ops.kv_shift(k, v, llaisys.tensor(s_all, device), llaisys.tensor(d_all, device), delta, inv.tolist())
    want_k, want_v = kr.copy(), vr.copy()
    want_k[d_all] = ref_turn(kr[s_all], delta, inv)
    want_v[dst] = vr[src]
    assert_close(k, want_k, dtype)
    got_k, got_v = to_f64(k), to_f64(v)
    untouched = np.setdiff1d(np.arange(rows), d_all)
    np.testing.assert_array_equal(got_k[untouched], kr[untouched])  # rows not given: exactly as they were
    np.testing.assert_array_equal(got_v, want_v)                    # values move, bit for bit
    np.testing.assert_array_equal(got_k[d_all][..., 2 * len(inv):], kr[s_all][..., 2 * len(inv):])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["full", "quarter"])
def test_rope_then_shift_is_rope_at_the_shifted_position(device, kind):
    """What the engine relies on: a key cached at position p and shifted by -d is the key at p - d."""
    heads, hd, T = 2, 64, 37
    inv = table(kind, hd)
    x, xr = rand((T, heads, hd), "f32", device, seed=3)
    p = np.arange(100, 100 + T)
    k = llaisys.empty([T, heads, hd], "f32", device)
    ops.rope(k, x, llaisys.tensor(p, device), inv.tolist())
    v = llaisys.zeros([T, heads, hd], "f32", device)
    idx = llaisys.tensor(np.arange(T), device)
    ops.kv_shift(k, v, idx, idx, -96, inv.tolist())
    angle = ((p - 96).astype(np.float32)[:, None] * inv[None, :]).astype(np.float64)
    c, s = np.cos(angle)[:, None], np.sin(angle)[:, None]
    r = len(inv)
    want = np.concatenate([xr[..., :r] * c - xr[..., r:2 * r] * s, xr[..., r:2 * r] * c + xr[..., :r] * s,
                           xr[..., 2 * r:]], axis=-1)
    # two f32 rotations in sequence (p, then -96) instead of one: a few f32 ulps of the angles' cos/sin
    assert_close(k, want, "f32", atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_shift_i32_indices_and_nothing_to_do(device):
    k, kr, v, vr = cache(8, 1, 16, "f32", device, seed=1)
    inv = table("full", 16)
    ops.kv_shift(k, v, llaisys.tensor(np.array([], np.int64), device), llaisys.tensor(np.array([], np.int64), device),
                 -5, inv.tolist())
    np.testing.assert_array_equal(to_f64(k), kr)
    ops.kv_shift(k, v, llaisys.tensor(np.array([3], np.int32), device), llaisys.tensor(np.array([5], np.int32), device),
                 -5, inv.tolist())
    want = kr.copy()
    want[5] = ref_turn(kr[3:4], -5, inv)[0]
    assert_close(k, want, "f32")
    np.testing.assert_array_equal(bits(v)[5], bits(v)[3])


def test_kv_shift_errors():
    k, _, v, _ = cache(8, 2, 16, "f32", "cpu", seed=2)
    inv = table("full", 16).tolist()
    one = llaisys.tensor(np.array([1]))
    with pytest.raises(IndexError, match="kv_shift: row 9 -> 1 at index 0 is out of range"):
        ops.kv_shift(k, v, llaisys.tensor(np.array([9])), one, -1, inv)
    with pytest.raises(IndexError, match="kv_shift: row 1 -> -1"):
        ops.kv_shift(k, v, one, llaisys.tensor(np.array([-1])), -1, inv)
    with pytest.raises(ValueError, match="kv_shift: inv_freq must have 1 .. head_dim / 2 = 8 entries, got 9"):
        ops.kv_shift(k, v, one, one, -1, inv + [1.0])
    with pytest.raises(ValueError, match="kv_shift: delta must be within"):
        ops.kv_shift(k, v, one, one, 1 << 24, inv)
    with pytest.raises((ValueError, TypeError), match="kv_shift"):
        ops.kv_shift(k, llaisys.zeros([8, 2, 16], "f16"), one, one, -1, inv)
    with pytest.raises(ValueError, match="kv_shift"):
        ops.kv_shift(k, v, one, llaisys.tensor(np.array([1, 2])), -1, inv)


@pytest.mark.cuda
def test_kv_shift_bad_row_on_cuda_raises_at_synchronize():
    k, _, v, _ = cache(8, 2, 16, "f32", "cuda", seed=2)
    one = llaisys.tensor(np.array([1]), "cuda")
    ops.kv_shift(k, v, llaisys.tensor(np.array([9]), "cuda"), one, -1, table("full", 16).tolist())
    with pytest.raises(IndexError, match="kv_shift: a row is out of range of the KV cache"):
        llaisys.synchronize("cuda")
    llaisys.synchronize("cuda")  # the flag was cleared: the device stays usable
