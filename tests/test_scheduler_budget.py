"""The step budget (max_num_batched_tokens) and the prefill chunk (max_prefill_chunk), without a model: a long
prompt never takes a step while decodes or short prompts wait, every step stays within both caps, long
prompts progress in arrival order, the uncapped scheduler is the one of before, and no schedule changes what
a sequence generates. The engine's defaults per device, and the same texts on a tiny model."""
import random
from collections import deque

import numpy as np
import pytest

from llaisys.engine.block_manager import BlockManager
from llaisys.engine.config import EngineConfig
from llaisys.engine.scheduler import Scheduler, Step
from llaisys.engine.sequence import Sequence, Status
from llaisys.sampling import resolve_sampling
from utils import DEVICES


def seq(tokens, max_new=4):
    return Sequence(list(tokens), resolve_sampling({}, max_new_tokens=max_new), seed=0, eos=frozenset())


def next_token(tokens):
    """A deterministic 'model': the next token is a function of the sequence's own tokens."""
    return (sum(tokens) * 31 + len(tokens)) % 97


def model(s):
    return next_token(s.tokens)


def run_step(sched, step, next_token=model):
    """What EngineCore.step does with the runner's output."""
    for s, n in zip(step.seqs, step.num_tokens):
        if s.status is not Status.RUNNING:
            continue
        s.num_computed += n
        sched.blocks.register_full(s)
        if s.num_computed == len(s):
            s.append(next_token(s))
            if s.num_output >= s.params.max_new_tokens:
                sched.finish(s, "length")


def check_step(sched, step):
    assert len(step.seqs) == len(set(map(id, step.seqs))) <= sched.max_num_seqs
    assert sum(step.num_tokens) <= sched.max_tokens
    for s, n in zip(step.seqs, step.num_tokens):
        assert 1 <= n <= s.remaining and s.status is Status.RUNNING
        alone = len(step.seqs) == 1 and len(sched.running) + len(sched.waiting) == 1  # the whole budget, then
        if sched.max_chunk is not None and not alone:
            assert n <= sched.max_chunk


def test_a_long_prompt_never_takes_the_step_from_decodes_and_short_prompts():
    sched = Scheduler(BlockManager(num_blocks=400, block_size=4), max_num_seqs=16, max_num_batched_tokens=32,
                      max_prefill_chunk=8)
    streams = [seq([1, 2, 3], max_new=200), seq([4, 5], max_new=200)]
    for s in streams:
        sched.add(s)
    run_step(sched, sched.schedule())
    long = seq(range(100, 400), max_new=2)  # 300 tokens: 38 chunks of 8
    sched.add(long)
    shorts = []
    for i in range(30):
        if i % 3 == 0:  # a short request arrives every third step
            shorts.append(seq([10 + i] * 5, max_new=3))
            sched.add(shorts[-1])
        step = sched.schedule()
        check_step(sched, step)
        got = dict(zip(map(id, step.seqs), step.num_tokens))
        assert all(got.get(id(s)) == 1 for s in streams)  # every stream decodes in every step
        assert got[id(long)] == 8  # the long prompt progresses by one chunk, never more
        # a short request is admitted, and its whole prompt computed, in the step after it arrives
        for s in shorts:
            assert s.status is not Status.WAITING
        run_step(sched, step)
    assert long.num_computed == 30 * 8 and long.num_output == 0
    assert all(s.num_output == 3 for s in shorts)


def test_long_prompts_progress_in_arrival_order_and_fill_what_short_ones_leave():
    sched = Scheduler(BlockManager(num_blocks=400, block_size=4), max_num_seqs=16, max_num_batched_tokens=24,
                      max_prefill_chunk=8)
    a, b, c = seq(range(50), max_new=1), seq(range(100, 150), max_new=1), seq(range(200, 250), max_new=1)
    for s in (a, b, c):
        sched.add(s)
    step = sched.schedule()  # nothing else waits: the long ones fill the budget, oldest first
    assert step.seqs == [a, b, c] and step.num_tokens == [8, 8, 8]
    run_step(sched, step)
    short = seq([7] * 6)
    sched.add(short)
    step = sched.schedule()  # the oldest long one, then the short one, then the other long ones in what is left
    assert step.seqs == [a, short, b, c] and step.num_tokens == [8, 6, 8, 2]
    run_step(sched, step)
    first = {}  # the step of each long prompt's first token
    for t in range(100):
        if not sched.has_work():
            break
        step = sched.schedule()
        check_step(sched, step)
        if a in step.seqs:  # the oldest is never passed over
            assert step.num_tokens[step.seqs.index(a)] == min(8, a.remaining)
        run_step(sched, step)
        first.update({name: t for name, s in (("a", a), ("b", b), ("c", c)) if s.num_output and name not in first})
    assert first["a"] <= first["b"] <= first["c"] and first["a"] < first["c"]


