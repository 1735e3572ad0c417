"""Reading a GGUF file (llama.cpp's format): config from its metadata, weights dequantized to float32 under
their HF names (one tensor at a time, as the consumer asks), and the tokenizer rebuilt from its
tokenizer.ggml.* metadata. Which metadata key is which config field, and which GGUF tensor is which HF
weight, come from the core's architecture tables (loader/config.py).

llama.cpp's converter permutes the rows of q/k for LLaMA-style families (`gguf_permuted_qk` in the table) to
its interleaved rotary layout; transformers' GGUF loader undoes it and so does this one. Qwen2's are stored
as in HF, which tests/test_loader.py checks against transformers' own GGUF load.
"""
from __future__ import annotations

import os
import sys

import gguf
import numpy as np
from gguf.quants import dequantize

from ..tokenizer import Tokenizer
from . import FileSpan, LazyWeights
from .config import ModelConfig, _typed, check_weight_shapes, find_architecture, known_architectures, weight_table
from .gguf_fields import FieldParser

# GGUF block formats the core computes with directly (cpp/include/llaisys/quant.hpp)
QUANT_FORMATS = ("Q4_0", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0")


def load_gguf(path: str):
    """-> (config, weights LazyWeights {HF name: float32 array}, tokenizer, chat_template, generation_config,
    {HF name: stored format})."""
    reader = _open(path)
    meta = _Metadata(reader, path)
    name = meta.get("general.architecture")
    arch = find_architecture(name) if name else None
    if arch is None or not arch["gguf_arch"]:
        raise ValueError(f"{path}: architecture {name} is not supported (llaisys runs {known_architectures()})")
    config = _config(meta, arch, {t.name for t in reader.tensors}, source=path)
    tokenizer = _tokenizer(meta, path)
    plan = _plan(reader, config, path)
    weights = _lazy_weights(reader, plan, path, _qk_row_order(config))
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
    # GGUFReader's metadata parse slices its np.memmap several times per element of every array (~800k for
    # a 262k SentencePiece vocabulary with scores and types); gguf_fields.FieldParser reads the same fields
    # from a plain ndarray view of the mapping, one slice per string and one view per numeric array. Both
    # stay zero-copy views of the file. The memmap's mmap (all of the file, from offset 0) is kept to
    # release tensors' pages after use.
    def _build_fields(self, offs, count):
        self.mapping = self.data._mmap
        self.data = self.data.view(np.ndarray)
        swapped = ">" if sys.byteorder == "little" else "<"
        parser = FieldParser(self.data, "=" if self.byte_order == "I" else swapped)
        for _ in range(int(count)):
            field, offs = parser.field(offs)
            self._push_field(field, skip_sum=True)
        return offs


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


def _config(meta: _Metadata, arch: dict, tensors: set[str], source: str) -> ModelConfig:
    """The config from the metadata keys the architecture's table names; traits a GGUF file states only by
    its tensors (tied head, biases) are read from which tensors it holds."""
    prefix = arch["gguf_arch"]
    core = dict(arch["defaults"])
    for fname, _, key in arch["keys"]:
        value = meta.get(key.replace("{arch}", prefix)) if key else None
        if value is not None:
            core[fname] = _typed(source, key.replace("{arch}", prefix), value, core[fname])
    for fname in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        key = next(k for f, _, k in arch["keys"] if f == fname).replace("{arch}", prefix)
        meta.need(key)
    core["vocab_size"] = len(meta.need("tokenizer.ggml.tokens"))
    core["tie_word_embeddings"] = "output.weight" not in tensors
    core["qkv_bias"] = "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors
    core["o_bias"] = "blk.0.attn_output.bias" in tensors
    core["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if meta.get(f"{prefix}.attention.head_count_kv") is None:
        core["num_key_value_heads"] = core["num_attention_heads"]
    if meta.get(f"{prefix}.attention.key_length") is None:
        core["head_dim"] = core["hidden_size"] // core["num_attention_heads"]
    if meta.get(f"{prefix}.rope.freq_base") is None and prefix == "qwen2":
        core["rope_theta"] = 1e6  # llama.cpp's Qwen2 default
    rotary = meta.get(f"{prefix}.rope.dimension_count")
    if rotary is not None:
        core["partial_rotary_factor"] = int(rotary) / core["head_dim"]
    # llama.cpp's converter stores Gemma's norm weights as 1 + w already
    core["norm_plus_one"] = False
    scaling = meta.get(f"{prefix}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{source}: rope scaling {scaling!r} is not supported in GGUF files yet")
    return ModelConfig(core=core, max_position_embeddings=int(meta.need(f"{prefix}.context_length")),
                       dtype="f32",  # every weight is dequantized to float32
                       bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_ids=_eos_ids(meta),
                       gguf_permuted_qk=arch["gguf_permuted_qk"])


def _eos_ids(meta: _Metadata) -> tuple[int, ...]:
    """EOS, and llama.cpp's end-of-turn token when the file names one."""
    ids = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _tokenizer(meta: _Metadata, source: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(
        meta.need("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.token_type"),
        meta.get("tokenizer.ggml.merges"), model=meta.need("tokenizer.ggml.model"),
        pre=meta.get("tokenizer.ggml.pre"), architecture=meta.get("general.architecture"), bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(meta),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)), source=source)


def _plan(reader, config: ModelConfig, path: str) -> list:
    """[(HF name, HF shape, reader tensor)] after checking names, shapes and types against the config,
    before any dequantizing. An untied file's output.weight is lm_head; a tied config never lists it."""
    integer = {gguf.GGMLQuantizationType[n] for n in ("I8", "I16", "I32", "I64")
               if n in gguf.GGMLQuantizationType.__members__}
    found, gguf_names, plan = {}, {}, []
    hf_of = {g: hf for hf, g, *_ in weight_table(config)}
    for t in reader.tensors:
        name = hf_of.get(t.name)
        if name is None:
            raise ValueError(f"{path}: unexpected tensor {t.name} (not a weight of a {config.arch} model with this "
                             f"config)")
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


def _qk_row_order(config: ModelConfig) -> dict[str, np.ndarray]:
    """{HF name: the GGUF row each HF row is} for the q/k weights (and biases) of a family whose q/k rows
    llama.cpp's converter permuted, which inverts its permute: (heads, 2, hd/2) -> (heads, hd/2, 2)."""
    if not config.gguf_permuted_qk:
        return {}
    order = {}
    for hf, _, shape, *_ in weight_table(config):
        part = hf.rsplit(".", 2)[-2]
        if part in ("q_proj", "k_proj"):
            heads = config.num_attention_heads if part == "q_proj" else config.num_key_value_heads
            rows = np.arange(shape[0]).reshape(heads, 2, shape[0] // heads // 2)
            order[hf] = np.argsort(rows.swapaxes(1, 2).reshape(-1))
    return order


def _lazy_weights(reader, plan: list, path: str, row_order: dict[str, np.ndarray]) -> LazyWeights:
    """Each tensor dequantized to float32 when asked for (F32 tensors stay views of the file); 2-D tensors
    in QUANT_FORMATS also as their raw blocks, [rows, row bytes] uint8 views of the file (rows reordered,
    a copy, where row_order has the tensor)."""
    def reorder(name, a):
        return a[row_order[name]] if name in row_order else a

    makers = {name: (lambda t=t, shape=shape, name=name: reorder(name, _dequantize(t.data, t, path).reshape(shape)))
              for name, shape, t in plan}
    spans = {name: FileSpan(reader.mapping, int(t.data_offset), int(t.n_bytes)) for name, _, t in plan}
    raw = {name: (lambda t=t, shape=shape, name=name: (t.tensor_type.name.lower(), shape[0], shape[1],
                                                       reorder(name, t.data.reshape(shape[0], -1))))
           for name, shape, t in plan if len(shape) == 2 and t.tensor_type.name in QUANT_FORMATS}
    return LazyWeights(makers, spans, raw)
