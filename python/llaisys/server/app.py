"""The OpenAI-compatible HTTP app over one Engine: /v1/models, /v1/chat/completions, /v1/completions,
/health and /metrics. Every error, routing ones included, is answered in OpenAI's JSON error shape.

Logprobs of generated tokens are the engine's (sampling.py: log-softmax of the logits the token was drawn
from, after penalties and temperature, before top-k/top-p/min-p). Completions with `echo` and `logprobs`
list the prompt's tokens first, as OpenAI and vLLM do: their logprobs are the raw model distribution at the
previous position (log-softmax of Engine.score's logits: no temperature, penalties or truncation, since the
prompt was not sampled), the first token with null token_logprob and top_logprobs; they cost one more
forward pass over the prompt. `max_tokens: 0` with `echo` returns the prompt alone (vLLM's behaviour).

Request bodies are bounded before they are read (body_limit: a few bytes per token of the context) and
answered 413 past it without being buffered; a body is decoded and validated in a worker thread, so a large
or deeply nested one does not hold the event loop (/health). A client that leaves while sending its body is
one INFO line, not an error.

Authorization: `Bearer <key>` with the scheme in any case (RFC 7235: auth schemes are case-insensitive) and
one or more spaces after it; the key is compared exactly (bytes as sent, no trimming; an HTTP parser drops
spaces and tabs at the ends of a header's value before the app sees it, so a server key that starts or ends
with whitespace could never match and create_app refuses it).

    app = create_app(engine, model_name="qwen2.5-coder-0.5b-instruct", api_key=None)
    uvicorn.run(app)                # or `llaisys serve`, which also ends streams cleanly on SIGINT/SIGTERM
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
import uuid

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine_args import trim_heap
from .backend import StreamHub
from .generate import Call
from .metrics import Metrics
from .protocol import APIError, ChatRequest, CompletionRequest, parse

log = logging.getLogger("llaisys.server")

# The body limit (body_limit). Bytes of JSON a token of a prompt that fits can need, measured on Qwen2.5's
# tokenizer: English 3.5, code 4.3, token ids 5.5-8 ("151643, "), Chinese 5.2 (10.4 with json.dumps'
# default \uXXXX escapes), emoji 4.3 (12.3 escaped), 64-space indentation 22. 32 leaves room above all.
BODY_BYTES_PER_TOKEN = 32
BODY_OVERHEAD_BYTES = 64 << 10  # field names, sampling values, message wrappers, stop strings and ids
MIN_BODY_LIMIT = 256 << 10  # small contexts (tests, --max-seq-len 256) still take any ordinary request
# After a body this big, the heap is trimmed: decoding and tokenizing it took tens of MB in a worker thread's
# malloc arena, which glibc keeps (RSS grew by ~80 MB and stayed there) unless asked to give it back.
TRIM_AFTER_BYTES = 64 << 10


def body_limit(max_seq_len: int) -> int:
    """The largest request body the server reads, in bytes: max(MIN_BODY_LIMIT, BODY_BYTES_PER_TOKEN *
    max_seq_len + BODY_OVERHEAD_BYTES). A prompt must fit the context (max_seq_len tokens), so a bigger body
    can only be refused, after the cost of reading, decoding and tokenizing it (a 10 MiB prompt took 40 s of
    tokenizing, holding the GIL, and left the process 1.2 GB larger); it gets 413 first. The default model's
    8192-token context gives 320 KiB. The limit is on the whole body: a /v1/completions batch of several
    prompts shares it (send large batches as several requests)."""
    return max(MIN_BODY_LIMIT, BODY_BYTES_PER_TOKEN * int(max_seq_len) + BODY_OVERHEAD_BYTES)


class ClientLeft(Exception):
    """The client disconnected before its request body was read in full."""


class ServerState:
    def __init__(self, engine, model_name: str, api_key: str | None, max_body_bytes: int | None = None):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.max_body_bytes = body_limit(engine.max_seq_len) if max_body_bytes is None else max_body_bytes
        self.metrics = Metrics()
        self.live: set[Call] = set()
        self.closing = False
        self.created = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the app starts
        self.hub: StreamHub | None = None  # the sink of every engine request, one per event loop (app start)

    def request_shutdown(self) -> None:
        """shutdown() from any thread or a signal handler."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.shutdown)

    def shutdown(self) -> None:
        """Refuse new requests and end running ones (their streams get an error chunk). Event loop only."""
        self.closing = True
        for call in list(self.live):
            call.gen.abort()


