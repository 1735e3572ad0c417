"""How the server reads the engine (server/backend.py), without HTTP: requests submitted with a sink hand
their chunks to one StreamHub per event loop, flushed once per step, and a reader that falls behind gets
the waiting chunks of a choice as one. A coalesced stream must carry exactly what Engine.generate gives
(text, token ids, logprobs, finish_reason, usage), with stop strings and multi-byte characters; n > 1,
aborts and a closing engine keep their meaning. A whole (non-streaming) response's requests give one chunk
each (submit(incremental=False), issue 33), checked through the app too (TestClient, the engine in process
and in its own process): the same response as before and as the stream merged. A tiny random checkpoint
on the CPU."""
import asyncio
import json
import time

import pytest

pytest.importorskip("fastapi")

from llaisys.engine.request import StreamChunk, merge_chunks  # noqa: E402
from llaisys.server.backend import Engine, Generation, StreamHub, coalesce  # noqa: E402
from tiny_model import make_tiny_qwen2  # noqa: E402


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    path = make_tiny_qwen2(tmp_path_factory.mktemp("delivery"), seed=5, max_position_embeddings=512)
    e = Engine(path, device="cpu", dtype="f32", progress=False, max_seq_len=256, num_kv_blocks=256)
    yield e
    e.close()


PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Ünïcödé naïve café 你好世界", "for i in range(10):"]


async def _read(gen: Generation, wait_for_end: bool):
    """Every event of gen; with wait_for_end, only once every request has put its last chunk (and the
    hub has handed them over), so each choice's chunks are read together."""
    if wait_for_end:
        while not all(r.done for r in gen.requests) or gen.hub._items or gen.hub._scheduled:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)
    return [ev async for ev in gen.events()]


def _run(eng, groups, wait_for_end, hub=True):
    async def main():
        gen = Generation(eng, eng.engine_config.block_size, StreamHub(asyncio.get_running_loop()) if hub else None)
        gen.start(groups)
        return gen, await _read(gen, wait_for_end)
    return asyncio.run(main())


@pytest.mark.parametrize("wait_for_end", [True, False], ids=["coalesced", "as-it-comes"])
def test_a_stream_carries_exactly_what_generate_gives(eng, wait_for_end):
    sampling = dict(temperature=0, max_new_tokens=24, logprobs=2)
    want = eng.generate(PROMPTS, **sampling)
    groups = [(eng.tokenize(p), [dict(sampling)]) for p in PROMPTS]
    gen, events = _run(eng, groups, wait_for_end)
    for i, w in enumerate(want):
        chunks = [c for k, c in events if k == i]
        assert "".join(c.text for c in chunks) == w.text
        assert [t for c in chunks for t in c.token_ids] == w.token_ids
        assert [e for c in chunks for e in c.logprobs] == w.logprobs
        assert chunks[-1].finish_reason == w.finish_reason
        usage = chunks[-1].usage  # cached_tokens differ: generate() put the prompts in the prefix cache
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (w.usage["prompt_tokens"], len(w.token_ids))
        assert all(c.finish_reason is None for c in chunks[:-1])
        if wait_for_end:  # everything was waiting when the reader came: one event
            assert len(chunks) == 1
    assert not gen.hub._routes  # every request's last item removed its route


def test_coalesced_text_hides_stop_strings_and_keeps_whole_characters(eng):
    prompt = PROMPTS[2]
    full = eng.generate(prompt, temperature=0, max_new_tokens=30)
    assert len(full.text) > 8
    stop = full.text[4:7]
    want = eng.generate(prompt, temperature=0, max_new_tokens=30, stop=[stop])
    for wait in (True, False):
        _, events = _run(eng, [(eng.tokenize(prompt), [dict(temperature=0, max_new_tokens=30, stop=[stop])])], wait)
        text = "".join(c.text for _, c in events)
        assert text == want.text == full.text[:full.text.index(stop)]
        assert events[-1][1].finish_reason == "stop" and all(stop not in c.text for _, c in events)
        assert all("\ufffd" not in c.text for _, c in events)


