"""rope_qkv_cache: after the fused QKV projection, q_out = rope(q), k_cache[pos] = rope(k), v_cache[pos] = v
in one op. Against a float64 NumPy formula, and bit for bit against rope + index_copy on the same device."""
import numpy as np
import pytest

import llaisys
from llaisys import ops
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, assert_close, bits, poisoned, rand, to_f64

# (nh, nkvh, hd): Qwen2-0.5B, Qwen2-1.5B, Gemma 3 (head dim 256), odd heads and one pair
SHAPES = [(14, 2, 64), (12, 2, 128), (4, 1, 256), (3, 1, 2)]


def inv_freq_f32(theta, hd):
    """HF's ``1 / theta ** (arange(0, hd, 2).float() / hd)`` in f32, theta^e rounded once to f32."""
    e = np.arange(0, hd, 2).astype(np.float32) / np.float32(hd)
    return np.float32(1.0) / (np.float64(np.float32(theta)) ** e.astype(np.float64)).astype(np.float32)


def ref_rope(x, pos, theta):
    """x [T, heads, hd] float64, pos [T]. The angle is the f32 product float(pos) * inv_freq the op is
    specified to use (at large positions an f32 angle is up to ~3e-3 rad off a float64 one, which would
    measure angle rounding rather than the kernel); everything after the angle is float64."""
    h = x.shape[-1] // 2
    angle = (np.asarray(pos).astype(np.float32)[:, None] * inv_freq_f32(theta, x.shape[-1])[None, :]).astype(np.float64)
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]  # [T, 1, h]
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def positions(tokens, capacity, seed):
    """Distinct, unordered, with gaps (a prefix-cached chunk or scattered decode positions)."""
    return np.random.default_rng(seed).choice(capacity, tokens, replace=False).astype(np.int64)


def make_qkv(tokens, width, dtype, device, layout, seed):
    """qkv [T, width]: dense, or rows of a wider buffer starting one element in (row stride width + 3, not
    16-byte aligned: the scalar path on CUDA)."""
    if layout == "dense":
        return rand((tokens, width), dtype, device, seed=seed)
    buf, bufr = rand((tokens, width + 3), dtype, device, seed=seed)
    return buf.slice(1, 1, width + 1), bufr[:, 1: width + 1]


def make_caches(capacity, nkvh, hd, dtype, device, layout, seed):
    """k_cache, v_cache [capacity, nkvh, hd] pre-filled with random values (every row its own sentinel):
    two dense tensors, or k and v interleaved in one buffer [capacity, 2, nkvh, hd] (leading stride
    2 * nkvh * hd, each view one half of every row)."""
    if layout == "dense":
        (k, kr), (v, vr) = (rand((capacity, nkvh, hd), dtype, device, seed=seed + i) for i in (1, 2))
        return k, kr, v, vr
    buf, bufr = rand((capacity, 2, nkvh, hd), dtype, device, seed=seed + 1)
    return buf.select(1, 0), bufr[:, 0], buf.select(1, 1), bufr[:, 1]


def expected(qkvr, kr, vr, pos, nh, nkvh, hd, theta):
    """(q [T, nh, hd], k_cache, v_cache) in float64 after the op."""
    x = qkvr.reshape(len(pos), nh + 2 * nkvh, hd)
    k_want, v_want = kr.copy(), vr.copy()
    k_want[pos] = ref_rope(x[:, nh: nh + nkvh], pos, theta)
    v_want[pos] = x[:, nh + nkvh:]
    return ref_rope(x[:, :nh], pos, theta), k_want, v_want


