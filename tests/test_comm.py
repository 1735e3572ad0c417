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


def _signed_zero_inputs(rng, n, world, dtype):
    """Each rank's input of n elements as the dtype holds it (float64), with -0.0 and +0.0 mixed in: every 5th
    element is -0.0 on every rank (its sum is a zero, and the push kernel must not take the data for its
    empty-slot sentinel and wait forever), others are a zero of either sign on some ranks."""
    xs = [rounded(rng.standard_normal(n), dtype) for _ in range(world)]
    for r, x in enumerate(xs):
        x[::5] = -0.0
        pick = rng.random(n) < 0.15
        x[pick] = np.where(rng.random(int(pick.sum())) < 0.5, -0.0, 0.0)
    return xs


def _peer_group(world, push, monkeypatch):
    """A CUDA group with the peer kernels on and push on or off (LLAISYS_PEER_ALLREDUCE_PUSH), or a skip."""
    if _gpus() < world or llaisys.build_info()["nccl"] is None:
        pytest.skip(f"needs {world} GPUs and a build with NCCL")
    monkeypatch.setenv("LLAISYS_PEER_ALLREDUCE", "1")
    monkeypatch.setenv("LLAISYS_PEER_ALLREDUCE_PUSH", "1" if push else "0")
    comms = _core.local_group("cuda", world)
    if "peer memory" not in comms[0].backend:
        pytest.skip(f"these GPUs cannot reach each other's memory ({comms[0].backend})")
    assert ("push up to 512 KiB" in comms[0].backend) == push, comms[0].backend
    return comms


