"""Our tokenizer against transformers' on the same files: the tiny model's (HF dir and a GGUF converted from
it), the real default GGUF, and an HF dir saved from it. Many strings: ASCII, code, whitespace runs,
unicode, emoji, CJK, numbers, special tokens inside text, plus seeded random mixtures."""
import json
import os
import random
import shutil
import unicodedata

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from llaisys.loader.gguf import load_gguf_tokenizer  # noqa: E402
from llaisys.tokenizer import Tokenizer, read_tokenizer_config  # noqa: E402
from tiny_model import make_tiny_qwen2, write_tiny_gguf  # noqa: E402

FIXED = [
    "", " ", "a", "Hello world", "Hello, world! How are you?", "  leading and trailing  ", "a  b   c    d\t\te",
    "\n", "\n\n\n", "\r\n\r\n", "line one\nline two\r\nline three\n\n", "\t\ttabs\t", " \n \n ",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "x = [i**2 for i in range(10) if i % 2 == 0]  # squares", "#include <stdio.h>\nint main() { return 0; }",
    "if (a != b && c >= d) { x += 1; } else { y -= 2; }", "```python\nprint('hi')\n```",
    "0", "42", "12345678901234567890", "3.14159", "-7e-6", "1,000,000", "2024-05-24T22:29:00Z", "v0.9.0",
    "don't you're we'll I'M they've she'd it's", "DON'T YOU'RE", "'s 't 're",
    "Ünïcödé naïve café résumé", "e\u0301 (combining acute)", "Ångström ﬁ ligature ½ ² ① ™",
    "你好世界，这是一个测试。", "こんにちは世界", "안녕하세요", "Привет мир", "مرحبا بالعالم", "שלום עולם",
    "😀👍🏽🚀 emoji", "👨‍👩‍👧‍👦 family", "🏳️‍🌈", "\u200b zero\u200dwidth\ufeff", "\x00\x01\x7f control",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more<|endoftext|>",
    "<|im_start|> is a special token; so is <|endoftext|>.", "<|im_start|><|im_end|><|im_start|>",
    " <|im_end|> spaces around ", "<|im_start", "im_start|>", "<|unknown_token|>", "[PAD151665] literal",
    "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", "<|fim_prefix|>def<|fim_suffix|>x<|fim_middle|>",
]

_POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    [" ", "  ", "\t", "\n", "\r\n", "\n\n", "    "], "你好世界中文測試漢字", "ひらがなカタカナ", "éèêëçñøåüöäßœ",
    "😀😂🤖🚀👍🏽❤️✨", "\u0301\u0308\u0327", "αβγδΩπ∑∫√≈≠", ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
    ["'s", "'re", "n't", "'LL"], ["def ", "return ", "import ", "class ", "self.", "lambda"],
]


def random_strings(n=300, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 30)):
            pool = rng.choice(_POOLS)
            piece = rng.choice(pool) if isinstance(pool, list) else "".join(rng.choices(pool, k=rng.randint(1, 6)))
            parts.append(piece)
        out.append("".join(parts))
    return out


STRINGS = FIXED + random_strings()


def assert_same_as_hf(ours: Tokenizer, hf, normalize=None):
    """Encoding (with and without special tokens), decoding, round trip and the special tokens."""
    for s in STRINGS:
        ids = ours.encode(s)
        assert ids == hf(s, add_special_tokens=False)["input_ids"], s
        assert ours.encode(s, add_special_tokens=True) == hf(s)["input_ids"], s
        assert ours.decode(ids, skip_special_tokens=False) == (normalize(s) if normalize else s), s
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), s
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), s
    assert ours.vocab_size == len(hf)
    assert ours.eos_token == hf.eos_token and ours.bos_token == hf.bos_token
    assert ours.eos_token_ids == (hf.eos_token_id,)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.add_bos_token is False
    ids = list(range(0, ours.vocab_size, 7))
    assert [ours.id_to_token(i) for i in ids] == hf.convert_ids_to_tokens(ids)
    assert all(ours.token_to_id(ours.id_to_token(i)) == i for i in ids)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return Tokenizer.from_hf_dir(tiny_dir), transformers.AutoTokenizer.from_pretrained(tiny_dir)


def test_tiny_hf_dir_equals_transformers(tiny):
    # the tiny tokenizer.json NFC-normalizes, like Qwen2's own
    assert_same_as_hf(*tiny, normalize=lambda s: unicodedata.normalize("NFC", s))
    ours = tiny[0]
    assert ours.eos_token == "<|im_end|>" and ours.bos_token is None and ours.vocab_size == 400


def test_partial_utf8_and_single_token_decoding_matches_hf(tiny):
    """Token-by-token decoding (what streaming sees) gives the same text, replacement chars included."""
    ours, hf = tiny
    ids = ours.encode("😀 你好 ünï <|im_end|>")
    for i in ids:
        assert ours.decode([i]) == hf.decode([i], skip_special_tokens=True)
        assert ours.decode([i], skip_special_tokens=False) == hf.decode([i], skip_special_tokens=False)
    assert ours.inner.decode(ids, skip_special_tokens=False) == ours.decode(ids, skip_special_tokens=False)


