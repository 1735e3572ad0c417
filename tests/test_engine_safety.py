"""The Engine under threads, after close(), and with wrong arguments: every call either returns the answer to
its own prompt or raises a clear error; arguments are checked before any file is read."""
import threading

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import llaisys  # noqa: E402
from llaisys.engine import engine as engine_mod  # noqa: E402
from llaisys.engine import Engine  # noqa: E402
from tiny_model import make_tiny_qwen2  # noqa: E402

GREEDY = dict(max_new_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [f"{w} number {i}" for i, w in enumerate(["hello", "the quick", "def f", "café", "class Cache",
                                                      "for i in", "你好", "Numbers"] * 2)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def eng(tiny):
    return Engine(tiny, device="cpu", dtype="f32", progress=False)


@pytest.fixture(scope="module")
def expected(eng):
    out = {p: eng.generate(p, **GREEDY).token_ids for p in PROMPTS}
    assert len({tuple(ids) for ids in out.values()}) > len(PROMPTS) // 2  # answers tell prompts apart
    return out


def run_threads(target, n):
    """Start n threads together (a barrier), run target(i) in each; return results or exceptions by index."""
    barrier, out = threading.Barrier(n), [None] * n

    def body(i):
        barrier.wait()
        try:
            out[i] = target(i)
        except Exception as e:  # noqa: BLE001 (collected and checked by the test)
            out[i] = e

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_concurrent_generate_calls_each_get_their_own_answer(eng, expected):
    for _ in range(2):
        got = run_threads(lambda i: eng.generate(PROMPTS[i], **GREEDY).token_ids, len(PROMPTS))
        assert got == [expected[p] for p in PROMPTS]


def test_concurrent_chat_and_score_are_serialized(eng, expected):
    msgs = [{"role": "user", "content": "hi"}]
    chat_ref = eng.chat(msgs, **GREEDY).text
    ids = eng.tokenizer.encode("the quick brown fox")
    score_ref = eng.score(ids)

    def call(i):
        kind = i % 3
        if kind == 0:
            return eng.generate(PROMPTS[i], **GREEDY).token_ids == expected[PROMPTS[i]]
        if kind == 1:
            return eng.chat(msgs, **GREEDY).text == chat_ref
        return np.array_equal(eng.score(ids), score_ref)

    assert run_threads(call, 12) == [True] * 12


def test_streams_never_continue_on_another_call_s_context(eng, expected):
    """Streams and generates interleaved from threads: a stream ends with exactly its own text, or raises the
    clear RuntimeError if another call took the cache while it was paused; generate always answers."""
    def call(i):
        p = PROMPTS[i]
        if i % 2:
            return eng.generate(p, **GREEDY).token_ids == expected[p]
        return [t for c in eng.stream(p, **GREEDY) for t in c.token_ids] == expected[p]

    assert run_threads(call, len(PROMPTS)) == [True] * len(PROMPTS)


def test_a_paused_stream_keeps_its_own_text_while_another_thread_generates(eng, expected):
    it = eng.stream(PROMPTS[0], **GREEDY)
    first = next(it)
    t = threading.Thread(target=lambda: out.append(eng.generate(PROMPTS[1], **GREEDY).token_ids))
    out = []
    t.start()
    t.join()
    assert out == [expected[PROMPTS[1]]] and expected[PROMPTS[0]][:len(first.token_ids)] == first.token_ids
    rest = [t for c in it for t in c.token_ids]  # the batched engine runs both; neither sees the other
    assert first.token_ids + rest == expected[PROMPTS[0]]


def test_close_releases_the_model_and_later_calls_raise(tiny):
    with Engine(tiny, device="cpu", dtype="f32", progress=False) as e:
        # long enough that the step loop cannot finish it before close(): 24 tokens sometimes did (the loop
        # thread can hold the GIL for a switch interval, ~5 ms), and list(paused) then returned them
        paused = e.stream("hello", **{**GREEDY, "max_new_tokens": 480})
        next(paused)
        assert not e.closed
    assert e.closed and e._model is None
    for call in (lambda: e.generate("hi"), lambda: e.stream("hi"), lambda: e.chat([{"role": "user", "content": "x"}]),
                 lambda: e.score([1, 2]), e.reset, lambda: list(paused)):
        with pytest.raises(RuntimeError, match="engine is closed"):
            call()
    e.close()  # twice is fine


def test_the_heap_is_frozen_while_an_engine_runs_and_its_parts_freed_at_close(tiny):
    """An engine freezes the collector's heap once built (engine_args.freeze_heap: full collections then skip
    every object alive at start-up); close() thaws it, and the runner with its KV pool is freed at once by
    reference counts (no cycle holds it: a frozen cycle would never be freed, nor before a collection)."""
    import gc
    import weakref

    e = Engine(tiny, device="cpu", dtype="f32", progress=False)
    assert gc.get_freeze_count() > 0
    runner = weakref.ref(e._core.runner)
    e.generate("hello", **{**GREEDY, "max_new_tokens": 4})
    e.close()
    assert runner() is None and gc.get_freeze_count() == 0


# ---- arguments --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, given", [
    (b"Hello", "bytes"), (bytearray(b"Hi"), "bytearray"), ({"a": 1}, "dict"), (1.5, "float"), (None, "NoneType"),
    ({1, 2}, "set"), (iter([1, 2]), "list_iterator"), (np.array([1.0, 2.0]), "float64"),
])
def test_prompts_that_are_not_text_or_token_ids_raise_type_error(eng, prompt, given):
    with pytest.raises(TypeError, match=rf"prompt.*{given}"):
        eng.generate(prompt)
    with pytest.raises(TypeError, match="prompt"):
        eng.stream(prompt)


