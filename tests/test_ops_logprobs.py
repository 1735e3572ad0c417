"""logprobs (the log-softmax of a step's sampled rows after the temperature, the chosen token's entry and
the top k) against a NumPy float64 formula: the one EngineCore used before the op existed."""
import numpy as np
import pytest

import llaisys
from llaisys import ops
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, poisoned, rand

V_LLM = 151936  # Qwen2's vocabulary

# lp = (x - max) / t - log(sum): the log of a sum of V terms accumulated in f32 (a thread's few hundred in
# order, then a tree on CUDA) has a relative error of up to ~1e-5, which is an absolute error of every lp.
LP_TOL = dict(atol=1e-4, rtol=1e-5)


def vec(values, dtype, device):
    return llaisys.tensor(np.asarray(values, NP_DTYPE[dtype]), device)


def reference(a64, temperature, chosen, rows, k):
    """(chosen_lp [R], top_ids [R, k], top_lp [R, k]) in float64: the log-softmax of a64[b] / (t or 1), the
    k largest by (lp desc, id asc), slots past V as (-1, -inf)."""
    R, V = len(rows), a64.shape[1]
    clp, ids, tlp = np.empty(R), np.full((R, k), -1, np.int64), np.full((R, k), -np.inf)
    with np.errstate(invalid="ignore", over="ignore"):
        for r, b in enumerate(rows):
            x = a64[b] / (float(temperature[b]) or 1.0)
            m = x.max()
            lp = x - (m + np.log(np.exp(x - m).sum()))
            clp[r] = lp[chosen[b]]
            top = np.lexsort((np.arange(V), -lp))[:k]
            ids[r, :len(top)], tlp[r, :len(top)] = top, lp[top]
    return clp, ids, tlp


def run(x, temperature, chosen, rows, k, device):
    R = len(rows)
    clp, ids, tlp = poisoned((R,), "f32", device), poisoned((R, k), "i64", device), poisoned((R, k), "f32", device)
    ops.logprobs(clp, ids, tlp, x, vec(temperature, "f32", device), vec(chosen, "i64", device),
                 vec(rows, "i64", device))
    return (np.asarray(clp.to("cpu").numpy(), np.float64), ids.to("cpu").numpy(),
            np.asarray(tlp.to("cpu").numpy(), np.float64))


