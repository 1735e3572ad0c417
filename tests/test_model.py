"""The Qwen2 model and the Engine against HF transformers (Qwen2ForCausalLM) on tiny random checkpoints
written by transformers itself, and (on CUDA) on random weights of the real 0.5B and 1.5B shapes."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import llaisys  # noqa: E402
from llaisys import _core  # noqa: E402
from llaisys.engine import Engine  # noqa: E402
from tiny_model import make_tiny_qwen2  # noqa: E402
from utils import DEVICES  # noqa: E402


def hf_model(path, dtype=torch.float32, device="cpu"):
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return m.to(device).eval()


@torch.no_grad()
def hf_greedy(model, ids, n, processor=None):
    """Reference greedy decode with HF's KV cache; `processor` is an HF LogitsProcessor or None."""
    dev = next(model.parameters()).device
    seq = torch.tensor([ids], device=dev)
    out = model(seq, use_cache=True)
    past, result = out.past_key_values, []
    logits = out.logits[:, -1]
    for _ in range(n):
        if processor is not None:
            logits = processor(seq, logits)
        token = int(logits.argmax(-1))
        result.append(token)
        seq = torch.cat([seq, torch.tensor([[token]], device=dev)], 1)
        out = model(seq[:, -1:], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    return result


def prompt_ids(vocab, n=12, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


@pytest.fixture(scope="module", params=["untied", "tied", "sharded"])
def tiny(request, tmp_path_factory):
    kwargs = {"untied": {}, "tied": {"tie": True}, "sharded": {"shards": 3}}[request.param]
    return make_tiny_qwen2(tmp_path_factory.mktemp(request.param), seed=7, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_f32_greedy_equals_hf(tiny, device):
    hf = hf_model(tiny, device="cuda" if device == "cuda" else "cpu")
    eng = Engine(tiny, device=device, dtype="f32", progress=False)
    ids = prompt_ids(eng.config.vocab_size)
    ref = hf_greedy(hf, ids, 64)
    out = eng.generate(ids, max_new_tokens=64, temperature=0, ignore_eos=True)
    assert out.token_ids == ref
    assert out.finish_reason == "length"
    assert out.usage == {"prompt_tokens": 12, "completion_tokens": 64, "cached_tokens": 0}


@pytest.mark.parametrize("device", DEVICES)
def test_f32_logits_match_hf(tiny, device):
    hf = hf_model(tiny)
    eng = Engine(tiny, device=device, dtype="f32", progress=False)
    ids = prompt_ids(eng.config.vocab_size, 40, seed=3)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().numpy()
    got = eng.score(ids)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_half_precision_logits_close_to_f32_reference(tiny, device, dtype):
    hf = hf_model(tiny)
    eng = Engine(tiny, device=device, dtype=dtype, progress=False)
    ids = prompt_ids(eng.config.vocab_size, 40, seed=4)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().numpy()
    got = eng.score(ids)
    # Weights and activations rounded to 8 (bf16) or 11 (f16) mantissa bits through 2 layers: the error is
    # a few ulps of the activations' scale, far above f32's; the relative L2 error stays at the percent level.
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < (3e-2 if dtype == "bf16" else 5e-3), err


class _Paged:
    """A _core.Qwen2 run by the runtime as the engine runs it (a KVPool and a Runner), with the block tables
    kept by hand so a test can say which sequence gets which tokens: sequence i owns the blocks
    1 + i * per_seq .. (block 0 is reserved). forward() appends tokens to sequences and returns the logits
    (Runner.logits); sample() appends them and returns one token each (Runner.step: penalties, sampling,
    the CUDA graphs of decode batches); truncate() forgets a sequence's positions from `length` on."""

    BLOCK = 16

    def __init__(self, model, config: dict, num_seqs: int = 2, max_seq_len: int = 128):
        self.model, self.per_seq = model, max_seq_len // self.BLOCK
        self.pool = _core.KVPool(config["num_hidden_layers"], 1 + num_seqs * self.per_seq, self.BLOCK,
                                 config["num_key_value_heads"], config["head_dim"], model.dtype, model.device)
        self.runner = _core.Runner(model, self.pool, [1, 2], self.per_seq, True)
        self.lengths = [0] * num_seqs

    def _table(self, s):
        return [1 + s * self.per_seq + j for j in range(self.per_seq)]

    def _arrays(self, seqs, tokens):
        ids, pos, slots, q_start, kv_len = [], [], [], [0], []
        for s, toks in zip(seqs, tokens):
            start, table = self.lengths[s], self._table(s)
            for p, t in enumerate(toks, start):
                ids.append(t)
                pos.append(p)
                slots.append(table[p // self.BLOCK] * self.BLOCK + p % self.BLOCK)
            q_start.append(q_start[-1] + len(toks))
            kv_len.append(start + len(toks))
        return (np.array(ids, np.int64), np.array(pos, np.int64), np.array(slots, np.int64),
                np.array(q_start, np.int32), np.array(kv_len, np.int32),
                np.array([self._table(s) for s in seqs], np.int32))

    def _advance(self, seqs, tokens):
        for s, toks in zip(seqs, tokens):
            self.lengths[s] += len(toks)

    def forward(self, seqs, tokens, all_logits=False):
        logits = self.runner.logits(*self._arrays(seqs, tokens), all_logits)
        self._advance(seqs, tokens)
        return logits

    def sample(self, seqs, tokens, temperature=0.0, top_k=0, seed=0, step=0):
        B, arrays = len(seqs), self._arrays(seqs, tokens)
        try:
            return list(self.runner.step(
                *arrays, np.full(B, temperature, np.float32), np.full(B, top_k, np.int32), np.ones(B, np.float32),
                np.zeros(B, np.float32), np.ones(B, np.float32), np.full(B, seed, np.uint64),
                np.full(B, step, np.uint64), np.full(B, -1, np.int32), [], []))
        finally:  # a step that fails while sampling has written its keys/values, as any step
            self._advance(seqs, tokens)

    def truncate(self, s, length):
        self.lengths[s] = length


def _core_model(eng, path, device, dtype, fused, skip=()):
    from llaisys import loader

    m = _core.create_model(eng.config.core, dtype, device if device == "cpu" else "cuda:0", fused=fused)
    for name, w in loader.load(path, progress=False).weights.items():
        if name not in skip:
            m.load_weight(name, llaisys.tensor(np.array(w)))  # a writable copy of the mapped weight
    return m


@pytest.mark.parametrize("device", DEVICES)
def test_several_sequences_in_one_step_equal_separate_runs(tiny, device):
    eng = Engine(tiny, device=device, dtype="f32", progress=False)
    m = _Paged(_core_model(eng, tiny, device, "f32", None), eng.config.core)
    a, b = prompt_ids(eng.config.vocab_size, 9, 1), prompt_ids(eng.config.vocab_size, 4, 2)
    both = m.forward([0, 1], [a, b]).to("cpu").numpy()
    m.truncate(0, 0)
    m.truncate(1, 0)
    only_b = m.forward([1], [b]).to("cpu").numpy()
    only_a = m.forward([0], [a]).to("cpu").numpy()
    np.testing.assert_allclose(both[0], only_a[0], atol=1e-5)
    np.testing.assert_allclose(both[1], only_b[0], atol=1e-5)
    # a decode step for both sequences at once, with different context lengths
    step = m.forward([0, 1], [[5], [6]]).to("cpu").numpy()
    m.truncate(0, 9)
    np.testing.assert_allclose(m.forward([0], [[5]]).to("cpu").numpy()[0], step[0], atol=1e-5)


@pytest.mark.cuda
def test_first_step_under_a_graph_capture_raises_and_the_model_stays_usable(tiny):
    """The first step after loading synchronizes once (the weights are constant from then on), which a graph
    capture cannot hold: it raises a clear error, and the model then runs as if nothing happened."""
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False)
    m, fresh = (_Paged(_core_model(eng, tiny, "cuda", "f32", True), eng.config.core) for _ in range(2))
    ids = prompt_ids(eng.config.vocab_size, 5, 3)
    stream = llaisys.current_stream("cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="model: the first step after load_weight .* cannot be captured"):
        with torch.cuda.graph(graph, stream=torch.cuda.ExternalStream(stream.handle)):
            m.forward([0], [ids])
    got = torch.from_dlpack(m.forward([0], [ids])).cpu()
    want = torch.from_dlpack(fresh.forward([0], [ids])).cpu()
    assert torch.equal(got, want)


@pytest.mark.cuda
def test_reloaded_weights_are_not_replayed_from_an_old_graph(tiny):
    """A captured decode graph holds the weights' addresses: after load_weight the Runner captures anew, so
    the next decode uses the new weights (as a model loaded with them from the start does)."""
    from llaisys import loader

    eng = Engine(tiny, device="cpu", dtype="f32", progress=False)
    m, fresh = (_Paged(_core_model(eng, tiny, "cuda", "f32", False), eng.config.core) for _ in range(2))
    ids = prompt_ids(eng.config.vocab_size, 6, 4)
    name = "model.layers.0.mlp.down_proj.weight"
    new = 3 * np.array(loader.load(tiny, progress=False).weights[name])
    m.sample([0], [ids])
    m.sample([0], [[5]], step=1)  # a decode: captures the graph of batch size 1
    assert m.runner.captured_batch_sizes == [1]
    m.model.load_weight(name, llaisys.tensor(new))  # a new buffer (unfused): the graph's address is stale
    fresh.model.load_weight(name, llaisys.tensor(new))
    m.truncate(0, 0)  # the prompt again, with the new weights in both
    assert m.sample([0], [ids]) == fresh.sample([0], [ids])
    for step, feed in enumerate([5, 6, 7], 1):
        assert m.sample([0], [[feed]], step=step) == fresh.sample([0], [[feed]], step=step)
        assert torch.equal(torch.from_dlpack(m.runner.last_logits()).cpu(),
                           torch.from_dlpack(fresh.runner.last_logits()).cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_fused_projections_equal_unfused(tiny, device, dtype):
    """One q/k/v GEMV + rope_qkv_cache and the gate/up GEMV with SwiGLU against the separate ops: bit for
    bit on the CPU (same sums in the same order); on CUDA the fused GEMV may split its sums differently,
    so close (f32) and top-1 equal. Covers prefill of two sequences in one step and graphed decode."""
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False)
    fused, plain = (_Paged(_core_model(eng, tiny, device, dtype, f), eng.config.core) for f in (True, False))
    assert fused.model.fused_projections and not plain.model.fused_projections
    a, b = prompt_ids(eng.config.vocab_size, 9, 1), prompt_ids(eng.config.vocab_size, 4, 2)
    to_np = lambda t: torch.from_dlpack(t).double().cpu().numpy()  # noqa: E731
    got = [to_np(m.forward([0, 1], [a, b], all_logits=True)) for m in (fused, plain)]
    toks = [[], []]
    for i, m in enumerate((fused, plain)):
        feed = [a[-1]]
        m.truncate(0, len(a) - 1)  # decode one sequence from its prefix (the graphed path on CUDA)
        for step in range(12):
            feed = m.sample([0], [feed], step=step)
            toks[i].append(feed[0])
    if device == "cpu":
        np.testing.assert_array_equal(got[0], got[1])
    else:
        tol = 1e-5 if dtype == "f32" else 2e-2
        assert _rel_err(got[0], got[1]) < tol, _rel_err(got[0], got[1])
        assert (got[0].argmax(-1) == got[1].argmax(-1)).mean() >= (1.0 if dtype == "f32" else 0.9)
    if device == "cpu" or dtype == "f32":
        assert toks[0] == toks[1]


def test_fused_model_tracks_missing_slices_and_env_switch(tiny, monkeypatch):
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False)
    name = "model.layers.1.self_attn.k_proj.bias"
    m = _core_model(eng, tiny, "cpu", "f32", True, skip=(name,))
    assert m.missing_weights() == [name]  # the fused matrix exists, the slice was never filled
    with pytest.raises(ValueError, match="not loaded"):
        _Paged(m, eng.config.core).forward([0], [[1]])
    # EngineConfig.fused_projections decides; LLAISYS_FUSED only supplies its default
    monkeypatch.setenv("LLAISYS_FUSED", "1")
    on = Engine(tiny, device="cpu", dtype="f32", progress=False)
    forced_off = Engine(tiny, device="cpu", dtype="f32", progress=False, fused_projections=False)
    monkeypatch.setenv("LLAISYS_FUSED", "0")
    off = Engine(tiny, device="cpu", dtype="f32", progress=False)
    forced_on = Engine(tiny, device="cpu", dtype="f32", progress=False, fused_projections=True)
    assert on._model.fused_projections and not off._model.fused_projections
    assert forced_on._model.fused_projections and not forced_off._model.fused_projections
    assert not eng._model.fused_projections  # the CPU default: the mapped checkpoint is used in place
    kw = dict(max_new_tokens=16, temperature=0, ignore_eos=True)
    assert on.generate("a b c", **kw).token_ids == off.generate("a b c", **kw).token_ids
    with pytest.raises(ValueError, match="fused_projections must be True, False or None"):
        Engine(tiny, device="cpu", progress=False, fused_projections=1)


def test_prefix_reuse_matches_a_fresh_engine(tiny):
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False)
    ids = prompt_ids(eng.config.vocab_size, 10, 5)
    first = eng.generate(ids, max_new_tokens=8, temperature=0, ignore_eos=True)
    follow = ids + first.token_ids + prompt_ids(eng.config.vocab_size, 5, 6)
    reused = eng.generate(follow, max_new_tokens=8, temperature=0, ignore_eos=True)
    fresh = Engine(tiny, device="cpu", dtype="f32", progress=False).generate(
        follow, max_new_tokens=8, temperature=0, ignore_eos=True)
    assert reused.token_ids == fresh.token_ids
    # the same prompt again: everything but the last token comes from the cache
    again = eng.generate(follow, max_new_tokens=8, temperature=0, ignore_eos=True)
    assert again.token_ids == fresh.token_ids


def test_repetition_penalty_matches_hf(tiny):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    hf = hf_model(tiny)
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False)
    ids = prompt_ids(eng.config.vocab_size, 8, 9)
    ref = hf_greedy(hf, ids, 32, RepetitionPenaltyLogitsProcessor(1.8))
    out = eng.generate(ids, max_new_tokens=32, temperature=0, repetition_penalty=1.8, ignore_eos=True)
    assert out.token_ids == ref
    assert ref != hf_greedy(hf, ids, 32)  # the penalty changed the output, so the test has teeth


def test_stream_equals_generate_and_seeds_reproduce(tiny):
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False)
    kw = dict(max_new_tokens=40, temperature=1.0, top_k=20, top_p=0.9, seed=123, ignore_eos=True)
    full = eng.generate("hello world", **kw)
    chunks = list(eng.stream("hello world", **kw))
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].usage["completion_tokens"] == 40 and chunks[-1].timings["ttft_s"] > 0
    assert eng.generate("hello world", **{**kw, "seed": 124}).token_ids != full.token_ids


