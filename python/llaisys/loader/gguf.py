"""Reading a Qwen2 GGUF file (llama.cpp's format): config from its metadata, weights dequantized to float32
under their HF names (one tensor at a time, as the consumer asks), and the tokenizer rebuilt from its
tokenizer.ggml.* metadata.

Qwen2's q/k projections are stored as in HF (llama.cpp's converter permutes q/k rows only for LLaMA-style
models; transformers' GGUF loader un-permutes only those), which tests/test_loader.py checks against
transformers' own GGUF load.
"""
from __future__ import annotations

import os
import re

import gguf
import numpy as np
from gguf.quants import dequantize

from ..tokenizer import Tokenizer
from . import FileSpan, LazyWeights
from .config import Qwen2Config, check_weight_shapes

# GGUF tensor name -> HF name: whole-model tensors, then the part after "blk.N." / "model.layers.N."
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor name, or None when it is not a Qwen2 weight."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
    return None


# GGUF block formats the core computes with directly (cpp/include/llaisys/quant.hpp)
QUANT_FORMATS = ("Q4_0", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0")


def load_gguf(path: str):
    """-> (config, weights LazyWeights {HF name: float32 array}, tokenizer, chat_template, generation_config,
    {HF name: stored format})."""
    reader = _open(path)
    meta = _Metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch != "qwen2":
        raise ValueError(f"{path}: architecture {arch} is not supported, llaisys runs Qwen2-family models")
    config = _config(meta, tied=not any(t.name == "output.weight" for t in reader.tensors), source=path)
    tokenizer = _tokenizer(meta, path)
    plan = _plan(reader, config, path)
    weights = _lazy_weights(reader, plan, path)
    formats = {name: t.tensor_type.name.lower() for name, _, t in plan}
    # what transformers' GGUF load puts in its generation_config
    ids = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
    gen = {k: int(v) for k, key in ids.items() if (v := meta.get(f"tokenizer.ggml.{key}")) is not None}
    return config, weights, tokenizer, meta.get("tokenizer.chat_template"), gen, formats


def load_gguf_tokenizer(path: str) -> tuple[Tokenizer, str | None]:
    """Only the tokenizer and chat template of a GGUF file (no weights are read)."""
    meta = _Metadata(_open(path), path)
    return _tokenizer(meta, path), meta.get("tokenizer.chat_template")


class _Metadata:
    def __init__(self, reader, source: str):
        self.fields, self.source = reader.fields, source

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        if field is None:
            return default
        try:
            return _field_value(field)
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.source}: corrupt GGUF metadata {key} ({e})") from None

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.source}: GGUF metadata is missing {key}")
        return value


