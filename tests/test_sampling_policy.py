"""Sampling policy: merging user arguments with generation_config.json (HF semantics), validation messages,
and the EOS set."""
import dataclasses
import math

import numpy as np
import pytest

from llaisys.sampling import DEFAULT_MAX_NEW_TOKENS, HF_DEFAULTS, SamplingParams, eos_union, resolve_sampling

# generation_config.json of Qwen2.5-Coder-0.5B-Instruct
QWEN_GC = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
           "repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.8, "top_k": 20}


def test_hf_defaults_are_transformers_defaults():
    transformers = pytest.importorskip("transformers")
    hf = transformers.GenerationConfig._get_default_generation_params()
    for key in ("temperature", "top_k", "top_p", "repetition_penalty"):
        assert HF_DEFAULTS[key] == hf[key], key
    assert hf["do_sample"] is False and HF_DEFAULTS["min_p"] == 0.0  # min_p is off unless set


def test_model_config_is_used_when_the_user_gives_nothing():
    p = resolve_sampling(QWEN_GC)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (0.7, 20, 0.8, 0.0, 1.1)
    assert p.max_new_tokens == DEFAULT_MAX_NEW_TOKENS == 256
    assert (p.stop, p.stop_token_ids, p.seed, p.ignore_eos) == ((), (), None, False)
    assert not p.greedy


@pytest.mark.parametrize("gc", [{}, None, {"do_sample": False, "temperature": 0.7, "top_k": 20},
                                {"temperature": 0.9}])
def test_without_do_sample_generation_is_greedy(gc):
    p = resolve_sampling(gc)
    assert p.temperature == 0.0 and p.greedy
    assert p.top_k == (gc or {}).get("top_k", 50) and p.top_p == 1.0 and p.repetition_penalty == 1.0


def test_user_temperature_turns_sampling_on_with_the_config_filters():
    p = resolve_sampling({"do_sample": False, "top_k": 20, "top_p": 0.8}, temperature=0.6)
    assert (p.temperature, p.top_k, p.top_p) == (0.6, 20, 0.8)
    assert resolve_sampling({"do_sample": False}, temperature=0.6).top_k == 50  # HF default


def test_user_temperature_zero_is_greedy_even_when_the_config_samples():
    p = resolve_sampling(QWEN_GC, temperature=0)
    assert p.greedy and isinstance(p.temperature, float)


def test_do_sample_without_temperature_uses_hf_default_and_nulls_mean_absent():
    p = resolve_sampling({"do_sample": True, "temperature": None, "top_k": None, "top_p": None,
                          "repetition_penalty": None, "min_p": None})
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (1.0, 50, 1.0, 0.0, 1.0)


def test_user_values_override_the_config():
    p = resolve_sampling(QWEN_GC, max_new_tokens=7, temperature=1.3, top_k=0, top_p=1.0, min_p=0.05,
                         repetition_penalty=1.0, stop="###", stop_token_ids=[5, 9, 5], seed=1234, ignore_eos=True)
    assert p == SamplingParams(max_new_tokens=7, temperature=1.3, top_k=0, top_p=1.0, min_p=0.05,
                               repetition_penalty=1.0, stop=("###",), stop_token_ids=(5, 9), seed=1234,
                               ignore_eos=True)


def test_max_new_tokens_from_the_config_and_numpy_scalars():
    assert resolve_sampling({"max_new_tokens": 33}).max_new_tokens == 33
    p = resolve_sampling({}, max_new_tokens=np.int64(5), temperature=np.float32(0.5), top_k=np.int32(3),
                         seed=np.uint64(2**63 + 1), stop_token_ids=np.int64(4))
    assert (p.max_new_tokens, p.top_k, p.seed, p.stop_token_ids) == (5, 3, 2**63 + 1, (4,))
    assert type(p.max_new_tokens) is int and type(p.temperature) is float and type(p.seed) is int


@pytest.mark.parametrize("stop, expected", [
    (None, ()), ("\n\n", ("\n\n",)), (["a", "b", "a"], ("a", "b")), (("x",), ("x",)), ([], ()),
    (["<|im_end|>", "😀"], ("<|im_end|>", "😀")),
])
def test_stop_strings(stop, expected):
    assert resolve_sampling({}, stop=stop).stop == expected


