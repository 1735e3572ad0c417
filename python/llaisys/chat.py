"""Chat templates: render a conversation to the prompt text the model was trained on.

Renders exactly as transformers' ``apply_chat_template(..., tokenize=False)`` does (same jinja2 sandbox, options,
filters and globals), without importing transformers:

    text = render_chat_template(template, [{"role": "user", "content": "Hi"}], eos_token="<|im_end|>")

Templates come from model files (untrusted), so they run in jinja2's immutable sandbox, with bounds: a render
stops after TIME_LIMIT_S seconds (checked at every loop iteration, call and output piece), range() and
integer arguments of calls are capped at MAX_RANGE, and strings/lists built by the template, as well as its
output, at MAX_CHARS. Every failure, a broken bound included, is a ValueError with a message a user can act on.
"""
from __future__ import annotations

import contextvars
import functools
import json
import time
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .engine_args import check_text

TIME_LIMIT_S = 10.0  # real templates render in milliseconds
MAX_RANGE = 100_000  # jinja's own sandbox range() cap
MAX_CHARS = 4 << 20  # characters: many times the text of the longest Qwen2 context

# Names a message's reasoning may be given under; transformers copies it to the first two, which templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """raise_exception() called by the template itself: its message goes to the user unchanged."""


def _raise_exception(message):
    raise _TemplateRaised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers replaces jinja's tojson, which HTML-escapes and always sorts keys
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in transformers;
    when rendering a prompt it only outputs its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateDict:
    # As in transformers: `dict` without attribute access to the builtin type.
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # As in transformers: a namespace() that refuses underscore names (a path to interpreter internals).
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _LimitExceeded(Exception):
    pass


_DEADLINE: contextvars.ContextVar[float] = contextvars.ContextVar("chat_template_deadline", default=float("inf"))


def _tick() -> None:
    if time.monotonic() > _DEADLINE.get():
        raise _LimitExceeded(f"it ran longer than {TIME_LIMIT_S:g} s")


def _check_size(value):
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_CHARS:
        raise _LimitExceeded(f"it built a {type(value).__name__} of {len(value)} items (limit {MAX_CHARS})")
    return value


def _check_args(args, kwargs) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and abs(a) > MAX_RANGE:
            raise _LimitExceeded(f"it passed {a} to a function (integer arguments are limited to {MAX_RANGE})")


def _range(*args):
    _check_args(args, {})
    return range(*args)


def _bounded_iter(iterable):
    """Every {% for %} loop iterates through this (see _instrument): a deadline check per iteration."""
    return _TimedIterable(iterable)


class _TimedIterable:
    def __init__(self, iterable):
        self._source = iterable

    def __len__(self):  # loop.length / loop.last stay as cheap as without the wrapper
        return len(self._source)

    def __iter__(self):
        for item in self._source:
            _tick()
            yield item


def _bounded_concat(*parts) -> str:
    return _check_size("".join(map(str, parts)))  # the `~` operator, as jinja's str_join does it


def _bounded_filter(f):
    @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marks
    def wrapper(*args, **kwargs):
        _tick()
        _check_args(args[1:], kwargs)
        return _check_size(f(*args, **kwargs))
    return wrapper


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox plus time and size bounds on operators and calls."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator, left, right):
        _tick()
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_CHARS:
                raise _LimitExceeded(f"it repeated a {type(seq).__name__} {n} times (limit {MAX_CHARS} items)")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right > 4096:
                raise _LimitExceeded(f"it computed {left} ** {right}")
        return _check_size(super().call_binop(context, operator, left, right))

    def call(self, context, obj, /, *args, **kwargs):
        _tick()
        _check_args(args, kwargs)
        return _check_size(super().call(context, obj, *args, **kwargs))


def _instrument(ast: jinja2.nodes.Template) -> jinja2.nodes.Template:
    """Route loops and `~` through the bounded helpers: the sandbox has no hook for either."""
    def call(name, args, lineno):
        return jinja2.nodes.Call(jinja2.nodes.Name(name, "load", lineno=lineno), args, [], None, None,
                                 lineno=lineno)

    for loop in ast.find_all(jinja2.nodes.For):
        loop.iter = call("__bounded_iter", [loop.iter], loop.lineno)
    for concat in ast.find_all(jinja2.nodes.Concat):
        concat.nodes = [call("__bounded_concat", concat.nodes, concat.lineno)]
    ast.set_environment(ast.environment)
    return ast


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace, range=_range, __bounded_iter=_bounded_iter,
                       __bounded_concat=_bounded_concat)
    try:
        return env.from_string(_instrument(env.parse(template)))
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat template is invalid: {e.message} (template line {e.lineno})") from None


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts like {{'role': 'user', 'content': 'Hi'}}, "
                         f"got {_short(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {_short(m)}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {i} needs a 'role' string (system, user, assistant or tool), "
                             f"got {_short(role)}")
        if "content" not in m:
            raise ValueError(f"message {i} (role {role!r}) has no 'content'")
        content = m["content"]
        if content is None and role == "assistant":
            continue  # an assistant turn that only calls tools; the template decides whether it accepts it
        if not isinstance(content, str):
            raise ValueError(f"message {i} (role {role!r}): content must be a string, got {_short(content)}"
                             + (" (None is accepted only for assistant messages)" if content is None else ""))
        check_text(f"message {i} (role {role!r}) content", content)


def _short(x) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def _template_messages(messages) -> list:
    """The messages as transformers hands them to templates: keys whose value is None dropped (so
    `content=None, tool_calls=None` read as absent), reasoning given as both `reasoning_content` and
    `thinking`. The caller's dicts are not modified."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


def render_chat_template(template: str | None, messages: list[dict], *, add_generation_prompt: bool = True,
                         bos_token: str | None = None, eos_token: str | None = None, tools: list | None = None,
                         **extra) -> str:
    """Render `messages` with the Jinja chat `template`. `tools` are JSON schemas (dicts); `extra` keyword
    arguments are visible to the template (e.g. enable_thinking=False)."""
    if not template:
        raise ValueError("this model has no chat template; send a raw prompt instead "
                         "(Engine.generate/stream, or `llaisys generate --raw`)")
    if not isinstance(template, str):
        raise ValueError(f"chat template must be a string, got {type(template).__name__}")
    if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools)):
        raise ValueError("tools must be a list of JSON-schema dicts")
    _check_messages(messages)
    compiled = _compile(template)
    special = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
    deadline = _DEADLINE.set(time.monotonic() + TIME_LIMIT_S)
    try:
        pieces = compiled.generate(messages=_template_messages(messages), tools=tools,
                                   documents=extra.pop("documents", None),
                                   add_generation_prompt=add_generation_prompt, **{**special, **extra})
        return _collect_output(pieces)
    except _TemplateRaised as e:
        raise ValueError(str(e.message)) from None
    except _LimitExceeded as e:
        raise ValueError(f"chat template stopped: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e
    except (TypeError, AttributeError, KeyError, IndexError) as e:
        raise ValueError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e
    except Exception as e:  # RecursionError, MemoryError, OverflowError...: still the template's fault
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from None
    finally:
        _DEADLINE.reset(deadline)


def _collect_output(pieces) -> str:
    out, size = [], 0
    for piece in pieces:
        _tick()
        size += len(piece)
        if size > MAX_CHARS:
            raise _LimitExceeded(f"its output passed {MAX_CHARS} characters")
        out.append(piece)
    return "".join(out)
