"""The tokenizer: a tokenizers.Tokenizer plus the special tokens the engine and chat templates need.

Built from an HF directory (tokenizer.json + tokenizer_config.json) or from GGUF metadata, rebuilt the way
transformers reads the file (transformers/integrations/gguf/gguf_tokenizer_mapping.py): byte-level BPE with
Qwen2's split regex (`tokenizer.ggml.model = gpt2`), or Gemma's SentencePiece-style BPE with byte fallback
(`llama` in a Gemma file).
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

# Qwen2's pre-tokenizer split (tokenizer.json of every Qwen2/2.5 model; llama.cpp's "qwen2" pre-type).
QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre values that use it
_QWEN2_PRE_TYPES = ("qwen2", "deepseek-r1-qwen")
# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4
# architectures whose 'llama' (SentencePiece) vocabulary transformers builds as Gemma's tokenizer
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


# From this many characters on, encode() goes through encode_batch, which releases the GIL while it works
# (encode holds it: ~1 s for 300 KiB of text on a 2-core machine, during which a server's event loop is
# stopped); below it, encode (no batch to build, no thread pool).
GIL_FREE_CHARS = 16 << 10


class Tokenizer:
    """encode/decode plus bos/eos. `inner` is the tokenizers.Tokenizer (the streaming detokenizer uses it)."""

    def __init__(self, inner: _HFTokenizer, *, bos_token: str | None = None, eos_tokens: Sequence[str] = (),
                 add_bos_token: bool = False):
        self.inner = inner
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.add_bos_token = bool(add_bos_token)
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_ids = tuple(dict.fromkeys(self._id_of(t) for t in eos_tokens))
        if self.add_bos_token and self.bos_token_id is None:
            raise ValueError("tokenizer: add_bos_token is set but there is no bos_token")

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.inner.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer: special token {token!r} is not in the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. <|im_start|>) are always recognized;
        add_special_tokens only decides whether BOS is prepended (when the model wants one)."""
        if len(text) >= GIL_FREE_CHARS:
            ids = self.inner.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.inner.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.inner.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.inner.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    # ---- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """tokenizer.json (the whole pipeline) + tokenizer_config.json (bos/eos, added tokens)."""
        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{path}: no tokenizer.json (llaisys reads tokenizers in that format)")
        try:
            inner = _HFTokenizer.from_file(file)
        except Exception as e:  # the Rust side raises its own Exception type
            raise ValueError(f"{file}: cannot be read as a tokenizer ({e})") from None
        config = read_tokenizer_config(path)
        _add_config_tokens(inner, config, path)
        eos = _token_content(config.get("eos_token"))
        return cls(inner, bos_token=_token_content(config.get("bos_token")), eos_tokens=[eos] if eos else [],
                   add_bos_token=bool(config.get("add_bos_token", False)))

    @classmethod
    def from_gguf_metadata(cls, tokens: Sequence[str], token_types: Sequence[int] | None,
                           merges: Sequence[str] | None, *, model: str = "gpt2", pre: str | None = "qwen2",
                           architecture: str | None = None, bos_token_id: int | None = None,
                           eos_token_ids: Sequence[int] = (), add_bos_token: bool = False,
                           source: str = "GGUF") -> "Tokenizer":
        """The tokenizer.ggml.* metadata -> a tokenizer equal to transformers' reading of it."""
        types = list(token_types or [])
        if model == "gpt2":
            if merges is None:
                raise ValueError(f"{source}: GGUF metadata is missing tokenizer.ggml.merges (needed by a 'gpt2' "
                                 f"tokenizer)")
            inner, vocab = _byte_level_bpe(tokens, merges, source)
            inner.pre_tokenizer = _gguf_pre_tokenizer(pre, source)
            inner.decoder = decoders.ByteLevel()
            # a CONTROL token outside the byte alphabet is a converter's mislabel and left out, like transformers
            control = [t for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= _ALPHABET]
        elif model == "llama" and architecture in _GEMMA_ARCHS:
            inner, vocab = _gemma_bpe(tokens)
            control = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
        else:
            raise ValueError(f"{source}: tokenizer.ggml.model {model!r} of architecture {architecture!r} is not "
                             f"supported (byte-level BPE 'gpt2', or 'llama' in a Gemma file)")
        # CONTROL tokens are special (matched whole, skipped when decoding); USER_DEFINED ones match whole but
        # are text
        inner.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
        vocab = inner.get_vocab(with_added_tokens=True)
        inner.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
                          if ty == _USER_DEFINED and t in vocab])

        def name(i):
            if i is None:
                return None
            if not 0 <= int(i) < len(tokens):
                raise ValueError(f"{source}: special token id {i} is outside the vocabulary ({len(tokens)} tokens)")
            return tokens[int(i)]

        return cls(inner, bos_token=name(bos_token_id), eos_tokens=[name(i) for i in eos_token_ids],
                   add_bos_token=add_bos_token)


