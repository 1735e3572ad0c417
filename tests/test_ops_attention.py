"""self_attention: causal GQA attention against a NumPy float64 masked-softmax reference.

Covers prefill (qlen == kvlen), decode (qlen == 1, short and long contexts), chunked prefill with a
causal offset (qlen < kvlen), the head layouts of Qwen2 models and odd ones, every float dtype, the
scale argument, strided q, k/v as slices of a larger NaN-filled KV cache, NaN propagation, and the
argument checks. On CUDA the same references apply, plus CUDA-vs-CPU on identical inputs (which
exercises the tensor-core prefill, the SIMT fallback and the split-KV decode kernels), and decode's
key chunking at many lengths and capacities.
"""
import numpy as np
import pytest

import llaisys
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, assert_close, needs_caching_allocator, poisoned, rand, to_f64

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)

# (nh, nkvh, hd): Qwen2-0.5B, Qwen2-1.5B, an odd head dim without GQA, a small GQA group.
HEADS = [(14, 2, 64), (12, 2, 128), (4, 4, 19), (6, 3, 32)]
HEAD_IDS = [f"{nh}x{nkvh}x{hd}" for nh, nkvh, hd in HEADS]
# (qlen, kvlen): prefill, decode, chunked prefill with a causal offset of 92.
SHAPES = [(1, 1), (19, 19), (111, 111), (1, 19), (1, 111), (19, 111)]


def reference(q, k, v, scale):
    """float64 attention: q [qlen, nh, hd], k [kvlen, nkvh, hd], v [kvlen, nkvh, hd_v] -> [qlen, nh, hd_v]."""
    qlen, nh, _ = q.shape
    kvlen, nkvh, _ = k.shape
    group = nh // nkvh
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # head h reads kv head h // group
    s = np.einsum("qhd,khd->hqk", q, kk) * scale
    visible = np.arange(kvlen)[None, :] <= np.arange(qlen)[:, None] + (kvlen - qlen)
    s = np.where(visible[None], s, -np.inf)
    with np.errstate(invalid="ignore"):  # NaN/Inf inputs must come out as NaN, as they do here
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, vv)


def make_inputs(qlen, kvlen, nh, nkvh, hd, dtype, device, hd_v=None, seed=0):
    hd_v = hd if hd_v is None else hd_v
    q, rq = rand((qlen, nh, hd), dtype, device, seed=seed)
    k, rk = rand((kvlen, nkvh, hd), dtype, device, seed=seed + 1)
    v, rv = rand((kvlen, nkvh, hd_v), dtype, device, seed=seed + 2)
    return (q, k, v), (rq, rk, rv)


def run(q, k, v, scale, dtype, device):
    out = poisoned((q.shape[0], q.shape[1], v.shape[2]), dtype, device)
    llaisys.ops.self_attention(out, q, k, v, scale)
    return out