def _field_value(field):
    """A metadata value as Python (str, int, float, bool or a list of them). ReaderField.contents() does this
    from gguf 0.16 on; the parts/data layout it reads is the same in every gguf version llaisys allows."""
    string = gguf.GGUFValueType.STRING
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == string:
            return [field.parts[i].tobytes().decode("utf-8") for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if field.types[0] == string:
        return field.parts[-1].tobytes().decode("utf-8")
    return field.parts[-1].tolist()[0]


class _Reader(gguf.GGUFReader):
    # GGUFReader slices its np.memmap once per metadata string (~600k for a 150k vocabulary); on a plain
    # ndarray view of the same mapping each slice is ~3x cheaper. Both stay zero-copy views of the file.
    # The memmap's mmap (all of the file, from offset 0) is kept to release tensors' pages after use.
    def _build_fields(self, offs, count):
        self.mapping = self.data._mmap
        self.data = self.data.view(np.ndarray)
        return super()._build_fields(offs, count)


def _open(path: str) -> gguf.GGUFReader:
    """A GGUFReader, any failure reported as ValueError naming the file."""
    try:
        reader = _Reader(path)
    except Exception as e:  # truncated files fail in numpy (reshape/index), bad magic in gguf itself
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ValueError(f"{path}: tensor {t.name} ends beyond the end of the file: the file is truncated")
    return reader


def _config(meta: _Metadata, tied: bool, source: str) -> Qwen2Config:
    tokens = meta.need("tokenizer.ggml.tokens")
    hidden, heads = int(meta.need("qwen2.embedding_length")), int(meta.need("qwen2.attention.head_count"))
    scaling = meta.get("qwen2.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{source}: rope scaling {scaling!r} is not supported (llaisys implements plain RoPE)")
    return Qwen2Config(
        vocab_size=len(tokens), hidden_size=hidden, intermediate_size=int(meta.need("qwen2.feed_forward_length")),
        num_hidden_layers=int(meta.need("qwen2.block_count")), num_attention_heads=heads,
        num_key_value_heads=int(meta.get("qwen2.attention.head_count_kv", heads)),
        head_dim=int(meta.get("qwen2.attention.key_length", hidden // heads)),
        max_position_embeddings=int(meta.need("qwen2.context_length")),
        rms_norm_eps=float(meta.need("qwen2.attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get("qwen2.rope.freq_base", 1e6)), tie_word_embeddings=tied,
        dtype="f32",  # every weight is dequantized to float32
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(meta))


def _eos_ids(meta: _Metadata) -> tuple[int, ...]:
    """EOS, and llama.cpp's end-of-turn token when the file names one."""
    ids = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _tokenizer(meta: _Metadata, source: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(
        meta.need("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.token_type"),
        meta.need("tokenizer.ggml.merges"), model=meta.need("tokenizer.ggml.model"),
        pre=meta.get("tokenizer.ggml.pre"), bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(meta),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)), source=source)


def _plan(reader, config: Qwen2Config, path: str) -> list:
    """[(HF name, HF shape, reader tensor)] after checking names, shapes and types against the config,
    before any dequantizing. An untied file's output.weight is lm_head; a tied config never lists it."""
    integer = {gguf.GGMLQuantizationType[n] for n in ("I8", "I16", "I32", "I64")
               if n in gguf.GGMLQuantizationType.__members__}
    found, gguf_names, plan = {}, {}, []
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ValueError(f"{path}: unexpected tensor {t.name} (not a Qwen2 weight)")
        if t.tensor_type in integer:
            raise ValueError(f"{path}: tensor {t.name} has integer type {t.tensor_type.name}, expected a float or "
                             f"quantized type")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        found[name], gguf_names[name] = shape, t.name
        plan.append((name, shape, t))
    check_weight_shapes(found, config, {n: path for n in found}, gguf_names=gguf_names)
    for _, _, t in plan:  # one row of each, so an unsupported type fails here rather than halfway through a load
        _dequantize(t.data[:1] if t.data.ndim > 1 else t.data, t, path)
    return plan


def _dequantize(data: np.ndarray, t, path: str) -> np.ndarray:
    try:
        return dequantize(data, t.tensor_type)
    except NotImplementedError:
        raise ValueError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which gguf cannot "
                         f"dequantize") from None


def _lazy_weights(reader, plan: list, path: str) -> LazyWeights:
    """Each tensor dequantized to float32 when asked for (F32 tensors stay views of the file); 2-D tensors
    in QUANT_FORMATS also as their raw blocks, [rows, row bytes] uint8 views of the file."""
    makers = {name: (lambda t=t, shape=shape: _dequantize(t.data, t, path).reshape(shape)) for name, shape, t in plan}
    spans = {name: FileSpan(reader.mapping, int(t.data_offset), int(t.n_bytes)) for name, _, t in plan}
    raw = {name: (lambda t=t, shape=shape: (t.tensor_type.name.lower(), shape[0], shape[1],
                                            t.data.reshape(shape[0], -1)))
           for name, shape, t in plan if len(shape) == 2 and t.tensor_type.name in QUANT_FORMATS}
    return LazyWeights(makers, spans, raw)
