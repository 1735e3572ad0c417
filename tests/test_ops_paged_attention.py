"""paged_attention: causal GQA attention of a batch of sequences over a paged KV cache, against a NumPy
float64 reference that gathers each sequence's keys through its block table and applies the causal rule.

Covers block sizes 1, 5, 16, 32 (and 256 on CUDA), partial last blocks, shuffled block ids, table
entries past a sequence's length holding garbage, prefix hits and chunked prefill (kv_len > qlen > 1),
pure decode batches of mixed lengths, sequences without queries, rows outside every sequence (left as
they were), GQA ratios 1, 2, 6 and 7, head dims 19, 32, 64, 128 and 256, strided q and out, NaN in every
cache row no sequence may read, NaN-poisoned outputs and the argument checks; sliding windows (decode,
prefill, chunked prefill, windows smaller and larger than a block, keys and table entries before every
window unread). On CUDA the same cases plus
long split-KV decodes, large batches, an over-sized max_q_len and the device-side error flag.
"""
import numpy as np
import pytest

import llaisys
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, assert_close, bits, poisoned, to_f64

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)

# (nh, nkvh, hd): Qwen2-0.5B (GQA 7), Qwen2-1.5B (GQA 6, hd 128), no GQA with an odd head dim, GQA 2.
HEADS = [(14, 2, 64), (12, 2, 128), (4, 4, 19), (4, 2, 32)]
HEAD_IDS = [f"{nh}x{nkvh}x{hd}" for nh, nkvh, hd in HEADS]


def visible_mask(qlen, kv, window=0):
    """[qlen, kv]: query i (at position p = kv - qlen + i) sees key j iff j <= p, and with a window also
    j > p - window (HF's sliding_window_causal_mask_function; test_window_rule_is_hfs checks the two agree)."""
    p = np.arange(qlen)[:, None] + (kv - qlen)
    j = np.arange(kv)[None, :]
    return (j <= p) & ((j > p - window) if window > 0 else True)


def first_seen_key(qlen, kv, window):
    """The first key any query of a sequence sees (keys before it are read by none)."""
    return max(0, kv - qlen - window + 1) if window > 0 else 0


