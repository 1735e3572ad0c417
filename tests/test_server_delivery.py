"""How the server reads the engine (server/backend.py), without HTTP: requests submitted with a sink hand
their chunks to one StreamHub per event loop, flushed once per step, and a reader that falls behind gets
the waiting chunks of a choice as one. A coalesced stream must carry exactly what Engine.generate gives
(text, token ids, logprobs, finish_reason, usage), with stop strings and multi-byte characters; n > 1,
aborts and a closing engine keep their meaning. A tiny random checkpoint on the CPU."""
import asyncio

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