def test_token_id_sequences_of_any_kind_are_accepted(eng):
    ref = eng.generate([5, 6, 7], **GREEDY).token_ids
    for ids in ((5, 6, 7), range(5, 8), np.array([5, 6, 7], dtype=np.int32), np.array([5, 6, 7])):
        assert eng.generate(ids, **GREEDY).token_ids == ref
    assert np.array_equal(eng.score(np.array([5, 6, 7])), eng.score([5, 6, 7]))
    with pytest.raises(TypeError, match="token_ids"):
        eng.score(b"abc")


def test_a_lone_surrogate_is_not_valid_unicode(eng):
    with pytest.raises(ValueError, match=r"prompt is not valid Unicode: lone surrogate '\\udc80' at position 2"):
        eng.generate("ab\udc80c")
    with pytest.raises(ValueError, match="not valid Unicode"):
        eng.chat([{"role": "user", "content": "x\ud800"}])


@pytest.mark.parametrize("call", ["generate", "stream", "chat"])
def test_unknown_keywords_name_the_public_call_and_suggest(eng, call):
    fn = getattr(eng, call)
    arg = [{"role": "user", "content": "x"}] if call == "chat" else "x"
    with pytest.raises(TypeError, match=rf"^{call}\(\) got an unexpected keyword argument 'max_tokens'; "
                                        r"did you mean max_new_tokens\? \(sampling arguments: max_new_tokens,"):
        fn(arg, max_tokens=5)


def test_chat_flags_must_be_bool_and_stop_ids_in_the_vocab(eng):
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(TypeError, match="stream must be True or False, got 'yes'"):
        eng.chat(msgs, stream="yes")
    with pytest.raises(TypeError, match="add_generation_prompt"):
        eng.chat(msgs, add_generation_prompt=1)
    with pytest.raises(ValueError, match=r"stop_token_ids: 1000000000 is not a token id of this model"):
        eng.generate("x", stop_token_ids=[10**9])


