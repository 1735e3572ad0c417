"""One request's bad input ends that request alone (issue 28): sampling values float32 cannot hold are
refused before the request is queued (the server answers 400 naming the field); a row that makes a step
fail, a sink that raises, or a bad sink never reaches another request or stops the engine; result() and
iteration never wait forever; a bad max_seq_len fails before the model's weights (or tokenizer) are read.
A tiny random checkpoint on the CPU. The reference for "goes on unharmed" is the same request run alone."""
import dataclasses
import threading

import pytest

pytest.importorskip("transformers")

import llaisys.loader  # noqa: E402
from llaisys.engine.engine import Engine  # noqa: E402
from llaisys.engine.model_runner import ModelRunner  # noqa: E402
from llaisys.sampling import resolve_sampling  # noqa: E402
from tiny_model import make_tiny_qwen2, write_tiny_gguf  # noqa: E402

ARGS = dict(device="cpu", dtype="f32", progress=False, max_seq_len=256, num_kv_blocks=256)
PROMPT = "def fibonacci(n):"
# seeded: many chunks of varied text (greedy on this random model repeats one token, all text at the end)
KW = dict(temperature=1.0, seed=7, max_new_tokens=24, ignore_eos=True)
HANG_GUARD_S = 60  # how long a call may take before the test calls it a hang (each takes well under 1 s)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("bad"), seed=3, max_position_embeddings=512)


@pytest.fixture(scope="module")
def eng(ckpt):
    e = Engine(ckpt, **ARGS)
    yield e
    e.close()


@pytest.fixture(scope="module")
def solo(eng):
    return eng.generate(PROMPT, **KW)


