"""The model configuration: a frozen, validated view of an HF config.json (or of GGUF metadata).

Which fields exist, each family's traits, where each field is read and every weight's name and shape are
the C++ core's architecture tables (cpp/models/arch/, `_core.architectures()`, `_core.weight_table()`): this
module reads a file through them and never lists a field or a weight itself.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from .. import _core

# config.json "dtype" (transformers >= 4.56) / "torch_dtype" -> our names
_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "bf16": "bf16", "f16": "f16", "f32": "f32"}
_INT_FIELDS_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def architectures() -> list[dict]:
    """Every architecture the core runs (name, hf_architectures, gguf_arch, defaults, keys)."""
    return _core.architectures()


def find_architecture(name: str | None) -> dict | None:
    """The architecture named by an HF `architectures` entry, a `model_type` or a GGUF general.architecture."""
    for a in architectures():
        if name == a["name"] or name == a["gguf_arch"] or name in a["hf_architectures"]:
            return a
    return None


def known_architectures() -> str:
    return ", ".join(a["hf_architectures"][0] for a in architectures())


@dataclass(frozen=True)
class ModelConfig:
    """`core`: every field of the C++ ModelConfig (what `_core.create_model` takes); the rest is what only
    Python needs. Attribute access reaches the core fields too: `config.hidden_size`."""
    core: dict
    max_position_embeddings: int
    dtype: str  # the stored weights' dtype: "bf16" | "f16" | "f32"
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    gguf_permuted_qk: bool = field(default=False, compare=False)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            value = self.core.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig: {name} must be a positive int, got {value!r}")
        m = self.max_position_embeddings
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"ModelConfig: max_position_embeddings must be a positive int, got {m!r}")
        if self.dtype not in ("bf16", "f16", "f32"):
            raise ValueError(f"ModelConfig: dtype must be bf16, f16 or f32, got {self.dtype!r}")
        _core.check_config(self.core)  # the core's own checks (ValueError naming the field)

    def __getattr__(self, name):  # only called when normal lookup fails: the core's fields
        core = self.__dict__.get("core")
        if core is not None and name in core:
            return core[name]
        raise AttributeError(f"ModelConfig has no field {name!r}")

    @property
    def arch(self) -> str:
        return self.core["arch"]

    @property
    def rms_norm_eps(self) -> float:  # the name earlier versions used
        return self.core["norm_eps"]

    @classmethod
    def from_hf(cls, d: dict, source: str) -> "ModelConfig":
        """Validate an HF config.json dict. `source` (the file) prefixes every error message."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        arch = _hf_architecture(d, source)
        core = dict(arch["defaults"])
        for fname, key, _ in arch["keys"]:
            if d.get(key) is not None:
                core[fname] = _typed(source, key, d[key], core[fname])
        for fname in _INT_FIELDS_REQUIRED:
            key = next(k for f, k, _ in arch["keys"] if f == fname)
            if d.get(key) is None:
                raise ValueError(f"{source}: config is missing {key!r}")
        _check_hf_traits(d, arch, source)
        reads_kv = any(f == "num_key_value_heads" for f, _, _ in arch["keys"])  # GPT-NeoX's table does not
        if d.get("num_key_value_heads") is None or not reads_kv:
            core["num_key_value_heads"] = core["num_attention_heads"]
        if d.get("head_dim") is None:
            heads, hidden = core["num_attention_heads"], core["hidden_size"]
            if hidden % heads:
                raise ValueError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
            core["head_dim"] = hidden // heads
        core.update(_rope(d, source, core["rope_theta"]))
        core.update(_layer_types(d, source, core))
        dtype_name = d.get("dtype") or d.get("torch_dtype") or "float32"  # HF's own default when absent
        if dtype_name not in _DTYPES:
            raise ValueError(f"{source}: dtype {dtype_name!r} is not supported (bfloat16, float16 or float32)")
        eos, bos = d.get("eos_token_id"), d.get("bos_token_id")
        if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)):
            raise ValueError(f"{source}: bos_token_id must be an integer, got {bos!r}")
        try:
            eos_ids = token_ids(eos)
        except ValueError:
            raise ValueError(f"{source}: eos_token_id must be an integer or a list of integers, got {eos!r}") from None
        max_pos = d.get("max_position_embeddings")
        if max_pos is None:
            raise ValueError(f"{source}: config is missing 'max_position_embeddings'")
        return cls(core=core, max_position_embeddings=_typed(source, "max_position_embeddings", max_pos, 0),
                   dtype=_DTYPES[dtype_name], bos_token_id=bos, eos_token_ids=eos_ids,
                   gguf_permuted_qk=arch["gguf_permuted_qk"])


def _hf_architecture(d: dict, source: str) -> dict:
    archs = d.get("architectures") or []
    for name in [*archs, d.get("model_type")]:
        arch = find_architecture(name)
        if arch is not None:
            return arch
    given = ", ".join(archs) if archs else d.get("model_type", "(none given)")
    raise ValueError(f"{source}: architecture {given} is not supported (llaisys runs {known_architectures()})")


