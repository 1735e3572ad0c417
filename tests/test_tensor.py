"""Tensor core through Python: views, copies, zero-copy exchange, memory statistics, errors."""
import os

import numpy as np
import pytest

import llaisys
from utils import DEVICES, NP_DTYPE, needs_caching_allocator


def test_numpy_roundtrip_is_zero_copy():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    t = llaisys.tensor(a)
    assert t.data_ptr() == a.ctypes.data
    assert t.shape == (2, 3, 4) and t.strides == (12, 4, 1) and t.dtype == "f32" and t.device == "cpu"
    n = t.numpy()
    assert n.ctypes.data == a.ctypes.data
    a[0, 0, 0] = 42.0  # shared memory: the write shows through both
    assert t.numpy()[0, 0, 0] == 42.0


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i32", "i64", "u8", "bool"])
def test_every_dtype_roundtrips(dtype):
    a = (np.arange(10) % 3).astype(NP_DTYPE[dtype])
    t = llaisys.tensor(a)
    assert t.dtype == dtype
    back = t.numpy()
    assert back.dtype == a.dtype and np.array_equal(back, a) and back.ctypes.data == a.ctypes.data


def test_torch_dlpack_zero_copy_both_ways():
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 5).to(torch.bfloat16)
    t = llaisys.from_dlpack(x)
    assert t.data_ptr() == x.data_ptr() and t.dtype == "bf16"
    y = torch.from_dlpack(t)
    assert y.data_ptr() == x.data_ptr() and y.dtype == torch.bfloat16 and torch.equal(x, y)
    s = t.slice(1, 1, 4)  # a strided view keeps its offset and strides through DLPack
    ys = torch.from_dlpack(s)
    assert torch.equal(ys, x[:, 1:4]) and ys.stride() == x[:, 1:4].stride()


def test_views_and_offsets():
    a = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    t = llaisys.tensor(a)
    s = t.slice(0, 1, 3).slice(2, 1, 4)
    assert s.offset == (20 + 1) * 4
    np.testing.assert_array_equal(s.contiguous().numpy(), a[1:3, :, 1:4])
    np.testing.assert_array_equal(t.permute(2, 0, 1).contiguous().numpy(), a.transpose(2, 0, 1))
    np.testing.assert_array_equal(t.transpose(0, 2).reshape(-1).numpy(), a.transpose(2, 1, 0).reshape(-1))
    np.testing.assert_array_equal(t.select(1, -1).numpy(), a[:, -1])
    # a view of a slice keeps the slice's offset
    np.testing.assert_array_equal(t.slice(0, 2, 3).view(4, 5).numpy(), a[2])


def test_view_errors():
    t = llaisys.tensor(np.zeros((4, 6), np.float32)).transpose(0, 1)
    with pytest.raises(ValueError, match="incompatible with the strides"):
        t.view(24)
    with pytest.raises(ValueError, match="cannot reshape"):
        t.reshape(5, 5)
    with pytest.raises(IndexError):
        t.slice(0, 3, 99)
    with pytest.raises(IndexError):
        t.transpose(0, 5)
    with pytest.raises(ValueError, match="repeated"):
        t.permute(0, 0)


def test_negative_strides_and_bad_dtypes_are_rejected():
    with pytest.raises(ValueError, match="negative strides"):
        llaisys.tensor(np.arange(5, dtype=np.float32)[::-1])
    with pytest.raises(TypeError, match="unsupported dtype"):
        llaisys.tensor(np.zeros(3, np.float64))
    with pytest.raises(TypeError, match="not a DLPack producer"):
        llaisys.from_dlpack([1, 2, 3])


def test_cuda_in_cpu_build_says_how_to_rebuild():
    if llaisys.build_info()["cuda"]:
        pytest.skip("this build has CUDA")
    with pytest.raises(RuntimeError, match="LLAISYS_CUDA=ON"):
        llaisys.empty((2,), device="cuda")


def test_build_info_fields():
    info = llaisys.build_info()
    for key in ("version", "cuda", "cuda_version", "cuda_archs", "compiler", "cpu_threads"):
        assert key in info
    assert info["cpu_threads"] == len(os.sched_getaffinity(0))  # the default: every core this process may use


@pytest.mark.parametrize("device", DEVICES)
def test_copy_between_strides_and_devices(device):
    a = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    t = llaisys.tensor(a).to(device)
    out = llaisys.empty((7, 5), "f32", device).transpose(0, 1)  # non-contiguous destination
    out.copy_(t)
    np.testing.assert_array_equal(out.to("cpu").numpy(), a)
    half = llaisys.empty((5, 3), "f32", "cpu")
    half.copy_(t.slice(1, 2, 5))
    np.testing.assert_array_equal(half.numpy(), a[:, 2:5])
    f = llaisys.empty((2, 3), "bf16", device).fill_(1.5)
    np.testing.assert_array_equal(f.to("cpu").numpy().astype(np.float32), np.full((2, 3), 1.5, np.float32))


def test_cpu_memory_stats_and_alignment():
    before = llaisys.memory_stats("cpu")["allocated"]
    t = llaisys.empty((1000,), "f32")
    assert t.data_ptr() % 64 == 0
    assert llaisys.memory_stats("cpu")["allocated"] >= before + 4000
    del t
    assert llaisys.memory_stats("cpu")["allocated"] == before


