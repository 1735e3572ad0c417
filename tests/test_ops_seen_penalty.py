"""seen_penalty and seen_mark (the repetition penalty over per-sequence bitmasks kept on the device) against
NumPy float64 formulas: HF's RepetitionPenaltyLogitsProcessor (a seen token's logit / p if > 0, else * p,
once) and plain set insertion."""
import numpy as np
import pytest

import llaisys
from llaisys import ops
from utils import DEVICES, NP_DTYPE, assert_close, rand, to_f64


def vec(values, dtype, device):
    return llaisys.tensor(np.asarray(values, NP_DTYPE[dtype]), device)


def bitmask(sets, V):
    """[S, ceil(V / 32)] i32 with bit v % 32 of word v / 32 set for each v in sets[s] (a plain loop)."""
    words = np.zeros((len(sets), (V + 31) // 32), np.uint32)
    for s, ids in enumerate(sets):
        for v in ids:
            words[s, v // 32] |= np.uint32(1 << (v % 32))
    return words.view(np.int32)


def reference(l64, sets, rows, penalty):
    ref = l64.copy()
    for b, r in enumerate(rows):
        if r < 0:
            continue
        for v in set(sets[r]):
            ref[b, v] = ref[b, v] / penalty[b] if ref[b, v] > 0 else ref[b, v] * penalty[b]
    return ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("B,V", [(1, 1), (3, 19), (5, 111), (4, 989)])
def test_seen_penalty_matches_hf_formula(device, dtype, B, V):
    rng = np.random.default_rng(V)
    x, x64 = rand((B, V), dtype, device, seed=V, scale=3.0)
    # S = B + 1 sets of different sizes (one empty, one with both ends of the vocabulary); rows may share a set
    sets = [list(rng.choice(V, min(V, k), replace=False)) for k in (7, 0, 30, 1, 200, 3)[:B + 1]]
    sets[0] = sorted(set(sets[0]) | {0, V - 1})
    rows = [int(r) for r in rng.integers(-1, B + 1, B)]
    rows[0] = 0
    penalty = rng.uniform(0.5, 2.0, B).astype(np.float32)
    if B > 2:
        penalty[2] = 1.0  # penalty 1 leaves its row as it is
    before = x.to("cpu").numpy().copy()
    ops.seen_penalty(x, vec(bitmask(sets, V), "i32", device), vec(rows, "i32", device), vec(penalty, "f32", device))
    ref = reference(x64, sets, rows, penalty.astype(np.float64))
    assert_close(x, ref, dtype)
    untouched = ref == x64
    np.testing.assert_array_equal(x.to("cpu").numpy()[untouched], before[untouched])  # bit-exact elsewhere


@pytest.mark.parametrize("device", DEVICES)
def test_seen_penalty_strided_logits_and_specials(device):
    xt, xt64 = rand((50, 2), "f32", device, seed=18)
    x = xt.transpose(0, 1)  # [2, 50], strides (1, 2): updated in place through the view
    sets = [[3, 10, 49], [0, 7]]
    ops.seen_penalty(x, vec(bitmask(sets, 50), "i32", device), vec([1, 0], "i32", device),
                     vec([2.0, 0.5], "f32", device))
    assert_close(xt, reference(xt64.T.copy(), sets, [1, 0], [2.0, 0.5]).T, "f32")
    y = vec([[np.nan, np.inf, -np.inf, 0.0, 1.0]], "f32", device)
    ops.seen_penalty(y, vec(bitmask([[0, 1, 2, 3]], 5), "i32", device), vec([0], "i32", device),
                     vec([2.0], "f32", device))
    got = y.to("cpu").numpy()
    assert np.isnan(got[0, 0]) and got[0, 1] == np.inf and got[0, 2] == -np.inf and got[0, 3] == 0.0
    assert got[0, 4] == 1.0  # not in the set


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V", [1, 33, 989])
def test_seen_mark_adds_each_token_to_its_set(device, V):
    rng = np.random.default_rng(V)
    sets = [list(rng.choice(V, min(V, 5), replace=False)), [], [V - 1]]
    seen = vec(bitmask(sets, V), "i32", device)
    rows = [2, -1, 0, 1, 0]
    ids = [0, 5 % V, V - 1, -1, int(sets[0][0])]  # row -1 and id -1 (no token): nothing; a token already in
    ops.seen_mark(seen, vec(rows, "i32", device), vec(ids, "i64", device))
    want = [set(s) for s in sets]
    for r, t in zip(rows, ids):
        if r >= 0 and t >= 0:
            want[r].add(t)
    np.testing.assert_array_equal(seen.to("cpu").numpy(), bitmask([sorted(s) for s in want], V))


def test_seen_errors():
    x, _ = rand((2, 40), "f32")
    seen, rows, pen = vec(np.zeros((3, 2)), "i32", "cpu"), vec([0, 2], "i32", "cpu"), vec([1.5, 1.5], "f32", "cpu")
    for bad in [0.0, -1.0, np.nan, np.inf]:
        with pytest.raises(ValueError, match=r"seen_penalty: penalty\[1\] must be a finite number > 0"):
            ops.seen_penalty(x, seen, rows, vec([1.5, bad], "f32", "cpu"))
    with pytest.raises(IndexError, match=r"seen_penalty: rows\[1\] = 3 is outside the 3 rows of seen"):
        ops.seen_penalty(x, seen, vec([0, 3], "i32", "cpu"), pen)
    with pytest.raises(IndexError, match=r"seen_mark: rows\[0\] = -2"):
        ops.seen_mark(seen, vec([-2, 0], "i32", "cpu"), vec([1, 2], "i64", "cpu"))
    with pytest.raises(IndexError, match=r"seen_mark: ids\[1\] = 64 is outside the 64 tokens of seen"):
        ops.seen_mark(seen, rows, vec([1, 64], "i64", "cpu"))
    with pytest.raises(IndexError, match=r"seen_mark: ids\[0\] = -2"):
        ops.seen_mark(seen, rows, vec([-2, 1], "i64", "cpu"))
    with pytest.raises(ValueError, match="seen_penalty: seen must have shape"):
        ops.seen_penalty(x, vec(np.zeros((3, 1)), "i32", "cpu"), rows, pen)
    with pytest.raises(TypeError, match="seen_penalty: rows must be i32"):
        ops.seen_penalty(x, seen, vec([0, 1], "i64", "cpu"), pen)
    with pytest.raises(TypeError, match="seen_mark: ids must be i64"):
        ops.seen_mark(seen, rows, vec([1, 2], "i32", "cpu"))
    with pytest.raises(ValueError, match="seen_penalty: penalty must have shape"):
        ops.seen_penalty(x, seen, rows, vec([1.5], "f32", "cpu"))


@pytest.mark.cuda
def test_seen_cuda_skips_out_of_range_rows_and_ids():
    """On a device a bad row index or id is skipped (checking it would need a sync)."""
    x, x64 = rand((2, 40), "f32", "cuda", seed=19)
    sets = [[1, 39], [5]]
    seen = vec(bitmask(sets, 40), "i32", "cuda")
    ops.seen_penalty(x, seen, vec([7, 1], "i32", "cuda"), vec([1.5, 1.5], "f32", "cuda"))
    ops.seen_mark(seen, vec([0, 9], "i32", "cuda"), vec([64, 3], "i64", "cuda"))  # 64: past the 2 words
    llaisys.synchronize("cuda")
    assert_close(x, reference(x64, sets, [-1, 1], [1.5, 1.5]), "f32")
    np.testing.assert_array_equal(seen.to("cpu").numpy(), bitmask(sets, 40))
