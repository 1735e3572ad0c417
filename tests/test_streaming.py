"""StreamingLLM on the paged KV cache (issue 32): attention sinks plus a rolling window, the oldest whole
non-sink blocks evicted and the kept keys turned back (kv_shift), positions taken within the cache.
References: a dense run (equal until the first eviction); for one-layer models, where a key depends on its
token and position alone, a dense forward of exactly the tokens the window holds (equal logits at every
position, GPT-NeoX's partial rotary and Llama's included); each request run alone; and the block manager's
own books (exact after thousands of evictions, prefix hits only on blocks whose keys are intact)."""
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import arch_check  # noqa: E402
from llaisys.engine.engine import Engine  # noqa: E402
from tiny_model import make_tiny_qwen2  # noqa: E402
from utils import DEVICES  # noqa: E402

BS = 8  # small blocks: many evictions in few tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("stream"), seed=11, max_position_embeddings=128)


def engine(path, device="cpu", **kw):
    kw.setdefault("num_kv_blocks", 96)
    return Engine(path, device=device, dtype=kw.pop("dtype", "f32"), progress=False,
                  max_seq_len=kw.pop("max_seq_len", 64), block_size=BS, **kw)


def prompt(n, seed=0, vocab=300):
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def check_books(eng):
    """Every block back in the pool once idle: no reference left, each free block listed once, and every
    prefix-cache entry a free cached block whose key is the one it is found by."""
    bm = eng._core.blocks
    assert bm.num_used == 0 and eng.stats()["running"] == 0
    assert not any(bm.ref[1:])
    free = list(bm.free_plain) + list(bm.free_cached)
    assert sorted(free) == list(range(1, bm.num_blocks))
    for h, b in bm.by_hash.items():
        assert bm.key[b] is not None and bm.key[b][0] == h and b in bm.free_cached


@pytest.mark.parametrize("device", DEVICES)
def test_windowed_equals_dense_until_the_first_eviction(tiny, device):
    eng = engine(tiny, device)
    p = prompt(20)
    # sinks 4 -> 1 block, window 32 -> 4 blocks, cap (1 + 4 + 1) * 8 = 48 tokens: nothing evicted before
    dense = eng.generate(p, max_new_tokens=28, temperature=0, ignore_eos=True)
    win = eng.generate(p, max_new_tokens=28, temperature=0, ignore_eos=True, kv_window=32, sink_tokens=4)
    assert win.token_ids == dense.token_ids
    assert eng.stats()["kv_blocks_evicted"] == 0
    eng.close()


GEMMA3 = dict(head_dim=32, num_attention_heads=4, num_key_value_heads=1, sliding_window=16, tie_word_embeddings=True,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "default", "rope_theta": 1e6}})