# HF activation names -> the core's (transformers.activations: "gelu" is the erf form)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def _check_hf_traits(d: dict, arch: dict, source: str) -> None:
    """What the config asks for that the table cannot express, refused before any weight is read."""
    key = "hidden_act" if "hidden_act" in d else "hidden_activation"
    act = d.get(key)
    if act is not None and _ACTIVATIONS.get(act) != arch["defaults"]["activation"]:
        raise ValueError(f"{source}: {key} {act!r} is not supported ({arch['name']} runs "
                         f"{arch['defaults']['activation']})")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            raise ValueError(f"{source}: {key}={d[key]} is not supported (logit soft-capping)")
    if arch["name"] == "qwen2" and d.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported for Qwen2 (full attention only)")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if d.get(key):
            raise ValueError(f"{source}: {key}={d[key]}: mixture-of-experts models are not supported")


def _typed(source: str, key: str, value, default):
    """value checked against the type of the field's default (int() would turn 2.7 into 2: refuse it)."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{source}: {key} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{source}: {key} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{source}: {key} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{source}: {key} must be a string, got {value!r}")
    return value


def _rope(d: dict, source: str, theta: float) -> dict:
    """RoPE base and scaling. transformers 5 writes rope_parameters {rope_theta, rope_type, ...}; older files
    write rope_theta and rope_scaling (null unless scaled)."""
    out = {}
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per layer type (Gemma 3 in transformers 5)
        local = params.get("sliding_attention") or {}
        if local.get("rope_theta") is not None:
            out["rope_local_theta"] = _typed(source, "rope_parameters.sliding_attention.rope_theta",
                                             local["rope_theta"], 0.0)
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: a scaled RoPE on sliding-window layers is not supported")
        d = {**d, "rope_parameters": params["full_attention"]}
        params = d["rope_parameters"]
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        out["rope_theta"] = _typed(source, "rope_parameters.rope_theta", params["rope_theta"], 0.0)
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        out["partial_rotary_factor"] = _typed(source, "rope_parameters.partial_rotary_factor",
                                              params["partial_rotary_factor"], 0.0)
    for key in ("rope_scaling", "rope_parameters"):
        p = d.get(key)
        if p is None:
            continue
        if not isinstance(p, dict):
            raise ValueError(f"{source}: {key} must be an object, got {p!r}")
        kind = p.get("rope_type", p.get("type", "default"))
        if kind == "default":
            continue
        if kind not in ("linear", "llama3"):
            raise ValueError(f"{source}: {key} rope_type {kind!r} is not supported (default, linear, llama3)")
        out["rope_scaling"] = kind
        out["rope_factor"] = _typed(source, f"{key}.factor", p.get("factor"), 0.0)
        if kind == "llama3":
            for name, hf in (("rope_low_freq_factor", "low_freq_factor"), ("rope_high_freq_factor", "high_freq_factor")):
                out[name] = _typed(source, f"{key}.{hf}", p.get(hf), 0.0)
            out["rope_original_max_position_embeddings"] = _typed(
                source, f"{key}.original_max_position_embeddings", p.get("original_max_position_embeddings"), 0)
    return out


def _layer_types(d: dict, source: str, core: dict) -> dict:
    """transformers 5's layer_types (sliding_attention / full_attention per layer) as the core's window pattern:
    every Nth layer global. A layout the pattern cannot express is refused."""
    types = d.get("layer_types")
    if types is None:
        return {}
    n = core["num_hidden_layers"]
    if not isinstance(types, list) or len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"{source}: layer_types must list sliding_attention/full_attention for each of {n} layers")
    if "sliding_attention" not in types:
        return {"sliding_window": 0}
    pattern = types.index("full_attention") + 1 if "full_attention" in types else 0
    expected = ["full_attention" if pattern and (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    if types != expected:
        raise ValueError(f"{source}: layer_types {types} is not 'every Nth layer global', which llaisys runs")
    return {"sliding_window_pattern": pattern}


def token_ids(value) -> tuple[int, ...]:
    """An int, a list of ints or None -> a tuple of ints (ValueError for anything else)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in items):
        raise ValueError(f"token ids must be an int or a list of ints, got {value!r}")
    return tuple(items)


def weight_table(config: ModelConfig) -> list[tuple]:
    """[(HF name, GGUF name, shape, fusion group, tensor-parallel split dim, decoder role, layer or -1)] of
    every weight the model takes."""
    return _core.weight_table(config.core)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a checkpoint with this config must hold (HF names), with its shape."""
    return {hf: tuple(shape) for hf, _, shape, *_ in weight_table(config)}


def check_weight_shapes(found: dict[str, tuple[int, ...]], config: ModelConfig, file_of: dict[str, str],
                        gguf_names: dict[str, str] | None = None) -> None:
    """Strict loading: every expected weight present with its exact shape, nothing else. Raises ValueError
    naming the tensor (and its GGUF name when there is one) and the file."""
    expected = expected_weight_shapes(config)

    def label(name):
        alias = (gguf_names or {}).get(name)
        return f"{name!r} ({alias})" if alias else repr(name)

    for name, shape in found.items():
        if name not in expected:
            raise ValueError(f"{file_of[name]}: unexpected tensor {label(name)}: not a weight of a {config.arch} "
                             f"model with this config")
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


Qwen2Config = ModelConfig  # the name earlier versions exported