def finishes(fn):
    """fn()'s value, or a test failure when it does not return within HANG_GUARD_S (a hang, not a slow run)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    assert not t.is_alive(), f"{fn} did not return within {HANG_GUARD_S} s: it hangs"
    if "error" in out:
        raise out["error"]
    return out["value"]


def assert_idle_and_serving(eng, solo):
    stats = eng.stats()
    assert not eng.closed and stats["running"] == 0 and stats["waiting"] == 0, stats
    assert eng.generate(PROMPT, **KW).token_ids == solo.token_ids


# ---- 1a. values float32 cannot hold are refused before the request is queued ---------------------------

FLOAT32_BAD = [("temperature", 1e39), ("temperature", 1e300), ("temperature", 3.5e38), ("temperature", 1e-300),
               ("temperature", 1e-39), ("temperature", 10**400), ("top_p", 1e-300), ("top_p", 1e-40),
               ("repetition_penalty", 1e308), ("repetition_penalty", 3.5e38), ("repetition_penalty", 1e-300),
               ("presence_penalty", 10**400)]


@pytest.mark.parametrize("name, value", FLOAT32_BAD, ids=[f"{n}={v:.0e}" if isinstance(v, float) else f"{n}=int"
                                                         for n, v in FLOAT32_BAD])
def test_values_float32_cannot_hold_are_refused_naming_the_field(eng, solo, name, value):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        resolve_sampling({}, **{name: value})
    with pytest.raises(ValueError, match=f"^{name} must be"):
        eng.submit(PROMPT, **{name: value})
    assert_idle_and_serving(eng, solo)


def test_the_edges_of_float32_are_accepted_and_run(eng):
    edges = [dict(temperature=3.4e38), dict(temperature=1.2e-38), dict(top_p=1.2e-38, temperature=1.0),
             dict(repetition_penalty=3.4e38), dict(repetition_penalty=1.2e-38), dict(min_p=1e-300, temperature=1.0)]
    reqs = [eng.submit(PROMPT, max_new_tokens=8, seed=1, **kw) for kw in edges]
    for kw, r in zip(edges, reqs):
        assert r.result().finish_reason in ("length", "stop"), kw


# ---- 1b. a row that makes a step fail ends its request alone ---------------------------------------------

@pytest.fixture
def poisoned_row(monkeypatch):
    """Steps holding a sequence marked `poison` (once it has 3 output tokens) raise, as a kernel refusing
    that row's values would: the failure passes validation, so only the step loop's isolation is tested.
    Steps wait until the test sets the returned gate, so every request it submitted shares their steps."""
    gate = threading.Event()

    def wrap(method):
        def run(self, step, *args, **kwargs):
            assert gate.wait(HANG_GUARD_S), "the test never opened the gate"
            for seq in step.seqs:
                if getattr(seq, "poison", False) and seq.num_output >= 3:
                    raise RuntimeError(f"injected failure of row {step.seqs.index(seq)}")
            return method(self, step, *args, **kwargs)
        return run
    monkeypatch.setattr(ModelRunner, "step", wrap(ModelRunner.step))
    monkeypatch.setattr(ModelRunner, "launch", wrap(ModelRunner.launch))
    return gate


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_row_ends_its_request_and_the_others_keep_their_text(ckpt, solo, poisoned_row, overlap):
    e = Engine(ckpt, overlap_steps=overlap, **ARGS)
    try:
        reqs = [e.submit(PROMPT, **KW) for _ in range(2)]
        bad = e.submit("The quick brown fox", **KW)
        bad.seq.poison = True
        reqs.append(e.submit(PROMPT, **KW))
        poisoned_row.set()
        with pytest.raises(RuntimeError, match="injected failure"):
            finishes(bad.result)
        for r in reqs:
            assert finishes(r.result).token_ids == solo.token_ids
            assert r.result().text == solo.text
        assert_idle_and_serving(e, solo)
    finally:
        e.close()


def test_a_row_the_sampler_refuses_ends_alone(eng, solo):
    """A real kernel refusal: temperature inf slipped past the policy (as 1e39 did before it checked float32)."""
    good = [eng.submit(PROMPT, **KW) for _ in range(2)]
    params = dataclasses.replace(eng._params("submit", dict(max_new_tokens=24)), temperature=float("inf"))
    bad = eng._submit_ids(eng.tokenize("The quick brown fox"), params)
    with pytest.raises(Exception, match="temperature"):
        finishes(bad.result)
    assert [finishes(r.result).token_ids for r in good] == [solo.token_ids] * 2
    assert_idle_and_serving(eng, solo)


# ---- 3. result() and iteration never wait forever ---------------------------------------------------------

def test_result_twice_and_iterating_after_it_return_the_same(eng, solo):
    r = eng.submit(PROMPT, **KW)
    first = finishes(r.result)
    assert finishes(r.result) is first and first.token_ids == solo.token_ids
    chunks = finishes(lambda: list(r))
    assert [t for c in chunks for t in c.token_ids] == solo.token_ids and chunks[-1].finish_reason == "length"
    assert [t for c in finishes(lambda: list(r)) for t in c.token_ids] == solo.token_ids


def test_result_after_iterating_and_after_a_partial_read(eng, solo):
    r = eng.submit(PROMPT, **KW)
    it = iter(r)
    head = finishes(lambda: next(it))
    assert finishes(r.result).token_ids == solo.token_ids  # the chunk read already is not lost
    assert head.token_ids == solo.token_ids[:len(head.token_ids)]
    rest = finishes(lambda: list(it))
    assert head.token_ids + [t for c in rest for t in c.token_ids] == solo.token_ids


def test_a_failed_request_raises_its_error_every_time(eng, solo, poisoned_row):
    r = eng.submit(PROMPT, **KW)
    r.seq.poison = True
    poisoned_row.set()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="injected failure"):
            finishes(r.result)
        with pytest.raises(RuntimeError, match="injected failure"):
            finishes(lambda: list(r))


# ---- 4. sinks: checked at submit; one that raises ends its request alone ----------------------------------

class Sink:
    def __init__(self, fail_put_at=None, fail_flush=False):
        self.items, self.fail_put_at, self.fail_flush = [], fail_put_at, fail_flush
        self.ended = threading.Event()

    def put(self, req, item):
        if isinstance(item, BaseException) or getattr(item, "finish_reason", None) is not None:
            self.ended.set()
        if self.fail_put_at is not None and not isinstance(item, BaseException) and \
                len(self.items) >= self.fail_put_at:
            raise ValueError("the sink's own bug")
        self.items.append(item)

    def flush(self):
        if self.fail_flush:
            raise ValueError("the sink's own flush bug")


@pytest.mark.parametrize("sink", [object(), 42, type("OnlyPut", (), {"put": lambda self, r, i: None})()])
def test_a_sink_without_put_and_flush_is_refused_at_submit(eng, solo, sink):
    with pytest.raises(TypeError, match=r"sink must be a ChunkSink.*put\(request, item\) and flush\(\)"):
        eng.submit(PROMPT, sink=sink, **KW)
    assert_idle_and_serving(eng, solo)


@pytest.mark.parametrize("bad_sink", [Sink(fail_put_at=2), Sink(fail_flush=True)], ids=["put", "flush"])
def test_a_sink_that_raises_ends_its_request_alone(eng, solo, bad_sink):
    good = [eng.submit(PROMPT, **KW), eng.submit(PROMPT, sink=(good_sink := Sink()), **KW)]
    eng.submit(PROMPT, sink=bad_sink, **KW)
    assert bad_sink.ended.wait(HANG_GUARD_S), "the request of the failing sink never ended"
    errors = [i for i in bad_sink.items if isinstance(i, BaseException)]
    assert len(errors) == 1 and "sink" in str(errors[0]), bad_sink.items
    assert finishes(good[0].result).token_ids == solo.token_ids
    assert good_sink.ended.wait(HANG_GUARD_S)
    eng.stats()  # a round of the loop after the last put
    assert [t for c in good_sink.items for t in c.token_ids] == solo.token_ids
    assert_idle_and_serving(eng, solo)


# ---- 8. arguments are checked before the model is read ------------------------------------------------------

@pytest.fixture
def no_loading(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model was read although an argument was bad")
    monkeypatch.setattr(llaisys.loader, "load", fail)
    monkeypatch.setattr(Engine, "_load_weights", fail)


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_max_seq_len_beyond_the_model_fails_before_loading(ckpt, tmp_path, fmt, no_loading):
    path = ckpt if fmt == "hf" else write_tiny_gguf(ckpt, tmp_path / "tiny.gguf")
    for bad in (10**9, 513):
        with pytest.raises(ValueError, match=f"max_seq_len must be at most 512 .*got {bad}"):
            Engine(path, device="cpu", progress=False, max_seq_len=bad)


def test_a_kv_budget_too_small_for_max_seq_len_fails_before_the_upload(ckpt, monkeypatch):
    monkeypatch.setattr(Engine, "_load_weights", lambda *a: pytest.fail("weights uploaded before the KV check"))
    with pytest.raises(ValueError, match="KV cache budget"):
        Engine(ckpt, device="cpu", progress=False, max_seq_len=512, cpu_kv_cache_bytes=1 << 10)


# ---- 1. the server: a 400 naming the field, and a failing row is that request's error alone -----------------

@pytest.fixture
def http(eng):
    testclient = pytest.importorskip("fastapi.testclient")
    from llaisys.server.app import create_app

    with testclient.TestClient(create_app(eng, model_name="tiny")) as client:
        yield client


@pytest.mark.parametrize("name, value", [("temperature", 1e39), ("temperature", 1e-300), ("top_p", 1e-300),
                                         ("repetition_penalty", 1e308), ("repetition_penalty", 3.5e38)])
def test_the_server_answers_400_naming_the_field(http, name, value):
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, name: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(f"{name} must be"), r.text


def test_the_server_fails_only_the_request_whose_row_fails(http, eng, solo, poisoned_row, monkeypatch):
    submit, submitted = type(eng).submit, []

    def poison_the_bad_one(self, prompt, sink=None, **sampling):
        req = submit(self, prompt, sink, **sampling)
        req.seq.poison = sampling.get("seed") == 666
        submitted.append(req)
        if len(submitted) == 3:  # all three share the steps from here
            poisoned_row.set()
        return req
    monkeypatch.setattr(type(eng), "submit", poison_the_bad_one)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": KW["max_new_tokens"], "temperature": 1.0,
            "ignore_eos": True}
    replies = [None] * 3

    def post(i, seed):
        replies[i] = http.post("/v1/completions", json={**body, "seed": seed})
    threads = [threading.Thread(target=post, args=(i, s)) for i, s in enumerate([KW["seed"], 666, KW["seed"]])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD_S)
        assert not t.is_alive(), "a request never got its answer"
    good = [replies[0], replies[2]]
    assert all(r.status_code == 200 for r in good), [r.text for r in good]
    assert [r.json()["choices"][0]["text"] for r in good] == [solo.text] * 2
    assert replies[1].status_code >= 500 and "injected failure" in replies[1].text, replies[1].text
