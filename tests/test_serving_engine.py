"""The batched engine end to end on tiny random checkpoints: a request's tokens never depend on its
neighbours (batched == alone, greedy and seeded), preemption and the prefix cache change nothing,
aborts free blocks at once, bad requests fail alone, and 64 threads get exactly their own tokens.
References: each request run alone, and HF transformers' greedy decode."""
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llaisys.engine.engine import Engine  # noqa: E402
from tiny_model import make_tiny_qwen2  # noqa: E402
from utils import DEVICES  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("serving"), seed=11, max_position_embeddings=1024)


def prompts(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


LENGTHS = [1, 7, 16, 17, 33, 120, 250, 500]
OUTS = [5, 40, 17, 1, 64, 23, 9, 30]


def engine(path, device, **kw):
    dtype = kw.pop("dtype", "f32")
    kw.setdefault("num_kv_blocks", 1024)  # not 90% of a GPU: several engines live at once here
    return Engine(path, device=device, dtype=dtype, progress=False, max_seq_len=kw.pop("max_seq_len", 640), **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_batched_equals_alone_and_hf(tiny, device):
    eng = engine(tiny, device, enable_prefix_caching=False, max_num_batched_tokens=256)
    ps = prompts(eng.config.vocab_size, LENGTHS)
    alone = [eng.generate(p, max_new_tokens=n, temperature=0, ignore_eos=True).token_ids for p, n in zip(ps, OUTS)]
    batch = eng.generate(ps, max_new_tokens=OUTS, temperature=0, ignore_eos=True)
    assert [r.token_ids for r in batch] == alone
    assert [r.finish_reason for r in batch] == ["length"] * len(ps)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        for p, n, got in list(zip(ps, OUTS, alone))[:4]:
            out = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
            assert out[0, len(p):].tolist() == got
    eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_does_not_depend_on_the_batch(tiny, device):
    eng = engine(tiny, device)
    ps = prompts(eng.config.vocab_size, LENGTHS, seed=1)
    kw = dict(temperature=0.9, top_p=0.95, top_k=40, ignore_eos=True)
    alone = [eng.generate(p, max_new_tokens=n, seed=100 + i, **kw).token_ids
             for i, (p, n) in enumerate(zip(ps, OUTS))]
    batch = eng.generate(ps, max_new_tokens=OUTS, seed=[100 + i for i in range(len(ps))], **kw)
    assert [r.token_ids for r in batch] == alone
    shuffled = eng.generate(ps[::-1], max_new_tokens=OUTS[::-1], seed=[100 + i for i in range(len(ps))][::-1], **kw)
    assert [r.token_ids for r in shuffled][::-1] == alone
    eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_preemption_under_a_tiny_pool(tiny, device):
    ref = engine(tiny, device)
    ps = prompts(ref.config.vocab_size, [30, 45, 60, 20, 50, 33], seed=2)
    outs = [40, 35, 30, 45, 25, 38]
    alone = [ref.generate(p, max_new_tokens=n, temperature=0, ignore_eos=True).token_ids for p, n in zip(ps, outs)]
    ref.close()
    # 12 blocks of 8 tokens: one request (at most 85 tokens) fits, all six at once cannot
    eng = engine(tiny, device, num_kv_blocks=13, block_size=8, max_seq_len=96)
    batch = eng.generate(ps, max_new_tokens=outs, temperature=0, ignore_eos=True)
    assert [r.token_ids for r in batch] == alone
    stats = eng.stats()
    assert stats["preemptions"] > 0 and stats["kv_blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0
    eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_cache_reuses_a_shared_system_prompt(tiny, device):
    on, off = engine(tiny, device), engine(tiny, device, enable_prefix_caching=False)
    system = prompts(on.config.vocab_size, [64], seed=3)[0]
    tails = prompts(on.config.vocab_size, [5, 9, 13, 1], seed=4)
    first = on.generate(system + tails[0], max_new_tokens=8, temperature=0)
    assert first.usage["cached_tokens"] == 0
    rest = on.generate([system + t for t in tails[1:]], max_new_tokens=8, temperature=0)
    assert all(r.usage["cached_tokens"] == 64 for r in rest)  # prefilled once, then shared
    plain = off.generate([system + t for t in tails], max_new_tokens=8, temperature=0)
    assert [r.token_ids for r in [first] + rest] == [r.token_ids for r in plain]
    assert all(r.usage["cached_tokens"] == 0 for r in plain)
    assert on.stats()["prefix_cache_hit_rate"] > 0
    on.close()
    off.close()


def test_abort_frees_blocks_and_leaves_others_untouched(tiny):
    eng = engine(tiny, "cpu")
    ps = prompts(eng.config.vocab_size, [40, 50, 60], seed=5)
    alone = eng.generate(ps[1], max_new_tokens=60, temperature=0, ignore_eos=True).token_ids
    reqs = [eng.submit(p, max_new_tokens=60, temperature=0, ignore_eos=True) for p in ps]
    it = iter(reqs[0])
    next(it)  # the first request has produced text: abort it mid-stream
    reqs[0].abort()
    rest = [r.result() for r in reqs[1:]]
    assert rest[0].token_ids == alone
    assert reqs[0].result().finish_reason == "abort"
    s = eng.stats()
    assert s["kv_blocks_used"] == 0 and s["running"] == 0
    stream = eng.stream(ps[2], max_new_tokens=60, temperature=0, ignore_eos=True)
    next(stream)
    stream.close()  # closing the iterator aborts the request
    assert eng.stats()["kv_blocks_used"] == 0
    eng.close()


def test_requests_that_cannot_fit_fail_alone_and_bad_arguments_before_anything_runs(tiny):
    eng = engine(tiny, "cpu", num_kv_blocks=9, block_size=8, max_seq_len=200)  # the pool holds 64 tokens
    ok = prompts(eng.config.vocab_size, [10], seed=6)[0]
    with pytest.raises(ValueError, match="whole pool holds 64"):
        eng.generate(prompts(eng.config.vocab_size, [60], seed=7)[0], max_new_tokens=20)
    with pytest.raises(ValueError, match="context holds 200"):
        eng.generate(list(range(200)), max_new_tokens=1)
    with pytest.raises(ValueError, match="top_p"):
        eng.generate([ok, ok], top_p=[0.5, 7.0])
    with pytest.raises(ValueError, match="3 values for 2 prompts"):
        eng.generate([ok, ok], seed=[1, 2, 3])
    assert eng.stats()["waiting"] == 0 and eng.stats()["running"] == 0
    assert len(eng.generate(ok, max_new_tokens=5, ignore_eos=True).token_ids) == 5
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate(ok)


def test_64_threads_get_exactly_their_own_tokens(tiny):
    eng = engine(tiny, "cpu")
    ps = prompts(eng.config.vocab_size, [3 + (i * 7) % 90 for i in range(64)], seed=8)
    kw = [dict(max_new_tokens=4 + i % 13, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
          for i in range(64)]
    alone = [eng.generate(p, **k).token_ids for p, k in zip(ps, kw)]
    got, errors = [None] * 64, []

    def worker(i):
        try:
            if i % 3 == 0:  # streaming readers interleave with blocking ones
                got[i] = [t for c in eng.stream(ps[i], **kw[i]) for t in c.token_ids]
            else:
                got[i] = eng.generate(ps[i], **kw[i]).token_ids
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == alone
    eng.close()


def test_chat_accepts_a_list_of_conversations(tiny):
    eng = engine(tiny, "cpu")
    convs = [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "sort a list"}]]
    both = eng.chat(convs, max_new_tokens=6, temperature=0)
    assert [r.token_ids for r in both] == [eng.chat(c, max_new_tokens=6, temperature=0).token_ids for c in convs]
    with pytest.raises(ValueError, match="one conversation"):
        eng.chat(convs, stream=True)
    eng.close()


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def _reference_greedy(eng, prompt, n, bias_fn):
    """Greedy decoding written from the formulas: score()'s last-row logits + bias_fn(step, generated)."""
    out = []
    for step in range(n):
        logits = eng.score(prompt + out)[-1].astype(np.float64)
        for t, b in bias_fn(step, out).items():
            logits[t] += b
        out.append(int(np.argmax(logits)))
    return out


def test_presence_and_frequency_penalties_follow_openai_formula(tiny):
    eng = engine(tiny, "cpu")
    prompt = prompts(eng.config.vocab_size, [9], seed=9)[0]
    pres, freq = 1.5, 0.7

    def bias(step, out):
        counts = {t: out.count(t) for t in set(out)}
        return {t: -(pres + freq * c) for t, c in counts.items()}
    ref = _reference_greedy(eng, prompt, 24, bias)
    got = eng.generate(prompt, max_new_tokens=24, temperature=0, ignore_eos=True, presence_penalty=pres,
                       frequency_penalty=freq).token_ids
    assert got == ref
    plain = eng.generate(prompt, max_new_tokens=24, temperature=0, ignore_eos=True).token_ids
    assert len(set(got)) > len(set(plain))  # the penalty really changed something
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty="1"), dict(min_tokens=-1), dict(logprobs=21)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            eng.generate(prompt, **bad)
    eng.close()


def test_min_tokens_bans_stop_tokens_until_reached(tiny):
    eng = engine(tiny, "cpu")
    prompt = prompts(eng.config.vocab_size, [6], seed=10)[0]
    first = eng.generate(prompt, max_new_tokens=1, temperature=0, ignore_eos=True).token_ids[0]
    early = eng.generate(prompt, max_new_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[first])
    assert early.token_ids == [first] and early.finish_reason == "stop"
    ref = _reference_greedy(eng, prompt, 4, lambda step, out: {first: -np.inf} if step < 4 else {})
    late = eng.generate(prompt, max_new_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[first],
                        min_tokens=4)
    assert late.token_ids[:4] == ref and first not in late.token_ids[:4] and len(late.token_ids) > 4
    eng.close()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_log_softmax_of_the_sampled_logits(tiny, temperature):
    eng = engine(tiny, "cpu")
    prompt = prompts(eng.config.vocab_size, [7], seed=11)[0]
    r = eng.generate(prompt, max_new_tokens=6, temperature=temperature, seed=3, ignore_eos=True, logprobs=5)
    assert len(r.logprobs) == len(r.token_ids) == 6
    logits = eng.score(prompt + r.token_ids)
    for i, (tok, entry) in enumerate(zip(r.token_ids, r.logprobs)):
        ref = _log_softmax(logits[len(prompt) - 1 + i] / (temperature or 1.0))
        assert entry["token_id"] == tok
        assert entry["logprob"] == pytest.approx(ref[tok], abs=1e-4)
        top = entry["top"]
        assert [t for t, _ in top] == list(np.argsort(-ref, kind="stable")[:5])
        assert [lp for _, lp in top] == sorted([lp for _, lp in top], reverse=True)
        if temperature == 0:
            assert top[0][0] == tok
    chunks = list(eng.stream(prompt, max_new_tokens=6, temperature=temperature, seed=3, ignore_eos=True, logprobs=0))
    streamed = [e for c in chunks for e in (c.logprobs or [])]
    assert [e["token_id"] for e in streamed] == r.token_ids and all(e["top"] == [] for e in streamed)
    assert eng.generate(prompt, max_new_tokens=2).logprobs is None
    eng.close()
