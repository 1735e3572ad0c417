"""One /v1/chat/completions or /v1/completions request, from its parsed body to the response: prompts to
token ids, n choices with their own seeds, then a whole response or an SSE stream.

Every request ends in exactly one log line (id, status, tokens, TTFT) and one metrics observation. A
client that leaves (stream or not) aborts its engine requests, which frees their KV blocks before the
next step; a server shutdown aborts them too and the client gets an error (chunk).
"""
from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .backend import Generation, StreamChunk, chat_ids, choice_seed, prompt_ids, prompt_logprobs
from .protocol import APIError, ChatRequest, CompletionRequest
from .responses import Choice, Formatter, echo_logprobs, sse, total_usage

log = logging.getLogger("llaisys.server")
DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks that its client is still there


class ClientGone(Exception):
    pass


def prepare(eng, req: ChatRequest | CompletionRequest, chat: bool) -> tuple[list, list[Choice], list]:
    """(groups for Generation.start, one Choice per choice holding its echoed prompt and that prompt's
    logprobs, (index, last chunk) of choices that end without generating: echo with max_tokens=0). Runs in
    a worker thread: chat templates, tokenizers and prompt logprobs take a while on long prompts."""
    sampling = req.sampling()
    trigger = sampling.get("grammar_trigger")
    if trigger is not None and eng.tokenizer.token_to_id(trigger) is None:
        # no <tool_call> token in this vocabulary: its auto calls are parsed from free text (tools.py)
        sampling = {k: v for k, v in sampling.items() if k not in ("grammar", "grammar_trigger")}
    if chat:
        prompts = [chat_ids(eng, req.message_dicts(), req.tool_dicts())]
    else:
        prompts = [prompt_ids(eng, p) for p in req.prompts()]
    for ids in prompts:
        if len(ids) >= eng.max_seq_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens but the model's context holds {eng.max_seq_len} "
                                f"(the prompt and at least one generated token must fit)",
                           "messages" if chat else "prompt", "context_length_exceeded")
    n = req.n or 1
    choices = [Choice() for _ in range(len(prompts) * n)]
    if not chat and req.echo:
        for k, (p, ids) in enumerate(zip(req.prompts(), prompts)):
            text = p if isinstance(p, str) else eng.tokenizer.decode(p)
            lps = None if req.logprobs is None else echo_logprobs(eng, prompt_logprobs(eng, ids, req.logprobs), text)
            choices[k * n:(k + 1) * n] = [Choice(echo=text, echo_logprobs=lps) for _ in range(n)]
    if not chat and req.echo_only:
        ended = [(k * n + i, StreamChunk("", [], "length", {"prompt_tokens": len(ids), "completion_tokens": 0,
                                                              "cached_tokens": 0}, {}))
                 for k, ids in enumerate(prompts) for i in range(n)]
        return [], choices, ended
    groups = [(ids, [{**sampling, "seed": choice_seed(sampling["seed"], i)} for i in range(n)]) for ids in prompts]
    return groups, choices, []


