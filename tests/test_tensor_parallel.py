"""Tensor parallelism (issue 30) end to end: an Engine whose model is split over N ranks computes what the
whole model computes. On the CPU the ranks are threads with the in-process group (what CI runs); marked
`cuda`, the same checks on 2 and 4 GPUs over NCCL. The reference is the same engine at N = 1 (itself
checked against HF transformers in tests/test_arch_*.py), and HF itself for the f32 logits.

Also: the settings that cannot split raise before any weight is read; a rank that fails or stalls breaks
the group and fails the engine within its timeout, with an error naming the rank, and /health turns 503."""
import re
import time

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import arch_check  # noqa: E402
import llaisys  # noqa: E402
from llaisys.engine import Engine  # noqa: E402

VOCAB = 416  # divides by 2 and 4 (the LM head's rows split evenly)
# 8 query heads, 2 KV heads (split at 2 ranks, replicated at 4), head_dim 8, MLP 136
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
FAMILIES = {
    "qwen2": {}, "llama-biases": dict(attention_bias=True, mlp_bias=True), "llama-tied": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=8), "mistral": {}, "gemma3": dict(head_dim=8),
    "gpt_neox": dict(num_key_value_heads=8),  # no GQA: kv = heads
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> a tiny random checkpoint of it (made once per module)."""
    made = {}

    def get(name):
        if name not in made:
            family = name.split("-")[0]
            made[name] = arch_check.make_tiny(tmp_path_factory.mktemp(name), family, seed=5,
                                              **{**SHAPE, **FAMILIES[name]})
        return made[name]
    return get


GPU_TOO = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]  # on 2 GPUs over NCCL as well (issue 30's GPU list)


def need_gpus(device, n=2):
    if device == "cuda" and (llaisys.cuda_device_count() < n or not llaisys.build_info()["nccl"]):
        pytest.skip(f"needs {n} GPUs and a build with NCCL")


def run(path, tp, device="cpu", dtype="f32", prompts=None, **settings):
    """(greedy tokens of three prompts batched, their seeded samples, teacher-forced logits of one)."""
    prompts = prompts or [arch_check.prompt(VOCAB, k, seed=k) for k in (5, 17, 30)]
    with Engine(path, device=device, dtype=dtype, progress=False, tensor_parallel_size=tp, **settings) as eng:
        greedy = [r.token_ids for r in eng.generate(prompts, max_new_tokens=24, temperature=0, ignore_eos=True)]
        sampled = [r.token_ids for r in eng.generate(prompts, max_new_tokens=16, temperature=0.8, top_p=0.9,
                                                     seed=[1, 2, 3], ignore_eos=True)]
        logits = eng.score(prompts[1])
        assert eng.describe()["tensor_parallel_size"] == tp
    return greedy, sampled, logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_ranks_equal_one_in_f32(tiny, family):
    path = tiny(family)
    g1, s1, l1 = run(path, 1)
    g2, s2, l2 = run(path, 2)
    assert g2 == g1
    assert s2 == s1
    np.testing.assert_allclose(l2, l1, rtol=0, atol=1e-4 * np.abs(l1).max())


def test_prompt_chunks_without_the_lm_head_at_two_ranks(tiny):
    """A step budget of 8: a 70-token prompt alone runs 8 chunks without the LM head (HostBatch::logits False),
    which every rank must skip together (the split LM head's gather is a collective), then decodes; and batched
    with a second prompt. Tokens and logprobs equal one rank's and the unchunked run's."""
    path = tiny("qwen2")
    p, q = arch_check.prompt(VOCAB, 70, seed=3), arch_check.prompt(VOCAB, 50, seed=4)
    out = {}
    for tp in (1, 2):
        for budget in (8, 4096):
            with Engine(path, device="cpu", dtype="f32", progress=False, tensor_parallel_size=tp,
                        max_num_batched_tokens=budget, max_prefill_chunk=min(budget, 8)) as eng:
                a = eng.generate(p, max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
                b = eng.generate([p, q], max_new_tokens=8, temperature=0, ignore_eos=True)
                out[(tp, budget)] = (a.token_ids, [e["logprob"] for e in a.logprobs], [r.token_ids for r in b])
    ref = out[(1, 4096)]
    for key, (tokens, lps, batched) in out.items():
        assert tokens == ref[0] and batched == ref[2], key
        np.testing.assert_allclose(lps, ref[1], rtol=0, atol=1e-4, err_msg=str(key))


@pytest.mark.parametrize("family", ["gemma3", "gpt_neox", "qwen2"])
def test_two_fused_ranks_equal_one(tiny, family):
    """Fused projections (CUDA's default) at two ranks: each rank's [gate; up] matrix (SwiGLU, and GeGLU's since
    it fuses too) stacks its own gate rows over its own up rows; GPT-NeoX's GELU runs inside each rank's cut of
    the up projection."""
    path = tiny(family)
    g1, s1, l1 = run(path, 1)
    g2, s2, l2 = run(path, 2, fused_projections=True)
    assert (g2, s2) == (g1, s1)
    np.testing.assert_allclose(l2, l1, rtol=0, atol=1e-4 * np.abs(l1).max())


@pytest.mark.parametrize("family", ["llama-tied", "qwen2"])
def test_four_ranks_with_replicated_kv_heads_equal_one(tiny, family):
    path = tiny(family)  # 2 KV heads over 4 ranks: each KV head on two ranks
    g1, s1, l1 = run(path, 1)
    g4, s4, l4 = run(path, 4)
    assert (g4, s4) == (g1, s1)
    np.testing.assert_allclose(l4, l1, rtol=0, atol=1e-4 * np.abs(l1).max())


def test_split_logits_equal_hf(tiny):
    arch_check_path = tiny("llama-biases")
    import torch

    hf = arch_check.hf_model(arch_check_path)
    ids = arch_check.prompt(VOCAB, 33, seed=2)
    with Engine(arch_check_path, device="cpu", dtype="f32", progress=False, tensor_parallel_size=2) as eng:
        got = eng.score(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().numpy()
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4


def test_bf16_two_ranks_agree_with_one(tiny):
    """bf16: the all-reduce rounds partial sums once more, so logits are close, not equal (the bf16 rule)."""
    path = tiny("qwen2")
    _, _, l1 = run(path, 1, dtype="bf16")
    _, _, l2 = run(path, 2, dtype="bf16")
    assert np.linalg.norm(l2 - l1) / np.linalg.norm(l1) < 2e-2


def test_gguf_file_splits_like_the_checkpoint(tiny, tmp_path):
    pytest.importorskip("gguf")
    path = arch_check.write_gguf(tiny("llama-biases"), str(tmp_path / "llama.gguf"), "llama")
    assert run(path, 2)[:2] == run(path, 1)[:2]


@pytest.mark.parametrize("device", GPU_TOO)
def test_preemption_and_prefix_cache_at_two_ranks(tiny, device):
    """A pool so small that sequences are preempted and recomputed, and prompts sharing a prefix: the
    tokens are the unsplit engine's."""
    need_gpus(device)
    path = tiny("qwen2")
    base = arch_check.prompt(VOCAB, 40, seed=9)
    prompts = [base + arch_check.prompt(VOCAB, 3, seed=s) for s in range(6)]
    kw = dict(num_kv_blocks=14, block_size=8, max_seq_len=80)
    out = {}
    for tp in (1, 2):
        with Engine(path, device=device, dtype="f32", progress=False, tensor_parallel_size=tp, **kw) as eng:
            out[tp] = [r.token_ids for r in eng.generate(prompts, max_new_tokens=20, temperature=0, ignore_eos=True)]
            stats = eng.stats()
        assert stats["preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0, stats
    assert out[2] == out[1]


def test_settings_that_cannot_split_raise_before_any_weight_is_read(tiny, monkeypatch):
    path = tiny("qwen2")
    monkeypatch.setattr(Engine, "_load_weights", lambda *a: pytest.fail("weights read before the check"))
    with pytest.raises(ValueError, match="num_attention_heads 8 is not a multiple of tensor_parallel_size 3"):
        Engine(path, device="cpu", progress=False, tensor_parallel_size=3)
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size must be"):
            Engine(path, device="cpu", progress=False, tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="tp_timeout_s"):
        Engine(path, device="cpu", progress=False, tensor_parallel_size=2, tp_timeout_s=0)
    if not llaisys.build_info()["cuda"]:
        with pytest.raises(RuntimeError, match="no CUDA backend"):
            Engine(path, device="cuda", progress=False, tensor_parallel_size=2)
    elif llaisys.cuda_device_count() < 64:
        with pytest.raises(ValueError, match="needs GPUs 0..63"):
            Engine(path, device="cuda", progress=False, tensor_parallel_size=64)


@pytest.mark.parametrize("device", GPU_TOO)
@pytest.mark.parametrize("mode", ["raise", "stall"])
def test_a_rank_that_fails_or_stalls_fails_the_engine_within_the_timeout(tiny, mode, device):
    need_gpus(device)
    path = tiny("qwen2")
    ids = arch_check.prompt(VOCAB, 9, seed=1)
    with Engine(path, device=device, dtype="f32", progress=False, tensor_parallel_size=2, tp_timeout_s=3) as eng:
        assert eng.generate(ids, max_new_tokens=4, temperature=0).token_ids  # healthy first
        assert eng.failure is None
        eng._core.runner.runner.inject_fault(1, mode)
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="rank.* 1"):
            eng.generate(ids, max_new_tokens=4, temperature=0)
        assert time.monotonic() - t < 3 + 12  # the timeout, and the abort's grace at most
        assert "rank" in eng.failure
        with pytest.raises(RuntimeError):  # nothing runs after: a clear error, not a hang
            eng.generate(ids, max_new_tokens=2, temperature=0)


def test_a_rank_left_behind_keeps_its_runner_for_good(tiny, capsys):
    """A rank that never returns from its call, not even on the group's abort (a driver call that hangs): the
    engine fails within the timeout and its grace, and at close the group's runners, models and KV pools are
    kept for the process's life (ranks._LEFT_BEHIND, with a line saying so) rather than freed under a thread
    that may still return into them."""
    from llaisys.engine import ranks

    path = tiny("qwen2")
    ids = arch_check.prompt(VOCAB, 9, seed=1)
    kept = len(ranks._LEFT_BEHIND)
    eng = Engine(path, device="cpu", dtype="f32", progress=False, tensor_parallel_size=2, tp_timeout_s=1)
    group = eng._core.runner.runner
    assert eng.generate(ids, max_new_tokens=3, temperature=0).token_ids and group.left_behind == 0
    group.inject_fault(1, "hang")
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="rank.* 1"):
        eng.generate(ids, max_new_tokens=3, temperature=0)
    assert time.monotonic() - t < 1 + 10 + 5  # the timeout, the abort's grace (10 s), slack
    assert group.left_behind == 1
    eng.close()
    assert len(ranks._LEFT_BEHIND) == kept + 1 and ranks._LEFT_BEHIND[-1][0] is not None
    assert "1 rank(s) of the broken tensor-parallel group never returned" in capsys.readouterr().err


@pytest.mark.parametrize("device", GPU_TOO)
def test_server_health_turns_503_when_the_group_breaks(tiny, device):
    need_gpus(device)
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from llaisys.server.app import create_app

    path = tiny("qwen2")
    with Engine(path, device=device, dtype="f32", progress=False, tensor_parallel_size=2, tp_timeout_s=2) as eng:
        with TestClient(create_app(eng, model_name="tiny")) as client:
            assert client.get("/health").status_code == 200
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
            eng._core.runner.runner.inject_fault(0, "raise")
            r = client.post("/v1/completions", json=body)
            assert r.status_code >= 500 and "rank 0" in r.text
            health = client.get("/health")
            assert health.status_code == 503 and "rank 0" in health.text


@pytest.mark.cuda
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["qwen2", "llama-tied", "gpt_neox"])
def test_gpus_equal_one_gpu(tiny, family, tp):
    need_gpus("cuda", tp)
    path = tiny(family)
    g1, s1, l1 = run(path, 1, device="cuda")
    g2, s2, l2 = run(path, tp, device="cuda")
    assert (g2, s2) == (g1, s1)
    np.testing.assert_allclose(l2, l1, rtol=0, atol=1e-4 * np.abs(l1).max())
    _, _, h1 = run(path, 1, device="cuda", dtype="bf16")  # bf16 within the tie rules: logits close
    _, _, h2 = run(path, tp, device="cuda", dtype="bf16")
    assert np.linalg.norm(h2 - h1) / np.linalg.norm(h1) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("tp", [2, 4])