def check(got, ref):
    np.testing.assert_allclose(got[0], ref[0], **LP_TOL)
    np.testing.assert_array_equal(got[1], ref[1])
    np.testing.assert_allclose(got[2], ref[2], **LP_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("V", [1, 7, 989, V_LLM])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_match_numpy(device, dtype, V, k):
    B = 4
    x, x64 = rand((B, V), dtype, device, seed=V + k, scale=3.0)
    temperature = np.array([0.0, 0.7, 1.0, 1.9], np.float32)  # 0: as 1 (a greedy row)
    chosen = np.random.default_rng(k).integers(0, V, B)
    rows = [3, 0, 1] if k % 2 else [0, 1, 2, 3]  # a subset out of order, or every row
    got = run(x, temperature, chosen, rows, k, device)
    check(got, reference(x64, temperature.astype(np.float64), chosen, rows, k))
    if V < k:  # slots past the vocabulary
        assert (got[1][:, V:] == -1).all() and (got[2][:, V:] == -np.inf).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_logprobs_ties_take_the_lower_id(device, dtype):
    a = np.random.default_rng(3).standard_normal((3, 989))
    a[0, [7, 500, 988, 3]] = 6.0  # far apart: different threads on CUDA
    a[1, :] = -1.0  # all equal
    a[2, [988, 987, 0, 1]] = [9.0, 9.0, 8.0, 8.0]  # above every normal draw
    a = a.astype(NP_DTYPE[dtype]).astype(np.float64)
    temperature, chosen, rows = np.ones(3, np.float32), np.array([7, 988, 0]), [0, 1, 2]
    got = run(vec(a, dtype, device), temperature, chosen, rows, 5, device)
    np.testing.assert_array_equal(got[1][0, :4], [3, 7, 500, 988])
    np.testing.assert_array_equal(got[1][1], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(got[1][2, :4], [987, 988, 0, 1])
    check(got, reference(a, temperature, chosen, rows, 5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [2, 5])
def test_logprobs_banned_tokens_are_minus_inf(device, k):
    """-inf entries (a token banned by a bias) have lp -inf; where fewer than k are finite they fill the top
    in id order."""
    a = np.random.default_rng(4).standard_normal((2, 111))
    a[0, [5, 50]] = -np.inf
    a[1, :] = -np.inf
    a[1, [9, 30, 60]] = [1.0, 3.0, 2.0]  # three finite values
    temperature, chosen, rows = np.array([0.5, 1.0], np.float32), np.array([4, 30]), [0, 1]
    got = run(vec(a, "f32", device), temperature, chosen, rows, k, device)
    check(got, reference(a, temperature, chosen, rows, k))
    if k == 5:
        np.testing.assert_array_equal(got[1][1], [30, 60, 9, 0, 1])
        assert (got[2][1, 3:] == -np.inf).all()


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_rows_without_a_finite_max_are_nan(device):
    a = np.random.default_rng(5).standard_normal((4, 50))
    a[0, 10] = np.nan
    a[1, 20] = np.inf
    a[2, :] = -np.inf
    rows = [0, 1, 2, 3]
    got = run(vec(a, "f32", device), np.ones(4, np.float32), np.array([1, 2, 3, 4]), rows, 3, device)
    assert np.isnan(got[0][:3]).all() and np.isnan(got[2][:3]).all()
    assert ((got[1][:3] >= 0) & (got[1][:3] < 50)).all()  # every slot written
    check(tuple(g[3:] for g in got), reference(a[3:], np.ones(1), np.array([4]), [0], 3))


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_non_contiguous_operands(device):
    xt, xt64 = rand((300, 6), "f32", device, seed=6)
    x = xt.transpose(0, 1)  # [6, 300], strides (1, 6)
    big_ids, big_lp = poisoned((2, 4, 2), "i64", device), poisoned((2, 4, 2), "f32", device)
    ids, tlp = big_ids.select(2, 1), big_lp.select(2, 0)  # [2, 4], strides (8, 2)
    clp = poisoned((2, 3), "f32", device).select(1, 2)
    temperature, chosen, rows = np.full(6, 0.8, np.float32), np.arange(6) * 7, [5, 2]
    ops.logprobs(clp, ids, tlp, x, vec(temperature, "f32", device), vec(chosen, "i64", device),
                 vec(rows, "i64", device))
    got = (np.asarray(clp.to("cpu").numpy(), np.float64), ids.to("cpu").numpy(),
           np.asarray(tlp.to("cpu").numpy(), np.float64))
    check(got, reference(xt64.T, temperature, chosen, rows, 4))


def test_logprobs_no_rows_is_a_no_op():
    x, _ = rand((2, 9), "f32")
    ops.logprobs(poisoned((0,), "f32"), poisoned((0, 3), "i64"), poisoned((0, 3), "f32"), x, vec([1, 1], "f32", "cpu"),
                 vec([0, 0], "i64", "cpu"), vec([], "i64", "cpu"))


def test_logprobs_errors_name_the_op():
    x, _ = rand((2, 9), "f32")
    t, c, r = vec([1, 1], "f32", "cpu"), vec([0, 3], "i64", "cpu"), vec([1], "i64", "cpu")
    clp, ids, tlp = poisoned((1,), "f32"), poisoned((1, 3), "i64"), poisoned((1, 3), "f32")
    with pytest.raises(TypeError, match="logprobs: logits must be f32, f16 or bf16, got i64"):
        ops.logprobs(clp, ids, tlp, vec(np.zeros((2, 9)), "i64", "cpu"), t, c, r)
    with pytest.raises(TypeError, match="logprobs: temperature must be f32, got f16"):
        ops.logprobs(clp, ids, tlp, x, vec([1, 1], "f16", "cpu"), c, r)
    with pytest.raises(TypeError, match="logprobs: rows must be i64, got i32"):
        ops.logprobs(clp, ids, tlp, x, t, c, vec([1], "i32", "cpu"))
    with pytest.raises(TypeError, match="logprobs: top_lp must be f32, got bf16"):
        ops.logprobs(clp, ids, poisoned((1, 3), "bf16"), x, t, c, r)
    with pytest.raises(ValueError, match=r"logprobs: top_lp must have shape \[1, 3\], got \[1, 2\]"):
        ops.logprobs(clp, ids, poisoned((1, 2), "f32"), x, t, c, r)
    with pytest.raises(ValueError, match=r"logprobs: chosen must have shape \[2\], got \[3\]"):
        ops.logprobs(clp, ids, tlp, x, t, vec([0, 1, 2], "i64", "cpu"), r)
    with pytest.raises(ValueError, match="logprobs: logits must be 2-D"):
        ops.logprobs(clp, ids, tlp, rand((9,), "f32")[0], t, c, r)
    with pytest.raises(ValueError, match="logprobs: top_ids may have at most 20 columns"):
        ops.logprobs(clp, poisoned((1, 21), "i64"), poisoned((1, 21), "f32"), x, t, c, r)
    with pytest.raises(IndexError, match=r"logprobs: rows\[0\] = 2 is out of range for logits with 2 rows"):
        ops.logprobs(clp, ids, tlp, x, t, c, vec([2], "i64", "cpu"))
    with pytest.raises(IndexError, match=r"logprobs: chosen\[1\] = 9 is out of range for a vocabulary of 9"):
        ops.logprobs(clp, ids, tlp, x, t, vec([0, 9], "i64", "cpu"), r)
    with pytest.raises(ValueError, match="logprobs: temperature must be a finite number >= 0.* in row 1"):
        ops.logprobs(clp, ids, tlp, x, vec([1, -1], "f32", "cpu"), c, r)


@pytest.mark.cuda
def test_logprobs_device_mismatch():
    x, _ = rand((2, 5), "f32", "cuda")
    with pytest.raises(ValueError, match="logprobs: all tensors must be on one device"):
        ops.logprobs(poisoned((1,), "f32", "cuda"), poisoned((1, 2), "i64", "cuda"), poisoned((1, 2), "f32", "cuda"),
                     x, vec([1, 1], "f32", "cpu"), vec([0, 0], "i64", "cuda"), vec([0], "i64", "cuda"))


@pytest.mark.cuda
def test_logprobs_cuda_out_of_range_indices_give_nan():
    """On a device the op cannot check index values without a sync: a bad row gives ids -1 and NaN, a bad
    chosen id a NaN chosen_lp; the good rows are unaffected."""
    x, x64 = rand((2, 40), "f32", "cuda", seed=8)
    t, chosen, rows = np.ones(2, np.float32), np.array([3, 99]), [0, 7, 1]
    got = run(x, t, chosen, rows, 3, "cuda")
    llaisys.synchronize("cuda")
    check(tuple(g[:1] for g in got), reference(x64, t, chosen, [0], 3))
    assert np.isnan(got[0][1]) and (got[1][1] == -1).all() and np.isnan(got[2][1]).all()
    assert np.isnan(got[0][2])  # chosen 99 >= V; its row's top is still right
    _, ref_ids, ref_lp = reference(x64, t, np.array([3, 0]), [1], 3)
    np.testing.assert_array_equal(got[1][2:], ref_ids)
    np.testing.assert_allclose(got[2][2:], ref_lp, **LP_TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_logprobs_cuda_matches_cpu(dtype):
    """Many rows of the real vocabulary (one block per row fills the GPU): CUDA and the CPU agree."""
    B, k = 160, 20
    x, _ = rand((B, V_LLM), dtype, "cuda", seed=11, scale=4.0)
    xc = x.to("cpu")
    rng = np.random.default_rng(12)
    t, chosen = rng.uniform(0.2, 2.0, B).astype(np.float32), rng.integers(0, V_LLM, B)
    rows = rng.permutation(B)[:150]
    gpu, cpu = run(x, t, chosen, rows, k, "cuda"), run(xc, t, chosen, rows, k, "cpu")
    np.testing.assert_allclose(gpu[0], cpu[0], **LP_TOL)
    np.testing.assert_array_equal(gpu[1], cpu[1])
    np.testing.assert_allclose(gpu[2], cpu[2], **LP_TOL)