def check_caches(k, v, k_want, v_want, kr, pos, dtype):
    k_got = to_f64(k)
    assert_close(k_got, k_want, dtype)
    untouched = np.ones(len(kr), bool)
    untouched[pos] = False
    np.testing.assert_array_equal(k_got[untouched], kr[untouched])  # only the target rows changed
    np.testing.assert_array_equal(to_f64(v), v_want)  # v is moved, not computed: exact everywhere


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("nh,nkvh,hd", SHAPES)
@pytest.mark.parametrize("tokens", [0, 1, 7, 33])
@pytest.mark.parametrize("layout", ["dense", "strided"])
def test_rope_qkv_cache_matches_reference(device, dtype, nh, nkvh, hd, tokens, layout):
    capacity, theta, width = tokens + 17, 1e6, (nh + 2 * nkvh) * hd
    qkv, qkvr = make_qkv(tokens, width, dtype, device, layout, seed=tokens)
    k, kr, v, vr = make_caches(capacity, nkvh, hd, dtype, device, layout, seed=tokens)
    p = positions(tokens, capacity, seed=tokens)
    q = poisoned((tokens, nh, hd), dtype, device)
    ops.rope_qkv_cache(q, k, v, qkv, llaisys.tensor(p, device), theta)
    q_want, k_want, v_want = expected(qkvr, kr, vr, p, nh, nkvh, hd, theta)
    assert_close(q, q_want, dtype)
    check_caches(k, v, k_want, v_want, kr, p, dtype)
    np.testing.assert_array_equal(to_f64(qkv), qkvr)  # the input is left alone


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("nh,nkvh,hd", SHAPES)
@pytest.mark.parametrize("ids,theta", [("i64", 1e6), ("i32", 1e4)])
def test_fused_equals_rope_and_index_copy_exactly(device, dtype, nh, nkvh, hd, ids, theta):
    tokens, capacity, width = 33, 8193, (nh + 2 * nkvh) * hd
    buf, _ = rand((tokens, width + 16), dtype, device, seed=11)  # wider rows, still 16-byte aligned
    qkv = buf.slice(1, 0, width)
    p = positions(tokens, capacity, seed=12)
    p[0] = capacity - 1  # position 8192: angles up to 8192 rad
    pos = llaisys.tensor(p.astype(NP_DTYPE[ids]), device)
    base = llaisys.zeros((capacity, nkvh, hd), dtype, device)  # untouched rows are checked in the test above

    def part(lo, hi, heads):  # a head range of qkv as [T, heads, hd]
        return qkv.slice(1, lo * hd, hi * hd).view(tokens, heads, hd)

    q1, k1 = poisoned((tokens, nh, hd), dtype, device), poisoned((tokens, nkvh, hd), dtype, device)
    k_cache1, v_cache1 = base.clone(), base.clone()
    ops.rope(q1, part(0, nh, nh), pos, theta)
    ops.rope(k1, part(nh, nh + nkvh, nkvh), pos, theta)
    ops.index_copy(k_cache1, pos, k1)
    ops.index_copy(v_cache1, pos, part(nh + nkvh, nh + 2 * nkvh, nkvh))

    q2, k_cache2, v_cache2 = poisoned((tokens, nh, hd), dtype, device), base.clone(), base.clone()
    ops.rope_qkv_cache(q2, k_cache2, v_cache2, qkv, pos, theta)
    for name, unfused, fused in [("q", q1, q2), ("k_cache", k_cache1, k_cache2), ("v_cache", v_cache1, v_cache2)]:
        a, b = bits(fused), bits(unfused)
        assert np.array_equal(a, b), f"{name}: {np.count_nonzero(a != b)} elements differ from rope + index_copy"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_q_out_in_place_and_strided(device, dtype):
    nh, nkvh, hd, tokens, capacity, theta = 14, 2, 64, 9, 40, 1e6
    width = (nh + 2 * nkvh) * hd
    p = positions(tokens, capacity, seed=21)
    pos = llaisys.tensor(p.astype(np.int32), device)
    k, kr, v, vr = make_caches(capacity, nkvh, hd, dtype, device, "dense", seed=22)
    qkv, qkvr = rand((tokens, width), dtype, device, seed=23)
    q_want, k_want, v_want = expected(qkvr, kr, vr, p, nh, nkvh, hd, theta)

    # q_out is qkv's own q part: q is turned in place, k and v in qkv stay as they were.
    ops.rope_qkv_cache(qkv.slice(1, 0, nh * hd).view(tokens, nh, hd), k, v, qkv, pos, theta)
    got = to_f64(qkv)
    assert_close(got[:, : nh * hd], q_want.reshape(tokens, -1), dtype)
    np.testing.assert_array_equal(got[:, nh * hd:], qkvr[:, nh * hd:])
    check_caches(k, v, k_want, v_want, kr, p, dtype)

    qkv, _ = rand((tokens, width), dtype, device, seed=23)
    buf = poisoned((tokens, nh, 2 * hd), dtype, device)  # head stride 2 * hd, dense last dim
    ops.rope_qkv_cache(buf.slice(2, 0, hd), k, v, qkv, pos, theta)
    assert_close(to_f64(buf)[..., :hd], q_want, dtype)
    assert np.isnan(to_f64(buf)[..., hd:]).all(), "wrote outside the q_out view"
    q_t = poisoned((hd, nh, tokens), dtype, device).permute(2, 1, 0)  # strided last dim: through a temporary
    ops.rope_qkv_cache(q_t, k, v, qkv, pos, theta)
    assert_close(q_t, q_want, dtype)
    check_caches(k, v, k_want, v_want, kr, p, dtype)


