"""index_copy: out[index[i]] = src[i] along dim 0 (the KV-cache write). A data-moving op: exact."""
import numpy as np
import pytest

import llaisys
from utils import DEVICES, NP_DTYPE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("index_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("row_shape", [(2, 64), (1,), (3, 19)])
def test_index_copy_matches_numpy(device, dtype, index_dtype, row_shape):
    rng = np.random.default_rng(0)
    base = rng.standard_normal((37, *row_shape)).astype(NP_DTYPE[dtype])
    src = rng.standard_normal((5, *row_shape)).astype(NP_DTYPE[dtype])
    index = np.array([3, 36, 0, 17, 18], index_dtype)
    out = llaisys.tensor(base.copy(), device)
    llaisys.ops.index_copy(out, llaisys.tensor(index, device), llaisys.tensor(src, device))
    want = base.copy()
    want[index] = src
    np.testing.assert_array_equal(out.to("cpu").numpy(), want)


def test_index_copy_errors_on_cpu():
    out = llaisys.zeros((4, 3))
    src = llaisys.zeros((2, 3))
    with pytest.raises(IndexError, match="index 4 at position 1"):
        llaisys.ops.index_copy(out, llaisys.tensor(np.array([0, 4])), src)
    with pytest.raises(ValueError, match="src must have shape"):
        llaisys.ops.index_copy(out, llaisys.tensor(np.array([0])), src)
    with pytest.raises(TypeError, match="index must be i64 or i32"):
        llaisys.ops.index_copy(out, llaisys.tensor(np.array([0.0, 1.0], np.float32)), src)
    with pytest.raises(ValueError, match="out must be contiguous"):
        llaisys.ops.index_copy(llaisys.zeros((3, 4)).transpose(0, 1), llaisys.tensor(np.array([0, 1])), src)


@pytest.mark.cuda
def test_index_copy_out_of_range_raises_at_synchronize_on_cuda():
    out = llaisys.zeros((4, 3), "f32", "cuda")
    llaisys.ops.index_copy(out, llaisys.tensor(np.array([1, 9]), "cuda"), llaisys.zeros((2, 3), "f32", "cuda"))
    with pytest.raises(IndexError, match="index_copy"):
        llaisys.synchronize("cuda")
    llaisys.synchronize("cuda")  # the flag was cleared: the device stays usable
