"""Load test of an OpenAI-compatible server, in the spirit of vLLM's benchmark_serving.

N requests arrive all at once (--request-rate inf) or as a Poisson process at a given rate. Prompt and
output lengths follow nano-vllm's bench.py: prompts of random token ids (values < 10000), lengths uniform
in [100, max_input_len], outputs uniform in [100, max_output_len] with ignore_eos, seed 0. Every request
streams; reported: request and token throughput, TTFT p50/p99, inter-token latency (ITL) p50/p99 and time
per output token. A chunk may carry several tokens (llaisys serve merges the waiting chunks of a stream that
fell behind, as vLLM does): ITL is the time between chunks with text, TPOT counts tokens from usage.
--compare-url runs the same requests against a second server in the same run; --offline
runs them through llaisys.Engine in this process (at the same arrival times), the ceiling the server's
throughput is measured against; --offline-only runs only that (start it when no server holds the GPU).

The client must not be what limits a run. --procs N splits the requests over N worker processes (request i
goes to worker i % N with its own prompt, length and arrival time), each with its own event loop, all
starting at one common time; the parent merges their results and computes every figure over all requests,
throughput over the span from that start to the last request's end. The default, min(8, usable cores // 2)
(8 on a 16-core machine, 1 on 2 cores), leaves half the cores to the server and its engine process, and
keeps each worker's loop mostly idle so that it timestamps chunks as they come. --client light (the
default) is a small HTTP/1.1 client on an asyncio Protocol (chunked, Content-Length or until-close bodies,
SSE lines split anywhere across reads, kept-alive connections); --client httpx is the previous client,
at 2.5x its CPU per token (bench/fake_step.py's stand-in: ~28 against ~68 us at 256 streams). Every run
reports the client's own CPU: client_cpu_us_per_token (the workers' process CPU time over output tokens)
and client_busiest_cpu_share (the busiest worker's CPU over the run's wall time: near 1, the figures are
the client's, not the server's). --max-concurrency is split among the workers.

`transformers serve` (HF's OpenAI-compatible server; bench/serve_check.sh starts it) takes only text
prompts and no ignore_eos: --api transformers sends --prompt-format text (random common words) and asks
for EOS to be ignored through its `generation_config` field (eos_token_id -1, with the same sampling).

    llaisys serve --model qwen2.5-coder-0.5b-instruct --device cuda &
    python bench/serve_load.py --url http://127.0.0.1:8000 --model qwen2.5-coder-0.5b-instruct -n 256
    python bench/serve_load.py --url ... --request-rate 1 -n 64 --offline --json out.json
    python bench/serve_load.py --write-checkpoint /tmp/ckpt --shape qwen2-0.5b   # random weights, for both servers
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import sys
import time
import traceback
import urllib.parse

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

WORDS = ("the of and to in is that for it as with was on be by this are from at or an have not they which "
         "one you were all we can her has there been if more when will would who so no out up into do time "
         "only new some could these two may first then any like my now over such our man me even most made "
         "after also did many before must through back years where much your way well down should because "
         "each just those people how too little state good very make world still own see men work long get "
         "here between both life being under never day same another know while last might us great old year "
         "off come since against go came right used take three").split()


def make_requests(n: int, max_input_len: int, max_output_len: int, seed: int = 0) -> list[dict]:
    """nano-vllm's protocol: token-id prompts and output lengths drawn with one seeded generator."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))]
        out.append({"prompt_ids": ids, "text": " ".join(WORDS[i % len(WORDS)] for i in ids),
                    "max_tokens": rng.randint(100, max_output_len)})
    return out


def arrival_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return list(np.cumsum(rng.exponential(1.0 / rate, n)))