def test_a_long_prompt_passed_over_is_admitted_after_short_ones():
    sched = Scheduler(BlockManager(num_blocks=400, block_size=4), max_num_seqs=16, max_num_batched_tokens=20,
                      max_prefill_chunk=8)
    running = seq(range(40), max_new=1)
    sched.add(running)
    run_step(sched, sched.schedule())
    waiting_long, short = seq(range(300, 340), max_new=1), seq([5, 6, 7], max_new=1)
    sched.add(waiting_long)
    sched.add(short)
    step = sched.schedule()
    assert step.seqs == [running, short, waiting_long] and step.num_tokens == [8, 3, 8]


def test_a_prompt_alone_takes_the_whole_budget_and_the_cap_returns_with_company():
    sched = Scheduler(BlockManager(num_blocks=400, block_size=4), max_num_seqs=16, max_num_batched_tokens=32,
                      max_prefill_chunk=8)
    long = seq(range(100, 200), max_new=3)  # 100 tokens
    sched.add(long)
    step = sched.schedule()
    assert step.seqs == [long] and step.num_tokens == [32]  # alone: the budget, not the cap
    run_step(sched, step)
    short = seq([1, 2, 3], max_new=5)
    sched.add(short)  # waiting: the long prompt has company again
    step = sched.schedule()
    assert step.seqs == [long, short] and step.num_tokens == [8, 3]
    run_step(sched, step)
    step = sched.schedule()  # short decodes beside the long prompt's chunks of the cap
    assert step.seqs == [short, long] and step.num_tokens == [1, 8]
    while short.status is Status.RUNNING:
        run_step(sched, sched.schedule())
    step = sched.schedule()  # alone again
    assert step.seqs == [long] and step.num_tokens == [min(32, long.remaining)]
    assert long.remaining > 8


def test_a_new_request_that_does_not_fit_stops_admission():
    bm = BlockManager(num_blocks=12, block_size=4)  # 44 tokens
    sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=64, max_prefill_chunk=8)
    big = seq(range(39), max_new=5)  # alone: its whole prompt in one step (10 blocks), then it decodes in block 10
    sched.add(big)
    run_step(sched, sched.schedule())
    assert big.num_computed == 39
    blocked, short = seq(range(100, 108), max_new=1), seq([1, 2], max_new=1)  # 2 blocks, 1 free
    sched.add(blocked)
    sched.add(short)
    step = sched.schedule()
    assert step.seqs == [big] and list(sched.waiting) == [blocked, short]


def old_schedule(sched):
    """The scheduler as it was before max_prefill_chunk (commit 68fe1c6), for the comparison below."""
    step, budget = Step(), sched.max_tokens
    decodes = [s for s in sched.running if s.remaining == 1]
    prefills = [s for s in sched.running if s.remaining > 1]
    for s in decodes + prefills:
        if budget == 0 or len(step.seqs) == sched.max_num_seqs:
            break
        if s.status is not Status.RUNNING or not sched._make_room(s, step):
            continue
        n = min(s.remaining, budget)
        step.add(s, n)
        budget -= n
    while sched.waiting and budget > 0 and len(sched.running) < sched.max_num_seqs:
        s = sched.waiting[0]
        if not sched.blocks.can_admit(s):
            break
        sched.waiting.popleft()
        sched.blocks.admit(s)
        s.status = Status.RUNNING
        sched.running.append(s)
        n = min(s.remaining, budget)
        step.add(s, n)
        budget -= n
    return step


