"""The model configuration: a frozen, validated view of an HF config.json (or of GGUF metadata)."""
from __future__ import annotations

import os
from dataclasses import dataclass

# config.json "dtype" (transformers >= 4.56) / "torch_dtype" -> our names
_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "bf16": "bf16", "f16": "f16", "f32": "f32"}
_ARCH = "Qwen2ForCausalLM"


@dataclass(frozen=True)
class Qwen2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    dtype: str  # the stored weights' dtype: "bf16" | "f16" | "f32"
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Qwen2Config: {name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"Qwen2Config: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"Qwen2Config: rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps}, "
                             f"{self.rope_theta}")
        if self.dtype not in ("bf16", "f16", "f32"):
            raise ValueError(f"Qwen2Config: dtype must be bf16, f16 or f32, got {self.dtype!r}")

    @classmethod
    def from_hf(cls, d: dict, source: str) -> "Qwen2Config":
        """Validate an HF config.json dict. `source` (the file) prefixes every error message."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        archs = d.get("architectures") or []
        if d.get("model_type") != "qwen2" and _ARCH not in archs:
            arch = ", ".join(archs) if archs else d.get("model_type", "(none given)")
            raise ValueError(f"{source}: architecture {arch} is not supported, llaisys runs Qwen2-family models")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {d['hidden_act']!r} is not supported (Qwen2 uses silu)")
        if d.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported (full attention only)")

        def need(key):
            if d.get(key) is None:
                raise ValueError(f"{source}: config is missing {key!r}")
            return d[key]

        def integer(key, value):  # int() would turn 2.7 into 2 and "64" into 64: refuse both
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{source}: {key} must be an integer, got {value!r}")
            return value

        def real(key, value):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{source}: {key} must be a number, got {value!r}")
            return float(value)

        def required_int(key):
            return integer(key, need(key))

        def optional_int(key, default):
            return default if d.get(key) is None else integer(key, d[key])

        heads, hidden = required_int("num_attention_heads"), required_int("hidden_size")
        if d.get("head_dim") is None and hidden % heads:
            raise ValueError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        dtype_name = d.get("dtype") or d.get("torch_dtype") or "float32"  # HF's own default when absent
        if dtype_name not in _DTYPES:
            raise ValueError(f"{source}: dtype {dtype_name!r} is not supported (bfloat16, float16 or float32)")
        tie = d.get("tie_word_embeddings", False)  # Qwen2Config's default
        if not isinstance(tie, bool):
            raise ValueError(f"{source}: tie_word_embeddings must be true or false, got {tie!r}")
        eos, bos = d.get("eos_token_id"), optional_int("bos_token_id", None)
        try:
            eos_ids = token_ids(eos)
        except ValueError:
            raise ValueError(f"{source}: eos_token_id must be an integer or a list of integers, got {eos!r}") from None
        return cls(
            vocab_size=required_int("vocab_size"), hidden_size=hidden,
            intermediate_size=required_int("intermediate_size"), num_hidden_layers=required_int("num_hidden_layers"),
            num_attention_heads=heads, num_key_value_heads=optional_int("num_key_value_heads", heads),
            head_dim=optional_int("head_dim", hidden // heads),
            max_position_embeddings=required_int("max_position_embeddings"),
            rms_norm_eps=real("rms_norm_eps", need("rms_norm_eps")),
            rope_theta=real("rope_theta", _rope_theta(d, source)),
            tie_word_embeddings=tie, dtype=_DTYPES[dtype_name], bos_token_id=bos, eos_token_ids=eos_ids)


def _rope_theta(d: dict, source: str):
    """Plain RoPE only. transformers 5 writes rope_parameters {rope_theta, rope_type}; older files write
    rope_theta and rope_scaling (null unless scaled)."""
    for key in ("rope_scaling", "rope_parameters"):
        params = d.get(key)
        if params is None:
            continue
        kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else params
        if kind != "default":
            raise ValueError(f"{source}: {key} {params!r} is not supported (llaisys implements plain RoPE)")
    params = d.get("rope_parameters") or {}
    return params.get("rope_theta", d.get("rope_theta", 10000.0))  # 10000: Qwen2Config's default


def token_ids(value) -> tuple[int, ...]:
    """An int, a list of ints or None -> a tuple of ints (ValueError for anything else)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in items):
        raise ValueError(f"token ids must be an int or a list of ints, got {value!r}")
    return tuple(items)


def expected_weight_shapes(config: Qwen2Config) -> dict[str, tuple[int, ...]]:
    """Every weight a Qwen2 checkpoint with this config must hold (HF names), with its shape."""
    c = config
    H, I, V = c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (V, H)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q, H), p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, H), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (H, q),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
        })
    shapes["model.norm.weight"] = (H,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def check_weight_shapes(found: dict[str, tuple[int, ...]], config: Qwen2Config, file_of: dict[str, str],
                        gguf_names: dict[str, str] | None = None) -> None:
    """Strict loading: every expected weight present with its exact shape, nothing else. Raises ValueError
    naming the tensor (and its GGUF name when there is one) and the file."""
    expected = expected_weight_shapes(config)

    def label(name):
        alias = (gguf_names or {}).get(name)
        return f"{name!r} ({alias})" if alias else repr(name)

    for name, shape in found.items():
        if name not in expected:
            raise ValueError(f"{file_of[name]}: unexpected tensor {label(name)}: not a weight of a Qwen2 model "
                             f"with this config")
        if tuple(shape) != expected[name]:
            raise ValueError(f"{file_of[name]}: tensor {label(name)} has shape {list(shape)}, expected "
                             f"{list(expected[name])} from the config")
    missing = [name for name in expected if name not in found]
    if missing:
        files = sorted(set(file_of.values()))
        where = files[0] if len(files) == 1 else "the checkpoint"
        if len(files) > 1:
            where = f"{os.path.dirname(files[0])} ({len(files)} files)"
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"{where}: missing tensor {missing[0]!r}{more}")