@pytest.mark.cuda
@needs_caching_allocator
def test_cuda_steady_state_needs_no_device_malloc():
    dev = "cuda:0"
    a = llaisys.tensor(np.ones((256, 1024), np.float32), dev)

    def step():
        x = llaisys.empty((256, 1024), "f32", dev)
        llaisys.ops.add(x, a, a)
        y = llaisys.empty((256, 1024), "f32", dev)
        llaisys.ops.add(y, x, a)
        return y

    y = step()
    y = step()  # the loop below holds the previous y while a step runs: warm up in that same pattern
    llaisys.synchronize(dev)
    mallocs = llaisys.memory_stats(dev)["device_mallocs"]
    for _ in range(50):
        y = step()
    llaisys.synchronize(dev)
    assert llaisys.memory_stats(dev)["device_mallocs"] == mallocs
    np.testing.assert_array_equal(y.to("cpu").numpy(), np.full((256, 1024), 3, np.float32))
    stats = llaisys.memory_stats(dev)
    assert stats["peak"] >= stats["allocated"] > 0 and stats["reserved"] >= stats["allocated"]
    del y
    llaisys.empty_cache(dev)
    assert llaisys.memory_stats(dev)["device_frees"] > 0


@pytest.mark.cuda
def test_cuda_out_of_memory_is_memory_error():
    with pytest.raises(MemoryError, match="out of memory"):
        llaisys.empty((1 << 50,), "u8", "cuda")


@pytest.mark.cuda
def test_torch_cuda_dlpack_zero_copy():
    torch = pytest.importorskip("torch")
    x = torch.randn(64, 33, device="cuda")
    t = llaisys.from_dlpack(x)
    assert t.device == "cuda:0" and t.data_ptr() == x.data_ptr()
    out = llaisys.empty((64, 33), "f32", "cuda")
    llaisys.ops.add(out, t, t)
    y = torch.from_dlpack(out)
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y, 2 * x)


@pytest.mark.cuda
def test_cuda_streams_and_events():
    dev = "cuda:0"
    s = llaisys.new_stream(dev)
    old = llaisys.current_stream(dev)
    start, end = llaisys.Event(dev, timing=True), llaisys.Event(dev, timing=True)
    llaisys.set_current_stream(s)
    try:
        start.record(s)
        a = llaisys.tensor(np.ones((1024, 1024), np.float32), dev)
        out = llaisys.empty((1024, 1024), "f32", dev)
        llaisys.ops.add(out, a, a)
        end.record(s)
        end.synchronize()
        assert end.query() and start.elapsed_ms(end) >= 0
    finally:
        llaisys.set_current_stream(old)
    np.testing.assert_array_equal(out.to("cpu").numpy()[:2, :2], np.full((2, 2), 2, np.float32))


@pytest.mark.cuda
def test_host_wait_inside_a_graph_capture_raises_and_capture_ends_cleanly():
    """A synchronize while llaisys' stream is being captured (here by torch, on that stream) raises a clear
    error instead of invalidating the capture in the driver; the stream works normally afterwards."""
    torch = pytest.importorskip("torch")
    stream = llaisys.current_stream("cuda")
    assert not stream.capturing and not llaisys.current_stream("cpu").capturing
    seen = []
    for wait in (lambda: llaisys.synchronize("cuda"), stream.synchronize):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="being captured into a CUDA graph"):
            with torch.cuda.graph(graph, stream=torch.cuda.ExternalStream(stream.handle)):
                seen.append(stream.capturing)
                wait()
    assert seen == [True, True] and not stream.capturing
    a = llaisys.tensor(np.arange(6, dtype=np.float32), "cuda")
    out = llaisys.empty((6,), "f32", "cuda")
    llaisys.ops.add(out, a, a)
    llaisys.synchronize("cuda")
    np.testing.assert_array_equal(out.to("cpu").numpy(), 2 * np.arange(6, dtype=np.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_add_matches_numpy(device, dtype):
    from utils import assert_close, poisoned, rand

    a, ra = rand((19, 111), dtype, device, seed=1)
    b, rb = rand((19, 111), dtype, device, seed=2)
    out = poisoned((19, 111), dtype, device)
    llaisys.ops.add(out, a, b)
    assert_close(out, ra + rb, dtype)
    # non-contiguous inputs and output
    out_t = poisoned((111, 19), dtype, device).transpose(0, 1)
    llaisys.ops.add(out_t, a.transpose(0, 1).contiguous().transpose(0, 1), b)
    assert_close(out_t, ra + rb, dtype)


def test_add_errors():
    a = llaisys.zeros((3, 4))
    with pytest.raises(ValueError, match="add: b must have shape"):
        llaisys.ops.add(a, a, llaisys.zeros((4, 3)))
    with pytest.raises(TypeError, match="add: a must be f32, f16 or bf16"):
        llaisys.ops.add(llaisys.zeros((3,), "i64"), llaisys.zeros((3,), "i64"), llaisys.zeros((3,), "i64"))


def test_read_only_arrays_are_rejected_not_made_writable():
    a = np.zeros(4, np.float32)
    a.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        llaisys.tensor(a)
    assert llaisys.tensor(np.array(a)).numpy().flags.writeable
