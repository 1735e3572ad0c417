"""Logprobs of requests read only at their end (engine/logprobs_log.py, issue 33): generate()'s rows with
logprobs are quiet rows of the persistent batch, their entries kept as arrays in the log of each batch layout
and built when the request ends. What users see must be what streaming gives, entry by entry: one entry per
output token, in order, whatever ends a row (EOS, length, an abort), whatever else changes the batch (rows
ending beside it, late arrivals, preemption and recompute), on the plain steps (entries from the logits) and
the overlapped ones (computed on the device behind the step)."""
import numpy as np
import pytest

from tiny_model import make_tiny_qwen2
from utils import f32_engine as engine, token_prompts as prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("lplog"), seed=7, max_position_embeddings=1024)


def same_entries(got, want):
    """got and want: lists of entries, equal entry by entry (ids exactly, logprobs to f32 rounding: the rows
    ran in batches of other sizes)."""
    assert got is not None and want is not None and len(got) == len(want)
    for a, b in zip(got, want):
        assert set(a) == {"token_id", "logprob", "top"} and type(a["top"]) is list
        assert a["token_id"] == b["token_id"] and [i for i, _ in a["top"]] == [i for i, _ in b["top"]]
        assert all(type(p) is list and type(p[0]) is int and type(p[1]) is float for p in a["top"])
        assert type(a["token_id"]) is int and type(a["logprob"]) is float
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)
        np.testing.assert_allclose([x for _, x in a["top"]], [x for _, x in b["top"]], atol=1e-5)


def streamed(eng, prompt, **kw):
    """(token ids, logprobs entries, finish reason) of the request streamed alone (entries built step by step)."""
    chunks = list(eng.stream(prompt, **kw))
    lps = [e for c in chunks for e in (c.logprobs or ())]
    return [t for c in chunks for t in c.token_ids], lps, chunks[-1].finish_reason


@pytest.mark.parametrize("overlap", [False, True])
def test_entries_of_rows_read_at_the_end_equal_the_streamed_ones(tiny, overlap):
    """A batch of generate() rows with logprobs (k 5, 0, 20 and 3: one layout's arrays hold several k) that end
    at different steps (max_new_tokens, an EOS among them), beside a streamed row with logprobs (not quiet:
    its entries are built each step from the same arrays): each result's entries equal the ones of the same
    request streamed alone, one per token, with the token's id."""
    eng = engine(tiny, "cpu", overlap)
    ps = prompts(eng.config.vocab_size, [4, 19, 33, 7, 12], seed=21)
    news, ks = [40, 9, 20, 33, 30], [5, 0, 20, 3, 2]  # the row with k 20 leaves before two others
    alone = [streamed(eng, p, max_new_tokens=n, temperature=0, logprobs=k, ignore_eos=True)
             for p, n, k in zip(ps, news, ks)]
    stop_at = alone[0][0][15]  # a token the first row samples mid-way: rows that sample it end there
    alone_eos = [streamed(eng, p, max_new_tokens=n, temperature=0, logprobs=k, stop_token_ids=[stop_at])
                 for p, n, k in zip(ps, news, ks)]
    for stop, want in ((None, alone), ([stop_at], alone_eos)):
        kw = dict(ignore_eos=True) if stop is None else dict(stop_token_ids=stop)
        loud = eng.submit(ps[4], max_new_tokens=news[4], temperature=0, logprobs=ks[4], **kw)  # streamed
        out = eng.generate(ps[:4], max_new_tokens=news[:4], temperature=0, logprobs=ks[:4], **kw)
        got = list(loud)
        out.append(type(out[0])("", [t for c in got for t in c.token_ids], got[-1].finish_reason,
                                logprobs=[e for c in got for e in c.logprobs]))
        for r, (ids, lps, reason), k in zip(out, want, ks):
            assert (r.token_ids, r.finish_reason) == (ids, reason)
            same_entries(r.logprobs, lps)
            assert [e["token_id"] for e in r.logprobs] == r.token_ids
            assert {len(e["top"]) for e in r.logprobs} == {k}
    assert alone_eos[0][2] == "stop" and len(alone_eos[0][0]) <= 16  # it ends mid-batch
    s = eng.stats()
    assert s["decode_batch_steps"] > 0 and s["kv_blocks_used"] == 0
    if overlap:  # rows ending by length left chained steps (EngineCore._account_kept), logprobs on the device
        assert s["chain_dropped_rows"] > 0 and s["overlapped_steps"] > 20
    eng.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_rows_read_at_the_end_get_no_entries_per_step(tiny, overlap):
    """generate()'s rows with logprobs are quiet: a batch step's produced list leaves them out until they end
    (the step loop does nothing for them per token), and no entry is built for them per step."""
    from llaisys.engine import core as core_mod

    eng = engine(tiny, "cpu", overlap)
    listed, built, step = [], [], eng._core.step
    own = core_mod.lp_entries

    def counting():
        produced, failed = step()
        listed.append(len(produced))
        return produced, failed

    def entries(tokens, *a, **kw):
        out = own(tokens, *a, **kw)
        built.append(len(out))
        return out

    eng._core.step = counting
    core_mod.lp_entries = entries
    try:
        ps = prompts(eng.config.vocab_size, [3, 17, 40, 9], seed=4)
        out = eng.generate(ps, max_new_tokens=[30, 5, 47, 60], temperature=0, logprobs=5, ignore_eos=True)
    finally:
        core_mod.lp_entries = own
    total = sum(len(r.token_ids) for r in out)
    assert [len(r.logprobs) for r in out] == [30, 5, 47, 60]
    assert sum(listed) < total / 2  # the first tokens, the ends, and the steps before the batch
    assert sum(built) < total / 2  # entries built per step: only the general path's (prefill steps)
    assert eng.stats()["decode_batch_steps"] > 0
    eng.close()


