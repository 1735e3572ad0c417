"""Constrained rows in overlapped decode: a chained step of a constrained row is launched without its
sampling, and its mask, which needs the token of the step ahead, is computed on the host while the device
runs the forward (ModelRunner.sample_deferred). Nothing a caller sees may change: with overlap forced on
(the CPU runs each call synchronously, so the same sequence of calls runs, checked exactly) json schema,
regex, grammar and choice rows, alone or batched with free rows, greedy and seeded, give the tokens and
finish reasons they give with overlap off; a row whose grammar completes ends there ("stop"), one that
cannot complete within max_new_tokens ends with "length"."""
import json
import re

import numpy as np
import pytest

pytest.importorskip("llguidance")

from tiny_model import make_tiny_qwen2  # noqa: E402
from utils import DEVICES, f32_engine, failing_mask_fills, token_prompts  # noqa: E402

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "c": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "c", "ok"], "additionalProperties": False}
DATE = r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("overlap_constrained"), seed=11, max_position_embeddings=1024)


def run_both(tiny, fn, device="cpu", **kw):
    """fn(engine) with overlap off and on; both results and the chained steps of the second whose sampling
    waited for their masks."""
    out = []
    for overlap in (False, True):
        eng = f32_engine(tiny, device, overlap, **kw)
        try:
            out += [fn(eng), eng.stats()["overlapped_constrained_steps"]]
        finally:
            eng.close()
    plain, n_plain, over, n_over = out
    assert n_plain == 0
    return plain, over, n_over


def result(rs):
    return [(r.token_ids, r.finish_reason) for r in rs]


def mixed(eng, temperature, seed=None):
    ps = token_prompts(eng.config.vocab_size, [5, 19, 8, 33, 12, 7], seed=4)
    return eng.generate(ps, max_new_tokens=[40, 30, 24, 12, 16, 30], temperature=temperature, seed=seed,
                        ignore_eos=[False, True, False, False, False, False],
                        json_schema=[SCHEMA, None, None, None, None, True],
                        regex=[None, None, DATE, None, None, None],
                        choice=[None, None, None, ["yes", "no", "maybe"], None, None],
                        grammar=[None, None, None, None, 'start: "a" "b"* "c"', None])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature,seed,threads", [(0.0, None, 1), (0.9, 7, 1), (0.9, 7, 4)])
def test_constrained_and_free_rows_chained_give_the_same_tokens(tiny, temperature, seed, threads, device):
    """On CUDA the chained steps replay the decode graph for their forward (sampler off) and sample after
    it: f32, the same rows in both runs, so the same tokens. threads: EngineConfig.mask_threads (4: the
    rows' masks on llguidance's thread pool)."""
    def go(eng):
        return mixed(eng, temperature, seed)
    plain, over, n = run_both(tiny, go, device, mask_threads=threads)
    assert result(over) == result(plain)
    assert n > 5  # constrained rows ran chained steps
    date, choice, ab = over[2], over[3], over[4]
    if date.finish_reason == "stop":
        assert re.fullmatch(DATE, date.text)
    assert choice.finish_reason == "stop" and choice.text in ("yes", "no", "maybe")
    if ab.finish_reason == "stop":
        assert re.fullmatch("ab*c", ab.text)
    if over[0].finish_reason == "stop":
        out = json.loads(over[0].text)
        assert set(out) == {"n", "c", "ok"} and out["c"] in ("red", "green", "blue")


def test_constrained_rows_alone_chain_and_end_where_their_grammar_ends(tiny):
    def go(eng):
        ps = token_prompts(eng.config.vocab_size, [9, 14, 3], seed=8)
        return eng.generate(ps, max_new_tokens=[60, 60, 60], temperature=[0, 0.8, 0], seed=3,
                            choice=[["alpha", "beta gamma delta"], None, None],
                            regex=[None, r"[a-z]{3,6}", None], json_schema=[None, None, SCHEMA])
    plain, over, n = run_both(tiny, go)
    assert result(over) == result(plain)
    assert n > 0
    assert over[0].finish_reason == "stop" and over[0].text in ("alpha", "beta gamma delta")
    assert over[1].finish_reason in ("stop", "length")
    if over[1].finish_reason == "stop":
        assert re.fullmatch(r"[a-z]{3,6}", over[1].text)


