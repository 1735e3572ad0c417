"""The CPU pool's choice of threads never changes a result: a step's logits, greedy tokens and logprobs of the
real default model are bit equal with the pool forced onto the caller alone, forced onto the workers, and
with 1 or 3 threads (the ops' task split changes with the thread count, so every op must partition its
output so that an output element's arithmetic is the same in any split)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import llaisys
import llaisys.ops
from llaisys import _core
from tiny_model import real_model_path

pytestmark = pytest.mark.slow  # runs the real default model on the CPU

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = "def quicksort(arr):\n    # sort the list in place, then return it"


def outputs(path: str) -> dict:
    """Teacher-forced logits of the prompt (one prefill step) and 6 greedy decode steps' tokens and logprobs,
    from a fresh engine (no prefix cache shared between the runs compared)."""
    eng = llaisys.Engine(path, device="cpu", progress=False)
    try:
        ids = eng.tokenizer.encode(PROMPT, add_special_tokens=False)
        r = eng.generate(PROMPT, max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
        return {"logits": eng.score(ids), "tokens": np.array(r.token_ids),
                "logprobs": np.array([[e["logprob"]] + [lp for _, lp in e["top"]] for e in r.logprobs])}
    finally:
        eng.close()


@pytest.fixture(scope="module")
def gguf():
    return real_model_path()


@pytest.fixture
def pool_mode():
    yield _core.set_pool_mode
    _core.set_pool_mode("adaptive")


def assert_bit_equal(a: dict, b: dict):
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs"


def test_serial_and_parallel_pool_give_bit_equal_steps(gguf, pool_mode):
    if llaisys.build_info()["cpu_threads"] < 2:
        pytest.skip("one thread: the pool never runs on workers")
    runs = {}
    for mode in ("serial", "parallel"):
        pool_mode(mode)
        before = _core.pool_stats()
        runs[mode] = outputs(gguf)
        after = _core.pool_stats()
        ran = {k: after[k] - before[k] for k in ("parallel_jobs", "serial_jobs")}
        assert ran["parallel_jobs" if mode == "parallel" else "serial_jobs"] > 100, ran  # the mode took effect
        assert ran["serial_jobs" if mode == "parallel" else "parallel_jobs"] == 0, ran
    assert_bit_equal(runs["serial"], runs["parallel"])


def _outputs_in_process(gguf: str, threads: int, tmp_path) -> dict:
    out = tmp_path / f"t{threads}.npz"
    code = f"import numpy as np, test_thread_pool as t; np.savez({str(out)!r}, **t.outputs({gguf!r}))"
    env = dict(os.environ, LLAISYS_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=HERE)
    with np.load(out) as f:
        return {k: f[k] for k in f.files}


def test_one_and_three_threads_give_bit_equal_steps(gguf, tmp_path):
    assert_bit_equal(_outputs_in_process(gguf, 1, tmp_path), _outputs_in_process(gguf, 3, tmp_path))


def test_adaptive_pool_starts_on_the_workers_and_counts_its_jobs(pool_mode):
    if llaisys.build_info()["cpu_threads"] < 2:
        pytest.skip("one thread: the pool never runs on workers")
    pool_mode("adaptive")  # restarts the choice: the first jobs run on the workers, whatever the load
    before = _core.pool_stats()
    x = llaisys.tensor(np.ones((256, 4096), np.float32))
    llaisys.ops.rms_norm(x, x, llaisys.tensor(np.ones(4096, np.float32)), 1e-6)  # one job of 16 tasks
    after = _core.pool_stats()
    assert after["parallel_jobs"] - before["parallel_jobs"] == 1
    assert after["serial_jobs"] == before["serial_jobs"]


def test_pool_mode_without_restart_keeps_counting(pool_mode):
    before = _core.pool_stats()
    assert set(before) == {"parallel_jobs", "serial_jobs", "switches_to_serial", "probes"}
    pool_mode("serial", restart=False)  # what cpu_contention.py --interleaved does between rounds
    x = llaisys.tensor(np.ones((256, 4096), np.float32))
    llaisys.ops.rms_norm(x, x, llaisys.tensor(np.ones(4096, np.float32)), 1e-6)
    after = _core.pool_stats()
    if llaisys.build_info()["cpu_threads"] > 1:
        assert after["serial_jobs"] == before["serial_jobs"] + 1
    assert all(after[k] >= before[k] for k in before)


def test_bad_pool_mode_raises():
    with pytest.raises(ValueError, match="adaptive"):
        _core.set_pool_mode("fast")
