"""bench/serve_load.py, the load tool bench/serve_check.sh runs on an H100 with no network: its random
checkpoint must stream text for every token (else TTFT is unmeasurable), each server gets its own dialect,
its light HTTP client reads exactly what a server sent (chunked, Content-Length or until-close bodies, split
anywhere, UTF-8 characters cut across reads) as httpx does, --procs N gives every request the result that
one process gives it, and a run against a real `llaisys serve` process (tiny random model, CPU) answers every
request with the lengths asked for. No timings are asserted."""
import asyncio
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import serve_load  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return serve_load.write_checkpoint("tiny", str(tmp_path_factory.mktemp("ckpt")))


def test_random_checkpoint_decodes_every_id_to_text_in_both_tokenizers(ckpt):
    from transformers import AutoTokenizer

    from llaisys.server.backend import Engine, token_bytes

    hf = AutoTokenizer.from_pretrained(ckpt)
    with open(os.path.join(ckpt, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    assert len(hf) == vocab
    with open(os.path.join(ckpt, "tokenizer.json")) as f:
        specials = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
    assert hf.convert_tokens_to_ids(list(specials)) == list(specials.values())  # not re-numbered past the padding
    eng = Engine(ckpt, device="cpu", progress=False, max_seq_len=256, cpu_kv_cache_bytes=4 << 20)
    try:
        ids = [i for i in range(vocab) if i not in specials.values()]
        assert all(token_bytes(eng, i) for i in ids)
        assert hf.decode(ids[-3:]) == eng.tokenizer.decode(ids[-3:]) == "".join(f" t{i}" for i in ids[-3:])
        text = "the of and to in is that for it"
        assert eng.tokenize(text) == hf(text)["input_ids"]
    finally:
        eng.close()


def _args(**kw):
    base = dict(temperature=0.6, ignore_eos=True, api="llaisys", endpoint="completions", prompt_format="ids")
    return SimpleNamespace(**{**base, **kw})


def test_request_bodies_speak_each_servers_dialect():
    req = serve_load.make_requests(1, 120, 130)[0]
    path, body = serve_load.request_body("m", req, _args())
    assert path == "/v1/completions" and body["prompt"] == req["prompt_ids"] and body["ignore_eos"] is True
    assert body["max_tokens"] == req["max_tokens"] and body["stream"] is True
    # transformers serve answers 422 to ignore_eos; EOS goes off through its generation_config (-1: none)
    path, body = serve_load.request_body("m", req, _args(api="transformers", prompt_format="text"))
    assert "ignore_eos" not in body and body["prompt"] == req["text"]
    assert json.loads(body["generation_config"]) == {"do_sample": True, "temperature": 0.6, "top_k": 50,
                                                     "top_p": 1.0, "eos_token_id": -1}
    _, body = serve_load.request_body("m", req, _args(api="transformers", temperature=0.0, ignore_eos=False))
    assert json.loads(body["generation_config"])["do_sample"] is False
    assert "eos_token_id" not in json.loads(body["generation_config"])
    with pytest.raises(SystemExit):  # transformers serve takes no token ids
        serve_load.main(["--url", "http://x", "--model", "m", "--api", "transformers", "--prompt-format", "ids"])


def test_poisson_arrivals_are_seeded_and_all_at_once_is_zero():
    a = serve_load.arrival_offsets(16, 4.0, seed=3)
    assert a == serve_load.arrival_offsets(16, 4.0, seed=3) and a == sorted(a) and a[0] > 0
    assert serve_load.arrival_offsets(4, math.inf) == [0.0] * 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_load_run_against_llaisys_serve_and_offline_gets_every_token(ckpt, tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "llaisys.server", "--model", ckpt, "--device", "cpu", "--port",
                             str(port), "--max-seq-len", "512", "--cpu-kv-cache-bytes", str(16 << 20)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            assert proc.poll() is None, open(tmp_path / "server.log").read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        out = tmp_path / "run.json"
        common = ["--model", ckpt, "-n", "6", "--max-input-len", "120", "--max-output-len", "110", "--device", "cpu"]
        rc = serve_load.main(["--url", url, *common, "--request-rate", "20", "--offline", "--json", str(out)])
        res = json.loads(out.read_text())
        assert rc == 0 and res["server"]["failed"] == 0 and res["server"]["requests"] == 6
        want = sum(r["max_tokens"] for r in serve_load.make_requests(6, 120, 110))
        # every output has its drawn length (ignore_eos), through HTTP and offline
        for part in ("server", "offline engine"):
            assert res[part]["output_throughput"] * res[part]["duration_s"] == pytest.approx(want)
        rc = serve_load.main(["--url", url, *common, "--prompt-format", "text", "--procs", "2", "--json", str(out)])
        res = json.loads(out.read_text())["server"]
        assert rc == 0 and res["failed"] == 0 and res["client_procs"] == 2
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) in (0, -15)
        log.close()


# ---- the light client, against an in-process fake server ---------------------------------------------------

def fake_stream(ids: list[int], max_tokens: int, error_at: int | None = None) -> tuple[bytes, list[str]]:
    """The SSE body a fake server streams for one request, and the text pieces it carries: one chunk per token
    (with 2- and 4-byte UTF-8 characters, some events ended by CRLF), a usage chunk and [DONE]; with
    error_at, an OpenAI error event instead of chunk error_at and nothing after it."""
    pieces = [f" é{ids[k % len(ids)]}" + ("😀" if k % 7 == 0 else "") for k in range(max_tokens)]
    events = [{"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": p, "logprobs": None,
                                                                           "finish_reason": None}]} for p in pieces]
    events[-1]["choices"][0]["finish_reason"] = "length"
    events.append({"id": "cmpl-1", "object": "text_completion", "choices": [],
                   "usage": {"prompt_tokens": len(ids), "completion_tokens": max_tokens}})
    if error_at is not None:
        events[error_at:] = [{"error": {"message": "boom", "type": "internal_error"}}]
        pieces = pieces[:error_at]
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}" + ("\r\n\r\n" if k % 5 == 4 else "\n\n")
                   for k, e in enumerate(events))
    return (body + "data: [DONE]\n\n").encode(), pieces


