"""Loading a Qwen2-family model: an HF safetensors directory or a GGUF file -> config, weights, tokenizer.

    m = loader.load("/models/Qwen2.5-0.5B-Instruct")         # config.json + *.safetensors + tokenizer.json
    m = loader.load("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    m.weights["model.layers.0.self_attn.q_proj.weight"]        # numpy, HF names and shapes

Loading is strict: the expected weights (names and shapes) come from the config, and a missing, unknown or
mis-shaped tensor, or a non-float one, raises ValueError naming the tensor and the file. Safetensors
weights are zero-copy views of a read-only mmap in their stored dtype; GGUF weights are dequantized to
float32.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np

from ..tokenizer import Tokenizer, read_json, read_tokenizer_config
from .config import Qwen2Config, check_weight_shapes, expected_weight_shapes

__all__ = ["LoadedModel", "Qwen2Config", "load", "expected_weight_shapes"]

_FLOAT_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(ml_dtypes.bfloat16): "bf16"}


@dataclass
class LoadedModel:
    config: Qwen2Config
    weights: dict[str, np.ndarray]  # HF names; lm_head.weight only when untied
    tokenizer: Tokenizer
    chat_template: str | None
    generation_config: dict  # generation_config.json, or the bos/eos/pad ids of a GGUF file
    source: str  # the path loaded


def load(path: str | os.PathLike, progress: bool = True) -> LoadedModel:
    """Load an HF checkpoint directory (config.json, *.safetensors, tokenizer.json) or a .gguf file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return _load_hf_dir(path, progress)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (llaisys loads an HF checkpoint directory with config.json "
                             f"and *.safetensors, or a .gguf file)")
    from .gguf import load_gguf

    config, weights, tokenizer, template, gen = load_gguf(path, progress)
    return LoadedModel(config, weights, tokenizer, template, gen, path)


def _load_hf_dir(path: str, progress: bool) -> LoadedModel:
    from tqdm import tqdm

    from .safetensors import read_checkpoint_dir

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path}: no config.json (expected an HF checkpoint directory or a .gguf file)")
    config = Qwen2Config.from_hf(read_json(config_file), config_file)
    tensors, file_of = read_checkpoint_dir(path)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store a copy; the embedding is the weight
    for name in [n for n in tensors if n.endswith("rotary_emb.inv_freq")]:
        del tensors[name]  # a buffer older transformers saved; recomputed from rope_theta
    check_weight_shapes({n: t.shape for n, t in tensors.items()}, config, file_of)
    weights = {}
    for name in tqdm(list(expected_weight_shapes(config)), desc=f"reading {os.path.basename(path)}",
                     unit="tensor", disable=not progress, file=sys.stderr, leave=False):
        array = tensors[name]
        if array.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{file_of[name]}: tensor {name!r} has dtype {array.dtype}, expected float32, float16 "
                             f"or bfloat16")
        weights[name] = array
    # the config's dtype describes the weights as stored (config.json's "dtype" is sometimes stale)
    config = replace(config, dtype=_FLOAT_DTYPES[weights["model.embed_tokens.weight"].dtype])
    tokenizer = Tokenizer.from_hf_dir(path)
    chat_template = read_tokenizer_config(path).get("chat_template")
    gen = read_json(os.path.join(path, "generation_config.json")) or {}
    return LoadedModel(config, weights, tokenizer, chat_template, gen, path)

