"""The engine in a process of its own (engine/process.py EngineProcess, `llaisys serve`'s default): it must
give what the in-process Engine gives (greedy text, seeded samples of concurrent requests, errors with the
same types and messages, score and stats), free an aborted request's blocks, and end cleanly: a killed
engine process fails running streams (an error chunk, not a hang) and /health; SIGTERM on the server or a
server that is killed leaves no engine process behind. A tiny random checkpoint on the CPU."""
import asyncio
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")

from llaisys.engine.process import EngineProcess  # noqa: E402
from llaisys.server.backend import Engine, Generation, StreamHub  # noqa: E402
from tiny_model import make_tiny_qwen2  # noqa: E402

ARGS = dict(device="cpu", dtype="f32", progress=False, max_seq_len=256, num_kv_blocks=256, max_queued_requests=8)
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Ünïcödé naïve café 你好世界", "for i in range(10):"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("proc"), seed=7, max_position_embeddings=512)


@pytest.fixture(scope="module")
def eng(ckpt):
    e = Engine(ckpt, **ARGS)
    yield e
    e.close()


@pytest.fixture(scope="module")
def proc(ckpt):
    p = EngineProcess(ckpt, **ARGS)
    yield p
    p.close()


def _gone(pid: int) -> bool:
    """True once no process `pid` runs (a zombie waiting for its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, what: str) -> None:
    deadline = time.monotonic() + 60  # a hang guard, not a timing: exiting takes well under a second
    while not _gone(pid):
        assert time.monotonic() < deadline, f"{what}: process {pid} still runs"
        time.sleep(0.05)


def _read_all(it):
    """list(it), or the exception it raised; read in a thread so that a hang fails the test instead."""
    out = queue.SimpleQueue()

    def run():
        try:
            out.put(list(it))
        except BaseException as e:
            out.put(e)
    threading.Thread(target=run, daemon=True).start()
    return out.get(timeout=60)  # queue.Empty: nothing ended the request


def test_the_server_sees_the_engines_values(proc, eng):
    for name in ("source", "max_seq_len", "engine_config", "generation_config", "chat_template", "device", "dtype"):
        assert getattr(proc, name) == getattr(eng, name), name
    assert proc.config.vocab_size == eng.config.vocab_size
    assert proc.tokenize(PROMPTS[2]) == eng.tokenize(PROMPTS[2])
    msgs = [{"role": "user", "content": "Hi"}]
    assert proc.render_chat(msgs) == eng.render_chat(msgs)
    assert proc.pid != os.getpid() and not proc.closed


def test_greedy_output_equals_generate_iterated_and_through_the_hub(proc, eng):
    sampling = dict(temperature=0, max_new_tokens=24, logprobs=2)
    want = eng.generate(PROMPTS, **sampling)
    for p, w in zip(PROMPTS, want):
        chunks = list(proc.submit(p, **sampling))
        assert "".join(c.text for c in chunks) == w.text
        assert [t for c in chunks for t in c.token_ids] == w.token_ids
        assert [e for c in chunks for e in c.logprobs] == w.logprobs
        assert chunks[-1].finish_reason == w.finish_reason
        assert chunks[-1].usage["completion_tokens"] == len(w.token_ids)

    async def main():
        gen = Generation(proc, proc.engine_config.block_size, StreamHub(asyncio.get_running_loop()))
        gen.start([(proc.tokenize(p), [dict(sampling)]) for p in PROMPTS])
        return [ev async for ev in gen.events()]
    events = asyncio.run(main())
    for i, w in enumerate(want):
        chunks = [c for k, c in events if k == i]
        assert "".join(c.text for c in chunks) == w.text and chunks[-1].finish_reason == w.finish_reason


def test_entries_read_at_the_end_cross_as_arrays_and_are_built_when_read(proc, eng):
    """Requests read only at their end (incremental=False, the server's non-streaming responses): the child's
    step loop does not build their logprobs entries; the last chunk carries the arrays (a Pending) across, and
    the parent builds the entries when they are read: the same as the in-process generate()'s, request by
    request (submitted together, so their rows share the child's batch)."""
    from llaisys.engine.logprobs_log import Pending, raw_logprobs

    sampling = dict(temperature=0, max_new_tokens=24, logprobs=3, ignore_eos=True)
    want = eng.generate(PROMPTS, **sampling)
    reqs = [proc.submit(p, incremental=False, **sampling) for p in PROMPTS]
    got = [_read_all(r) for r in reqs]
    assert any(type(raw_logprobs(chunks[-1])) is Pending for chunks in got)  # (rows of the batch, not built)
    for chunks, w in zip(got, want):
        assert len(chunks) == 1 and chunks[0].token_ids == w.token_ids
        assert chunks[0].logprobs == w.logprobs and type(chunks[0].logprobs) is list


def test_concurrent_seeded_streams_each_get_their_own_text(proc, eng):
    jobs = [(f"Item {i}: a note about {i * 7}", 100 + i) for i in range(8)]
    want = [eng.generate(p, temperature=1.0, max_new_tokens=12, seed=s).text for p, s in jobs]

    async def main():
        gen = Generation(proc, proc.engine_config.block_size, StreamHub(asyncio.get_running_loop()))
        gen.start([(proc.tokenize(p), [dict(temperature=1.0, max_new_tokens=12, seed=s)]) for p, s in jobs])
        return [ev async for ev in gen.events()]
    texts = [""] * len(jobs)
    for i, chunk in asyncio.run(main()):
        texts[i] += chunk.text
    assert texts == want
    assert len(set(texts)) > len(jobs) // 2  # no answer served twice


def test_submit_raises_what_engine_submit_raises(proc, eng):
    cases = [([1, 10**9], {}), ("x", {"temperature": -1}), ("x", {"bogus": 1}), ("x", {"stop_token_ids": [10**9]}),
             (list(range(1, 300)), {}), ("x", {"max_new_tokens": 0}),
             # finite as Python floats, inf or 0 as the float32 the kernels read (issue 28)
             ("x", {"temperature": 1e39}), ("x", {"top_p": 1e-300}), ("x", {"repetition_penalty": 1e308}),
             ("x", {"sink": object()}),
             # StreamingLLM: bad values, and a window the context cannot hold (issue 32)
             ("x", {"kv_window": -1}), ("x", {"kv_window": 4096}), ("x", {"kv_window": 16, "sink_tokens": 1.5})]
    for prompt, sampling in cases:
        with pytest.raises(Exception) as mine:
            proc.submit(prompt, **sampling)
        with pytest.raises(Exception) as theirs:
            eng.submit(prompt, **sampling)
        assert (type(mine.value), str(mine.value)) == (type(theirs.value), str(theirs.value)), (prompt, sampling)
        assert isinstance(mine.value, (ValueError, TypeError))


def test_a_sink_that_raises_ends_its_request_alone(proc, eng):
    """The receiver thread puts into the server's sinks: one that raises must not end the others."""
    class Sink:
        def __init__(self, fail):
            self.items, self.fail, self.ended = [], fail, threading.Event()

        def put(self, req, item):
            if self.fail and not isinstance(item, BaseException):
                raise ValueError("the sink's own bug")
            self.items.append(item)
            if isinstance(item, BaseException) or item.finish_reason is not None:
                self.ended.set()

        def flush(self):
            pass
    kw = dict(temperature=1.0, seed=3, max_new_tokens=16, ignore_eos=True)
    good, bad = Sink(False), Sink(True)
    proc.submit(PROMPTS[1], sink=bad, **kw)
    proc.submit(PROMPTS[1], sink=good, **kw)
    assert bad.ended.wait(60) and good.ended.wait(60), "a request never ended"  # a hang guard
    assert len(bad.items) == 1 and "sink" in str(bad.items[0])
    assert "".join(c.text for c in good.items) == eng.generate(PROMPTS[1], **kw).text
    assert not proc.closed and proc.stats()["running"] == 0


def test_a_full_queue_is_a_runtime_error_and_abort_frees_blocks(proc):
    reqs = [proc.submit(p, temperature=0, max_new_tokens=200, ignore_eos=True) for p in PROMPTS * 2]  # 8: the limit
    with pytest.raises(RuntimeError, match=r"too many requests in flight \(8"):
        proc.submit("one more", max_new_tokens=2)
    firsts = [next(iter(r)) for r in reqs]
    assert all(c.finish_reason is None for c in firsts)
    assert proc.stats()["kv_blocks_used"] > 0
    for r in reqs:
        r.abort()
    # the aborts went down the pipe before the stats call, and the step loop handles aborts first
    stats = proc.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0
    ends = [list(r)[-1].finish_reason for r in reqs]
    assert ends == ["abort"] * len(reqs)
    assert list(proc.submit("Hello", temperature=0, max_new_tokens=2))[-1].finish_reason == "length"


def test_score_equals_the_engines(proc, eng):
    ids = eng.tokenize(PROMPTS[1])
    np.testing.assert_array_equal(proc.score(ids), eng.score(ids))


def test_windowed_requests_and_score_equal_the_engines(proc, eng):
    """A windowed request past the context (prompt 300 > max_seq_len 256, 400 new tokens) and a windowed score,
    through the child, equal the in-process engine's."""
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 300, 300)]
    kw = dict(max_new_tokens=400, temperature=0, ignore_eos=True, kv_window=32, sink_tokens=4)
    want = eng.generate(ids, **kw).token_ids
    assert len(want) == 400
    assert [t for c in proc.submit(ids, **kw) for t in c.token_ids] == want
    np.testing.assert_array_equal(proc.score(ids, kv_window=32, sink_tokens=4), eng.score(ids, kv_window=32, sink_tokens=4))