def test_stop_strings_are_removed_and_finish_reason_is_stop(tiny):
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False)
    base = eng.generate("the cat", max_new_tokens=30, temperature=0, ignore_eos=True)
    assert len(base.text) > 6
    stop = base.text[3:6]
    cut = eng.generate("the cat", max_new_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == base.text[: base.text.index(stop)]
    streamed = "".join(c.text for c in eng.stream("the cat", max_new_tokens=30, temperature=0, ignore_eos=True,
                                                  stop=[stop]))
    assert streamed == cut.text


def test_eos_stops_generation(tiny):
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False)
    base = eng.generate("a", max_new_tokens=20, temperature=0, ignore_eos=True)
    stop_id = base.token_ids[4]
    out = eng.generate("a", max_new_tokens=20, temperature=0, stop_token_ids=[stop_id])
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_id
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]


def test_interrupted_stream_leaves_engine_usable(tiny):
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False)
    ref = eng.generate("once upon", max_new_tokens=20, temperature=0, ignore_eos=True)
    it = eng.stream("once upon a time", max_new_tokens=50, temperature=0, ignore_eos=True)
    for _ in zip(range(3), it):
        pass
    it.close()  # like a client disconnecting, or KeyboardInterrupt unwinding the loop
    assert eng.generate("once upon", max_new_tokens=20, temperature=0, ignore_eos=True).token_ids == ref.token_ids