def request_body(model: str, req: dict, args) -> tuple[str, dict]:
    """(path, JSON body) of one request, in the dialect of --api."""
    body = {"model": model, "max_tokens": req["max_tokens"], "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.api == "transformers":
        # transformers serve refuses ignore_eos (422) and reads sampling from a GenerationConfig given as
        # JSON; eos_token_id -1 turns EOS off in its continuous batching. top_k/top_p: llaisys's defaults.
        gc = {"do_sample": args.temperature > 0, "temperature": args.temperature or 1.0, "top_k": 50, "top_p": 1.0}
        if args.ignore_eos:
            gc["eos_token_id"] = -1
        body["generation_config"] = json.dumps(gc)
    elif args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": req["text"]}]}
    return "/v1/completions", {**body, "prompt": req["text"] if args.prompt_format == "text" else req["prompt_ids"]}


# ---- reading a streamed reply ---------------------------------------------------------------------------

class Reply:
    """What one streamed request got: the time of every chunk with text, the text, the usage, the error.
    feed() takes the SSE lines (bytes, without line ends) that arrived at time t; it returns True when the
    stream carried an error and reading should stop."""

    __slots__ = ("times", "pieces", "usage", "error")

    def __init__(self):
        self.times, self.pieces, self.usage, self.error = [], [], None, None

    def feed(self, lines: list[bytes], t: float) -> bool:
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:  # OpenAI's {"error": {...}}, or transformers serve's {"error": "..."}
                err = chunk["error"]
                self.error = err.get("message") if isinstance(err, dict) else str(err)
                return True
            self.usage = chunk.get("usage") or self.usage
            for c in chunk.get("choices", ()):
                piece = c.get("text") or (c.get("delta") or {}).get("content")
                if piece:
                    self.times.append(t)
                    self.pieces.append(piece)
        return False


class LineSplitter:
    """Splits a byte stream into lines (ended by \\n, \\r\\n or \\r, as SSE allows), whatever the reads' split."""

    def __init__(self):
        self.tail = b""

    def feed(self, data: bytes) -> list[bytes]:
        lines = (self.tail + data).splitlines(keepends=True) if self.tail else data.splitlines(keepends=True)
        self.tail = lines.pop() if lines and lines[-1][-1:] not in (b"\n", b"\r") else b""
        return [line.rstrip(b"\r\n") for line in lines]  # a \r\n cut after its \r gives one more, empty, line


class LengthBody:
    """A body of Content-Length bytes (or none, for 204/304). Each body reader's feed() returns the body bytes
    in what was read; `done` once the body is complete; `excess`: bytes came past its end (or may: the
    connection is not reused); eof() when the server closed the connection first (raises if the body is cut)."""

    def __init__(self, length: int):
        self.left, self.done, self.excess = length, length == 0, False

    def feed(self, data: bytes) -> bytes:
        if len(data) > self.left:
            self.excess = True
            data = data[:self.left]
        self.left -= len(data)
        self.done = self.left == 0
        return data

    def eof(self) -> None:
        raise ConnectionError(f"the server closed the connection {self.left} bytes before the body's end")


class ChunkedBody:
    """The chunked transfer coding (RFC 9112 7.1): a size line (hex; extensions ignored), the data and CRLF
    per chunk, then the last chunk (size 0) and trailer fields up to an empty line; fed bytes split anywhere."""

    def __init__(self):
        self.buf, self.state, self.left, self.done, self.excess = b"", "size", 0, False, False

    def feed(self, data: bytes) -> bytes:
        buf, i, out = self.buf + data if self.buf else data, 0, []
        while not self.done:
            if self.state == "data":
                take = min(self.left, len(buf) - i)
                out.append(buf[i:i + take])
                i += take
                self.left -= take
                if self.left:
                    break
                self.state = "crlf"
            if self.state == "crlf":
                if len(buf) - i < 2:
                    break
                if buf[i:i + 2] != b"\r\n":
                    raise ValueError("chunked body: a chunk's data is not followed by CRLF")
                i += 2
                self.state = "size"
                continue
            end = buf.find(b"\r\n", i)
            if end < 0:
                break
            line, i = buf[i:end], end + 2
            if self.state == "size":
                size = int(line.split(b";", 1)[0], 16)  # ValueError unless hex digits
                if size < 0:
                    raise ValueError(f"chunked body: chunk size {line!r}")
                self.state, self.left = ("data", size) if size else ("trailer", 0)
            elif not line:  # the empty line that ends the trailer fields
                self.done = True
        self.buf = buf[i:]
        self.excess = self.done and bool(self.buf)
        return b"".join(out)

    def eof(self) -> None:
        raise ConnectionError("the server closed the connection before the chunked body's last chunk")


class UntilCloseBody:
    """A body with neither length nor chunking: it ends when the server closes the connection."""
    done, excess = False, True

    def feed(self, data: bytes) -> bytes:
        return data

    def eof(self) -> None:
        self.done = True


def body_reader(status: int, fields: dict):
    te = fields.get("transfer-encoding")
    if te is not None:
        return ChunkedBody() if te.lower().rsplit(",", 1)[-1].strip() == "chunked" else UntilCloseBody()
    if "content-length" in fields:
        return LengthBody(int(fields["content-length"]))
    return LengthBody(0) if status in (204, 304) else UntilCloseBody()


def parse_head(head: bytes) -> tuple[str, int, dict]:
    """(HTTP version, status, header fields) of a response head without its blank line; field names
    lower-cased, a repeated field's values joined with ", "."""
    lines = head.decode("latin-1").split("\r\n")
    version, status = lines[0].split(None, 2)[:2]
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name, value = name.strip().lower(), value.strip()
        fields[name] = f"{fields[name]}, {value}" if name in fields else value
    return version, int(status), fields


MAX_HEAD = 1 << 16


class NothingBack(ConnectionError):
    """The connection closed before any byte of the response came."""


class Response:
    """One response, read from the bytes its connection hands to feed() as they arrive: the head (after any
    interim 1xx), then the body's framing, then, for a 200, its lines to on_lines(lines, arrival time) until
    that returns True. `done` gets (whether the connection can carry another request, the error text of a
    non-200 reply: "status: body", its first 200 characters), or the exception that ended the read."""

    def __init__(self, on_lines, done: asyncio.Future):
        self.on_lines, self.done = on_lines, done
        self.buf, self.got_any = b"", False
        self.version, self.status, self.fields = "", 0, {}
        self.body = self.lines = None
        self.other: list[bytes] = []  # a non-200 reply's body

    def feed(self, data: bytes) -> None:
        t = time.perf_counter()
        self.got_any = True
        try:
            if self.body is None:
                data = self._head(data)
                if self.body is None:
                    return
            if data:
                data = self.body.feed(data)
                if self.lines is None:
                    self.other.append(data)
                elif data and self.on_lines(self.lines.feed(data), t):
                    return self._finish(reusable=False)  # stopped before the body's end
            if self.body.done:
                self._finish(reusable=not self.body.excess)
        except Exception as e:
            self.done.set_exception(e)

    def _head(self, data: bytes) -> bytes:
        """Reads the head from data; returns the bytes after it (the body's first)."""
        buf = self.buf + data if self.buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    raise ValueError(f"no end of the response head in its first {MAX_HEAD} bytes")
                self.buf = buf
                return b""
            self.version, self.status, self.fields = parse_head(buf[:end])
            buf = buf[end + 4:]
            if not 100 <= self.status < 200 or self.status == 101:  # else an interim response: the next follows
                break
        self.buf = b""
        self.body = body_reader(self.status, self.fields)
        self.lines = LineSplitter() if self.status == 200 else None
        return buf

    def _finish(self, reusable: bool) -> None:
        if self.lines is not None and self.lines.tail and self.body.done:  # a last line without its line end
            self.on_lines([self.lines.tail], time.perf_counter())
        error = None if self.status == 200 else f"{self.status}: {b''.join(self.other).decode(errors='replace')[:200]}"
        keep = reusable and self.version == "HTTP/1.1" and self.fields.get("connection", "").lower() != "close"
        self.done.set_result((keep, error))

    def eof(self) -> None:
        """The server closed the connection."""
        if self.done.done():
            return
        if self.body is None:
            self.done.set_exception(NothingBack("the server closed the connection without a response")
                                    if not self.got_any else ConnectionError("the server closed the connection "
                                                                            "in the response head"))
            return
        try:
            self.body.eof()  # raises unless the body ends with the connection
            self._finish(reusable=False)
        except Exception as e:
            self.done.set_exception(e)


class Connection(asyncio.Protocol):
    """One connection of LightClient: the response being read gets every byte in data_received, as it
    comes: no future, task wake-up and buffer copy per read, as asyncio's streams would add (a streams
    version of this client took ~37 us of CPU a token where this one takes ~28-30, one run each)."""

    def __init__(self):
        self.transport, self.response, self.closed = None, None, False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        r = self.response
        if r is None or r.done.done():  # bytes nobody asked for: the connection cannot be trusted
            self.close()
        else:
            r.feed(data)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.response is not None:
            self.response.eof()

    def exchange(self, request: bytes, on_lines) -> asyncio.Future:
        self.response = Response(on_lines, asyncio.get_running_loop().create_future())
        self.transport.write(request)
        return self.response.done

    def close(self) -> None:
        self.closed = True
        self.transport.close()


class LightClient:
    """A streaming HTTP/1.1 client on an asyncio Protocol, for this benchmark's one use: POST a JSON body and
    read the SSE reply as it arrives. Keeps connections alive for the next request, as httpx's pool does; a
    reused connection that gives nothing back (the server closed it while idle) is retried once on a new one."""

    def __init__(self, url: str):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"expected an http:// or https:// URL, got {url!r}")
        self.addr = (u.hostname, u.port or (443 if u.scheme == "https" else 80))
        self.ssl = True if u.scheme == "https" else None
        self.netloc, self.base = u.netloc, u.path.rstrip("/")
        self.idle: list[Connection] = []

    async def _connection(self) -> tuple[Connection, bool]:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn, True
        _, conn = await asyncio.get_running_loop().create_connection(Connection, *self.addr, ssl=self.ssl)
        return conn, False

    async def post(self, path: str, body: bytes, headers: dict, on_lines) -> str | None:
        """POSTs `body` (JSON) and hands the reply's lines to on_lines(lines, arrival time) until it returns
        True or the reply ends. Returns None after a 200, else "status: body" (its first 200 characters)."""
        request = "".join([f"POST {self.base}{path} HTTP/1.1\r\nHost: {self.netloc}\r\n",
                           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n",
                           *(f"{k}: {v}\r\n" for k, v in headers.items()), "\r\n"]).encode() + body
        for retry in (True, False):
            conn, reused = await self._connection()
            try:
                keep, error = await conn.exchange(request, on_lines)
            except NothingBack:
                conn.close()
                if retry and reused:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            conn.response = None
            if keep:
                self.idle.append(conn)
            else:
                conn.close()
            return error

    async def aclose(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


class HttpxClient:
    """The previous client (--client httpx), to compare with: httpx's pool, h11 and aiter_lines."""

    def __init__(self, url: str):
        import httpx

        self.url = url
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=None))

    async def post(self, path: str, body: bytes, headers: dict, on_lines) -> str | None:
        async with self.client.stream("POST", self.url + path, content=body,
                                      headers={"Content-Type": "application/json", **headers}) as r:
            if r.status_code != 200:
                return f"{r.status_code}: {(await r.aread()).decode()[:200]}"
            async for line in r.aiter_lines():
                if on_lines([line.encode()], time.perf_counter()):
                    break
        return None

    async def aclose(self) -> None:
        await self.client.aclose()


