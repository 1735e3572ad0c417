"""Sampling policy: merge the user's sampling arguments with the model's generation_config.json.

An argument left as None takes the model's value, with Hugging Face semantics: when the config does not ask for
sampling (``do_sample`` false or absent) generation is greedy unless the user sets a temperature > 0; keys the
config lacks take HF's defaults. temperature 0 means exact greedy (argmax).
"""
from __future__ import annotations

import difflib
import inspect
import math
import numbers
from dataclasses import dataclass

import numpy as np

from .constraints import compile_constraint

DEFAULT_MAX_NEW_TOKENS = 256
# HF GenerationConfig defaults, used when generation_config.json lacks a key.
HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
_INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20  # top alternatives reported per token, as OpenAI allows
# The kernels read temperature, top_p, min_p and the penalties as float32: a value that is finite as a Python
# float may be inf or 0 there (1e39, 1e-300), or a subnormal that flush-to-zero makes 0 on the GPU. The rules
# below are checked on the float32 value too, so the kernels never see what the policy refused.
F32_MIN = float(np.finfo(np.float32).tiny)  # the smallest normal float32, ~1.18e-38
F32_MAX = float(np.finfo(np.float32).max)  # ~3.40e38


def as_f32(value: float) -> float:
    """value as the float32 the kernels read (inf beyond float32's range), back as a Python float."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(value))


def _f32_normal(value: float) -> bool:
    return F32_MIN <= as_f32(value) <= F32_MAX


@dataclass(frozen=True)
class SamplingParams:
    """Resolved, validated sampling settings for one request. top_k 0 and min_p 0 mean off."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    seed: int | None
    ignore_eos: bool
    presence_penalty: float = 0.0   # OpenAI: subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence of a token already generated
    min_tokens: int = 0             # EOS and stop_token_ids are banned until this many tokens are generated
    logprobs: int | None = None     # None = off; k = the chosen token's logprob and the k most likely
    # StreamingLLM (not sampling, but per request like it): None = the engine's default (EngineConfig)
    kv_window: int | None = None    # tokens kept besides the sinks; 0 = dense (no window)
    sink_tokens: int | None = None  # first tokens always kept (attention sinks)
    constraint: str | None = None   # structured output: an llguidance grammar (constraints.compile_constraint)
    # the constraint starts after the output's first token of this text (one token of the vocabulary), the
    # text before it free: tool_choice "auto" (the call grammar once the model opens <tool_call>)
    grammar_trigger: str | None = None
    # a grammar the whole output follows if its first token starts it (else the output is free): an llguidance
    # grammar like `constraint` (tool_choice "auto": a bare JSON call)
    opening_grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _bad(name: str, value, rule: str, from_config: bool) -> ValueError:
    where = " (from generation_config.json)" if from_config else ""
    return ValueError(f"{name} must be {rule}, got {value!r}{where}")


def _real(name, value, ok, rule, from_config=False) -> float:
    try:
        f = float(value) if _is_real(value) else math.nan
    except OverflowError:  # an int beyond a float's range (10**400)
        f = math.nan
    if math.isnan(f) or not ok(f):
        raise _bad(name, value, rule, from_config)
    return f


def _int(name, value, ok, rule, from_config=False) -> int:
    if not _is_int(value) or not ok(int(value)):
        raise _bad(name, value, rule, from_config)
    return int(value)


_F32_RANGE = "[1.2e-38, 3.4e38] (float32's normal range)"
_CHECKS = {
    "temperature": (_real, lambda v: v == 0.0 or (0.0 < v < math.inf and _f32_normal(v)),
                    f"a finite number >= 0 (0 = greedy): 0 or in {_F32_RANGE}"),
    "top_k": (_int, lambda v: 0 <= v <= _INT32_MAX, "an int >= 0 (0 = off)"),
    "top_p": (_real, lambda v: 0.0 < v <= 1.0 and _f32_normal(v), "in (0, 1] (1 = off) and at least 1.2e-38 "
              "(float32's smallest normal number)"),
    "min_p": (_real, lambda v: 0.0 <= v <= 1.0, "in [0, 1] (0 = off)"),
    "repetition_penalty": (_real, lambda v: 0.0 < v < math.inf and _f32_normal(v),
                           f"a finite number > 0 (1 = off) in {_F32_RANGE}"),
    "max_new_tokens": (_int, lambda v: v >= 1, "an int >= 1"),
    "presence_penalty": (_real, lambda v: -2.0 <= v <= 2.0, "in [-2, 2] (0 = off)"),
    "frequency_penalty": (_real, lambda v: -2.0 <= v <= 2.0, "in [-2, 2] (0 = off)"),
    "min_tokens": (_int, lambda v: v >= 0, "an int >= 0"),
    "logprobs": (_int, lambda v: 0 <= v <= MAX_LOGPROBS, f"None or an int in [0, {MAX_LOGPROBS}]"),
    "kv_window": (_int, lambda v: v >= 0, "None or an int >= 0 (0 = no window)"),
    "sink_tokens": (_int, lambda v: v >= 0, "None or an int >= 0"),
}


def _check(name: str, value, from_config: bool = False):
    kind, ok, rule = _CHECKS[name]
    return kind(name, value, ok, rule, from_config)


def _from_config(gc: dict, name: str, default):
    """The config's value for `name` (validated), or `default` when absent or null."""
    value = gc.get(name)
    return default if value is None else _check(name, value, from_config=True)


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
    return tuple(dict.fromkeys(items))  # drop duplicates, keep order