def aborted_beside_others(eng) -> None:
    """A generate-style request with logprobs (incremental=False) aborted after the streamed row beside it got 30
    tokens, and a third that goes on: the aborted one holds one entry per token it got, equal to the entries of
    the same request run alone; the others equal theirs alone."""
    ps = prompts(eng.config.vocab_size, [6, 21, 11], seed=12)
    kw = dict(max_new_tokens=80, temperature=0, ignore_eos=True, logprobs=4)
    alone = [streamed(eng, p, **kw) for p in ps]
    quiet = eng.submit(ps[0], incremental=False, **kw)
    other = eng.submit(ps[2], incremental=False, **kw)
    ids = []
    for chunk in eng.submit(ps[1], **kw):
        ids += chunk.token_ids
        if len(ids) >= 30 and not quiet.done:
            quiet.abort()
    got, rest = quiet.result(), other.result()
    assert got.finish_reason == "abort" and 0 < len(got.token_ids) < 80
    assert got.token_ids == alone[0][0][:len(got.token_ids)]
    same_entries(got.logprobs, alone[0][1][:len(got.token_ids)])
    assert rest.token_ids == alone[2][0]
    same_entries(rest.logprobs, alone[2][1])
    assert ids == alone[1][0]


@pytest.mark.parametrize("overlap", [False, True])
def test_aborted_row_read_at_the_end_keeps_an_entry_per_token(tiny, overlap):
    """A generate-style request with logprobs (incremental=False) aborted while the batch runs: its result holds
    one entry per token it got, equal to the entries of the same request run alone, and the row beside it
    (which goes on, its batch condensed) too."""
    eng = engine(tiny, "cpu", overlap)
    aborted_beside_others(eng)
    assert eng.stats()["kv_blocks_used"] == 0
    eng.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_preempted_rows_read_at_the_end_get_each_entry_once(tiny, overlap):
    """A pool so small that decodes preempt each other (a preempted row is recomputed from its tokens, and
    its entries so far are kept, not computed again), with late arrivals that rebuild the batch: every result
    has one entry per token, equal to the same request's alone."""
    eng = engine(tiny, "cpu", overlap, block_size=4, num_kv_blocks=64, max_seq_len=200)
    ps = prompts(eng.config.vocab_size, [30, 9, 3, 20, 14], seed=31)
    kw = dict(max_new_tokens=[70, 66, 75, 40, 61], temperature=0, ignore_eos=True, logprobs=[3, 5, 1, 0, 5])
    alone = [streamed(eng, p, max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=k)
             for p, n, k in zip(ps, kw["max_new_tokens"], kw["logprobs"])]
    before = eng.stats()["preemptions"]
    first = [eng.submit(p, incremental=False, max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=k)
             for p, n, k in zip(ps[:3], kw["max_new_tokens"][:3], kw["logprobs"][:3])]
    out = eng.generate(ps[3:], max_new_tokens=kw["max_new_tokens"][3:], temperature=0, ignore_eos=True,
                       logprobs=kw["logprobs"][3:])
    out = [r.result() for r in first] + out
    assert eng.stats()["preemptions"] > before
    for r, (ids, lps, reason) in zip(out, alone):
        assert (r.token_ids, r.finish_reason) == (ids, reason)
        same_entries(r.logprobs, lps)
    assert eng.stats()["kv_blocks_used"] == 0
    eng.close()


