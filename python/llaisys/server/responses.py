"""Response bodies in OpenAI's shapes: chat.completion(.chunk) and text_completion, logprobs, usage.

A Choice accumulates the engine's chunks of one choice; a Formatter turns chunks into stream chunks and
finished choices into the whole response, for chat or for completions.
"""
from __future__ import annotations

import codecs
import json
import time
from dataclasses import dataclass, field
from json.encoder import encode_basestring  # a str as JSON, non-ASCII kept (json.dumps with ensure_ascii=False)

from .backend import token_bytes
from .tools import ToolStream, parse_tool_calls


@dataclass
class Choice:
    echo: str = ""  # completions with echo: the prompt text, sent before the generated text
    echo_logprobs: dict | None = None  # with echo and logprobs: the prompt's, in OpenAI's shape (echo_logprobs())
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # the engine's entries: token_id, logprob, top
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    started: bool = False  # its first stream chunk (the role, or the echoed prompt) was sent
    chars_before: int = 0  # generated characters before the last chunk (its logprobs' text_offset)
    tools: ToolStream | None = None  # with tools, streaming: what splits the text into content and calls
    num_calls: int = 0  # tool calls streamed so far

    def add(self, chunk) -> None:
        self.chars_before += sum(map(len, self.text[-1:]))
        self.text.append(chunk.text)
        self.logprobs.extend(getattr(chunk, "logprobs", None) or ())
        if chunk.finish_reason is not None:
            self.finish_reason, self.usage, self.timings = chunk.finish_reason, chunk.usage, chunk.timings


def total_usage(choices: list[Choice], leaders: list[int]) -> dict:
    """Prompt tokens once per prompt (its first choice computed it; the others share its blocks) and the
    completion tokens of every choice."""
    prompt = sum(choices[i].usage.get("prompt_tokens", 0) for i in leaders)
    cached = sum(choices[i].usage.get("cached_tokens", 0) for i in leaders)
    completion = sum(c.usage.get("completion_tokens", 0) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def token_text(eng, token_id: int) -> str:
    """A token's text as logprobs show it: its bytes, with a broken UTF-8 character as U+FFFD."""
    return token_bytes(eng, token_id).decode("utf-8", errors="replace")


def top_dict(eng, top: list) -> dict[str, float]:
    """Completion top_logprobs: {token text: logprob}, highest first. Tokens with the same text (e.g. two
    halves of different characters, both U+FFFD) share a key: the most likely one keeps it."""
    out: dict[str, float] = {}
    for token_id, lp in top:
        out.setdefault(token_text(eng, token_id), lp)
    return out


def echo_logprobs(eng, entries: list[dict], text: str) -> dict:
    """The echoed prompt's completion logprobs: entries from backend.prompt_logprobs (the first one's
    logprob and top None, as OpenAI has them), text offsets into the echoed `text`. An offset counts the
    characters decoded before its token (a character split across tokens belongs to the token that
    completes it), capped at len(text) so that the generated tokens' offsets, from len(text) on, stay in
    order."""
    tokens, offsets, offset = [], [], 0
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for e in entries:
        offsets.append(min(offset, len(text)))
        raw = token_bytes(eng, e["token_id"])
        tokens.append(raw.decode("utf-8", errors="replace"))
        offset += len(decoder.decode(raw))
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else top_dict(eng, e["top"]) for e in entries],
            "text_offset": offsets}