CLIENTS = {"light": LightClient, "httpx": HttpxClient}


# ---- the load -------------------------------------------------------------------------------------------

async def one_request(client, model: str, req: dict, args, t_start: float) -> dict:
    path, body = request_body(model, req, args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    reply = Reply()
    sent = time.perf_counter()
    try:
        error = await client.post(path, json.dumps(body).encode(), headers, reply.feed)
        reply.error = error or reply.error
    except Exception as e:  # a refused or dropped connection, or a reply that cannot be read, fails the request
        reply.error = f"{type(e).__name__}: {e}"
    done = time.perf_counter()
    times, usage = reply.times, reply.usage or {}
    return {"ok": reply.error is None and bool(times), "error": reply.error, "start": sent - t_start,
            "ttft": times[0] - sent if times else None, "itl": list(np.diff(times)), "e2e": done - sent,
            "output_tokens": usage.get("completion_tokens", len(times)),
            "prompt_tokens": usage.get("prompt_tokens", len(req["prompt_ids"])), "text": "".join(reply.pieces)}


async def run_part(url: str, model: str, jobs: list, args, limit: int | None, start) -> tuple[list, float]:
    """One worker's share: jobs are (index, request, arrival offset). Sends the warm-up requests, then calls
    start() (blocking) for the common start time t0 and runs the jobs from it. Returns [(index, result)] and
    the CPU seconds this process spent from t0 to the last request's end."""
    client = CLIENTS[args.client](url)
    try:
        for i in range(args.warmup):  # not measured: lazy model loads, CUDA graphs, transformers' CB start
            w = await one_request(client, model, {**jobs[i % len(jobs)][1], "max_tokens": 4}, args, 0.0)
            if not w["ok"]:
                raise SystemExit(f"the warm-up request to {url} failed: {w['error']}")
        t0 = start()
        cpu0 = time.process_time()
        slots = asyncio.Semaphore(limit or len(jobs))

        async def launch(i, req, offset):
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            async with slots:
                return i, await one_request(client, model, req, args, t0)
        results = await asyncio.gather(*(launch(*job) for job in jobs))
        return results, time.process_time() - cpu0
    finally:
        await client.aclose()


def default_procs() -> int:
    """Half the cores this process may run on, at most 8, leaving the other half to the server's HTTP process
    and its engine process. The light client needs about half a core in all at 17K tok/s (~28 us a token):
    several processes keep each event loop idle enough that it timestamps chunks as they come."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores // 2))


START_MARGIN_S = 0.2  # the common start is this far after the parent hears that every worker is ready


def _worker(conn, url: str, model: str, jobs: list, args, limit: int | None) -> None:
    """A worker process (multiprocessing spawn): run_part with the start time the parent sends."""
    def start() -> float:
        conn.send(("ready",))
        return conn.recv()
    try:
        conn.send(("done", asyncio.run(run_part(url, model, jobs, args, limit, start))))
    except BaseException as e:
        conn.send(("failed", str(e) if isinstance(e, SystemExit) else traceback.format_exc()))


def run_load(url: str, model: str, reqs: list[dict], args) -> dict:
    return summarize(*run_requests(url, model, reqs, args))


def run_requests(url: str, model: str, reqs: list[dict], args) -> tuple[list[dict], float, list[float]]:
    """The requests against one server from args.procs worker processes (from this one, for 1): each
    request's result in request order, the span from the common start to the last request's end, and each
    client process's CPU seconds."""
    jobs = list(zip(range(len(reqs)), reqs, arrival_offsets(len(reqs), args.request_rate, args.seed)))
    procs = min(args.procs, len(reqs), args.max_concurrency or len(reqs))
    mc = args.max_concurrency
    limits = [mc // procs + (k < mc % procs) for k in range(procs)] if mc else [None] * procs
    if procs == 1:
        parts = [asyncio.run(run_part(url, model, jobs, args, limits[0], time.perf_counter))]
    else:
        parts = _run_workers(url, model, [jobs[k::procs] for k in range(procs)], args, limits)
    results = [r for _, r in sorted((pair for part, _ in parts for pair in part), key=lambda pair: pair[0])]
    return results, max(r["start"] + r["e2e"] for r in results), [cpu for _, cpu in parts]


def _run_workers(url: str, model: str, shares: list, args, limits: list) -> list:
    """run_part in one spawned process per share, all from one start time. A worker that fails ends the run
    (SystemExit with its error) and the others with it."""
    # time.perf_counter is CLOCK_MONOTONIC on Linux (mach_absolute_time on macOS, QueryPerformanceCounter on
    # Windows): one clock for every process of the machine, so the workers measure from the parent's t0
    ctx = multiprocessing.get_context("spawn")
    workers = []

    def receive(p, conn):
        try:
            msg = conn.recv()
        except EOFError:
            p.join(5)
            raise SystemExit(f"a client worker process exited (exit code {p.exitcode})") from None
        if msg[0] == "failed":
            raise SystemExit(f"a client worker failed: {msg[1]}")
        return msg[1:]
    try:
        for jobs, limit in zip(shares, limits):
            conn, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, url, model, jobs, args, limit), daemon=True)
            p.start()
            child.close()
            workers.append((p, conn))
        for p, conn in workers:
            receive(p, conn)  # ready: warmed up
        t0 = time.perf_counter() + START_MARGIN_S
        for _, conn in workers:
            conn.send(t0)
        return [receive(p, conn)[0] for p, conn in workers]
    except BaseException:
        for p, _ in workers:
            p.kill()
        raise
    finally:
        for p, conn in workers:
            p.join()
            conn.close()


