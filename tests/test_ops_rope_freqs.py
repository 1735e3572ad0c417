"""RoPE from an explicit frequency table: rope_inv_freq against HF transformers' own tables
(modeling_rope_utils: a model's default, "linear", "llama3"), and rope / rope_qkv_cache with a table of
r <= head_dim / 2 pairs (GPT-NeoX's partial rotary: dims [2r, head_dim) pass through) against a float64
NumPy formula; the theta overloads equal the table overloads bit for bit."""
import math

import numpy as np
import pytest

import llaisys
from llaisys import ops
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, assert_close, bits, poisoned, rand, to_f64

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


# ---- rope_inv_freq against HF ---------------------------------------------------------------------------


class CorrectlyRoundedBase(float):
    """A rope_theta whose ``base ** exponents`` (the one pow in HF's tables) is rounded correctly to f32
    (through float64) instead of by torch's f32 pow, which is up to 1 ulp off for some entries (e.g. theta
    1e6, dim 128, i = 37). Everything after the pow is HF's own code, run by torch as is."""

    def __pow__(self, e):
        if isinstance(e, torch.Tensor):
            v = np.float64(np.float32(float(self))) ** e.numpy().astype(np.float64)
            return torch.from_numpy(v.astype(np.float32))
        return float(self) ** e


def hf_inv_freq(theta, head_dim, rope_type, partial=1.0, **scaling):
    """HF's inv_freq for a small Llama config (GPT-NeoX's for a partial rotary), f32."""
    from transformers import GPTNeoXConfig, LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": rope_type, "rope_theta": theta, **scaling}
    if partial != 1.0:
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

        params["partial_rotary_factor"] = partial
        cfg = GPTNeoXConfig(hidden_size=head_dim * 3, num_attention_heads=3, rope_parameters=params)
        inv, _ = GPTNeoXRotaryEmbedding.compute_default_rope_parameters(cfg)
        return inv.numpy().astype(np.float32)
    cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim, rope_parameters=params,
                      max_position_embeddings=131072)
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        inv, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        inv, _ = ROPE_INIT_FUNCTIONS[rope_type](cfg)
    return inv.numpy().astype(np.float32)


def ours(theta, rotary_dim, rope_type="default", **scaling):
    return np.array(ops.rope_inv_freq(theta, rotary_dim, rope_type=rope_type, **scaling), np.float32)


def ulps(a, b):
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


LLAMA3 = [  # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    (8.0, 1.0, 4.0, 8192),   # Llama 3.1
    (32.0, 1.0, 4.0, 8192),  # Llama 3.2
    (16.0, 2.0, 8.0, 4096),  # made up: every branch moves
    (4.0, 1.0, 4.0, 2048),
]
TABLES = ([("default", {})] + [("linear", {"factor": f}) for f in (2.0, 8.0, 3.7)] +
          [("llama3", dict(factor=f, low_freq_factor=lo, high_freq_factor=hi, original_max_position_embeddings=o))
           for f, lo, hi, o in LLAMA3])
TABLE_IDS = ["default", "linear2", "linear8", "linear3.7", "llama3.1", "llama3.2", "llama3-x", "llama3-2k"]


@pytest.mark.parametrize("rope_type,scaling", TABLES, ids=TABLE_IDS)
@pytest.mark.parametrize("theta", [1e4, 5e5, 1e6, 3e6])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128, 256])
def test_rope_inv_freq_equals_hf(rope_type, scaling, theta, head_dim):
    """Bit for bit HF's table once HF's pow is the correctly rounded one; with torch's own pow, bit for bit
    wherever torch's pow is correctly rounded. Where it is not (1 ulp off: theta^e near a binade's top,
    e.g. 3e6^(14/32) = 681.93118, torch 681.9312, rounded 681.93115), the reciprocal 1 / p lands in a
    binade of other relative spacing and can carry that into 2 ulp of inv_freq; llama3's smoothed band,
    (1 - s) * f / factor + s * f with s = (orig / wavelen - low) / (high - low), cancels and turns it into at
    most 4 (seen at theta 3e6, head_dim 256). Our pow is the correctly rounded one, which is also what
    the theta overloads have always used."""
    got = ours(theta, head_dim, rope_type, **scaling)
    np.testing.assert_array_equal(got.view(np.int32),
                                  hf_inv_freq(CorrectlyRoundedBase(theta), head_dim, rope_type, **scaling).view(np.int32))
    hf = hf_inv_freq(theta, head_dim, rope_type, **scaling)
    pow_off = ulps(hf_inv_freq(theta, head_dim, "default"), ours(theta, head_dim)) > 0
    d = ulps(got, hf)
    assert (d[~pow_off] == 0).all()
    assert d.max() <= (4 if rope_type == "llama3" else 2)