class Formatter:
    def __init__(self, eng, rid: str, chat: bool, model: str, want_logprobs: bool, include_usage: bool = False,
                 tool_names=None):
        self.eng, self.id, self.chat, self.model = eng, rid, chat, model
        self.tools = tool_names is not None and chat  # the answers may hold tool calls (tools.py)
        self.tool_names = frozenset(tool_names or ())
        self.want_logprobs, self.include_usage = want_logprobs, include_usage
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._prefixes: dict[int, str] = {}  # choice index -> the start of its stream events (stream_event)
        self._suffix = "}]" + (',"usage":null' if include_usage else "") + "}\n\n"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ---- streaming --------------------------------------------------------------------------
    def stream_chunk(self, index: int, choice: Choice, chunk) -> dict:
        """The stream chunk for `chunk`, already added to `choice`."""
        entries = getattr(chunk, "logprobs", None) or []
        if self.chat:
            delta = {} if choice.started else {"role": "assistant", "content": ""}
            if chunk.text:
                delta["content"] = chunk.text
            body = {"index": index, "delta": delta, "logprobs": self._chat_logprobs(entries),
                    "finish_reason": chunk.finish_reason}
            obj = "chat.completion.chunk"
        else:
            # the first chunk carries the echoed prompt, and its logprobs before the generated ones
            text = chunk.text if choice.started else choice.echo + chunk.text
            offset = len(choice.echo) + choice.chars_before
            lp = self._completion_logprobs(entries, offset, None if choice.started else choice.echo_logprobs)
            body = {"index": index, "text": text, "logprobs": lp, "finish_reason": chunk.finish_reason}
            obj = "text_completion"
        choice.started = True
        out = {**self._head(obj), "choices": [body]}
        if self.include_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last
        return out

    def stream_event(self, index: int, choice: Choice, chunk) -> str:
        """The SSE event of stream_chunk(), as `data: <json>` and a blank line. The common event (no logprobs,
        not a choice's first) is written from a cached prefix instead of a dict through json.dumps: at
        hundreds of streams this runs once per stream and step on the thread the engine shares."""
        if self.tools:
            return self._tool_events(index, choice, chunk)
        if self.want_logprobs or not choice.started:
            return sse(self.stream_chunk(index, choice, chunk))
        prefix = self._prefixes.get(index)
        if prefix is None:
            head = json.dumps(self._head("chat.completion.chunk" if self.chat else "text_completion"),
                              ensure_ascii=False, separators=(",", ":"))
            prefix = self._prefixes[index] = f'data: {head[:-1]},"choices":[{{"index":{index},'
        reason = "null" if chunk.finish_reason is None else encode_basestring(chunk.finish_reason)
        if self.chat:
            delta = f'{{"content":{encode_basestring(chunk.text)}}}' if chunk.text else "{}"
            body = f'"delta":{delta},"logprobs":null,"finish_reason":{reason}'
        else:
            body = f'"text":{encode_basestring(chunk.text)},"logprobs":null,"finish_reason":{reason}'
        return prefix + body + self._suffix

    def _tool_events(self, index: int, choice: Choice, chunk) -> str:
        """A chat stream with tools: content as it is known not to open a call, and each complete call as
        OpenAI streams one (a delta with its id and name, then one with its arguments)."""
        if choice.tools is None:
            choice.tools = ToolStream(self.tool_names)
        content, calls = choice.tools.feed(chunk.text)
        if chunk.finish_reason is not None:
            more, last = choice.tools.finish()
            content, calls = content + more, calls + last
        deltas = [] if choice.started else [{"role": "assistant", "content": ""}]
        if content:
            deltas.append({"content": content})
        for call in calls:
            k = choice.num_calls
            choice.num_calls += 1
            f = call["function"]
            deltas.append({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                           "function": {"name": f["name"], "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": k, "function": {"arguments": f["arguments"]}}]})
        reason = chunk.finish_reason
        if reason == "stop" and choice.num_calls:
            reason = "tool_calls"
        if reason is not None:
            deltas.append({})
        choice.started = True
        head = {**self._head("chat.completion.chunk")}
        out = []
        for i, d in enumerate(deltas):
            last = i == len(deltas) - 1
            body = {"index": index, "delta": d, "logprobs": None, "finish_reason": reason if last else None}
            event = {**head, "choices": [body]}
            if self.include_usage:
                event["usage"] = None
            out.append(sse(event))
        return "".join(out)

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}

    # ---- whole response ---------------------------------------------------------------------
    def response(self, choices: list[Choice], usage: dict) -> dict:
        out = []
        for i, c in enumerate(choices):
            text = "".join(c.text)
            if self.chat:
                message, reason = {"role": "assistant", "content": text}, c.finish_reason
                if self.tools:
                    content, calls = parse_tool_calls(text, self.tool_names)
                    if calls:
                        message = {"role": "assistant", "content": content, "tool_calls": calls}
                        reason = "tool_calls" if reason == "stop" else reason
                out.append({"index": i, "message": message, "logprobs": self._chat_logprobs(c.logprobs),
                            "finish_reason": reason})
            else:
                out.append({"index": i, "text": c.echo + text,
                            "logprobs": self._completion_logprobs(c.logprobs, len(c.echo), c.echo_logprobs),
                            "finish_reason": c.finish_reason})
        return {**self._head(self.object), "choices": out, "usage": usage}

    # ---- logprobs ---------------------------------------------------------------------------
    def _token(self, token_id: int) -> tuple[str, bytes]:
        raw = token_bytes(self.eng, token_id)
        return raw.decode("utf-8", errors="replace"), raw

    def _chat_logprobs(self, entries: list[dict]) -> dict | None:
        if not self.want_logprobs:
            return None
        content = []
        for e in entries:
            text, raw = self._token(e["token_id"])
            top = []
            for tid, lp in e["top"]:
                t, b = self._token(tid)
                top.append({"token": t, "logprob": lp, "bytes": list(b)})
            content.append({"token": text, "logprob": e["logprob"], "bytes": list(raw), "top_logprobs": top})
        return {"content": content}

    def _completion_logprobs(self, entries: list[dict], offset: int, echoed: dict | None = None) -> dict | None:
        """The generated tokens' logprobs, their text offsets from `offset`; after `echoed` (the prompt's)."""
        if not self.want_logprobs:
            return None
        tokens, offsets = [], []
        for e in entries:
            offsets.append(offset)
            tokens.append(self._token(e["token_id"])[0])
            offset += len(tokens[-1])
        out = {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
               "top_logprobs": [top_dict(self.eng, e["top"]) for e in entries],
               "text_offset": offsets}
        return {k: echoed[k] + v for k, v in out.items()} if echoed else out


def sse(obj: dict) -> str:
    """One server-sent event carrying obj as compact JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
