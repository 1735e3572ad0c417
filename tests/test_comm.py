"""Collectives of a tensor-parallel group (llaisys/comm.hpp, ops all_reduce / all_gather; issue 30) against
NumPy float64: on the CPU the ranks are threads of this process (what CI runs), on CUDA one NCCL rank per
GPU (needs 2 or 4 GPUs). A rank that never arrives makes the others raise within the timeout, naming it,
and the group stays broken rather than hanging."""
import threading
import time

import numpy as np
import pytest

import llaisys
from llaisys import _core

TOL = {"f32": (1e-6, 1e-6), "f16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2)}  # one rounding of the f32 sum
UNIT = {"f32": 2.0**-24, "f16": 2.0**-11, "bf16": 2.0**-8}  # unit roundoff of each dtype


def run_ranks(comms, fn):
    """fn(rank, comm) on one thread per rank; the results in rank order (an exception is re-raised)."""
    out, errors = [None] * len(comms), [None] * len(comms)

    def go(r):
        try:
            out[r] = fn(r, comms[r])
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            errors[r] = e

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out, errors


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """x as the dtype holds it, back in float64 (the inputs the ranks really pass)."""
    return llaisys.tensor(x.astype(np.float32)).to(dtype).to("f32").numpy().astype(np.float64)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 19, 989, 40_000])
def test_cpu_all_reduce_sums_every_rank(world, n, dtype):
    rng = np.random.default_rng(world * 1000 + n)
    xs = [rounded(rng.standard_normal(n), dtype) for _ in range(world)]
    comms = _core.local_group("cpu", world, timeout_s=30)
    assert [c.rank for c in comms] == list(range(world)) and {c.world for c in comms} == {world}

    def fn(r, comm):
        t = llaisys.tensor(xs[r].astype(np.float32)).to(dtype)
        _core.ops.all_reduce(t, comm)
        return t.to("f32").numpy().astype(np.float64)

    out, errors = run_ranks(comms, fn)
    assert errors == [None] * world
    want = np.sum(xs, axis=0)
    rtol, atol = TOL[dtype]
    for r in range(world):
        np.testing.assert_allclose(out[r], want, rtol=rtol, atol=atol)
        np.testing.assert_array_equal(out[r], out[0])  # every rank ends with the same bits


@pytest.mark.parametrize("world", [2, 4])
def test_cpu_all_gather_concatenates_in_rank_order(world):
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(37).astype(np.float32) for _ in range(world)]
    comms = _core.local_group("cpu", world, timeout_s=30)

    def fn(r, comm):
        out = llaisys.tensor(np.full(37 * world, np.nan, np.float32))
        _core.ops.all_gather(out, llaisys.tensor(xs[r]), comm)
        return out.numpy().copy()

    out, errors = run_ranks(comms, fn)
    assert errors == [None] * world
    for r in range(world):
        np.testing.assert_array_equal(out[r], np.concatenate(xs))


def test_many_calls_in_a_row_stay_in_step():
    comms = _core.local_group("cpu", 3, timeout_s=30)

    def fn(r, comm):
        t = llaisys.tensor(np.zeros(5, np.float32))
        for i in range(200):
            t2 = llaisys.tensor(np.full(5, float(r + i), np.float32))
            _core.ops.all_reduce(t2, comm)
            t = t2
        return t.numpy().copy()

    out, errors = run_ranks(comms, fn)
    assert errors == [None] * 3
    for r in range(3):
        np.testing.assert_array_equal(out[r], np.full(5, 0 + 1 + 2 + 3 * 199, np.float32))


def test_a_rank_that_never_arrives_fails_the_others_within_the_timeout():
    comms = _core.local_group("cpu", 3, timeout_s=0.5)

    def fn(r, comm):
        if r == 2:
            return "absent"
        _core.ops.all_reduce(llaisys.tensor(np.ones(4, np.float32)), comm)

    t0 = time.perf_counter()
    _, errors = run_ranks(comms, fn)
    assert time.perf_counter() - t0 < 10
    for r in (0, 1):
        assert isinstance(errors[r], RuntimeError) and "rank(s) 2, which never arrived" in str(errors[r])
    with pytest.raises(RuntimeError, match="the group is broken"):  # later calls raise at once
        _core.ops.all_reduce(llaisys.tensor(np.ones(4, np.float32)), comms[2])


def test_mismatched_shapes_raise_on_every_rank():
    comms = _core.local_group("cpu", 2, timeout_s=30)

    def fn(r, comm):
        _core.ops.all_reduce(llaisys.tensor(np.ones(4 + r, np.float32)), comm)

    _, errors = run_ranks(comms, fn)
    for e in errors:
        assert isinstance(e, ValueError) and "every rank must pass the same shape and dtype" in str(e)