def test_gpus_chained_steps_equal_one_gpu(tiny, tp):
    """Chained steps at 2 and 4 GPUs, by default (CUDA graphs with NCCL inside, chained on each rank's stream):
    the one-GPU tokens, most decode steps chained."""
    need_gpus("cuda", tp)
    path = tiny("qwen2")
    g1, s1, _ = run(path, 1, device="cuda")
    prompts = [arch_check.prompt(VOCAB, k, seed=k) for k in (5, 17, 30)]
    with Engine(path, device="cuda", dtype="f32", progress=False, tensor_parallel_size=tp, tp_timeout_s=30) as eng:
        g2 = [r.token_ids for r in eng.generate(prompts, max_new_tokens=24, temperature=0, ignore_eos=True)]
        s2 = [r.token_ids for r in eng.generate(prompts, max_new_tokens=16, temperature=0.8, top_p=0.9,
                                                seed=[1, 2, 3], ignore_eos=True)]
        assert eng.stats()["overlapped_steps"] > 20 and eng.failure is None
    assert (g2, s2) == (g1, s1)


@pytest.mark.cuda
def test_gpus_batched_equal_alone_and_a_stalled_rank_fails(tiny):
    need_gpus("cuda")
    path = tiny("qwen2")
    prompts = [arch_check.prompt(VOCAB, k, seed=k) for k in (3, 11, 19, 27)]
    with Engine(path, device="cuda", dtype="f32", progress=False, tensor_parallel_size=2, tp_timeout_s=5) as eng:
        batched = [r.token_ids for r in eng.generate(prompts, max_new_tokens=30, temperature=0, ignore_eos=True)]
        alone = [eng.generate(p, max_new_tokens=30, temperature=0, ignore_eos=True).token_ids for p in prompts]
        assert batched == alone
        assert eng.stats()["overlapped_steps"] > 0  # chained by default: the stall below hits a chained group
        eng._core.runner.runner.inject_fault(1, "stall")
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="rank.* 1"):
            eng.generate(prompts[0], max_new_tokens=8, temperature=0, ignore_eos=True)
        assert time.monotonic() - t < 5 + 12