def test_a_model_that_fails_to_load_raises_its_error_here(ckpt):
    with pytest.raises(ValueError, match="max_seq_len must be at most 512"):
        EngineProcess(ckpt, **{**ARGS, "max_seq_len": 4096})
    with pytest.raises(ValueError, match="unknown model"):
        EngineProcess(os.path.join(ckpt, "missing"), **ARGS)


def test_a_killed_engine_process_fails_running_requests_and_calls(ckpt):
    p = EngineProcess(ckpt, **ARGS)
    try:
        req = p.submit(PROMPTS[0], temperature=0, max_new_tokens=200, ignore_eos=True)
        it = iter(req)
        assert next(it).finish_reason is None
        os.kill(p.pid, signal.SIGKILL)
        err = _read_all(it)
        assert isinstance(err, RuntimeError) and "engine process exited (exit code -9)" in str(err), err
        assert p.closed and "exit code -9" in p.failure
        with pytest.raises(RuntimeError, match="closed"):
            p.submit("x", max_new_tokens=1)
        with pytest.raises(RuntimeError, match="closed"):
            p.stats()
    finally:
        p.close()


def test_close_ends_running_requests_and_the_process(ckpt):
    p = EngineProcess(ckpt, **ARGS)
    req = p.submit(PROMPTS[0], temperature=0, max_new_tokens=200, ignore_eos=True)
    it = iter(req)
    next(it)
    p.close()
    err = _read_all(it)
    assert isinstance(err, RuntimeError) and "engine is closed" in str(err), err
    assert _gone(p.pid) and p.failure is None and p.closed
    p.close()  # twice is fine