def test_chat_uses_the_template_and_supports_multi_turn(tiny):
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False)
    msgs = [{"role": "user", "content": "hi"}]
    r1 = eng.chat(msgs, max_new_tokens=10, temperature=0, ignore_eos=True)
    msgs += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "more"}]
    r2 = eng.chat(msgs, max_new_tokens=10, temperature=0, ignore_eos=True)
    fresh = Engine(tiny, device="cpu", dtype="f32", progress=False)
    assert fresh.chat(msgs, max_new_tokens=10, temperature=0, ignore_eos=True).token_ids == r2.token_ids
    assert "".join(c.text for c in eng.chat(msgs, stream=True, max_new_tokens=10, temperature=0,
                                            ignore_eos=True)) == r2.text


@pytest.mark.parametrize("bad, err", [
    (dict(prompt=""), "empty"),
    (dict(prompt=[]), "empty"),
    (dict(prompt=[1, -3]), "position 1"),
    (dict(prompt=[10**9]), "position 0"),
    (dict(prompt=[0] * 600), "context holds"),
    (dict(prompt="x", temperature=-1.0), "temperature"),
    (dict(prompt="x", top_p=0.0), "top_p"),
    (dict(prompt="x", top_p=1.5), "top_p"),
    (dict(prompt="x", top_k=-1), "top_k"),
])
def test_bad_generate_arguments_raise_value_error(tiny, bad, err):
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False, max_seq_len=512)
    bad = dict(bad)  # the parameter dict is shared between the tiny-model variants
    prompt = bad.pop("prompt")
    with pytest.raises(ValueError, match=err):
        eng.generate(prompt, **bad)
    assert eng.generate("ok", max_new_tokens=2).usage["completion_tokens"] >= 1  # still usable