def test_quantized_gguf_blocks_split_along_whole_blocks(tmp_path):
    """A Q8_0 file kept quantized: o and down are cut along whole 32-column blocks; a cut that would fall
    inside a block is kept dense (tests/test_kquant_shards.py checks its values and its log line)."""
    pytest.importorskip("gguf")
    from tiny_model import write_tiny_gguf

    def tokens(path, tp):
        with Engine(path, device="cpu", progress=False, tensor_parallel_size=tp) as eng:
            assert eng.describe()["quantized"]
            prompts = [arch_check.prompt(VOCAB, k, seed=k) for k in (4, 19)]
            return [r.token_ids for r in eng.generate(prompts, max_new_tokens=16, temperature=0, ignore_eos=True)]

    hf = arch_check.make_tiny(tmp_path / "hf", "qwen2", seed=6, **SHAPE, intermediate_size=128)
    path = write_tiny_gguf(hf, tmp_path / "q8.gguf", qtype="Q8_0")
    assert tokens(path, 2) == tokens(path, 1)
    hf = arch_check.make_tiny(tmp_path / "hf96", "qwen2", seed=6, **SHAPE, intermediate_size=96)
    path = write_tiny_gguf(hf, tmp_path / "q8-96.gguf", qtype="Q8_0")  # 48 columns a rank: 1.5 blocks
    with Engine(path, device="cpu", progress=False, tensor_parallel_size=2) as eng:
        formats = {name: fmt for name, fmt, _ in eng._model.weight_formats() if name.endswith("_proj.weight")}
        assert eng.generate(arch_check.prompt(VOCAB, 5, seed=1), max_new_tokens=4, temperature=0).token_ids
    assert {f for n, f in formats.items() if "down_proj" in n} == {"f32"}
    assert {f for n, f in formats.items() if "down_proj" not in n} == {"q8_0"}