@pytest.mark.parametrize("head_dim,partial", [(128, 0.25), (64, 0.25), (80, 0.5), (256, 0.25)])
@pytest.mark.parametrize("theta", [1e4, 1e6])
def test_rope_inv_freq_partial_rotary_equals_gpt_neox(head_dim, partial, theta):
    """GPT-NeoX's table for rotary_pct: rope_inv_freq(theta, int(head_dim * rotary_pct))."""
    rotary_dim = int(head_dim * partial)
    got = ours(theta, rotary_dim)
    assert len(got) == rotary_dim // 2
    hf = hf_inv_freq(CorrectlyRoundedBase(theta), head_dim, "default", partial=partial)
    np.testing.assert_array_equal(got.view(np.int32), hf.view(np.int32))
    assert ulps(got, hf_inv_freq(theta, head_dim, "default", partial=partial)).max() <= 2


def test_rope_inv_freq_errors():
    with pytest.raises(ValueError, match="rope_inv_freq: theta must be finite and > 0"):
        ops.rope_inv_freq(0.0, 64)
    with pytest.raises(ValueError, match="rope_inv_freq: rotary_dim must be even and >= 2, got 7"):
        ops.rope_inv_freq(1e4, 7)
    with pytest.raises(ValueError, match="rope_inv_freq: rotary_dim must be even and >= 2, got 0"):
        ops.rope_inv_freq(1e4, 0)
    with pytest.raises(ValueError, match="rope_inv_freq: the scaling factor must be finite and > 0"):
        ops.rope_inv_freq(1e4, 64, rope_type="linear", factor=0.0)
    with pytest.raises(ValueError, match="rope_inv_freq: llama3 needs 0 < low_freq_factor < high_freq_factor"):
        ops.rope_inv_freq(1e4, 64, rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=4.0)
    with pytest.raises(ValueError, match="rope_inv_freq: original_max_position_embeddings must be > 0"):
        ops.rope_inv_freq(1e4, 64, rope_type="llama3", factor=8.0, original_max_position_embeddings=0)
    with pytest.raises(ValueError, match="rope_inv_freq: rope_type must be 'default', 'linear' or 'llama3', got 'yarn'"):
        ops.rope_inv_freq(1e4, 64, rope_type="yarn")


# ---- rope / rope_qkv_cache with a table -----------------------------------------------------------------


def ref_rope_table(x, pos, inv):
    """x [T, heads, hd] float64, pos [T], inv [r] f32: pairs (i, i + r), i < r, turn by the f32 angle
    float(pos) * inv[i] (as the op specifies; everything after the angle is float64); dims [2r, hd) stay."""
    r = len(inv)
    angle = (np.asarray(pos).astype(np.float32)[:, None] * np.asarray(inv, np.float32)[None, :]).astype(np.float64)
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = x[..., :r], x[..., r: 2 * r]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * r:]], axis=-1)