def small_args(tokens=3, nh=3, nkvh=1, hd=4, capacity=8, dtype="f32", device="cpu"):
    """(q_out, k_cache, v_cache, qkv, pos_ids) of consistent shapes for the error tests."""
    qkv, _ = rand((tokens, (nh + 2 * nkvh) * hd), dtype, device)
    k, _ = rand((capacity, nkvh, hd), dtype, device, seed=1)
    v, _ = rand((capacity, nkvh, hd), dtype, device, seed=2)
    return poisoned((tokens, nh, hd), dtype, device), k, v, qkv, llaisys.tensor(np.array([2, 0, 5][:tokens]), device)


@pytest.mark.parametrize("ids", ["i64", "i32"])
@pytest.mark.parametrize("bad", [8, -1])
def test_position_out_of_range_raises_and_writes_nothing(ids, bad):
    q, k, v, qkv, _ = small_args()
    k0, v0 = to_f64(k), to_f64(v)
    with pytest.raises(IndexError, match=rf"rope_qkv_cache: position {bad} at index 1 is out of range of the KV "
                                         r"cache \[0, 8\)"):
        ops.rope_qkv_cache(q, k, v, qkv, llaisys.tensor(np.array([2, bad, 5], NP_DTYPE[ids])), 1e4)
    assert np.isnan(to_f64(q)).all()
    np.testing.assert_array_equal(to_f64(k), k0)
    np.testing.assert_array_equal(to_f64(v), v0)