def test_bad_chat_messages_and_engine_arguments(tiny):
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False)
    with pytest.raises(ValueError, match="role"):
        eng.chat([{"content": "no role"}])
    with pytest.raises(ValueError, match="dtype"):
        Engine(tiny, device="cpu", dtype="f8", progress=False)
    with pytest.raises(ValueError, match="max_seq_len"):
        Engine(tiny, device="cpu", max_seq_len=10**9, progress=False)
    with pytest.raises(ValueError):
        Engine("no-such-model-name", progress=False)


def test_model_weight_errors_name_the_tensor(tiny):
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False)
    m = _core.create_model(eng.config.core, "f32", "cpu")
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.99.mlp.up_proj.weight'"):
        m.load_weight("model.layers.99.mlp.up_proj.weight", llaisys.zeros((1,)))
    with pytest.raises(ValueError, match="model.norm.weight' has shape"):
        m.load_weight("model.norm.weight", llaisys.zeros((3,)))
    with pytest.raises(ValueError, match="not loaded"):
        _Paged(m, eng.config.core).forward([0], [[1]])
    with pytest.raises(ValueError, match="not loaded"):
        m.prepare()
    with pytest.raises(TypeError):
        _core.create_model(eng.config.core, "f32", "cpu", fused=1)  # a bool or None


