"""The real default model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF) kept in its block formats on the CPU
(Engine(dtype="auto"), the default) against HF transformers' float32 run of the same file (which it
dequantizes): top-1 agreement and perplexity, the formats and bytes it holds, and fusion."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from llaisys.engine import Engine  # noqa: E402
from tiny_model import real_model_path  # noqa: E402

pytestmark = pytest.mark.slow  # runs the real default model on the CPU

# A conversation as a chat UI would send it back to the model: its text is what the model is scored on.
CONVERSATION = [
    {"role": "system", "content": "You are a helpful coding assistant. Answer briefly and show code."},
    {"role": "user", "content": "How do I read a JSON file in Python and print one of its keys?"},
    {"role": "assistant", "content": (
        "Use the json module from the standard library:\n\n```python\nimport json\n\n"
        "with open(\"config.json\", encoding=\"utf-8\") as f:\n    data = json.load(f)\n\n"
        "print(data[\"name\"])\n```\n\n`json.load` parses the whole file into dictionaries and lists. If the key "
        "may be missing, use `data.get(\"name\")`, which returns None instead of raising KeyError.")},
    {"role": "user", "content": "And how would I write a dictionary back to a file, nicely indented?"},
    {"role": "assistant", "content": (
        "Call `json.dump` with an indent:\n\n```python\nimport json\n\nsettings = {\"name\": \"demo\", "
        "\"retries\": 3, \"tags\": [\"a\", \"b\"]}\n\nwith open(\"out.json\", \"w\", encoding=\"utf-8\") as f:\n"
        "    json.dump(settings, f, indent=2, sort_keys=True)\n```\n\n`indent=2` puts each key on its own line, "
        "and `sort_keys=True` keeps the output stable between runs, which makes diffs easier to read.")},
    {"role": "user", "content": "Write a function that merges two sorted lists into one sorted list."},
    {"role": "assistant", "content": (
        "Walk both lists with two indices and always take the smaller head:\n\n```python\n"
        "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
        "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n"
        "    return out\n```\n\nIt runs in O(len(a) + len(b)) time. Using `<=` keeps the merge stable: equal "
        "items from the first list come first. For many lists at once, `heapq.merge` does the same lazily.")},
    {"role": "user", "content": "Thanks! What is the difference between a list and a tuple?"},
    {"role": "assistant", "content": (
        "A list is mutable: you can append, remove and change items in place. A tuple is immutable: once "
        "created it cannot change, so it can be used as a dictionary key or stored in a set when all its "
        "items are hashable. Tuples are a little smaller and faster to create, and they signal that the "
        "collection has a fixed structure, like a point `(x, y)` or a database row.")},
]


@pytest.fixture(scope="module")
def path(qwen_gguf):
    return qwen_gguf


@pytest.fixture(scope="module")
def ids(qwen_hf_tokenizer):  # conftest.py: HF's tokenizer and model of the file, loaded once per session
    text = qwen_hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    return qwen_hf_tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def hf_logits(qwen_hf32, ids):
    with torch.no_grad():
        return qwen_hf32(torch.tensor([ids])).logits[0].double().numpy()


@pytest.fixture(scope="module")
def eng(path):
    with Engine(path, device="cpu", max_seq_len=2048, progress=False) as e:
        yield e


def _nll(logits: np.ndarray, ids: list[int]) -> float:
    """Mean negative log-likelihood of ids[1:] under the logits of the positions before them (float64)."""
    z = logits[:-1].astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].mean())


def test_default_dtype_keeps_the_file_formats(eng, path):
    reader = gguf.GGUFReader(path)
    expected = {}
    for t in reader.tensors:
        expected[t.tensor_type.name.lower()] = expected.get(t.tensor_type.name.lower(), 0) + 1
    d = eng.describe()
    assert d["quantized"] and d["dtype"] == "f32"
    assert {fmt: v["tensors"] for fmt, v in d["weight_formats"].items()} == expected
    # every weight as the file stores it (norms and biases are F32 there and here): the same bytes, no more
    assert d["weight_bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert sum(v["bytes"] for v in d["weight_formats"].values()) == d["weight_bytes"]


def test_quantized_top1_agrees_with_hf_f32_of_the_same_file(eng, ids, hf_logits):
    """Teacher-forced over the conversation: the quantized model (8-bit activations against the file's
    blocks) picks HF's float32 top-1 at >= 98% of >= 500 positions."""
    ours = eng.score(ids)
    assert len(ids) >= 500
    agree = (ours.argmax(-1) == hf_logits.argmax(-1)).mean()
    assert agree >= 0.98, agree