def test_rope_qkv_cache_errors():
    q, k, v, qkv, pos = small_args()
    op = ops.rope_qkv_cache
    with pytest.raises(ValueError, match=r"rope_qkv_cache: qkv's last dim must be \(nh \+ 2 \* nkvh\) \* head_dim = "
                                         r"\(3 \+ 2 \* 1\) \* 4 = 20, got 24"):
        op(q, k, v, rand((3, 24))[0], pos, 1e4)
    with pytest.raises(ValueError, match=r"rope_qkv_cache: q_out must have shape \[3, 3, 4\], got \[2, 3, 4\]"):
        op(poisoned((2, 3, 4)), k, v, qkv, pos, 1e4)
    with pytest.raises(ValueError, match=r"rope_qkv_cache: k_cache must have shape \[8, 1, 4\], got \[8, 1, 6\]"):
        op(q, rand((8, 1, 6))[0], v, qkv, pos, 1e4)
    with pytest.raises(ValueError, match=r"rope_qkv_cache: v_cache must have shape \[8, 1, 4\], got \[9, 1, 4\]"):
        op(q, k, rand((9, 1, 4))[0], qkv, pos, 1e4)
    with pytest.raises(ValueError, match=r"rope_qkv_cache: pos_ids must have shape \[3\], got \[4\]"):
        op(q, k, v, qkv, llaisys.tensor(np.arange(4)), 1e4)
    with pytest.raises(ValueError, match="rope_qkv_cache: qkv must be 2-D"):
        op(q, k, v, rand((3, 5, 4))[0], pos, 1e4)
    with pytest.raises(ValueError, match="rope_qkv_cache: k_cache must be 3-D"):
        op(q, rand((8, 4))[0], v, qkv, pos, 1e4)
    with pytest.raises(ValueError, match="rope_qkv_cache: head_dim must be even, got 3"):
        op(poisoned((3, 3, 3)), rand((8, 1, 3))[0], rand((8, 1, 3))[0], rand((3, 15))[0], pos, 1e4)
    for theta in [0.0, -1.0, float("nan"), float("inf")]:
        with pytest.raises(ValueError, match="rope_qkv_cache: theta must be finite and > 0"):
            op(q, k, v, qkv, pos, theta)
    with pytest.raises(TypeError, match="rope_qkv_cache: pos_ids must be i64 or i32, got f32"):
        op(q, k, v, qkv, llaisys.tensor(np.arange(3, dtype=np.float32)), 1e4)
    with pytest.raises(TypeError, match="rope_qkv_cache: k_cache must have dtype f32 like the other operands, got "
                                        "bf16"):
        op(q, rand((8, 1, 4), "bf16")[0], v, qkv, pos, 1e4)
    with pytest.raises(TypeError, match="rope_qkv_cache: q_out must have dtype f32"):
        op(poisoned((3, 3, 4), "f16"), k, v, qkv, pos, 1e4)
    with pytest.raises(TypeError, match="rope_qkv_cache: qkv must be f32, f16 or bf16, got i32"):
        op(poisoned((3, 3, 4), "i32"), k, v, llaisys.tensor(np.zeros((3, 20), np.int32)), pos, 1e4)
    k_t = rand((4, 1, 8))[0].permute(2, 1, 0)  # [8, 1, 4] with a strided last dim
    with pytest.raises(ValueError, match="rope_qkv_cache: k_cache and v_cache must have a contiguous last dim"):
        op(q, k_t, v, qkv, pos, 1e4)


@pytest.mark.cuda
@pytest.mark.parametrize("ids", ["i64", "i32"])
def test_cuda_position_out_of_range_raises_at_synchronize(ids):
    q, k, v, qkv, _ = small_args(device="cuda")
    k0, v0 = to_f64(k), to_f64(v)
    ops.rope_qkv_cache(q, k, v, qkv, llaisys.tensor(np.array([2, 8, 5], NP_DTYPE[ids]), "cuda"), 1e4)
    with pytest.raises(IndexError, match="rope_qkv_cache: a position is out of range of the KV cache"):
        llaisys.synchronize("cuda")
    llaisys.synchronize("cuda")  # the flag was cleared: the device stays usable
    # The bad token wrote nothing; the others are written (the kernel cannot stop them without a host sync).
    assert np.isnan(to_f64(q)[1]).all() and not np.isnan(to_f64(q)[[0, 2]]).any()
    k_got, v_got = to_f64(k), to_f64(v)
    rest = [r for r in range(8) if r not in (2, 5)]
    np.testing.assert_array_equal(k_got[rest], k0[rest])
    np.testing.assert_array_equal(v_got[rest], v0[rest])


@pytest.mark.cuda
def test_cuda_device_mismatch_and_head_dim_limit():
    q, k, v, qkv, _ = small_args(device="cuda")
    with pytest.raises(ValueError, match="rope_qkv_cache: all tensors must be on one device"):
        ops.rope_qkv_cache(q, k, v, qkv, llaisys.tensor(np.array([2, 0, 5])), 1e4)
    with pytest.raises(ValueError, match="rope_qkv_cache: head_dim 1026 is not supported on CUDA"):
        ops.rope_qkv_cache(*small_args(tokens=1, hd=1026, device="cuda"), 1e4)