def test_runner_refuses_token_ids_outside_the_vocabulary(tiny):
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False)
    m = _Paged(_core_model(eng, tiny, "cpu", "f32", None), eng.config.core)
    vocab = eng.config.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(IndexError, match=rf"Runner: token id {bad} out of range \[0, {vocab}\)"):
            m.forward([0], [[1, bad]])
    assert tuple(m.forward([0], [[1, vocab - 1]]).shape) == (1, vocab)  # the refused steps left nothing behind


# ---- CUDA: random weights of the real shapes, same weights in HF (zero-copy through DLPack) -------------

def _ours_from_hf(hf, shape: str, dtype: str):
    from llaisys_bench.shapes import SHAPES

    from llaisys.loader.config import ModelConfig

    c = ModelConfig.from_hf({"model_type": "qwen2", **SHAPES[shape]}, f"{shape} shape").core
    ours = _core.create_model(c, dtype, "cuda:0")
    for name, p in hf.state_dict().items():
        ours.load_weight(name, llaisys.from_dlpack(p.detach().contiguous()))
    return _Paged(ours, c, num_seqs=1, max_seq_len=512)


def _rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.cuda
@pytest.mark.parametrize("shape", ["qwen2-0.5b", "qwen2-1.5b"])
def test_real_shapes_against_hf_on_cuda(shape):
    """Random weights of the real shape: f32 greedy equals HF; in bf16 our logits are as close to the f32
    reference as HF's own bf16 model is (teacher forcing over 300 positions)."""
    from llaisys_bench.shapes import SHAPES

    cfg = transformers.Qwen2Config(**SHAPES[shape], attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg).to("cuda").eval()
    ours = _ours_from_hf(hf, shape, "f32")
    ids = prompt_ids(151936, 16, 11)
    ref = hf_greedy(hf, ids, 32)
    got, feed = [], ids
    for step in range(32):
        tok = ours.sample([0], [feed], step=step)[0]
        got.append(tok)
        feed = [tok]
    assert got == ref
    seq = prompt_ids(151936, 300, 12)
    with torch.no_grad():
        ref32 = hf(torch.tensor([seq], device="cuda")).logits[0].double().cpu().numpy()
        del ours
        hf = hf.to(torch.bfloat16)
        hf_bf = hf(torch.tensor([seq], device="cuda")).logits[0].double().cpu().numpy()
    ours = _ours_from_hf(hf, shape, "bf16")
    ours_bf = torch.from_dlpack(ours.forward([0], [seq], all_logits=True)).double().cpu().numpy()
    err_hf, err_ours = _rel_err(hf_bf, ref32), _rel_err(ours_bf, ref32)
    assert err_ours <= 1.5 * err_hf + 1e-3, (err_ours, err_hf)
    assert (ours_bf.argmax(-1) == hf_bf.argmax(-1)).mean() >= (hf_bf.argmax(-1) == ref32.argmax(-1)).mean() - 0.05