class Call:
    """The state of one generation request while it is answered."""

    def __init__(self, state, rid: str, req, chat: bool):
        self.state, self.rid, self.req = state, rid, req
        self.t0 = time.perf_counter()
        self.ttft: float | None = None
        self.engine_ttft: float | None = None  # a whole response's: from the engine's timings (_first_token)
        self.submitted = 0.0  # when its engine requests were submitted, from t0
        self.gen = Generation(state.engine, state.engine.engine_config.block_size, state.hub)
        self.fmt = Formatter(state.engine, rid, chat, state.model_name, req.num_logprobs() is not None,
                             req.include_usage, tool_names=req.tool_names() if chat else None)
        self.choices: list[Choice] = []
        self.leaders: list[int] = []
        self.ended: list = []  # (index, last chunk) of choices that generate nothing

    async def start(self, chat: bool) -> None:
        eng, req = self.state.engine, self.req
        try:
            groups, self.choices, self.ended = await asyncio.to_thread(prepare, eng, req, chat)
            self.leaders = list(range(0, len(self.choices), req.n or 1))
            self.submitted = time.perf_counter() - self.t0
            # a whole response reads only each choice's end: one chunk per request, decoded once (backend.py)
            self.gen.start(groups, incremental=bool(req.stream))
        except (ValueError, TypeError) as e:  # a bad value, or a prompt that can never fit: the numbers
            raise APIError(400, str(e)) from None
        except RuntimeError as e:  # the queue or KV cache is full (max_queued_requests, prompt logprobs); closing
            raise APIError(503, str(e), code="server_busy") from None
        self.state.live.add(self)
        self.state.metrics.in_flight += 1

    async def _chunks(self):
        """(index, Choice, chunk) as they arrive; raises APIError for a request the server cut short."""
        async for index, chunk in self._events():
            self._first_token(chunk)
            if chunk.finish_reason == "abort":  # only the server aborts what a client still reads
                raise APIError(503, "the server is shutting down", code="server_shutdown")
            choice = self.choices[index]
            choice.add(chunk)
            yield index, choice, chunk

    def _first_token(self, chunk) -> None:
        """TTFT: a stream's is when its first chunk arrives. A whole response's chunks may all arrive at the
        end (incremental=False): its first token's time is the engine's (timings ttft_s, counted from
        submission), the earliest of its choices; the arrival, for choices that generated nothing."""
        if not self.req.stream:
            ttft_s = (chunk.timings or {}).get("ttft_s") if chunk.finish_reason is not None else None
            if ttft_s:
                t = self.submitted + ttft_s
                self.engine_ttft = t if self.engine_ttft is None else min(self.engine_ttft, t)
                self.ttft = self.engine_ttft
                return
            if self.engine_ttft is not None:
                return
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.t0

    async def _events(self):
        for item in self.ended:
            yield item
        async for item in self.gen.events():
            yield item

    def usage(self) -> dict:
        return total_usage(self.choices, self.leaders)

    def end(self, status: int, outcome: str, error: str | None = None) -> None:
        """Frees what is still running, records metrics and writes the request's one log line."""
        self.gen.abort()
        self.state.live.discard(self)
        self.state.metrics.in_flight -= 1
        total = time.perf_counter() - self.t0
        usage = self.usage() if outcome == "ok" else None
        rates = [c.timings.get("decode_tokens_per_s", 0.0) for c in self.choices if c.timings]
        self.state.metrics.finished(outcome, usage, self.ttft, total if outcome == "ok" else None, rates)
        u = self.usage()
        ttft = f"{self.ttft:.4f}s" if self.ttft is not None else "-"  # 0.1 ms: a small model's TTFT is under 0.5
        tail = f" error={error!r}" if error else ""
        user = f" user={self.req.user!r}" if self.req.user else ""
        log.info("%s %d %s prompt=%d cached=%d completion=%d n=%d ttft=%s total=%.4fs%s%s", self.rid, status,
                 outcome, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"],
                 len(self.choices), ttft, total, user, tail)

    # ---- non-streaming --------------------------------------------------------------------------
    async def respond(self, request: Request) -> JSONResponse:
        consume = asyncio.ensure_future(self._consume())
        try:
            while not consume.done():
                await asyncio.wait({consume}, timeout=DISCONNECT_POLL_S)
                if not consume.done() and await request.is_disconnected():
                    raise ClientGone()
            consume.result()
        except ClientGone:
            consume.cancel()
            self.end(499, "aborted", "the client disconnected")
            return JSONResponse({}, status_code=499)  # nobody reads it
        except APIError as e:
            self.end(e.status, "error", e.message)
            return JSONResponse(e.body(), status_code=e.status)
        except Exception as e:  # an engine step failed
            self.end(500, "error", str(e))
            err = APIError(500, f"generation failed: {e}")
            return JSONResponse(err.body(), status_code=500)
        self.end(200, "ok")
        return JSONResponse(self.fmt.response(self.choices, self.usage()))

    async def _consume(self) -> None:
        async for _ in self._chunks():
            pass

    # ---- streaming ------------------------------------------------------------------------------
    def stream(self) -> StreamingResponse:
        return StreamingResponse(self._sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _sse(self):
        status, outcome, error = 200, "ok", None
        try:
            async for index, choice, chunk in self._chunks():
                yield self.fmt.stream_event(index, choice, chunk)
            if self.fmt.include_usage:
                yield sse(self.fmt.usage_chunk(self.usage()))
        except asyncio.CancelledError:  # Starlette cancels the stream when the client disconnects
            status, outcome, error = 499, "aborted", "the client disconnected"
            raise
        except Exception as e:  # headers are sent: the error goes in the stream, as vLLM does
            err = e if isinstance(e, APIError) else APIError(500, f"generation failed: {e}")
            status, outcome, error = err.status, "error", err.message
            yield sse(err.body())
        finally:
            self.end(status, outcome, error)
        yield "data: [DONE]\n\n"