def test_n_choices_share_the_hub_and_each_get_their_own_tokens(eng):
    ids = eng.tokenize("A long enough prompt to fill more than one block of the KV cache " * 2)
    choices = [dict(temperature=1.0, max_new_tokens=12, seed=s) for s in (1, 2, 3)]
    want = [eng.generate(ids, **c) for c in choices]
    for wait in (True, False):
        gen, events = _run(eng, [(ids, [dict(c) for c in choices])], wait)
        assert gen.followers == {}  # the followers were started after the leader's first chunk
        for i, w in enumerate(want):
            chunks = [c for k, c in events if k == i]
            assert [t for c in chunks for t in c.token_ids] == w.token_ids
            assert "".join(c.text for c in chunks) == w.text


def test_without_a_shared_hub_a_generation_makes_its_own(eng):
    ids = eng.tokenize(PROMPTS[0])
    want = eng.generate(ids, temperature=0, max_new_tokens=6)
    gen, events = _run(eng, [(ids, [dict(temperature=0, max_new_tokens=6)])], True, hub=False)
    assert [t for _, c in events for t in c.token_ids] == want.token_ids


def test_abort_ends_every_choice_with_abort_and_frees_blocks(eng):
    async def main():
        gen = Generation(eng, eng.engine_config.block_size, StreamHub(asyncio.get_running_loop()))
        gen.start([(eng.tokenize(p), [dict(temperature=0, max_new_tokens=200, ignore_eos=True)]) for p in PROMPTS])
        out = []
        async for index, chunk in gen.events():
            out.append((index, chunk))
            if len(out) == 3:
                gen.abort()
        return gen, out
    gen, out = asyncio.run(main())
    last = {}
    for index, chunk in out:
        last[index] = chunk
    assert sorted(last) == list(range(len(PROMPTS)))
    assert {c.finish_reason for c in last.values()} == {"abort"}
    assert sum(len(c.token_ids) for _, c in out) < 200 * len(PROMPTS)
    stats = eng.stats()
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0


def test_a_closing_engine_fails_running_streams(tmp_path):
    path = make_tiny_qwen2(tmp_path, seed=6, max_position_embeddings=512)
    e = Engine(path, device="cpu", dtype="f32", progress=False, max_seq_len=256, num_kv_blocks=64)

    async def main():
        gen = Generation(e, e.engine_config.block_size, StreamHub(asyncio.get_running_loop()))
        gen.start([(e.tokenize(PROMPTS[0]), [dict(temperature=0, max_new_tokens=200, ignore_eos=True)])])
        async for _ in gen.events():
            await asyncio.to_thread(e.close)  # the step loop fails what still runs
    with pytest.raises(RuntimeError, match="engine is closed"):
        asyncio.run(main())


def test_a_request_with_a_sink_is_not_read_by_iteration(eng):
    class Sink:
        def __init__(self):
            self.items, self.flushes = [], 0

        def put(self, req, item):
            self.items.append(item)

        def flush(self):
            self.flushes += 1
    sink = Sink()
    req = eng.submit(PROMPTS[1], sink=sink, temperature=0, max_new_tokens=5)
    with pytest.raises(RuntimeError, match="sink"):
        next(iter(req))
    req._ended.wait()
    eng.stats()  # a round of the loop after the last put: its flush has run
    want = eng.generate(PROMPTS[1], temperature=0, max_new_tokens=5)
    assert [t for c in sink.items for t in c.token_ids] == want.token_ids
    assert sink.items[-1].finish_reason == "length" and 1 <= sink.flushes <= len(sink.items)