# ---- through `llaisys serve` ---------------------------------------------------------------------------

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(ckpt, tmp_path, *extra, session=False, launcher=("-m", "llaisys.server")):
    port = _free_port()
    log_path = tmp_path / f"server-{port}.log"
    log = open(log_path, "w")
    server = subprocess.Popen([sys.executable, *launcher, "--model", ckpt, "--device", "cpu", "--port",
                               str(port), "--max-seq-len", "256", "--num-kv-blocks", "256", *extra],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=session)
    url = f"http://127.0.0.1:{port}"
    while True:
        assert server.poll() is None, log_path.read_text()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    text = log_path.read_text()
    pid = int(text.split("the engine runs in process ", 1)[1].split()[0]) if "--no-engine-process" not in extra else None
    return server, url, pid, log


def _stream(url: str, **body):
    return httpx.stream("POST", url + "/v1/completions", timeout=120,
                        json={"model": "m", "prompt": PROMPTS[0], "stream": True, **body})


@pytest.mark.parametrize("extra", [(), ("--no-engine-process",)], ids=["engine-process", "in-process"])
def test_both_modes_serve_the_engines_greedy_text(ckpt, eng, tmp_path, extra):
    server, url, pid, log = _start_server(ckpt, tmp_path, "--served-model-name", "m", *extra)
    try:
        want = eng.generate(PROMPTS[1], temperature=0, max_new_tokens=16)
        r = httpx.post(url + "/v1/completions", timeout=120,
                       json={"model": "m", "prompt": PROMPTS[1], "temperature": 0, "max_tokens": 16})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
        r = httpx.post(url + "/v1/completions", timeout=120, json={"model": "m", "prompt": [1, 10**9]})
        assert r.status_code == 400 and "token id at position 1" in r.json()["error"]["message"]
        total = eng.stats()["kv_blocks_total"]  # the same --num-kv-blocks as ARGS
        assert f"\nllaisys_kv_blocks_total {total}\n" in httpx.get(url + "/metrics", timeout=120).text
        assert (pid is None) == bool(extra)
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) in (0, -signal.SIGTERM)
        log.close()
    if pid is not None:
        _wait_gone(pid, "after SIGTERM on the server")