@pytest.mark.parametrize("device", GPU_TOO)
def test_windowed_generation_and_logprobs_at_two_ranks(tiny, device):
    """StreamingLLM's evictions (the K-shift runs on every rank's KV heads) and logprobs (from rank 0's
    gathered logits) are the unsplit engine's."""
    need_gpus(device)
    path = tiny("llama-biases")
    ids = arch_check.prompt(VOCAB, 20, seed=7)
    out = {}
    for tp in (1, 2):
        with Engine(path, device=device, dtype="f32", progress=False, tensor_parallel_size=tp, block_size=8) as eng:
            w = eng.generate(ids, max_new_tokens=60, temperature=0, ignore_eos=True, kv_window=24, sink_tokens=4)
            lp = eng.generate(ids, max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
            out[tp] = (w.token_ids, lp.token_ids, [round(x["logprob"], 4) for x in lp.logprobs])
            assert eng.stats()["kv_blocks_evicted"] > 0
    assert out[2] == out[1]


@pytest.mark.parametrize("device", GPU_TOO)
def test_llaisys_serve_with_two_ranks_answers_the_openai_client(tiny, tmp_path, device):
    """`llaisys serve --tensor-parallel-size 2` (the engine in its own process, split over 2 CPU ranks or 2
    GPUs) answers the official openai client with the unsplit engine's text."""
    need_gpus(device)
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from utils import llaisys_server

    path = tiny("qwen2")
    args = ["--model", path, "--device", device, "--dtype", "f32", "--max-seq-len", "256", "--tensor-parallel-size",
            "2", "--served-model-name", "tiny"]
    with llaisys_server(args, tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="x", max_retries=0, timeout=300)
        prompts = ["The quick brown fox", "def fibonacci(n):"]
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text
               for p in prompts]
    with Engine(path, device=device, dtype="f32", progress=False, max_seq_len=256) as eng:
        want = [r.text for r in eng.generate(prompts, max_new_tokens=12, temperature=0)]
    assert got == want