def test_bad_arguments():
    comm = _core.local_group("cpu", 1)[0]
    x = llaisys.tensor(np.ones(4, np.float32))
    _core.ops.all_reduce(x, comm)  # a group of one: nothing to do
    np.testing.assert_array_equal(x.numpy(), np.ones(4))
    with pytest.raises(TypeError, match="all_reduce: x must be f32, f16 or bf16"):
        _core.ops.all_reduce(llaisys.tensor(np.ones(4, np.int64)), comm)
    with pytest.raises(ValueError, match="all_reduce: x must be contiguous"):
        _core.ops.all_reduce(llaisys.tensor(np.ones((4, 4), np.float32)).permute(1, 0), comm)
    with pytest.raises(ValueError, match="all_gather: out has 3 elements"):
        _core.ops.all_gather(llaisys.tensor(np.ones(3, np.float32)), x, comm)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="world must be >= 1"):
            _core.local_group("cpu", bad)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        _core.local_group("cpu", 2, timeout_s=0)


def test_build_info_says_whether_nccl_is_there():
    info = llaisys.build_info()
    assert "nccl" in info
    if not info["cuda"]:
        assert info["nccl"] is None
        with pytest.raises(Exception, match="CUDA|NCCL"):
            _core.local_group("cuda", 2)


def _gpus():
    try:
        return llaisys.cuda_device_count()
    except Exception:
        return 0


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_cuda_all_reduce_and_gather_over_nccl(world, dtype):
    if _gpus() < world or llaisys.build_info()["nccl"] is None:
        pytest.skip(f"needs {world} GPUs and a build with NCCL")
    rng = np.random.default_rng(world)
    xs = [rounded(rng.standard_normal(4099), dtype) for _ in range(world)]
    comms = _core.local_group("cuda", world)

    def fn(r, comm):
        dev = f"cuda:{r}"
        t = llaisys.tensor(xs[r].astype(np.float32)).to(dev).to(dtype)
        _core.ops.all_reduce(t, comm)
        g = llaisys.tensor(np.full(16 * world, np.nan, np.float32)).to(dev)
        _core.ops.all_gather(g, llaisys.tensor(np.arange(16, dtype=np.float32) + 100 * r).to(dev), comm)
        llaisys.synchronize(dev)
        return t.to("f32").to("cpu").numpy().astype(np.float64), g.to("cpu").numpy().copy()

    out, errors = run_ranks(comms, fn)  # one thread per GPU: each rank's NCCL call from its own thread
    assert errors == [None] * world
    rtol, atol = TOL[dtype]
    for r in range(world):
        np.testing.assert_allclose(out[r][0], np.sum(xs, axis=0), rtol=rtol, atol=atol)
        np.testing.assert_array_equal(out[r][1], np.concatenate([np.arange(16) + 100 * k for k in range(world)]))


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("peer", [True, False])
def test_cuda_all_reduce_sizes_peer_memory_and_nccl(world, dtype, peer, monkeypatch):
    """Sizes that take each path of the one-shot peer-memory kernel (a lone element, odd counts element by
    element, 16-byte units) and one past its limit (NCCL), each reduced several times in a row (the kernel's two
    buffers alternate by call): every rank gets the NumPy float64 sum within one rounding, and all ranks the
    same bits (they must agree on every token). peer=False: NCCL for all sizes."""
    if _gpus() < world or llaisys.build_info()["nccl"] is None:
        pytest.skip(f"needs {world} GPUs and a build with NCCL")
    monkeypatch.setenv("LLAISYS_PEER_ALLREDUCE", "1" if peer else "0")
    comms = _core.local_group("cuda", world)
    if peer and "peer memory" not in comms[0].backend:
        pytest.skip(f"these GPUs cannot reach each other's memory ({comms[0].backend})")
    assert peer or "peer memory" not in comms[0].backend
    rng = np.random.default_rng(7 * world)
    sizes = [1, 4099, 4096, 3584 * 8, 3 * 2**17 + 5]  # the last is past the kernel's 512 KiB: NCCL
    cases = [[rounded(rng.standard_normal(n), dtype) for _ in range(world)] for n in sizes for _ in range(3)]

    def fn(r, comm):
        dev, outs = f"cuda:{r}", []
        for xs in cases:
            t = llaisys.tensor(xs[r].astype(np.float32)).to(dev).to(dtype)
            _core.ops.all_reduce(t, comm)
            outs.append(t)
        llaisys.synchronize(dev)
        return [t.to("f32").to("cpu").numpy().astype(np.float64) for t in outs]

    out, errors = run_ranks(comms, fn)
    assert errors == [None] * world
    rtol, atol = TOL[dtype]
    for k, xs in enumerate(cases):
        exact = np.sum(xs, axis=0)
        if peer and sizes[k // 3] != sizes[-1]: # the peer kernel sums in f32 and rounds once
            np.testing.assert_allclose(out[0][k], exact, rtol=rtol, atol=atol, err_msg=f"case {k}")
        else: # NCCL's ring rounds each partial sum to the dtype: up to world - 1 roundings of a partial,
            # each within the unit roundoff of |partial| <= sum |x_i| (4 ranks in bf16 exceed one rounding)
            bound = atol + rtol * np.abs(exact) + (world - 1) * UNIT[dtype] * np.sum(np.abs(xs), axis=0)
            worst = np.max(np.abs(out[0][k] - exact) - bound)
            assert worst <= 0, f"case {k}: NCCL's sum off by {worst} past the rounding bound"
        for r in range(1, world):
            np.testing.assert_array_equal(out[r][k], out[0][k], err_msg=f"case {k}, rank {r}")