def raw_response(body: bytes, framing: str, status: str = "200 OK") -> bytes:
    """A whole HTTP response around `body`: chunked (chunk sizes 1..300 that cut lines and characters, some
    with extensions; a trailer field; after an interim 100 Continue), length (Content-Length) or close (the
    body runs to the connection's end)."""
    head = f"HTTP/1.1 {status}\r\nContent-Type: text/event-stream\r\n"
    if framing == "length":
        return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
    if framing == "close":
        return f"{head}Connection: close\r\n\r\n".encode() + body
    out, i = [b"HTTP/1.1 100 Continue\r\n\r\n", f"{head}Transfer-Encoding: chunked\r\n\r\n".encode()], 0
    for k in range(len(body)):
        if i >= len(body):
            break
        n = (1, 17, 100, 5, 300)[k % 5]
        out.append(b"%X%s\r\n%s\r\n" % (len(body[i:i + n]), b";ext=1" if k % 3 == 0 else b"", body[i:i + n]))
        i += n
    return b"".join(out) + b"0\r\nX-Trailer: yes\r\n\r\n"


def cut(raw: bytes, sizes=(1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233)) -> list[bytes]:
    out, i, k = [], 0, 0
    while i < len(raw):
        out.append(raw[i:i + sizes[k % len(sizes)]])
        i += sizes[k % len(sizes)]
        k += 1
    return out