def test_merge_and_coalesce_keep_order_and_the_last_chunks_end():
    a = StreamChunk("a", [1], logprobs=[{"token_id": 1}])
    b = StreamChunk("é", [2, 3], logprobs=[{"token_id": 2}, {"token_id": 3}])
    end = StreamChunk("", [4], "length", {"completion_tokens": 4}, {"total_s": 1.0}, [{"token_id": 4}])
    m = merge_chunks([a, b, end])
    assert (m.text, m.token_ids, m.finish_reason, m.usage, m.timings) == ("aé", [1, 2, 3, 4], "length",
                                                                          end.usage, end.timings)
    assert [e["token_id"] for e in m.logprobs] == [1, 2, 3, 4]
    assert merge_chunks([StreamChunk("x", [1]), StreamChunk("y", [2])]).logprobs is None
    err = RuntimeError("boom")
    abort = StreamChunk("", [], "abort")
    out = coalesce([a, b, abort])
    assert [c.text for c in out] == ["aé", ""] and out[1] is abort  # the text before an abort still goes out
    out = coalesce([a, err])
    assert out[0].text == "a" and out[1] is err


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("include_usage", [True, False])
def test_stream_events_written_from_a_prefix_equal_the_dict_through_json(chat, include_usage):
    from llaisys.server.responses import Choice, Formatter, sse

    texts = ["plain", "", 'quo"te \\ back\nslash\t', "Ünïcödé 你好 😀", "\x00\x1f ctrl \u2028", "end"]
    fast = Formatter(None, "id-1", chat, "the/model \"name\"", False, include_usage)
    slow = Formatter(None, "id-1", chat, "the/model \"name\"", False, include_usage)
    slow.created = fast.created
    for index in (0, 2):
        a, b = Choice(), Choice()
        for k, text in enumerate(texts):
            chunk = StreamChunk(text, [k], "length" if k == len(texts) - 1 else None)
            a.add(chunk)
            b.add(chunk)
            got = fast.stream_event(index, a, chunk)
            assert got == sse(slow.stream_chunk(index, b, chunk))
            assert got.startswith("data: {") and got.endswith("}\n\n")


# ---- a whole (non-streaming) response: one chunk per request, decoded once (issue 33) --------------------

class Sink:
    """A ChunkSink that records every item put, per request."""

    def __init__(self):
        self.items, self.flushes = {}, 0

    def put(self, req, item):
        self.items.setdefault(req, []).append(item)

    def flush(self):
        self.flushes += 1


def _sunk(eng, sink, prompt, incremental, **sampling):
    req = eng.submit(prompt, sink=sink, incremental=incremental, **sampling)
    req._ended.wait()
    eng.stats()  # a round of the loop after the last put: its flush has run
    return sink.items[req]