def test_rank_devices_checks_the_machine_before_loading(monkeypatch):
    """cuda:i .. cuda:i + N - 1; too few GPUs, mixed GPU kinds and a build without NCCL raise (the machine's
    answers faked: this runs without a GPU)."""
    from llaisys.engine import ranks

    kinds = ["NVIDIA H100 80GB HBM3"] * 3 + ["NVIDIA H200"]
    monkeypatch.setattr(ranks._core, "cuda_device_count", lambda: 4)
    monkeypatch.setattr(ranks._core, "cuda_device_name", lambda i: kinds[i])
    monkeypatch.setattr(ranks._core, "build_info", lambda: {"nccl": "2.28.3"})
    assert ranks.rank_devices("cuda:0", 3) == ["cuda:0", "cuda:1", "cuda:2"]
    assert ranks.rank_devices("cuda:3", 1) == ["cuda:3"]
    assert ranks.rank_devices("cpu", 2) == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="needs GPUs 2..5, but this machine shows 4"):
        ranks.rank_devices("cuda:2", 4)
    with pytest.raises(ValueError, match=r"mix GPU kinds \(NVIDIA H100 80GB HBM3, NVIDIA H200\)"):
        ranks.rank_devices("cuda:2", 2)
    monkeypatch.setattr(ranks._core, "build_info", lambda: {"nccl": None})
    with pytest.raises(RuntimeError, match="needs NCCL"):
        ranks.rank_devices("cuda:0", 2)
    assert ranks.rank_devices("cuda:0", 1) == ["cuda:0"]  # one GPU needs no NCCL