class FakeServer:
    """An OpenAI-like completions server on its own thread and event loop. Each request with token-id prompt P
    and max_tokens M gets reply(P, M) (default: fake_stream in `framing`), written in pieces of 1..233 bytes
    with a yield between them, so reads split lines, chunk framing and characters. Connections are kept
    alive (except with framing "close"); drop_second: the second request of a connection gets no answer, the
    connection closes (a server closing an idle connection as the client sends)."""

    def __init__(self, framing: str = "chunked", reply=None, drop_second: bool = False):
        self.framing, self.drop_second = framing, drop_second
        self.reply = reply or (lambda ids, m: raw_response(fake_stream(ids, m)[0], framing))
        self.connections = self.dropped = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(30)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    async def _handle(self, reader, writer) -> None:
        self.connections += 1
        try:
            for n in range(1, 10**6):
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                req = json.loads(await reader.readexactly(int(re.search(rb"(?i)content-length: *(\d+)", head)[1])))
                if self.drop_second and n == 2:
                    self.dropped += 1
                    return
                for piece in cut(self.reply(req["prompt"], req["max_tokens"])):
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
                if self.framing == "close":
                    return
        finally:
            writer.close()

    def close(self) -> None:
        async def stop():  # the handlers of kept-alive connections wait for a next request: end them
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture
def fake_server():
    servers = []

    def start(**kw):
        servers.append(FakeServer(**kw))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def _load_args(url: str, *extra: str):
    return serve_load.parse_args(["--url", url, "--model", "m", "-n", "5", "--max-input-len", "120",
                                  "--max-output-len", "110", *extra])


def _fetch(url: str, reqs: list[dict], client: str = "light") -> tuple[list[dict], object]:
    """The requests one after another through one client (kept-alive connections); the results and client."""
    args = _load_args(url, "--client", client)

    async def run():
        c = serve_load.CLIENTS[client](url)
        try:
            return [await serve_load.one_request(c, "m", r, args, 0.0) for r in reqs], c
        finally:
            await c.aclose()
    return asyncio.run(run())


def _parse(raw: bytes, cuts) -> tuple[serve_load.Reply, tuple]:
    """Response + Reply fed `raw` cut at `cuts`, as a connection would feed them; the reply and (keep, error)."""
    loop = asyncio.new_event_loop()
    try:
        reply = serve_load.Reply()
        r = serve_load.Response(reply.feed, loop.create_future())
        for a, b in zip([0, *cuts], [*cuts, len(raw)]):
            r.feed(raw[a:b])
        r.eof()  # the connection closes: ends a close-framed body, does nothing after a complete one
        return reply, r.done.result()
    finally:
        loop.close()


@pytest.mark.parametrize("framing", ["chunked", "length", "close"])
def test_the_response_parser_reads_the_stream_whatever_the_split(framing):
    ids = [5, 60, 700]
    body, pieces = fake_stream(ids, 9)
    raw = raw_response(body, framing)
    usage = {"prompt_tokens": 3, "completion_tokens": 9}
    rng = random.Random(0)
    splits = [[i] for i in range(1, len(raw))] + [sorted(rng.sample(range(1, len(raw)), 40)) for _ in range(50)]
    for cuts in splits:
        reply, (keep, error) = _parse(raw, cuts)
        assert (reply.pieces, reply.usage, reply.error, error) == (pieces, usage, None, None), cuts
        assert len(reply.times) == len(pieces) and keep == (framing != "close")