def summarize(results: list[dict], duration: float, client_cpu: list[float]) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    out_tokens = sum(r["output_tokens"] for r in ok)

    def pct(xs, q):
        return float(np.percentile(xs, q) * 1e3) if xs else float("nan")
    return {"requests": len(results), "failed": len(results) - len(ok), "duration_s": duration,
            "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
            "total_token_throughput": (out_tokens + sum(r["prompt_tokens"] for r in ok)) / duration,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(itl, 50),
            "itl_p99_ms": pct(itl, 99), "tpot_mean_ms": float(np.mean(tpot) * 1e3) if tpot else float("nan"),
            "client_procs": len(client_cpu), "client_cpu_s": sum(client_cpu),
            "client_cpu_us_per_token": sum(client_cpu) / out_tokens * 1e6 if out_tokens else float("nan"),
            "client_busiest_cpu_share": max(client_cpu) / duration,
            "errors": sorted({r["error"] for r in results if r["error"]})[:5]}


def run_offline(model: str, reqs: list[dict], args) -> dict:
    """The same requests through llaisys.Engine in this process, submitted at the same arrival times (all at
    once by default). TTFT counts from each request's submit, as the server's from its HTTP request."""
    from llaisys.server.backend import Engine

    eng = Engine(model, device=args.device, progress=False)
    try:
        for _ in range(args.warmup):
            eng.generate(reqs[0]["prompt_ids"][:16], max_new_tokens=4, temperature=0)
        offsets = arrival_offsets(len(reqs), args.request_rate, args.seed)
        handles = []
        t0 = time.perf_counter()
        for r, offset in zip(reqs, offsets):  # submit() returns at once; the engine's thread runs them
            time.sleep(max(0.0, offset - (time.perf_counter() - t0)))
            handles.append(eng.submit(r["prompt_ids"], max_new_tokens=r["max_tokens"],
                                      temperature=args.temperature or 0, ignore_eos=args.ignore_eos))
        results = [h.result() for h in handles]  # chunks wait in each request's queue until read
        duration = time.perf_counter() - t0
    finally:
        eng.close()
    out = sum(len(r.token_ids) for r in results)
    ttft = [r.timings["ttft_s"] for r in results]
    return {"requests": len(reqs), "duration_s": duration, "output_throughput": out / duration,
            "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3), "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3)}


