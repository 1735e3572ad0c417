"""Shared test helpers: devices, dtypes, the tolerance table, random inputs and poisoned outputs.

References are NumPy float64 formulas written in each test; inputs are drawn in float64, rounded to
the tested dtype, and the reference is computed from the rounded values, so only the op's own
arithmetic is measured.
"""
from __future__ import annotations

import contextlib
import os

import ml_dtypes
import numpy as np
import pytest

import llaisys

# Every op test runs on the CPU, and on CUDA when `pytest -m cuda` runs on a GPU machine.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
FLOAT_DTYPES = ["f32", "f16", "bf16"]

# Tests of the CUDA caching allocator's steady state (no device malloc once warm) skip when a sanitizer
# run turns the cache off with LLAISYS_CUDA_ALLOC=exact (bench/gpu_check.sh sanitize).
needs_caching_allocator = pytest.mark.skipif(os.environ.get("LLAISYS_CUDA_ALLOC") == "exact",
                                             reason="LLAISYS_CUDA_ALLOC=exact turns the CUDA caching allocator off")

NP_DTYPE = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "i32": np.int32, "i64": np.int64,
            "u8": np.uint8, "bool": np.bool_}

# The one tolerance table: |out - ref| <= atol + rtol * |ref|. Outputs are rounded to the dtype
# (bf16 has 8 mantissa bits: 2^-8 ~ 3.9e-3 relative; f16 has 11: 4.9e-4), accumulation is f32.
TOL = {
    "f32": dict(atol=1e-5, rtol=1e-5),
    "f16": dict(atol=1e-3, rtol=2e-3),
    "bf16": dict(atol=8e-3, rtol=1.6e-2),
}


def rand(shape, dtype="f32", device="cpu", seed=0, scale=1.0):
    """(llaisys tensor, float64 copy of exactly the values it holds)."""
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(shape) * scale).astype(NP_DTYPE[dtype])
    return llaisys.tensor(a, device), a.astype(np.float64)


def poisoned(shape, dtype="f32", device="cpu"):
    """An output tensor pre-filled with NaN (floats) or a sentinel (ints): every element must be written."""
    t = llaisys.empty(list(shape), dtype, device)
    t.fill_(float("nan") if dtype in FLOAT_DTYPES else -7)
    return t


def bits(t) -> np.ndarray:
    """The stored bit patterns of a tensor's values, for exact comparisons (NaN == NaN, -0 != +0)."""
    a = np.ascontiguousarray(t.to("cpu").numpy())
    return a.view(f"u{a.itemsize}")


def to_f64(t) -> np.ndarray:
    return np.asarray(t.to("cpu").numpy()).astype(np.float64)


def assert_close(out, ref, dtype, atol=None, rtol=None):
    """Compare an op's output (llaisys tensor or array) with a float64 reference under TOL[dtype]."""
    got = to_f64(out) if isinstance(out, llaisys.Tensor) else np.asarray(out, np.float64)
    tol = dict(TOL[dtype])
    if atol is not None:
        tol["atol"] = atol
    if rtol is not None:
        tol["rtol"] = rtol
    assert got.shape == ref.shape, f"shape {got.shape} != reference {ref.shape}"
    assert not np.isnan(got).any() or np.isnan(ref).any(), "output has NaN (an element was not written?)"
    np.testing.assert_allclose(got, ref, **tol)


def token_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    """Random prompts of token ids, one per length (engine tests)."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


def f32_engine(path, device, overlap, **kw):
    """An f32 Engine with a fixed pool (512 blocks unless given) and max_seq_len 400 unless given."""
    from llaisys.engine.engine import Engine

    kw.setdefault("num_kv_blocks", 512)
    return Engine(path, device=device, dtype="f32", progress=False, max_seq_len=kw.pop("max_seq_len", 400),
                  overlap_steps=overlap, **kw)


@contextlib.contextmanager
def llaisys_server(args: list[str], log_path, timeout: float = 300.0):
    """`python -m llaisys.server ARGS --port P` in a child process, once /health answers 200: yields
    {"url", "port", "proc", "log"}; terminated (killed after 60 s) on exit. Fails with the log's tail if the
    server exits or does not come up within `timeout` seconds."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "llaisys.server", *args, "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, open(log_path).read()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up: " + open(log_path).read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield {"url": url, "port": port, "proc": proc, "log": log_path}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def failing_mask_fills(monkeypatch, failing: tuple[int, ...]) -> list[int]:
    """MaskFiller.fill raises on its calls numbered `failing` (1-based), else fills as usual; the returned
    list gets each call's row count (tests of a mask failure in a chained step). The lanes are off
    (LLAISYS_MASK_LANES=0; with LLAISYS_MASK_LANES=1 they never call fill: their failures are
    test_overlap_constrained.flaky_lanes')."""
    from llaisys.constraints import MaskFiller

    monkeypatch.setenv("LLAISYS_MASK_LANES", "0")
    fill, calls = MaskFiller.fill, []

    def flaky(self, constraints, mask, *args):
        calls.append(len(constraints))
        if len(calls) in failing:
            raise RuntimeError("injected")
        return fill(self, constraints, mask, *args)
    monkeypatch.setattr(MaskFiller, "fill", flaky)
    return calls