def test_quantized_perplexity_within_2_percent_of_hf(eng, ids, hf_logits):
    ours = np.exp(_nll(eng.score(ids), ids))
    ref = np.exp(_nll(hf_logits, ids))
    assert abs(ours / ref - 1) <= 0.02, (ours, ref)


def test_fused_projections_give_the_same_logits(path, ids, eng, monkeypatch):
    """gate/up (both Q5_0 in this file) run as one fused quantized matrix with LLAISYS_FUSED=1; q/k/v mix
    Q5_0 and Q8_0, so they stay separate. The fused kernel rounds as the separate ones do: equal bits."""
    monkeypatch.setenv("LLAISYS_FUSED", "1")
    with Engine(path, device="cpu", max_seq_len=1024, progress=False) as fused:
        assert fused.describe()["weight_bytes"] == eng.describe()["weight_bytes"]
        np.testing.assert_array_equal(fused.score(ids[:200]), eng.score(ids[:200]))


def test_explicit_dtype_still_dequantizes(path):
    with Engine(path, device="cpu", dtype="f32", max_seq_len=256, progress=False) as e:
        d = e.describe()
        assert not d["quantized"] and d["dtype"] == "f32" and set(d["weight_formats"]) == {"f32"}


# ---- CUDA: random-quantized weights of the 1.5B model's shapes --------------------------------------------
# The real file can't reach the GPU machine; a file of random Q4_K / Q6_K blocks with the 1.5B matrices
# (fewer layers) runs the CUDA kernels of both the GEMV (<= 8 rows) and the dequantize + GEMM paths.
# Random weights give flat, near-tied distributions, so our bf16 run is held to HF's own bf16 run of the
# same weights: as close to HF float32 (relative logit error, top-1 agreement) as that is.

def _tokenizer_source():
    here = os.path.join(os.path.dirname(__file__), "..")
    carried = os.path.join(here, ".devdeps", "tokenizer.gguf")  # the device run carries only the tokenizer
    return carried if os.path.exists(carried) else real_model_path()


@pytest.fixture(scope="module")
def random_q4_k_m(tmp_path_factory):
    import random_gguf  # bench/ is on sys.path (conftest.py)
    from llaisys_bench.shapes import SHAPES

    shape = dict(SHAPES["qwen2-1.5b"], num_hidden_layers=4)
    path = str(tmp_path_factory.mktemp("gguf") / "random-1.5b-q4_k_m.gguf")
    return random_gguf.write_random_gguf(path, shape, "q4_k_m", seed=3, tokenizer_from=_tokenizer_source(),
                                         verbose=False)