def window_context(ids, t, sinks, window):
    """The tokens a windowed cache holds when it computes token t (the policy, written out): the sink
    blocks, then what is left after evicting whole blocks while more than (sink + window + 1) blocks."""
    sink_end = -(-sinks // BS) * BS
    cap = (-(-sinks // BS) + -(-window // BS) + 1) * BS
    evicted = max(0, -(-(t + 1 - cap) // BS)) * BS
    return ids[:min(sink_end, t + 1)] + ids[sink_end + evicted:t + 1]


@pytest.mark.parametrize("family,overrides", [
    ("qwen2", {}),
    ("qwen3", {}),  # q/k norms before the rotation
    ("mistral", {}),
    ("gpt_neox", {"hidden_size": 96}),  # partial rotary 0.25 of head_dim 16: 2 of 8 pairs turn
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    ("gemma3", GEMMA3),  # a windowed layer (window 16) with its local base
    ("gemma3", {**GEMMA3, "layer_types": ["full_attention"]}),  # a global one with its own base
])
@pytest.mark.parametrize("sinks", [4, 0])
@pytest.mark.parametrize("device", DEVICES)
def test_one_layer_window_equals_a_dense_forward_of_what_it_holds(tmp_path, family, overrides, sinks, device):
    """One layer: a key is RoPE(W_k x_token) at its position, so a cache whose keys were turned back as
    blocks left it must equal the keys a fresh dense forward of the held tokens computes at positions
    0..n-1. Checked at every position through score(kv_window=...), whose chunks decode's window equals."""
    path = arch_check.make_tiny(tmp_path, family, seed=3, num_hidden_layers=1, **overrides)
    eng = engine(path, device, max_seq_len=128)
    vocab = eng.config.vocab_size
    ids = prompt(150, seed=1, vocab=vocab)
    got = eng.score(ids, kv_window=24, sink_tokens=sinks)
    assert got.shape == (150, vocab)
    assert eng.stats()["kv_blocks_evicted"] > 10
    for t in range(0, 150, 7):
        ctx = window_context(ids, t, sinks, 24)
        want = eng.score(ctx, kv_window=0)[-1]
        np.testing.assert_allclose(got[t], want, atol=2e-4, rtol=2e-4, err_msg=f"position {t}")
    check_books(eng)
    eng.close()


def record_tables(eng):
    """The largest block table a windowed sequence had after any slide (wrapped on the engine's block manager)."""
    bm, seen = eng._core.blocks, {"max": 0}
    slide = bm.slide

    def recording(seq, n, ahead=0):
        shift = slide(seq, n, ahead)
        seen["max"] = max(seen["max"], len(seq.block_table))
        return shift
    bm.slide = recording
    return seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [False, True])
def test_batched_equals_alone_with_windows_and_memory_stays_bounded(tiny, device, overlap):
    eng = engine(tiny, device, overlap_steps=overlap)
    seen = record_tables(eng)
    ps = [prompt(n, seed=n) for n in (3, 20, 45, 9)]
    kw = dict(temperature=0, ignore_eos=True, sink_tokens=4)
    windows, outs = [16, 24, 40, 0], [150, 90, 200, 30]
    alone = [eng.generate(p, max_new_tokens=n, kv_window=w, **kw).token_ids for p, w, n in zip(ps, windows, outs)]
    batched = [r.token_ids for r in eng.generate(ps, max_new_tokens=outs, kv_window=windows, **kw)]
    assert batched == alone
    assert [len(b) for b in batched] == outs
    assert seen["max"] == 1 + 40 // BS + 1  # the widest window's sinks + window + one, never more
    s_alone = eng.generate(ps[2], max_new_tokens=120, kv_window=16, temperature=0.8, seed=5).token_ids
    s_batch = eng.generate([ps[2], ps[0]], max_new_tokens=120, kv_window=16, temperature=0.8, seed=[5, 6])
    assert s_batch[0].token_ids == s_alone
    if overlap:
        assert eng.stats()["overlapped_steps"] > 0
    assert eng.stats()["kv_blocks_evicted"] > 50
    check_books(eng)
    eng.close()


def test_three_times_the_context_and_past_max_position_embeddings(tiny):
    """max_seq_len 64, max_position_embeddings 128: a windowed request runs 400 tokens (its prompt longer
    than the context too), bounded by max_new_tokens alone; a dense one still stops at the context."""
    eng = engine(tiny)
    seen = record_tables(eng)
    r = eng.generate(prompt(100, seed=4), max_new_tokens=400, temperature=0, ignore_eos=True, kv_window=20,
                     sink_tokens=5)
    assert len(r.token_ids) == 400 and r.finish_reason == "length"
    assert seen["max"] <= 1 + 3 + 1
    dense = eng.generate(prompt(10), max_new_tokens=400, temperature=0, ignore_eos=True)
    assert len(dense.token_ids) == 64 - 10
    with pytest.raises(ValueError, match="context holds 64"):
        eng.generate(prompt(100), max_new_tokens=4)
    check_books(eng)
    eng.close()


def test_pool_accounting_exact_after_thousands_of_evictions(tiny):
    """Many windowed and dense requests at once in a pool too small for them all (preemption), with the
    prefix cache sharing their common prefix: every block comes back, the books are exact."""
    eng = engine(tiny, num_kv_blocks=18, max_num_seqs=6)
    common = prompt(30, seed=9)
    ps = [common + prompt(n, seed=n) for n in (1, 5, 13, 2, 8, 21, 3, 17)]
    windows = [8, 16, 0, 8, 24, 8, 0, 16]
    outs = [2000, 1600, 20, 2400, 1200, 1800, 25, 1400]
    res = eng.generate(ps, max_new_tokens=outs, kv_window=windows, sink_tokens=3, temperature=0.7, seed=1,
                       ignore_eos=True)
    assert [len(r.token_ids) for r in res] == outs
    st = eng.stats()
    assert st["kv_blocks_evicted"] >= 1000 and st["preemptions"] > 0
    check_books(eng)
    eng.close()


def test_prefix_hits_never_find_evicted_or_turned_blocks(tiny):
    """A windowed request shares a cached prompt, evicts and turns its blocks (copies of those others hold);
    requests after it that hit the same prefix (dense and windowed) get exactly the tokens of a fresh
    engine without any cache."""
    p = prompt(30, seed=7)  # 3 full blocks shared, within the window's cap (1 + 2 + 1 blocks of 8)
    kw = dict(temperature=0, ignore_eos=True)
    fresh = engine(tiny, enable_prefix_caching=False)
    want_dense = fresh.generate(p, max_new_tokens=3, **kw).token_ids
    want_win = fresh.generate(p, max_new_tokens=80, kv_window=16, sink_tokens=4, **kw).token_ids
    fresh.close()
    eng = engine(tiny)
    bm, copies = eng._core.blocks, []
    slide = bm.slide

    def recording(seq, n, ahead=0):
        shift = slide(seq, n, ahead)
        copies.append(shift is not None and shift[0] != shift[1])
        return shift
    bm.slide = recording
    assert eng.generate(p, max_new_tokens=3, **kw).token_ids == want_dense  # registers the prompt's blocks
    for _ in range(2):
        assert eng.generate(p, max_new_tokens=80, kv_window=16, sink_tokens=4, **kw).token_ids == want_win
        assert eng.generate(p, max_new_tokens=3, **kw).token_ids == want_dense
    # two windowed requests and a dense one on the same cached blocks at once: the first to evict copies them
    both = eng.generate([p, p, p], max_new_tokens=[80, 3, 80], kv_window=[16, 0, 16], sink_tokens=4, **kw)
    assert [r.token_ids for r in both] == [want_win, want_dense, want_win]
    assert any(copies)
    assert eng.stats()["prefix_cache_hit_rate"] > 0.5
    check_books(eng)
    eng.close()


@pytest.mark.parametrize("sinks", [4, 0])
def test_a_prompt_longer_than_the_window_computes_its_sinks_and_last_window(tiny, sinks):
    """Admitted with more tokens than its cap (a long prompt, a chat past the context, a recompute after
    preemption), a windowed request computes its sink blocks and its last window only: its tokens until its
    first eviction are exactly a dense run of that shortened prompt."""
    eng = engine(tiny)
    p = prompt(300, seed=2)  # 5x the context
    sink_end = -(-sinks // BS) * BS
    short = p[:sink_end] + p[-24:]  # window 20 -> 3 blocks of 8
    kw = dict(temperature=0, ignore_eos=True)
    win = eng.generate(p, max_new_tokens=BS, kv_window=20, sink_tokens=sinks, **kw)
    assert win.token_ids == eng.generate(short, max_new_tokens=BS, kv_window=0, **kw).token_ids
    assert win.usage["prompt_tokens"] == 300
    check_books(eng)
    eng.close()


def test_bad_window_values(tiny):
    eng = engine(tiny)
    with pytest.raises(ValueError, match="kv_window must be None or an int >= 0"):
        eng.generate("hi", kv_window=-1)
    with pytest.raises(ValueError, match="sink_tokens must be None or an int >= 0"):
        eng.generate("hi", kv_window=8, sink_tokens=1.5)
    with pytest.raises(ValueError, match="lower kv_window or raise max_seq_len"):
        eng.generate("hi", kv_window=64)
    with pytest.raises(ValueError, match="lower kv_window or raise max_seq_len"):
        eng.score([1, 2, 3], kv_window=60, sink_tokens=4)
    with pytest.raises(ValueError, match="EngineConfig.kv_window must be an int >= 0"):
        engine(tiny, kv_window=-2)
    eng.close()


def test_engine_default_window(tiny):
    """EngineConfig.kv_window is the default of requests that do not choose; kv_window=0 asks for dense."""
    eng = engine(tiny, kv_window=16, sink_tokens=4)
    r = eng.generate(prompt(5), max_new_tokens=200, temperature=0, ignore_eos=True)
    assert len(r.token_ids) == 200
    assert len(eng.generate(prompt(5), max_new_tokens=200, temperature=0, ignore_eos=True, kv_window=0).token_ids) == 59
    check_books(eng)
    eng.close()


def test_server_window_extras_and_metrics(tiny):
    """kv_window / sink_tokens as request extras (past the context), bad values an OpenAI-shaped 400, and
    /metrics counting evicted blocks."""
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from llaisys.server.app import create_app

    eng = engine(tiny)
    with TestClient(create_app(eng, "tiny")) as client:
        body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 150, "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/completions", json={**body, "kv_window": 16, "sink_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 150
        assert r.json()["choices"][0]["finish_reason"] == "length"
        for bad, word in (({"kv_window": -1}, "kv_window"), ({"kv_window": 10_000}, "kv_window"),
                          ({"kv_window": 16, "sink_tokens": "x"}, "sink_tokens")):
            r = client.post("/v1/completions", json={**body, **bad})
            assert r.status_code == 400, r.text
            assert word in r.json()["error"]["message"] and r.json()["error"]["type"]
        metrics = client.get("/metrics").text
        evicted = [line for line in metrics.splitlines() if line.startswith("llaisys_kv_blocks_evicted_total ")]
        assert evicted and float(evicted[0].split()[1]) > 10
    eng.close()
