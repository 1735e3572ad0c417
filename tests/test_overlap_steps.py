"""Overlapped decode steps (EngineConfig.overlap_steps): the host launches step n + 1, its input tokens
chained on the device, before it reads step n's tokens. Nothing a caller sees may change: the same tokens,
texts and finish reasons as the plain step loop, for greedy and seeded sampling, EOS, stop strings, length
limits, aborts, requests arriving mid-stream, penalties (which run the plain way) and the prefix cache.
On the CPU the step runs on the calling thread, so nothing overlaps in time, but the same code paths run
(overlap_steps=True forces them); on CUDA the whole engine suite runs overlapped by default."""
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
def test_penalties_and_logprobs_run_the_plain_way(tiny, device):
    def go(eng):
        p = prompts(eng.config.vocab_size, [20], seed=4)[0]
        a = eng.generate(p, max_new_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.3)
        b = eng.generate(p, max_new_tokens=20, temperature=0, ignore_eos=True, presence_penalty=0.5)
        c = eng.generate(p, max_new_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
        return a.token_ids, b.token_ids, c.token_ids
    plain, over, n = run_both(tiny, device, go)
    assert over == plain and n == 0


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