def test_a_killed_engine_process_ends_streams_with_an_error_and_fails_health(ckpt, tmp_path):
    # one sequence at a time and three streams of 480 tokens: when the first chunk of one is read, hundreds
    # of steps are left, so the kill finds streams running (or queued: both end with the error chunk). The
    # reader that sees the first chunk kills at once: a wake-up of the main thread on a loaded 2-core box
    # came after the whole first stream (the tiny model's 240 tokens take ~20 ms) and found none running
    server, url, pid, log = _start_server(ckpt, tmp_path, "--served-model-name", "m", "--max-num-seqs", "1",
                                          "--max-seq-len", "512")
    try:
        got = [None] * 3
        first = threading.Event()
        kill_once = threading.Lock()

        def read(i):
            try:
                with _stream(url, max_tokens=480, ignore_eos=True) as r:
                    if r.status_code != 200:
                        got[i] = (r.status_code, [], r.read())
                        return
                    lines = []
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            lines.append(line)
                            if kill_once.acquire(blocking=False):
                                os.kill(pid, signal.SIGKILL)
                                first.set()
                    got[i] = (r.status_code, lines, b"")
            except Exception as e:
                got[i] = (None, [], repr(e).encode())
        threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        assert first.wait(timeout=120)
        for t in threads:
            t.join()
        errors = []
        for status, lines, body in got:  # each: a stream, or (submitted after the kill) a 503
            if status == 503:
                assert b"not running" in body or b"closed" in body, body
                continue
            assert status == 200 and lines[-1] == "data: [DONE]", lines
            end = json.loads(lines[-2][5:])
            if "error" in end:
                errors.append(end["error"]["message"])
            else:
                assert end["choices"][0]["finish_reason"] == "length", end
        assert errors and all("engine process exited (exit code -9)" in e for e in errors), got
        h = httpx.get(url + "/health", timeout=30)
        assert h.status_code == 503 and "engine is not running" in h.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", timeout=30, json={"model": "m", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 503
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) in (0, -signal.SIGTERM)
        log.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_a_server_that_ends_leaves_no_engine_process(ckpt, tmp_path, sig):
    # SIGINT goes to the whole process group, as Ctrl-C in a terminal does; SIGKILL to the server alone
    server, url, pid, log = _start_server(ckpt, tmp_path, "--served-model-name", "m", session=True)
    try:
        with _stream(url, max_tokens=200, ignore_eos=True) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            if sig == signal.SIGINT:  # a graceful end: the stream ends (tests/test_server.py checks its error chunk)
                os.killpg(server.pid, sig)
                assert [line for line in lines if line.startswith("data:")][-1] == "data: [DONE]"
            else:
                server.send_signal(sig)
        server.wait(timeout=60)
        _wait_gone(pid, f"after {sig.name} on the server")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()


