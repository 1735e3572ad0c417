"""The repetition penalty in chained steps and the persistent decode batch: each penalised sequence's set
of seen tokens lives on the device (engine/seen.py), written once from its prompt and grown by the sampler
with each token, so a chained step penalises the token it reads although the host does not know it yet.
Rows with different penalties, and rows without, batched: the tokens are HF transformers' (greedy with its
RepetitionPenaltyLogitsProcessor, each prompt alone) with overlap off and on, and those of the general path;
steps now chain and run from the batch arrays (on the code before, a penalised row kept every step plain).
Rows waiting for a tool-call trigger (grammar_trigger) join the batch too and still get their constraint.
On the CPU the same calls run as on CUDA with overlap forced on (checked exactly)."""
import re

import pytest
import torch

from tiny_model import make_tiny_qwen2
from utils import DEVICES, f32_engine, failing_mask_fills, token_prompts

PENALTIES = [1.8, 1.0, 1.3, 0.7, 1.0, 1.1]  # 0.7 < 1 rewards repetition; 1.0: no penalty
LENGTHS = [9, 4, 17, 6, 12, 25]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("overlap_penalty"), seed=5, max_position_embeddings=1024)


def run(tiny, device, overlap, fn, general=False, monkeypatch=None):
    """fn(engine) -> (its result, the engine's stats). general: no row may join the persistent batch."""
    if general:
        from llaisys.engine import scheduler
        monkeypatch.setattr(scheduler, "eligible", lambda seq: False)
    eng = f32_engine(tiny, device, overlap)
    try:
        return fn(eng), eng.stats()
    finally:
        eng.close()
        if general:
            monkeypatch.undo()


