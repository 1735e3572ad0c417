"""Structured output in the Engine (json_schema / regex / grammar / choice through llguidance) with the real
default model on the CPU: every output obeys its constraint, a constraint that cannot finish within
max_new_tokens ends with "length", constrained rows batched with free ones give what they give alone, and a
bad constraint raises ValueError at submit without touching the requests already running."""
import json
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from llaisys.engine import Engine  # noqa: E402
from tiny_model import real_model_path, real_model_path_or_skip  # noqa: E402

pytestmark = pytest.mark.slow  # runs the real default model

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                    "minItems": 1, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def eng():
    e = Engine(real_model_path(), device="cpu", max_seq_len=1024, progress=False)
    yield e
    e.close()


def ask(eng, text):
    return eng.render_chat([{"role": "user", "content": text}])


def test_constrained_outputs_in_one_batch_with_free_rows(eng):
    prompts = [ask(eng, "Describe a person as JSON."), ask(eng, "Say hi."),
               ask(eng, "Give a date."), ask(eng, "Is the sky blue? yes or no"), ask(eng, "Pick a colour.")]
    out = eng.generate(prompts, max_new_tokens=[60, 8, 20, 8, 8], temperature=[0, 0, 0, 0.8, 0], seed=7,
                       json_schema=[PERSON, None, None, None, None],
                       regex=[None, None, r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", None, None],
                       choice=[None, None, None, ["yes", "no"], None],
                       grammar=[None, None, None, None, 'start: "red" | "green" | "blue"'])
    assert out[0].finish_reason == "stop", out[0].text
    jsonschema.validate(json.loads(out[0].text), PERSON)
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", out[2].text) and out[2].finish_reason == "stop"
    assert out[3].text in ("yes", "no") and out[3].finish_reason == "stop"
    assert out[4].text in ("red", "green", "blue") and out[4].finish_reason == "stop"
    # batched == alone (greedy rows; the sampled row draws from its own seed)
    alone = eng.generate(prompts[0], max_new_tokens=60, temperature=0, json_schema=PERSON)
    assert alone.token_ids == out[0].token_ids
    free = eng.generate(prompts[1], max_new_tokens=8, temperature=0)
    assert free.token_ids == out[1].token_ids
    sampled = eng.generate(prompts[3], max_new_tokens=8, temperature=0.8, seed=7, choice=["yes", "no"])
    assert sampled.token_ids == out[3].token_ids


def test_json_schema_text_and_any_object_stream(eng):
    chunks = list(eng.stream(ask(eng, "A JSON object with a key x."), max_new_tokens=40, temperature=0,
                             json_schema=json.dumps({"type": "object", "properties": {"x": {"type": "number"}},
                                                     "required": ["x"]})))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop" and isinstance(json.loads(text)["x"], (int, float))


def test_too_few_tokens_end_with_length_not_stop(eng):
    r = eng.generate(ask(eng, "Describe a person as JSON."), max_new_tokens=3, temperature=0, json_schema=PERSON)
    assert r.finish_reason == "length" and len(r.token_ids) == 3


@pytest.mark.parametrize("kw,match", [
    (dict(json_schema={"type": "intt"}), "json_schema.*intt"),
    (dict(json_schema="{not json"), "json_schema: not valid JSON"),
    (dict(json_schema=[1]), "json_schema must be"),
    (dict(regex="a(b"), "regex.*unclosed group"),
    (dict(grammar="start: foo"), "grammar.*foo"),
    (dict(choice=[]), "choice must be"),
    (dict(choice="yes"), "choice must be"),
    (dict(regex="a", choice=["a"]), "at most one"),
])
def test_bad_constraints_raise_at_submit_and_spare_the_others(eng, kw, match):
    running = eng.submit(ask(eng, "Count to five."), max_new_tokens=6, temperature=0, regex="[0-9, ]+")
    with pytest.raises(ValueError, match=match):
        eng.submit(ask(eng, "hi"), max_new_tokens=4, **kw)
    r = running.result()
    assert r.finish_reason in ("stop", "length") and re.fullmatch("[0-9, ]+", r.text)


@pytest.mark.cuda
def test_constrained_rows_on_cuda_beside_graphed_and_overlapped_ones():
    """On CUDA free rows decode in graphs and overlapped; a constrained row's steps are overlapped too, the
    graph running its forward and the masked sampling enqueued after the host's mask (sample_deferred):
    every output obeys its constraint, and each equals its request alone in f32 (bf16 GEMMs of other batch
    sizes may round differently)."""
    eng = Engine(real_model_path_or_skip(), device="cuda", dtype="f32", max_seq_len=1024, progress=False)
    try:
        prompts = [ask(eng, "Describe a person as JSON."), ask(eng, "Say hi."), ask(eng, "Give a date.")]
        kw = dict(max_new_tokens=[60, 24, 20], temperature=[0, 0, 0.7], seed=3,
                  json_schema=[PERSON, None, None], regex=[None, None, r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"])
        out = eng.generate(prompts, **kw)
        jsonschema.validate(json.loads(out[0].text), PERSON)
        assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", out[2].text)
        for i, p in enumerate(prompts):
            alone = eng.generate(p, **{k: (v[i] if isinstance(v, list) else v) for k, v in kw.items()})
            assert alone.token_ids == out[i].token_ids, i
    finally:
        eng.close()


def test_a_repeated_schema_is_compiled_once():
    from llaisys import constraints
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    first = constraints.compile_constraint(json_schema=schema)
    hits = constraints._compiled.cache_info().hits
    assert constraints.compile_constraint(json_schema=json.dumps(schema)) == first
    assert constraints._compiled.cache_info().hits == hits + 1
