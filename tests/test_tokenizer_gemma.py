"""Gemma's SentencePiece-style GGUF tokenizer (tokenizer.ggml.model = llama, architecture gemma3) against
transformers' reading of the same file: a tiny Gemma-shaped vocabulary written here (fast), and the real
Gemma-3-270M GGUF of the catalog (slow: 253 MB, and transformers takes ~20 s to build its 262k tokenizer)."""
import os
import random

import gguf
import pytest

transformers = pytest.importorskip("transformers")

from llaisys.chat import render_chat_template  # noqa: E402
from llaisys.loader.gguf import load_gguf_tokenizer  # noqa: E402
from llaisys.tokenizer import Tokenizer  # noqa: E402

MIXED = ("<start_of_turn>user\ndef fib(n):\n    \"\"\"naïve — Fibonacci\"\"\"\n\tif n < 2:  return n\n"
         "        return fib(n-1) + fib(n-2)   # tab, 4 and 8 spaces\n\n\n\n"
         "你好，世界！日本語のテキスト。한국어   Ünïcödé “quotes” … ©®™\n"
         "Emoji: 🦙🚀👩‍💻🏳️‍🌈 rare: 𝔘𝔫𝔦 \x00\x7f ␀\n  leading, trailing   \n<end_of_turn>\n"
         "<start_of_turn>model\nx = {\"a\": [1, 2.5e-3, None]}  <eos> <bos><unk><pad> [multimodal]<unused0>")
TEXTS = [MIXED, "", " ", "  ", "\n", " \n ", "a  b   c", "the the", "<start_of_turn>", "<start_of_turn",
         "你好", "🦙", "\t\t", "▁ literal", "thethe there"]
# a Gemma-style chat template (the real 270M base file carries none): bos, turns, generation prompt
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
            "else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MESSAGES = [{"role": "user", "content": "Write 你好 in code:\n  print('hi')"},
            {"role": "assistant", "content": "print('你好') 🦙"}, {"role": "user", "content": "Thanks!"}]

# (token, type): llama.cpp's types, 1 normal, 3 control, 4 user-defined, 6 byte; the order is the merge rank
_SPECIAL = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 3), ("<mask>", 3), ("[multimodal]", 4),
            ("<unused0>", 3), ("<start_of_turn>", 3), ("<end_of_turn>", 3), ("\n", 4), ("\n\n", 4),
            ("  ", 4), ("   ", 4)]  # the file spells 2+ spaces as spaces; transformers renames them to ▁▁
_PIECES = ["▁", "t", "h", "e", "r", "a", "b", "c", "n", "i", "f", "d", "o", "(", ")", ":", "你", "好", "th", "he",
           "the", "▁the", "▁t", "re", "ere", "there", "in", "def", "▁▁", "▁▁▁▁", "fi", "fib", "你好", "▁a", "er"]


def write_tiny_gemma_gguf(path, template=TEMPLATE):
    """A tokenizer-only GGUF shaped like Gemma 3's: specials, user-defined whitespace runs, 256 byte
    tokens and pieces whose file order is their merge order."""
    entries = _SPECIAL + [(f"<0x{b:02X}>", 6) for b in range(256)] + [(p, 1) for p in _PIECES]
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(1)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in entries])
    w.add_token_scores([0.0] * len(entries))  # Gemma's scores do not give the merge order; file order does
    w.add_token_types([ty for _, ty in entries])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def hf_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def random_texts(n, seed=0):
    pool = ["the", "there", " ", "  ", "\n", "\t", "你好", "好", "🦙", "é", "fib(", "def ", "<start_of_turn>",
            "<end_of_turn>", "<eos>", "▁", "x", "THE", "\x00", "[multimodal]"]
    rng = random.Random(seed)
    return ["".join(rng.choices(pool, k=rng.randint(1, 25))) for _ in range(n)]