def test_the_response_parser_refuses_broken_framing():
    body, _ = fake_stream([1, 2], 3)
    raw = raw_response(body, "chunked")
    with pytest.raises(ValueError):  # a chunk size that is not hex
        _parse(raw.replace(b"\r\n1;ext=1\r\n", b"\r\nzz\r\n", 1), [])
    with pytest.raises(ConnectionError, match="before the chunked body's last chunk"):  # cut short
        _parse(raw[:len(raw) // 2], [])
    with pytest.raises(ConnectionError, match="bytes before the body's end"):
        _parse(raw_response(body, "length")[:-10], [])


@pytest.mark.parametrize("framing", ["chunked", "length", "close"])
def test_the_light_client_gets_what_the_server_sent_as_httpx_does(fake_server, framing):
    server = fake_server(framing=framing)
    reqs = serve_load.make_requests(3, 120, 110)
    light, client = _fetch(server.url, reqs)
    reference, _ = _fetch(server.url, reqs, client="httpx")
    for req, mine, ref in zip(reqs, light, reference):
        ids, m = req["prompt_ids"], req["max_tokens"]
        assert mine["ok"] and mine["error"] is None and mine["text"] == "".join(fake_stream(ids, m)[1])
        assert (mine["output_tokens"], mine["prompt_tokens"], len(mine["itl"])) == (m, len(ids), m - 1)
        assert {k: ref[k] for k in ("ok", "text", "output_tokens", "prompt_tokens")} == \
               {k: mine[k] for k in ("ok", "text", "output_tokens", "prompt_tokens")}
        assert len(ref["itl"]) == len(mine["itl"])
    # kept alive: the light client's three requests went over one connection (httpx's over another)
    assert server.connections == (2 if framing != "close" else 6)


def test_a_kept_alive_connection_the_server_closed_is_retried_once(fake_server):
    server = fake_server(drop_second=True)
    reqs = serve_load.make_requests(2, 120, 110)
    results, _ = _fetch(server.url, reqs)
    assert all(r["ok"] for r in results) and server.dropped == 1 and server.connections == 2


def test_errors_fail_the_request_with_the_servers_message(fake_server):
    req = serve_load.make_requests(1, 120, 110)[0]
    bad = json.dumps({"error": {"message": "prompt too long"}}).encode()
    server = fake_server(reply=lambda ids, m: raw_response(bad, "length", status="400 Bad Request"))
    for client in ("light", "httpx"):
        (r,), _ = _fetch(server.url, [req], client)
        assert not r["ok"] and r["error"] == f"400: {bad.decode()}"
    server = fake_server(reply=lambda ids, m: raw_response(fake_stream(ids, m, error_at=4)[0], "chunked"))
    for client in ("light", "httpx"):
        (r,), _ = _fetch(server.url, [req], client)
        assert not r["ok"] and r["error"] == "boom" and r["text"] == "".join(fake_stream(req["prompt_ids"], 4)[1])
    server = fake_server(reply=lambda ids, m: raw_response(fake_stream(ids, m)[0], "length")[:-20], framing="close")
    (r,), _ = _fetch(server.url, [req])
    assert not r["ok"] and r["error"].startswith("ConnectionError: the server closed the connection 20 bytes")


@pytest.mark.parametrize("extra", [(), ("--request-rate", "200", "--max-concurrency", "3")], ids=["all", "rate"])
def test_two_client_processes_give_every_request_the_result_one_process_gives(fake_server, extra):
    server = fake_server()
    reqs = serve_load.make_requests(5, 120, 110)
    one, _, cpu1 = serve_load.run_requests(server.url, "m", reqs, _load_args(server.url, "--procs", "1", *extra))
    two, duration, cpu2 = serve_load.run_requests(server.url, "m", reqs, _load_args(server.url, "--procs", "2", *extra))
    assert len(cpu1) == 1 and len(cpu2) == 2 and all(c > 0 for c in cpu2)
    keys = ("ok", "error", "text", "output_tokens", "prompt_tokens")
    for req, a, b in zip(reqs, one, two):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert b["text"] == "".join(fake_stream(req["prompt_ids"], req["max_tokens"])[1])  # request i kept its identity
        assert len(a["itl"]) == len(b["itl"]) == req["max_tokens"] - 1
    assert duration == max(r["start"] + r["e2e"] for r in two)
    s = serve_load.summarize(two, duration, cpu2)
    assert s["failed"] == 0 and s["client_procs"] == 2
    assert s["output_throughput"] * s["duration_s"] == pytest.approx(sum(r["max_tokens"] for r in reqs))
    assert s["client_cpu_us_per_token"] == pytest.approx(sum(cpu2) / sum(r["max_tokens"] for r in reqs) * 1e6)


@pytest.mark.parametrize("argv, message", [
    (["--procs", "0"], "--procs and --max-concurrency must be >= 1"),
    (["--procs", "two"], "invalid int value"),
    (["--max-concurrency", "0"], "--procs and --max-concurrency must be >= 1"),
    (["--client", "curl"], "invalid choice"),
])
def test_bad_arguments_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        serve_load.parse_args(["--url", "http://x", "--model", "m", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
