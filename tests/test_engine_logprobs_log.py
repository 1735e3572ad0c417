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


@pytest.mark.parametrize("overlap", [False, True])
def test_aborted_row_read_at_the_end_keeps_an_entry_per_token(tiny, overlap):
    """A generate-style request with logprobs (incremental=False) aborted while the batch runs: its result holds
    one entry per token it got, equal to the entries of the same request run alone, and the row beside it
    (which goes on, its batch condensed) too."""
    eng = engine(tiny, "cpu", overlap)
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
    assert ids == alone[1][0] and eng.stats()["kv_blocks_used"] == 0
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
