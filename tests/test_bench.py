"""`llaisys bench`: its random model must be as big in memory as the real one, and a figure above the
roofline must never print without a warning (issue 16, item 3); its flags and peers (llama.cpp, HF) and the
random GGUF writer of bench/random_gguf.py (issue 19)."""
import argparse
import importlib.util
import json
import os

import gguf
import numpy as np
import pytest

from llaisys_bench import one_request as bench, peers, shapes  # bench/ is on sys.path (conftest.py)

# A small Qwen2 shape (HF config values): every weight kind, a few MB in all
SMALL = dict(vocab_size=1000, hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
             max_position_embeddings=512)


def test_the_installed_package_ships_no_benchmark_code():
    """Issue 17: the benchmark code lives in bench/llaisys_bench, outside the package; the wheel packs
    python/llaisys alone (scikit-build-core's wheel.packages), so it holds no benchmark module."""
    import llaisys

    root = os.path.dirname(os.path.abspath(llaisys.__file__))
    modules = [os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files
               if f.endswith(".py")]
    assert "cli.py" in modules and "__init__.py" in modules
    assert [m for m in modules if "bench" in m or "peers" in m] == []
    assert os.path.dirname(os.path.abspath(bench.__file__)) != root
    pyproject = os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")
    if not os.path.exists(pyproject):
        pytest.skip("no source checkout: pyproject.toml is not here")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(pyproject, "rb") as f:
        assert tomllib.load(f)["tool"]["scikit-build"]["wheel"]["packages"] == ["python/llaisys"]


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_random_model_weights_are_distinct_memory_of_their_real_size(dtype):
    """Overlapping windows of one pool let the whole model sit in a CPU's cache (154% of roofline). The weights
    the Engine takes from random_loaded are each a new buffer of the real shape and dtype."""
    loaded = shapes.random_loaded(SMALL, dtype)
    expected = shapes.weight_shapes(SMALL)
    assert list(loaded.weights) == list(expected)
    taken = {name: loaded.weights.pop(name) for name in list(loaded.weights)}  # as Engine._load_weights does
    spans = []
    for name, w in taken.items():
        assert w.shape == expected[name] and w.dtype == shapes._np_dtype(dtype), name
        begin = w.__array_interface__["data"][0]
        spans.append((begin, begin + w.nbytes, name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        assert begin >= end, f"{a} and {b} share memory"


def test_bench_shape_runs_random_weights_through_the_engine(monkeypatch):
    """--shape measures the same Engine as --model, on random weights of the shape (a small one here); the
    model holds every weight at its real size."""
    monkeypatch.setitem(shapes.SHAPES, "tiny-test", SMALL)
    r = bench.bench(shape="tiny-test", device="cpu", dtype="f32", prompt_len=20, new_tokens=6)
    assert (r["model"], r["dtype"], r["compute_dtype"], r["prompt_len"], r["new_tokens"]) == (
        "tiny-test", "f32", "f32", 20, 6)
    assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["ttft_ms"] > 0
    assert r["weight_bytes"] == shapes.decode_weight_bytes(SMALL, "f32") and r["weight_formats"] == ["f32"]
    assert r["roofline_tok_s"] > 0 and r["fraction_of_roofline"] == r["decode_tok_s"] / r["roofline_tok_s"]
    from llaisys.engine import Engine

    with pytest.raises(TypeError, match="from_loaded\\(\\) takes a loader.LoadedModel, got dict"):
        Engine.from_loaded(SMALL, device="cpu")
    eng = Engine.from_loaded(shapes.random_loaded(SMALL, "bf16"), device="cpu", dtype="bf16", max_seq_len=64,
                             progress=False)
    try:
        sizes = {name: nbytes for name, _, nbytes in eng._model.weight_formats()}
        assert sizes == {n: 2 * int(np.prod(s)) for n, s in shapes.weight_shapes(SMALL).items()}
        out = eng.generate([1, 2, 3], max_new_tokens=5, temperature=0, ignore_eos=True)
        assert len(out.token_ids) == 5 and all(0 <= t < SMALL["vocab_size"] for t in out.token_ids)
    finally:
        eng.close()


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_random_weights_look_like_an_initialised_model(dtype):
    weights = dict(shapes.random_weights(SMALL, dtype, seed=1))
    w = weights["model.layers.1.mlp.down_proj.weight"].astype(np.float64)
    assert np.isfinite(w).all() and 0.0078 <= np.abs(w).min() and np.abs(w).max() < 0.032
    assert abs(w.mean()) < 1e-3 and 0.01 < w.std() < 0.03  # both signs, not one repeated value
    assert len(np.unique(w)) > 100
    np.testing.assert_array_equal(weights["model.norm.weight"].astype(np.float32), 1.0)
    other = weights["model.layers.2.mlp.down_proj.weight"].astype(np.float64)
    assert not np.array_equal(w, other)  # each weight drawn anew, not a copy of one block


def _result(fraction: float) -> dict:
    return {"engine": "llaisys", "model": "qwen2-0.5b", "device": "cpu", "dtype": "bf16", "prefill_tok_s": 90.0,
            "ttft_ms": 1400.0, "decode_tok_s": 40.0 * fraction, "decode_ms_per_token": 25.0 / fraction,
            "fraction_of_roofline": fraction}


def test_above_roofline_prints_a_warning():
    row = bench.format_row(_result(1.54))
    assert "154% of roofline" in row and "WARNING" in row and "cache" in row
    assert bench.roofline_warning(_result(1.54)) in row


def test_below_roofline_prints_no_warning():
    assert "WARNING" not in bench.format_row(_result(0.97))
    assert bench.roofline_warning(_result(0.97)) is None
    peer = {k: v for k, v in _result(2.0).items() if k != "fraction_of_roofline"}  # peers have no roofline
    assert "WARNING" not in bench.format_row(peer)


def test_bench_model_runs_one_request_through_the_engine(tmp_path):
    """--model measures the Engine users get (scheduler, paged KV cache), on fresh prompts."""
    from tiny_model import make_tiny_qwen2

    path = make_tiny_qwen2(tmp_path / "m", seed=3)
    r = bench.bench(model=path, device="cpu", dtype="f32", prompt_len=20, new_tokens=6)
    assert r["model"] == path and r["prompt_len"] == 20 and r["new_tokens"] == 6
    assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["ttft_ms"] > 0


# ---- flags, peers and the comparison with llama.cpp (issue 19) ------------------------------------------

def _args(**kw):
    base = dict(model=None, shape=None, device="cpu", dtype="bf16", prompt_len=8, new_tokens=4, peers=False,
                json=None, threads=None, gguf_types=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("threads", [0, -2, "2", True, 1.5])
def test_bad_threads_raise(threads):
    with pytest.raises(ValueError, match="--threads must be a whole number >= 1"):
        bench._options(_args(threads=threads))


def test_conflicting_sources_raise():
    with pytest.raises(ValueError, match="either --model or --shape"):
        bench._options(_args(model="m.gguf", shape="qwen2-0.5b"))
    with pytest.raises(ValueError, match="--gguf-types .* cannot be combined with --model"):
        bench._options(_args(model="m.gguf", gguf_types="q8_0"))
    with pytest.raises(ValueError, match="--dtype must be auto, quantized, bf16, f16 or f32"):
        bench._options(_args(dtype="int4"))
    with pytest.raises(ValueError, match="--dtype quantized needs a GGUF file"):
        bench._options(_args(shape="qwen2-0.5b", dtype="quantized"))
    with pytest.raises(ValueError, match="dtype quantized needs a GGUF file"):  # bench() called directly
        bench.bench(shape="qwen2-0.5b", dtype="quantized", device="cpu")


def test_options_pass_dtype_and_threads_through():
    o = bench._options(_args(model="m.gguf", dtype="auto", threads=3, peers=True))
    assert o["kw"] == dict(shape=None, model="m.gguf", device="cpu", dtype="auto", prompt_len=8, new_tokens=4,
                           tensor_parallel_size=1)
    assert o["threads"] == 3 and o["peers"] and o["label"] is None


def _bench_script(name: str):
    """bench/NAME.py imported as a module."""
    path = os.path.join(os.path.dirname(__file__), "..", "bench", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"bench_{name}_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_script(name: str, *args, cwd=None):
    """bench/NAME.py ARGS in a child process that imports this llaisys."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "bench", f"{name}.py")
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), cwd=cwd)


def _peers_script():
    return _bench_script("peers")


def test_peers_script_parses_the_new_flags():
    args = _peers_script().parser().parse_args(["--shape", "qwen2-1.5b", "--gguf-types", "q4_k_m", "--threads", "2",
                                                "--dtype", "bf16", "--device", "cpu", "--skip-hf"])
    assert (args.shape, args.gguf_types, args.threads, args.dtype, args.model, args.skip_hf) == (
        "qwen2-1.5b", "q4_k_m", 2, "bf16", None, True)
    assert _peers_script().parser().parse_args([]).dtype == "auto"  # the file's formats unless asked otherwise


def test_threads_reach_the_llaisys_child(monkeypatch):
    """--threads is LLAISYS_NUM_THREADS of the process that measures llaisys (the pool reads it at start)."""
    seen = {}

    def fake_run_child(code, payload, env, what):
        seen.update(env=env, payload=payload, what=what)
        return {"ok": True}

    monkeypatch.setattr(peers, "run_child", fake_run_child)
    assert bench.run_isolated(dict(model="m.gguf", dtype="bf16"), threads=3) == {"ok": True}
    assert seen["env"]["LLAISYS_NUM_THREADS"] == "3" and seen["payload"]["dtype"] == "bf16"
    import llaisys
    import llaisys_bench

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(llaisys.__file__)))
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[:2] == [package_parent, llaisys_bench.BENCH_DIR]


def test_run_child_reports_a_failing_child_in_one_error():
    with pytest.raises(RuntimeError, match=r"llama.cpp failed in its own process \(exit 3\): boom"):
        peers.run_child("import sys; print('boom', file=sys.stderr); sys.exit(3)", {}, dict(os.environ), "llama.cpp")
    assert peers.run_child("import json, sys; print('noise'); print(json.dumps(json.loads(sys.argv[1])))",
                           {"a": [1, 2]}, dict(os.environ), "x") == {"a": [1, 2]}


def _hide(monkeypatch, *modules):
    real = importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec",
                        lambda name, *a: None if name in modules else real(name, *a))


def test_missing_llama_cpp_is_one_line(monkeypatch):
    _hide(monkeypatch, "llama_cpp")
    assert peers.llama_cpp_skip_reason("cpu", "m.gguf") == peers.LLAMA_CPP_MISSING
    assert "pip install llama-cpp-python" in peers.LLAMA_CPP_MISSING and "\n" not in peers.LLAMA_CPP_MISSING


def test_llama_cpp_needs_cpu_and_a_gguf_file():
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python not installed: the missing-module reason comes first")
    assert "CPU build" in peers.llama_cpp_skip_reason("cuda:0", "m.gguf")
    assert "runs GGUF files" in peers.llama_cpp_skip_reason("cpu", "/models/qwen")
    assert "runs GGUF files" in peers.llama_cpp_skip_reason("cpu", None)
    assert peers.llama_cpp_skip_reason("cpu", "m.gguf") is None


def test_peers_without_llama_cpp_or_torch_say_so_in_one_line_each(monkeypatch, capsys):
    """`bench --peers` without the peers installed: one line each, no traceback, llaisys' row still printed."""
    ours = {"engine": "llaisys", "model": "qwen2-0.5b", "device": "cpu", "dtype": "bf16", "prompt_len": 8,
            "new_tokens": 4, "ttft_ms": 10.0, "prefill_tok_s": 800.0, "decode_tok_s": 40.0, "decode_ms_per_token": 25.0,
            "fraction_of_roofline": 0.5, "copy_bandwidth_gb_s": 10.0, "weight_bytes": 10 ** 9, "roofline_tok_s": 80.0,
            "decode_device_mallocs": 0, "threads": 2, "peak_rss_mb": 900.0, "vocab_size": 1000}
    calls = []
    monkeypatch.setattr(bench, "run_isolated", lambda kw, threads: calls.append((kw, threads)) or dict(ours))
    _hide(monkeypatch, "llama_cpp", "torch", "transformers")
    assert bench.main(_args(shape="qwen2-0.5b", peers=True, threads=2)) == 0
    out = capsys.readouterr().out.splitlines()
    assert calls == [(dict(shape="qwen2-0.5b", model=None, device="cpu", dtype="bf16", prompt_len=8, new_tokens=4,
                           tensor_parallel_size=1), 2)]
    assert out[0].startswith("llaisys") and "2 threads, peak RSS 900 MB" in out[1]
    assert out[2:] == [peers.LLAMA_CPP_MISSING,
                       "HF transformers: skipped, torch and transformers not installed (pip install '.[test]')"]
    assert bench.main(_args(shape="qwen2-0.5b", peers=True, skip_hf=True)) == 0
    assert capsys.readouterr().out.splitlines()[2:] == [peers.LLAMA_CPP_MISSING]  # HF left out: no line


def test_comparison_table_gives_llaisys_over_llama_cpp():
    row = lambda engine, dtype, p, d, m, **kw: dict(engine=engine, dtype=dtype, prefill_tok_s=p, decode_tok_s=d,  # noqa
                                                   peak_rss_mb=m, threads=2, prompt_len=128, new_tokens=256, **kw)
    rows = [row("llaisys", "auto", 120.0, 36.0, 660.0, quantized=True), row("llaisys", "bf16", 60.0, 15.0, 1500.0),
            row("llama.cpp", "file", 100.0, 30.0, 600.0), row("hf-eager", "bf16", 5.0, 1.0, 0.0)]
    lines = bench.comparison_table(rows).splitlines()
    assert "2 threads, prompt 128, 256 new tokens" in lines[0]
    assert lines[-2].split()[-3:] == ["1.20x", "1.20x", "1.10x"]  # quantized / llama.cpp
    assert lines[-1].split()[-3:] == ["0.60x", "0.50x", "2.50x"]  # bf16 / llama.cpp
    assert not any("hf-eager" in line for line in lines)
    assert bench.comparison_table(rows[:2]) is None  # nothing to compare with


# ---- bench/random_gguf.py --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def random_gguf():
    # this checkout's writer, loaded from its file: the tests may run against an installed (non-editable) package
    return _bench_script("random_gguf")


@pytest.fixture(scope="module")
def tiny_tokenizer_gguf(tmp_path_factory):
    """A GGUF with a small trained tokenizer (tests/tiny_model.py), whose tokenizer.* keys the writer copies."""
    from tiny_model import make_tiny_qwen2, write_tiny_gguf

    d = tmp_path_factory.mktemp("tok")
    hf = make_tiny_qwen2(d / "hf")
    with open(os.path.join(hf, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    return write_tiny_gguf(hf, d / "tok.gguf"), vocab


def _shape(vocab, hidden=256, intermediate=512):
    # rows of 256 and 512: every format's block fits, K-quants included
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-6, rope_theta=1e6,
                tie_word_embeddings=False, max_position_embeddings=1024)


EXPECTED = {  # preset -> (most 2-D weights, ffn_down / output / token_embd) when no fallback is needed
    "q4_k_m": ("Q4_K", "Q6_K"), "q8_0": ("Q8_0", "Q8_0"), "q4_0": ("Q4_0", "Q4_0"), "q5_0": ("Q5_0", "Q5_0"),
    "q5_k": ("Q5_K", "Q5_K"), "q6_k": ("Q6_K", "Q6_K")}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_random_gguf_loads_with_the_requested_formats_and_sane_values(random_gguf, tiny_tokenizer_gguf, tmp_path,
                                                                      preset):
    from llaisys import loader

    tok, vocab = tiny_tokenizer_gguf
    shape = _shape(vocab)
    path = random_gguf.write_random_gguf(tmp_path / "r.gguf", shape, preset, seed=3, tokenizer_from=tok,
                                         verbose=False)
    m = loader.load(path, progress=False)
    c = m.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim) == (vocab, 256, 512, 2, 4, 2, 64)
    assert not c.tie_word_embeddings
    assert {n: tuple(w.shape) for n, w in m.weights.items()} == dict(shapes.weight_shapes(shape))
    main, more = EXPECTED[preset]
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, t in tensors.items():
        want = "F32" if len(t.shape) == 1 else more if name in ("output.weight", "token_embd.weight") or \
            name.endswith("ffn_down.weight") else main
        assert t.tensor_type.name == want, name
    for name, w in m.weights.items():
        w = np.asarray(w, np.float64)
        assert np.isfinite(w).all(), name
        if w.ndim == 2:
            target = 0.04 if name == "model.embed_tokens.weight" else 0.02
            assert 0.6 * target < w.std() < 1.5 * target and abs(w.mean()) < 0.1 * target, (name, w.std(), w.mean())
    q0, q1 = (np.asarray(m.weights[f"model.layers.{i}.self_attn.q_proj.weight"]) for i in (0, 1))
    assert not np.array_equal(q0, q1)  # each tensor its own draw
    assert m.tokenizer.encode("def f(x): return x") == loader.load(tok, progress=False).tokenizer.encode(
        "def f(x): return x")


def test_random_gguf_is_seeded(random_gguf, tiny_tokenizer_gguf, tmp_path):
    tok, vocab = tiny_tokenizer_gguf
    a, b, c = (random_gguf.write_random_gguf(tmp_path / f"{n}.gguf", _shape(vocab), "q4_k_m", seed=s,
                                             tokenizer_from=tok, verbose=False)
               for n, s in (("a", 1), ("b", 1), ("c", 2)))
    read = lambda p: gguf.GGUFReader(p).tensors[3].data.tobytes()  # noqa: E731
    assert read(a) == read(b) and read(a) != read(c)


def test_k_quants_fall_back_on_rows_that_are_not_a_multiple_of_256(random_gguf):
    """The 0.5B shape (rows of 896) as llama.cpp quantizes it: Q4_K -> Q5_0, Q6_K -> Q8_0; ffn_down (rows of
    4864 = 19 x 256) keeps its K-quant. The 1.5B shape needs no fallback."""
    tensors, notes = random_gguf.plan("qwen2-0.5b", "q4_k_m")
    types = {name: q.name for name, (_, q) in tensors.items()}
    assert types["blk.0.attn_q.weight"] == types["blk.5.ffn_up.weight"] == "Q5_0"
    assert types["blk.0.ffn_down.weight"] == "Q6_K"
    assert types["output.weight"] == types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == types["blk.0.attn_q.bias"] == "F32"
    assert any("Q4_K -> Q5_0 for 144 tensors" in n for n in notes) and any("Q6_K -> Q8_0 for 2" in n for n in notes)
    tensors, notes = random_gguf.plan("qwen2-1.5b", "q4_k_m")
    counts = {}
    for _, q in tensors.values():
        counts[q.name] = counts.get(q.name, 0) + 1
    assert notes == [] and counts == {"Q6_K": 28 + 2, "Q4_K": 28 * 6, "F32": 28 * 5 + 1}
    _, notes = random_gguf.plan("qwen2-0.5b", "q5_k")
    assert any("Q5_K -> Q5_0" in n for n in notes)


def test_random_gguf_bad_inputs_raise(random_gguf, tiny_tokenizer_gguf, tmp_path):
    tok, vocab = tiny_tokenizer_gguf
    with pytest.raises(ValueError, match="unknown --types preset 'q3_k'"):
        random_gguf.plan("qwen2-0.5b", "q3_k")
    with pytest.raises(ValueError, match="unknown shape 'qwen2-9b'"):
        random_gguf.plan("qwen2-9b", "q8_0")
    with pytest.raises(TypeError, match="shape must be a name"):
        random_gguf.plan(7, "q8_0")
    with pytest.raises(ValueError, match="not a multiple of Q8_0's block of 32"):
        random_gguf.plan(_shape(vocab, hidden=80), "q8_0")
    with pytest.raises(ValueError, match=f"has {vocab} tokens but the shape's vocab_size is {vocab - 1}"):
        random_gguf.write_random_gguf(tmp_path / "x.gguf", _shape(vocab - 1), "q6_k", tokenizer_from=tok, verbose=False)
    with pytest.raises(TypeError, match="seed must be an int"):
        random_gguf.write_random_gguf(tmp_path / "x.gguf", _shape(vocab), "q6_k", seed=1.5, tokenizer_from=tok)


def test_random_gguf_pads_the_tokenizer_to_the_shapes_rows(random_gguf, tiny_tokenizer_gguf, tmp_path):
    """A shape with more embedding rows than the tokenizer has tokens (Qwen2.5-7B/72B: 152064 rows, 151936
    tokens) gets "[PAD{i}]" tokens of type UNUSED, as llama.cpp's converter writes them; the text encodes as
    before and the file loads."""
    from llaisys import loader

    tok, vocab = tiny_tokenizer_gguf
    path = random_gguf.write_random_gguf(tmp_path / "p.gguf", _shape(vocab + 3), "q8_0", tokenizer_from=tok,
                                         verbose=False)
    fields = gguf.GGUFReader(path).fields
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == len(types) == vocab + 3
    assert tokens[vocab:] == [f"[PAD{i}]" for i in range(vocab, vocab + 3)]
    assert types[vocab:] == [int(gguf.TokenType.UNUSED)] * 3
    m = loader.load(path, progress=False)
    assert m.config.vocab_size == vocab + 3
    assert m.tokenizer.encode("def f(x): return x") == loader.load(tok, progress=False).tokenizer.encode(
        "def f(x): return x")


def test_random_gguf_copies_the_real_tokenizer(random_gguf, tmp_path):
    """By default the tokenizer is the default model's, so the file tokenizes like the real model."""
    from llaisys.loader.gguf import load_gguf_tokenizer
    from tiny_model import real_model_path

    real = real_model_path()
    path = random_gguf.write_random_gguf(tmp_path / "r.gguf", _shape(151936), "q6_k", verbose=False)
    (ours, template), (theirs, real_template) = load_gguf_tokenizer(path), load_gguf_tokenizer(real)
    text = "def quicksort(arr):\n    return sorted(arr)  # 快速排序 <|im_end|>"
    assert ours.encode(text) == theirs.encode(text) and template == real_template


def test_llama_cpp_runs_a_random_gguf(random_gguf, tiny_tokenizer_gguf, tmp_path):
    """The llama.cpp peer on a tiny random file: it loads, decodes greedy past EOS, and reports its RSS."""
    pytest.importorskip("llama_cpp")
    tok, vocab = tiny_tokenizer_gguf
    path = random_gguf.write_random_gguf(tmp_path / "r.gguf", _shape(vocab), "q4_k_m", tokenizer_from=tok,
                                         verbose=False)
    ours = {"model": path, "prompt_len": 12, "new_tokens": 6, "vocab_size": vocab}
    row = peers.run_llama_cpp(ours, path, threads=1)
    assert row["engine"] == "llama.cpp" and row["threads"] == 1 and row["new_tokens"] == 6
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0 and row["peak_rss_mb"] > 0
    with pytest.raises(RuntimeError, match="not the same model"):
        peers.run_llama_cpp(dict(ours, vocab_size=vocab + 1), path, threads=1)


# ---- batched throughput, nano-vllm's protocol (issue 17) -------------------------------------------------

from llaisys_bench import throughput as bench_throughput  # noqa: E402


def _every_token_ends(loaded):
    """The model's generation_config names every id as EOS: a request that honours EOS stops after one token."""
    loaded.generation_config["eos_token_id"] = list(range(loaded.config.vocab_size))
    return loaded


def test_throughput_generates_every_requested_token_eos_ignored(monkeypatch):
    """--shape runs random weights of the shape through the Engine; with every id an EOS, only ignore_eos lets
    the output token count reach the requested lengths summed."""
    monkeypatch.setitem(shapes.SHAPES, "tiny-test", SMALL)
    real = shapes.random_loaded
    monkeypatch.setattr(shapes, "random_loaded", lambda *a, **kw: _every_token_ends(real(*a, **kw)))
    lines = []
    r = bench_throughput.throughput(shape="tiny-test", device="cpu", dtype="f32", num_requests=5, min_len=3,
                                    max_len=12, max_num_seqs=4, out=lines.append)
    prompts, outs = bench_throughput.requests(5, 3, 12, SMALL["vocab_size"])
    assert sorted(set(outs)) != [1] and all(3 <= n <= 12 for n in outs) and all(3 <= len(p) <= 12 for p in prompts)
    assert r["output_tokens"] == r["requested_output_tokens"] == sum(outs)
    assert r["prompt_tokens"] == sum(map(len, prompts))
    assert r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"] and r["seconds"] > 0
    assert r["steps"] >= max(outs) and r["ms_per_step"] > 0  # at most one token per request a step
    assert (r["model"], r["dtype"], r["num_requests"], r["max_num_seqs"]) == ("tiny-test", "f32", 5, 4)
    assert lines[0].startswith("llaisys ") and "5 requests, lengths [3, 12]" in lines[0]
    assert lines[1].startswith("batched: ") and "output tok/s" in lines[1] and "total tok/s" in lines[1]
    for part in ("steps", "ms/step", "schedule", "arrays", "runner", "postprocess", "us per sequence per step"):
        assert part in lines[1], part
    assert r["host_us_per_seq_step"] > 0
    # the same model honours EOS outside the protocol: every request would end after one token
    loaded = shapes.random_loaded(bench_throughput.shape_config("tiny-test"), "f32")
    from llaisys.engine import Engine

    with Engine.from_loaded(loaded, device="cpu", dtype="f32", max_seq_len=64, progress=False) as eng:
        assert len(eng.generate(prompts[0], max_new_tokens=outs[0], temperature=0.6).token_ids) == 1


def test_throughput_requests_are_seeded_and_uniform():
    a, b = bench_throughput.requests(64, 100, 1024, 151936), bench_throughput.requests(64, 100, 1024, 151936)
    assert a == b  # seed 0: every run and every engine gets the same requests
    assert bench_throughput.requests(64, 100, 1024, 151936, seed=1) != a
    prompts, outs = a
    lens = [len(p) for p in prompts] + outs
    assert min(lens) >= 100 and max(lens) <= 1024 and len(set(lens)) > 40
    assert all(0 <= t < 151936 for p in prompts for t in p)


@pytest.mark.parametrize("kw, message", [
    (dict(num_requests=0), "--num-requests must be a whole number >= 1"),
    (dict(min_len=0), "--min-len must be a whole number >= 1"),
    (dict(max_len=2.5), "--max-len must be a whole number >= 1"),
    (dict(max_num_seqs=True), "--max-num-seqs must be a whole number >= 1"),
    (dict(min_len=50, max_len=10), "--min-len \\(50\\) must not exceed --max-len \\(10\\)"),
    (dict(temperature=-0.1), "--temperature must be a number >= 0"),
])
def test_throughput_bad_settings_raise(kw, message):
    settings = {**dict(num_requests=4, min_len=2, max_len=8, temperature=0.0, max_num_seqs=4), **kw}
    with pytest.raises(ValueError, match=message):
        bench_throughput.check(**{k: settings[k] for k in ("num_requests", "min_len", "max_len", "temperature",
                                                           "max_num_seqs")})
    with pytest.raises(ValueError, match=message):  # before any model is built
        bench_throughput.throughput(shape="no-such-shape", device="cpu", **settings)


def test_throughput_shape_is_tied_like_the_real_models():
    for shape in shapes.SHAPES:
        c = bench_throughput.shape_config(shape)
        assert c["tie_word_embeddings"] and {k: v for k, v in c.items() if k != "tie_word_embeddings"} == {
            k: v for k, v in shapes.SHAPES[shape].items() if k != "tie_word_embeddings"}
    with pytest.raises(ValueError, match="unknown shape 'qwen9'"):
        bench_throughput.shape_config("qwen9")


def _throughput_script(*args, cwd=None):
    return _run_script("throughput", *args, cwd=cwd)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tiny_model import make_tiny_qwen2

    return make_tiny_qwen2(tmp_path_factory.mktemp("thr") / "m", seed=5)


def test_throughput_script_keeps_its_flags(tiny_path, tmp_path):
    """bench/throughput.py (what bench/gpu_check.sh runs) is a wrapper of llaisys_bench.throughput."""
    out = tmp_path / "r.json"
    r = _throughput_script("--model", tiny_path, "--device", "cpu", "-n", "4", "--min-len", "2", "--max-len", "10",
                           "--temperature", "0", "--max-num-seqs", "2", "--solo", "--json", str(out))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("llaisys ") and lines[1].startswith("batched: ") and lines[2].startswith(
        "one at a time: ")
    res = json.loads(out.read_text())
    _, outs = bench_throughput.requests(4, 2, 10, _vocab(tiny_path))
    assert res["output_tokens"] == sum(outs) and res["solo"]["output_tokens"] == sum(outs)
    assert res["output_tok_s"] > 0 and res["total_tok_s"] > 0 and res["max_num_seqs"] == 2
    r = _throughput_script("--model", tiny_path, "--device", "cpu", "--single", "8", "4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].startswith("one request, prompt 8, 4 new: decode ")


def _vocab(path) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


@pytest.mark.parametrize("args, message", [
    (["--shape", "qwen2-0.5b", "-n", "0"], "--num-requests must be a whole number >= 1, got 0"),
    (["--shape", "qwen2-0.5b", "--min-len", "9", "--max-len", "3"], "--min-len (9) must not exceed --max-len (3)"),
    (["--model", "m", "--gguf-types", "q8_0"], "--gguf-types writes a random GGUF of --shape"),
    (["--shape", "qwen2-0.5b", "--single", "0", "4"], "--single PROMPT NEW must both be >= 1"),
])
def test_throughput_script_bad_values_are_argparse_errors(args, message):
    r = _throughput_script(*args)
    assert r.returncode == 2 and "usage: throughput.py" in r.stderr and message in r.stderr, r.stderr


def test_throughput_script_parses_gpu_check_flags():
    """The command lines of bench/gpu_check.sh, parsed without running them."""
    p = _bench_script("throughput").parser()
    a = p.parse_args(["--shape", "qwen2-1.5b", "--device", "cuda", "--single", "128", "256"])
    assert (a.shape, a.device, a.single, a.dtype) == ("qwen2-1.5b", "cuda", [128, 256], None)
    a = p.parse_args(["--shape", "qwen2-1.5b", "--gguf-types", "q4_k_m", "--device", "cuda", "-n", "64"])
    assert (a.gguf_types, a.num_requests, a.peers) == ("q4_k_m", 64, False)
    a = p.parse_args(["--shape", "qwen2-0.5b", "--device", "cuda", "-n", "256", "--peers"])
    assert a.peers and (a.num_requests, a.min_len, a.max_len, a.temperature, a.max_num_seqs) == (
        256, 100, 1024, 0.6, 256)


def test_decode_breakdown_script_starts():
    """bench/decode_breakdown.py (gpu_check.sh's breakdown step) starts: it takes its shapes and requests from
    llaisys_bench.shapes / llaisys_bench.throughput, not from bench/throughput.py."""
    r = _run_script("decode_breakdown", "--help")
    assert r.returncode == 0, r.stderr
    assert "--batch" in r.stdout and "qwen2-1.5b" in r.stdout


# ---- bench/memory.py and bench/cpu_contention.py (issue 16, items 8 and 2) -------------------------------

def test_memory_script_reports_every_stage(tiny_path, tmp_path):
    """Each dtype in its own process: the RSS of every stage, and the model's bytes as the engine holds them."""
    out = tmp_path / "mem.json"
    r = _run_script("memory", "--model", tiny_path, "--dtype", "f32", "bf16", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in r.stdout.splitlines()[2:4]] == ["f32", "bf16"]
    res = json.loads(out.read_text())["dtypes"]
    for dtype in ("f32", "bf16"):
        stages = res[dtype]["stages"]
        assert list(stages) == ["imported", "loaded", "generated", "closed", "deleted"]
        assert all(s["VmRSS"] > 0 and s["VmHWM"] >= s["VmRSS"] for s in stages.values())
        assert res[dtype]["dtype"] == dtype and res[dtype]["kv_bytes"] > 0
    assert res["f32"]["weight_bytes"] == 2 * res["bf16"]["weight_bytes"]


def test_memory_script_shape_argument_errors():
    r = _run_script("memory", "--shape", "qwen9")
    assert r.returncode == 2 and "unknown shape 'qwen9'" in r.stderr, r.stderr
    r = _run_script("memory", "--shape", "qwen2-1.5b", "--model", "m")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr, r.stderr


def test_contention_one_thread_rows_have_the_same_contender(monkeypatch):
    """The 1-thread rows beside a busy loop or a 2nd engine start the contender of the engine's own-threads row;
    only the measured engine runs on one thread."""
    script = _bench_script("cpu_contention")
    args = argparse.Namespace(model="m", tokens=8, repeats=1, dtype="auto", threads=None,
                              single_thread_env="LLAISYS_NUM_THREADS")
    calls = []

    class Contender:
        def kill(self):
            pass

        def wait(self):
            pass

    def start_contender(kind, engine, a):
        calls.append(("contender", kind, engine))
        return Contender()

    def run(cmd, env, **kw):
        threads = cmd[cmd.index("--threads") + 1] if "--threads" in cmd else None
        calls.append(("measure", threads, env.get("LLAISYS_NUM_THREADS")))
        return argparse.Namespace(stdout=json.dumps({"median": 1.0, "rates": [1.0], "threads": 2}))

    monkeypatch.setattr(script, "start_contender", start_contender)
    monkeypatch.setattr(script.subprocess, "run", run)
    monkeypatch.setattr(script.time, "sleep", lambda s: None)
    monkeypatch.delenv("LLAISYS_NUM_THREADS", raising=False)
    for own, one in script.SAME_CONTENDER.values():
        calls.clear()
        script.measure("llaisys", own, args)
        own_calls = list(calls)
        calls.clear()
        script.measure("llaisys", one, args)
        assert calls[:-1] == own_calls[:-1]  # the same contender, or none
        assert own_calls[-1] == ("measure", None, None) and calls[-1] == ("measure", "1", "1")


def test_contention_same_contender_ratios():
    script = _bench_script("cpu_contention")
    medians = {"idle": 20.0, "busy-loop": 10.0, "engine": 6.0, "1-thread": 12.0, "1-thread busy-loop": 8.0,
               "1-thread engine": 4.0}
    ratios = script.same_contender({c: {"median": m} for c, m in medians.items()})
    assert ratios == pytest.approx({"none": 20 / 12, "busy-loop": 10 / 8, "engine": 6 / 4})


def test_steady_decode_times_a_step_of_the_whole_batch(monkeypatch, capsys):
    """bench/steady_decode.py (issue 33): the llaisys row runs B sequences of C cached tokens through the
    Engine and prints one row per batch; without CUDA the torch.compile peer is left out, not faked."""
    import steady_decode

    monkeypatch.setitem(shapes.SHAPES, "tiny-test", SMALL)
    assert steady_decode.main(["--shape", "tiny-test", "--device", "cpu", "--batch", "1", "3", "--context", "20",
                               "--steps", "32"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert len(rows) == 2 and all(float(r.split("|")[2]) > 0 and r.rstrip().endswith("- | - | - |") for r in rows), out
    # --modes: every mode timed in the same engine, each compared with greedy's step
    assert steady_decode.main(["--shape", "tiny-test", "--device", "cpu", "--batch", "2", "--context", "20",
                               "--steps", "32", "--modes", "greedy", "sampled", "logprobs5", "logprobs5read"]) == 0
    out = capsys.readouterr().out
    for mode in ("greedy", "sampled", "logprobs5", "logprobs5read"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"batch 2 {mode}: "))
        assert float(line.split()[3]) > 0 and line.endswith("x greedy's step"), out
    with pytest.raises(SystemExit):
        steady_decode.main(["--shape", "tiny-test", "--device", "cpu", "--steps", "0"])
    # a clock that cannot see the steps (noise as large as the signal) is an error, never a number <= 0
    monkeypatch.setattr(steady_decode, "_clock", lambda: 1.0)
    with pytest.raises(SystemExit, match="raise --steps"):
        steady_decode.main(["--shape", "tiny-test", "--device", "cpu", "--batch", "2", "--context", "8", "--steps", "2"])


@pytest.mark.parametrize("window", [{}, {"kv_window": 16, "sink_tokens": 4}])
def test_streaming_speed_counts_every_decoded_token(tiny_path, window):
    """decode_rate on a clock that ticks once per accounted step: one token a step, so exactly 1.0 for the
    dense (quiet, persistent-batch) row as for the windowed one. It read the step's produced list, which
    lists a quiet row only when it ends: the dense run measured 6.65 tok/s on an H200 (session 30)."""
    from types import SimpleNamespace

    from llaisys.engine import Engine

    mod = _bench_script("streaming_speed")
    ticks = iter(range(10**6))
    mod.time = SimpleNamespace(perf_counter=lambda: float(next(ticks)))
    with Engine(tiny_path, device="cpu", dtype="f32", progress=False, max_seq_len=64) as eng:
        assert mod.decode_rate(eng, list(range(3, 11)), 40, 12, **window) == pytest.approx(1.0)


def test_streaming_rotation_cost_prints_both_ways(capsys):
    """bench/streaming_rotation_cost.py (issue 32's choice between the K-shift and keys rotated inside
    attention) runs and prints a row per window with both costs."""
    mod = _bench_script("streaming_rotation_cost")
    assert mod.main(["--window", "16", "40", "--repeat", "1", "--device", "cpu"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 16 ") or ln.startswith("| 40 ")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[3]) > 0 and cells[4].endswith("x")


def test_logprobs_gc_prints_both_heap_settings(capsys):
    """bench/logprobs_gc.py (the GC freeze A/B): one row per setting and round, each with a step time for
    greedy and for logprobs=5 from its own child process; bad arguments are refused."""
    mod = _bench_script("logprobs_gc")
    assert mod.main(["--batch", "3", "--steps", "2", "--rounds", "1"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 1 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["not frozen", "frozen"]
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert len([float(x) for x in cells[2:]]) == 2  # greedy's and logprobs' ms a step (noise may make either < 0)
    assert mod.main(["--batch", "3", "--steps", "2", "--rounds", "1", "--warm", "--profile", "3"]) == 0
    out = capsys.readouterr().out
    assert len([ln for ln in out.splitlines() if ln.startswith("| 1 |")]) == 2
    assert "logprobs5, heap frozen: profiled host time" in out  # the loop's own times, after the table
    assert mod.main(["--batch", "3", "--steps", "2", "--rounds", "1", "--read"]) == 0  # + the entries read
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 1 |")]
    assert len(rows) == 2 and all(len([float(c) for c in r.strip("|").split("|")[2:]]) == 3 for r in rows)
    with pytest.raises(SystemExit):
        mod.main(["--steps", "0"])
