"""Tool calls in Qwen2.5's (and Hermes') format: the chat template renders `tools` and the model answers
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (several in a row for parallel calls).

tool_choice "required" or a named function is enforced by a grammar (one llguidance Lark grammar whose
calls are JSON objects of each tool's own parameter schema); "auto" is free text until the model opens a
call, and from that token on the same grammar (the engine's grammar_trigger); an answer whose first token
begins a bare (or ```json-fenced) call's JSON, as small models write them, follows that call's grammar from
there (the engine's opening_grammar). So an auto call is never malformed (a model whose vocabulary has no
`<tool_call>` token gets only the second);
"none" renders no tools and parses nothing. The output becomes OpenAI's `tool_calls`, streamed one call at a time
(a delta with its id and name, then one with its whole arguments string)."""
from __future__ import annotations

import json
import re
import uuid

from ..constraints import JSON_OPTIONS, compile_constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def check_tools(tools: list[dict], tool_choice) -> None:
    """ValueError naming the tool whose parameters are not a schema llguidance takes, or a named
    tool_choice that names no tool."""
    for i, t in enumerate(tools):
        params = t["function"].get("parameters")
        if params is not None:
            try:
                compile_constraint(json_schema=params)
            except ValueError as e:
                raise ValueError(f"tools[{i}].function.parameters ({t['function']['name']}): {e}") from None
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in {t["function"]["name"] for t in tools}:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")


def call_schema(tool: dict) -> dict:
    f = tool["function"]
    params = f.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_grammar(tools: list[dict], tool_choice, parallel: bool, opened: bool = False) -> str:
    """Lark for one tool call (or several, with parallel) of the allowed tools, in the template's format.
    opened: the text after the first call's `<tool_call>` (tool_choice "auto", started by that token)."""
    if isinstance(tool_choice, dict):
        tools = [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
    schema = {"anyOf": [call_schema(t) for t in tools], "x-guidance": JSON_OPTIONS}
    more = ' ("\\n" call)*' if parallel else ""
    # the tags are tokens of their own (Qwen2.5's added tokens): llguidance names them <tool_call>, unquoted
    return (f'start: {"body" if opened else "call"}{more}\ncall: {OPEN} body\n'
            f'body: "\\n" %json {json.dumps(schema)} "\\n" {CLOSE}')


def bare_call_grammar(tools: list[dict]) -> str:
    """Lark for an answer that is one call's JSON without the tags, bare or in a ```json fence (how small
    models answer; _bare_call parses it), with the whitespace the model puts (its first token is already
    out when this starts: tool_choice "auto"'s opening_grammar)."""
    j = f'%json {json.dumps({"anyOf": [call_schema(t) for t in tools], "x-guidance": {"whitespace_flexible": True}})}'
    return f'start: {j} | "```" "json"? "\\n" {j} "\\n"? "```"'


def new_call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


def _call_of(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return new_call(obj["name"], obj.get("arguments", {}))


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def _bare_call(text: str, names) -> dict | None:
    """A whole answer that is one call's JSON without the tags, or in a ```json fence (small models often
    answer so)."""
    text = text.strip()
    fenced = _FENCE.match(text)
    text = fenced.group(1) if fenced else text
    call = _call_of(text) if text.startswith("{") else None
    return call if call is not None and call["function"]["name"] in names else None


def parse_tool_calls(text: str, names=()) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole answer: the text outside complete, well-formed calls is content
    (None when empty); a malformed call stays in the content. An answer that is only a call's JSON, for
    one of the tools `names`, is that call."""
    bare = _bare_call(text, names) if OPEN not in text else None
    if bare is not None:
        return None, [bare]
    calls, content, last = [], [], 0
    for m in _CALL.finditer(text):
        call = _call_of(m.group(1))
        if call is None:
            continue
        content.append(text[last:m.start()])
        calls.append(call)
        last = m.end()
    content.append(text[last:])
    joined = "".join(content).strip() if calls else "".join(content)
    return (joined or None), calls


class ToolStream:
    """Splits streamed text into content deltas and complete calls. Text that may be the start of
    `<tool_call>` is held back until it is known not to be."""

    def __init__(self, names=()):
        self.buf = ""
        self.in_call = False
        self.calls = 0
        self.names = names
        self.sent = False  # some content went out: a bare call is no longer possible
        self.hold = False  # the answer began with "{": maybe a bare call, known at the end

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content to send now, calls completed by this text)."""
        self.buf += text
        if not self.sent and not self.hold and self.buf.strip():
            self.hold = self.buf.lstrip()[:1] in ("{", "`")
        if self.hold:
            return "", []
        content, calls = self._split()
        self.sent = self.sent or bool(content)
        return content, calls

    def _split(self) -> tuple[str, list[dict]]:
        content, calls = "", []
        while True:
            if not self.in_call:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = _partial_suffix(self.buf, OPEN)
                    content += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content += self.buf[:i]
                self.buf, self.in_call = self.buf[i:], True
            j = self.buf.find(CLOSE)
            if j < 0:
                break
            body, self.buf, self.in_call = self.buf[len(OPEN):j], self.buf[j + len(CLOSE):], False
            call = _call_of(body.strip())
            if call is None:
                content += OPEN + body + CLOSE
            else:
                calls.append(call)
        self.calls += len(calls)
        if self.calls:  # between and after calls: the newlines the format puts there are not content
            content = content.strip()
        return content, calls

    def finish(self) -> tuple[str, list[dict]]:
        """What is left at the end: a held answer as a bare call or as content; an unclosed call as text."""
        if self.hold:
            self.hold = False
            bare = _bare_call(self.buf, self.names)
            if bare is not None:
                self.buf, self.calls = "", self.calls + 1
                return "", [bare]
            content, calls = self._split()
        else:
            content, calls = "", []
        rest, self.buf = self.buf, ""
        return content + ("" if self.calls and not rest.strip() else rest), calls


def _partial_suffix(text: str, word: str) -> int:
    """The length of the longest end of `text` that begins `word`."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:n]):
            return n
    return 0