def test_tiny_gguf_equals_transformers(tiny_dir, tmp_path):
    path = write_tiny_gguf(tiny_dir, tmp_path / "tok.gguf")
    ours, template = load_gguf_tokenizer(path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    assert_same_as_hf(ours, hf)  # a GGUF tokenizer has no normalizer (as in transformers and llama.cpp)
    assert template == hf.chat_template
    assert ours.vocab_size == 416  # padded to the model's rows with [PADn] tokens, as llama.cpp does


def test_hf_dir_errors(tmp_path, tiny_dir):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read as a tokenizer"):
        Tokenizer.from_hf_dir(tmp_path)
    shutil.copy(os.path.join(tiny_dir, "tokenizer.json"), tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|nope|>"}')
    with pytest.raises(ValueError, match=r"special token '<\|nope\|>' is not in the vocabulary"):
        Tokenizer.from_hf_dir(tmp_path)


def test_tokenizer_config_variants(tmp_path, tiny_dir):
    shutil.copy(os.path.join(tiny_dir, "tokenizer.json"), tmp_path / "tokenizer.json")
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates,
                                                                "eos_token": {"content": "<|im_end|>"}}))
    assert read_tokenizer_config(str(tmp_path))["chat_template"] == "D"
    assert Tokenizer.from_hf_dir(tmp_path).eos_token == "<|im_end|>"  # AddedToken-dict form
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("J")  # where transformers >= 4.50 saves it
    assert read_tokenizer_config(str(tmp_path))["chat_template"] == "J"
    bad = {"added_tokens_decoder": {"5": {"content": "<|im_end|>", "special": True}}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"added token '<\|im_end\|>' has id 399 in tokenizer.json but 5"):
        Tokenizer.from_hf_dir(tmp_path)


def test_gguf_metadata_errors():
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'llama' of architecture None is not supported"):
        Tokenizer.from_gguf_metadata(["a"], [1], [], model="llama")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'falcon' is not supported"):
        Tokenizer.from_gguf_metadata(["a"], [1], [], pre="falcon")
    with pytest.raises(ValueError, match="special token id 5 is outside the vocabulary"):
        Tokenizer.from_gguf_metadata(["a", "b", "ab"], [1, 1, 1], ["a b"], eos_token_ids=[5])
    with pytest.raises(ValueError, match="merges entry 'a b' is not two tokens of the vocabulary"):
        Tokenizer.from_gguf_metadata(["a", "b"], [1, 1], ["a b"])


def test_add_bos_token_prepends_bos():
    tok = Tokenizer.from_gguf_metadata(["a", "b", "ab", "<s>"], [1, 1, 1, 3], ["a b"], bos_token_id=3,
                                       add_bos_token=True)
    assert tok.encode("ab") == [2] and tok.encode("ab", add_special_tokens=True) == [3, 2]
    assert tok.decode([3, 2]) == "ab" and tok.decode([3, 2], skip_special_tokens=False) == "<s>ab"


# ---- the real default model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_gguf(qwen_gguf):
    return qwen_gguf


@pytest.fixture(scope="module")
def hf_real(qwen_hf_tokenizer):  # conftest.py: one load per session
    return qwen_hf_tokenizer


@pytest.mark.slow
def test_real_gguf_tokenizer_equals_transformers(real_gguf, hf_real):
    ours, template = load_gguf_tokenizer(real_gguf)
    assert_same_as_hf(ours, hf_real)
    assert template == hf_real.chat_template
    assert (ours.vocab_size, ours.bos_token_id, ours.eos_token_ids) == (151936, 151643, (151645,))
    assert ours.encode("<|im_start|>user\nHello<|im_end|>") == [151644, 872, 198, 9707, 151645]
    assert ours.encode("<tool_call>") == [151657]  # USER_DEFINED: matched whole, kept when decoding
    assert ours.decode([151657, 151645]) == "<tool_call>"


@pytest.mark.slow
def test_real_hf_dir_tokenizer_equals_transformers(hf_real, tmp_path):
    """from_hf_dir on a full-size tokenizer.json + tokenizer_config.json (saved by transformers), with the NFC
    normalizer that the Qwen2 repos' own tokenizer.json has (transformers 5's Qwen2Tokenizer adds NFC
    whatever the file says; we follow the file, so the file says it here)."""
    hf_real.save_pretrained(tmp_path)
    with open(tmp_path / "tokenizer.json", encoding="utf-8") as f:
        spec = json.load(f)
    spec["normalizer"] = {"type": "NFC"}
    with open(tmp_path / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    ours = Tokenizer.from_hf_dir(tmp_path)
    assert_same_as_hf(ours, transformers.AutoTokenizer.from_pretrained(tmp_path),
                      normalize=lambda s: unicodedata.normalize("NFC", s))
    assert read_tokenizer_config(str(tmp_path))["chat_template"] == hf_real.chat_template
