"""llaisys.functional: the allocating forms return what the out-parameter ops write (NumPy references)."""
import numpy as np

import llaisys
import llaisys.functional as F
from utils import assert_close, rand


def test_allocating_forms_match_formulas():
    x, rx = rand((3, 19), seed=1)
    w, rw = rand((7, 19), seed=2)
    b, rb = rand((7,), seed=3)
    assert_close(F.linear(x, w, b), rx @ rw.T + rb, "f32", atol=1e-4)
    assert_close(F.add(x, x), 2 * rx, "f32")
    nw, rnw = rand((19,), seed=4)
    assert_close(F.rms_norm(x, nw, 1e-6), rx / np.sqrt((rx**2).mean(-1, keepdims=True) + 1e-6) * rnw, "f32")
    g, rg = rand((3, 19), seed=5)
    assert_close(F.swiglu(g, x), rx * rg / (1 + np.exp(-rg)), "f32")
    idx, val = F.argmax(x)
    np.testing.assert_array_equal(idx.numpy(), rx.argmax(-1))
    table, rt = rand((10, 4), seed=6)
    ids = llaisys.tensor(np.array([3, 0, 9]))
    np.testing.assert_array_equal(F.embedding(ids, table).numpy(), rt[[3, 0, 9]].astype(np.float32))
    assert F.cast(x, "bf16").dtype == "bf16"
    assert F.sample(x, temperature=0).numpy().tolist() == rx.argmax(-1).tolist()


def test_attention_and_rope_shapes():
    q, _ = rand((5, 4, 8), seed=7)
    k, _ = rand((5, 2, 8), seed=8)
    out = F.self_attention(q, k, k)
    assert out.shape == (5, 4, 8)
    pos = llaisys.tensor(np.arange(5))
    assert F.rope(q, pos, 10000.0).shape == (5, 4, 8)
