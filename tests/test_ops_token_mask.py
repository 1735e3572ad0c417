"""token_mask: logits[b, v] = -inf where bit v % 32 of mask[b, v // 32] is 0 (llguidance's allowed-token
bitmask, structured output), in place; allowed logits keep their exact bits (NaN and Inf included)."""
import numpy as np
import pytest

import llaisys
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, bits, rand


def reference(logits64, mask, dtype):
    """The NumPy formula: each word's 32 bits, low bit first, as the allowed flags of 32 ids."""
    V = logits64.shape[1]
    words = mask.astype(np.int64) & 0xFFFFFFFF
    allowed = ((words[:, :, None] >> np.arange(32)) & 1).reshape(mask.shape[0], -1)[:, :V].astype(bool)
    return np.where(allowed, logits64, -np.inf).astype(NP_DTYPE[dtype])


def random_mask(rng, B, V, density):
    allowed = rng.random((B, 32 * ((V + 31) // 32))) < density
    words = (allowed.reshape(B, -1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    return words.astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("B,V", [(1, 1), (1, 19), (3, 32), (2, 111), (5, 989), (4, 151936)])
def test_token_mask_formula(device, dtype, B, V):
    rng = np.random.default_rng(B * V)
    logits, l64 = rand((B, V), dtype, device, seed=V)
    mask = random_mask(rng, B, V, density=0.3)
    mask[0, 0] |= np.int32(-2**31)  # the sign bit is id 31's flag
    if B > 1:
        mask[1] = -1  # an unconstrained row: every logit unchanged
    llaisys.ops.token_mask(logits, llaisys.tensor(mask, device))
    ref = reference(l64, mask, dtype)
    np.testing.assert_array_equal(bits(logits), ref.view(f"u{ref.itemsize}"))


@pytest.mark.parametrize("device", DEVICES)
def test_token_mask_nan_inf_and_strided(device):
    x = np.array([[np.nan, np.inf, -np.inf, 1.0, np.nan, 2.0, 3.0]], np.float32).repeat(3, 0)
    x[1] = [4, 5, 6, 7, 8, 9, 10]
    base = llaisys.tensor(np.ascontiguousarray(x.T), device)  # [7, 3]: logits are its transpose, strides (1, 3)
    view = base.transpose(0, 1)
    mask = np.array([[0b0100011], [0b1111111], [0]], np.int32)  # row 2 allows nothing: all -inf
    llaisys.ops.token_mask(view, llaisys.tensor(mask, device))
    ref = reference(x.astype(np.float64), mask, "f32")
    np.testing.assert_array_equal(np.ascontiguousarray(base.to("cpu").numpy().T).view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("device", DEVICES)
def test_token_mask_empty_batch(device):
    logits = llaisys.tensor(np.zeros((0, 40), np.float32), device)
    llaisys.ops.token_mask(logits, llaisys.tensor(np.zeros((0, 2), np.int32), device))


def test_token_mask_errors():
    logits, _ = rand((2, 33), "f32")
    with pytest.raises((TypeError, ValueError), match="mask"):  # 33 ids need 2 words
        llaisys.ops.token_mask(logits, llaisys.tensor(np.zeros((2, 1), np.int32)))
    with pytest.raises((TypeError, ValueError), match="mask"):
        llaisys.ops.token_mask(logits, llaisys.tensor(np.zeros((3, 2), np.int32)))
    with pytest.raises((TypeError, ValueError), match="mask"):
        llaisys.ops.token_mask(logits, llaisys.tensor(np.zeros((2, 2), np.int64)))
    with pytest.raises((TypeError, ValueError), match="logits"):
        llaisys.ops.token_mask(llaisys.tensor(np.zeros((2, 33), np.int32)), llaisys.tensor(np.zeros((2, 2), np.int32)))
    with pytest.raises((TypeError, ValueError), match="logits"):
        llaisys.ops.token_mask(llaisys.tensor(np.zeros((66,), np.float32)), llaisys.tensor(np.zeros((2, 2), np.int32)))