# ---- slots: the cache rows of a paged cache, apart from the RoPE positions ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("nh,nkvh,hd", SHAPES)
@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("ids", [("i64", "i32"), ("i32", "i64")], ids=["pos64-slot32", "pos32-slot64"])
def test_slots_equal_rope_and_index_copy_at_the_slot_rows(device, dtype, nh, nkvh, hd, tokens, ids):
    """k_cache viewed as [num_blocks * block_size, nkvh, hd]: token t's rotated key lands in row slots[t]
    (turned by pos_ids[t], which may exceed the capacity); bit for bit rope + index_copy at those rows, and
    every other row untouched."""
    num_blocks, block_size, theta, width = 9, 5, 1e6, (nh + 2 * nkvh) * hd
    capacity = num_blocks * block_size
    qkv, _ = rand((tokens, width), dtype, device, seed=31 + tokens)
    p = np.random.default_rng(tokens).integers(0, 3 * capacity, tokens)  # positions need not fit the cache
    s = positions(tokens, capacity, seed=32 + tokens)  # distinct rows, scattered over shuffled blocks
    pos, slots = (llaisys.tensor(a.astype(NP_DTYPE[i]), device) for a, i in zip((p, s), ids))
    base, _ = rand((num_blocks, block_size, nkvh, hd), dtype, device, seed=33)  # every row its own sentinel

    def part(lo, hi, heads):  # a head range of qkv as [T, heads, hd]
        return qkv.slice(1, lo * hd, hi * hd).view(tokens, heads, hd)

    q1, k1 = poisoned((tokens, nh, hd), dtype, device), poisoned((tokens, nkvh, hd), dtype, device)
    k_cache1, v_cache1 = (base.clone().view(capacity, nkvh, hd) for _ in range(2))
    ops.rope(q1, part(0, nh, nh), pos, theta)
    ops.rope(k1, part(nh, nh + nkvh, nkvh), pos, theta)
    ops.index_copy(k_cache1, slots, k1)
    ops.index_copy(v_cache1, slots, part(nh + nkvh, nh + 2 * nkvh, nkvh))

    q2, paged_k, paged_v = poisoned((tokens, nh, hd), dtype, device), base.clone(), base.clone()
    ops.rope_qkv_cache(q2, paged_k.view(capacity, nkvh, hd), paged_v.view(capacity, nkvh, hd), qkv, pos, theta,
                       slots)
    for name, unfused, fused in [("q", q1, q2), ("k_cache", k_cache1, paged_k), ("v_cache", v_cache1, paged_v)]:
        a, b = bits(fused).reshape(-1), bits(unfused).reshape(-1)
        assert np.array_equal(a, b), f"{name}: {np.count_nonzero(a != b)} elements differ from rope + index_copy"
    untouched = np.setdiff1d(np.arange(capacity), s)
    np.testing.assert_array_equal(bits(paged_k).reshape(capacity, -1)[untouched],
                                  bits(base).reshape(capacity, -1)[untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_slots_reference_and_functional_default(device):
    """Against the float64 formula (q and k turned by the positions, rows from the slots); slots=None is the
    old behaviour (rows = positions)."""
    nh, nkvh, hd, tokens, capacity, theta = 4, 2, 8, 5, 20, 1e4
    qkv, qkvr = rand((tokens, (nh + 2 * nkvh) * hd), "f32", device, seed=41)
    k, kr, v, vr = make_caches(capacity, nkvh, hd, "f32", device, "dense", seed=42)
    p, s = np.array([100, 3, 7, 250, 0]), positions(tokens, capacity, seed=43)
    q = poisoned((tokens, nh, hd), "f32", device)
    ops.rope_qkv_cache(q, k, v, qkv, llaisys.tensor(p, device), theta, slots=llaisys.tensor(s, device))
    x = qkvr.reshape(tokens, nh + 2 * nkvh, hd)
    k_want, v_want = kr.copy(), vr.copy()
    k_want[s] = ref_rope(x[:, nh: nh + nkvh], p, theta)
    v_want[s] = x[:, nh + nkvh:]
    assert_close(q, ref_rope(x[:, :nh], p, theta), "f32")
    check_caches(k, v, k_want, v_want, kr, s, "f32")
    p_small = np.array([1, 3, 7, 2, 0])
    ops.rope_qkv_cache(q, k, v, qkv, llaisys.tensor(p_small, device), theta, slots=None)
    k_want[p_small] = ref_rope(x[:, nh: nh + nkvh], p_small, theta)
    assert_close(to_f64(k)[p_small], k_want[p_small], "f32")


def test_slots_errors():
    q, k, v, qkv, pos = small_args()
    k0 = to_f64(k)
    with pytest.raises(IndexError, match=r"rope_qkv_cache: slot 8 at index 2 is out of range of the KV cache \[0, 8\)"):
        ops.rope_qkv_cache(q, k, v, qkv, pos, 1e4, llaisys.tensor(np.array([1, 0, 8])))
    np.testing.assert_array_equal(to_f64(k), k0)  # nothing written
    with pytest.raises(ValueError, match=r"rope_qkv_cache: slots must have shape \[3\], got \[2\]"):
        ops.rope_qkv_cache(q, k, v, qkv, pos, 1e4, llaisys.tensor(np.array([1, 0])))
    with pytest.raises(TypeError, match="rope_qkv_cache: slots must be i64 or i32, got f32"):
        ops.rope_qkv_cache(q, k, v, qkv, pos, 1e4, llaisys.tensor(np.zeros(3, np.float32)))
    # positions beyond the cache are fine when the rows come from slots
    ops.rope_qkv_cache(q, k, v, qkv, llaisys.tensor(np.array([80, 90, 100])), 1e4, llaisys.tensor(np.array([1, 0, 7])))


@pytest.mark.cuda
def test_cuda_slot_out_of_range_raises_at_synchronize():
    q, k, v, qkv, pos = small_args(device="cuda")
    ops.rope_qkv_cache(q, k, v, qkv, pos, 1e4, llaisys.tensor(np.array([1, -1, 3], np.int32), "cuda"))
    with pytest.raises(IndexError, match="rope_qkv_cache: a position is out of range of the KV cache"):
        llaisys.synchronize("cuda")
    llaisys.synchronize("cuda")
    assert np.isnan(to_f64(q)[1]).all() and not np.isnan(to_f64(q)[[0, 2]]).any()
    with pytest.raises(ValueError, match="rope_qkv_cache: all tensors must be on one device"):
        ops.rope_qkv_cache(q, k, v, qkv, pos, 1e4, llaisys.tensor(np.array([1, 0, 3])))


# ---- q_norm / k_norm: Qwen3 / Gemma 3 q/k RMSNorm in the same launch ----

# (nh, nkvh, hd): Gemma 3 1B, Qwen3, hd > 64 but not a multiple of 32, hd <= 64, one pair, odd hd (partial only)
NORM_SHAPES = [(4, 1, 256), (16, 8, 128), (2, 1, 80), (3, 2, 48), (3, 1, 2), (3, 2, 5)]


def norm_args(nh, nkvh, hd, tokens, dtype, device, layout, rotary, seed):
    """(qkv twins of one layout, q_norm, k_norm, table): two equal qkv tensors laid out alike (CUDA's
    summation order depends on the alignment, so the reference must see the same one), weights around 1,
    and theta 1e6 or a partial table (rotary dims 2 * (hd // 4), odd hd allowed)."""
    width = (nh + 2 * nkvh) * hd
    twins = []
    for _ in range(2):
        if layout == "aligned":  # rows 16-byte aligned, row stride width + 16
            buf, bufr = rand((tokens, width + 16), dtype, device, seed=seed, scale=3.0)
            twins.append((buf.slice(1, 0, width), bufr[:, :width]))
        else:  # one element in, row stride width + 3: the unvectorised paths on CUDA
            buf, bufr = rand((tokens, width + 3), dtype, device, seed=seed, scale=3.0)
            twins.append((buf.slice(1, 1, width + 1), bufr[:, 1: width + 1]))
    rng = np.random.default_rng(seed + 1)
    wq, wk = (rng.uniform(0.5, 1.5, hd).astype(NP_DTYPE[dtype]) for _ in range(2))
    table = 1e6 if rotary == "full" else ops.rope_inv_freq(1e6, 2 * max(1, hd // 4))
    return twins, (llaisys.tensor(wq, device), wq.astype(np.float64)), (llaisys.tensor(wk, device),
                                                                          wk.astype(np.float64)), table


def table_f64(table, hd):
    return inv_freq_f32(table, hd) if not isinstance(table, list) else np.asarray(table, np.float32)


def ref_rope_table(x, pos, inv):
    """ref_rope with an explicit (possibly partial) f32 table: the first 2r dims turn, the rest pass."""
    r = len(inv)
    angle = (np.asarray(pos).astype(np.float32)[:, None] * inv[None, :]).astype(np.float64)
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = x[..., :r], x[..., r: 2 * r]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * r:]], axis=-1)


# (nh, nkvh, hd, rotary): every shape with a partial table, and with the theta overload's full one where hd is
# even (that overload takes no odd head_dim)
NORM_CASES = [(nh, nkvh, hd, rotary) for nh, nkvh, hd in NORM_SHAPES for rotary in ("full", "partial")
              if not (hd % 2 and rotary == "full")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("nh,nkvh,hd,rotary", NORM_CASES)
@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("layout", ["aligned", "unaligned"])
@pytest.mark.parametrize("paged", [False, True])
def test_qk_norm_equals_rms_norm_then_rope_qkv_cache_exactly(device, dtype, nh, nkvh, hd, rotary, tokens, layout,
                                                             paged):
    eps, capacity = 1e-6, 40
    twins, (wq, _), (wk, _), table = norm_args(nh, nkvh, hd, tokens, dtype, device, layout, rotary, seed=hd + tokens)
    (qkv1, _), (qkv2, _) = twins
    p = positions(tokens, capacity, seed=tokens)
    pos = llaisys.tensor(p, device)
    slots = llaisys.tensor(positions(tokens, capacity, seed=tokens + 5).astype(np.int32), device) if paged else None
    base, _ = rand((capacity, nkvh, hd), dtype, device, seed=3)

    heads = qkv1.view(tokens, nh + 2 * nkvh, hd)
    qh, kh = heads.slice(1, 0, nh), heads.slice(1, nh, nh + nkvh)
    ops.rms_norm(qh, qh, wq, eps)
    ops.rms_norm(kh, kh, wk, eps)
    q1, k1, v1 = poisoned((tokens, nh, hd), dtype, device), base.clone(), base.clone()
    ops.rope_qkv_cache(q1, k1, v1, qkv1, pos, table, slots)

    q2, k2, v2 = poisoned((tokens, nh, hd), dtype, device), base.clone(), base.clone()
    ops.rope_qkv_cache(q2, k2, v2, qkv2, pos, table, slots, q_norm=wq, k_norm=wk, eps=eps)
    for name, unfused, fused in [("q", q1, q2), ("k_cache", k1, k2), ("v_cache", v1, v2)]:
        a, b = bits(fused), bits(unfused)
        assert np.array_equal(a, b), f"{name}: {np.count_nonzero(a != b)} elements differ from rms_norm + rope_qkv_cache"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("nh,nkvh,hd", [(4, 1, 256), (3, 2, 5)])
def test_qk_norm_matches_reference_and_leaves_k_and_v_in_qkv(device, dtype, nh, nkvh, hd):
    """Against float64 rms_norm then RoPE; q_out is qkv's own q part (in place): qkv's k and v heads stay."""
    tokens, capacity, eps = 7, 20, 1e-6
    twins, (wq, wqr), (wk, wkr), table = norm_args(nh, nkvh, hd, tokens, dtype, device, "aligned", "partial", seed=51)
    qkv, qkvr = twins[0]
    k, kr, v, vr = make_caches(capacity, nkvh, hd, dtype, device, "dense", seed=52)
    p = positions(tokens, capacity, seed=53)
    ops.rope_qkv_cache(qkv.slice(1, 0, nh * hd).view(tokens, nh, hd), k, v, qkv, llaisys.tensor(p, device), table,
                       q_norm=wq, k_norm=wk, eps=eps)
    x = qkvr.reshape(tokens, nh + 2 * nkvh, hd)

    def normed(h, w):
        return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * w

    inv = table_f64(table, hd)
    k_want, v_want = kr.copy(), vr.copy()
    k_want[p] = ref_rope_table(normed(x[:, nh: nh + nkvh], wkr), p, inv)
    v_want[p] = x[:, nh + nkvh:]
    got = to_f64(qkv)
    # bf16's rounding of the normed head before the rotation, then of the result: two roundings' worth
    assert_close(got[:, : nh * hd], ref_rope_table(normed(x[:, :nh], wqr), p, inv).reshape(tokens, -1), dtype)
    np.testing.assert_array_equal(got[:, nh * hd:], qkvr[:, nh * hd:])
    check_caches(k, v, k_want, v_want, kr, p, dtype)


def test_qk_norm_errors():
    q, k, v, qkv, pos = small_args()
    w = rand((4,))[0]
    op = ops.rope_qkv_cache
    with pytest.raises(ValueError, match="rope_qkv_cache: q_norm and k_norm must be given together"):
        op(q, k, v, qkv, pos, 1e4, q_norm=w, eps=1e-6)
    with pytest.raises(ValueError, match="rope_qkv_cache: q_norm and k_norm must be given together"):
        op(q, k, v, qkv, pos, [1.0], k_norm=w, eps=1e-6)
    with pytest.raises(ValueError, match=r"rope_qkv_cache: k_norm must have shape \[4\], got \[5\]"):
        op(q, k, v, qkv, pos, 1e4, q_norm=w, k_norm=rand((5,))[0], eps=1e-6)
    with pytest.raises(ValueError, match=r"rope_qkv_cache: q_norm must have shape \[4\], got \[1, 4\]"):
        op(q, k, v, qkv, pos, [1.0], q_norm=rand((1, 4))[0], k_norm=w, eps=1e-6)
    with pytest.raises(TypeError, match="rope_qkv_cache: q_norm must have dtype f32 like the other operands, got bf16"):
        op(q, k, v, qkv, pos, 1e4, q_norm=rand((4,), "bf16")[0], k_norm=w, eps=1e-6)
    for eps in [-1e-6, float("nan"), float("inf")]:
        with pytest.raises(ValueError, match="rope_qkv_cache: eps must be finite and >= 0"):
            op(q, k, v, qkv, pos, 1e4, q_norm=w, k_norm=w, eps=eps)
    with pytest.raises(TypeError):  # keyword-only: slots is the last positional argument
        op(q, k, v, qkv, pos, 1e4, None, w, w, 1e-6)
    # nothing was written by a refused call
    assert np.isnan(to_f64(q)).all()


@pytest.mark.cuda
def test_cuda_qk_norm_device_mismatch():
    q, k, v, qkv, pos = small_args(device="cuda")
    w = rand((4,), device="cuda")[0]
    with pytest.raises(ValueError, match="rope_qkv_cache: all tensors must be on one device"):
        ops.rope_qkv_cache(q, k, v, qkv, pos, 1e4, q_norm=rand((4,))[0], k_norm=w, eps=1e-6)
