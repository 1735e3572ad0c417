"""The real Gemma-3-270M (Q4_K_M GGUF from the package index, catalog name gemma-3-270m) against HF transformers
loading the same GGUF file: f32 greedy tokens on several prompts, and the quantized path's teacher-forced top-1
agreement with HF's f32 over 500+ positions."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llaisys import catalog  # noqa: E402
from llaisys.engine import Engine  # noqa: E402

pytestmark = pytest.mark.slow  # downloads the model (253 MB, once per machine) and runs it on the CPU

PROMPTS = ["The capital of France is", "def quicksort(arr):\n", "Once upon a time, in a small village,",
           "你好，世界！今天"]


@pytest.fixture(scope="module")
def gguf():
    return catalog.resolve("gemma-3-270m")


@pytest.fixture(scope="module")
def hf32(gguf):
    m = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                          dtype=torch.float32)
    return m.eval()


@torch.no_grad()
def hf_greedy(model, ids, n):
    seq = list(ids)
    for _ in range(n):  # HF's full forward each step: no cache layer between it and the definition
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def test_f32_greedy_equals_transformers(gguf, hf32):
    with Engine(gguf, device="cpu", dtype="f32", max_seq_len=1024, progress=False) as eng:
        assert eng.config.arch == "gemma3"
        for text in PROMPTS:
            ids = eng.tokenizer.encode(text)
            out = eng.generate(ids, max_new_tokens=32, temperature=0, ignore_eos=True)
            assert out.token_ids == hf_greedy(hf32, ids, 32), text


def test_quantized_top1_agreement_with_transformers_f32(gguf, hf32):
    text = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()[:6000]
    with Engine(gguf, device="cpu", dtype="auto", max_seq_len=2048, progress=False) as eng:
        assert eng.quantized
        ids = eng.tokenizer.encode(text)[:600]
        got = eng.score(ids)
    assert len(ids) >= 500
    with torch.no_grad():
        ref = hf32(torch.tensor([ids])).logits[0].numpy()
    agree = float(np.mean(got.argmax(-1) == ref.argmax(-1)))
    # Issue 29 asks >= 98%; measured 94.3% (this file, 600 positions). The f32 path on the same dequantized
    # weights equals HF token for token (above), so the gap is the quantized kernels' 8-bit activations (one
    # scale per 256 values, as llama.cpp rounds them: llama.cpp itself reaches 95.5% here, 2026-11-28 in
    # bench/RESULTS.md, and no weight group kept dense alone reaches 98%). Session 26 (bench/gemma_act_rounding.py):
    # only the o_proj/down_proj inputs are rounded per 256 here (every matrix reading the 640-wide hidden state is
    # Q5_0/Q8_0, rounded per 32 as llama.cpp does); with those two not rounded at all agreement is still 97.2%, so
    # 98% needs finer rounding of the 32-element formats too. Not met; this guards the level.
    # The bar is 92%, not 94%: the int8 activation rounding amplifies an ulp anywhere into a different rounding
    # noise (session 27: three tanh-GELU implementations with the same error statistics, ~3e-7 rms relative,
    # gave 94.33%, 94.17% and 93.17% here while their f32 paths all equal HF within 2.2e-6 relative; one
    # position is 0.17% and the binomial spread at 600 positions is ~1%). 92% still catches a real loss.
    assert agree >= 0.92, agree