def table(kind, hd, theta=1e4):
    """A frequency table for head_dim hd: Pythia's rotary_pct 0.25, a full llama3-scaled one, or an odd
    count of pairs (no 16-byte vector fits it: the scalar paths)."""
    if kind == "quarter":
        return ours(theta, hd // 4)
    if kind == "llama3":
        return ours(theta, hd, "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=64)
    if kind == "odd":
        return ours(theta, 2 * 3)  # 3 pairs
    raise ValueError(kind)


def positions(tokens, capacity, seed):
    return np.random.default_rng(seed).choice(capacity, tokens, replace=False).astype(np.int64)


# (heads, hd): Pythia's head dims 64 / 128 (rotary 16 / 32) with odd head counts, Gemma 3's 256, and 24
# (rotary_pct 0.25: 3 pairs, no 16-byte vector fits)
ROPE_SHAPES = [(3, 64), (5, 128), (1, 256), (7, 24)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads,hd", ROPE_SHAPES)
@pytest.mark.parametrize("kind", ["quarter", "llama3", "odd"])
@pytest.mark.parametrize("seq", [1, 33])
def test_rope_table_matches_reference(device, dtype, heads, hd, kind, seq):
    inv = table(kind, hd)
    x, xr = rand((seq, heads, hd), dtype, device, seed=seq + hd)
    p = np.random.default_rng(seq).integers(0, 20000, seq)
    pos = llaisys.tensor(p, device)
    out = poisoned((seq, heads, hd), dtype, device)
    ops.rope(out, x, pos, inv.tolist())
    want = ref_rope_table(xr, p, inv)
    assert_close(out, want, dtype)
    np.testing.assert_array_equal(to_f64(out)[..., 2 * len(inv):], xr[..., 2 * len(inv):])  # moved, not computed
    # in place, and through the functional form
    ops.rope(x, x, pos, inv.tolist())
    np.testing.assert_array_equal(bits(x), bits(out))
    if device == "cuda":  # the CPU kernel on the same inputs
        cpu = llaisys.functional.rope(llaisys.tensor(xr.astype(NP_DTYPE[dtype])), pos.to("cpu"), inv_freq=inv)
        assert_close(out, to_f64(cpu), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rope_table_strided_views(device, dtype):
    """x and out as head slices of wider rows (any seq/head strides), and an out with a strided last dim."""
    T, heads, hd = 9, 3, 64
    inv = table("quarter", hd)
    buf, bufr = rand((T, heads + 2, hd), dtype, device, seed=5)
    x, xr = buf.slice(1, 1, heads + 1), bufr[:, 1: heads + 1]
    p = np.arange(T) * 7
    pos = llaisys.tensor(p.astype(np.int32), device)
    want = ref_rope_table(xr, p, inv)
    wide = poisoned((T, heads, 2 * hd), dtype, device)
    ops.rope(wide.slice(2, 0, hd), x, pos, inv.tolist())
    assert_close(to_f64(wide)[..., :hd], want, dtype)
    assert np.isnan(to_f64(wide)[..., hd:]).all(), "wrote outside the out view"
    out_t = poisoned((hd, heads, T), dtype, device).permute(2, 1, 0)
    ops.rope(out_t, x, pos, inv.tolist())
    assert_close(out_t, want, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("theta", [1e4, 1e6])
def test_theta_overloads_equal_the_table_bit_for_bit(device, dtype, hd, theta):
    T, nh, nkvh, capacity = 17, 3, 1, 40
    x, _ = rand((T, nh, hd), dtype, device, seed=1)
    p = positions(T, capacity, seed=2)
    p[0] = 32000 % capacity
    pos = llaisys.tensor(p, device)
    inv = ops.rope_inv_freq(theta, hd)
    a, b = poisoned((T, nh, hd), dtype, device), poisoned((T, nh, hd), dtype, device)
    ops.rope(a, x, pos, theta)
    ops.rope(b, x, pos, inv)
    np.testing.assert_array_equal(bits(a), bits(b))
    qkv, _ = rand((T, (nh + 2 * nkvh) * hd), dtype, device, seed=3)
    outs = []
    for arg in (theta, inv):
        q = poisoned((T, nh, hd), dtype, device)
        k, _ = rand((capacity, nkvh, hd), dtype, device, seed=4)
        v, _ = rand((capacity, nkvh, hd), dtype, device, seed=5)
        ops.rope_qkv_cache(q, k, v, qkv, pos, arg)
        outs.append((q, k, v))
    for name, x1, x2 in zip("qkv", *outs):
        np.testing.assert_array_equal(bits(x1), bits(x2), err_msg=name)


def qkv_expected(qkvr, kr, vr, p, rows, nh, nkvh, hd, inv):
    x = qkvr.reshape(len(p), nh + 2 * nkvh, hd)
    k_want, v_want = kr.copy(), vr.copy()
    k_want[rows] = ref_rope_table(x[:, nh: nh + nkvh], p, inv)
    v_want[rows] = x[:, nh + nkvh:]
    return ref_rope_table(x[:, :nh], p, inv), k_want, v_want


# (nh, nkvh, hd): Pythia-160m (12 heads of 64, no GQA), odd counts with GQA, Gemma 3 (4 x 1 x 256), 3 pairs
QKV_SHAPES = [(12, 12, 64), (5, 1, 128), (4, 1, 256), (3, 3, 24)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("nh,nkvh,hd", QKV_SHAPES)
@pytest.mark.parametrize("kind", ["quarter", "llama3", "odd"])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_rope_qkv_cache_table_matches_reference(device, dtype, nh, nkvh, hd, kind, tokens):
    inv = table(kind, hd, theta=1e4)
    num_blocks, bs = 9, 5
    capacity = num_blocks * bs
    qkv, qkvr = rand((tokens, (nh + 2 * nkvh) * hd), dtype, device, seed=tokens)
    k, kr = rand((capacity, nkvh, hd), dtype, device, seed=tokens + 1)
    v, vr = rand((capacity, nkvh, hd), dtype, device, seed=tokens + 2)
    p = np.random.default_rng(tokens).integers(0, 5000, tokens)
    s = positions(tokens, capacity, seed=tokens + 3)  # cache rows of a paged cache, apart from the positions
    q = poisoned((tokens, nh, hd), dtype, device)
    ops.rope_qkv_cache(q, k, v, qkv, llaisys.tensor(p, device), inv.tolist(), llaisys.tensor(s.astype(np.int32), device))
    q_want, k_want, v_want = qkv_expected(qkvr, kr, vr, p, s, nh, nkvh, hd, inv)
    assert_close(q, q_want, dtype)
    assert_close(k, k_want, dtype)
    np.testing.assert_array_equal(to_f64(v), v_want)
    r2 = 2 * len(inv)
    np.testing.assert_array_equal(to_f64(q)[..., r2:], q_want[..., r2:])  # the untouched dims are moved exactly
    np.testing.assert_array_equal(to_f64(k)[s][..., r2:], k_want[s][..., r2:])
    untouched = np.setdiff1d(np.arange(capacity), s)
    np.testing.assert_array_equal(to_f64(k)[untouched], kr[untouched])
    # equals rope + rope + index_copy with the same table, bit for bit
    q1, k1 = poisoned((tokens, nh, hd), dtype, device), poisoned((tokens, nkvh, hd), dtype, device)
    pos = llaisys.tensor(p, device)
    width = lambda lo, hi: qkv.slice(1, lo * hd, hi * hd).view(tokens, hi - lo, hd)  # noqa: E731
    ops.rope(q1, width(0, nh), pos, inv.tolist())
    ops.rope(k1, width(nh, nh + nkvh), pos, inv.tolist())
    np.testing.assert_array_equal(bits(q1), bits(q))
    np.testing.assert_array_equal(bits(k1), bits(k)[s])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("hd", [64, 128])
def test_rope_qkv_cache_table_q_in_place(device, dtype, hd):
    """q_out is qkv's own q part: its first 2r dims turn, the rest stay as they were (not rewritten)."""
    nh, nkvh, tokens, capacity = 3, 3, 6, 16
    inv = table("quarter", hd)
    qkv, qkvr = rand((tokens, (nh + 2 * nkvh) * hd), dtype, device, seed=8)
    k, kr = rand((capacity, nkvh, hd), dtype, device, seed=9)
    v, vr = rand((capacity, nkvh, hd), dtype, device, seed=10)
    p = positions(tokens, capacity, seed=11)
    ops.rope_qkv_cache(qkv.slice(1, 0, nh * hd).view(tokens, nh, hd), k, v, qkv, llaisys.tensor(p, device),
                       inv.tolist())
    q_want, k_want, v_want = qkv_expected(qkvr, kr, vr, p, p, nh, nkvh, hd, inv)
    got = to_f64(qkv)
    assert_close(got[:, : nh * hd], q_want.reshape(tokens, -1), dtype)
    np.testing.assert_array_equal(got[:, nh * hd:], qkvr[:, nh * hd:])
    assert_close(k, k_want, dtype)
    np.testing.assert_array_equal(to_f64(v), v_want)


def test_table_errors():
    x, _ = rand((3, 2, 8))
    pos = llaisys.tensor(np.arange(3))
    out = poisoned((3, 2, 8))
    with pytest.raises(ValueError, match=r"rope: inv_freq must have 1 \.\. head_dim / 2 = 4 entries, got 5"):
        ops.rope(out, x, pos, [1.0] * 5)
    with pytest.raises(ValueError, match=r"rope: inv_freq must have 1 \.\. head_dim / 2 = 4 entries, got 0"):
        ops.rope(out, x, pos, [])
    with pytest.raises(ValueError, match=r"rope: inv_freq\[1\] must be finite, got nan"):
        ops.rope(out, x, pos, [1.0, float("nan")])
    assert np.isnan(to_f64(out)).all()
    qkv, _ = rand((3, 4 * 8))
    k, _ = rand((8, 1, 8))
    with pytest.raises(ValueError, match=r"rope_qkv_cache: inv_freq must have 1 \.\. head_dim / 2 = 4 entries, got 5"):
        ops.rope_qkv_cache(poisoned((3, 2, 8)), k, k.clone(), qkv, pos, [1.0] * 5)
    # an odd head_dim is fine with a table (the last dim passes through)
    x7, x7r = rand((3, 2, 7))
    out7 = poisoned((3, 2, 7))
    ops.rope(out7, x7, pos, [0.5, 0.25])
    assert_close(out7, ref_rope_table(x7r, np.arange(3), np.array([0.5, 0.25], np.float32)), "f32")


@pytest.mark.cuda
def test_cuda_table_head_dim_limit():
    x, _ = rand((1, 1, 1026), "f32", "cuda")
    with pytest.raises(ValueError, match="rope: head_dim 1026 is not supported on CUDA"):
        ops.rope(poisoned((1, 1, 1026), "f32", "cuda"), x, llaisys.tensor(np.arange(1), "cuda"), [1.0])
