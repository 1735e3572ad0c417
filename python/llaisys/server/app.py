"""The OpenAI-compatible HTTP app over one Engine: /v1/models, /v1/chat/completions, /v1/completions,
/health and /metrics. Every error, routing ones included, is answered in OpenAI's JSON error shape.

Logprobs of generated tokens are the engine's (sampling.py: log-softmax of the logits the token was drawn
from, after penalties and temperature, before top-k/top-p/min-p). Completions with `echo` and `logprobs`
list the prompt's tokens first, as OpenAI and vLLM do: their logprobs are the raw model distribution at the
previous position (log-softmax of Engine.score's logits: no temperature, penalties or truncation, since the
prompt was not sampled), the first token with null token_logprob and top_logprobs; they cost one more
forward pass over the prompt. `max_tokens: 0` with `echo` returns the prompt alone (vLLM's behaviour).

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
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .backend import StreamHub
from .generate import Call
from .metrics import Metrics
from .protocol import APIError, ChatRequest, CompletionRequest, parse

log = logging.getLogger("llaisys.server")
MAX_BODY_BYTES = 32 << 20  # a whole context of text is far smaller; refuse bigger bodies before decoding


class ServerState:
    def __init__(self, engine, model_name: str, api_key: str | None):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
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


def create_app(engine, model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    """The app serving `engine` under `model_name` (default: the model directory's name). With api_key,
    every /v1 request needs `Authorization: Bearer <api_key>`; /health and /metrics stay open."""
    name = model_name or os.path.basename(str(engine.source).rstrip("/\\"))
    state = ServerState(engine, name, api_key)

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


async def _authorize(request: Request) -> None:
    key = request.app.state.llaisys.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    # compare_digest: the time taken does not tell how much of a guess was right
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        log.info("%s %s 401 missing or wrong API key", request.method, request.url.path)
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


async def _generate(state: ServerState, request: Request, chat: bool):
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        if state.closing:
            raise APIError(503, "the server is shutting down", code="server_shutdown")
        req = parse(ChatRequest if chat else CompletionRequest, await _json_body(request))
        if req.model != state.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {state.model_name!r}",
                           "model", "model_not_found")
        call = Call(state, rid, req, chat)
        await call.start(chat)
    except APIError as e:
        state.metrics.finished("rejected")
        log.info("%s %d rejected error=%r", rid, e.status, e.message)
        return JSONResponse(e.body(), status_code=e.status)
    return call.stream() if req.stream else await call.respond(request)


async def _json_body(request: Request):
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"the body has {length} bytes; the limit is {MAX_BODY_BYTES}")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"the body has {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


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

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)