SHAPES = {  # HF config fields of the real models (tied embeddings, as they have) and a tiny one for the CPU
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, tie=True),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, tie=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie=True, vocab_size=16384, max_position_embeddings=4096),
}


def write_checkpoint(shape: str, dirpath: str) -> str:
    """A random HF checkpoint of `shape` (the real shapes and vocabulary, bf16; or "tiny") that both
    llaisys and transformers load. The test tokenizer knows 400 tokens; its vocabulary is padded
    with one word per remaining id (" t<id>") so every id a random model samples decodes to text: a server
    streams nothing for a token without text, and TTFT could not be measured."""
    sys.path[:0] = [os.path.join(HERE, "..", "tests")]
    from tiny_model import make_tiny_qwen2

    if shape not in SHAPES:
        raise SystemExit(f"--shape must be one of {sorted(SHAPES)}, got {shape!r}")
    cfg = dict(SHAPES[shape])
    tie = cfg.pop("tie")
    cfg = {"vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1e6, **cfg}
    make_tiny_qwen2(dirpath, tie=tie, dtype="bfloat16", **cfg)
    path = os.path.join(dirpath, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})  # else a loader re-numbers them past the padding
    taken = set(vocab.values())
    for i in range(cfg["vocab_size"]):
        if i not in taken:
            vocab[f"\u0120t{i}"] = i  # U+0120 is a space in byte-level BPE's alphabet
    with open(path, "w") as f:
        json.dump(tok, f)
    return dirpath