# seeded sampling: varied text in many chunks (greedy on this random model repeats one token)
SAMPLED = dict(temperature=1.0, seed=11, max_new_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("extra", [{}, {"logprobs": 3}, {"max_new_tokens": 1}, {"temperature": 0, "ignore_eos": False}],
                         ids=["plain", "logprobs", "one-token", "greedy"])
@pytest.mark.parametrize("prompt", [PROMPTS[1], PROMPTS[2]], ids=["ascii", "unicode"])
def test_submit_not_incremental_puts_one_chunk_equal_to_the_merged_stream(eng, prompt, extra):
    sampling = {**SAMPLED, **extra}
    ref = eng.generate(prompt, **sampling)  # first: the prompt's full blocks are cached for both runs below
    chunks = _sunk(eng, Sink(), prompt, True, **sampling)
    whole = _sunk(eng, Sink(), prompt, False, **sampling)
    assert len(whole) == 1 and whole[0].finish_reason is not None
    if sampling["max_new_tokens"] > 1:
        assert len(chunks) > 1  # the comparison means something: the incremental one came in pieces
    want, got = merge_chunks(chunks), whole[0]
    assert (got.text, got.token_ids, got.logprobs, got.finish_reason) == \
           (want.text, want.token_ids, want.logprobs, want.finish_reason)
    assert got.usage == want.usage
    assert set(got.timings) == set(want.timings)
    assert (got.text, got.token_ids) == (ref.text, ref.token_ids)


def test_submit_not_incremental_with_stop_strings_stays_incremental_and_stops_at_the_same_place(eng):
    full = eng.generate(PROMPTS[1], **SAMPLED)
    stop = full.text[5:8]
    chunks = _sunk(eng, Sink(), PROMPTS[1], True, stop=[stop], **SAMPLED)
    whole = _sunk(eng, Sink(), PROMPTS[1], False, stop=[stop], **SAMPLED)
    want, got = merge_chunks(chunks), merge_chunks(whole)
    assert got.text == want.text == full.text[:full.text.index(stop)]
    assert got.token_ids == want.token_ids and len(got.token_ids) < len(full.token_ids)  # no token past the stop
    assert got.finish_reason == want.finish_reason == "stop" and got.usage == want.usage


def test_submit_not_incremental_never_detokenizes_per_token(eng, monkeypatch):
    from llaisys.streaming import IncrementalDetokenizer

    steps = []
    step = IncrementalDetokenizer.step
    monkeypatch.setattr(IncrementalDetokenizer, "step", lambda self, t: steps.append(t) or step(self, t))
    _sunk(eng, Sink(), PROMPTS[0], False, **SAMPLED)
    assert steps == []
    _sunk(eng, Sink(), PROMPTS[0], True, **SAMPLED)
    assert len(steps) == SAMPLED["max_new_tokens"]


@pytest.mark.parametrize("bad", [0, "no", None])
def test_submit_incremental_must_be_a_bool(eng, bad):
    with pytest.raises(TypeError, match="incremental must be True or False"):
        eng.submit(PROMPTS[0], sink=Sink(), incremental=bad, max_new_tokens=2)


def test_an_aborted_whole_request_ends_with_abort_and_frees_blocks(eng):
    sink = Sink()
    req = eng.submit(PROMPTS[0], sink=sink, incremental=False, temperature=0, max_new_tokens=200, ignore_eos=True)
    while req.first is None:
        time.sleep(0.001)
    req.abort()
    req._ended.wait()
    eng.stats()
    [last] = sink.items[req]
    assert last.finish_reason == "abort" and 0 < len(last.token_ids) < 200
    assert last.text == eng.tokenizer.decode(last.token_ids, skip_special_tokens=True)
    assert eng.stats()["kv_blocks_used"] == 0


# ---- the same, through the HTTP server (in process, and with the engine in its own process) ----------------

@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    from llaisys.engine.process import EngineProcess

    path = make_tiny_qwen2(tmp_path_factory.mktemp("delivery-proc"), seed=5, max_position_embeddings=512)
    p = EngineProcess(path, device="cpu", dtype="f32", progress=False, max_seq_len=256, num_kv_blocks=256)
    yield p
    p.close()


@pytest.fixture(scope="module", params=["engine", "process"])
def served(request):
    """(TestClient, {engine request: [items the hub was given]}) for an app serving the module's engine, or
    one running in a child process (the same checkpoint and seed)."""
    testclient = pytest.importorskip("fastapi.testclient")
    from llaisys.server.app import create_app

    engine = request.getfixturevalue("eng" if request.param == "engine" else "proc")
    app = create_app(engine, model_name="tiny")
    with testclient.TestClient(app) as client:
        hub, puts = app.state.llaisys.hub, {}
        put = hub.put
        hub.put = lambda req, item: (puts.setdefault(req, []).append(item), put(req, item))[1]
        yield client, puts


def _merged_stream(client, path: str, body: dict) -> dict:
    """The SSE stream of `body` merged into the shape of a whole response's choices and usage."""
    r = client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert not any("error" in e for e in events), events
    chat = path.endswith("chat/completions")
    choices: dict[int, dict] = {}
    for e in events:
        for c in e["choices"]:
            out = choices.setdefault(c["index"], {"index": c["index"], "finish_reason": None, "logprobs": None,
                                                  **({"message": {"role": "assistant", "content": ""}} if chat
                                                     else {"text": ""})})
            if chat:
                out["message"]["content"] += c["delta"].get("content") or ""
            else:
                out["text"] += c["text"]
            if c.get("logprobs"):
                lp = out["logprobs"] = out["logprobs"] or {}
                for k, v in c["logprobs"].items():
                    lp[k] = lp.get(k, []) + v
            out["finish_reason"] = c["finish_reason"] or out["finish_reason"]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": events[-1]["usage"]}


LONG = "A long enough prompt to fill more than one block of the KV cache " * 2  # n > 1: a leader and followers
CASES = [
    ("/v1/completions", {"prompt": PROMPTS[1]}),
    ("/v1/completions", {"prompt": PROMPTS[2], "logprobs": 2}),
    ("/v1/completions", {"prompt": PROMPTS[1], "n": 2}),
    ("/v1/completions", {"prompt": LONG, "n": 3, "logprobs": 1}),
    ("/v1/completions", {"prompt": [PROMPTS[0], PROMPTS[3]], "echo": True, "logprobs": 1}),
    ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 0, "echo": True}),
    ("/v1/completions", {"prompt": PROMPTS[1], "stop": "STOP"}),  # filled in by the test: a stop it meets
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[2]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[1]}], "logprobs": True,
                              "top_logprobs": 2, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}], "stop": ["STOP"]}),
]