PEER_MAX = 512 * 1024  # the default LLAISYS_PEER_ALLREDUCE_KB, and the push kernel's limit


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("path", ["push", "pull"])
def test_cuda_push_and_pull_kernels_sum_every_rank(world, dtype, path, monkeypatch):
    """Each peer kernel forced (push: LLAISYS_PEER_ALLREDUCE_PUSH=1, pull: =0) over a lone element, odd counts
    (the tail of a 16-byte unit), a decode step's [1, 3584], a batch-64 step's [64, 3584] (f32: past 512 KiB,
    NCCL) and a misaligned x (one element into its buffer), three calls of each with new data, 18 in a row (the
    push kernel's three phases wrap six times; sizes change between calls, so a phase's slots are reused by
    other sizes), with -0.0 and +0.0 in the inputs: the NumPy float64 sum within one rounding, every rank the
    same bits, and the path counters say which kernel ran."""
    comms = _peer_group(world, path == "push", monkeypatch)
    rng = np.random.default_rng(world * 100 + len(dtype))
    elem = 4 if dtype == "f32" else 2
    sizes = [(1, 0), (19, 0), (989, 0), (3584, 0), (64 * 3584, 0), (989, 1)]  # (count, elements of offset)
    cases = [(n, off, _signed_zero_inputs(rng, n, world, dtype)) for n, off in sizes for _ in range(3)]

    def fn(r, comm):
        dev, outs = f"cuda:{r}", []
        for n, off, xs in cases:
            base = np.concatenate([np.full(off, 7.0), xs[r]]).astype(np.float32)
            t = llaisys.tensor(base).to(dev).to(dtype).slice(0, off, off + n)
            _core.ops.all_reduce(t, comm)
            outs.append(t)
        llaisys.synchronize(dev)
        return [t.to("f32").to("cpu").numpy().astype(np.float64) for t in outs], comm.all_reduce_paths

    out, errors = run_ranks(comms, fn)
    assert errors == [None] * world
    rtol, atol = TOL[dtype]
    for k, (n, _, xs) in enumerate(cases):
        exact = np.sum(xs, axis=0)
        if n * elem <= PEER_MAX:  # a peer kernel: f32 sum in rank order, one rounding
            np.testing.assert_allclose(out[0][0][k], exact, rtol=rtol, atol=atol, err_msg=f"case {k}")
        else:  # NCCL: up to world - 1 roundings of a partial sum (test_cuda_all_reduce_sizes_peer_memory_and_nccl)
            bound = atol + rtol * np.abs(exact) + (world - 1) * UNIT[dtype] * np.sum(np.abs(xs), axis=0)
            assert np.max(np.abs(out[0][0][k] - exact) - bound) <= 0, f"case {k}"
        for r in range(1, world):
            np.testing.assert_array_equal(out[r][0][k], out[0][0][k], err_msg=f"case {k}, rank {r}")
    peer_calls = sum(1 for n, _, _ in cases if n * elem <= PEER_MAX)
    want = {"push": 0, "pull": 0, "nccl": len(cases) - peer_calls}
    want[path] = peer_calls
    for r in range(world):
        assert out[r][1] == want, f"rank {r}: {out[r][1]}"


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
def test_cuda_push_and_pull_give_the_same_bits(world, monkeypatch):
    """Both kernels add the ranks' inputs in rank order in f32 and round once (push reads -0.0 as +0.0, which a
    sum cannot tell apart): on the same inputs their results are equal bit for bit."""
    rng = np.random.default_rng(world)
    cases = [_signed_zero_inputs(rng, n, world, "bf16") for n in (3, 3584, 8 * 3584)]
    results = {}
    for push in (True, False):
        comms = _peer_group(world, push, monkeypatch)

        def fn(r, comm):
            ts = [llaisys.tensor(xs[r].astype(np.float32)).to(f"cuda:{r}").to("bf16") for xs in cases]
            for t in ts:
                _core.ops.all_reduce(t, comm)
            return [t.to("f32").to("cpu").numpy().copy() for t in ts]

        out, errors = run_ranks(comms, fn)
        assert errors == [None] * world
        results[push] = out[0]
        for k, xs in enumerate(cases):
            np.testing.assert_allclose(out[0][k], np.sum(xs, axis=0), rtol=TOL["bf16"][0], atol=TOL["bf16"][1])
    for k in range(len(cases)):
        np.testing.assert_array_equal(results[True][k], results[False][k], err_msg=f"case {k}")


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("path", ["push", "pull"])
def test_cuda_peer_all_reduce_replayed_from_a_cuda_graph(world, path, monkeypatch):
    """The engine captures its all-reduces into CUDA graphs: here each rank captures one all-reduce of a
    [1, 3584] bf16 x into a graph and replays it 12 times with new data each time (copied into x before the
    replay), with an eager all-reduce of another size between some replays. The kernels' phase/epoch counters
    live in device memory, so replays and eager calls advance them alike and the ranks stay in step: every
    result is the NumPy sum. The captured call counts once in the path counters."""
    comms = _peer_group(world, path == "push", monkeypatch)
    rng = np.random.default_rng(3 * world)
    n, steps = 3584, 12
    data = [_signed_zero_inputs(rng, n, world, "bf16") for _ in range(steps)]
    extra = [_signed_zero_inputs(rng, 989, world, "bf16") for _ in range(steps)]
    barrier = threading.Barrier(world)

    def fn(r, comm):
        dev = f"cuda:{r}"
        x = llaisys.tensor(np.zeros(n, np.float32)).to(dev).to("bf16")
        srcs = [llaisys.tensor(xs[r].astype(np.float32)).to(dev).to("bf16") for xs in data]
        llaisys.synchronize(dev)
        graph = _core.Graph(dev)
        barrier.wait()  # nobody copies from the host while another rank captures
        graph.capture(lambda: _core.ops.all_reduce(x, comm))
        barrier.wait()
        outs, extras = [], []
        for i in range(steps):
            x.copy_(srcs[i])
            graph.replay()
            outs.append(x.to("f32").to("cpu").numpy().astype(np.float64))
            if i % 3 == 1:
                e = llaisys.tensor(extra[i][r].astype(np.float32)).to(dev).to("bf16")
                _core.ops.all_reduce(e, comm)
                extras.append(e.to("f32").to("cpu").numpy().astype(np.float64))
        return outs, extras, comm.all_reduce_paths

    out, errors = run_ranks(comms, fn)
    assert errors == [None] * world
    rtol, atol = TOL["bf16"]
    for r in range(world):
        for i in range(steps):
            np.testing.assert_allclose(out[r][0][i], np.sum(data[i], axis=0), rtol=rtol, atol=atol,
                                       err_msg=f"rank {r}, replay {i}")
        for j, i in enumerate(range(1, steps, 3)):
            np.testing.assert_allclose(out[r][1][j], np.sum(extra[i], axis=0), rtol=rtol, atol=atol,
                                       err_msg=f"rank {r}, eager call after replay {i}")
        assert out[r][2] == {"push": 0, "pull": 0, "nccl": 0, path: 1 + len(out[r][1])}, out[r][2]


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["push", "pull"])
def test_cuda_peer_kernel_waiting_for_a_rank_that_never_comes_ends_on_abort(path, monkeypatch):
    """Rank 0 all-reduces and rank 1 never does: rank 0's kernel waits on the GPU for data (push) or a flag
    (pull) that never comes. Aborting the group (what the engine does when a rank fails or stalls) raises the
    mapped host flag the kernel polls, so the kernel leaves and rank 0's device synchronizes instead of hanging
    (alone it would wait the kernel's 120 s timeout); later calls raise the abort's reason."""
    comms = _peer_group(2, path == "push", monkeypatch)
    x = llaisys.tensor(np.ones(3584, np.float32)).to("cuda:0").to("bf16")
    llaisys.synchronize("cuda:0")
    _core.ops.all_reduce(x, comms[0])  # enqueued; rank 1 never calls
    assert comms[0].all_reduce_paths[path] == 1
    time.sleep(0.5)  # the kernel is polling by now (an abort raised before it starts must end it too)
    for c in comms:
        c.abort("test: rank 1 never came")
    waiter = threading.Thread(target=llaisys.synchronize, args=("cuda:0",))
    waiter.start()
    waiter.join(60)
    assert not waiter.is_alive(), f"rank 0's {path} kernel did not leave on abort"
    with pytest.raises(RuntimeError, match="rank 1 never came"):
        _core.ops.all_reduce(x, comms[0])


def test_graph_needs_cuda():
    with pytest.raises(Exception, match="CUDA graphs need"):  # a CPU build, or a CPU device on a CUDA build
        _core.Graph("cpu")


def test_cpu_groups_count_no_paths():
    assert _core.local_group("cpu", 2)[0].all_reduce_paths == {}