def check_against_cpu(out, q, k, v, scale, dtype):
    """A CUDA result must match the CPU op on the very same inputs (same tolerance as the reference)."""
    cpu = [t.to("cpu") for t in (q, k, v)]
    ref = run(*cpu, scale, dtype, "cpu")
    assert_close(out, to_f64(ref), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("qlen,kvlen", SHAPES)
def test_attention_matches_reference(qlen, kvlen, heads, dtype, device):
    nh, nkvh, hd = heads
    (q, k, v), (rq, rk, rv) = make_inputs(qlen, kvlen, nh, nkvh, hd, dtype, device)
    scale = hd ** -0.5
    out = run(q, k, v, scale, dtype, device)
    assert_close(out, reference(rq, rk, rv, scale), dtype)
    if device != "cpu":
        check_against_cpu(out, q, k, v, scale, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kvlen", [989, 4096])
def test_long_decode(kvlen, dtype, device):
    nh, nkvh, hd = 14, 2, 64
    (q, k, v), (rq, rk, rv) = make_inputs(1, kvlen, nh, nkvh, hd, dtype, device, seed=3)
    out = run(q, k, v, 0.125, dtype, device)
    assert_close(out, reference(rq, rk, rv, 0.125), dtype)
    if device != "cpu":
        check_against_cpu(out, q, k, v, 0.125, dtype)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("qlen,kvlen", [(300, 300), (989, 989), (100, 1000), (4, 989), (3, 257), (2, 4096)])
def test_cuda_larger_shapes(qlen, kvlen, heads, dtype, device):
    """Many query/key tiles, ragged tails, split-KV chunks (some fully masked for early queries)."""
    nh, nkvh, hd = heads
    (q, k, v), (rq, rk, rv) = make_inputs(qlen, kvlen, nh, nkvh, hd, dtype, device, seed=5)
    scale = hd ** -0.5
    out = run(q, k, v, scale, dtype, device)
    assert_close(out, reference(rq, rk, rv, scale), dtype)
    check_against_cpu(out, q, k, v, scale, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.3, 0.02])
def test_scale_argument(scale, dtype, device):
    (q, k, v), (rq, rk, rv) = make_inputs(19, 40, 6, 3, 32, dtype, device, seed=7)
    out = run(q, k, v, scale, dtype, device)
    assert_close(out, reference(rq, rk, rv, scale), dtype)
    # the functional form defaults to 1/sqrt(hd)
    assert_close(llaisys.functional.self_attention(q, k, v), reference(rq, rk, rv, 32 ** -0.5), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_value_head_dim_differs(dtype, device):
    (q, k, v), (rq, rk, rv) = make_inputs(19, 23, 4, 2, 32, dtype, device, hd_v=48, seed=8)
    out = run(q, k, v, 0.2, dtype, device)
    assert_close(out, reference(rq, rk, rv, 0.2), dtype)


def kv_caches(kvlen, max_seq, nkvh, hd, dtype, device, seed):
    """K/V caches [max_seq, nkvh, hd] whose rows past kvlen hold NaN (they must never be read), and the
    float64 values of their first kvlen rows."""
    rng = np.random.default_rng(seed)
    caches, refs = [], []
    for _ in range(2):
        a = rng.standard_normal((max_seq, nkvh, hd))
        a[kvlen:] = np.nan
        a = a.astype(NP_DTYPE[dtype])
        caches.append(llaisys.tensor(a, device))
        refs.append(a[:kvlen].astype(np.float64))
    return caches, refs


def kv_cache_slices(kvlen, max_seq, nkvh, hd, dtype, device, seed):
    """k, v = cache[0:kvlen] of NaN-padded caches (see kv_caches)."""
    caches, refs = kv_caches(kvlen, max_seq, nkvh, hd, dtype, device, seed)
    return [c.slice(0, 0, kvlen) for c in caches], refs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads", [(14, 2, 64), (12, 2, 128), (6, 3, 32)], ids=["14x2x64", "12x2x128", "6x3x32"])
@pytest.mark.parametrize("qlen,kvlen", [(1, 37), (19, 111), (70, 70)])
def test_strided_q_and_kv_cache_slices(qlen, kvlen, heads, dtype, device):
    nh, nkvh, hd = heads
    (k, v), (rk, rv) = kv_cache_slices(kvlen, kvlen + 50, nkvh, hd, dtype, device, seed=11)
    # q as the first nh heads of a fused [qlen, nh + 2 * nkvh, hd] projection: row stride != nh * hd
    qkv, rqkv = rand((qlen, nh + 2 * nkvh, hd), dtype, device, seed=12)
    q, rq = qkv.slice(1, 0, nh), rqkv[:, :nh]
    assert qlen == 1 or not q.is_contiguous()
    scale = hd ** -0.5
    ref = reference(rq, rk, rv, scale)
    assert_close(run(q, k, v, scale, dtype, device), ref, dtype)
    # q stored head-major [nh, qlen, hd] and viewed as [qlen, nh, hd]
    qt = q.contiguous().permute(1, 0, 2).contiguous().permute(1, 0, 2)
    assert qlen == 1 or qt.strides == (hd, qlen * hd, 1)
    assert_close(run(qt, k, v, scale, dtype, device), ref, dtype)
    # a last dim that is not contiguous (taken through a copy)
    qd = q.contiguous().permute(2, 0, 1).contiguous().permute(1, 2, 0)
    assert qd.strides[-1] != 1
    assert_close(run(qd, k, v, scale, dtype, device), ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_non_contiguous_output(dtype, device):
    (q, k, v), (rq, rk, rv) = make_inputs(19, 30, 4, 2, 32, dtype, device, seed=13)
    out = poisoned((4, 19, 32), dtype, device).permute(1, 0, 2)
    llaisys.ops.self_attention(out, q, k, v, 0.25)
    assert_close(out, reference(rq, rk, rv, 0.25), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("qlen,kvlen,heads", [(1, 300, (14, 2, 64)), (70, 70, (12, 2, 128)), (19, 111, (4, 4, 19))])
def test_nan_propagates(qlen, kvlen, heads, dtype, device):
    """A NaN query poisons its own row only; a NaN in key 0 (seen by every query) poisons its kv group."""
    nh, nkvh, hd = heads
    (_, k, v), (rq, rk, rv) = make_inputs(qlen, kvlen, nh, nkvh, hd, dtype, device, seed=17)
    rq = rq.copy()
    rq[qlen - 1, 1, 3] = np.nan
    q = llaisys.tensor(rq.astype(NP_DTYPE[dtype]), device)
    out = to_f64(run(q, k, v, 0.1, dtype, device))
    ref = reference(rq, rk, rv, 0.1)
    assert np.isnan(out[qlen - 1, 1]).all() and np.isnan(ref[qlen - 1, 1]).all()
    assert_close(out, ref, dtype)
    rk = rk.copy()
    rk[0, 0, 0] = np.nan
    k = llaisys.tensor(rk.astype(NP_DTYPE[dtype]), device)
    out = to_f64(run(q, k, v, 0.1, dtype, device))
    group = nh // nkvh
    assert np.isnan(out[:, :group]).all()
    assert_close(out, reference(rq, rk, rv, 0.1), dtype)


CACHED_CASES = [(1, 1, (14, 2, 64)), (1, 989, (14, 2, 64)), (4, 300, (12, 2, 128)), (19, 111, (4, 4, 19)),
                (70, 200, (6, 3, 32)), (100, 333, (12, 2, 128))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("len_dtype", ["i64", "i32"])
@pytest.mark.parametrize("qlen,kvlen,heads", CACHED_CASES)
def test_cached_reads_the_length_from_memory(qlen, kvlen, heads, len_dtype, dtype, device):
    """self_attention_cached == self_attention on cache[:len], with len read from a tensor (on CUDA by the
    kernels, so the same launch serves any length: a captured graph stays valid)."""
    nh, nkvh, hd = heads
    cap = kvlen + 77
    (kc, vc), (rk, rv) = kv_caches(kvlen, cap, nkvh, hd, dtype, device, seed=31)
    q, rq = rand((qlen, nh, hd), dtype, device, seed=32)
    kv_len = llaisys.tensor(np.array([kvlen], NP_DTYPE[len_dtype]), device)
    scale = hd ** -0.5
    out = poisoned((qlen, nh, hd), dtype, device)
    llaisys.ops.self_attention_cached(out, q, kc, vc, kv_len, scale)
    assert_close(out, reference(rq, rk, rv, scale), dtype)
    # a shorter valid length, written into the same length tensor
    short = max(qlen, kvlen // 2)
    kv_len.copy_(llaisys.tensor(np.array([short], NP_DTYPE[len_dtype]), device))
    llaisys.ops.self_attention_cached(out, q, kc, vc, kv_len, scale)
    assert_close(out, reference(rq, rk[:short], rv[:short], scale), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("qlen,capacity", [(4, 16), (1, 300)])  # a chunk of queries; decode
def test_cuda_cached_length_out_of_range_raises_at_synchronize(qlen, capacity):
    (kc, vc), _ = kv_caches(10, capacity, 2, 64, "bf16", "cuda", seed=33)
    q, _ = rand((qlen, 14, 64), "bf16", "cuda", seed=34)
    out = llaisys.empty((qlen, 14, 64), "bf16", "cuda")
    for bad in (capacity + 1, qlen - 1):  # past the capacity; shorter than qlen
        kv_len = llaisys.tensor(np.array([bad], np.int64), "cuda")
        llaisys.ops.self_attention_cached(out, q, kc, vc, kv_len, 0.125)
        with pytest.raises(IndexError, match="self_attention_cached: kv_len out of range"):
            llaisys.synchronize("cuda")


# Decode (qlen == 1) on CUDA splits the keys into chunks planned for the capacity (a captured graph
# serves every length) and uses those the length read on the device covers, then merges the chunks.
# (nh, nkvh, hd): groups of 1, 6, 7, 8 and 8.
DECODE_HEADS = [(2, 2, 64), (12, 2, 128), (14, 2, 64), (16, 2, 128), (8, 1, 64)]
DECODE_HEAD_IDS = [f"{nh}x{nkvh}x{hd}" for nh, nkvh, hd in DECODE_HEADS]
# capacity -> lengths: one key, around the 32/64-key chunk steps, a ragged tail, the full cache.
DECODE_LENGTHS = {64: [1, 63, 64], 340: [1, 63, 64, 65, 257, 340], 4096: [1, 65, 257, 1000, 4095, 4096]}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads", DECODE_HEADS, ids=DECODE_HEAD_IDS)
@pytest.mark.parametrize("capacity", sorted(DECODE_LENGTHS))
def test_cuda_decode_lengths_and_capacities(capacity, heads, dtype):
    """Decode over a NaN-padded cache at many lengths: from the device (self_attention_cached) and from
    the host (self_attention on cache[:len])."""
    nh, nkvh, hd = heads
    q, rq = rand((1, nh, hd), dtype, "cuda", seed=41)
    scale = hd ** -0.5
    for n in DECODE_LENGTHS[capacity]:
        (kc, vc), (rk, rv) = kv_caches(n, capacity, nkvh, hd, dtype, "cuda", seed=42 + n)
        ref = reference(rq, rk, rv, scale)
        out = poisoned((1, nh, hd), dtype, "cuda")
        llaisys.ops.self_attention_cached(out, q, kc, vc, llaisys.tensor(np.array([n], np.int64), "cuda"), scale)
        assert_close(out, ref, dtype)
        assert_close(run(q, kc.slice(0, 0, n), vc.slice(0, 0, n), scale, dtype, "cuda"), ref, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_cuda_decode_back_to_back_lengths(dtype):
    """Calls queued back to back on one length tensor that changes in between, as in a replayed decode
    graph: every call's chunks and merge start afresh."""
    nh, nkvh, hd, cap = 14, 2, 64, 4096
    (kc, vc), (rk, rv) = kv_caches(cap, cap, nkvh, hd, dtype, "cuda", seed=43)
    q, rq = rand((1, nh, hd), dtype, "cuda", seed=44)
    kv_len = llaisys.tensor(np.array([1], np.int64), "cuda")
    outs = []
    for n in [4096, 257, 4096, 1, 1000, 64, 65]:
        kv_len.copy_(llaisys.tensor(np.array([n], np.int64), "cuda"))
        out = poisoned((1, nh, hd), dtype, "cuda")
        llaisys.ops.self_attention_cached(out, q, kc, vc, kv_len, 0.125)
        outs.append((n, out))
    for n, out in outs:
        assert_close(out, reference(rq, rk[:n], rv[:n], 0.125), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_cuda_decode_odd_shapes(dtype):
    """qlen == 1 with a group of 16, hd_v != hd, head dim 96, K rows that are not 16-byte aligned."""
    for nh, nkvh, hd, hd_v in [(16, 1, 64, 64), (4, 2, 64, 128), (4, 2, 96, 96)]:
        (q, k, v), (rq, rk, rv) = make_inputs(1, 300, nh, nkvh, hd, dtype, "cuda", hd_v=hd_v, seed=45)
        assert_close(run(q, k, v, 0.1, dtype, "cuda"), reference(rq, rk, rv, 0.1), dtype)
    big, rbig = rand((300 * 2 * 64 + 1,), dtype, "cuda", seed=46)
    k, rk = big.slice(0, 1, 300 * 2 * 64 + 1).view(300, 2, 64), rbig[1:].reshape(300, 2, 64)
    (q, _, v), (rq, _, rv) = make_inputs(1, 300, 14, 2, 64, dtype, "cuda", seed=47)
    assert_close(run(q, k, v, 0.125, dtype, "cuda"), reference(rq, rk, rv, 0.125), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kvlen", [40, 300])  # one chunk (16-bit types); several chunks merged
def test_cuda_decode_infinite_key(kvlen, dtype):
    """An infinite key element: heads whose score is +inf come out NaN (inf - inf), heads whose score is
    -inf ignore that key, as in the float64 formula."""
    (q, _, v), (rq, rk, rv) = make_inputs(1, kvlen, 14, 2, 64, dtype, "cuda", seed=50)
    rk = rk.copy()
    rk[kvlen // 2, 0, 0] = np.inf
    k = llaisys.tensor(rk.astype(NP_DTYPE[dtype]), "cuda")
    ref = reference(rq, rk, rv, 0.125)
    assert np.isnan(ref[0, :7]).any() and not np.isnan(ref[0, :7]).all()
    assert_close(run(q, k, v, 0.125, dtype, "cuda"), ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_queries_is_a_no_op(device):
    (q, k, v), _ = make_inputs(0, 5, 4, 2, 8, "f32", device)
    out = llaisys.empty((0, 4, 8), "f32", device)
    llaisys.ops.self_attention(out, q, k, v, 1.0)


def test_errors():
    z = lambda *shape, dtype="f32": llaisys.zeros(shape, dtype)  # noqa: E731
    att = llaisys.ops.self_attention
    with pytest.raises(ValueError, match="self_attention: the number of query heads \\(6\\) must be a multiple"):
        att(z(3, 6, 8), z(3, 6, 8), z(3, 4, 8), z(3, 4, 8), 1.0)
    with pytest.raises(ValueError, match="self_attention: k must have head dim 8"):
        att(z(3, 4, 8), z(3, 4, 8), z(3, 2, 16), z(3, 2, 8), 1.0)
    with pytest.raises(ValueError, match="self_attention: v must have shape \\[3, 2, hd_v\\]"):
        att(z(3, 4, 8), z(3, 4, 8), z(3, 2, 8), z(4, 2, 8), 1.0)
    with pytest.raises(ValueError, match="self_attention: qlen \\(4\\) must be <= kvlen \\(3\\)"):
        att(z(4, 4, 8), z(4, 4, 8), z(3, 2, 8), z(3, 2, 8), 1.0)
    with pytest.raises(ValueError, match="self_attention: kvlen must be >= 1"):
        att(z(0, 4, 8), z(0, 4, 8), z(0, 2, 8), z(0, 2, 8), 1.0)
    with pytest.raises(ValueError, match="self_attention: out must have shape \\[3, 4, 8\\]"):
        att(z(3, 4, 16), z(3, 4, 8), z(3, 2, 8), z(3, 2, 8), 1.0)
    with pytest.raises(ValueError, match="self_attention: q must be 3-D"):
        att(z(3, 4, 8), z(3, 32), z(3, 2, 8), z(3, 2, 8), 1.0)
    with pytest.raises(TypeError, match="self_attention: k must have dtype f32"):
        att(z(3, 4, 8), z(3, 4, 8), z(3, 2, 8, dtype="bf16"), z(3, 2, 8), 1.0)
    with pytest.raises(TypeError, match="self_attention: out must have dtype f32"):
        att(z(3, 4, 8, dtype="f16"), z(3, 4, 8), z(3, 2, 8), z(3, 2, 8), 1.0)
    with pytest.raises(TypeError, match="self_attention: q must be f32, f16 or bf16"):
        att(z(3, 4, 8, dtype="i64"), z(3, 4, 8, dtype="i64"), z(3, 2, 8, dtype="i64"), z(3, 2, 8, dtype="i64"), 1.0)


@pytest.mark.cuda
def test_cuda_device_mismatch():
    (q, k, v), _ = make_inputs(3, 3, 4, 2, 8, "f32", "cuda")
    out = llaisys.empty((3, 4, 8), "f32", "cuda")
    with pytest.raises(ValueError, match="self_attention: all tensors must be on one device"):
        llaisys.ops.self_attention(out, q, k.to("cpu"), v, 1.0)


@pytest.mark.cuda
def test_cuda_head_dim_limit():
    (q, k, v), _ = make_inputs(2, 2, 2, 1, 300, "f32", "cuda")
    out = llaisys.empty((2, 2, 300), "f32", "cuda")
    with pytest.raises(ValueError, match="self_attention: head dim 300 .* at most 256 on CUDA"):
        llaisys.ops.self_attention(out, q, k, v, 1.0)


@pytest.mark.cuda
def test_cuda_misaligned_views_take_the_fallback():
    """Tensor-core kernels need 16-byte aligned rows; a view starting one element in must still work."""
    for dtype in ("bf16", "f16"):
        big, rbig = rand((40 * 2 * 64 + 1,), dtype, "cuda", seed=21)
        k = big.slice(0, 1, 40 * 2 * 64 + 1).view(40, 2, 64)
        (q, _, v), (rq, _, rv) = make_inputs(40, 40, 14, 2, 64, dtype, "cuda", seed=22)
        rk = rbig[1:].reshape(40, 2, 64)
        assert_close(run(q, k, v, 0.125, dtype, "cuda"), reference(rq, rk, rv, 0.125), dtype)


@pytest.mark.cuda
@needs_caching_allocator
def test_cuda_is_stream_ordered_and_needs_no_device_malloc():
    dev = "cuda:0"
    (q, k, v), (rq, rk, rv) = make_inputs(1, 4096, 14, 2, 64, "bf16", dev, seed=23)
    out = poisoned((1, 14, 64), "bf16", dev)
    llaisys.ops.self_attention(out, q, k, v, 0.125)  # warms the caching allocator (split-KV scratch)
    llaisys.synchronize(dev)
    mallocs = llaisys.memory_stats(dev)["device_mallocs"]
    for _ in range(20):
        llaisys.ops.self_attention(out, q, k, v, 0.125)
    llaisys.synchronize(dev)
    assert llaisys.memory_stats(dev)["device_mallocs"] == mallocs
    assert_close(out, reference(rq, rk, rv, 0.125), "bf16")