def _gemma_bpe(tokens: Sequence[str]) -> tuple[_HFTokenizer, dict]:
    """Gemma's tokenizer as transformers builds it from a GGUF (`gemma_tokenizer` + GemmaTokenizer): spaces
    become "▁" before a BPE with byte fallback, over the whole text (no pre-tokenizer split)."""
    # The file stores tokens of 2+ spaces as spaces, but text reaches the BPE as "▁"s: respell them.
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=_merges_in_file_order(vocab), dropout=None, fuse_unk=True,
                     unk_token="<unk>" if "<unk>" in vocab else None, byte_fallback=True)
    inner = _HFTokenizer(bpe)
    inner.normalizer = normalizers.Replace(" ", "\u2581")
    # GemmaTokenizer's Split(" ") sees no spaces after the normalizer: it changes nothing and is left out
    inner.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return inner, vocab


def _merges_in_file_order(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges a Gemma file implies (it stores none): every split of a token into two tokens, ranked by
    the token's position in the file (Gemma's scores do not follow its merge order), the longer left part
    first. This is transformers' generate_merges(vocab, {token: -position}), whose sort keys never tie, so
    it is written here without the sort: 262k tokens in well under a second."""
    merges = []
    for token in sorted(vocab, key=vocab.__getitem__):
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], source: str) -> tuple[_HFTokenizer, dict]:
    """The BPE model of a GGUF vocabulary, as transformers builds it (GPT2Tokenizer's settings)."""
    # Tokens the file spells outside the byte alphabet are respelled as their UTF-8 bytes, as transformers does.
    vocab = {t if set(t) <= _ALPHABET else "".join(_BYTE_CHARS[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    # tokenizers panics (PanicException, not an Exception) on a merge whose parts are not tokens: check first
    bad = next((m for m, p in zip(merges, pairs)
                if len(p) != 2 or not (p[0] in vocab and p[1] in vocab and p[0] + p[1] in vocab)), None)
    if bad is not None:
        raise ValueError(f"{source}: tokenizer.ggml.merges entry {bad!r} is not two tokens of the vocabulary "
                         f"separated by a space, merging into a third")
    bpe = models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                     fuse_unk=False, byte_fallback=False)
    return _HFTokenizer(bpe), vocab


def read_tokenizer_config(path: str) -> dict:
    """tokenizer_config.json of an HF directory ({} when absent), with chat_template filled in from
    chat_template.jinja / chat_template.json when the config itself has none."""
    config = read_json(os.path.join(path, "tokenizer_config.json")) or {}
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if template is None and os.path.isfile(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
            template = f.read()
    if template is None:
        template = (read_json(os.path.join(path, "chat_template.json")) or {}).get("chat_template")
    config["chat_template"] = template
    return config


def read_json(file: str):
    """A JSON file's content, None when the file does not exist; invalid JSON raises ValueError naming it."""
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, OSError) as e:
        raise ValueError(f"{file}: invalid JSON ({e})") from None


def _token_content(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, null, or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _add_config_tokens(inner: _HFTokenizer, config: dict, path: str) -> None:
    """Register tokenizer_config.json's added_tokens_decoder entries (normally already in tokenizer.json) so
    each is matched whole; a token that would get a different id than the config says is an error."""
    for token_id, info in (config.get("added_tokens_decoder") or {}).items():
        content = info.get("content")
        known = inner.token_to_id(content)
        if known is not None and known != int(token_id):
            raise ValueError(f"{path}: added token {content!r} has id {known} in tokenizer.json but "
                             f"{token_id} in tokenizer_config.json")
        token = AddedToken(content, special=bool(info.get("special", False)),
                           normalized=bool(info.get("normalized", not info.get("special", False))),
                           lstrip=bool(info.get("lstrip", False)), rstrip=bool(info.get("rstrip", False)),
                           single_word=bool(info.get("single_word", False)))
        if known is None and inner.get_vocab_size(with_added_tokens=True) != int(token_id):
            raise ValueError(f"{path}: added token {content!r} (id {token_id}) is not in tokenizer.json and would "
                             f"get id {inner.get_vocab_size(with_added_tokens=True)}")
        if token.special:
            inner.add_special_tokens([token])
        else:
            inner.add_tokens([token])


def _gguf_pre_tokenizer(pre: str | None, source: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _QWEN2_PRE_TYPES:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
                                        byte_level])
    if pre in (None, "default", "gpt-2", "gpt2"):  # GPT-2's own regex, built into ByteLevel
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    raise ValueError(f"{source}: tokenizer.ggml.pre {pre!r} is not supported (Qwen2 models use 'qwen2')")


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as. Printable Latin-1
    bytes stand for themselves; the others map to 256, 257, ... in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


_BYTE_CHARS = _bytes_to_unicode()
_ALPHABET = frozenset(_BYTE_CHARS)