def test_review_regressions(tiny):
    """ignore_eos keeps explicit stop ids; chat checks the context; a paused stream resumes with its own
    text after another call ran (the batched engine keeps both sequences)."""
    eng = Engine(tiny, device="cpu", dtype="f32", progress=False, max_seq_len=64)
    base = eng.generate("a", max_new_tokens=20, temperature=0, ignore_eos=True)
    t = base.token_ids[3]
    out = eng.generate("a", max_new_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[t])
    assert out.finish_reason == "stop" and out.token_ids[-1] == t
    with pytest.raises(ValueError, match="context holds"):
        eng.chat([{"role": "user", "content": "word " * 200}])
    alone = eng.generate("the quick brown", max_new_tokens=8, temperature=0, ignore_eos=True).token_ids
    a = eng.stream("the quick brown", max_new_tokens=8, temperature=0, ignore_eos=True)
    first = next(a)
    eng.generate("other", max_new_tokens=2)
    assert first.token_ids + [t for c in a for t in c.token_ids] == alone
    assert eng.generate("a", max_new_tokens=20, temperature=0, ignore_eos=True).token_ids == base.token_ids


def _nan_checkpoint(dirpath, name, rows=None):
    """The tiny untied checkpoint with weight `name` (only `rows` of it, if given) set to NaN."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_qwen2(dirpath, seed=7)
    file = f"{path}/model.safetensors"
    weights = load_file(file)
    weights[name][slice(None) if rows is None else rows] = float("nan")
    save_file(weights, file, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_non_finite_logits_raise_naming_the_step(tmp_path, device, dtype):
    """NaN logits never become tokens (they used to come out as token 0): a Runner step raises naming the
    request's step and the row, greedy or sampled, on the CUDA-graph decode path too. Feeding the token whose
    embedding row is NaN makes only that step's logits NaN."""
    bad = 9
    path = _nan_checkpoint(tmp_path, "model.embed_tokens.weight", rows=bad)
    eng = Engine(path, device="cpu", dtype="f32", progress=False)
    m = _Paged(_core_model(eng, path, device, dtype, None), eng.config.core)
    prompt = [t for t in prompt_ids(eng.config.vocab_size, 8, 5) if t != bad]
    for temperature in [0.0, 0.8]:
        kw = dict(temperature=temperature, top_k=20, seed=1)
        m.truncate(0, 0)
        tokens = m.sample([0], [prompt], **kw, step=0)
        for step, feed in enumerate([5, 6], 1):  # on CUDA: capture the decode graph, then replay it
            tokens += m.sample([0], [[feed]], **kw, step=step)
        assert all(0 <= t < eng.config.vocab_size for t in tokens)
        with pytest.raises(RuntimeError, match=r"non-finite logits \(NaN or Inf\) at generation step 3 of the "
                                               r"request in row 0 of the step"):
            m.sample([0], [[bad]], **kw, step=3)  # a replay of the graph
        m.truncate(0, len(prompt) + 2)  # drop the NaN keys/values: the model is usable again
        assert 0 <= m.sample([0], [[7]], **kw, step=3)[0] < eng.config.vocab_size
        m.truncate(1, 0)
        with pytest.raises(RuntimeError, match=r"at generation step 4 of the request in row 1 of the step"):
            m.sample([0, 1], [[5], [bad]], **kw, step=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_engine_with_a_nan_weight_raises_instead_of_emitting_tokens(tmp_path, device, temperature):
    path = _nan_checkpoint(tmp_path, "model.norm.weight")
    eng = Engine(path, device=device, dtype="f32", progress=False)
    with pytest.raises(RuntimeError, match=r"non-finite logits \(NaN or Inf\) at generation step 0 .*\(check the "
                                           r"weights and the dtype\)"):
        eng.generate("hello", max_new_tokens=4, temperature=temperature)
    chunks = []
    with pytest.raises(RuntimeError, match="at generation step 0"):
        for chunk in eng.stream("hello", max_new_tokens=4, temperature=temperature):
            chunks.append(chunk)
    assert not any(c.token_ids for c in chunks)