def _token_ids(ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    items = [ids] if _is_int(ids) else ids
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop_token_ids must be an int or a list of ints, got {ids!r}")
    for t in items:
        if not _is_int(t) or t < 0:
            raise ValueError(f"stop_token_ids must be ints >= 0, got {t!r}")
    return tuple(dict.fromkeys(int(t) for t in items))


def _seed(seed) -> int | None:
    if seed is None:
        return None
    if not _is_int(seed) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return int(seed)


def _temperature(gc: dict, temperature) -> float:
    if temperature is not None:
        return _check("temperature", temperature)
    if not gc.get("do_sample"):
        return 0.0  # HF: no do_sample in the config means greedy decoding
    return _from_config(gc, "temperature", HF_DEFAULTS["temperature"])


def resolve_sampling(generation_config: dict | None, *, max_new_tokens=None, temperature=None, top_k=None,
                     top_p=None, min_p=None, repetition_penalty=None, stop=None, stop_token_ids=None, seed=None,
                     ignore_eos=False, presence_penalty=None, frequency_penalty=None, min_tokens=None,
                     logprobs=None, kv_window=None, sink_tokens=None, json_schema=None, regex=None, grammar=None,
                     choice=None, grammar_trigger=None, opening_grammar=None) -> SamplingParams:
    """Sampling settings for one request: each argument left as None comes from `generation_config`
    (the model's generation_config.json as a dict), else from HF's defaults. Raises ValueError naming the
    parameter for an invalid value. User stop_token_ids are added to the EOS set by the engine.
    presence/frequency penalties, min_tokens and logprobs have no generation_config counterpart (0 / off).
    logprobs are the log-softmax of the logits the token was drawn from: after the penalties and the
    temperature, before top-k/top-p/min-p (vLLM's default); greedy rows use temperature 1. kv_window and
    sink_tokens (StreamingLLM's rolling KV window) are left None for the engine's defaults.
    json_schema / regex / grammar (Lark) / choice (a list of strings): at most one, the structured output
    the request must produce (constraints.py), compiled and checked here. grammar_trigger: the text of one
    token after whose first occurrence in the output that constraint applies (free text before it).
    opening_grammar (Lark): the output follows it when its first token (not blank) is one it accepts, else
    the output is free."""
    gc = dict(generation_config or {})
    constraint = compile_constraint(json_schema, regex, grammar, choice)
    if grammar_trigger is not None and (not isinstance(grammar_trigger, str) or not grammar_trigger or
                                        constraint is None):
        raise ValueError(f"grammar_trigger must be a non-empty string given with json_schema, regex, grammar "
                         f"or choice, got {grammar_trigger!r}")

    def pick(name, value):
        return _check(name, value) if value is not None else _from_config(gc, name, HF_DEFAULTS[name])

    if not isinstance(ignore_eos, bool):
        raise ValueError(f"ignore_eos must be True or False, got {ignore_eos!r}")
    return SamplingParams(
        max_new_tokens=(_check("max_new_tokens", max_new_tokens) if max_new_tokens is not None
                        else _from_config(gc, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
        temperature=_temperature(gc, temperature),
        top_k=pick("top_k", top_k),
        top_p=pick("top_p", top_p),
        min_p=pick("min_p", min_p),
        repetition_penalty=pick("repetition_penalty", repetition_penalty),
        stop=_stops(stop),
        stop_token_ids=_token_ids(stop_token_ids),
        seed=_seed(seed),
        ignore_eos=ignore_eos,
        presence_penalty=0.0 if presence_penalty is None else _check("presence_penalty", presence_penalty),
        frequency_penalty=0.0 if frequency_penalty is None else _check("frequency_penalty", frequency_penalty),
        min_tokens=0 if min_tokens is None else _check("min_tokens", min_tokens),
        logprobs=None if logprobs is None else _check("logprobs", logprobs),
        kv_window=None if kv_window is None else _check("kv_window", kv_window),
        sink_tokens=None if sink_tokens is None else _check("sink_tokens", sink_tokens),
        constraint=constraint,
        grammar_trigger=grammar_trigger,
        opening_grammar=None if opening_grammar is None else compile_constraint(grammar=opening_grammar),
    )


SAMPLING_ARGS = tuple(inspect.signature(resolve_sampling).parameters)[1:]
# Names other APIs use for our arguments (OpenAI, llama.cpp, HF pipelines)
_ALIASES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "n_predict": "max_new_tokens",
            "max_length": "max_new_tokens", "stop_sequences": "stop", "repeat_penalty": "repetition_penalty",
            "random_seed": "seed"}


def check_sampling_names(call: str, kwargs: dict) -> None:
    """Raise TypeError naming the public `call` for a keyword that is not a sampling argument, with the
    accepted names and a suggestion when the name looks like one of them."""
    for name in kwargs:
        if name in SAMPLING_ARGS:
            continue
        guess = _ALIASES.get(name) or next(iter(difflib.get_close_matches(name, SAMPLING_ARGS, n=1)), None)
        hint = f"; did you mean {guess}?" if guess else ""
        raise TypeError(f"{call}() got an unexpected keyword argument {name!r}{hint} (sampling arguments: "
                        f"{', '.join(SAMPLING_ARGS)})")


def eos_union(generation_config: dict | None, tokenizer_eos_ids, extra=()) -> tuple[int, ...]:
    """Token ids that end generation: generation_config's eos_token_id (an int or a list), the tokenizer's
    EOS ids and `extra` (the user's stop_token_ids), without duplicates, in that order."""
    out: list[int] = []
    for source in ((generation_config or {}).get("eos_token_id"), tokenizer_eos_ids, extra):
        if source is None:
            continue
        for t in ([source] if _is_int(source) else source):
            if not _is_int(t) or t < 0:
                raise ValueError(f"EOS token ids must be ints >= 0, got {t!r}")
            if int(t) not in out:
                out.append(int(t))
    return tuple(out)
