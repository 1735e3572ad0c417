"""argmax, sample and repetition_penalty against NumPy float64 formulas.

sample is checked statistically: a chi-square test on a small vocabulary with a known softmax shows
the draws follow the filtered, renormalised distribution, and filtered-out tokens are never drawn.
"""
import numpy as np
import pytest

import llaisys
from llaisys import ops
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, TOL, assert_close, poisoned, rand, to_f64

V_LLM = 151936  # Qwen2's vocabulary


def vec(values, dtype, device):
    return llaisys.tensor(np.asarray(values, NP_DTYPE[dtype]), device)


# ---------------------------------------------------------------------------------------------- argmax


def run_argmax(x, device):
    lead = list(x.shape[:-1])
    idx, val = poisoned(lead, "i64", device), poisoned(lead, x.dtype, device)
    ops.argmax(idx, val, x)
    return idx.to("cpu").numpy(), to_f64(val)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("V", [1, 19, 64, V_LLM])
def test_argmax_matches_numpy(device, dtype, V):
    x, x64 = rand((3, V), dtype, device, seed=V)
    idx, val = run_argmax(x, device)
    np.testing.assert_array_equal(idx, np.argmax(x64, axis=-1))  # bf16 ties: numpy also takes the first
    np.testing.assert_array_equal(val, np.max(x64, axis=-1))


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_f16_batched_3d(device):
    x, x64 = rand((2, 3, 111), "f16", device, seed=4)
    idx, val = run_argmax(x, device)
    assert idx.shape == (2, 3) and val.shape == (2, 3)
    np.testing.assert_array_equal(idx, np.argmax(x64, axis=-1))
    np.testing.assert_array_equal(val, np.max(x64, axis=-1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_argmax_ties_take_the_first_index(device, dtype):
    a = np.zeros((4, 989))
    a[0, [7, 500, 988]] = 3.0  # ties far apart: different threads on CUDA
    a[1, :] = -1.0  # all equal
    a[2, [988, 987]] = 2.0
    a[3, [0, 988]] = 5.0
    x = vec(a, dtype, device)
    idx, val = run_argmax(x, device)
    np.testing.assert_array_equal(idx, [7, 0, 987, 0])
    np.testing.assert_array_equal(val, [3.0, -1.0, 2.0, 5.0])


def argmax_reference(a64):
    """ops.argmax in float64: NumPy's max and first maximum, index -1 where the max is not finite (a NaN, a
    +inf, or only -inf: no token to pick)."""
    m = np.max(a64, axis=-1)  # NaN if the row holds one
    return np.where(np.isfinite(m), np.argmax(a64, axis=-1), -1), m


def non_finite_rows(V):
    """Rows [n, V] (float64) and, per row, whether it has a finite maximum. NaN, +inf and -inf at the
    start, middle and end of the row; -inf next to finite values is a mask, not an error."""
    base = np.random.default_rng(V).standard_normal(V)
    mid, nan, inf = V // 2, np.nan, np.inf
    specs = [
        ({0: nan}, False), ({V - 1: nan}, False), ({mid: np.copysign(nan, -1.0)}, False),  # NaN, any sign
        ({mid: inf}, False), ({V - 1: inf, 0: nan}, False),  # +inf; +inf and NaN
        ({}, True), ({0: -inf, V - 1: -inf}, True),  # finite; finite with masked tokens
    ]
    rows = []
    for spec, _ in specs:
        row = base.copy()
        for i, v in spec.items():
            row[i] = v
        rows.append(row)
    rows.append(np.full(V, -inf))  # only -inf
    rows.append(np.full(V, nan))  # only NaN
    row = np.full(V, -inf)
    row[mid] = 2.5  # one finite value among -inf
    rows.append(row)
    return np.stack(rows), np.array([ok for _, ok in specs] + [False, False, True])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("V", [1000, 999])  # on CUDA: vector and scalar loads
def test_argmax_rows_without_a_finite_max_give_minus_one(device, dtype, V):
    a, finite = non_finite_rows(V)
    a = a.astype(NP_DTYPE[dtype]).astype(np.float64)
    idx, val = run_argmax(vec(a, dtype, device), device)
    ref_idx, ref_max = argmax_reference(a)
    np.testing.assert_array_equal(ref_idx >= 0, finite)  # the reference agrees with the table
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_array_equal(val, ref_max)  # NaN where NumPy's max is NaN


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_signed_zero_ties_take_the_first_index(device):
    """-0 and +0 are equal: the first of them wins wherever it sits (the CPU compares f32 rows 8 at a time,
    so before, inside and after a block of 8, and in the tail)."""
    a = np.full((4, 37), -1.0, dtype=np.float32)
    a[0, [3, 9]] = [-0.0, 0.0]
    a[1, [9, 3]] = [-0.0, 0.0]
    a[2, [17, 35]] = [0.0, -0.0]
    a[3, [33, 36]] = [-0.0, 0.0]
    idx, val = run_argmax(vec(a, "f32", device), device)
    np.testing.assert_array_equal(idx, [3, 3, 17, 33])
    np.testing.assert_array_equal(np.signbit(val), [True, False, False, True])


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_single_values(device):
    a = np.array([[np.nan], [np.inf], [-np.inf], [-3.0]])
    idx, val = run_argmax(vec(a, "f32", device), device)
    np.testing.assert_array_equal(idx, [-1, -1, -1, 0])
    np.testing.assert_array_equal(val, np.max(a, axis=-1))


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_non_contiguous_input_and_outputs(device):
    xt, xt64 = rand((19, 6), "f32", device, seed=5)
    x = xt.transpose(0, 1)  # [6, 19], strides (1, 6)
    big_idx, big_val = poisoned((6, 2), "i64", device), poisoned((6, 2), "f32", device)
    idx, val = big_idx.select(1, 1), big_val.select(1, 0)
    ops.argmax(idx, val, x)
    np.testing.assert_array_equal(idx.to("cpu").numpy(), np.argmax(xt64.T, axis=-1))
    np.testing.assert_array_equal(to_f64(val), np.max(xt64.T, axis=-1))
    assert (big_idx.to("cpu").numpy()[:, 0] == -7).all(), "wrote outside the max_idx view"


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_1d_gives_scalars(device):
    x, x64 = rand((989,), "f32", device, seed=6)
    idx, val = llaisys.functional.argmax(x)
    assert idx.shape == () and int(idx.to("cpu").numpy()) == np.argmax(x64)


def test_argmax_argument_errors():
    x, _ = rand((2, 5), "f32")
    with pytest.raises(TypeError, match="argmax: max_idx must be i64, got i32"):
        ops.argmax(llaisys.empty([2], "i32"), llaisys.empty([2], "f32"), x)
    with pytest.raises(TypeError, match="argmax: max_val must have dtype f32"):
        ops.argmax(llaisys.empty([2], "i64"), llaisys.empty([2], "bf16"), x)
    with pytest.raises(ValueError, match=r"argmax: max_idx must have shape \[2\], got \[3\]"):
        ops.argmax(llaisys.empty([3], "i64"), llaisys.empty([2], "f32"), x)
    with pytest.raises(ValueError, match="argmax: the last dim of x must be >= 1"):
        ops.argmax(llaisys.empty([2], "i64"), llaisys.empty([2], "f32"), llaisys.empty([2, 0], "f32"))
    with pytest.raises(TypeError, match="argmax: x must be f32, f16 or bf16"):
        ops.argmax(llaisys.empty([2], "i64"), llaisys.empty([2], "i64"), llaisys.empty([2, 5], "i64"))


# --------------------------------------------------------- argmax: long rows split over several CUDA blocks


def cdiv(a, b):
    return -(-a // b)


def argmax_split_chunk(V, itemsize, rows, sms=132):
    """Elements per block of the CUDA split path (mirrors argmax_parts in cpp/ops/argmax/cuda.cu with the
    132 SMs of an H100 SXM / H200), or None where one block reads the whole row. Only places test values
    at block boundaries: another SM count can move them, never the references (NumPy's argmax)."""
    nbytes = V * itemsize
    if nbytes <= 32 * 1024 or rows >= sms:
        return None
    parts = min(cdiv(nbytes, 8 * 1024), cdiv(2 * sms, rows))
    return cdiv(cdiv(V, parts), 8) * 8


def argmax_split_rows(V, c):
    """Rows [n, V] (float64) that stress how the per-block results combine; c: elements per block."""
    base = np.clip(np.random.default_rng(V).standard_normal(V), -4.0, 4.0)  # markers lie above it
    M, inf, nan, neg_nan = 8.0, np.inf, np.nan, np.copysign(np.nan, -1.0)
    specs = [
        {V - 1: M},  # last element: last block, last (partial) vector
        {0: M},  # first element
        {c: M},  # first element of the second block
        {2 * c - 1: M},  # last element of the second block
        {c - 1: M, c: M},  # tie across a boundary: the earlier block wins
        {5 * c + 3: M, 2 * c + 7: M, V - 1: M},  # ties in three blocks
        {V - 2: M, V - 1: M},  # tie at the end of the row
        {c + 1: M, 3 * c + 2: nan},  # a NaN after the max, in a later block: -1
        {c + 1: nan, 3 * c + 2: M},  # a NaN before the max, in an earlier block
        {c // 2: M, 4 * c: M, 3 * c: nan, 2 * c + 5: nan},  # two NaN in different blocks
        {c: inf, 3 * c: inf, V - 1: nan},  # +inf in two blocks, a NaN last
        {c: inf, 2 * c: neg_nan},  # a NaN with the sign bit set, after a +inf
        {2 * c + 1: inf},  # +inf alone: -1
        {c: -inf, V - 1: -inf},  # -inf next to finite values is a mask: the max still counts
    ]
    out = []
    for spec in specs:
        row = base.copy()
        for i, v in spec.items():
            row[i % V] = v  # short rows: positions wrap; the reference is still np.argmax
        out.append(row)
    out.append(np.full(V, -inf))  # all -inf: -1
    row = np.full(V, -inf)
    row[V - 1] = -3.0  # one finite value, last
    out.append(row)
    out.append(np.full(V, nan))  # all NaN: -1
    for first, second in [(-0.0, 0.0), (0.0, -0.0)]:  # -0.0 == +0.0: the first of them
        row = np.full(V, -inf)
        row[(2 * c) % V], row[(c + 1) % V] = second, first
        out.append(row)
    out.append(np.full(V, -1.0))  # all equal: index 0
    return np.stack(out)


def check_argmax_exact(a, device, offset=0):
    """argmax of a [rows, V] (already in the tested dtype) == argmax_reference; a finite max is x's element,
    bit for bit. offset > 0 puts the rows `offset` elements into their buffer (a misaligned view)."""
    rows, V = a.shape
    if offset:
        flat = np.concatenate([np.zeros(offset, a.dtype), a.ravel()])
        x = llaisys.tensor(flat, device).slice(0, offset, offset + rows * V).view(rows, V)
    else:
        x = llaisys.tensor(a, device)
    idx = poisoned((rows,), "i64", device)
    val = poisoned((rows,), {np.dtype(v): k for k, v in NP_DTYPE.items()}[a.dtype], device)
    ops.argmax(idx, val, x)
    ref, ref_max = argmax_reference(a.astype(np.float64))
    np.testing.assert_array_equal(idx.to("cpu").numpy(), ref)
    bits = np.uint32 if a.dtype.itemsize == 4 else np.uint16
    got = np.asarray(val.to("cpu").numpy())
    ok = ref >= 0
    np.testing.assert_array_equal(got[ok].view(bits), a[np.arange(rows)[ok], ref[ok]].view(bits))
    np.testing.assert_array_equal(got[~ok].astype(np.float64), ref_max[~ok])  # NaN, +inf or -inf


ARGMAX_SPLIT_CASES = [(dtype, V, rows, 0) for dtype in FLOAT_DTYPES for V in [151936, 151937, 40000, 1, 31]
                      for rows in [1, 3]]
ARGMAX_SPLIT_CASES += [(dtype, V, rows, 1) for dtype in FLOAT_DTYPES for V in [151936, 40000] for rows in [1, 3]]
# 64 rows: 5 blocks per row on a 132-SM H100, so chunks of V / 5 rounded up to 8 elements.
ARGMAX_SPLIT_CASES += [(dtype, V, 64, offset) for dtype in FLOAT_DTYPES
                       for V, offset in [(151936, 0), (151937, 0), (40000, 1)]]


# The CPU runs two cases only: they check the test itself; the split path is CUDA's.
@pytest.mark.parametrize("device,dtype,V,rows,offset",
                         [pytest.param("cuda", *c, marks=pytest.mark.cuda) for c in ARGMAX_SPLIT_CASES] +
                         [("cpu", "bf16", 151937, 3, 1), ("cpu", "f32", 31, 1, 0)])
def test_argmax_long_rows_follow_numpy(device, dtype, V, rows, offset):
    np_dtype = NP_DTYPE[dtype]
    a64 = rand((rows, V), dtype, seed=V + rows)[1]
    check_argmax_exact(a64.astype(np_dtype), device, offset)  # random rows (bf16 and f16 hold ties)
    c = argmax_split_chunk(V, np.dtype(np_dtype).itemsize, rows) or max(1, V // 7)
    special = argmax_split_rows(V, c).astype(np_dtype)
    special = np.concatenate([special, special[: (-len(special)) % rows]])  # whole groups of `rows`
    for g in range(0, len(special), rows):
        check_argmax_exact(special[g : g + rows], device, offset)


@pytest.mark.cuda
def test_argmax_cuda_many_long_rows():
    # rows >= SMs: one block per row again, over long rows.
    check_argmax_exact(rand((140, 40000), "bf16", seed=8)[1].astype(NP_DTYPE["bf16"]), "cuda")


# ---------------------------------------------------------------------------------------------- sample


def sample_ids(logits, device, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, offset=0):
    """ops.sample with per-row parameters (scalars are broadcast); returns the ids as a NumPy array."""
    B = logits.shape[0]

    def per_row(v, dtype):
        return vec(np.broadcast_to(np.asarray(v), (B,)), dtype, device)

    out = poisoned((B,), "i64", device)
    ops.sample(out, logits, per_row(temperature, "f32"), per_row(top_k, "i32"), per_row(top_p, "f32"),
               per_row(min_p, "f32"), seed, offset)
    return out.to("cpu").numpy()


def run_sample(logits, device, *args, **kwargs):
    """sample_ids for logits whose rows all have a finite maximum: every id is a token."""
    ids = sample_ids(logits, device, *args, **kwargs)
    assert ((ids >= 0) & (ids < logits.shape[1])).all(), f"ids out of range: {ids}"
    return ids


def kept_distribution(l, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """float64 reference: the filtered, renormalised sampling distribution over one row of logits."""
    w = np.exp((l - l.max()) / temperature)  # p_i / p_max
    keep = np.ones(len(l), bool)
    if min_p > 0:
        keep &= w >= min_p
    order = np.argsort(-w, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1:
        kept_order = order[keep[order]]
        cum = np.cumsum(w[kept_order]) / w[kept_order].sum()
        # keep away from a boundary that float32 rounding could move
        assert np.min(np.abs(cum - top_p)) > 1e-4, "test distribution too close to the top_p boundary"
        n = int(np.searchsorted(cum, top_p)) + 1  # smallest prefix whose mass reaches top_p
        keep[kept_order[n:]] = False
    p = np.where(keep, w, 0.0)
    return p / p.sum()


# Upper 0.1% point of the chi-square distribution by the Wilson-Hilferty formula (within ~1% of the
# tables for dof >= 4: 18.7 vs 18.47 at 4 dof, 61.2 vs 61.10 at 31).
def chi2_critical_001(dof):
    z = 3.090232  # standard normal 99.9% quantile
    return dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


def draw_counts(logits, device, n_calls, params):
    """Counts over n_calls calls of B identical rows (rows and offsets give independent draws)."""
    V = logits.shape[1]
    counts = np.zeros(V, np.int64)
    for offset in range(n_calls):
        counts += np.bincount(run_sample(logits, device, offset=offset, seed=7, **params), minlength=V)
    return counts


SAMPLE_CASES = {
    "plain": dict(temperature=0.8),
    "top_k": dict(temperature=1.0, top_k=5),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=1.2, min_p=0.1),
    "combined": dict(temperature=1.3, top_k=12, top_p=0.8, min_p=0.05),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(SAMPLE_CASES))
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_sample_follows_the_filtered_distribution(device, case, dtype):
    params = SAMPLE_CASES[case]
    V, B, calls = 32, 2500, 8  # 20000 draws
    row = np.random.default_rng(11).standard_normal(V) * 1.2
    row = row.astype(NP_DTYPE[dtype]).astype(np.float64)
    logits = vec(np.tile(row, (B, 1)), dtype, device)
    p = kept_distribution(row, **params)
    counts = draw_counts(logits, device, calls, params)
    n = counts.sum()
    assert counts[p == 0].sum() == 0, f"drew filtered-out tokens {np.nonzero(counts * (p == 0))[0]}"
    kept = p > 0
    expected = n * p[kept]
    assert expected.min() >= 5, "chi-square needs >= 5 expected draws per token"
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    dof = int(kept.sum()) - 1
    if dof == 0:
        return
    assert chi2 < chi2_critical_001(dof), f"chi2 {chi2:.1f} with {dof} dof: draws do not follow the distribution"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("V", [1, 19, V_LLM])
def test_sample_greedy_and_top_k_1_equal_argmax(device, dtype, V):
    x, x64 = rand((4, V), dtype, device, seed=V + 1, scale=2.0)
    ref = np.argmax(x64, axis=-1)
    np.testing.assert_array_equal(run_sample(x, device, temperature=0.0), ref)
    np.testing.assert_array_equal(run_sample(x, device, temperature=0.7, top_k=1, seed=3), ref)
    np.testing.assert_array_equal(run_sample(x, device, temperature=1.0, min_p=1.0, seed=4), ref)


SAMPLE_NON_FINITE_PARAMS = [
    dict(temperature=0.0),  # greedy
    dict(temperature=1.0),  # plain draw
    dict(temperature=0.7, top_k=5, top_p=0.9),  # sorted candidates
    dict(temperature=1.0, top_p=0.5, min_p=0.01),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("V", [1000, 999, V_LLM])  # on CUDA: vector and scalar loads; the LLM vocabulary
def test_sample_rows_without_a_finite_max_give_minus_one(device, dtype, V):
    """A row holding a NaN or +inf, or only -inf, gets -1 at every temperature (no token is emitted for
    it); its neighbours are sampled as usual, and -inf next to finite logits only masks those tokens."""
    a, finite = non_finite_rows(V)
    a = a.astype(NP_DTYPE[dtype]).astype(np.float64)
    x = vec(a, dtype, device)
    for seed, params in enumerate(SAMPLE_NON_FINITE_PARAMS):
        ids = sample_ids(x, device, seed=seed, **params)
        np.testing.assert_array_equal(ids < 0, ~finite, err_msg=f"{params}")
        assert (ids[~finite] == -1).all(), f"{params}: {ids}"
        good = ids[finite]
        assert (good < V).all() and np.isfinite(a[finite, :][np.arange(len(good)), good]).all(), f"{params}: {ids}"
        if params["temperature"] == 0.0:
            np.testing.assert_array_equal(good, np.argmax(a[finite], axis=-1))


@pytest.mark.parametrize("device", DEVICES)
def test_sample_never_draws_minus_inf(device):
    a = np.full((64, 50), -np.inf)
    a[:, [3, 30, 49]] = [0.0, 1.0, -1.0]
    ids = run_sample(vec(a, "f32", device), device, temperature=2.0)
    assert set(ids) <= {3, 30, 49} and len(set(ids)) == 3


@pytest.mark.parametrize("device", DEVICES)
def test_sample_is_deterministic_in_seed_and_offset(device):
    x, _ = rand((64, 1000), "bf16", device, seed=8)
    params = dict(temperature=1.0, top_k=100, top_p=0.95)
    a = run_sample(x, device, seed=5, offset=9, **params)
    np.testing.assert_array_equal(a, run_sample(x, device, seed=5, offset=9, **params))
    assert (a != run_sample(x, device, seed=6, offset=9, **params)).sum() > 16
    assert (a != run_sample(x, device, seed=5, offset=10, **params)).sum() > 16


@pytest.mark.parametrize("device", DEVICES)
def test_sample_rows_use_their_own_parameters(device):
    V = 200
    x, x64 = rand((5, V), "f32", device, seed=9, scale=3.0)
    order = np.argsort(-x64, axis=-1)
    temperature, top_k = [0.0, 1.0, 1.0, 5.0, 1.0], [0, 1, 3, 0, 0]
    top_p, min_p = [1.0, 1.0, 1.0, 1.0, 0.2], [0.0, 0.0, 0.0, 0.0, 0.0]
    for offset in range(20):
        ids = run_sample(x, device, temperature, top_k, top_p, min_p, seed=1, offset=offset)
        assert ids[0] == order[0, 0] and ids[1] == order[1, 0]
        assert ids[2] in order[2, :3]
        ref4 = kept_distribution(x64[4], 1.0, top_p=0.2)
        assert ref4[ids[4]] > 0
    # Row 3 (temperature 5, no filter) spreads over many tokens.
    many = [run_sample(x, device, temperature, top_k, top_p, min_p, seed=2, offset=o)[3] for o in range(30)]
    assert len(set(many)) > 10


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_sample_llm_vocab_respects_the_filters(device, dtype):
    x, x64 = rand((4, V_LLM), dtype, device, seed=12, scale=3.0)
    order = np.argsort(-x64, axis=-1, kind="stable")
    ids = run_sample(x, device, temperature=0.7, top_k=50, top_p=0.9, seed=3)
    for b in range(4):
        assert ids[b] in order[b, :50]
        assert kept_distribution(x64[b], 0.7, top_k=50, top_p=0.9)[ids[b]] > 0
    run_sample(x, device, temperature=1.0, seed=4)  # plain: any id in range
    ids = run_sample(x, device, temperature=1.0, min_p=0.05, seed=5)
    for b in range(4):
        assert kept_distribution(x64[b], 1.0, min_p=0.05)[ids[b]] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_sample_large_kept_sets(device):
    # top_p over a flat distribution keeps ~100k tokens and top_k = 5000: more than the CUDA kernel sorts
    # in shared memory, so these take its binary-search path.
    x, x64 = rand((2, V_LLM), "f32", device, seed=13)
    ids = run_sample(x, device, temperature=1.0, top_k=5000, seed=6)
    order = np.argsort(-x64, axis=-1)
    for b in range(2):
        assert ids[b] in order[b, :5000]
    ids = run_sample(x, device, temperature=1.0, top_p=0.5, seed=7)
    for b in range(2):
        w = np.exp(x64[b] - x64[b].max())
        rank_mass = np.sort(w)[::-1].cumsum() / w.sum()
        # kept: the top tokens whose mass reaches 0.5 (slack of 1e-4 for float32 rounding)
        threshold = np.sort(w)[::-1][np.searchsorted(rank_mass, 0.5 - 1e-4)]
        assert w[ids[b]] >= threshold * (1 - 1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V,scale,dtype", [(V_LLM, 1.3, "bf16"), (V_LLM, 0.02, "bf16"), (16389, 2.0, "f32"),
                                           (4099, 2.0, "bf16"), (300, 1.0, "f16")])
def test_sample_top_k_draws_what_the_masked_row_draws(device, V, scale, dtype):
    # top_k keeps the tokens whose logit is >= the k-th largest (ties kept) and draws among them with the
    # weights the whole row gives them. The same row with every other logit at -inf (weight 0) and top_k off
    # therefore draws the same token for the same seed: the backends find top_k's tokens from a floor (the
    # k-th largest chunk or thread maximum), the masked row goes through the plain path. scale 0.02 puts
    # thousands of tokens within a histogram bin of the max (ties of bf16 values too); the f32 rows have runs
    # of -inf (whole CPU chunks and CUDA threads without a number); 300 tokens leave most CUDA threads empty.
    rows = 6
    a = (np.random.default_rng(V).standard_normal((rows, V)) * scale).astype(NP_DTYPE[dtype])
    if dtype == "f32":
        a[:, 1000:1600] = -np.inf
        a[::2, 5000:5300] = -np.inf
    x = llaisys.tensor(a, device)
    for k, extra in [(1, {}), (5, {}), (50, {}), (20, dict(top_p=0.8)), (64, dict(top_p=0.95, min_p=0.2)),
                     (1000, {})]:
        a64 = a.astype(np.float64)
        kth = -np.sort(-a64, axis=-1)[:, min(k, V) - 1:min(k, V)]  # k >= V keeps every token
        masked = llaisys.tensor(np.where(a64 >= kth, a64, -np.inf).astype(NP_DTYPE["f32"]), device)
        for offset in range(4):
            got = run_sample(x, device, temperature=0.7, top_k=k, seed=9, offset=offset, **extra)
            want = run_sample(masked, device, temperature=0.7, seed=9, offset=offset, **extra)
            np.testing.assert_array_equal(got, want, err_msg=f"top_k={k} {extra} offset {offset}")


@pytest.mark.parametrize("device", DEVICES)
def test_sample_non_contiguous_logits(device):
    xt, xt64 = rand((19, 3), "f32", device, seed=14, scale=4.0)
    x = xt.transpose(0, 1)  # [3, 19]
    np.testing.assert_array_equal(run_sample(x, device, temperature=0.0), np.argmax(xt64.T, axis=-1))
    ids = run_sample(x, device, temperature=1.0, top_k=2)
    for b in range(3):
        assert ids[b] in np.argsort(-xt64.T[b])[:2]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_sample_cuda_matches_cpu(dtype):
    # Same rule, same generator: tokens agree unless rounding (CUDA's fast exp vs the C library's expf,
    # relative difference < 3e-6) moves a draw across a token boundary. With ~100 tokens of similar mass
    # that is rare (>= 95% must agree); over the ~10^4-10^5 kept tokens of the search path the shift is
    # a sizeable fraction of one token's mass, so only most rows agree there (>= 50%).
    x, _ = rand((256, 1000), dtype, "cpu", seed=15, scale=2.0)
    xc = x.to("cuda")
    for params in [dict(temperature=0.8), dict(temperature=1.0, top_k=40, top_p=0.9),
                   dict(temperature=1.1, top_p=0.8), dict(temperature=0.9, min_p=0.05)]:
        a = run_sample(x, "cpu", seed=21, offset=3, **params)
        b = run_sample(xc, "cuda", seed=21, offset=3, **params)
        assert (a == b).mean() >= 0.95, f"{params}: CPU and CUDA agree on {(a == b).mean():.1%} of rows"
    xl, _ = rand((8, V_LLM), dtype, "cpu", seed=16)
    for params in [dict(temperature=1.0, top_p=0.5), dict(temperature=1.0, top_k=5000)]:  # search path
        a = run_sample(xl, "cpu", seed=22, **params)
        b = run_sample(xl.to("cuda"), "cuda", seed=22, **params)
        assert (a == b).mean() >= 0.5, f"{params}: CPU and CUDA agree on {(a == b).mean():.1%} of rows"



@pytest.mark.cuda
@pytest.mark.parametrize("params", [dict(temperature=0.6, top_k=50), dict(temperature=0.7, top_k=20, top_p=0.8),
                                    dict(temperature=0.7, top_k=50, min_p=0.3),  # fewer survivors than k
                                    dict(temperature=1.0, top_k=50, top_p=0.5, min_p=0.2),
                                    dict(temperature=1.0, top_k=1000)])
def test_sample_cuda_top_k_at_llm_vocab_matches_cpu(params):
    # top_k on CUDA takes its cut-off from the threads' maxima of the max pass (no histogram of the row);
    # the kept set and the draw are the rule's, so the tokens are the CPU's but for fast-exp rounding
    x, _ = rand((64, V_LLM), "bf16", "cpu", seed=17, scale=1.3)
    a = run_sample(x, "cpu", seed=23, offset=5, **params)
    b = run_sample(x.to("cuda"), "cuda", seed=23, offset=5, **params)
    assert (a == b).mean() >= 0.95, f"{params}: CPU and CUDA agree on {(a == b).mean():.1%} of rows"


def test_sample_argument_errors():
    x, _ = rand((2, 5), "f32")
    f32, i32 = vec([1.0, 1.0], "f32", "cpu"), vec([0, 0], "i32", "cpu")
    out = poisoned((2,), "i64")
    with pytest.raises(TypeError, match="sample: temperature must be f32, got i32"):
        ops.sample(out, x, i32, i32, f32, f32, 0, 0)
    with pytest.raises(TypeError, match="sample: top_k must be i32, got f32"):
        ops.sample(out, x, f32, f32, f32, f32, 0, 0)
    with pytest.raises(TypeError, match="sample: out_ids must be i64"):
        ops.sample(poisoned((2,), "i32"), x, f32, i32, f32, f32, 0, 0)
    with pytest.raises(ValueError, match=r"sample: top_p must have shape \[2\], got \[3\]"):
        ops.sample(out, x, f32, i32, vec([1, 1, 1], "f32", "cpu"), f32, 0, 0)
    with pytest.raises(ValueError, match="sample: logits must be 2-D"):
        ops.sample(out, rand((5,), "f32")[0], f32, i32, f32, f32, 0, 0)
    with pytest.raises(TypeError, match="sample: logits must be f32, f16 or bf16"):
        ops.sample(out, llaisys.empty([2, 5], "i64"), f32, i32, f32, f32, 0, 0)


@pytest.mark.parametrize("name, bad, rule", [
    ("temperature", -1.0, r"a finite number >= 0"), ("temperature", np.nan, r"a finite number >= 0"),
    ("temperature", np.inf, r"a finite number >= 0"), ("top_k", -1, r"an int >= 0"),
    ("top_p", 5.0, r"in \(0, 1\]"), ("top_p", 0.0, r"in \(0, 1\]"), ("top_p", np.nan, r"in \(0, 1\]"),
    ("min_p", 1.5, r"in \[0, 1\]"), ("min_p", -0.1, r"in \[0, 1\]"),
])
def test_sample_parameter_values_are_checked(name, bad, rule):
    """Out-of-range parameters raise naming the argument: the op checks host-resident values per row,
    functional.sample checks its scalars on every device."""
    x, _ = rand((3, 7), "f32")
    params = dict(temperature=[1.0] * 3, top_k=[0] * 3, top_p=[1.0] * 3, min_p=[0.0] * 3)
    params[name][2] = bad
    with pytest.raises(ValueError, match=rf"sample: {name} must be {rule}.* in row 2"):
        sample_ids(x, "cpu", **params)
    with pytest.raises(ValueError, match=rf"^{name} must be {rule}"):
        llaisys.functional.sample(x, **{name: bad})


def test_functional_sample_issue_example_raises():
    x, _ = rand((1, 7), "f32")
    with pytest.raises(ValueError, match="temperature"):
        llaisys.functional.sample(x, top_p=5, temperature=-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_functional_argmax_and_sample_raise_on_non_finite_rows(device, dtype):
    """The allocating forms raise ValueError naming the first row without a finite maximum."""
    for value in [np.nan, np.inf]:
        a = np.random.default_rng(0).standard_normal((4, 50))
        a[2, 17] = value
        a[3, :] = -np.inf
        x = vec(a, dtype, device)
        with pytest.raises(ValueError, match=r"argmax: row 2 of x has no finite maximum"):
            llaisys.functional.argmax(x)
        for temperature in [0.0, 0.8]:
            with pytest.raises(ValueError, match=r"sample: row 2 of logits has no finite maximum"):
                llaisys.functional.sample(x, temperature=temperature)
    b = np.zeros((2, 3, 5))
    b[1, 2, :] = -np.inf
    with pytest.raises(ValueError, match=r"argmax: row \(1, 2\) of x"):
        llaisys.functional.argmax(vec(b, dtype, device))
    with pytest.raises(ValueError, match=r"argmax: x has no finite maximum"):
        llaisys.functional.argmax(vec([1.0, np.nan], dtype, device))
    ok = np.random.default_rng(1).standard_normal((3, 50))
    ok[:, 7] = -np.inf  # a masked token is fine
    idx, _ = llaisys.functional.argmax(vec(ok, dtype, device))
    np.testing.assert_array_equal(idx.to("cpu").numpy(), np.argmax(ok.astype(NP_DTYPE[dtype]), axis=-1))
    ids = llaisys.functional.sample(vec(ok, dtype, device), temperature=1.0).to("cpu").numpy()
    assert ((ids >= 0) & (ids < 50) & (ids != 7)).all()


@pytest.mark.cuda
def test_sample_device_mismatch():
    x, _ = rand((2, 5), "f32", "cuda")
    with pytest.raises(ValueError, match="sample: all tensors must be on one device"):
        ops.sample(poisoned((2,), "i64", "cuda"), x, vec([1, 1], "f32", "cpu"), vec([0, 0], "i32", "cuda"),
                   vec([1, 1], "f32", "cuda"), vec([0, 0], "f32", "cuda"), 0, 0)


# ---------------------------------------------------------------------------------- repetition_penalty


def penalty_reference(l64, ids, penalty):
    """HF's RepetitionPenaltyLogitsProcessor in float64."""
    ref = l64.copy()
    for b in range(ids.shape[0]):
        for i in ids[b]:
            if i >= 0:
                ref[b, i] = ref[b, i] / penalty if ref[b, i] > 0 else ref[b, i] * penalty
    return ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hf(device, dtype, penalty):
    B, V = 3, 989
    x, x64 = rand((B, V), dtype, device, seed=17, scale=3.0)
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(V, 7, replace=False) for _ in range(B)]).astype(np.int64)
    ids[1, 4:] = -1  # padding
    ids[2, :] = -1
    ids[0, 0], ids[0, 1] = 0, V - 1
    before = x.to("cpu").numpy().copy()
    ops.repetition_penalty(x, vec(ids, "i64", device), penalty)
    ref = penalty_reference(x64, ids, penalty)
    assert_close(x, ref, dtype)
    touched = np.zeros((B, V), bool)
    for b in range(B):
        touched[b, ids[b][ids[b] >= 0]] = True
    np.testing.assert_array_equal(x.to("cpu").numpy()[~touched], before[~touched])  # the rest is untouched
    assert (np.sign(x64[touched]) == np.sign(to_f64(x)[touched])).all()


@pytest.mark.parametrize("device", DEVICES)
def test_repetition_penalty_strided_logits_nan_and_empty(device):
    xt, xt64 = rand((50, 2), "f32", device, seed=18)
    x = xt.transpose(0, 1)  # [2, 50], strides (1, 2): updated in place through the view
    a = xt64.T.copy()
    ids = np.array([[3, 10, -1], [49, 0, 7]])
    ops.repetition_penalty(x, vec(ids, "i64", device), 2.0)
    assert_close(xt, penalty_reference(a, ids, 2.0).T, "f32")
    ops.repetition_penalty(x, llaisys.empty([2, 0], "i64", device), 2.0)  # no ids: no-op
    y = vec([[np.nan, np.inf, -np.inf, 0.0]], "f32", device)
    ops.repetition_penalty(y, vec([[0, 1, 2, 3]], "i64", device), 2.0)
    got = y.to("cpu").numpy()
    assert np.isnan(got[0, 0]) and got[0, 1] == np.inf and got[0, 2] == -np.inf and got[0, 3] == 0.0


def test_repetition_penalty_errors():
    x, _ = rand((2, 10), "f32")
    ids = vec([[1, -1], [2, 3]], "i64", "cpu")
    for bad in [0.0, -1.0, float("nan"), float("inf")]:
        with pytest.raises(ValueError, match="repetition_penalty: penalty must be a finite number > 0"):
            ops.repetition_penalty(x, ids, bad)
    with pytest.raises(IndexError, match=r"repetition_penalty: id 10 at \[1, 0\] is out of range .* 10"):
        ops.repetition_penalty(x, vec([[1, -1], [10, 3]], "i64", "cpu"), 1.5)
    with pytest.raises(IndexError, match=r"id -2 at \[0, 1\]"):
        ops.repetition_penalty(x, vec([[1, -2], [2, 3]], "i64", "cpu"), 1.5)
    with pytest.raises(TypeError, match="repetition_penalty: ids must be i64, got i32"):
        ops.repetition_penalty(x, vec([[1, 2], [2, 3]], "i32", "cpu"), 1.5)
    with pytest.raises(ValueError, match="repetition_penalty: ids must have 2 rows like logits"):
        ops.repetition_penalty(x, vec([[1, 2]], "i64", "cpu"), 1.5)
    with pytest.raises(ValueError, match="repetition_penalty: logits must be 2-D"):
        ops.repetition_penalty(rand((10,), "f32")[0], ids, 1.5)


@pytest.mark.cuda
def test_repetition_penalty_cuda_skips_out_of_range_ids():
    x, x64 = rand((2, 10), "f32", "cuda", seed=19)
    ids = np.array([[1, 10, -5], [2, 3, 99]])
    ops.repetition_penalty(x, vec(ids, "i64", "cuda"), 1.5)
    llaisys.synchronize("cuda")  # no error: out-of-range ids are ignored on CUDA
    valid = np.where((ids >= 0) & (ids < 10), ids, -1)
    assert_close(x, penalty_reference(x64, valid, 1.5), "f32")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_sample_rows_draws_each_row_from_its_own_seed_and_step(device, dtype):
    """Row b of sample_rows equals sample() of that row alone with (seeds[b], steps[b]): what makes a
    batched request's tokens independent of its row."""
    B, V = 9, 999
    logits, _ = rand((B, V), dtype, device, seed=21, scale=3.0)
    rng = np.random.default_rng(5)
    temp = rng.uniform(0.3, 1.5, B).astype(np.float32)
    top_k = rng.integers(0, 50, B).astype(np.int32)
    top_p = rng.uniform(0.5, 1.0, B).astype(np.float32)
    min_p = rng.uniform(0.0, 0.1, B).astype(np.float32)
    seeds = rng.integers(0, 2**62, B, dtype=np.int64)
    steps = rng.integers(0, 1000, B, dtype=np.int64)
    out = llaisys.empty([B], "i64", device)
    t = lambda a: llaisys.tensor(a, device)  # noqa: E731
    llaisys.ops.sample_rows(out, logits, t(temp), t(top_k), t(top_p), t(min_p), t(seeds), t(steps))
    got = out.to("cpu").numpy().tolist()
    for b in range(B):
        one = llaisys.empty([1], "i64", device)
        llaisys.ops.sample(one, logits.slice(0, b, b + 1), t(temp[b:b + 1]), t(top_k[b:b + 1]), t(top_p[b:b + 1]),
                           t(min_p[b:b + 1]), int(seeds[b]), int(steps[b]))
        assert got[b] == int(one.to("cpu").numpy()[0]), f"row {b}"
    assert len(set(got)) > 1  # the rows really were drawn, not all the argmax of one row
    with pytest.raises((TypeError, ValueError), match="seeds"):
        llaisys.ops.sample_rows(out, logits, t(temp), t(top_k), t(top_p), t(min_p), t(seeds[:3]), t(steps))
