"""Real shapes of every family and random weights of them: what `llaisys bench --shape` and the throughput
protocol run without a download, each weight a buffer of its own real size (aliased weights would let a CPU
model sit in cache and beat the roofline)."""
from __future__ import annotations

from typing import Iterator

import numpy as np

# Real shapes (HF config values; model_type picks the family, qwen2 when absent).
SHAPES = {
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                       rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=32768),
    "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=32768),
    "qwen2-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
                     rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=32768),
    "qwen2-72b": dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                      rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=32768),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=40960),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                         max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                         max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "pythia-1.4b": dict(model_type="gpt_neox", vocab_size=50304, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=24, num_attention_heads=16, rotary_pct=0.25, rotary_emb_base=10000,
                        layer_norm_eps=1e-5, use_parallel_residual=True, tie_word_embeddings=False,
                        max_position_embeddings=2048),
    "gemma-3-1b": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                       sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256, rope_theta=1e6,
                       rope_local_base_freq=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       max_position_embeddings=32768),
}
BYTES = {"bf16": 2, "f16": 2, "f32": 4}


def _model_config(c: dict):
    from llaisys.loader.config import ModelConfig

    return ModelConfig.from_hf({"model_type": "qwen2", **c}, "bench shape")


def weight_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """The HF-named weights of a model with HF config values `c` (the core's weight table)."""
    from llaisys.loader.config import expected_weight_shapes

    return expected_weight_shapes(_model_config(c))


def gguf_names(c: dict) -> dict[str, str]:
    """{HF name: GGUF name} of the weights of a model with HF config values `c` (the core's weight table)."""
    from llaisys.loader.config import weight_table

    return {hf: g for hf, g, *_ in weight_table(_model_config(c))}


def decode_weight_bytes(c: dict, dtype: str) -> int:
    """Bytes one decode step must read: every weight except the embedding table (one row is read)."""
    shapes = weight_shapes(c)
    embed = next(iter(shapes))  # the weight table lists the embedding first
    n = sum(int(np.prod(s)) for name, s in shapes.items() if name != embed)
    if c.get("tie_word_embeddings", False):
        n += c["vocab_size"] * c["hidden_size"]  # the LM head reads the whole table
    return n * BYTES[dtype]


# (bits, mantissa bits, exponent bias) of each float dtype, to draw random values as bit patterns
_FLOAT_BITS = {"bf16": (16, 7, 127), "f16": (16, 10, 15), "f32": (32, 23, 127)}


def random_weight(shape: tuple[int, ...], dtype: str, seed) -> np.ndarray:
    """A new buffer of `shape` in `dtype`, drawn from `seed` (an int or a tuple of ints). Values are random bit
    patterns: a random sign and mantissa with exponent 2^-7 or 2^-6, so |w| in [0.0078, 0.031) like an
    initialised model; 1.5B of them take seconds, not minutes."""
    bits, mantissa, bias = _FLOAT_BITS[dtype]
    uint = np.dtype(f"uint{bits}")
    keep = (1 << (bits - 1)) | (1 << mantissa) | ((1 << mantissa) - 1)  # sign, lowest exponent bit, mantissa
    exponent = (bias - 7) << mantissa  # bias - 7 is even, so the kept exponent bit picks 2^-7 or 2^-6
    n = int(np.prod(shape))
    w = np.random.default_rng(seed).bit_generator.random_raw(-(-n * bits // 64)).view(uint)[:n]
    w &= uint.type(keep)
    w |= uint.type(exponent)
    return w.view(_np_dtype(dtype)).reshape(shape)


def _np_dtype(dtype: str):
    import ml_dtypes

    return {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}[dtype]


def _random_or_ones(name: str, shape: tuple[int, ...], dtype: str, seed) -> np.ndarray:
    return np.ones(shape, _np_dtype(dtype)) if name.endswith("norm.weight") else random_weight(shape, dtype, seed)


def random_weights(c: dict, dtype: str, seed: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """(name, weight) for every weight of HF config `c`, one at a time, each a new buffer of its real size in
    `dtype` (norms 1), weight i drawn from (seed, i). Aliased weights (views of one pool) would let a CPU model
    sit in cache and beat the roofline."""
    for i, (name, shape) in enumerate(weight_shapes(c).items()):
        yield name, _random_or_ones(name, shape, dtype, (seed, i))


def random_loaded(c: dict, dtype: str, seed: int = 0, name: str = "random"):
    """A loader.LoadedModel of HF config `c` with the weights of random_weights (each made when the Engine
    takes it) and a tokenizer that knows no text (prompts are token ids; generated text is empty): what
    Engine.from_loaded runs for `llaisys bench --shape`."""
    from tokenizers import Tokenizer as HFTokenizer, models

    from llaisys.loader import LazyWeights, LoadedModel, ModelConfig
    from llaisys.tokenizer import Tokenizer

    config = ModelConfig.from_hf({"model_type": "qwen2", **c, "dtype": dtype}, f"{name} shape")
    makers = {n: (lambda n=n, s=s, i=i: _random_or_ones(n, s, dtype, (seed, i)))
              for i, (n, s) in enumerate(weight_shapes(c).items())}
    tokenizer = Tokenizer(HFTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    return LoadedModel(config, LazyWeights(makers, {}), tokenizer, None, {}, name)