def assert_same_as_hf(ours: Tokenizer, hf, texts):
    for s in texts:
        ids = ours.encode(s)
        assert ids == hf(s, add_special_tokens=False)["input_ids"], s
        assert ours.encode(s, add_special_tokens=True) == hf(s)["input_ids"], s  # add_bos: <bos> first
        # byte fallback round-trips any text, except a literal "▁", which decodes as a space (as in HF)
        assert ours.decode(ids, skip_special_tokens=False) == s.replace("▁", " "), s
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), s
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), s
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token, ours.bos_token_id, ours.eos_token) == (hf.bos_token, hf.bos_token_id, hf.eos_token)
    assert ours.add_bos_token is True
    ids = list(range(0, ours.vocab_size, max(1, ours.vocab_size // 4000)))
    assert [ours.id_to_token(i) for i in ids] == hf.convert_ids_to_tokens(ids)


def assert_chat_renders_like_hf(ours: Tokenizer, template, hf):
    text = render_chat_template(template, MESSAGES, bos_token=ours.bos_token, eos_token=ours.eos_token)
    assert text == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<bos><start_of_turn>user\n") and text.endswith("<start_of_turn>model\n")
    ids = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ours.encode(text) == list(ids)  # the template writes <bos> itself: no second one


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_gemma_gguf(tmp_path_factory.mktemp("gemma") / "tok.gguf")
    return path, hf_tokenizer(path)


def test_tiny_gemma_gguf_equals_transformers(tiny):
    path, hf = tiny
    ours, template = load_gguf_tokenizer(path)
    assert_same_as_hf(ours, hf, TEXTS + random_texts(200))
    assert template == TEMPLATE
    # what the tiny vocabulary makes of it, spelled out: spaces are ▁, the best-ranked merge wins, the
    # file's "  " is the piece ▁▁, and text outside the vocabulary falls back to its UTF-8 bytes
    assert [ours.id_to_token(i) for i in ours.encode("the  x")] == ["the", "▁▁", "<0x78>"]
    assert ours.encode("<start_of_turn>\n") == [7, 9]
    assert ours.decode(ours.encode("é🦙")) == "é🦙"
    assert ours.decode([7, 2, 1]) == "" and ours.decode([5]) == "[multimodal]"  # user-defined stays text


def test_tiny_gemma_chat_template_renders_like_transformers(tiny):
    path, hf = tiny
    ours, template = load_gguf_tokenizer(path)
    assert_chat_renders_like_hf(ours, template, hf)


def test_gemma_metadata_errors(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model 'llama' of architecture 'llama' is not supported"):
        Tokenizer.from_gguf_metadata(["<unk>", "a"], [2, 1], None, model="llama", architecture="llama")
    with pytest.raises(ValueError, match=r"missing tokenizer.ggml.merges \(needed by a 'gpt2' tokenizer\)"):
        Tokenizer.from_gguf_metadata(["a"], [1], None, model="gpt2")
    with pytest.raises(ValueError, match=r"special token id 9 is outside the vocabulary \(2 tokens\)"):
        Tokenizer.from_gguf_metadata(["<unk>", "a"], [2, 1], None, model="llama", architecture="gemma3",
                                     bos_token_id=9)
    truncated = tmp_path / "cut.gguf"
    data = open(write_tiny_gemma_gguf(tmp_path / "whole.gguf"), "rb").read()
    truncated.write_bytes(data[:len(data) // 2])  # cut inside the token list
    with pytest.raises(ValueError, match=r"cut\.gguf: corrupt or truncated GGUF file"):
        load_gguf_tokenizer(str(truncated))


# ---- the real Gemma-3-270M ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real():
    from llaisys import catalog

    path = catalog.download("gemma-3-270m")
    return path, hf_tokenizer(path)


@pytest.mark.slow
def test_real_gemma3_gguf_equals_transformers(real):
    path, hf = real
    ours, template = load_gguf_tokenizer(path)
    assert_same_as_hf(ours, hf, TEXTS + random_texts(100))
    assert ours.vocab_size == 262144 and (ours.bos_token_id, ours.eos_token_ids) == (2, (1,))
    assert ours.encode("<start_of_turn>user\n") == [105, 2364, 107]
    assert template is None  # the 270M base model's file has no chat template
    assert_chat_renders_like_hf(ours, TEMPLATE, hf.__class__.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), chat_template=TEMPLATE))