def test_context_overflow_mentions_the_cli_flag(eng):
    with pytest.raises(ValueError, match="--max-seq-len"):
        eng.generate([1] * 600)


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything is loaded: argument errors must come first."""
    def refuse(*a, **k):
        raise AssertionError("a file was read before the arguments were checked")
    monkeypatch.setattr(engine_mod.loader, "load", refuse)
    monkeypatch.setattr(engine_mod.catalog, "resolve", refuse)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(device=None), TypeError, "device must be a str .*got NoneType"),
    (dict(device=0), TypeError, "device must be a str"),
    (dict(device="gpu"), ValueError, "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    (dict(device="cuda:x"), ValueError, "device must be"),
    (dict(dtype=None), TypeError, "dtype must be a str"),
    (dict(dtype="f8"), ValueError, "dtype must be one of"),
    (dict(dtype="f8", device=None), ValueError, "dtype"),  # dtype is checked first
    (dict(max_seq_len="4096"), TypeError, "max_seq_len must be an int"),
    (dict(max_seq_len=1.5), TypeError, "max_seq_len must be an int"),
    (dict(max_seq_len=0), ValueError, "max_seq_len must be >= 1"),
    (dict(model=None), TypeError, "model must be a str or path"),
])
def test_engine_arguments_are_checked_before_loading(no_loading, kwargs, error, match):
    kwargs = {"model": "unused", "device": "cpu", **kwargs}
    with pytest.raises(error, match=match):
        Engine(**kwargs, progress=False)


@pytest.mark.skipif(llaisys.cuda_is_available(), reason="checks the CPU-only/no-GPU error")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"], ids=["plain", "index0", "index3"])
def test_cuda_without_a_gpu_raises_before_loading(no_loading, device):
    with pytest.raises(RuntimeError, match=f"device '{device}': (this llaisys build has no CUDA|no CUDA GPU)"):
        Engine("unused", device=device, progress=False)


@pytest.mark.parametrize("dtype, device, has_blocks, expected", [
    ("auto", "cpu", True, (True, "f32")),          # the file's blocks, f32 activations
    ("auto", "cuda:0", True, (True, "bf16")),      # the blocks on CUDA too, bf16 activations
    ("quantized", "cpu", True, (True, "f32")),
    ("quantized", "cuda:0", True, (True, "bf16")),
    ("auto", "cpu", False, (False, "bf16")),       # safetensors / a GGUF without blocks: bf16
    ("auto", "cuda:1", False, (False, "bf16")),
    ("f32", "cuda:0", True, (False, "f32")),       # an explicit dtype always dequantizes
    ("bf16", "cpu", True, (False, "bf16")),
    ("f16", "cpu", False, (False, "f16")),
])
def test_weight_policy_decides_blocks_and_compute_dtype(dtype, device, has_blocks, expected):
    """The dtype decision once the file is read: a pure function, so it is tested here for CUDA too."""
    from llaisys.engine_args import weight_policy

    assert weight_policy(dtype, device, has_blocks) == expected


def test_weight_policy_quantized_needs_blocks():
    from llaisys.engine_args import weight_policy

    with pytest.raises(ValueError, match="dtype='quantized' keeps a GGUF file's quantized tensors, but m.gguf has"):
        weight_policy("quantized", "cuda:0", False, "m.gguf")


# ---- model config -----------------------------------------------------------------------------------------

GOOD_CONFIG = dict(architectures=["Qwen2ForCausalLM"], vocab_size=416, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-6, rope_theta=10000.0, eos_token_id=[1, 2], bos_token_id=0)


@pytest.mark.parametrize("change, match", [
    (dict(num_hidden_layers=2.7), "num_hidden_layers must be an integer, got 2.7"),
    (dict(hidden_size="64"), "hidden_size must be an integer, got '64'"),
    (dict(vocab_size=True), "vocab_size must be an integer, got True"),
    (dict(head_dim=16.0), "head_dim must be an integer"),
    (dict(num_key_value_heads="2"), "num_key_value_heads must be an integer"),
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps must be a number, got '1e-6'"),
    (dict(rope_theta=[1]), "rope_theta must be a number"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),
    (dict(eos_token_id=["2"]), "eos_token_id must be an integer or a list of integers"),
    (dict(bos_token_id=0.5), "bos_token_id must be an integer"),
])
def test_config_values_are_checked_strictly_naming_the_field(change, match):
    from llaisys.loader.config import Qwen2Config

    assert Qwen2Config.from_hf(GOOD_CONFIG, "config.json").num_hidden_layers == 2
    with pytest.raises(ValueError, match=rf"^config\.json: {match}"):
        Qwen2Config.from_hf({**GOOD_CONFIG, **change}, "config.json")


@pytest.mark.parametrize("broken", [True, False])
def test_a_step_loop_that_ends_logs_it_and_raises_nothing_uncaught(tiny, monkeypatch, caplog, broken):
    """The loop thread ends when a tensor-parallel group broke (broken) or on a bug of its own; either way
    every waiting request fails with the reason and the thread's end is logged: never an uncaught exception,
    which Python prints as a second, bare traceback on stderr."""
    uncaught = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    with Engine(tiny, device="cpu", dtype="f32", progress=False) as e:
        core = e._core

        def fail(*_):
            if broken:  # a step that raises with the group broken: the loop ends (EngineCore.broken)
                core._stuck = "rank 1 stalled (injected)"
                raise RuntimeError("the step raised")
            raise KeyError("a bug in the loop itself")  # outside any step's handler

        monkeypatch.setattr(core, "step" if broken else "has_work", fail)
        with pytest.raises(RuntimeError, match="rank 1 stalled" if broken else "step loop failed.*a bug"):
            e.generate("hello", **GREEDY)
        e._loop._thread.join(10)
        assert not e._loop._thread.is_alive()
    assert uncaught == []
    assert any("step loop" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bad, pos", [([5, -1, 6], 1), ([5, 6, "vocab"], 2), ([True, 5], 0), ([5, 6, 7.0], 2),
                                      ([5, "7"], 1), ([5, 2**70], 1), (np.array([5, 6, -3]), 2)])
def test_bad_prompt_ids_name_their_position(eng, bad, pos):
    """Every id is checked (the plain-int fast path included): an id out of the vocabulary, a bool, a float, a
    string, a huge int; the message names the first bad position."""
    bad = [eng.config.vocab_size if t == "vocab" else t for t in bad] if isinstance(bad, list) else bad
    with pytest.raises(ValueError, match=rf"token id at position {pos} is .*, not an int in \[0, "):
        eng.generate(bad, max_new_tokens=1)


def test_numpy_and_plain_int_prompts_give_the_same_tokens(eng):
    ids = [5, 17, 3, 99, 12]
    ref = eng.generate(ids, **GREEDY).token_ids
    assert eng.generate(np.array(ids), **GREEDY).token_ids == ref
    assert eng.generate([np.int32(t) for t in ids], **GREEDY).token_ids == ref