def workload(rng, n):
    return [([rng.randrange(50) for _ in range(rng.choice([rng.randint(1, 6), rng.randint(10, 70)]))],
             rng.randint(1, 12), rng.randrange(30)) for _ in range(n)]


def simulate(schedule, max_chunk, num_blocks, seed, tokens=24, caching=True):
    """Runs a random workload (arrivals over time) to the end; (per-step [(seq index, tokens)], sequences)."""
    rng = random.Random(seed)
    sched = Scheduler(BlockManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=caching),
                      max_num_seqs=6, max_num_batched_tokens=tokens, max_prefill_chunk=max_chunk)
    arrivals = deque(sorted(workload(rng, 25), key=lambda w: w[2]))
    seqs, trace = [], []
    for t in range(5000):
        while arrivals and arrivals[0][2] <= t:
            prompt, new, _ = arrivals.popleft()
            seqs.append(seq(prompt, max_new=new))
            sched.add(seqs[-1])
        if not arrivals and not sched.has_work():
            break
        step = schedule(sched)
        check_step(sched, step)
        trace.append([(seqs.index(s), n) for s, n in zip(step.seqs, step.num_tokens)])
        run_step(sched, step)
    assert not sched.has_work() and sched.blocks.num_used == 0
    return trace, seqs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [24, 400])
def test_without_a_chunk_cap_the_schedule_is_the_one_of_before(seed, num_blocks):
    new, _ = simulate(Scheduler.schedule, None, num_blocks, seed)
    old, _ = simulate(old_schedule, None, num_blocks, seed)
    assert new == old


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [24, 400])  # 24: preemptions
@pytest.mark.parametrize("max_chunk,tokens", [(1, 24), (4, 24), (8, 24), (16, 16), (100, 24), (8, 6)])
def test_any_caps_give_every_sequence_the_same_tokens(seed, num_blocks, max_chunk, tokens):
    """Whatever the chunks and their order, each sequence generates what it generates alone, and the steps
    stay within their caps (check_step, in simulate)."""
    _, ref = simulate(old_schedule, None, num_blocks, seed)
    _, got = simulate(Scheduler.schedule, max_chunk, num_blocks, seed, tokens=tokens)
    assert [s.tokens for s in got] == [s.tokens for s in ref]
    for s in got:
        alone = list(s.tokens[:s.num_prompt])
        for _ in range(s.params.max_new_tokens):
            alone.append(next_token(alone))
        assert s.tokens == alone


def test_device_defaults():
    cpu, cuda = EngineConfig().for_device("cpu"), EngineConfig().for_device("cuda:0")
    assert (cpu.max_num_batched_tokens, cpu.max_prefill_chunk) == (256, 32)
    assert (cuda.max_num_batched_tokens, cuda.max_prefill_chunk) == (4096, 2048)
    mine = EngineConfig(max_num_batched_tokens=1000, max_prefill_chunk=100).for_device("cpu")
    assert (mine.max_num_batched_tokens, mine.max_prefill_chunk) == (1000, 100)
    assert EngineConfig().max_num_batched_tokens is None  # until the device is known
    for bad in (0, -1, 1.5, True, "64"):
        with pytest.raises(ValueError, match="max_prefill_chunk"):
            EngineConfig(max_prefill_chunk=bad)
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            EngineConfig(max_num_batched_tokens=bad)


def test_the_engine_uses_the_defaults_and_the_texts_do_not_change(tmp_path):
    pytest.importorskip("torch")
    from llaisys.engine.engine import Engine
    from tiny_model import make_tiny_qwen2

    path = make_tiny_qwen2(tmp_path / "m", seed=3, max_position_embeddings=1024)
    rng = random.Random(0)
    prompts = [[rng.randrange(200) for _ in range(n)] for n in (700, 5, 300, 40, 1, 130)]
    texts, steps = {}, {}
    for name, kw in (("default", {}), ("whole", dict(max_num_batched_tokens=4096, max_prefill_chunk=4096))):
        with Engine(path, device="cpu", dtype="f32", progress=False, max_seq_len=1024, num_kv_blocks=512, **kw) as eng:
            if name == "default":
                assert (eng.engine_config.max_num_batched_tokens, eng.engine_config.max_prefill_chunk) == (256, 32)
            out = eng.generate(prompts, max_new_tokens=12, temperature=0, ignore_eos=True)
            texts[name] = [(r.text, r.token_ids) for r in out]
            steps[name] = eng._core.timing["steps"]
    assert texts["default"] == texts["whole"]
    assert steps["default"] > steps["whole"]  # the prompts were computed in chunks


