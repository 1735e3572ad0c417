"""logit_bias: logits[b, ids[b, j]] += bias[b, j] in place (presence/frequency penalties, banned tokens),
against the NumPy formula: one rounding of (logit + bias) to the dtype, padding (-1) untouched."""
import numpy as np
import pytest

import llaisys
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, bits, rand


def reference(logits64, ids, bias, dtype):
    out = logits64.copy()
    for b in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            if ids[b, j] >= 0:
                out[b, ids[b, j]] = out[b, ids[b, j]] + float(bias[b, j])
    return out.astype(NP_DTYPE[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("B,V,n", [(1, 19, 1), (3, 111, 5), (7, 989, 33)])
def test_logit_bias_formula(device, dtype, B, V, n):
    rng = np.random.default_rng(B * V)
    logits, l64 = rand((B, V), dtype, device, seed=n)
    ids = np.stack([rng.permutation(V)[:n] for _ in range(B)]).astype(np.int64)
    ids[rng.random(ids.shape) < 0.2] = -1  # padding
    bias = rng.standard_normal((B, n)).astype(np.float32) * 3
    bias[0, 0] = -np.inf  # a banned token
    llaisys.ops.logit_bias(logits, llaisys.tensor(ids, device), llaisys.tensor(bias, device))
    ref = reference(l64, ids, bias, dtype)
    np.testing.assert_array_equal(bits(logits), ref.view(f"u{ref.itemsize}"))


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_strided_logits_and_empty(device):
    base, b64 = rand((40, 4), "f32", device, seed=3)
    view = base.transpose(0, 1)  # [4, 40] with strides (1, 4): updated in place, no copy
    ids = np.array([[0, 5], [19, -1], [1, 2], [-1, -1]], dtype=np.int64)
    bias = np.ones((4, 2), dtype=np.float32)
    llaisys.ops.logit_bias(view, llaisys.tensor(ids, device), llaisys.tensor(bias, device))
    ref = b64.copy()
    for b in range(4):
        for j in range(2):
            if ids[b, j] >= 0:
                ref[ids[b, j], b] += 1
    np.testing.assert_array_equal(base.to("cpu").numpy(), ref.astype(np.float32))
    llaisys.ops.logit_bias(view, llaisys.tensor(np.zeros((4, 0), np.int64), device),
                           llaisys.tensor(np.zeros((4, 0), np.float32), device))
    np.testing.assert_array_equal(base.to("cpu").numpy(), ref.astype(np.float32))


def test_logit_bias_errors():
    logits, _ = rand((2, 10), "f32")
    ids = llaisys.tensor(np.array([[1], [10]], dtype=np.int64))
    bias = llaisys.tensor(np.zeros((2, 1), np.float32))
    with pytest.raises(IndexError, match="out of range"):
        llaisys.ops.logit_bias(logits, ids, bias)
    with pytest.raises((TypeError, ValueError), match="bias"):
        llaisys.ops.logit_bias(logits, llaisys.tensor(np.zeros((2, 1), np.int64)),
                               llaisys.tensor(np.zeros((2, 2), np.float32)))
    with pytest.raises((TypeError, ValueError), match="ids"):
        llaisys.ops.logit_bias(logits, llaisys.tensor(np.zeros((2, 1), np.int32)), bias)