def test_a_constraint_that_cannot_complete_ends_with_length(tiny):
    def go(eng):
        ps = token_prompts(eng.config.vocab_size, [6, 11], seed=9)
        return eng.generate(ps, max_new_tokens=[5, 9], temperature=[0, 0.7], seed=1,
                            regex=[r"x{40}", r"[0-9]{50}"], ignore_eos=True)
    plain, over, n = run_both(tiny, go)
    assert result(over) == result(plain)
    assert [r.finish_reason for r in over] == ["length", "length"]
    assert [len(r.token_ids) for r in over] == [5, 9] and n > 0
    assert set(over[0].text) <= {"x"} and set(over[1].text) <= set("0123456789")


def test_streamed_constrained_request_beside_free_ones(tiny):
    def go(eng):
        ps = token_prompts(eng.config.vocab_size, [4, 21], seed=10)
        free = eng.submit(ps[1], max_new_tokens=30, temperature=0, ignore_eos=True)
        chunks = list(eng.stream(ps[0], max_new_tokens=40, temperature=0, json_schema=SCHEMA))
        return [c.token_ids for c in chunks], chunks[-1].finish_reason, free.result().token_ids
    plain, over, _ = run_both(tiny, go)
    assert over == plain


def test_a_failed_deferred_sampling_drops_only_that_step(tiny, monkeypatch):
    """A mask that cannot be computed for a chained step drops the step (EngineCore._sample_deferred): its
    sequences run again from what the host knows, so the tokens are those of the plain run."""

    def go(eng):
        ps = token_prompts(eng.config.vocab_size, [7, 13], seed=12)
        return result(eng.generate(ps, max_new_tokens=20, temperature=[0, 0.9], seed=5, json_schema=SCHEMA,
                                   ignore_eos=True))

    plain = go_engine(tiny, False, go)
    calls = failing_mask_fills(monkeypatch, (4, 9))
    assert go_engine(tiny, True, go) == plain
    assert len(calls) > 9