@pytest.mark.parametrize("device", GPU_TOO)
def test_constrained_rows_at_two_ranks(tmp_path, device):
    """Structured output: every rank masks its gathered logits with the same bitmask, so a regex-constrained
    row gets the unsplit engine's text, beside a free row."""
    need_gpus(device)
    pytest.importorskip("llguidance")
    from tiny_model import make_tiny_qwen2

    path = make_tiny_qwen2(tmp_path, seed=4, vocab_size=VOCAB)  # EOS is a token of its tokenizer (llguidance)
    out = {}
    for tp in (1, 2):
        with Engine(path, device=device, dtype="f32", progress=False, tensor_parallel_size=tp) as eng:
            rs = eng.generate(["Order number:", "Free text"], regex=[r"[0-9]{3}-[a-z]{2,4}", None],
                              max_new_tokens=12, temperature=0, ignore_eos=True)
            out[tp] = [r.text for r in rs]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out[1][0]), out[1][0]
    assert out[2] == out[1]


@pytest.mark.parametrize("device", GPU_TOO)
def test_concurrent_callers_at_two_ranks_each_get_their_own_tokens(tiny, device):
    """Six threads submit at once to a 2-rank engine (greedy and seeded sampling mixed): each gets exactly
    the tokens its request gets alone on the unsplit engine."""
    import threading

    need_gpus(device)
    path = tiny("qwen2")
    jobs = [(arch_check.prompt(VOCAB, 6 + 5 * i, seed=20 + i), dict(temperature=0.9 if i % 2 else 0, seed=i))
            for i in range(6)]
    with Engine(path, device=device, dtype="f32", progress=False) as eng:
        alone = [eng.generate(p, max_new_tokens=18, ignore_eos=True, **kw).token_ids for p, kw in jobs]
    got = [None] * len(jobs)
    with Engine(path, device=device, dtype="f32", progress=False, tensor_parallel_size=2) as eng:
        def run(i):
            p, kw = jobs[i]
            got[i] = eng.submit(p, max_new_tokens=18, ignore_eos=True, **kw).result().token_ids
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert got == alone


@pytest.mark.parametrize("family", ["qwen2", "gpt_neox"])
def test_chained_steps_at_two_ranks_equal_one_rank(tiny, family):
    """overlap_steps=True under tensor parallelism (issue 30): the chained decode steps of a 2-rank group give
    the unsplit engine's tokens. Before, RankGroup.finish was bound with Runner's signature: the first chained
    step's finish raised TypeError and the step loop retried it forever (what looked like a hang on 2 H100s)."""
    path = tiny(family)
    prompts = [arch_check.prompt(VOCAB, k, seed=k) for k in (5, 17, 30)]

    def go(eng):
        greedy = [r.token_ids for r in eng.generate(prompts, max_new_tokens=24, temperature=0, ignore_eos=True)]
        sampled = [r.token_ids for r in eng.generate(prompts, max_new_tokens=16, temperature=0.8, top_p=0.9,
                                                     seed=[1, 2, 3], ignore_eos=True)]
        return greedy, sampled, eng.stats()["overlapped_steps"]
    with Engine(path, device="cpu", dtype="f32", progress=False) as eng:
        g1, s1, _ = go(eng)
    with Engine(path, device="cpu", dtype="f32", progress=False, tensor_parallel_size=2, overlap_steps=True) as eng:
        g2, s2, chained = go(eng)
        assert eng.failure is None
    assert (g2, s2) == (g1, s1)
    assert chained > 20  # most decode steps ran chained
    with Engine(path, device="cpu", dtype="f32", progress=False, tensor_parallel_size=2) as eng:
        assert go(eng)[2] == 0  # not asked for: under tensor parallelism the default stays off until a GPU run