def create_app(engine, model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int | None = None) -> FastAPI:
    """The app serving `engine` under `model_name` (default: the model directory's name). With api_key,
    every /v1 request needs `Authorization: Bearer <api_key>`; /health and /metrics stay open. Request
    bodies over max_body_bytes (default: body_limit(engine.max_seq_len)) get 413. Raises ValueError for an
    api_key that no request could send (empty, or with whitespace at an end)."""
    check_api_key(api_key)
    if max_body_bytes is not None and (not isinstance(max_body_bytes, int) or max_body_bytes < 1):
        raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    name = model_name or os.path.basename(str(engine.source).rstrip("/\\"))
    state = ServerState(engine, name, api_key, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        state.hub = StreamHub(state.loop)
        yield
        state.shutdown()

    app = FastAPI(title="llaisys", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.llaisys = state
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        failure = getattr(engine, "failure", None)  # an engine process that died
        if failure is not None and not state.closing:
            raise APIError(503, f"the engine is not running: {failure}", code="engine_unavailable")
        if state.closing or engine.closed:
            raise APIError(503, "the server is shutting down", code="server_shutdown")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        stats = await asyncio.to_thread(engine.stats)  # waits for the step in progress: off the event loop
        return PlainTextResponse(state.metrics.render(stats), media_type="text/plain; version=0.0.4")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_authorize)])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": state.created,
                                            "owned_by": "llaisys", "max_model_len": engine.max_seq_len}]}

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(state, request, chat=True)

    @v1.post("/completions")
    async def completions(request: Request):
        return await _generate(state, request, chat=False)

    app.include_router(v1)
    return app


def check_api_key(key: str | None) -> None:
    """An API key a client can send: HTTP parsers strip spaces and tabs at the ends of a header's value,
    so a key with whitespace at an end (or an empty one) would never match, or match a bare 'Bearer'."""
    if key is None:
        return
    if not isinstance(key, str):
        raise TypeError(f"the API key must be a str, got {type(key).__name__}")
    if not key:
        raise ValueError("the API key is empty: give a key, or none (unset LLAISYS_API_KEY) for an open server")
    if key != key.strip() or any(c in key for c in "\r\n\0"):
        raise ValueError(f"the API key {key[:2]!r}... has whitespace at an end or a line break, which an HTTP "
                         f"header cannot carry (no request could match it): remove it")


async def _authorize(request: Request) -> None:
    key = request.app.state.llaisys.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, space, given = header.partition(" ")
    # RFC 6750/7235: the scheme is case-insensitive and 1*SP separates it from the token; the token itself
    # is compared exactly (the header's bytes: Starlette decodes them as latin-1). compare_digest: the time
    # taken does not tell how much of a guess was right.
    given = given.lstrip(" ").encode("latin-1")
    if not space or scheme.lower() != "bearer" or not hmac.compare_digest(given, key.encode()):
        log.info("%s %s 401 missing or wrong API key", request.method, request.url.path)
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


async def _generate(state: ServerState, request: Request, chat: bool):
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    size = 0
    try:
        if state.closing:
            raise APIError(503, "the server is shutting down", code="server_shutdown")
        raw = await _read_body(request, state.max_body_bytes)
        size = len(raw)
        # json.loads and pydantic hold the GIL for a while on big bodies: off the event loop
        req = await asyncio.to_thread(_decode, ChatRequest if chat else CompletionRequest, raw)
        del raw  # not kept for the whole generation
        if req.model != state.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {state.model_name!r}",
                           "model", "model_not_found")
        call = Call(state, rid, req, chat)
        await call.start(chat)
    except APIError as e:
        state.metrics.finished("rejected")
        log.info("%s %d rejected error=%r", rid, e.status, e.message)
        if size >= TRIM_AFTER_BYTES:
            await asyncio.to_thread(trim_heap)
        return JSONResponse(e.body(), status_code=e.status)
    except ClientLeft:  # nobody reads an answer: one INFO line, as for a client that leaves a generation
        state.metrics.finished("aborted")
        log.info("%s 499 aborted error='the client disconnected while sending its body'", rid)
        return Response(status_code=499)
    if size >= TRIM_AFTER_BYTES:
        await asyncio.to_thread(trim_heap)
    return call.stream() if req.stream else await call.respond(request)


def _too_large(size, limit: int) -> APIError:
    return APIError(413, f"the request body has {size} bytes; this server reads at most {limit} (its context is "
                         f"shorter than such a prompt)", code="request_too_large")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes: a Content-Length over it is refused before anything is read, a
    chunked body as soon as it passes it (413 either way; the server discards the rest as it arrives).
    Raises ClientLeft when the client disconnects first."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(length, limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(f"more than {limit}", limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientLeft() from None
    return b"".join(chunks)


def _decode(model, raw: bytes):
    """The parsed request (protocol.parse) of a JSON body; APIError(400) for anything malformed. Worker thread."""
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}", code="invalid_json")
        return parse(model, body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # json's decoder (or validation) past Python's recursion limit: thousands of levels
        raise APIError(400, "the body is nested too deeply (an OpenAI request needs a few levels)",
                       code="invalid_json") from None


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # unknown path (404), method (405)
        message = {404: f"no route {request.url.path!r}",
                   405: f"method {request.method} is not allowed on {request.url.path!r}"}.get(e.status_code, e.detail)
        return JSONResponse(APIError(e.status_code, str(message)).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, e: ClientDisconnect):  # a read of the body elsewhere: as _generate
        log.info("%s %s 499 aborted error='the client disconnected while sending its body'", request.method,
                 request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)