def load_hol_latency():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "bench", "hol_latency.py")
    spec = importlib.util.spec_from_file_location("bench_hol_latency_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hol_latency_policies_parse():
    hol = load_hol_latency()
    assert hol.parse_policy("before=4096:none") == ("before", 4096, None, False)
    assert hol.parse_policy("c=256:32") == ("c", 256, 32, True)
    assert hol.parse_policy("after=default") == ("after", None, None, True)
    for bad in ("x", "=1:2", "a=1", "a=0:4", "a=4:0", "a=b:c"):
        with pytest.raises(ValueError, match="--policy"):
            hol.parse_policy(bad)


def test_hol_latency_runs_before_and_after_on_a_tiny_model(tmp_path, capsys):
    import json

    pytest.importorskip("torch")
    from tiny_model import make_tiny_qwen2

    path = make_tiny_qwen2(tmp_path / "m", seed=4, max_position_embeddings=1024)
    out = tmp_path / "hol.json"
    assert load_hol_latency().main(["--model", str(path), "--long", "300", "--short", "2", "--gap", "0.01",
                                    "--stream-len", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tokens are the same under every policy" in printed and "short TTFT" in printed
    r = json.loads(out.read_text())
    assert r["same_tokens"] is True
    before, after = r["policies"]["before"], r["policies"]["after"]
    assert (before["tokens_per_step"], before["chunk"]) == (4096, None)
    assert (after["tokens_per_step"], after["chunk"]) == (256, 32)
    for p in (before, after):
        assert p["short_ttft_s"]["n"] == 2 and p["short_itl_s"]["n"] == 2 * 3 and p["long_ttft_s"] > 0


class _RunnerSpy:
    """The C++ runner, recording each step()/launch()'s logits flag (their last positional argument) and ids."""

    def __init__(self, runner):
        self._r, self.flags, self.ids = runner, [], []

    def step(self, *args):
        self.flags.append(args[-1])
        ids = self._r.step(*args)
        self.ids.append(list(ids))
        return ids

    def launch(self, *args):
        self.flags.append(args[-1])
        return self._r.launch(*args)

    def __getattr__(self, name):
        return getattr(self._r, name)


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_chunks_before_the_last_skip_the_lm_head(tmp_path, device):
    """A prompt alone in its steps: each chunk but its last runs without the LM head (HostBatch::logits False,
    token 0 a row), and the tokens are those of the whole prompt in one step."""
    pytest.importorskip("torch")
    from llaisys.engine.engine import Engine
    from tiny_model import make_tiny_qwen2

    path = make_tiny_qwen2(tmp_path / "m", seed=5, max_position_embeddings=512)
    prompt = [random.Random(1).randrange(200) for _ in range(100)]
    out = {}
    for chunk in (16, 4096):  # (a prompt alone takes the whole budget a step: the budget makes the chunks)
        with Engine(path, device=device, dtype="f32", progress=False, max_seq_len=512, num_kv_blocks=64,
                    max_num_seqs=4, max_num_batched_tokens=chunk, max_prefill_chunk=chunk) as eng:
            spy = _RunnerSpy(eng._core.runner.runner)
            eng._core.runner.runner = spy
            r = eng.generate(prompt, max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
            out[chunk] = (r.token_ids, [e["logprob"] for e in r.logprobs], spy.flags, spy.ids)
    tokens, lps, flags, ids = out[16]
    assert flags[:7] == [False] * 6 + [True]  # 100 tokens: 6 chunks of 16, then the last 4 with the logits
    assert all(flags[7:])
    assert ids[:6] == [[0]] * 6
    assert out[4096][2][0] is True
    assert tokens == out[4096][0]
    np.testing.assert_allclose(lps, out[4096][1], rtol=1e-5, atol=1e-6 if device == "cpu" else 1e-4)