@torch.no_grad()
def hf_reference(tiny, prompts, n, penalties):
    import transformers
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    out = []
    for ids, p in zip(prompts, penalties):
        seq, tokens = torch.tensor([ids]), []
        proc = RepetitionPenaltyLogitsProcessor(p) if p != 1.0 else None
        for _ in range(n):
            logits = hf(seq).logits[:, -1]
            if proc is not None:
                logits = proc(seq, logits)
            tokens.append(int(logits.argmax(-1)))
            seq = torch.cat([seq, torch.tensor([[tokens[-1]]])], 1)
        out.append(tokens)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_penalised_rows_chain_batch_and_match_hf(tiny, device, monkeypatch):
    def go(eng):
        ps = token_prompts(eng.config.vocab_size, LENGTHS, seed=3)
        rs = eng.generate(ps, max_new_tokens=24, temperature=0, repetition_penalty=PENALTIES, ignore_eos=True)
        return ps, [r.token_ids for r in rs]

    (ps, plain), s_plain = run(tiny, device, False, go)
    (_, over), s_over = run(tiny, device, True, go)
    (_, general), s_general = run(tiny, device, True, go, general=True, monkeypatch=monkeypatch)
    ref = hf_reference(tiny, ps, 24, PENALTIES)
    assert plain == ref and over == ref and general == ref
    assert ref != hf_reference(tiny, ps, 24, [1.0] * len(ps))  # the penalties changed the output: teeth
    assert s_plain["decode_batch_steps"] > 15  # the rows ran from the batch arrays (before: 0)
    assert s_over["overlapped_steps"] > 15 and s_general["overlapped_steps"] > 15  # chained (before: 0)
    assert s_general["decode_batch_steps"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_penalised_rows_beside_free_ones(tiny, device, monkeypatch):
    def go(eng):
        ps = token_prompts(eng.config.vocab_size, LENGTHS, seed=8)
        rs = eng.generate(ps, max_new_tokens=[30, 12, 25, 30, 7, 18], temperature=[0.9, 0.7, 0, 1.1, 0.8, 0.6],
                          top_p=0.95, seed=11, repetition_penalty=PENALTIES)
        return [(r.token_ids, r.finish_reason) for r in rs]

    plain, _ = run(tiny, device, False, go)
    over, stats = run(tiny, device, True, go)
    general, _ = run(tiny, device, False, go, general=True, monkeypatch=monkeypatch)
    assert over == plain and general == plain
    assert stats["overlapped_steps"] > 0


def test_each_sequence_set_is_written_once_and_rows_are_reused(tiny):
    """The host writes a sequence's set once (its first step), never per step; finished sequences' rows
    are reused by later ones."""
    eng = f32_engine(tiny, "cpu", True)
    try:
        seen = eng._core.runner.seen
        ps = token_prompts(eng.config.vocab_size, [5, 9, 7], seed=2)
        eng.generate(ps, max_new_tokens=30, temperature=0, repetition_penalty=[1.2, 1.0, 1.5], ignore_eos=True)
        assert seen.writes == 2 and seen.count == 2
        eng.generate(ps, max_new_tokens=30, temperature=0, repetition_penalty=1.3, ignore_eos=True)
        assert seen.writes == 5 and seen.count == 3  # two rows reused, one more
    finally:
        eng.close()


def test_a_failed_step_rewrites_the_sets(tiny, monkeypatch):
    """A chained step whose sampling fails is dropped after the device sampled it unmasked (EngineCore._drain):
    that token was added to the rows' sets on the device, so the sets are written again from what the host
    kept; the tokens are those of the plain run."""
    pytest.importorskip("llguidance")

    def go(eng):
        ps = token_prompts(eng.config.vocab_size, [7, 13, 5], seed=12)
        rs = eng.generate(ps, max_new_tokens=20, temperature=[0, 0.9, 0], seed=5, ignore_eos=True,
                          repetition_penalty=[1.5, 1.3, 2.0], regex=[None, "[a-z ]{1,40}", None])
        return [(r.token_ids, r.finish_reason) for r in rs]

    plain, _ = run(tiny, "cpu", False, go)
    calls = failing_mask_fills(monkeypatch, (4, 9))
    over, stats = run(tiny, "cpu", True, go)
    assert over == plain
    assert len(calls) > 9 and stats["overlapped_steps"] > 0


def test_tool_trigger_rows_join_the_batch_and_get_their_constraint(tiny, monkeypatch):
    """Rows waiting for a tool-call trigger (grammar_trigger, tool_choice "auto") run from the batch arrays:
    free up to the trigger, constrained after it, as on the general path, overlap off and on. One row never
    reaches its trigger and runs longest, so the batch steps counted are steps with a waiting row in it
    (before, such a row kept every step on the general path)."""
    pytest.importorskip("llguidance")

    def go(eng):
        p, q = token_prompts(eng.config.vocab_size, [15, 11], seed=13)
        kw = dict(temperature=0.8, seed=21, ignore_eos=True)
        free = eng.generate(p, max_new_tokens=40, **kw)
        first = free.token_ids.index(free.token_ids[6])
        trigger = eng.tokenizer.id_to_token(free.token_ids[6])
        before = eng.stats()["decode_batch_steps"]
        lazy, never = eng.generate([p, q], max_new_tokens=[40, 60], regex="[0-9]{3}",
                                   grammar_trigger=[trigger, "<|im_start|>"], **kw)
        batch_steps = eng.stats()["decode_batch_steps"] - before
        alone = eng.generate(q, max_new_tokens=60, **kw)
        tail = eng.tokenizer.decode(lazy.token_ids[first + 1:])
        return first, free.token_ids, lazy.token_ids, lazy.finish_reason, tail, never.token_ids, alone.token_ids, \
            batch_steps

    plain, _ = run(tiny, "cpu", False, go)
    over, _ = run(tiny, "cpu", True, go)
    general, _ = run(tiny, "cpu", False, go, general=True, monkeypatch=monkeypatch)
    assert over[:-1] == plain[:-1] and general[:-1] == plain[:-1]
    first, free, lazy, reason, tail, never, alone, batch_steps = plain
    assert lazy[:first + 1] == free[:first + 1] and reason == "stop" and re.fullmatch("[0-9]{3}", tail)
    assert never == alone  # never triggered: free throughout
    assert batch_steps > 50 and general[-1] == 0  # the waiting row decoded from the batch (before: 0)
