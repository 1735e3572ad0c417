"""embedding: out [n, D] = weight [V, D][ids], an exact (bit-equal) row copy; ids out of range raise."""
import numpy as np
import pytest

import llaisys
from llaisys import ops
from utils import DEVICES, FLOAT_DTYPES, NP_DTYPE, poisoned, rand

UINT = {"f32": np.uint32, "f16": np.uint16, "bf16": np.uint16}


def bits(t, dtype):
    """The raw bits of a float tensor, so NaN rows and signed zeros compare exactly."""
    return np.ascontiguousarray(t.to("cpu").numpy()).view(UINT[dtype])


def ids_tensor(values, id_dtype, device):
    return llaisys.tensor(np.asarray(values, NP_DTYPE[id_dtype]), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("id_dtype", ["i64", "i32"])
@pytest.mark.parametrize("D", [1, 19, 896])
def test_embedding_is_an_exact_row_copy(device, dtype, id_dtype, D):
    V = 111
    w, w64 = rand((V, D), dtype, device, seed=D)
    ids = np.array([0, 110, 5, 5, 37, 0, 109, 64, 3], np.int64)  # repeats, first and last rows
    out = poisoned((len(ids), D), dtype, device)
    ops.embedding(out, ids_tensor(ids, id_dtype, device), w)
    np.testing.assert_array_equal(bits(out, dtype), bits(w, dtype)[ids])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_embedding_copies_nan_inf_and_signed_zero_bits(device, dtype):
    a = np.array([[np.nan, np.inf, -np.inf, -0.0], [1.0, -2.5, 0.0, 3.0]]).astype(NP_DTYPE[dtype])
    w = llaisys.tensor(a, device)
    out = poisoned((3, 4), dtype, device)
    ops.embedding(out, ids_tensor([1, 0, 0], "i64", device), w)
    np.testing.assert_array_equal(bits(out, dtype), bits(w, dtype)[[1, 0, 0]])


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_strided_ids_weight_and_out(device):
    V, D = 50, 19
    wt, wt64 = rand((D, V), "f32", device, seed=1)
    w = wt.transpose(0, 1)  # [V, D], not contiguous
    ids2 = np.array([[4, -1], [49, -1], [0, -1], [17, -1]], np.int64)
    ids = llaisys.tensor(ids2, device).select(1, 0)  # stride 2
    big = poisoned((4, D + 5), "f32", device)
    out = big.slice(1, 2, D + 2)  # [4, D] with row stride D + 5
    ops.embedding(out, ids, w)
    np.testing.assert_array_equal(out.to("cpu").numpy(), wt64.T[ids2[:, 0]].astype(np.float32))
    assert np.isnan(big.to("cpu").numpy()[:, :2]).all(), "wrote outside the out view"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_embedding_unaligned_table_rows(device, dtype):
    # A table that starts one row into its storage: with D = 3, rows start at 6- or 12-byte offsets, so
    # the CUDA kernel must fall back from 16-byte copies to narrower words.
    full, full64 = rand((20, 3), dtype, device, seed=2)
    w = full.slice(0, 1, 20)
    out = poisoned((5, 3), dtype, device)
    ids = np.array([0, 18, 7, 7, 2])
    ops.embedding(out, ids_tensor(ids, "i64", device), w)
    np.testing.assert_array_equal(bits(out, dtype), bits(full, dtype)[1:][ids])


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_empty_ids_is_a_no_op(device):
    w, _ = rand((10, 4), "f32", device)
    out = llaisys.empty([0, 4], "f32", device)
    ops.embedding(out, ids_tensor(np.zeros(0), "i64", device), w)


@pytest.mark.parametrize("bad", [-1, 10, 2**40])
def test_embedding_id_out_of_range_raises_on_cpu(bad):
    w, _ = rand((10, 4), "f32")
    out = poisoned((3, 4), "f32")
    with pytest.raises(IndexError, match=rf"embedding: id {bad} at position 1 is out of range .* 10 rows"):
        ops.embedding(out, ids_tensor([2, bad, 3], "i64", "cpu"), w)
    with pytest.raises(IndexError, match=r"id -3 at position 0"):
        ops.embedding(out, ids_tensor([-3, 1, 2], "i32", "cpu"), w)


@pytest.mark.cuda
@pytest.mark.parametrize("bad", [-1, 10])
@pytest.mark.parametrize("id_dtype", ["i64", "i32"])
def test_embedding_id_out_of_range_raises_at_cuda_synchronize(bad, id_dtype):
    w, w64 = rand((10, 8), "bf16", "cuda")
    out = poisoned((3, 8), "bf16", "cuda")
    ops.embedding(out, ids_tensor([2, bad, 3], id_dtype, "cuda"), w)  # no host sync: nothing raised yet
    with pytest.raises(IndexError, match="embedding: an id is out of range"):
        llaisys.synchronize("cuda")
    got = out.to("cpu").numpy().astype(np.float64)
    np.testing.assert_array_equal(got[1], 0.0)  # the bad row is zero-filled, so the output is defined
    np.testing.assert_array_equal(got[[0, 2]], w64[[2, 3]])
    # The flag is cleared by the synchronize that reported it.
    ops.embedding(out, ids_tensor([1, 2, 3], id_dtype, "cuda"), w)
    llaisys.synchronize("cuda")
    np.testing.assert_array_equal(out.to("cpu").numpy().astype(np.float64), w64[[1, 2, 3]])


def test_embedding_argument_errors():
    w, _ = rand((10, 4), "f32")
    ids = ids_tensor([1, 2], "i64", "cpu")
    out = poisoned((2, 4), "f32")
    with pytest.raises(TypeError, match="embedding: ids must be i64 or i32, got f32"):
        ops.embedding(out, llaisys.tensor(np.array([1.0, 2.0], np.float32)), w)
    with pytest.raises(ValueError, match="embedding: ids must be 1-D"):
        ops.embedding(poisoned((1, 2, 4), "f32"), ids_tensor([[1, 2]], "i64", "cpu"), w)
    with pytest.raises(ValueError, match="embedding: weight must be 2-D"):
        ops.embedding(out, ids, llaisys.tensor(np.zeros(10, np.float32)))
    with pytest.raises(ValueError, match=r"embedding: out must have shape \[2, 4\], got \[2, 5\]"):
        ops.embedding(poisoned((2, 5), "f32"), ids, w)
    with pytest.raises(TypeError, match="embedding: out must have dtype f32"):
        ops.embedding(poisoned((2, 4), "bf16"), ids, w)
    with pytest.raises(TypeError, match="embedding: weight must be f32, f16 or bf16"):
        ops.embedding(llaisys.empty([2, 4], "i64"), ids, llaisys.tensor(np.zeros((10, 4), np.int64)))


@pytest.mark.cuda
def test_embedding_device_mismatch():
    w, _ = rand((10, 4), "f32", "cuda")
    with pytest.raises(ValueError, match="embedding: all tensors must be on one device"):
        ops.embedding(poisoned((2, 4), "f32", "cuda"), ids_tensor([1, 2], "i64", "cpu"), w)