def go_engine(tiny, overlap, fn):
    eng = f32_engine(tiny, "cpu", overlap)
    try:
        return fn(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_triggered_constraint_starts_after_its_token(tiny, temperature):
    """grammar_trigger (tool_choice "auto"'s mechanism): the output is free up to the trigger token and
    obeys the constraint after it; a request whose output never reaches the trigger, or whose first token
    does not begin its opening_grammar, is free throughout.
    The same with overlap on and off (the step after the trigger's is chained, its sampling deferred)."""
    def go(eng):
        p = token_prompts(eng.config.vocab_size, [15], seed=13)[0]
        kw = dict(max_new_tokens=40, temperature=temperature, seed=21, ignore_eos=True)
        free = eng.generate(p, **kw)
        first = 6
        trigger = eng.tokenizer.id_to_token(free.token_ids[first])
        first = free.token_ids.index(free.token_ids[first])
        lazy = eng.generate(p, regex="[0-9]{3}", grammar_trigger=trigger, **kw)
        never = eng.generate(p, regex="[0-9]{3}", grammar_trigger="<|im_start|>", **kw)
        # an opening grammar its first token does not start: free throughout
        unopened = eng.generate(p, opening_grammar='start: "\u00e9\u00e9\u00e9"', **kw)
        return first, result([free, lazy, never, unopened]), eng.tokenizer.decode(lazy.token_ids[first + 1:])
    plain, over, _ = run_both(tiny, go)
    assert over == plain
    first, (free, lazy, never, unopened), tail = over
    assert lazy[0][:first + 1] == free[0][:first + 1]
    assert lazy[1] == "stop" and re.fullmatch("[0-9]{3}", tail)
    assert never == free and unopened == free


def test_a_bad_grammar_trigger_raises_at_submit(tiny):
    eng = f32_engine(tiny, "cpu", False)
    try:
        with pytest.raises(ValueError, match="not one token"):
            eng.generate([5, 6], max_new_tokens=2, regex="a", grammar_trigger="no such token here")
        with pytest.raises(ValueError, match="grammar_trigger must be"):
            eng.generate([5, 6], max_new_tokens=2, grammar_trigger="<|im_start|>")
    finally:
        eng.close()


def test_sample_deferred_without_a_deferred_launch_raises(tiny):
    eng = f32_engine(tiny, "cpu", True)
    try:
        with pytest.raises(ValueError, match="no deferred launch"):
            eng._core.runner.runner.sample_deferred(None, [], 1)
        assert eng.generate([5, 6, 7], max_new_tokens=3, temperature=0, ignore_eos=True).finish_reason == "length"
    finally:
        eng.close()


def deferred_launch(eng, n=2, temperature=0.0):
    """An n-row decode at position 0 (blocks 1..n) launched with its sampling deferred, on the binding."""
    import numpy as np
    runner, bs = eng._core.runner.runner, eng._core.config.block_size
    f32, i32, u64 = (lambda v: np.array(v, np.float32)), (lambda v: np.array(v, np.int32)), np.uint64
    runner.launch(np.arange(5, 5 + n), np.zeros(n, np.int64), np.arange(1, n + 1) * bs, i32(range(n + 1)),
                  i32([1] * n), i32([[r + 1] for r in range(n)]), f32([temperature] * n), i32([0] * n),
                  f32([1.0] * n), f32([0.0] * n), f32([1.0] * n), np.arange(n, dtype=u64), np.zeros(n, u64),
                  i32([-1] * n), [[]] * n, [[]] * n, False, None, [], True)


@pytest.mark.parametrize("device", DEVICES)
def test_sample_deferred_applies_each_rows_mask_and_checks_its_arguments(tiny, device):
    """sample_deferred's masks: every row masked in order (uploaded straight from the array) or some rows
    (scattered into a batch mask): a mask that allows one token is that row's token, greedy or sampled. Bad
    arguments raise naming the problem (the launch is then lost: finish() has nothing of it)."""
    import numpy as np
    eng = f32_engine(tiny, device, True)
    try:
        r, W = eng._core.runner.runner, (eng.config.vocab_size + 31) // 32

        def only(*tokens):
            m = np.zeros((len(tokens), W), np.int32)
            for j, t in enumerate(tokens):
                m[j, t // 32] = np.int32(np.uint32(1 << (t % 32)).view(np.int32))
            return m
        for temperature in (0.0, 0.9):
            deferred_launch(eng, temperature=temperature)
            r.sample_deferred(only(40, 77), [0, 1], 2)
            assert r.finish() == [40, 77]
            deferred_launch(eng, temperature=temperature)
            r.sample_deferred(only(33), [1], 2)
            assert r.finish()[1] == 33
            deferred_launch(eng, temperature=temperature)
            r.sample_deferred(only(12, 19), [1, 0], 2)  # rows out of order
            assert r.finish() == [19, 12]
            for want in ([21, 8], [3, 50], [64, 7]):  # the runner's own buffers (pinned on CUDA), alternating
                buf = r.mask_buffer(2).numpy()
                assert buf.shape == (2, W) and buf.dtype == np.int32
                buf[:] = only(*want)
                deferred_launch(eng, temperature=temperature)
                r.sample_deferred(buf, [0, 1], 2)
                assert r.finish() == want
        with pytest.raises(ValueError, match="rows must be >= 1"):
            r.mask_buffer(0)
        for args, match in [((only(4), [0, 1], 2), "has 1 rows but mask_rows names 2"),
                            ((only(4), [2], 2), "mask row 2 outside the batch of 2"),
                            ((None, [], 3), "num_rows 3 for a launch of 2 rows"),
                            ((np.zeros((1, W + 1), np.int32), [0], 2), f"{W + 1} words a row")]:
            deferred_launch(eng)
            with pytest.raises((ValueError, IndexError), match=match):
                r.sample_deferred(*args)
            assert r.launched == 0
        assert eng.generate([5, 6, 7], max_new_tokens=3, temperature=0, ignore_eos=True).finish_reason == "length"
    finally:
        eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_sample_deferred_masks_of_a_batch_that_grows_and_shrinks(tiny, device):
    """The runner's own mask buffers (two pinned buffers, alternating) for batches of 3, 70 (past their first
    64 rows: they grow), 5 and 70 again: each row's one allowed token is its token, every time (a copy that
    overwrote a buffer still to be read, or read before it landed, would give another step's or a stale row's
    token)."""
    import numpy as np
    eng = f32_engine(tiny, device, True, max_num_seqs=80)
    try:
        r, W, V = eng._core.runner.runner, (eng.config.vocab_size + 31) // 32, eng.config.vocab_size
        rng = np.random.default_rng(3)
        for n in (3, 70, 5, 70, 64):
            want = rng.integers(0, V, n).tolist()
            buf = r.mask_buffer(n).numpy()
            buf[:] = 0
            for j, t in enumerate(want):
                buf[j, t // 32] = np.int32(np.uint32(1 << (t % 32)).view(np.int32))
            deferred_launch(eng, n=n, temperature=0.9)
            r.sample_deferred(buf, list(range(n)), n)
            assert r.finish() == want
        assert eng.generate([5, 6, 7], max_new_tokens=3, temperature=0, ignore_eos=True).finish_reason == "length"
    finally:
        eng.close()


@pytest.mark.parametrize("threads", [1, 4])
def test_constrained_rows_in_the_persistent_decode_batch(tiny, monkeypatch, threads):
    """Constrained rows join the persistent decode batch (batch.py): their masks come from their matchers,
    their tokens advance them (MaskFiller.advance; threads 4: the masks on llguidance's pool), a complete
    grammar ends its row. The same tokens as overlap off, and as the
    general path (no row eligible for the batch: one consume after another)."""
    def go(eng):
        ps = token_prompts(eng.config.vocab_size, [5, 9, 14, 4], seed=15)
        out = eng.generate(ps, max_new_tokens=[30, 24, 36, 20], temperature=[0, 0.8, 0, 0.6], seed=2,
                           ignore_eos=[True, False, False, True], json_schema=[None, SCHEMA, None, None],
                           choice=[None, None, ["yes", "no"], None], regex=[None, None, None, "[a-z ]{1,40}"])
        return result(out), eng.stats()["decode_batch_steps"]
    (tokens, batch_steps), (over, _), n = run_both(tiny, go, mask_threads=threads)
    assert over == tokens and n > 0
    assert batch_steps > 10  # overlap off: the rows ran from the batch arrays (chained steps are not counted)
    assert tokens[2][1] == "stop"  # the choice row ended by its grammar
    from llaisys.engine import scheduler
    monkeypatch.setattr(scheduler, "eligible", lambda seq: False)
    (general, general_steps), (general_over, _), _ = run_both(tiny, go, mask_threads=threads)
    assert general_steps == 0 and general == tokens and general_over == tokens


def test_mask_filler_threads_give_the_masks_of_one_row_at_a_time(tiny):
    import numpy as np

    from llaisys.constraints import Constraint, MaskFiller, compile_constraint
    eng = f32_engine(tiny, "cpu", False)
    try:
        lltok, V = eng._admit.ll_tokenizer(), eng.config.vocab_size
        grammars = [compile_constraint(json_schema=SCHEMA), compile_constraint(regex=DATE),
                    compile_constraint(choice=["yes", "no"])] * 3
        cs = [Constraint(lltok, g) for g in grammars]
        for c, text in zip(cs, ['{"n": 1', "20", "y", '{"n"', "2024-0", "n", "", "", ""]):
            for t in eng.tokenizer.encode(text):
                c.consume(t)
        one = np.empty((len(cs), (V + 31) // 32), np.int32)
        for c, row in zip(cs, one):
            c.mask_into(row)
        pooled = np.full_like(one, 7)
        MaskFiller(4).fill(cs, pooled)
        assert (pooled == one).all() and (one != -1).any()
    finally:
        eng.close()


def test_constraints_are_copies_of_a_kept_start_state_that_never_moves(tiny):
    """Constraints.new hands out deep copies of one matcher per grammar in its start state: each copy masks
    and advances as a matcher built from the grammar does, whatever another copy consumed before it; a bad
    grammar raises every time (nothing kept of it); the oldest grammar leaves once `size` are kept."""
    import numpy as np

    from llaisys.constraints import Constraint, Constraints, compile_constraint
    eng = f32_engine(tiny, "cpu", False)
    try:
        lltok, V = eng._admit.ll_tokenizer(), eng.config.vocab_size
        made = Constraints(lltok, size=2)
        schema, date, yn = (compile_constraint(json_schema=SCHEMA), compile_constraint(regex=DATE),
                            compile_constraint(choice=["yes", "no"]))

        def masks(c, text):  # the mask before each token of text, then after the last
            out = []
            for t in eng.tokenizer.encode(text) + [None]:
                row = np.empty((V + 31) // 32, np.int32)
                c.mask_into(row)
                out.append(row)
                if t is not None:
                    c.consume(t)
            return np.stack(out), c.done

        for grammar, text in ((schema, '{"n": 12, "s": "ab"}'), (date, "2024-05-06"), (yn, "yes")):
            want = masks(Constraint(lltok, grammar), text)
            for _ in range(2):  # the second copy comes after the first one consumed the whole text
                got = masks(made.new(grammar), text)
                assert (got[0] == want[0]).all() and got[1] == want[1]
            assert want[0].shape[0] > 2 and want[1]
        assert list(made._start) == [date, yn]  # size 2: the schema's start state was dropped
        bad = '{"grammars": [{"lark_grammar": "start: nope"}]}'
        for _ in range(2):
            with pytest.raises(ValueError, match="constraint"):
                made.new(bad)
        assert list(made._start) == [date, yn]
        # lanes: independent start states (llguidance's copies share one lexer lock), taken in turn
        laned = Constraints(lltok, lanes=3)
        got = [laned.new(schema) for _ in range(7)]
        assert [c.lane for c in got] == [0, 1, 2, 0, 1, 2, 0] and len(laned._start[schema]) == 3
        want = masks(Constraint(lltok, schema), '{"n": 12, "s": "ab"}')
        for c in got:
            m, done = masks(c, '{"n": 12, "s": "ab"}')
            assert (m == want[0]).all() and done == want[1]
    finally:
        eng.close()


def test_mask_filler_start_gives_the_masks_of_fill_on_its_worker(tiny):
    """MaskFiller.start computes on a worker thread what fill computes (one row and several, one thread and a
    pool); wait() returns once written, re-raises what the fill raised, and a second start before wait()
    raises rather than write one buffer twice."""
    import numpy as np

    from llaisys.constraints import Constraint, MaskFiller, compile_constraint
    eng = f32_engine(tiny, "cpu", False)
    try:
        lltok, V = eng._admit.ll_tokenizer(), eng.config.vocab_size
        cs = [Constraint(lltok, compile_constraint(**kw)) for kw in ({"json_schema": SCHEMA}, {"regex": DATE})]
        for t in eng.tokenizer.encode('{"n": 1'):
            cs[0].consume(t)
        one = np.empty((2, (V + 31) // 32), np.int32)
        for c, row in zip(cs, one):
            c.mask_into(row)
        for threads, rows in ((1, 1), (1, 2), (4, 2)):
            filler, got = MaskFiller(threads), np.full((rows, one.shape[1]), 7, np.int32)
            assert filler.wait() == 0.0  # nothing pending
            filler.start(cs[:rows], got)
            with pytest.raises(RuntimeError, match="not waited for"):
                filler.start(cs[:rows], got)
            assert filler.wait() >= 0.0 and (got == one[:rows]).all()
        broken = MaskFiller(1)
        broken.start(cs, np.empty((1, one.shape[1]), np.int32)[:, :-1])  # a row too short: mask_into refuses
        with pytest.raises(Exception):
            broken.wait()
        assert broken.wait() == 0.0  # the failure was handed over once
    finally:
        eng.close()


def test_deferred_masks_are_computed_off_the_step_loop(tiny, monkeypatch):
    """A chained constrained step's masks are written on the MaskFiller's worker thread (the loop delivers
    meanwhile), the masks of a plain step on the caller's; the tokens are those of the plain run."""
    import threading

    from llaisys.constraints import MaskFiller

    def go(eng):
        ps = token_prompts(eng.config.vocab_size, [7, 13, 9], seed=3)
        return result(eng.generate(ps, max_new_tokens=24, temperature=[0, 0.9, 0], seed=5, ignore_eos=True,
                                   json_schema=[SCHEMA, None, SCHEMA], regex=[None, DATE, None]))

    plain = go_engine(tiny, False, go)
    monkeypatch.setenv("LLAISYS_MASK_LANES", "0")  # (the lanes, when on, never call fill)
    fill, threads = MaskFiller.fill, []

    def recorded(self, constraints, mask, *args):
        threads.append(threading.current_thread().name)
        return fill(self, constraints, mask, *args)
    monkeypatch.setattr(MaskFiller, "fill", recorded)
    assert go_engine(tiny, True, go) == plain
    off_loop = [n for n in threads if n.startswith("llaisys-masks")]
    assert len(off_loop) > 10 and len(off_loop) < len(threads)  # the first step's masks: a plain step's


@pytest.mark.parametrize("failing,lanes", [((), False), ((5, 8), False), (tuple(range(3, 14, 2)), False),
                                           ((3, 6), True)],
                         ids=["masks-ok", "masks-fail", "masks-fail-often", "lanes-masks-fail"])
def test_score_between_chained_constrained_steps(tiny, monkeypatch, failing, lanes):
    """score() runs on the loop thread between steps, where a chained constrained step may still wait for
    its masks (on the worker, or the lanes: their second lane's masks fail). Its sampling is enqueued before
    score's forward overwrites the logits it reads, or, when its masks fail, the step is dropped and run
    again: the generation's tokens are the plain run's and every score equals a quiet engine's."""
    from llaisys.engine.core import EngineCore
    from llaisys.engine.score import score_logits

    def go(eng):
        ps = token_prompts(eng.config.vocab_size, [7, 13], seed=12)
        return result(eng.generate(ps, max_new_tokens=20, temperature=[0, 0.9], seed=5, json_schema=SCHEMA,
                                   ignore_eos=True))

    plain = go_engine(tiny, False, go)
    ids = go_engine(tiny, False, lambda eng: token_prompts(eng.config.vocab_size, [11], seed=4)[0])
    reference = go_engine(tiny, False, lambda eng: eng.score(ids))
    step, scores, pending = EngineCore.step, [], []

    def step_then_score(self):
        out = step(self)
        if self.runner.deferred is not None:  # masks of the chained step still being written
            pending.append(True)
            scores.append(np.asarray(score_logits(self, ids).to("cpu").to("f32").numpy(), np.float32))
        return out
    monkeypatch.setattr(EngineCore, "step", step_then_score)
    if lanes:
        monkeypatch.setenv("LLAISYS_MASK_LANES", "1")
        monkeypatch.setenv("LLAISYS_MASK_THREADS", "2")
        flaky = flaky_lanes(monkeypatch, 1, masks=failing)
    else:
        calls = failing_mask_fills(monkeypatch, failing)
    assert go_engine(tiny, True, go) == plain
    assert len(pending) > 5 and (flaky[0].calls["masks"] > 6 if lanes else len(calls) > 8)
    for s in scores:
        np.testing.assert_array_equal(s, reference)


# ---- lanes (MaskFiller.start_advanced): each lane's worker advances its rows' matchers, then masks them ----

class _FlakyExecutor:
    """An LLExecutor whose consume_token_par / unsafe_compute_mask_ptr raise on the calls numbered in
    `consume` / `masks` (1-based, counted per method), else call the real one."""

    def __init__(self, inner, consume=(), masks=()):
        self.inner, self.fail, self.calls = inner, {"consume": consume, "masks": masks}, {"consume": 0, "masks": 0}

    def _call(self, kind, fn, *args):
        self.calls[kind] += 1
        if self.calls[kind] in self.fail[kind]:
            raise RuntimeError(f"injected {kind}")
        return fn(*args)

    def consume_token_par(self, pairs):
        return self._call("consume", self.inner.consume_token_par, pairs)

    def unsafe_compute_mask_ptr(self, *args):
        return self._call("masks", self.inner.unsafe_compute_mask_ptr, *args)


def flaky_lanes(monkeypatch, lane: int, consume=(), masks=()) -> list:
    """Lane `lane` of every MaskFiller started from now on gets a _FlakyExecutor; returns the list of them."""
    import queue
    import threading

    from llaisys import constraints
    made = []

    def start_lane(i):
        jobs, ex = queue.SimpleQueue(), constraints._llg().LLExecutor(1)
        if i == lane:
            ex = _FlakyExecutor(ex, consume, masks)
            made.append(ex)
        threading.Thread(target=constraints._lane_main, args=(jobs, ex), daemon=True,
                         name=f"llaisys-lane-{i}").start()
        return jobs
    monkeypatch.setattr(constraints, "_start_lane", start_lane)
    return made


def test_lanes_advance_and_mask_as_one_row_at_a_time(tiny):
    """MaskFiller.start_advanced: each constraint consumes its token, then its row of the mask is what
    mask_into writes after the same consume, on 3 lanes of several grammars; a row only masked (an EOS row)
    gets its mask as it stands; each consume reports what it left: None (goes on), True (complete) or the
    matcher's error. A second start before wait() raises; wait() re-raises a lane's failure once."""
    from llaisys.constraints import Constraint, Constraints, MaskFiller, compile_constraint
    eng = f32_engine(tiny, "cpu", False)
    try:
        lltok, V, enc = eng._admit.ll_tokenizer(), eng.config.vocab_size, eng.tokenizer.encode
        W = (V + 31) // 32
        made = Constraints(lltok, lanes=3)
        grammars = [compile_constraint(json_schema=SCHEMA), compile_constraint(regex=DATE),
                    compile_constraint(choice=["yes", "no"])]
        texts = ['{"n": 1', "2024-0", "ye"]
        cs = [made.new(g) for g in grammars for _ in range(3)]  # 9 rows, each grammar on every lane
        ref = [Constraint(lltok, g) for g in grammars for _ in range(3)]
        assert sorted({c.lane for c in cs}) == [0, 1, 2]
        for c, r, text in zip(cs, ref, [t for t in texts for _ in range(3)]):
            for t in enc(text):
                c.consume(t)
                r.consume(t)
        # tokens: the next byte of an allowed text; "s" completes "yes"; "x" is refused by the schema
        nxt = [enc(x)[0] for x in (",", "x", '"', "5", "1", "5", "s", "s", "s")]
        consume = [(c, t) for j, (c, t) in enumerate(zip(cs, nxt)) if j != 4]  # row 4: an EOS row, masked only
        for r, (j, t) in zip(ref, enumerate(nxt)):
            if j != 4:
                r.consume(t)
        want = np.empty((len(ref), W), np.int32)
        for r, row in zip(ref, want):
            r.mask_into(row)
        filler = MaskFiller(3, lanes=True)
        got = np.full_like(want, 7)
        ended = filler.start_advanced(consume, cs, got)
        with pytest.raises(RuntimeError, match="not waited for"):
            filler.start_advanced([], cs, got)
        assert filler.wait() >= 0.0 and filler.wait() == 0.0
        assert (got == want).all()
        rows = [j for j in range(len(ref)) if j != 4]
        assert ended == [ref[j].error if ref[j].error is not None else (True if ref[j].done else None) for j in rows]
        assert None in ended and True in ended and isinstance(ended[1], str) and ended[1]  # each outcome
        # a lane whose masks raise: wait() raises it once, and the filler serves the next call
        broken = MaskFiller(2, lanes=True)
        short = np.empty((2, W - 1), np.int32)  # a row too short: llguidance refuses the buffer
        broken.start_advanced([], cs[6:8], short)
        with pytest.raises(Exception):
            broken.wait()
        assert broken.wait() == 0.0
        again = np.empty((2, W), np.int32)
        broken.start_advanced([], cs[6:8], again)
        broken.wait()
        assert (again == want[6:8]).all()
    finally:
        eng.close()


@pytest.mark.parametrize("threads", [2, 3])
def test_lanes_give_the_tokens_of_the_loops_consumes(tiny, monkeypatch, threads):
    """With the lanes on (LLAISYS_MASK_LANES=1) a chained constrained batch step's matchers advance on them:
    the tokens and finish reasons are those of overlap off, of the lanes off, and of each request alone."""
    from llaisys.constraints import MaskFiller
    calls = []
    start = MaskFiller.start_advanced

    def counted(self, consume, constraints, mask):
        calls.append(len(consume))
        return start(self, consume, constraints, mask)
    monkeypatch.setattr(MaskFiller, "start_advanced", counted)
    monkeypatch.setenv("LLAISYS_MASK_LANES", "1")
    plain, over, n = run_both(tiny, lambda eng: mixed(eng, 0.9, 7), mask_threads=threads)
    assert result(over) == result(plain) and n > 5 and len(calls) > 5 and max(calls) >= 3
    monkeypatch.setenv("LLAISYS_MASK_LANES", "0")
    calls.clear()
    off = go_engine_kw(tiny, True, lambda eng: mixed(eng, 0.9, 7), mask_threads=threads)
    assert result(off) == result(plain) and not calls
    monkeypatch.setenv("LLAISYS_MASK_LANES", "1")

    def alone(eng):  # each of mixed()'s requests by itself
        ps = token_prompts(eng.config.vocab_size, [5, 19, 8, 33, 12, 7], seed=4)
        kws = [dict(max_new_tokens=40, json_schema=SCHEMA), dict(max_new_tokens=30, ignore_eos=True),
               dict(max_new_tokens=24, regex=DATE), dict(max_new_tokens=12, choice=["yes", "no", "maybe"]),
               dict(max_new_tokens=16, grammar='start: "a" "b"* "c"'), dict(max_new_tokens=30, json_schema=True)]
        return [eng.generate(p, temperature=0.9, seed=7, **kw) for p, kw in zip(ps, kws)]
    assert result(go_engine_kw(tiny, True, alone, mask_threads=threads)) == result(plain)


def go_engine_kw(tiny, overlap, fn, **kw):
    eng = f32_engine(tiny, "cpu", overlap, **kw)
    try:
        return fn(eng)
    finally:
        eng.close()


def _schema_rows(eng, n, only=None):
    """n requests of SCHEMA, seeded (only: the i-th of them alone)."""
    ps = token_prompts(eng.config.vocab_size, [7 + i for i in range(n)], seed=31)
    return [eng.submit(p, max_new_tokens=30, temperature=0.8, seed=9 + i, json_schema=SCHEMA, ignore_eos=True)
            for i, p in enumerate(ps) if only is None or i == only]


def _outcome(req):
    try:
        r = req.result()
        return r.token_ids, r.finish_reason
    except Exception as e:
        return repr(e)


def test_a_lane_that_raises_fails_only_its_rows(tiny, monkeypatch):
    """A lane whose masks raise drops that step (its rows run again: the tokens of the plain run); a lane
    whose consumes raise ends its own rows with a structured-output error on their requests, and the rows of
    the other lane go on with the plain run's tokens. Nothing hangs."""
    monkeypatch.setenv("LLAISYS_MASK_LANES", "1")
    plain = go_engine_kw(tiny, False, lambda eng: [_outcome(r) for r in _schema_rows(eng, 4)], mask_threads=2)
    assert all(isinstance(o, tuple) for o in plain)
    flaky = flaky_lanes(monkeypatch, 1, masks=(3, 6))
    assert go_engine_kw(tiny, True, lambda eng: [_outcome(r) for r in _schema_rows(eng, 4)], mask_threads=2) == plain
    assert flaky and flaky[0].calls["masks"] > 6
    flaky = flaky_lanes(monkeypatch, 1, consume=(4,))
    got = go_engine_kw(tiny, True, lambda eng: [_outcome(r) for r in _schema_rows(eng, 4)], mask_threads=2)
    # requests take the lanes in turn: rows 0 and 2 on lane 0, rows 1 and 3 on lane 1
    assert got[0] == plain[0] and got[2] == plain[2]
    for failed in (got[1], got[3]):
        assert isinstance(failed, str) and "structured output" in failed and "injected consume" in failed


def test_abort_and_close_in_the_middle_of_a_constrained_batch_on_lanes(tiny, monkeypatch):
    """Requests aborted while their batch's masks are on the lanes end there; the others get the tokens they
    get alone. close() while constrained rows run on the lanes returns (nothing waits forever), their
    requests fail with the engine's error, and the lanes' threads end once the engine is gone."""
    import gc
    import threading
    import time

    monkeypatch.setenv("LLAISYS_MASK_LANES", "1")

    def lanes():  # lane threads alive now
        return {t for t in threading.enumerate() if t.name.startswith("llaisys-lane")}
    alone = go_engine_kw(tiny, True, lambda eng: [_outcome(_schema_rows(eng, 6, only=i)[0]) for i in range(6)],
                         mask_threads=3)
    gc.collect()
    before = lanes()
    eng = f32_engine(tiny, "cpu", True, mask_threads=3)
    try:
        reqs = _schema_rows(eng, 6)
        for chunk in reqs[1]:  # a few steps in, then two rows leave
            if len(chunk.token_ids) >= 1 and eng._core.runner.deferred_steps > 3:
                break
        reqs[1].abort()
        reqs[4].abort()
        got = [_outcome(r) for r in reqs]
        for i in (0, 2, 3, 5):
            assert got[i] == alone[i]
        for i in (1, 4):
            assert isinstance(got[i], str) or got[i][1] == "abort"
        assert eng._core.runner.deferred_steps > 3
        # close in the middle: long rows, closed once the lanes are busy
        long = [eng.submit(p, max_new_tokens=300, temperature=0.8, seed=3, regex="[a-z]{500}", ignore_eos=True)
                for p in token_prompts(eng.config.vocab_size, [5, 6, 7, 8, 9, 10], seed=2)]
        while eng._core.runner.deferred_steps < 20:
            time.sleep(0.001)
        assert len(lanes() - before) == 3  # this engine's
        closer = threading.Thread(target=eng.close)
        closer.start()
        closer.join(timeout=60)
        assert not closer.is_alive()
        for r in long:
            with pytest.raises(RuntimeError, match="closed"):
                r.result()
    finally:
        eng.close()
    del eng, reqs, long
    for _ in range(200):  # the lanes end when their MaskFiller is collected
        gc.collect()
        if not lanes() - before:
            break
        time.sleep(0.01)
    assert not lanes() - before