def test_entries_builder_matches_the_python_formula_on_strided_columns():
    """_core.logprobs_entries (through logprobs_log.entries) on a column of a [steps, rows, k] log: the dicts the
    Python comprehension of before built from tolist() (same keys, ints, floats, list pairs, first min(k, V)),
    for one k for every row and a k per row; its containers left to reference counting."""
    import gc

    from llaisys.engine.logprobs_log import entries

    rng = np.random.default_rng(5)
    T, R, K = 9, 4, 6
    ids = rng.integers(0, 1 << 40, (T, R, K))
    lps = rng.standard_normal((T, R, K)).astype(np.float32)
    chosen = rng.standard_normal((T, R)).astype(np.float32)
    tokens = rng.integers(0, 1 << 40, T).tolist()

    def before(ks, V):  # the engine's comprehension before (EngineCore._entries) on host lists
        return [{"token_id": t, "logprob": lp, "top": list(map(list, zip(i[:min(n, V)], l)))}
                for t, n, lp, i, l in zip(tokens, ks, chosen[:, 2].tolist(), ids[:, 2].tolist(), lps[:, 2].tolist())]

    for ks, V in ((5, 1000), (3, 2), (0, 1000), ([0, 1, 6, 2, 5, 6, 3, 4, 1], 1000), ([4] * T, 3)):
        got = entries(tokens, ks, chosen[:, 2], ids[:, 2], lps[:, 2], V)
        want = before(ks if isinstance(ks, list) else [ks] * T, V)
        assert got == want
        assert all(type(p[0]) is int and type(p[1]) is float for e in got for p in e["top"])
        assert not any(gc.is_tracked(x) for e in got for x in [e, e["top"], *e["top"]])
    e = got[0]
    e["more"] = [e]  # a container put in a dict: CPython tracks the dict again, so such a cycle is collected
    assert gc.is_tracked(e)


# ---- entries built when read (issue 33: off the step loop) -------------------------------------------------
def test_result_entries_are_built_in_the_readers_thread_when_first_read(tiny, monkeypatch):
    """generate()'s rows with logprobs come back with their entries not built (the step loop copied each row's
    arrays out when it ended, and built only the general path's entries); the first read of `logprobs` builds
    them in the reading thread, and they equal the entries of the same requests streamed (built step by step).
    Every token's entry is built once: those the step loop built plus those the reader built are one per token."""
    import threading

    from llaisys.engine import logprobs_log
    from llaisys.engine.logprobs_log import Pending, raw_logprobs

    eng = engine(tiny, "cpu", True)
    ps = prompts(eng.config.vocab_size, [3, 17, 40, 9], seed=4)
    kw = dict(max_new_tokens=[30, 5, 47, 60], temperature=0, logprobs=[5, 2, 0, 3], ignore_eos=True)
    alone = [streamed(eng, p, max_new_tokens=n, temperature=0, logprobs=k, ignore_eos=True)
             for p, n, k in zip(ps, kw["max_new_tokens"], kw["logprobs"])]
    built, core = [], logprobs_log._core

    class Counting:  # logprobs_log's _core (entries: the step loop's; Pending.build: the reader's)
        @staticmethod
        def logprobs_entries(tokens, *a):
            built.append((threading.current_thread() is threading.main_thread(), len(tokens)))
            return core.logprobs_entries(tokens, *a)

    monkeypatch.setattr(logprobs_log, "_core", Counting)
    out = eng.generate(ps, **kw)
    on_loop = sum(n for main, n in built if not main)
    assert not any(main for main, _ in built)  # nothing was built in this thread yet
    assert all(type(raw_logprobs(r)) is Pending for r in out)  # (and nothing read them)
    assert on_loop < sum(kw["max_new_tokens"]) / 2  # the first tokens' and the prefill steps' entries only
    for r, (ids, lps, reason) in zip(out, alone):
        assert r.token_ids == ids
        same_entries(r.logprobs, lps)
        assert type(r.logprobs) is list and r.logprobs is r.logprobs  # built once, then a plain attribute
        assert "logprobs" in vars(r) and raw_logprobs(r) is r.logprobs
    by_reader = sum(n for main, n in built if main)
    assert by_reader > 0 and on_loop + by_reader == sum(kw["max_new_tokens"])
    assert eng.stats()["decode_batch_steps"] > 0
    eng.close()


