"""Loading a model of any architecture in the core's tables (loader/config.py): an HF safetensors directory or a GGUF file -> config, weights, tokenizer.

    m = loader.load("/models/Qwen2.5-0.5B-Instruct")         # config.json + *.safetensors + tokenizer.json
    m = loader.load("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    m.weights["model.layers.0.self_attn.q_proj.weight"]        # numpy, HF names and shapes

Loading is strict: the expected weights (names and shapes) come from the config, and a missing, unknown or
mis-shaped tensor, or a non-float one, raises ValueError naming the tensor and the file, before any
weight is read. `weights` makes each tensor only when it is asked for (LazyWeights), so loading never holds
a converted copy of the whole model: safetensors weights are zero-copy views of a read-only mmap in their
stored dtype; GGUF weights are dequantized to float32 one tensor at a time, or (pop_raw) handed over in
their block format without a copy.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import ml_dtypes
import numpy as np

from ..tokenizer import Tokenizer, read_json, read_tokenizer_config
from .config import ModelConfig, Qwen2Config, check_weight_shapes, expected_weight_shapes, weight_table

__all__ = ["LazyWeights", "LoadedModel", "ModelConfig", "Qwen2Config", "load", "expected_weight_shapes", "weight_table"]

_FLOAT_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(ml_dtypes.bfloat16): "bf16"}


@dataclass(frozen=True)
class FileSpan:
    """Bytes [offset, offset + nbytes) of a read-only mapping of a checkpoint file."""

    mapping: mmap.mmap
    offset: int
    nbytes: int

    def release(self) -> None:
        """Drop this process's resident pages that lie wholly inside the span. The mapping is a shared
        read-only file mapping, so a later read (a zero-copy weight) faults the bytes back in from the file."""
        start = -(-self.offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (self.offset + self.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start and not self.mapping.closed:
            self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


class LazyWeights(Mapping):
    """{HF name: array} whose arrays are made when asked for, each time anew (a GGUF tensor is dequantized
    by every read). A consumer takes each weight with pop(): when it pops the next one it is done with the
    previous, whose file pages are released then, so a load's peak is the model plus about one tensor
    rather than the model, its file and a float32 copy of it.

    A GGUF tensor in a block format llaisys computes with (QUANT_FORMATS) can instead be taken as it is
    stored, with pop_raw(): (format, rows, cols, uint8 blocks [rows, row bytes]), a zero-copy view of the
    file whose pages are kept (the model reads them from the mapping)."""

    def __init__(self, makers: dict[str, Callable[[], np.ndarray]], spans: dict[str, FileSpan],
                 raw: dict[str, Callable[[], tuple]] | None = None):
        self._makers, self._spans, self._raw = dict(makers), spans, dict(raw or {})
        self._raw_spans: dict[str, FileSpan] = {}  # pop_raw's weights' spans, for release_raw
        self._previous: str | None = None

    def __getitem__(self, name: str) -> np.ndarray:
        return self._makers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    @property
    def quantized(self) -> bool:
        """Whether any weight is stored in a block format that pop_raw() can hand over as it is."""
        return bool(self._raw)

    def pop(self, name: str) -> np.ndarray:
        make = self._makers.pop(name)
        self._raw.pop(name, None)
        self._release_previous(name)
        return make()

    def pop_raw(self, name: str) -> tuple | None:
        """(format, rows, cols, blocks) of a quantized weight, removed from the mapping; None (and nothing
        removed) when the weight is not stored in a block format llaisys runs."""
        if name not in self._raw:
            return None
        self._makers.pop(name)
        span = self._spans.pop(name, None)  # the model may keep reading these pages: kept unless release_raw
        if span is not None:
            self._raw_spans[name] = span
        self._release_previous(name)
        return self._raw.pop(name)()

    def release_raw(self, name: str) -> None:
        """Drop the file pages of a weight taken with pop_raw, for a consumer that made its own copy of it (a CPU
        model's Q5_0 in the split layout): they are no longer part of the model, and no longer count in the
        process's resident memory. Reading the pop_raw view again faults them back in from the file."""
        span = self._raw_spans.pop(name, None)
        if span is not None:
            span.release()

    def _release_previous(self, name: str) -> None:
        if self._previous in self._spans:
            self._spans.pop(self._previous).release()
        self._previous = name


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: LazyWeights  # HF names; lm_head.weight only when untied
    tokenizer: Tokenizer
    chat_template: str | None
    generation_config: dict  # generation_config.json, or the bos/eos/pad ids of a GGUF file
    source: str  # the path loaded
    formats: dict = field(default_factory=dict)  # {HF name: stored format, "bf16" / "f32" / "q4_k" ...}


def load(path: str | os.PathLike, progress: bool = True) -> LoadedModel:
    """Load an HF checkpoint directory (config.json, *.safetensors, tokenizer.json) or a .gguf file.
    `progress` is accepted for callers of earlier versions: no weight is read here any more, so the
    consumer of `weights` (the Engine's upload) is what shows progress."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return _load_hf_dir(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (llaisys loads an HF checkpoint directory with config.json "
                             f"and *.safetensors, or a .gguf file)")
    from .gguf import load_gguf

    config, weights, tokenizer, template, gen, formats = load_gguf(path)
    return LoadedModel(config, weights, tokenizer, template, gen, path, formats)


def _load_hf_dir(path: str) -> LoadedModel:
    from .safetensors import read_checkpoint_dir

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path}: no config.json (expected an HF checkpoint directory or a .gguf file)")
    config = ModelConfig.from_hf(read_json(config_file), config_file)
    tensors, file_of, spans = read_checkpoint_dir(path)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store a copy; the embedding is the weight
    for name in [n for n in tensors if n.endswith("rotary_emb.inv_freq")]:
        del tensors[name]  # a buffer older transformers saved; recomputed from rope_theta
    check_weight_shapes({n: t.shape for n, t in tensors.items()}, config, file_of)
    names = list(expected_weight_shapes(config))
    for name in names:
        if tensors[name].dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{file_of[name]}: tensor {name!r} has dtype {tensors[name].dtype}, expected float32, "
                             f"float16 or bfloat16")
    # views cost nothing until read; the consumer converts (or wraps) them one at a time
    weights = LazyWeights({n: (lambda a=tensors[n]: a) for n in names}, {n: spans[n] for n in names})
    # the config's dtype describes the weights as stored (config.json's "dtype" is sometimes stale)
    config = replace(config, dtype=_FLOAT_DTYPES[tensors[names[0]].dtype])  # the table lists the embedding first
    tokenizer = Tokenizer.from_hf_dir(path)
    chat_template = read_tokenizer_config(path).get("chat_template")
    gen = read_json(os.path.join(path, "generation_config.json")) or {}
    formats = {n: _FLOAT_DTYPES[tensors[n].dtype] for n in names}
    return LoadedModel(config, weights, tokenizer, chat_template, gen, path, formats)