# `python SPY_SERVER LOG serve-options`: llaisys serve, with every entry point of llaisys._core (devices, memory,
# streams, tensors, the model, the KV pool, the runner, ops, and build_info, which callers such as
# cuda_is_available() consult first on a CPU build) logged to LOG when this process calls it after importing
# the server's modules, through whatever name a llaisys module holds it by. Its engine process imports this file as its
# main module (multiprocessing spawn) and skips the __main__ block: it is not spied on.
SPY_SERVER = """
import runpy, sys

if __name__ == "__main__":
    log = sys.argv.pop(1)
    import llaisys.server.app, llaisys.server.cli  # noqa: E401  (build_info is all that runs at import)
    from llaisys import _core

    class Spy:  # calls (and the attributes of classes, e.g. static methods) go to obj, once logged
        def __init__(self, name, obj):
            self.name, self.obj = name, obj

        def __call__(self, *args, **kwargs):
            with open(log, "a") as f:
                f.write(self.name + "\\n")
            return self.obj(*args, **kwargs)

        def __getattr__(self, attr):
            value = getattr(self.obj, attr)
            return Spy(f"{self.name}.{attr}", value) if callable(value) else value
    spies = {}
    for mod, prefix in ((_core, ""), (_core.ops, "ops."), (_core.quant, "quant.")):
        for name, obj in list(vars(mod).items()):
            if callable(obj) and not name.startswith("__"):
                spies[id(obj)] = Spy(prefix + name, obj)
                setattr(mod, name, spies[id(obj)])
    for mod in [m for n, m in sys.modules.items() if n.startswith("llaisys")]:
        for name, obj in list(vars(mod).items()):
            if id(obj) in spies:
                setattr(mod, name, spies[id(obj)])
    sys.argv[0] = "llaisys serve"
    runpy.run_module("llaisys.server", run_name="__main__")
"""


@pytest.mark.parametrize("extra", [(), ("--no-engine-process",)], ids=["engine-process", "in-process"])
def test_only_the_engine_process_touches_the_device(ckpt, tmp_path, extra):
    # with the engine in its own process, the server's process must create no CUDA context: once its modules
    # are imported it calls nothing of _core (not cuda_device_count, not the model, not memory stats),
    # whatever it serves.
    # In process (--no-engine-process) the same spy sees the engine being built: the check can fail.
    script, log = tmp_path / "spy_server.py", tmp_path / "core_calls.txt"
    script.write_text(SPY_SERVER)
    server, url, pid, server_log = _start_server(ckpt, tmp_path, "--served-model-name", "m", *extra,
                                                 launcher=(str(script), str(log)))
    try:
        with _stream(url, max_tokens=8, logprobs=2) as r:
            assert r.status_code == 200 and [x for x in r.iter_lines() if x.startswith("data:")][-1] == "data: [DONE]"
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200
        r = httpx.post(url + "/v1/completions", timeout=120,  # echo + logprobs: the prompt scored (Engine.score)
                       json={"model": "m", "prompt": PROMPTS[1], "max_tokens": 2, "echo": True, "logprobs": 1})
        assert r.status_code == 200
        assert "llaisys_kv_blocks_total" in httpx.get(url + "/metrics", timeout=120).text
        assert httpx.get(url + "/health", timeout=30).status_code == 200
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) in (0, -signal.SIGTERM)
        server_log.close()
    calls = set(log.read_text().split()) if log.exists() else set()
    if extra:
        assert {"create_model", "KVPool", "Runner"} <= calls, calls
    else:
        assert calls == set() and pid is not None