def test_a_requests_arrays_are_its_own_copies(tiny):
    """The Pending of a result holds copies of its own rows of the batch's log (arrays that own their data,
    one token's row each), not views of the log: a result kept unread holds no other request's arrays, and
    rows that go on writing the log (or a new log) cannot change it."""
    from llaisys.engine.logprobs_log import Pending, raw_logprobs

    eng = engine(tiny, "cpu", False)
    ps = prompts(eng.config.vocab_size, [5, 12, 8], seed=9)
    first = eng.submit(ps[0], incremental=False, max_new_tokens=12, temperature=0, logprobs=4, ignore_eos=True)
    rest = eng.submit(ps[1], incremental=False, max_new_tokens=70, temperature=0, logprobs=2, ignore_eos=True)
    got = first.result()
    pending = raw_logprobs(got)
    assert type(pending) is Pending
    segments, stack = [], [pending]
    while stack:
        for part in stack.pop().parts:
            if type(part) is Pending:
                stack.append(part)
            elif type(part) is tuple:
                segments.append(part)
    assert segments and sum(len(s[0]) for s in segments) < 12  # the first token's entry was built on the loop
    for tokens, chosen, ids, lps, (k,) in segments:
        assert all(a.base is None for a in (chosen, ids, lps)) and k == 4
        assert chosen.shape == (len(tokens),) and ids.shape == lps.shape == (len(tokens), 4)
    rest.result()
    alone = streamed(eng, ps[0], max_new_tokens=12, temperature=0, logprobs=4, ignore_eos=True)
    same_entries(got.logprobs, alone[1])  # read after the other row ran on
    eng.close()


def test_pending_entries_equal_the_eager_ones_from_the_same_arrays():
    """resolve() on a sequence's entries and Spans of two logs (one with a larger k, one ending before the
    sequence's output does) gives a Pending whose entries are the eager builder's on the same columns, in
    order, with the given entries in their places (the same objects)."""
    from types import SimpleNamespace

    from llaisys.engine.logprobs_log import LogprobsLog, Pending, Span, entries, resolve

    rng = np.random.default_rng(3)
    V, k = 50, 3
    logs = []
    for steps, K, cols in ((7, 5, 3), (9, 3, 2)):
        log = LogprobsLog(list(range(cols)), K, V, [k] * cols)
        for _ in range(steps):
            log.append(rng.integers(0, V, cols), rng.standard_normal(cols).astype(np.float32),
                       rng.integers(0, V, (cols, K)), rng.standard_normal((cols, K)).astype(np.float32))
        logs.append(log)
    head = {"token_id": 1, "logprob": -0.5, "top": [[1, -0.5]]}
    mid = {"token_id": 2, "logprob": -1.5, "top": [[2, -1.5]]}
    # output: head (1), 7 tokens in log 0's column 1, mid (1), 5 of log 1's 9 steps in column 0 (the output ends)
    out = rng.integers(0, V, 14).tolist()
    seq = SimpleNamespace(num_prompt=4, num_output=14, tokens=[0] * 4 + out, params=SimpleNamespace(logprobs=k))
    items = [head, Span(logs[0], 1, 1), mid, Span(logs[1], 0, 9)]
    got = resolve(items, seq)
    assert type(got) is Pending
    want = ([head] + entries(out[1:8], k, logs[0].chosen[:7, 1], logs[0].ids[:7, 1], logs[0].lps[:7, 1], V) + [mid]
            + entries(out[9:14], k, logs[1].chosen[:5, 0], logs[1].ids[:5, 0], logs[1].lps[:5, 0], V))
    lps = got.build()
    assert lps == want and len(lps) == 14 and lps[0] is head and lps[8] is mid
    assert got.build() is lps and got.parts is None  # once
    assert resolve([head, mid], seq) == [head, mid]  # no Span: the entries as they are


