"""The real default model (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF from the package index) against HF
transformers loading the same GGUF file: chat tokens, f32 greedy output, logits, bf16 agreement."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import llaisys  # noqa: E402
from llaisys.engine import Engine  # noqa: E402
from test_model import hf_greedy  # noqa: E402
from tiny_model import real_model_path  # noqa: E402

CHATS = [
    [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Explain what a KV cache is in two sentences."}],
    [{"role": "user", "content": "Translate to French: the cat sleeps."},
     {"role": "assistant", "content": "Le chat dort."},
     {"role": "user", "content": "Now in Japanese and Chinese, with an emoji 🐱."}],
]
EXTRA_CHATS = [
    [{"role": "user", "content": "Ünïcödé — naïve café, 你好世界, 😀👍🏽, \ttabs\nand\n\nnewlines"}],
    [{"role": "user", "content": "<|im_start|> is a special token; so is <|endoftext|>."}],
]


@pytest.fixture(scope="module")
def gguf():
    return real_model_path()


@pytest.fixture(scope="module")
def hf_tok(gguf):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))


@pytest.fixture(scope="module")
def hf32(gguf):
    m = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                          dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="module")
def eng32(gguf):
    return Engine(gguf, device="cpu", dtype="f32", max_seq_len=2048, progress=False)


def chat_ids(hf_tok, messages):
    text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return hf_tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("messages", CHATS + EXTRA_CHATS)
def test_chat_prompt_tokens_equal_transformers(eng32, hf_tok, messages):
    from llaisys.chat import render_chat_template

    text = render_chat_template(eng32.chat_template, messages, add_generation_prompt=True,
                                bos_token=eng32.tokenizer.bos_token, eos_token=eng32.tokenizer.eos_token)
    assert text == hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert eng32.tokenizer.encode(text, add_special_tokens=False) == chat_ids(hf_tok, messages)


@pytest.mark.parametrize("index", range(len(CHATS)))
def test_f32_greedy_equals_hf_for_128_tokens(eng32, hf32, hf_tok, index):
    ids = chat_ids(hf_tok, CHATS[index])
    ref = hf_greedy(hf32, ids, 128)
    got = eng32.generate(ids, max_new_tokens=128, temperature=0, ignore_eos=True)
    assert got.token_ids == ref
    # and the chat API produces the same prompt, so the same reply (up to its EOS)
    reply = eng32.chat(CHATS[index], max_new_tokens=128, temperature=0)
    n = len(reply.token_ids)
    assert reply.token_ids == ref[:n]
    assert reply.finish_reason == ("stop" if n < 128 else "length")


def test_gguf_logits_equal_transformers_gguf_load(eng32, hf32, hf_tok):
    ids = chat_ids(hf_tok, CHATS[0]) + hf_tok("def is_prime(n):\n    if n < 2:", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ref = hf32(torch.tensor([ids])).logits[0].double().numpy()
    got = eng32.score(ids)
    # Same dequantized weights in f32; only summation order differs (logits are O(10)).
    np.testing.assert_allclose(got, ref, atol=2e-3, rtol=1e-4)


def test_bf16_teacher_forced_top1_agreement_with_hf_bf16(gguf, hf32, hf_tok):
    text = open(llaisys.engine.__file__, encoding="utf-8").read()  # real code and prose, > 500 tokens
    ids = hf_tok(text, add_special_tokens=False)["input_ids"][:600]
    assert len(ids) >= 500
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = hf_bf16(torch.tensor([ids])).logits[0].float().numpy()
    del hf_bf16
    eng = Engine(gguf, device="cpu", dtype="bf16", max_seq_len=1024, progress=False)
    got = eng.score(ids)
    agreement = float((got.argmax(-1) == ref.argmax(-1)).mean())
    assert agreement >= 0.99, agreement
