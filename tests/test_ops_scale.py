"""scale: out = x * alpha (the f32 product rounded once: Gemma's embedding scale) against NumPy float64."""
import numpy as np
import pytest

import llaisys
from llaisys import ops
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, assert_close, poisoned, rand, to_f64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (19,), (3, 111), (7, 989)])
def test_scale_equals_numpy(device, dtype, shape):
    x, x64 = rand(shape, dtype, device, seed=len(shape))
    out = poisoned(shape, dtype, device)
    ops.scale(out, x, 25.25)
    assert_close(out, x64 * 25.25, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_scale_in_place_and_strided(device, dtype):
    x, x64 = rand((6, 10), dtype, device, seed=3)
    view = x.slice(1, 2, 9)  # non-contiguous rows
    ref = x64.copy()
    ref[:, 2:9] *= -0.5
    ops.scale(view, view, -0.5)
    assert_close(x, ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_scale_keeps_nan_and_inf(device):
    a = np.array([np.nan, np.inf, -np.inf, -0.0, 2.0], np.float32)
    out = poisoned((5,), "f32", device)
    ops.scale(out, llaisys.tensor(a, device), 3.0)
    got = to_f64(out)
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and got[4] == 6.0


@pytest.mark.parametrize("device", DEVICES)
def test_scale_errors_name_the_problem(device):
    x = llaisys.tensor(np.ones((2, 3), NP_DTYPE["f32"]), device)
    with pytest.raises(ValueError, match="scale: alpha must be finite"):
        ops.scale(x, x, float("inf"))
    with pytest.raises(Exception, match="scale"):
        ops.scale(poisoned((3, 2), "f32", device), x, 2.0)