CASE_IDS = [f"{'chat' if 'chat' in p else 'text'}-{i}" for i, (p, _) in enumerate(CASES)]


@pytest.mark.parametrize("path, extra", CASES, ids=CASE_IDS)
def test_a_whole_response_equals_the_stream_merged_and_gets_one_chunk_per_request(served, path, extra, monkeypatch):
    client, puts = served
    body = {"model": "tiny", "max_tokens": 16, "temperature": 1.0, "seed": 3, "ignore_eos": True, **extra}
    if "stop" in extra:  # a stop string the text meets, from the same request without one
        r = client.post(path, json={k: v for k, v in body.items() if k != "stop"})
        c = r.json()["choices"][0]
        text = c["message"]["content"] if "message" in c else c["text"]
        assert len(text) > 8, text
        body["stop"] = text[4:7]
    client.post(path, json=body)  # the prompt's blocks cached from here: every run counts the same cached tokens
    streamed = _merged_stream(client, path, body)
    with monkeypatch.context() as m:  # the whole response as before: every request incremental
        start = Generation.start
        m.setattr(Generation, "start", lambda self, groups, incremental=True: start(self, groups))
        before = client.post(path, json=body).json()
    puts.clear()
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert (got["choices"], got["usage"]) == (before["choices"], before["usage"])
    # and what a stream gives, but completions' text_offset: a stream counts a chunk's characters, a whole
    # response each token's text (a broken character is one U+FFFD per token): they differ where tokens split
    # a character, as they did before (a whole response never depended on how its chunks came)
    for c in got["choices"] + streamed["choices"]:
        (c["logprobs"] or {}).pop("text_offset", None)
    assert got["choices"] == streamed["choices"]
    assert got["usage"] == streamed["usage"]
    if "stop" in extra:
        assert all(c["finish_reason"] == "stop" for c in got["choices"])
        assert any(len(items) > 1 for items in puts.values())  # stop strings keep a request incremental
        return
    # one chunk per request, but the first of n choices when its prompt fills a KV block: the others start
    # at its first chunk, to share the prompt's cached blocks, so it stays incremental
    led = int(extra.get("n", 1) > 1)
    counts = sorted(len(items) for items in puts.values())
    assert len(counts) == (0 if extra.get("max_tokens") == 0 else len(got["choices"]))
    assert counts[:len(counts) - led] == [1] * (len(counts) - led), counts


def test_a_whole_responses_ttft_is_its_first_tokens_not_its_last(served, caplog):
    """Its one chunk arrives at the end: the TTFT it logs (and observes in /metrics) is the engine's."""
    import re

    client, _ = served
    with caplog.at_level("INFO", logger="llaisys.server"):
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 120,
                                                 "temperature": 1.0, "seed": 1, "ignore_eos": True})
    assert r.status_code == 200, r.text
    line = [rec.getMessage() for rec in caplog.records if " 200 ok " in rec.getMessage()][-1]
    ttft, total = map(float, re.search(r"ttft=([\d.]+)s total=([\d.]+)s", line).groups())
    assert 0 < ttft < total / 2, line  # 1 prefill step against 119 decode steps