def reference(q, kc, vc, tables, q_start, kv_len, scale, out0, window=0):
    """float64: q [T, nh, hd], caches [num_blocks, bs, nkvh, hd], out0 [T, nh, hd] the output before the op
    (rows of no sequence keep it). Key j of sequence b is cache row tables[b, j // bs] * bs + j % bs; keys
    a sequence's queries cannot see are never gathered (their table entries may be garbage)."""
    _, bs, nkvh, hd = kc.shape
    nh = q.shape[1]
    group = nh // nkvh
    rows_k, rows_v = kc.reshape(-1, nkvh, hd), vc.reshape(-1, nkvh, hd)
    out = out0.copy()
    for b in range(len(kv_len)):
        qs, qe, kv = q_start[b], q_start[b + 1], kv_len[b]
        qlen = qe - qs
        if qlen == 0:
            continue
        j0 = first_seen_key(qlen, kv, window)
        j = np.arange(j0, kv)
        slots = tables[b, j // bs].astype(np.int64) * bs + j % bs
        k = np.repeat(rows_k[slots], group, axis=1)  # head h reads kv head h // group
        v = np.repeat(rows_v[slots], group, axis=1)
        s = np.einsum("qhd,khd->hqk", q[qs:qe], k) * scale
        visible = visible_mask(qlen, kv, window)[:, j0:]
        s = np.where(visible[None], s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[qs:qe] = np.einsum("hqk,khd->qhd", p, v)
    return out


class Batch:
    """A paged batch: random q, caches whose rows no sequence may read are NaN (unused blocks and the tail
    of each last block, and with a window the keys before every query's window), block ids shuffled over the
    pool, table entries past a sequence's blocks (and before its first seen block) garbage."""

    def __init__(self, qlens, kvlens, block_size, heads, dtype, device, seed=0, extra_rows=0, q_layout="dense",
                 window=0):
        nh, nkvh, hd = heads
        rng = np.random.default_rng(seed)
        B, bs = len(qlens), block_size
        need = [-(-kv // bs) for kv in kvlens]
        max_blocks = max(need + [1]) + 1  # one spare column: always past every length
        num_blocks = sum(need) + 3
        ids = rng.permutation(num_blocks)
        self.tables = rng.integers(-(10 ** 6), 10 ** 6, (B, max_blocks)).astype(np.int32)  # garbage past lengths
        used, at = np.zeros(num_blocks * bs, bool), 0
        for b, n in enumerate(need):
            self.tables[b, :n] = ids[at: at + n]
            at += n
            j = np.arange(first_seen_key(qlens[b], kvlens[b], window), kvlens[b])
            used[self.tables[b, j // bs].astype(np.int64) * bs + j % bs] = True
            if len(j):  # blocks before the first one read: the op must not look them up
                self.tables[b, : j[0] // bs] = rng.integers(-(10 ** 6), 10 ** 6, j[0] // bs)
        self.q_start = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
        self.kv_len = np.asarray(kvlens, np.int32)
        T = int(self.q_start[-1]) + extra_rows
        np_dt = NP_DTYPE[dtype]

        def draw(shape):
            return rng.standard_normal(shape).astype(np_dt)

        kc, vc = draw((num_blocks, bs, nkvh, hd)), draw((num_blocks, bs, nkvh, hd))
        for c in (kc, vc):
            c.reshape(num_blocks * bs, nkvh, hd)[~used] = np.nan
        q = draw((T, nh, hd))
        self.ref_q, self.ref_k, self.ref_v = (a.astype(np.float64) for a in (q, kc, vc))
        if q_layout == "dense":
            self.q = llaisys.tensor(q, device)
        else:  # rows of a wider buffer, as q inside a fused QKV row
            wide = np.zeros((T, nh + 3, hd), np_dt)
            wide[:, 1: nh + 1] = q
            self.q = llaisys.tensor(wide, device).slice(1, 1, nh + 1)
        self.k, self.v = llaisys.tensor(kc, device), llaisys.tensor(vc, device)
        self.meta = [llaisys.tensor(a, device) for a in (self.tables, self.q_start, self.kv_len)]
        self.max_q_len = max(list(qlens) + [0])
        self.shape, self.dtype, self.device, self.window = (T, nh, hd), dtype, device, window

    def run(self, scale, max_q_len=None, out=None, window=None):
        out = poisoned(self.shape, self.dtype, self.device) if out is None else out
        llaisys.ops.paged_attention(out, self.q, self.k, self.v, *self.meta, scale,
                                    self.max_q_len if max_q_len is None else max_q_len,
                                    window=self.window if window is None else window)
        return out

    def expected(self, scale, out0=None):
        out0 = np.full(self.shape, np.nan) if out0 is None else out0
        return reference(self.ref_q, self.ref_k, self.ref_v, self.tables, self.q_start, self.kv_len, scale, out0,
                         self.window)


def check(batch, scale=None, max_q_len=None):
    scale = batch.shape[2] ** -0.5 if scale is None else scale
    out = batch.run(scale, max_q_len)
    assert_close(out, batch.expected(scale), batch.dtype)
    return out


# (qlens, kvlens): a mixed step (chunked prefill with a prefix hit, a decode, a sequence without queries,
# a fresh prefill), and one that ends exactly on a block boundary at every block size tested.
MIXED = [([3, 1, 0, 7], [40, 17, 9, 7]), ([5, 1], [160, 160])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
@pytest.mark.parametrize("lens", MIXED, ids=["mixed", "full-blocks"])
def test_paged_matches_reference(lens, block_size, heads, dtype, device):
    check(Batch(*lens, block_size, heads, dtype, device, seed=block_size))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads", [(14, 2, 64), (12, 2, 128)], ids=["0.5B", "1.5B"])
def test_decode_batch_of_mixed_lengths(heads, dtype, device):
    kvlens = np.random.default_rng(1).integers(1, 301, 33).tolist()
    kvlens[:3] = [1, 300, 16]  # a first token, the longest, one full block
    check(Batch([1] * 33, kvlens, 16, heads, dtype, device, seed=2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads", [(16, 2, 128), (8, 8, 64), (6, 2, 32), (5, 1, 128), (24, 2, 64), (16, 1, 128),
                                   (20, 1, 64)], ids=["g8", "g1", "hd32", "g5", "g12", "g16", "g20"])
def test_decode_steps_group_sizes_and_idle_sequences(heads, dtype, device):
    """Steps of one query per sequence (CUDA's decode kernels: in f32 lanes over the head dims for a GQA group
    of up to 8 rows; in 16-bit types and head dim 64/128 tensor cores for groups of up to 16 rows; larger
    groups take the split kernel): group sizes on both sides of those limits, sequences without a query in
    the step, lengths around the kernels' 8-, 16-, 32- and 64-key steps, and keys split over many chunks; the
    unused cache rows are NaN, so a masked key that reached a sum would show."""
    kvlens = [1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 0, 63, 64, 65, 129, 1000, 5]
    qlens = [1 if kv else 0 for kv in kvlens]
    qlens[7] = 0  # a sequence with keys but no query in this step
    check(Batch(qlens, kvlens, 16, heads, dtype, device, seed=11), max_q_len=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_decode_nan_key_reaches_its_head_group_only(dtype, device):
    """A NaN in one key read by a decode step makes the rows of that kv head's group NaN, nothing else."""
    b = Batch([1, 1], [70, 70], 8, (8, 2, 64), dtype, device, seed=12)
    k = b.ref_k.copy()
    slot = b.tables[1, 40 // 8] * 8 + 40 % 8
    k.reshape(-1, 2, 64)[slot, 0, 3] = np.nan
    b.k = llaisys.tensor(k.astype(NP_DTYPE[dtype]), device)
    b.ref_k = k
    out = to_f64(b.run(0.125))
    assert np.isnan(out[1, :4]).all() and not np.isnan(out[1, 4:]).any() and not np.isnan(out[0]).any()
    ok = b.expected(0.125)
    assert_close(out[0], ok[0], dtype)
    assert_close(out[1, 4:], ok[1, 4:], dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("qlens,kvlens", [([100], [100]), ([37, 64], [300, 64]), ([1, 70, 1, 19], [250, 90, 2, 19])],
                         ids=["prefill", "chunked+prefill", "decode+chunks"])
def test_prefill_and_chunks(qlens, kvlens, dtype, device):
    check(Batch(qlens, kvlens, 16, (14, 2, 64), dtype, device, seed=3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads", [(14, 2, 64), (12, 2, 128), (16, 16, 128)], ids=["0.5B", "1.5B", "mha"])
@pytest.mark.parametrize("block_size", [5, 16])
def test_long_prefill_over_many_tiles(heads, block_size, dtype, device):
    """Steps long enough for CUDA's tensor-core prefill (16+ queries, 16-bit, head dim 64 or 128): query
    blocks of 64 with a partial last one, keys over many 64-key tiles gathered through block tables whose
    blocks do not line up with the tiles, a chunk behind 200 cached keys, and a decode row and a row of no
    queries in the same step."""
    check(Batch([130, 16, 1, 0, 65], [130, 216, 77, 9, 300], block_size, heads, dtype, device, seed=11))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_strided_q_and_out_and_untouched_rows(dtype, device):
    """q rows inside wider rows; out with a row stride; rows past the last sequence stay as they were."""
    b = Batch([2, 0, 3], [9, 4, 30], 5, (4, 2, 32), dtype, device, seed=4, extra_rows=2, q_layout="strided")
    T, nh, hd = b.shape
    buf = poisoned((T, nh, 2 * hd), dtype, device)
    out = buf.slice(2, 0, hd)
    b.run(0.3, out=out)
    assert_close(to_f64(buf)[..., :hd], b.expected(0.3), dtype)
    assert np.isnan(to_f64(buf)[..., hd:]).all(), "wrote outside the out view"
    assert np.isnan(to_f64(buf)[-2:]).all(), "wrote rows of no sequence"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_scale_max_q_len_and_functional(dtype, device):
    b = Batch([4, 1], [23, 50], 16, (6, 3, 32), dtype, device, seed=5)
    for scale in (1.0, 0.02):
        check(b, scale)
    check(b, 0.2, max_q_len=9)  # an upper bound larger than any sequence's query count
    got = llaisys.functional.paged_attention(b.q, b.k, b.v, *b.meta, max_q_len=4)  # scale defaults to hd^-0.5
    assert_close(got, b.expected(32 ** -0.5), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_sequences_without_queries_write_nothing(device):
    b = Batch([0, 0], [5, 0], 4, (4, 2, 32), "f32", device, seed=6, extra_rows=3)
    out = b.run(0.5, max_q_len=0)
    assert np.isnan(to_f64(out)).all()
    out = b.run(0.5, max_q_len=4)
    assert np.isnan(to_f64(out)).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nan_in_a_read_key_reaches_its_rows_only(dtype, device):
    """A NaN in a key a query sees makes that query's row NaN (as the reference); earlier queries of the
    same sequence, which may not see it, and other sequences stay finite."""
    b = Batch([3, 1], [6, 6], 4, (4, 2, 32), dtype, device, seed=7)
    k = b.ref_k.copy()
    slot = b.tables[0, 5 // 4] * 4 + 5 % 4  # key 5 of sequence 0: only its last query (i = 2) sees it
    k.reshape(-1, 2, 32)[slot, 1, 0] = np.nan
    b.k = llaisys.tensor(k.astype(NP_DTYPE[dtype]), device)
    b.ref_k = k
    out = to_f64(b.run(0.25))
    assert np.isnan(out[2, 2:]).all() and not np.isnan(out[2, :2]).any()  # kv head 1 = heads 2, 3
    assert not np.isnan(out[:2]).any() and not np.isnan(out[3]).any()


# ---- head dim 256 (Gemma 3) ----

# Gemma-3-270M / 1B (4 query heads, 1 kv head) and Gemma-3-4B (8 / 4) in 16-bit types: the CUDA decode
# kernel with 8 dims a lane, the split kernel with 2 dims a thread; f32 rows of 1 KiB are CPU-only.
HD256 = [(4, 1, 256), (8, 4, 256)]
DEVICE_DTYPES_256 = [("cpu", "f32")] + [p for t in ("f16", "bf16")
                                        for p in (("cpu", t), pytest.param("cuda", t, marks=pytest.mark.cuda))]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES_256)
@pytest.mark.parametrize("heads", HD256, ids=["g4", "g2"])
@pytest.mark.parametrize("qlens,kvlens,block_size", [
    ([3, 1, 0, 7], [40, 17, 9, 7], 16), ([1] * 11, [1, 7, 8, 9, 31, 32, 33, 64, 65, 1000, 5], 16),
    ([1], [3000], 16), ([37, 64, 1], [300, 64, 250], 32)], ids=["mixed", "decode", "long-decode", "prefill+chunks"])
@pytest.mark.parametrize("window", [0, 512, 20])
def test_head_dim_256(qlens, kvlens, block_size, heads, window, dtype, device):
    """Gemma 3's head dim, with its 512-key window (and a short one), through every path: decode steps
    (lengths around the decode kernel's 8- and 32-key steps, split over many chunks), prefill, chunks."""
    check(Batch(qlens, kvlens, block_size, heads, dtype, device, seed=len(qlens) + window, window=window))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_cuda_head_dim_256_settled_history_same_bits(dtype):
    kvlens = [1, 7, 33, 300, 1000, 0, 65]
    b = Batch([1 if kv else 0 for kv in kvlens], kvlens, 16, (4, 1, 256), dtype, "cuda", seed=12)
    plain = b.run(0.0625)
    settled = poisoned(b.shape, dtype, "cuda")
    llaisys.ops.paged_attention(settled, b.q, b.k, b.v, *b.meta, 0.0625, 1, settled_history=True)
    np.testing.assert_array_equal(bits(settled), bits(plain))
    assert_close(plain, b.expected(0.0625), dtype)


# ---- sliding window ----


def test_window_rule_is_hfs():
    """The reference's mask is transformers' sliding_window_causal_mask_function (masking_utils) over the
    absolute positions of the step's queries."""
    torch = pytest.importorskip("torch")
    from transformers.masking_utils import sliding_window_causal_mask_function

    for qlen, kv, w in [(5, 5, 3), (4, 10, 1), (7, 20, 16), (1, 30, 4), (3, 6, 100), (9, 9, 9)]:
        q_idx, kv_idx = torch.arange(kv - qlen, kv)[:, None], torch.arange(kv)[None, :]
        hf = sliding_window_causal_mask_function(w)(0, 0, q_idx, kv_idx).numpy()
        np.testing.assert_array_equal(visible_mask(qlen, kv, w), hf)


# (qlens, kvlens): a decode batch of lengths around the windows and blocks; a fresh prefill; a chunked
# prefill with a prefix hit beside a decode, an idle sequence and a fresh prefill.
WINDOW_CASES = [([1] * 6, [1, 5, 16, 17, 40, 300]), ([40], [40]), ([7, 1, 0, 20], [60, 33, 9, 20])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads", [(14, 2, 64), (4, 4, 19)], ids=["0.5B", "odd-hd"])
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("window", [1, 3, 16, 37])  # smaller than a block, one block, over several
@pytest.mark.parametrize("lens", WINDOW_CASES, ids=["decode", "prefill", "chunked"])
def test_window_matches_reference(lens, window, block_size, heads, dtype, device):
    """Keys before a sequence's first window are NaN in the cache and their table entries garbage: a key
    outside a query's window that reached its sum, or a look-up of such a block, would show."""
    check(Batch(*lens, block_size, heads, dtype, device, seed=window + block_size, window=window))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("lens", WINDOW_CASES, ids=["decode", "prefill", "chunked"])
def test_window_at_least_kv_len_is_full_attention(lens, dtype, device):
    """A window >= every kv_len hides nothing: the full result (within the tolerance; the CUDA split may
    differ); a window >= max_blocks * block_size takes the full path itself: the same bits."""
    b = Batch(*lens, 16, (6, 2, 32), dtype, device, seed=21)
    full = b.run(0.2)
    assert_close(full, b.expected(0.2), dtype)
    for w in (max(lens[1]), max(lens[1]) + 7):
        assert_close(b.run(0.2, window=w), b.expected(0.2), dtype)
    capacity = b.tables.shape[1] * 16
    for w in (capacity, capacity + 1, 2 ** 40):
        np.testing.assert_array_equal(bits(b.run(0.2, window=w)), bits(full))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("qlens,kvlens,block_size,window", [
    ([1], [8200], 16, 512), ([1, 1, 1], [8200, 3, 1000], 256, 100), ([300, 1], [1000, 4000], 32, 129),
    ([1] * 64, None, 16, 64)], ids=["long-decode", "decode-bs256", "long-prefill", "batch64"])
def test_window_long(qlens, kvlens, block_size, window, dtype, device):
    """Long sequences under a window (CUDA: the split over the window's keys only, with the combine
    kernel's chunk range; many chunks, a 256-row block table, prefill of many query tiles)."""
    if kvlens is None:
        kvlens = np.random.default_rng(8).integers(1, 2049, len(qlens)).tolist()
    b = Batch(qlens, kvlens, block_size, (14, 2, 64), dtype, device, seed=9, window=window)
    check(b)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_cuda_window_settled_history_same_bits(dtype):
    kvlens = [1, 7, 33, 300, 1000, 0, 65]
    b = Batch([1 if kv else 0 for kv in kvlens], kvlens, 16, (8, 2, 64), dtype, "cuda", seed=12, window=40)
    plain = b.run(0.125)
    settled = poisoned(b.shape, dtype, "cuda")
    llaisys.ops.paged_attention(settled, b.q, b.k, b.v, *b.meta, 0.125, 1, settled_history=True, window=40)
    np.testing.assert_array_equal(bits(settled), bits(plain))
    assert_close(plain, b.expected(0.125), dtype)


def test_window_errors():
    args, _ = small()
    with pytest.raises(ValueError, match="paged_attention: window must be >= 0 \\(0 = full attention\\), got -1"):
        llaisys.ops.paged_attention(*args, 0.5, 2, window=-1)
    assert np.isnan(to_f64(args[0])).all()
    got = llaisys.functional.paged_attention(*args[1:], max_q_len=2, window=3)
    b = small()[1]
    b.window = 3
    assert_close(got, b.expected(8 ** -0.5), "f32")


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads", [(14, 2, 64), (12, 2, 128)], ids=["0.5B", "1.5B"])
@pytest.mark.parametrize("qlens,kvlens,block_size", [
    ([1], [8200], 16), ([1, 1, 1], [8200, 3, 1000], 256), ([1] * 256, None, 16), ([300, 1], [1000, 4000], 32)],
    ids=["long-decode", "decode-bs256", "batch256", "long-prefill"])
def test_cuda_large(qlens, kvlens, block_size, heads, dtype, device):
    """Split-KV with many chunks, a 256-row block table, a batch of 256, prefill of many query tiles; and
    the CUDA result equals the CPU op on the same inputs."""
    if kvlens is None:
        kvlens = np.random.default_rng(8).integers(1, 2049, len(qlens)).tolist()
    b = Batch(qlens, kvlens, block_size, heads, dtype, device, seed=9)
    out = check(b)
    cpu = poisoned(b.shape, dtype, "cpu")
    llaisys.ops.paged_attention(cpu, b.q.to("cpu"), b.k.to("cpu"), b.v.to("cpu"), *[m.to("cpu") for m in b.meta],
                                b.shape[2] ** -0.5, b.max_q_len)
    assert_close(out, to_f64(cpu), dtype)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("heads", [(14, 2, 64), (12, 2, 128), (16, 1, 128)], ids=["0.5B", "1.5B", "g16"])
@pytest.mark.parametrize("case", ["many-decodes", "few-long-decodes", "padded"])
def test_cuda_mixed_step_decodes_beside_prompt_chunks(case, heads, dtype, device):
    """A step of prompt chunks (fresh and after a prefix hit) beside decodes: the decodes run on the decode
    kernel in a launch of their own (one split a sequence, or with few of them several, whose partials are
    kept a sequence), the chunks on the tensor-core prefill; all rows equal the float64 reference and the
    CPU op."""
    rng = np.random.default_rng(len(case) + heads[0])
    if case == "many-decodes":  # 130 decodes of up to 2,048 keys around a 300-query chunk and a fresh prompt
        qlens = [1] * 64 + [300] + [1] * 66 + [40]
        kvlens = rng.integers(1, 2049, len(qlens)).tolist()
        kvlens[64], kvlens[-1] = 1000, 40
    elif case == "few-long-decodes":  # 2 decodes of many keys: the decode launch splits them
        qlens, kvlens = [1, 129, 1], [6000, 129, 3001]
    else:  # sequences without queries, chunks of under 64 and over 64 queries, a decode of one key
        qlens, kvlens = [0, 17, 1, 0, 65, 1], [30, 17, 1, 9, 200, 64]
    b = Batch(qlens, kvlens, 16, heads, dtype, device, seed=13)
    out = check(b)
    cpu = poisoned(b.shape, dtype, "cpu")
    llaisys.ops.paged_attention(cpu, b.q.to("cpu"), b.k.to("cpu"), b.v.to("cpu"), *[m.to("cpu") for m in b.meta],
                                b.shape[2] ** -0.5, b.max_q_len)
    assert_close(out, to_f64(cpu), dtype)


def write_newest_keys(b, kvlens, heads, dtype, seed):
    """New K/V rows for each sequence's newest key (kv_len - 1), written into the CUDA caches by index_copy (a
    kernel on the stream right before the attention, as rope_qkv_cache is in a step): (cache rows, the slots,
    new K, new V), for the caller to put into its float64 reference."""
    live = [i for i, kv in enumerate(kvlens) if kv]
    j = np.array([kvlens[i] - 1 for i in live])
    bs = b.ref_k.shape[1]
    slots = b.tables[live, j // bs].astype(np.int64) * bs + j % bs
    nkvh, hd = heads[1], heads[2]
    rng = np.random.default_rng(seed)
    new_k, new_v = (rng.standard_normal((len(live), nkvh * hd)).astype(NP_DTYPE[dtype]) for _ in range(2))
    rows = b.ref_k.shape[0] * bs
    idx = llaisys.tensor(slots, "cuda")
    llaisys.ops.index_copy(b.k.view(rows, nkvh * hd), idx, llaisys.tensor(new_k, "cuda"))
    llaisys.ops.index_copy(b.v.view(rows, nkvh * hd), idx, llaisys.tensor(new_v, "cuda"))
    return rows, slots, new_k, new_v


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("heads", [(14, 2, 64), (12, 2, 128)], ids=["0.5B", "1.5B"])
def test_cuda_mixed_step_settled_history_strided_and_untouched_rows(heads, dtype):
    """A mixed step as the model calls it (settled_history=True: the one-query launch reads the older keys
    before the kernel ahead ends): the bits of the default; q inside wider rows, out with a row stride, rows
    past the last sequence untouched; and the newest key of every sequence, written by a kernel launched just
    before the attention, is the one read (decodes split several ways: partials kept a sequence)."""
    qlens, kvlens = [1, 40, 1, 0, 130, 1], [300, 40, 5000, 9, 400, 1]
    b = Batch(qlens, kvlens, 16, heads, dtype, "cuda", seed=21, extra_rows=3, q_layout="strided")
    scale = heads[2] ** -0.5
    plain = b.run(scale)
    settled = poisoned(b.shape, dtype, "cuda")
    llaisys.ops.paged_attention(settled, b.q, b.k, b.v, *b.meta, scale, b.max_q_len, settled_history=True)
    np.testing.assert_array_equal(bits(settled), bits(plain))
    rows, slots, new_k, new_v = write_newest_keys(b, kvlens, heads, dtype, seed=22)
    nkvh, hd = heads[1], heads[2]
    T, nh, _ = b.shape
    buf = poisoned((T, nh, 2 * hd), dtype, "cuda")
    llaisys.ops.paged_attention(buf.slice(2, 0, hd), b.q, b.k, b.v, *b.meta, scale, b.max_q_len,
                                settled_history=True)
    for ref, new in ((b.ref_k, new_k), (b.ref_v, new_v)):
        ref.reshape(rows, nkvh, hd)[slots] = new.astype(np.float64).reshape(-1, nkvh, hd)
    assert_close(to_f64(buf)[..., :hd], b.expected(scale), dtype)
    assert np.isnan(to_f64(buf)[..., hd:]).all(), "wrote outside the out view"
    assert np.isnan(to_f64(buf)[-3:]).all(), "wrote rows of no sequence"


@pytest.mark.cuda
@pytest.mark.parametrize("q_start", [[0, 20, 19, 22], [0, 20, 21, 40], [-3, 20, 21, 22]],
                         ids=["falls", "past-tokens", "negative"])
def test_cuda_mixed_step_bad_q_start_raises_at_synchronize(q_start):
    """q_start that falls, passes the step's tokens or starts below 0, in a mixed step (the tensor-core
    prefill's tile search and the one-query launch): nothing out of bounds is read (run under
    compute-sanitizer to see it) and the next synchronize raises; the flag is cleared after."""
    b = Batch([20, 1, 1], [25, 7, 9], 4, (4, 2, 64), "bf16", "cuda", seed=10)
    out = poisoned(b.shape, "bf16", "cuda")
    llaisys.ops.paged_attention(out, b.q, b.k, b.v, b.meta[0], llaisys.tensor(np.array(q_start, np.int32), "cuda"),
                                b.meta[2], 0.125, 20)
    with pytest.raises(IndexError, match="paged_attention: "):
        llaisys.synchronize("cuda")
    llaisys.synchronize("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads", [(12, 2, 128), (14, 2, 64), (8, 8, 64)], ids=["1.5B", "0.5B", "g1"])
def test_cuda_settled_history_same_bits_and_sees_the_steps_own_keys(heads, dtype):
    """settled_history=True (a model's step: the decode kernel reads the metadata and the older keys before
    the kernel ahead of it ends) gives the bits of the default; and each sequence's newest key and value,
    written by a kernel (index_copy) launched just before the attention, are the ones it reads."""
    kvlens = [1, 7, 33, 300, 1000, 0, 65]
    b = Batch([1 if kv else 0 for kv in kvlens], kvlens, 16, heads, dtype, "cuda", seed=12)
    scale = heads[2] ** -0.5
    plain = b.run(scale)
    settled = poisoned(b.shape, dtype, "cuda")
    llaisys.ops.paged_attention(settled, b.q, b.k, b.v, *b.meta, scale, 1, settled_history=True)
    np.testing.assert_array_equal(settled.to("cpu").numpy().view(np.uint8), plain.to("cpu").numpy().view(np.uint8))
    # new newest rows, through a kernel on the same stream right before the attention
    rows, slots, new_k, new_v = write_newest_keys(b, kvlens, heads, dtype, seed=13)
    nkvh, hd = heads[1], heads[2]
    out = poisoned(b.shape, dtype, "cuda")
    llaisys.ops.paged_attention(out, b.q, b.k, b.v, *b.meta, scale, 1, settled_history=True)
    for ref, new in ((b.ref_k, new_k), (b.ref_v, new_v)):
        ref.reshape(rows, nkvh, hd)[slots] = new.astype(np.float64).reshape(-1, nkvh, hd)
    assert_close(out, b.expected(scale), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("qlens,kvlens,heads,dtype", [
    ([2, 1], [5, 7], (4, 2, 32), "f32"), ([1, 1], [5, 7], (4, 2, 32), "f32"),
    ([20, 1], [25, 7], (4, 2, 64), "bf16")], ids=["split-kernel", "decode-kernel", "mixed-tensor-cores"])
def test_cuda_bad_metadata_raises_at_synchronize(qlens, kvlens, heads, dtype):
    """kv_len < qlen and a block id out of range: the kernels clamp (nothing out of bounds is read) and
    the next synchronize raises; the flag is cleared after."""
    b = Batch(qlens, kvlens, 4, heads, dtype, "cuda", seed=10)
    for tables, kv_len in [(b.tables, np.array([0, kvlens[1]], np.int32)),
                           (np.where(np.arange(b.tables.shape[1]) == 0, 10 ** 6, b.tables).astype(np.int32),
                            b.kv_len)]:
        out = poisoned(b.shape, dtype, "cuda")
        llaisys.ops.paged_attention(out, b.q, b.k, b.v, llaisys.tensor(tables, "cuda"), b.meta[1],
                                    llaisys.tensor(kv_len, "cuda"), 0.5, max(qlens))
        with pytest.raises(IndexError, match="paged_attention: "):
            llaisys.synchronize("cuda")
        llaisys.synchronize("cuda")


# ---- argument checks ----

def small(device="cpu", dtype="f32"):
    """(out, q, k_cache, v_cache, block_tables, q_start, kv_len) of a valid two-sequence batch."""
    b = Batch([2, 1], [5, 7], 4, (4, 2, 8), dtype, device, seed=11)
    return [poisoned(b.shape, dtype, device), b.q, b.k, b.v, *b.meta], b


def call(args, scale=0.5, max_q_len=2):
    llaisys.ops.paged_attention(*args, scale, max_q_len)


def replaced(args, i, t):
    a = list(args)
    a[i] = t
    return a


def test_paged_attention_shape_and_dtype_errors():
    args, b = small()
    i32 = lambda a: llaisys.tensor(np.asarray(a, np.int32))  # noqa: E731
    f32 = lambda *s: llaisys.tensor(np.zeros(s, np.float32))  # noqa: E731
    cases = [
        (TypeError, "paged_attention: q must be f32, f16 or bf16, got i32", 1, llaisys.tensor(np.zeros((3, 4, 8), np.int32))),
        (TypeError, "paged_attention: k_cache must have dtype f32 like the other operands, got bf16", 2,
         small(dtype="bf16")[0][2]),
        (TypeError, "paged_attention: out must have dtype f32", 0, poisoned((3, 4, 8), "f16")),
        (TypeError, "paged_attention: q_start must be i32, got i64", 5, llaisys.tensor(np.array([0, 2, 3]))),
        (ValueError, "paged_attention: block_tables must be contiguous i32, got i64", 4,
         llaisys.tensor(b.tables.astype(np.int64))),
        (ValueError, "paged_attention: k_cache must be 4-D", 2, f32(8, 2, 8)),
        (ValueError, r"paged_attention: v_cache must have shape \[7, 4, 2, 8\], got \[7, 4, 2, 9\]", 3, f32(7, 4, 2, 9)),
        (ValueError, r"paged_attention: out must have shape \[3, 4, 8\], got \[2, 4, 8\]", 0, poisoned((2, 4, 8))),
        (ValueError, r"paged_attention: q_start must have shape \[3\], got \[2\]", 5, i32([0, 2])),
        (ValueError, r"paged_attention: kv_len must have shape \[2\], got \[3\]", 6, i32([5, 7, 1])),
        (ValueError, r"paged_attention: the number of query heads \(4\) must be a multiple of the number of kv heads "
                     r"\(3\)", 2, f32(6, 4, 3, 8)),
        (ValueError, "paged_attention: k_cache must have head dim 8 like q", 2, f32(6, 4, 2, 4)),
        (ValueError, "paged_attention: k_cache and v_cache must be contiguous", 2,
         llaisys.tensor(np.zeros((7, 4, 2, 16), np.float32)).slice(3, 0, 8)),
        (ValueError, "paged_attention: out must have a unit last stride", 0, poisoned((8, 4, 3)).permute(2, 1, 0)),
        (ValueError, "paged_attention: kv_len must be contiguous", 6, i32([5, 0, 7, 0]).view(2, 2).select(1, 0)),
    ]
    for exc, msg, i, t in cases:
        with pytest.raises(exc, match=msg):
            call(replaced(args, i, t))
    with pytest.raises(ValueError, match="paged_attention: max_q_len must be >= 0, got -1"):
        call(args, max_q_len=-1)
    assert np.isnan(to_f64(args[0])).all()  # nothing was written by any failed call


@pytest.mark.parametrize("what,exc,msg", [
    ("kv_len<qlen", IndexError, r"paged_attention: kv_len\[0\] = 1 is out of range \[2, 12\]"),
    ("kv_len>capacity", IndexError, r"paged_attention: kv_len\[1\] = 13 is out of range \[1, 12\]"),
    ("q_start", ValueError, r"paged_attention: sequence 1 has query rows \[2, 1\): q_start must be non-decreasing "
                            r"within \[0, 3\]"),
    ("max_q_len", ValueError, "paged_attention: sequence 0 has 2 queries, more than max_q_len = 1"),
    ("block_id", IndexError, r"paged_attention: block_tables\[1, 1\] = 7 is out of range \[0, 7\)"),
])
def test_paged_attention_metadata_errors_on_cpu(what, exc, msg):
    args, b = small()
    i32 = lambda a: llaisys.tensor(np.asarray(a, np.int32))  # noqa: E731
    max_q_len = 2
    if what == "kv_len<qlen":
        args[6] = i32([1, 7])
    elif what == "kv_len>capacity":
        args[6] = i32([5, 13])  # max_blocks (3) * block_size (4) = 12
    elif what == "q_start":
        args[5] = i32([0, 2, 1])
    elif what == "max_q_len":
        max_q_len = 1
    else:
        t = b.tables.copy()
        t[1, 1] = 7  # the pool has 7 blocks
        args[4] = i32(t)
    with pytest.raises(exc, match=msg):
        call(args, max_q_len=max_q_len)
    assert np.isnan(to_f64(args[0])).all()


@pytest.mark.cuda
def test_cuda_device_mismatch_and_head_dim_limit():
    args, _ = small(device="cuda")
    with pytest.raises(ValueError, match="paged_attention: all tensors must be on one device"):
        call(replaced(args, 6, args[6].to("cpu")))
    q = llaisys.tensor(np.zeros((3, 4, 160), np.float32), "cuda")
    kc = llaisys.tensor(np.zeros((6, 4, 2, 160), np.float32), "cuda")
    with pytest.raises(ValueError, match="paged_attention: head dim 160 in f32 is not supported on CUDA"):
        call([poisoned((3, 4, 160), "f32", "cuda"), q, kc, kc, *args[4:]])
    for hd, dtype in [(256, "f32"), (288, "bf16")]:  # rows over 512 bytes
        q = poisoned((3, 4, hd), dtype, "cuda")
        kc = poisoned((6, 4, 2, hd), dtype, "cuda")
        with pytest.raises(ValueError, match=f"paged_attention: head dim {hd} in {dtype} is not supported on CUDA"):
            call([poisoned((3, 4, hd), dtype, "cuda"), q, kc, kc, *args[4:]])


@pytest.mark.parametrize("heads", [(8, 1, 40), (8, 2, 256), (7, 1, 19)], ids=["g8-hd40", "g4-hd256", "g7-hd19"])
def test_cpu_query_heads_folded_together_same_bits_as_alone(heads):
    """The CPU folds 4 heads of one query together (each K/V line loaded once for them, GQA): every row's
    bits are those of the head alone, i.e. of the same caches repeated for each head (group 1)."""
    nh, nkvh, hd = heads
    batch = Batch([37, 64, 1], [300, 64, 250], 16, heads, "f32", "cpu", seed=nh + hd)
    grouped = batch.run(hd ** -0.5).numpy()
    kc, vc = (np.repeat(a.astype(np.float32), nh // nkvh, axis=2) for a in (batch.ref_k, batch.ref_v))
    alone = poisoned(batch.shape, "f32", "cpu")
    llaisys.ops.paged_attention(alone, batch.q, llaisys.tensor(kc), llaisys.tensor(vc), *batch.meta, hd ** -0.5,
                                batch.max_q_len)
    np.testing.assert_array_equal(bits(llaisys.tensor(grouped)), bits(alone))
