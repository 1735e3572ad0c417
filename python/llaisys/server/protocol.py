"""Request bodies of the OpenAI API as pydantic models, and OpenAI-shaped errors.

Models are strict (a string is not a number, 1 is not true) and forbid unknown fields: a field we do not
support (logit_bias, ...) is refused with a 400 that names it, never ignored.
Ranges OpenAI documents are checked here; the engine checks the rest (and its own limits) on submit.
Text the model would read or match (message content, prompts, stop strings) must be valid Unicode: JSON's
\\uXXXX escapes can spell a lone surrogate, which is refused with a 400 naming the field.
"""
from __future__ import annotations

import json
from typing import Literal, Optional, Union

from pydantic import Field, ValidationError, field_validator, model_validator

from .protocol_parts import (NamedToolChoice, ResponseFormat, Strict as _Strict, StructuredOutputs, Tool,
                             ToolCall)
from .tools import OPEN as TOOL_OPEN, bare_call_grammar, check_tools, tool_grammar

MAX_N = 16           # choices per request: each is a sequence in the batch
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        # a client's text quoted back (a field name, say) may hold lone surrogates, which UTF-8 cannot encode
        message, param = _printable(message), None if param is None else _printable(param)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def _printable(text: str) -> str:
    """text with any lone surrogate written as its escape (\\udc80), so the answer encodes to UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def check_unicode(text: str, what: str | None = None) -> str:
    """text, if it encodes to UTF-8; else ValueError naming the first lone surrogate (and `what`: which item
    of a list)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = f"{what} is not" if what else "not"
        raise ValueError(f"{where} valid Unicode: lone surrogate {text[e.start]!r} at position {e.start}") from None
    return text


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool's answer: the call it answers
    name: Optional[str] = None

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only for an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls are only allowed in assistant messages")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, value):
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content part of type {kind!r} is not supported (only 'text' parts)")
        return value

    @field_validator("content")
    @classmethod
    def _unicode(cls, value):
        if value is None:
            return value
        if isinstance(value, str):
            return check_unicode(value)
        for i, part in enumerate(value):
            check_unicode(part.text, f"content part {i}")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_dict(self) -> dict:
        """The message as chat templates take it: tool call arguments as objects (HF's convention)."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except json.JSONDecodeError:
                    raise ValueError(f"tool_calls: the arguments of {c.function.name!r} are not JSON") from None
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                           "arguments": args}})
            out["tool_calls"] = calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields chat and completions share. None means "the model's generation config decides"."""

    model: str
    max_tokens: Optional[int] = Field(None, ge=0)  # 0: completions with echo only (the prompt alone)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: Optional[int] = Field(1, ge=1, le=MAX_N)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    user: Optional[str] = None  # accepted for API compatibility; appears in the request log
    # vLLM's extras
    top_k: Optional[int] = Field(None, ge=-1)  # -1 and 0: off
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = False
    min_tokens: Optional[int] = Field(None, ge=0)
    # llaisys's extras: StreamingLLM's rolling KV window (None: the server's defaults; kv_window 0 = dense)
    kv_window: Optional[int] = Field(None, ge=0)
    sink_tokens: Optional[int] = Field(None, ge=0)
    # structured output (constraints.py): OpenAI's response_format, or vLLM's structured_outputs
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None

    @field_validator("stop")
    @classmethod
    def _stop_unicode(cls, value):
        if isinstance(value, list):
            for i, text in enumerate(value):
                check_unicode(text, f"stop string {i}")
        elif value is not None:
            check_unicode(value)
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def max_new_tokens(self) -> Optional[int]:
        return self.max_tokens

    def num_logprobs(self) -> Optional[int]:
        return None

    def sampling(self) -> dict:
        """Engine keywords for the fields set; the rest come from the model's generation config. Keywords
        the engine may lack (penalties, min_tokens, logprobs) are passed only when asked for."""
        out = {"max_new_tokens": self.max_new_tokens(), "temperature": self.temperature, "top_p": self.top_p,
               "top_k": 0 if self.top_k == -1 else self.top_k, "min_p": self.min_p,
               "repetition_penalty": self.repetition_penalty, "stop": self.stop,
               "stop_token_ids": self.stop_token_ids, "ignore_eos": bool(self.ignore_eos),
               # OpenAI takes any int64 seed; the engine's seeds are unsigned 64-bit
               "seed": None if self.seed is None else self.seed % 2**64}
        optional = {"presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                    "min_tokens": self.min_tokens or None, "logprobs": self.num_logprobs(),
                    "kv_window": self.kv_window, "sink_tokens": self.sink_tokens}
        out.update({k: v for k, v in optional.items() if v is not None})
        out.update(self.constraint())
        return out

    def constraint(self) -> dict:
        """The engine's json_schema / regex / grammar / choice keyword for response_format or
        structured_outputs (at most one of the two)."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        if rf is not None and rf.type == "json_object":
            return {"json_schema": {"type": "object"}}
        if rf is not None and rf.type == "json_schema":
            return {"json_schema": rf.json_schema.schema_ or {"type": "object"}}
        if so is None:
            return {}
        given = {k: v for k, v in (("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar)) if v is not None}
        return given

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @model_validator(mode="after")
    def _tools_for_tool_choice(self):
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        if forced and (self.structured_outputs is not None or
                       (self.response_format is not None and self.response_format.type != "text")):
            raise ValueError("a required or named tool_choice cannot be combined with response_format or "
                             "structured_outputs")
        return self

    def constraint(self) -> dict:
        """A required or named tool_choice is a grammar of tool calls; the tools are checked here."""
        mode = self.tool_mode()
        if mode is not None:
            check_tools(self.tool_dicts(), mode)
        if mode == "required" or isinstance(mode, dict):
            # a named function is called once (OpenAI's forced call); "required" may call several unless
            # parallel_tool_calls is false
            parallel = mode == "required" and self.parallel_tool_calls is not False
            return {"grammar": tool_grammar(self.tool_dicts(), mode, parallel)}
        given = super().constraint()
        if mode == "auto" and not given:  # free text; a call, once opened, follows the call grammar
            parallel = self.parallel_tool_calls is not False
            return {"grammar": tool_grammar(self.tool_dicts(), mode, parallel, opened=True),
                    "grammar_trigger": TOOL_OPEN, "opening_grammar": bare_call_grammar(self.tool_dicts())}
        return given

    @model_validator(mode="after")
    def _something_to_generate(self):
        if self.max_tokens == 0:
            raise ValueError("max_tokens must be >= 1 (0 is only allowed for /v1/completions with echo=true)")
        return self

    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict]:
        return [m.as_dict() if (m.tool_calls or m.role == "tool") else {"role": m.role, "content": m.text()}
                for m in self.messages]

    def tool_dicts(self) -> list[dict] | None:
        """The tools the template renders (none for tool_choice 'none')."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_names(self) -> list[str] | None:
        """The names of the tools the answer may call (None: no tools, or tool_choice 'none')."""
        tools = self.tool_dicts()
        return None if tools is None else [t["function"]["name"] for t in tools]

    def tool_mode(self) -> str | dict | None:
        """None (no tools), 'auto', 'required' or the named choice as a dict."""
        if self.tool_dicts() is None:
            return None
        choice = self.tool_choice or "auto"
        return choice if isinstance(choice, str) else choice.model_dump()


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Optional[bool] = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        def ids(x):
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        shape = "a string, a list of strings, a list of token ids or a list of lists of token ids"
        if isinstance(value, str) or ids(value) and value:
            items = [value]
        elif isinstance(value, list) and value and (all(isinstance(p, str) for p in value) or all(map(ids, value))):
            items = value
        else:
            raise ValueError(f"prompt must be {shape} (not empty)")
        if any(not p for p in items):
            raise ValueError("prompt is empty (give text or token ids)")
        for i, p in enumerate(items):
            if isinstance(p, str):
                check_unicode(p, f"prompt {i}" if len(items) > 1 else None)
        return value

    @model_validator(mode="after")
    def _nothing_to_return(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 needs echo=true (it returns the prompt alone, as vLLM does)")
        return self

    @property
    def echo_only(self) -> bool:
        """max_tokens=0 with echo: the prompt (and its logprobs) come back and nothing is generated."""
        return self.max_tokens == 0

    def num_logprobs(self) -> Optional[int]:
        return self.logprobs

    def prompts(self) -> list:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)


def parse(model: type[_Strict], body) -> _Strict:
    """Validates a decoded JSON body; raises APIError(400) naming the first offending field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def validation_error(errors) -> APIError:
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # pydantic adds the union member it tried (e.g. "str", "list[TextPart]") to the location: drop it
    param = ".".join(x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "function-after"))
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"unsupported field {param!r}: this server does not support it", param,
                        "unsupported_field")
    if err.get("type") == "string_unicode":  # a key with a lone surrogate (pydantic checks keys as it reads them)
        what = f"{param}: a key" if param else "a field name"
        return APIError(400, f"{what} is not valid Unicode (a lone surrogate)", param or None, "invalid_value")
    if err.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err.get('msg')}", None, "invalid_json")
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    where = f"{param}: " if param else ""
    return APIError(400, f"{where}{msg}", param or None, "invalid_value")