def report(name: str, s: dict) -> None:
    print(f"== {name}")
    for k, v in s.items():
        print(f"  {k:<24} {v:.2f}" if isinstance(v, float) else f"  {k:<24} {v}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="the model name the server expects (and the model --offline loads)")
    p.add_argument("--compare-url", help="a second server to run the same requests against")
    p.add_argument("--compare-model", help="its model name (default: --model)")
    p.add_argument("--offline", action="store_true", help="also run the requests through llaisys.Engine here")
    p.add_argument("--offline-only", action="store_true", help="only run them through llaisys.Engine (no --url)")
    p.add_argument("--device", default="auto", help="device of the --offline engine")
    p.add_argument("--num-requests", "-n", type=int, default=256)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int,
                   help="at most this many requests in flight (each client process holds its share)")
    p.add_argument("--procs", type=int, default=default_procs(),
                   help="client processes the requests are split over (default min(8, usable cores // 2): "
                        "%(default)s here)")
    p.add_argument("--client", choices=sorted(CLIENTS), default="light",
                   help="light: a small HTTP/1.1 client on an asyncio Protocol (default); httpx: the previous one")
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let outputs end at EOS (by default every output has its drawn length)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="completions sends --prompt-format; chat sends words")
    p.add_argument("--prompt-format", choices=["ids", "text"],
                   help="completions prompts: token ids (exact lengths; default) or random common words (text, for "
                        "servers that take no ids; default for --api transformers)")
    p.add_argument("--api", choices=["llaisys", "transformers"], default="llaisys",
                   help="the server's dialect: llaisys (and vLLM) take ignore_eos; transformers serve does not")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured short requests sent first (default 1)")
    p.add_argument("--api-key")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--write-checkpoint", metavar="DIR", help="write a random checkpoint of --shape into DIR and exit")
    p.add_argument("--shape", default="qwen2-0.5b", help="for --write-checkpoint: qwen2-0.5b, qwen2-1.5b or tiny")
    args = p.parse_args(argv)
    if args.write_checkpoint:
        return args
    if not args.model or not (args.url or args.offline_only):
        p.error("--model is needed, and --url unless --offline-only")
    args.prompt_format = args.prompt_format or ("text" if args.api == "transformers" else "ids")
    if args.api == "transformers" and args.endpoint == "completions" and args.prompt_format == "ids":
        p.error("transformers serve takes only text prompts: use --prompt-format text or --endpoint chat")
    if args.max_input_len < 100 or args.max_output_len < 100:
        p.error("--max-input-len and --max-output-len must be >= 100 (the protocol's lower bound)")
    if args.num_requests < 1 or args.warmup < 0:
        p.error("--num-requests must be >= 1 and --warmup >= 0")
    if args.procs < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        p.error("--procs and --max-concurrency must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.write_checkpoint:
        print(write_checkpoint(args.shape, args.write_checkpoint))
        return 0
    reqs = make_requests(args.num_requests, args.max_input_len, args.max_output_len, args.seed)
    results = {"args": {k: v for k, v in vars(args).items() if k != "api_key"}}
    if not args.offline_only:
        results["server"] = run_load(args.url, args.model, reqs, args)
        report(f"{args.url} ({args.model})", results["server"])
    if args.compare_url:
        results["compare"] = run_load(args.compare_url, args.compare_model or args.model, reqs, args)
        report(f"{args.compare_url}", results["compare"])
    if args.offline or args.offline_only:
        results["offline engine"] = run_offline(args.model, reqs, args)
        report("offline llaisys.Engine", results["offline engine"])
    if "server" in results and "offline engine" in results:
        share = results["server"]["output_throughput"] / results["offline engine"]["output_throughput"]
        print(f"server output throughput / offline engine's: {share:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 1 if any(results[k].get("failed") for k in ("server", "compare") if k in results) else 0


if __name__ == "__main__":
    sys.exit(main())
