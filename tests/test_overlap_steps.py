"""Overlapped decode steps (EngineConfig.overlap_steps): the host launches step n + 1, its input tokens
chained on the device, before it reads step n's tokens. Nothing a caller sees may change: the same tokens,
texts and finish reasons as the plain step loop, for greedy and seeded sampling, EOS, stop strings, length
limits, aborts, requests arriving mid-stream (steps keep chaining while they wait: they join the next step
that is not chained, within a bounded number of steps), penalties (a repetition penalty chains; bias
penalties run the plain way) and the prefix cache.
On the CPU the step runs on the calling thread, so nothing overlaps in time, but the same code paths run
(overlap_steps=True forces them); on CUDA the whole engine suite runs overlapped by default."""
import threading
import time

import numpy as np
import pytest

from llaisys.engine.engine import Engine
from tiny_model import make_tiny_qwen2
from utils import DEVICES, f32_engine, token_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("overlap"), seed=5, max_position_embeddings=1024)


engine, prompts = f32_engine, token_prompts


def overlapped_steps(eng):
    return eng.stats()["overlapped_steps"]


def run_both(tiny, device, fn, **kw):
    """fn(engine) with overlap off and on; returns both results and how many steps ran chained."""
    out = []
    for overlap in (False, True):
        eng = engine(tiny, device, overlap, **kw)
        out.append(fn(eng))
        out.append(overlapped_steps(eng))
        eng.close()
    plain, n_plain, over, n_over = out
    assert n_plain == 0
    return plain, over, n_over


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_and_seeded_tokens_unchanged(tiny, device):
    def go(eng):
        ps = prompts(eng.config.vocab_size, [3, 17, 40, 90], seed=1)
        greedy = eng.generate(ps, max_new_tokens=[30, 5, 47, 1], temperature=0, ignore_eos=True)
        seeded = eng.generate(ps, max_new_tokens=25, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
        return [(r.token_ids, r.finish_reason) for r in greedy + seeded]
    plain, over, n = run_both(tiny, device, go)
    assert over == plain
    assert n > 20  # the long requests ran chained steps


@pytest.mark.parametrize("device", DEVICES)
def test_rows_that_end_leave_the_chain(tiny, device, monkeypatch):
    """Rows of the persistent batch end one after another (length limits, max_seq_len, an EOS, a stop string):
    the chained step after each end leaves those rows out (Runner.launch's chain_rows) instead of waiting
    for the host. Same tokens and finish reasons as the plain loop and as the old way (LLAISYS_CHAIN_DROP=0,
    where an end stopped the chain), and more steps chained than the old way."""
    def go(eng):
        v = eng.config.vocab_size
        ps = prompts(v, [3, 17, 40, 50, 9, 21, 5], seed=31)
        greedy = eng.generate(ps, max_new_tokens=[3, 5, 8, 13, 21, 34, 1], temperature=0, ignore_eos=True)
        seeded = eng.generate(ps, max_new_tokens=[30, 2, 11, 100, 4, 19, 7], temperature=0.8, top_k=40,
                              seed=[1, 2, 3, 4, 5, 6, 7], ignore_eos=True)  # row 3 ends at max_seq_len
        stop_at = greedy[5].token_ids[6]  # a token the greedy run samples: ends that row (and maybe others) early
        eos = eng.generate(ps, max_new_tokens=[20, 25, 9, 30, 14, 34, 12], temperature=0, stop_token_ids=[stop_at])
        text = greedy[5].text
        stopped = eng.generate(ps[5:], max_new_tokens=[34, 40], temperature=0, ignore_eos=True,
                               stop=[text[len(text) // 2:len(text) // 2 + 2]])
        return [(r.token_ids, r.finish_reason) for r in greedy + seeded + eos + stopped]

    runs = {}
    for name, overlap, drop in (("plain", False, "1"), ("old", True, "0"), ("new", True, "1")):
        monkeypatch.setenv("LLAISYS_CHAIN_DROP", drop)
        eng = engine(tiny, device, overlap, max_seq_len=80)
        runs[name] = (go(eng), eng.stats())
        assert eng.stats()["kv_blocks_used"] == 0 and eng.stats()["running"] == 0
        eng.close()
    plain, old, new = runs["plain"][0], runs["old"][0], runs["new"][0]
    assert old == plain and new == plain
    assert any(reason == "stop" for _, reason in plain) and any(reason == "length" for _, reason in plain)
    assert len(plain[3 + 7][0]) < 100  # the max_seq_len end
    s_old, s_new = runs["old"][1], runs["new"][1]
    assert s_old["chain_dropped_rows"] == 0 and s_new["chain_dropped_rows"] >= 10
    assert s_new["decode_batch_steps"] > 0
    assert s_new["overlapped_steps"] >= s_old["overlapped_steps"] + 10


@pytest.mark.parametrize("device", DEVICES)
def test_eos_and_stop_strings_end_at_the_same_token(tiny, device):
    def go(eng):
        p = prompts(eng.config.vocab_size, [12], seed=2)[0]
        full = eng.generate(p, max_new_tokens=40, temperature=0, ignore_eos=True)
        eos = full.token_ids[9]  # a token the greedy run samples: a stop token there ends it at once
        first = full.token_ids.index(eos)
        by_eos = eng.generate(p, max_new_tokens=40, temperature=0, stop_token_ids=[eos])
        text = full.text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        by_stop = eng.generate(p, max_new_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
        return first, by_eos.token_ids, by_eos.finish_reason, by_stop.text, by_stop.finish_reason
    plain, over, n = run_both(tiny, device, go)
    assert over == plain
    first, ids, reason, _, stop_reason = over
    assert len(ids) == first + 1 and reason == "stop" and stop_reason == "stop"
    assert n > 0


@pytest.mark.parametrize("device", DEVICES)
def test_length_limits_and_the_context_end(tiny, device):
    def go(eng):
        ps = prompts(eng.config.vocab_size, [380, 5], seed=3)  # the first reaches max_seq_len (400)
        rs = eng.generate(ps, max_new_tokens=[100, 2], temperature=0, ignore_eos=True)
        return [(r.token_ids, r.finish_reason) for r in rs]
    plain, over, _ = run_both(tiny, device, go)
    assert over == plain
    assert [len(t) for t, _ in over] == [20, 2] and [f for _, f in over] == ["length", "length"]


@pytest.mark.parametrize("device", DEVICES)
def test_bias_penalties_run_the_plain_way_logprobs_chain(tiny, device):
    """Presence/frequency penalties (host bias lists) keep their steps plain; logprobs chain (computed on the
    device behind each step: test_engine_logprobs.py compares the entries); a repetition penalty chains (its
    set is on the device: test_overlap_penalty.py)."""
    def go(eng):
        p = prompts(eng.config.vocab_size, [20], seed=4)[0]
        return eng.generate(p, max_new_tokens=20, temperature=0, ignore_eos=True, presence_penalty=0.5).token_ids
    plain, over, n = run_both(tiny, device, go)
    assert over == plain and n == 0
    lp = run_both(tiny, device, lambda eng: [(e["token_id"], e["top"][0][0]) for e in eng.generate(
        prompts(eng.config.vocab_size, [20], seed=4)[0], max_new_tokens=20, temperature=0, ignore_eos=True,
        logprobs=2).logprobs])
    assert lp[1] == lp[0] and lp[2] > 10
    a = run_both(tiny, device, lambda eng: eng.generate(prompts(eng.config.vocab_size, [20], seed=4)[0],
                                                        max_new_tokens=20, temperature=0, ignore_eos=True,
                                                        repetition_penalty=1.3).token_ids)
    assert a[1] == a[0] and a[2] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_ban_chains_and_ends_at_the_same_token(tiny, device):
    """A row under min_tokens (its stop ids banned) chains: the ban of a chained step is decided by the count
    of tokens before it (known ahead), not by their values. Stop ids the unbanned run samples early must still
    be banned until min_tokens, in both modes alike, and the row end at the same token; before, such a row
    ran every step of its ban the plain way."""
    def go(eng):
        p = prompts(eng.config.vocab_size, [14], seed=6)[0]
        free = eng.generate(p, max_new_tokens=40, temperature=0, ignore_eos=True).token_ids
        stops = sorted(set(free[1:6]))  # tokens it samples within its first steps: the ban must hold them off
        before = overlapped_steps(eng)
        rs = [eng.generate(p, max_new_tokens=40, temperature=t, seed=3, stop_token_ids=stops, min_tokens=25)
              for t in (0, 0.8)]
        return [(r.token_ids, r.finish_reason) for r in rs], stops, overlapped_steps(eng) - before
    (plain, stops, _), (over, _, banned_chained), _ = run_both(tiny, device, go)
    assert over == plain
    for ids, _ in over:
        assert len(ids) >= 25 and not set(ids[:24]) & set(stops)
    # 2 x 40 steps, 2 x 24 of them banned: before this change only the <= 2 x 15 after the ban could chain
    assert banned_chained > 50, banned_chained


@pytest.mark.parametrize("device", DEVICES)
def test_requests_arriving_and_aborted_mid_stream(tiny, device):
    """A second request joins while the first decodes (chained steps in flight), a third is aborted after
    its first text; the others get exactly the tokens they get alone, and every block comes back."""
    eng = engine(tiny, device, True)
    ps = prompts(eng.config.vocab_size, [10, 30, 8], seed=5)
    kw = dict(max_new_tokens=60, temperature=0, ignore_eos=True)
    alone = [eng.generate(p, **kw).token_ids for p in ps[:2]]
    before = overlapped_steps(eng)
    first = eng.submit(ps[0], **kw)
    it = iter(first)
    ids = list(next(it).token_ids)  # decoding (chained) when the others arrive
    late, doomed = eng.submit(ps[1], **kw), eng.submit(ps[2], **kw)
    next(iter(doomed))
    doomed.abort()
    for chunk in it:
        ids += chunk.token_ids
    assert ids == alone[0] and late.result().token_ids == alone[1]
    assert doomed.result().finish_reason == "abort"
    s = eng.stats()
    assert s["kv_blocks_used"] == 0 and s["running"] == 0
    assert overlapped_steps(eng) > before
    eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_nan_logits_mid_decode_name_their_step(tiny, device, tmp_path):
    """A step whose logits are NaN samples no token (-1), and the step chained behind it has already been
    launched with that id: the error must still be the NaN step's own, naming its generation step."""
    from safetensors.torch import load_file, save_file

    eng = engine(tiny, device, True)
    p = prompts(eng.config.vocab_size, [6], seed=8)[0]
    ids = eng.generate(p, max_new_tokens=30, temperature=0, ignore_eos=True).token_ids
    eng.close()
    k = next(i for i in range(3, 30) if ids[i] not in p and ids[i] not in ids[:i])  # first fed at step k + 1
    path = make_tiny_qwen2(tmp_path, seed=5, max_position_embeddings=1024)
    weights = load_file(f"{path}/model.safetensors")
    weights["model.embed_tokens.weight"][ids[k]] = float("nan")
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    eng = engine(path, device, True)
    with pytest.raises(RuntimeError, match=rf"non-finite logits \(NaN or Inf\) at generation step {k + 1} "):
        eng.generate(p, max_new_tokens=30, temperature=0, ignore_eos=True)
    assert overlapped_steps(eng) > 0
    s = eng.stats()
    assert s["running"] == 0 and s["kv_blocks_used"] == 0
    assert len(eng.generate(p, max_new_tokens=2, temperature=0, ignore_eos=True).token_ids) == 2
    eng.close()


def test_a_finish_that_gets_nowhere_breaks_the_engine_instead_of_spinning(tiny):
    """A launched step whose finish() raises without finishing anything (the TypeError a mis-bound RankGroup
    gave) used to be retried forever by the drain after a failed step: the loop spun and the caller waited for
    good. Now the request fails, and the engine says why it can run no more steps."""
    import threading

    eng = engine(tiny, "cpu", True)
    runner = eng._core.runner

    def finish():
        raise TypeError("finish(): incompatible function arguments")
    runner.finish = finish
    p = prompts(eng.config.vocab_size, [9], seed=3)[0]
    outcome = []
    t = threading.Thread(target=lambda: outcome.append(_raised(lambda: eng.generate(p, max_new_tokens=8,
                                                                                  temperature=0))))
    t.start()
    t.join(60)
    assert not t.is_alive(), "the step loop spun on a finish() that never finishes"
    assert outcome and isinstance(outcome[0], RuntimeError), outcome
    assert "could not be finished" in (eng.failure or ""), eng.failure
    eng.close()


def _raised(fn):
    try:
        fn()
    except Exception as e:
        return e
    return None


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_cache_and_a_tiny_pool(tiny, device):
    """Chained steps grow block tables ahead of the host; the prefix cache registers only computed
    blocks, and a pool too small for a chained step runs the plain way (or preempts) with the same tokens."""
    def go(eng):
        sys = prompts(eng.config.vocab_size, [48], seed=6)[0]
        ps = [sys + q for q in prompts(eng.config.vocab_size, [5, 9, 3], seed=7)]
        first = [r.token_ids for r in eng.generate(ps, max_new_tokens=35, temperature=0, ignore_eos=True)]
        again = [r.token_ids for r in eng.generate(ps, max_new_tokens=35, temperature=0, ignore_eos=True)]
        return first, again, eng.stats()["prefix_cache_hit_rate"] > 0
    plain, over, n = run_both(tiny, device, go, block_size=4, num_kv_blocks=64)
    assert over == plain and over[0] == over[1] and over[2]
    assert n > 0


def test_setting_and_serve_flag():
    from llaisys import cli
    from llaisys.engine.config import EngineConfig
    from llaisys.server.cli import ENGINE_SETTINGS

    assert EngineConfig().overlap_steps is None and EngineConfig(overlap_steps=False).overlap_steps is False
    with pytest.raises(ValueError, match="EngineConfig.overlap_steps must be True, False or None"):
        EngineConfig(overlap_steps="yes")
    assert "overlap_steps" in ENGINE_SETTINGS
    assert cli.build_parser().parse_args(["serve", "--no-overlap-steps"]).overlap_steps is False
    assert cli.build_parser().parse_args(["serve"]).overlap_steps is None


# ---- overlap while requests wait (issue 33, "overlap always") ------------------------------------------

def _record_launches(core):
    """Wraps core.runner.launch: a list of (chained, requests waiting, from the decode batch) per launched step."""
    launches, real = [], core.runner.launch

    def launch(step, chain, before=None):
        launches.append((chain, bool(core.scheduler.waiting), step.batch is not None))
        return real(step, chain, before)
    core.runner.launch = launch
    return launches


def drive(eng, arrivals):
    """Runs eng's core step by step as the loop thread does, without the thread: before step i the requests of
    arrivals[i] ((prompt, sampling) pairs) join. Returns each request's (output ids, finish reason, steps from
    its arrival to its first token) in arrival order, and the launches (_record_launches)."""
    from llaisys.engine.sequence import Sequence

    core = eng._core
    launches = _record_launches(core)
    pending, seqs, first, i = sorted(arrivals.items()), [], {}, 0
    while pending or core.has_work():
        while pending and pending[0][0] <= i:
            for prompt, kw in pending.pop(0)[1]:
                params = eng._params("generate", dict(kw, ignore_eos=True))
                seq = Sequence(prompt, params, params.seed or 0, frozenset(params.stop_token_ids))
                core.add(seq)
                seqs.append((seq, i))
        if core.has_work():
            produced, failed = core.step()
            assert not failed
            for seq, _, _ in produced:
                first.setdefault(seq.seq_id, i)
        i += 1
        assert i < 5000
    return [(s.output, s.finish_reason, first[s.seq_id] - at) for s, at in seqs], launches


def _patterns(vocab, sampled):
    """Arrival patterns {name: (engine settings, arrivals)}; sampled: seeded sampling, else greedy."""
    def kw(n, seed, **more):
        base = dict(temperature=0.9, top_p=0.9, top_k=50, seed=seed) if sampled else dict(temperature=0)
        return dict(base, max_new_tokens=n, **more)
    ps = prompts(vocab, [5, 12, 3, 30, 7, 9, 4, 16, 6, 11], seed=21)
    eos = [ps[0][1]]  # some rows may sample it: an early stop beside the others
    return {
        # more requests than max_num_seqs: they wait while a full step chains on
        "queue": (dict(max_num_seqs=2), {0: [(p, kw(n, s)) for s, (p, n) in enumerate(zip(ps[:5], [20, 9, 14, 3, 11]))]}),
        # an arrival every third step while others decode (every step: every step admits, a prefill)
        "steady": ({}, {3 * i: [(ps[i], kw(n, 10 + i, stop_token_ids=eos))]
                            for i, n in enumerate([40, 25, 8, 30, 2, 17, 33, 5])}),
        # bursts apart, a long prompt in chunks (max_prefill_chunk 8) among them
        "bursts": (dict(max_num_seqs=3, max_prefill_chunk=8),
                   {0: [(ps[0], kw(30, 1)), (ps[1], kw(12, 2))], 6: [(ps[3], kw(10, 3)), (ps[2], kw(25, 4))],
                    9: [(ps[4], kw(6, 5))], 15: [(ps[5], kw(18, 6)), (ps[6], kw(1, 7)), (ps[7], kw(9, 8))]}),
        # a pool so small that decodes preempt each other (block_size 4, 20 blocks)
        "preempt": (dict(block_size=4, num_kv_blocks=20, max_seq_len=64),
                    {0: [(ps[0], kw(30, 1))], 2: [(ps[1], kw(28, 2))], 3: [(ps[8], kw(26, 3))],
                     5: [(ps[9], kw(20, 4))]}),
    }


@pytest.mark.parametrize("path", ["batch", "general"])
@pytest.mark.parametrize("sampled", [False, True])
def test_chained_while_requests_wait_with_the_same_tokens(tiny, sampled, path, monkeypatch):
    """Requests arriving while others decode (several patterns, greedy and seeded): the next decode is still
    chained while they wait, and every request gets exactly the tokens and finish reason of the plain run.
    path general: without the persistent decode batch (the general schedule and _launch_next_seqs)."""
    from llaisys.engine import scheduler as scheduler_mod

    if path == "general":
        monkeypatch.setattr(scheduler_mod.Scheduler, "decode_step", lambda self: None)
    vocab = engine(tiny, "cpu", False).config.vocab_size
    for name, (kw, arrivals) in _patterns(vocab, sampled).items():
        out = {}
        for overlap in (False, True):
            eng = engine(tiny, "cpu", overlap, **kw)
            out[overlap] = drive(eng, arrivals)
            s = eng._core.stats()
            assert s["kv_blocks_used"] == 0 and s["running"] == 0 and s["waiting"] == 0, name
            if name == "preempt":
                assert s["preemptions"] > 0
            eng.close()
        (plain, _), (over, launches) = out[False], out[True]
        assert [r[:2] for r in over] == [r[:2] for r in plain], name
        assert not any(chain for chain, _, _ in out[False][1])
        waited = sum(chain and waiting for chain, waiting, _ in launches)
        assert waited >= 2, (name, launches)  # the old rule never chained while a request waited
        if name == "queue":  # full steps while requests wait come from the decode batch (unless switched off)
            assert any(c and w and b for c, w, b in launches) == (path == "batch")


def test_no_starvation_behind_long_decodes(tiny):
    """Long decodes chain step after step; a request arriving among them (free room in the step) gets its
    first token at most 1 + MAX_CHAINED_WHILE_WAITING steps later than without overlap, and a request
    waiting for a full step gets in right after one of its sequences ends."""
    from llaisys.engine.chaining import Chainer

    bound = 1 + Chainer.MAX_CHAINED_WHILE_WAITING
    assert bound <= 2  # chaining on while a request could be admitted would starve it behind the long decodes
    vocab = engine(tiny, "cpu", False).config.vocab_size
    ps = prompts(vocab, [6, 9, 5, 8, 7], seed=22)
    greedy = dict(temperature=0)
    arrivals = {0: [(ps[0], dict(greedy, max_new_tokens=120)), (ps[1], dict(greedy, max_new_tokens=120))],
                10: [(ps[2], dict(greedy, max_new_tokens=5))], 40: [(ps[3], dict(greedy, max_new_tokens=3))],
                41: [(ps[4], dict(greedy, max_new_tokens=4))]}
    res = {}
    for overlap in (False, True):
        eng = engine(tiny, "cpu", overlap, max_num_seqs=4)
        res[overlap], launches = drive(eng, arrivals)
        eng.close()
    assert [r[:2] for r in res[True]] == [r[:2] for r in res[False]]
    assert [r[2] for r in res[False]] == [0] * 5
    assert all(0 < r[2] <= bound for r in res[True][2:]), res[True]
    assert sum(c for c, _, _ in launches) > 100  # the long decodes (120 steps) did chain

    # max_num_seqs 2: the third waits for a full step that chains on, until the first ends (EOS)
    ps = prompts(vocab, [6, 9, 5], seed=23)
    full = dict(greedy, max_new_tokens=60)
    eng = engine(tiny, "cpu", False, max_num_seqs=2)
    out = drive(eng, {0: [(ps[0], full)]})[0][0][0]
    eng.close()
    k = out.index(out[7])  # the first EOS
    assert k >= 4
    arrivals = {0: [(ps[0], dict(full, stop_token_ids=[out[k]])), (ps[1], full)], 3: [(ps[2], dict(full, max_new_tokens=5))]}
    res = {}
    for overlap in (False, True):
        eng = engine(tiny, "cpu", overlap, max_num_seqs=2)
        res[overlap], launches = drive(eng, arrivals)
        eng.close()
    assert [r[:2] for r in res[True]] == [r[:2] for r in res[False]]
    waited_plain, waited_over = res[False][2][2], res[True][2][2]
    assert res[True][0][1] == "stop" and waited_plain == k + 1 - 3  # admitted the step after the first's EOS
    assert waited_plain < waited_over <= waited_plain + 1
    assert sum(c and w for c, w, _ in launches) >= 3  # chained while it waited


def test_chained_while_submitted_requests_wait_in_the_loop(tiny):
    """Through the step loop (its own thread): requests submitted while a full step decodes wait, the steps
    still chain meanwhile, and each request's tokens are those it gets alone."""
    eng = engine(tiny, "cpu", True, max_num_seqs=2)
    ps = prompts(eng.config.vocab_size, [10, 30, 8, 14], seed=24)
    kw = dict(max_new_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
    alone = [eng.generate(p, **kw).token_ids for p in ps]
    launches = eng._loop.call(lambda: _record_launches(eng._core))
    # a's chunks go to a sink, whose put runs on the loop thread: it holds the loop after a's first chunk
    # until the late requests are in. (Read from a's own queue, a busy box could keep this thread away until
    # a and b had finished, 40 steps of the tiny model, a few ms, and no step had requests waiting.)
    first, gate, done = threading.Event(), threading.Event(), threading.Event()

    class HoldAfterFirst:
        def __init__(self):
            self.items = []

        def put(self, request, item):
            self.items.append(item)
            if len(self.items) == 1:
                first.set()
                gate.wait(60)
            if isinstance(item, BaseException) or item.finish_reason is not None:
                done.set()

        def flush(self):
            pass

    sink = HoldAfterFirst()
    eng.submit(ps[0], sink=sink, **kw)
    b = eng.submit(ps[1], **kw)
    assert first.wait(60)
    late = [eng.submit(p, **kw) for p in ps[2:]]
    gate.set()
    assert done.wait(60)
    ids = [t for chunk in sink.items for t in chunk.token_ids]
    assert [ids, b.result().token_ids] + [r.result().token_ids for r in late] == alone
    assert sum(c and w for c, w, _ in launches) >= 10
    s = eng.stats()
    assert s["kv_blocks_used"] == 0 and s["running"] == 0
    eng.close()


def test_host_seconds_counts_each_interval_once(tiny):
    """EngineCore.host_seconds (the host us per sequence per step of bench/throughput.py): its parts are disjoint
    intervals of the loop thread, so with the runner's time (launches and the waits for the device, less the
    arrays counted on the host side) they add up to no more than the caller's wall time; an overlapped step's
    accounting is in its to_return_s and counted once (before session 33 it was also added as postprocess_s)."""
    eng = engine(tiny, "cpu", True)
    core = eng._core
    ps = prompts(eng.config.vocab_size, [5, 9, 30, 12, 7, 21], seed=3)
    eng.generate(ps, max_new_tokens=2, ignore_eos=True)  # warm-up
    core.timing.update(dict.fromkeys(core.timing, 0))
    core.runner.prepare_s = 0.0
    t = time.perf_counter()
    eng.generate(ps, max_new_tokens=40, ignore_eos=True)
    wall = time.perf_counter() - t
    tm = core.timing
    assert tm["overlapped"] > 20 and tm["overlapped_postprocess_s"] > 0
    assert tm["overlapped_postprocess_s"] <= tm["postprocess_s"] and tm["overlapped_postprocess_s"] <= tm["to_return_s"]
    host = core.host_seconds()
    assert 0 < host
    assert host + tm["run_s"] - core.runner.prepare_s <= wall
    eng.close()