def test_lazy_results_and_chunks_behave_as_the_eager_ones():
    """A GenerationResult or StreamChunk whose logprobs wait in a Pending shows the same thing as one made with
    the built list: the attribute is a plain list (equal, same repr, the same list on every read, in every
    thread at once), dataclasses.asdict/replace, json, pickle, copy and deepcopy see it built; the dataclass's
    default is still None; merge_chunks and Request.result keep entries not built as they are until read."""
    import copy
    import dataclasses
    import json
    import pickle
    import threading

    from llaisys.engine import GenerationResult, StreamChunk
    from llaisys.engine.logprobs_log import Pending, raw_logprobs, set_lazy
    from llaisys.engine.request import merge_chunks

    seg = ([3, 4], np.array([-0.5, -1.0], np.float32), np.array([[3, 9], [4, 1]]),
           np.array([[-0.5, -2.0], [-1.0, -3.0]], np.float32), [2])
    head = {"token_id": 1, "logprob": -0.25, "top": [[1, -0.25], [7, -3.0]]}
    want = [head, {"token_id": 3, "logprob": -0.5, "top": [[3, -0.5], [9, -2.0]]},
            {"token_id": 4, "logprob": -1.0, "top": [[4, -1.0], [1, -3.0]]}]

    def lazy(cls=GenerationResult):
        args = ("abc", [1, 3, 4], "length", {"completion_tokens": 3}, {"total_s": 1.0})
        return set_lazy(cls(*args), Pending([head, seg])), cls(*args, logprobs=[dict(e) for e in want])

    for cls in (GenerationResult, StreamChunk):
        got, eager = lazy(cls)
        assert type(raw_logprobs(got)) is Pending and got == eager and type(got.logprobs) is list
        got, eager = lazy(cls)
        assert repr(got) == repr(eager) and vars(got) == vars(eager)
        got, eager = lazy(cls)
        assert dataclasses.asdict(got) == dataclasses.asdict(eager)
        assert json.dumps(lazy(cls)[0].logprobs) == json.dumps(eager.logprobs)
        for clone in (pickle.loads(pickle.dumps(lazy(cls)[0])), copy.copy(lazy(cls)[0]), copy.deepcopy(lazy(cls)[0])):
            assert clone == eager and vars(clone) == vars(eager)
        got = dataclasses.replace(lazy(cls)[0], text="x")
        assert got.logprobs == want and got.text == "x"
        got, seen = lazy(cls)[0], []
        threads = [threading.Thread(target=lambda: seen.append(got.logprobs)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(seen) == 8 and all(s is got.logprobs for s in seen) and got.logprobs == want
        assert cls("", [], "stop").logprobs is None and cls.logprobs is None
        assert [f.default for f in dataclasses.fields(cls) if f.name == "logprobs"] == [None]
    # a pickled Pending (the engine process's child sends it so) builds the same entries
    assert pickle.loads(pickle.dumps(Pending([head, seg]))).build() == want
    # merge_chunks: entries not built stay so, in order after the built ones
    first = StreamChunk("a", [9], logprobs=[{"token_id": 9, "logprob": -0.1, "top": []}])
    merged = merge_chunks([first, set_lazy(StreamChunk("bc", [1, 3, 4], "stop"), Pending([head, seg]))])
    assert type(raw_logprobs(merged)) is Pending
    assert merged.logprobs == first.logprobs + want and merged.text == "abc" and merged.token_ids == [9, 1, 3, 4]
    assert merge_chunks([StreamChunk("a", [1]), StreamChunk("b", [2], "stop")]).logprobs is None


def test_a_pending_unpickled_elsewhere_builds_the_same_entries_without_the_native_module(monkeypatch):
    """A Pending that crossed a process boundary (the engine process's child sends it so) builds its entries in
    Python (py_entries), never through _core (the server's process calls none of it): the same dicts, ints and
    floats as _core.logprobs_entries, for every k up to the segment's width (0 included)."""
    import pickle

    from llaisys.engine import logprobs_log
    from llaisys.engine.logprobs_log import Pending, py_entries

    rng = np.random.default_rng(8)
    T, K = 11, 6
    tokens = rng.integers(0, 1 << 40, T).tolist()
    chosen = rng.standard_normal(T).astype(np.float32)
    ids = rng.integers(0, 1 << 40, (T, K))
    lps = rng.standard_normal((T, K)).astype(np.float32)
    for k in (0, 1, 4, K, K + 2):
        want = logprobs_log._core.logprobs_entries(tokens, chosen, ids, lps, [k])
        got = py_entries(tokens, chosen, ids, lps, [k])
        assert got == want and all(type(p[0]) is int and type(p[1]) is float for e in got for p in e["top"])
        assert [type(e["token_id"]) for e in got] == [int] * T and [type(e["logprob"]) for e in got] == [float] * T
    head = {"token_id": 5, "logprob": -0.5, "top": []}
    parts = [head, (tokens, chosen, ids, lps, [3]), Pending([(tokens[:2], chosen[:2], ids[:2], lps[:2], [2])])]
    want = Pending(parts).build()
    crossed = pickle.loads(pickle.dumps(Pending(parts)))
    monkeypatch.setattr(logprobs_log, "_core", None)  # any use of it fails
    assert crossed.build() == want and len(want) == 1 + T + 2


# ---- entries built ahead while the device computes (EngineCore._build_ahead) --------------------------------
def _built_split(parts) -> tuple[int, int]:
    """(entries built ahead, entries still as arrays) of a Span's parts."""
    return (sum(len(p) for p in parts if type(p) is list), sum(len(p[0]) for p in parts if type(p) is tuple))


@pytest.fixture
def ahead(monkeypatch):
    """busy(pattern): ModelRunner.busy then answers from `pattern`, cycled (on the CPU the runner is never busy,
    so nothing would be built ahead), and every Span's parts, as Request.finish takes them, are checked: the
    entries built ahead plus those of the rest's arrays are exactly (==) the entries of the arrays alone (the
    lazy path: the same log with nothing built), so the tokens kept by the log are the sequence's, in every
    column and step. chunk: LogprobsLog.chunk (None: its own). Returns the counts: entries taken built, taken
    as arrays, build_next calls while rows had left the log's batch (its `at` path)."""
    import itertools

    from llaisys.engine import logprobs_log
    from llaisys.engine.logprobs_log import LogprobsLog, Pending, Span
    from llaisys.engine.model_runner import ModelRunner

    counts = {"built": 0, "arrays": 0, "at_calls": 0}
    parts, build_next = Span.parts, LogprobsLog.build_next

    def checked(self, seq):
        got = parts(self, seq)
        built = self.log.built
        saved, built[self.col] = built[self.col], []
        try:
            lazy = parts(self, seq)
        finally:
            built[self.col] = saved
        assert all(type(p) is tuple for p in lazy)
        assert Pending(list(got)).build() == Pending(lazy).build()
        b, a = _built_split(got)
        counts["built"] += b
        counts["arrays"] += a
        return got

    def counted(self):
        counts["at_calls"] += self.at is not None
        build_next(self)

    def busy(pattern, chunk=None):
        answers = itertools.cycle(pattern)
        if chunk is not None:
            monkeypatch.setattr(LogprobsLog, "chunk", chunk)
        monkeypatch.setattr(ModelRunner, "busy", property(lambda self: next(answers)))
        monkeypatch.setattr(logprobs_log.Span, "parts", checked)
        monkeypatch.setattr(logprobs_log.LogprobsLog, "build_next", counted)
        return counts

    return busy


def test_the_cpu_runner_is_never_busy_and_builds_nothing_ahead(tiny):
    """On the CPU (the device never busy) the step loop builds no entry ahead: every quiet row's entries wait
    as arrays, as before (built by the reader)."""
    from llaisys.engine.logprobs_log import Pending, raw_logprobs

    eng = engine(tiny, "cpu", True)
    assert eng._core.runner.busy is False and eng._core.runner.runner.busy is False  # (the native property)
    ps = prompts(eng.config.vocab_size, [3, 17], seed=4)
    out = eng.generate(ps, max_new_tokens=30, temperature=0, logprobs=3, ignore_eos=True)
    for r in out:
        pending = raw_logprobs(r)
        assert type(pending) is Pending and not any(type(p) is list for p in pending.parts)
        assert len(r.logprobs) == 30
    assert eng.stats()["overlapped_steps"] > 10 and eng._core.timing["ahead_steps"] == 0
    eng.close()


def test_a_failure_while_building_ahead_leaves_the_entries_to_the_reader(tiny, monkeypatch):
    """Building ahead is an optimisation: when it raises (here its third chunk, after two were appended) the step
    goes on, a RuntimeWarning says why, nothing more is built ahead, and every request's entries (part built,
    part arrays) equal those of the same requests streamed alone."""
    import itertools

    from llaisys.engine.logprobs_log import LogprobsLog
    from llaisys.engine.model_runner import ModelRunner

    eng = engine(tiny, "cpu", True)
    ps = prompts(eng.config.vocab_size, [5, 11, 8], seed=9)
    want = [streamed(eng, p, max_new_tokens=24, temperature=0, logprobs=3, ignore_eos=True) for p in ps]
    build_next, calls = LogprobsLog.build_next, itertools.count()

    def flaky(self):
        if next(calls) == 2:
            raise MemoryError("no room for the entries")
        build_next(self)
    monkeypatch.setattr(LogprobsLog, "chunk", 1)
    monkeypatch.setattr(LogprobsLog, "build_next", flaky)
    monkeypatch.setattr(ModelRunner, "busy", property(lambda self: True))
    with pytest.warns(RuntimeWarning, match="building logprobs entries ahead failed .MemoryError: no room"):
        out = eng.generate(ps, max_new_tokens=24, temperature=0, logprobs=3, ignore_eos=True)
    assert eng._core.ahead_failed == "MemoryError: no room for the entries"
    assert next(calls) == 3  # nothing was tried after the failure
    assert [(r.token_ids, r.logprobs) for r in out] == [(t, lp) for t, lp, _ in want]
    eng.close()


@pytest.mark.parametrize("pattern, chunk", [((True,), None), ((True, False, False), 2)], ids=["always", "mixed"])
def test_entries_built_ahead_equal_the_lazy_ones(tiny, ahead, pattern, chunk):
    """With the device busy before every overlapped step's tokens (always: every logged step gets built; mixed:
    two entries every other wait or so, so requests end with part built, part arrays, steps part built):
    generate() rows with
    different k (5, 0, 20, 3) ending at different steps (the log follows rows leaving: its `at` path), beside a
    streamed row and a row with a stop string (loud: their entries built each step, the log's `sel` path),
    with EOS ends and seeded sampling too. Every Span's built entries equal the lazy ones exactly (the fixture),
    and the results equal the same requests streamed alone."""
    eng = engine(tiny, "cpu", True)
    ps = prompts(eng.config.vocab_size, [4, 19, 33, 7, 12, 9], seed=21)
    news, ks = [40, 9, 20, 33, 30, 25], [5, 0, 20, 3, 2, 4]
    greedy = dict(temperature=0)
    sampled = dict(temperature=0.9, top_k=50, seed=11)
    alone = [streamed(eng, p, max_new_tokens=n, temperature=0, logprobs=k, ignore_eos=True)
             for p, n, k in zip(ps, news, ks)]
    stop_at = alone[0][0][15]  # a token the first row samples mid-way: rows that sample it end there
    text = eng.tokenizer.decode(alone[5][0])
    stop = text[len(text) // 2:len(text) // 2 + 2]  # a stop string the last row meets mid-way
    counts = ahead(pattern)
    rounds = (dict(ignore_eos=True, **greedy), dict(stop_token_ids=[stop_at], **greedy),
              dict(ignore_eos=True, **sampled))
    for kw in rounds:
        want = [streamed(eng, p, max_new_tokens=n, logprobs=k, **kw, **({"stop": [stop]} if i == 5 else {}))
                for i, (p, n, k) in enumerate(zip(ps, news, ks))]
        loud = eng.submit(ps[4], max_new_tokens=news[4], logprobs=ks[4], **kw)  # streamed
        stopped = eng.submit(ps[5], incremental=False, max_new_tokens=news[5], logprobs=ks[5], stop=[stop], **kw)
        out = eng.generate(ps[:4], max_new_tokens=news[:4], logprobs=ks[:4], **kw)
        got = list(loud)
        out.append(type(out[0])("", [t for c in got for t in c.token_ids], got[-1].finish_reason,
                                logprobs=[e for c in got for e in c.logprobs]))
        out.append(stopped.result())
        if kw is rounds[0]:  # the stop string ends it mid-way
            assert want[5][2] == "stop" and len(want[5][0]) < news[5]
        for r, (ids, lps, reason), k in zip(out, want, ks):
            assert (r.token_ids, r.finish_reason) == (ids, reason)
            same_entries(r.logprobs, lps)
            assert [e["token_id"] for e in r.logprobs] == r.token_ids
            assert {len(e["top"]) for e in r.logprobs} == {k}
    assert counts["built"] > 0 and counts["arrays"] > 0 and counts["at_calls"] > 0
    if pattern == (True,):  # each request's entries were built but those of its last step or two
        assert counts["built"] > 5 * counts["arrays"]
    assert eng._core.timing["ahead_steps"] > 0 and eng._core.timing["ahead_s"] > 0
    s = eng.stats()
    assert s["decode_batch_steps"] > 0 and s["kv_blocks_used"] == 0
    eng.close()


@pytest.mark.parametrize("pattern, chunk", [((True,), None), ((True, False, False), 2)], ids=["always", "mixed"])
def test_entries_built_ahead_of_aborted_and_preempted_rows(tiny, ahead, pattern, chunk):
    """Entries built ahead where a quiet row is aborted while its batch runs (its column left with steps the
    sequence never got), and where decodes preempt each other with late arrivals (each rebuild begins a new
    log, a sequence's entries then span several logs, each partly built): every Span's parts equal the lazy
    ones (the fixture), every result the same request's alone, one entry per token."""
    eng = engine(tiny, "cpu", True, block_size=4, num_kv_blocks=64, max_seq_len=200)
    counts = ahead(pattern, chunk)
    aborted_beside_others(eng)
    aborted = dict(counts)

    ps = prompts(eng.config.vocab_size, [30, 9, 3, 20, 14], seed=31)
    news, ks = [70, 66, 75, 40, 61], [3, 5, 1, 0, 5]
    alone = [streamed(eng, p, max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=k)
             for p, n, k in zip(ps, news, ks)]
    before = eng.stats()["preemptions"]
    first = [eng.submit(p, incremental=False, max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=k)
             for p, n, k in zip(ps[:3], news[:3], ks[:3])]
    out = eng.generate(ps[3:], max_new_tokens=news[3:], temperature=0, ignore_eos=True, logprobs=ks[3:])
    out = [r.result() for r in first] + out
    assert eng.stats()["preemptions"] > before
    for r, (ids, lps, reason) in zip(out, alone):
        assert (r.token_ids, r.finish_reason) == (ids, reason)
        same_entries(r.logprobs, lps)
    assert aborted["built"] > 0 and counts["built"] > aborted["built"] and counts["arrays"] > aborted["arrays"]
    assert eng.stats()["kv_blocks_used"] == 0
    eng.close()


def test_build_next_equals_the_arrays_entries_for_every_k_and_layout():
    """LogprobsLog.build_next on random arrays (no engine): columns with k 3, 0, 7 > V 6 (the vocabulary
    bounds it) and 2, steps whose logprobs rows hold loud rows too (`sel`), rows leaving mid-way (`at`), built
    whole steps or an entry at a time (a step part built), up to several points: resolve()'s entries equal
    the ones of the arrays alone (nothing built) exactly, each a column's built prefix and its arrays' rest; a
    Pending with built entries pickles and builds the same without the native module; the built entries are
    handed out in a new list, the log's emptied (it keeps none a request took)."""
    import pickle
    from types import SimpleNamespace

    from llaisys.engine import logprobs_log
    from llaisys.engine.logprobs_log import LogprobsLog, Span, resolve

    rng = np.random.default_rng(17)
    V, K = 6, 7
    ks = [3, 0, 7, 2]
    steps, leave = 12, {1: 5, 3: 8}  # column -> the step it leaves at (its last step is the one before)
    partial = 0
    for chunk in (64, 1):
        for built_upto in (0, 1, 4, 7, 12):
            log = LogprobsLog([10, 11, 12, 13], K, V, ks)
            log.chunk = chunk
            outs = [[] for _ in ks]
            for i in range(steps):
                cols = [c for c in range(4) if leave.get(c, steps) > i]
                rows = 1 + len(cols)  # a loud row first: the quiet ones are sel
                quiet = np.array([False] + [True] * len(cols))
                if log.version != len(cols):
                    log.follow(len(cols), quiet, [10 + c for c in cols])
                toks = rng.integers(0, 1 << 40, rows)
                log.append(toks, rng.standard_normal(rows).astype(np.float32), rng.integers(0, V, (rows, K)),
                           rng.standard_normal((rows, K)).astype(np.float32))
                for c, t in zip(cols, toks[1:].tolist()):
                    outs[c].append(t)
                while log.unbuilt and log.nb < min(built_upto, i):  # built lagging behind the appends
                    log.build_next()
            while log.nb < built_upto:
                log.build_next()
            if log.unbuilt and built_upto % 2:
                log.build_next()  # the next step's first chunk (part of it where chunk is 1)
            partial += log.nc > 0
            # every column, column 2's sequence's output ending 3 tokens before its log's steps
            for c, out in enumerate(outs[:2] + [outs[2][:-3]] + outs[3:]):
                k = ks[c]
                seq = SimpleNamespace(num_prompt=2, num_output=len(out), tokens=[0, 0] + out,
                                      params=SimpleNamespace(logprobs=k))
                had = len(log.built[c])
                if c not in leave:  # (one that left is not built for steps built after it left)
                    assert had >= min(built_upto, steps)
                got = resolve([Span(log, c, 0)], seq)
                kept = [p for p in got.parts if type(p) is list]
                assert sum(map(len, kept)) == min(had, len(out))
                assert log.built[c] == [] and all(p is not log.built[c] for p in kept)  # the request's own now
                lazy = resolve([Span(log, c, 0)], seq)  # (nothing built left: all from the arrays)
                crossed = pickle.loads(pickle.dumps(got))
                want = lazy.build()
                assert got.build() == want and len(want) == len(out) and [e["token_id"] for e in want] == out
                assert {len(e["top"]) for e in want} == {min(k, V)}
                real = logprobs_log._core
                logprobs_log._core = None  # an unpickled Pending calls none of it
                try:
                    assert crossed.build() == want
                finally:
                    logprobs_log._core = real
    assert partial > 0  # some resolve() met a step part built