def test_params_are_frozen():
    p = resolve_sampling({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), r"temperature must be a finite number >= 0 .*got -0\.1"),
    (dict(temperature=math.nan), "temperature .*got nan"),
    (dict(temperature=math.inf), "temperature .*got inf"),
    (dict(temperature="0.5"), "temperature .*got '0.5'"),
    (dict(temperature=True), "temperature .*got True"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\] .*got 0\.0"),
    (dict(top_p=1.5), r"top_p .*got 1\.5"),
    (dict(top_p=-0.2), r"top_p .*got -0\.2"),
    (dict(top_p=math.nan), "top_p .*got nan"),
    (dict(top_k=-1), "top_k must be an int >= 0 .*got -1"),
    (dict(top_k=2.5), r"top_k .*got 2\.5"),
    (dict(top_k=4.0), r"top_k .*got 4\.0"),
    (dict(top_k=True), "top_k .*got True"),
    (dict(top_k=2**40), "top_k .*got 1099511627776"),
    (dict(min_p=-0.01), r"min_p must be in \[0, 1\] .*got -0\.01"),
    (dict(min_p=1.01), r"min_p .*got 1\.01"),
    (dict(min_p=math.nan), "min_p .*got nan"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be a finite number > 0 .*got 0\.0"),
    (dict(repetition_penalty=-1), "repetition_penalty .*got -1"),
    (dict(repetition_penalty=math.nan), "repetition_penalty .*got nan"),
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
    (dict(max_new_tokens=-3), "max_new_tokens .*got -3"),
    (dict(max_new_tokens=8.0), r"max_new_tokens .*got 8\.0"),
    (dict(stop=""), "stop strings must be non-empty strings, got ''"),
    (dict(stop=["ok", ""]), "stop strings must be non-empty .*got ''"),
    (dict(stop=["ok", 3]), "stop strings .*got 3"),
    (dict(stop=7), "stop must be a string or a list of strings, got 7"),
    (dict(stop_token_ids=[1, -2]), "stop_token_ids must be ints >= 0, got -2"),
    (dict(stop_token_ids=["1"]), "stop_token_ids .*got '1'"),
    (dict(stop_token_ids=[True]), "stop_token_ids .*got True"),
    (dict(stop_token_ids="5"), "stop_token_ids must be an int or a list of ints, got '5'"),
    (dict(seed=1.5), r"seed must be an int in \[0, 2\*\*64\), got 1\.5"),
    (dict(seed="42"), "seed .*got '42'"),
    (dict(seed=-1), "seed .*got -1"),
    (dict(seed=2**64), "seed .*got 18446744073709551616"),
    (dict(seed=False), "seed .*got False"),
    (dict(ignore_eos="yes"), "ignore_eos must be True or False, got 'yes'"),
])
def test_invalid_values_name_the_parameter_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_sampling(QWEN_GC, **kwargs)


@pytest.mark.parametrize("gc, match", [
    ({"do_sample": True, "temperature": -1}, "temperature .*got -1 .from generation_config.json"),
    ({"top_p": 0}, "top_p .*from generation_config.json"),
    ({"top_k": "20"}, "top_k .*from generation_config.json"),
    ({"repetition_penalty": 0}, "repetition_penalty .*from generation_config.json"),
    ({"max_new_tokens": 0}, "max_new_tokens .*from generation_config.json"),
])
def test_invalid_config_values_say_where_they_came_from(gc, match):
    with pytest.raises(ValueError, match=match):
        resolve_sampling(gc)


def test_a_user_value_replaces_a_bad_config_value():
    assert resolve_sampling({"top_p": 0}, top_p=0.9).top_p == 0.9


@pytest.mark.parametrize("gc, tok, extra, expected", [
    (QWEN_GC, (151645,), (), (151645, 151643)),
    ({"eos_token_id": 2}, [2, 7], [9], (2, 7, 9)),
    ({"eos_token_id": None}, (), (), ()),
    ({}, None, (3,), (3,)),
    (None, (1,), (1, 4), (1, 4)),
    ({"eos_token_id": np.int64(5)}, (np.int32(6),), (), (5, 6)),
])
def test_eos_union(gc, tok, extra, expected):
    got = eos_union(gc, tok, extra)
    assert got == expected and all(type(t) is int for t in got)


def test_eos_union_rejects_bad_ids():
    with pytest.raises(ValueError, match="EOS token ids must be ints >= 0, got -1"):
        eos_union({"eos_token_id": -1}, (), ())
    with pytest.raises(ValueError, match="EOS token ids .*got 'x'"):
        eos_union({}, ("x",), ())