def _rel(x, ref):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@pytest.mark.cuda
# the dp4a GEMV (<= 8 rows), the tensor-core GEMM over W tiles decoded in shared memory (9-64 rows), then
# dequantize + cuBLASLt (more)
@pytest.mark.parametrize("rows", [8, 64, 300])
def test_cuda_quantized_is_as_close_to_hf_f32_as_hf_bf16(random_q4_k_m, rows):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(random_q4_k_m), gguf_file=os.path.basename(random_q4_k_m), dtype=torch.float32).eval().cuda()
    with Engine(random_q4_k_m, device="cuda", dtype="quantized", max_seq_len=1024, progress=False) as eng:
        d = eng.describe()
        assert d["quantized"] and d["dtype"] == "bf16" and {"q4_k", "q6_k"} <= set(d["weight_formats"])
        rng = np.random.default_rng(0)
        windows = [[int(t) for t in rng.integers(0, 150000, rows)] for _ in range(max(1, 320 // rows))]
        ours = np.concatenate([eng.score(w) for w in windows])
    with torch.no_grad():
        x = torch.tensor(windows, device="cuda")
        ref32 = hf(x).logits.double().cpu().numpy().reshape(-1, hf.config.vocab_size)
        ref16 = hf.to(torch.bfloat16)(x).logits.double().cpu().numpy().reshape(-1, hf.config.vocab_size)
    assert np.isfinite(ours).all()
    # Ours carries bf16 activations against exact weights; HF bf16 also rounds the weights to bf16: hold
    # ours to 1.5x HF bf16's error. The GEMV (<= 8 rows) also rounds each activation block to 8 bits
    # (d = max|x| / 127, llama.cpp's scheme), which adds about as much error again as bf16 does: 2.2x HF
    # bf16's on an H100 (2026-11-25), so 3x there.
    bound = 3.0 if rows <= 8 else 1.5
    assert _rel(ours, ref32) <= bound * _rel(ref16, ref32), (_rel(ours, ref32), _rel(ref16, ref32))
    agree = lambda a: float((a.argmax(-1) == ref32.argmax(-1)).mean())  # noqa: E731
    assert agree(ours) >= agree(ref16) - (0.05 if rows <= 8 else 0.02), (agree(ours), agree(ref16))


@pytest.mark.cuda
def test_cuda_batched_decode_graphs_read_the_decode_scratch(random_q4_k_m):
    """16 sequences decoding together: every linear of a step has 16 rows, so each quantized weight runs
    the tensor-core GEMM that decodes its tiles in shared memory (its split-K partials from the stream's
    allocator), in steps replayed from the captured CUDA graph of batch 16 (the fused gate/up's
    linear_swiglu included); longer rows (here none) decode into the model's one scratch for cuBLASLt
    (models::linear). The model holds the file's blocks plus that one scratch, sized for the largest matrix
    but the LM head, and the LM head's own decoded copy (read by steps of more rows than the quantized kernels
    take; here none). Each generated token is held
    to the same model's eager forward of the finished sequence (score(): prefill rows, decoded into the
    same scratch): greedy picks its top-1 up to near-ties, and reports its logprob. A replay that read a
    stale or overwritten scratch would pick tokens unrelated to those logits."""
    reader = gguf.GGUFReader(random_q4_k_m)
    file_bytes = {}
    for t in reader.tensors:
        file_bytes[t.tensor_type.name.lower()] = file_bytes.get(t.tensor_type.name.lower(), 0) + int(t.n_bytes)
    with Engine(random_q4_k_m, device="cuda", dtype="quantized", max_seq_len=256, max_num_seqs=16,
                progress=False) as eng:
        d, c = eng.describe(), eng.config
        for fmt in ("q4_k", "q6_k"):  # blocks only: the bytes the file holds
            assert d["weight_formats"][fmt]["bytes"] == file_bytes[fmt]
        # the LM head's bf16 copy plus the scratch, sized for the next largest: the fused gate/up
        assert d["decode_scratch_bytes"] == 2 * c.vocab_size * c.hidden_size + 2 * 2 * c.intermediate_size * c.hidden_size
        rng = np.random.default_rng(5)
        prompts = [[int(t) for t in rng.integers(0, 150000, 6 + 3 * i)] for i in range(16)]
        outs = eng.generate(prompts, max_new_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
        assert 16 in eng._core.runner.runner.captured_batch_sizes
        scored = [eng.score(p + o.token_ids[:-1])[len(p) - 1:].astype(np.float64) for p, o in zip(prompts, outs)]
    top1 = 0
    for o, z in zip(outs, scored):
        logp = z - z.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        for row, tok, entry in zip(logp, o.token_ids, o.logprobs):
            # Two bf16 runs (M = 16 against M = the sequence) differ by roundings: the logits' own (1 ulp is
            # ~2-4% of their spread for random weights) and the activations' carried through the layers. A
            # replay of wrong weights picks tokens ~4 spreads below the top (150k near-normal logits).
            tol = 0.15 * row.std()
            assert row[tok] >= row.max() - tol, (row.max() - row[tok], row.std())
            assert abs(entry["logprob"] - row[tok]) <= tol, (entry["logprob"], row[tok], row.std())
            top1 += int(row.argmax() == tok)
    assert top1 >= 0.75 * 16 * 4, top1


def test_quantized_dtype_on_a_file_without_blocks_raises(tmp_path):
    from tiny_model import make_tiny_qwen2

    path = make_tiny_qwen2(tmp_path)
    with pytest.raises(ValueError, match="dtype='quantized'.*has none"):
        Engine(path, device="cpu", dtype="quantized", progress=False)


def test_quantized_dtype_equals_auto_on_the_cpu(path, eng, ids):
    with Engine(path, device="cpu", dtype="quantized", max_seq_len=512, progress=False) as q:
        assert q.describe() == {**eng.describe()}
        np.testing.assert_array_equal(q.score(ids[:64]), eng.score(ids[:64]))
