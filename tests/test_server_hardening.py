"""`llaisys serve` against hostile or careless clients (issue 28): bodies larger than any prompt could need
(413 before they are read, RSS flat, /health answering meanwhile), JSON nested thousands of levels deep
(400, no traceback), clients that leave while sending their body (one INFO line each), lone surrogates in
any text field (400 naming it), the Authorization header (scheme in any case, key compared exactly), and
`llaisys serve`'s checks of the port and its arguments before the model is read.

One server (a tiny random checkpoint, the engine in its own process as by default) serves the module; its
log is read back to check what each case wrote there. Requests go over raw sockets where the point is what
arrives when (a body cut short, headers without a body)."""
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tiny_model import make_tiny_qwen2  # noqa: E402
from utils import llaisys_server  # noqa: E402

KEY = "hardening-key"
MAX_SEQ_LEN = 256
AUTH = {"Authorization": f"Bearer {KEY}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("hardening"), seed=3, max_position_embeddings=512)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("hardening-log") / "server.log"
    with llaisys_server(["--model", ckpt, "--device", "cpu", "--max-seq-len", str(MAX_SEQ_LEN), "--num-kv-blocks",
                         "256", "--served-model-name", "m", "--api-key", KEY], log_path) as server:
        yield server


class LogSince:
    """The server log written after this point."""

    def __init__(self, server):
        self.path, self.start = server["log"], os.path.getsize(server["log"])

    def text(self) -> str:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read().decode("utf-8", "replace")

    def wait_for(self, words: str, count: int = 1, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            if text.count(words) >= count or time.monotonic() > deadline:
                return text
            time.sleep(0.1)


def assert_no_errors(text: str) -> None:
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]


def assert_openai_error(r, status: int, code=None, param="any") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"], err
    if code is not None:
        assert err["code"] == code, err
    if param != "any":
        assert err["param"] == param, err
    return err


def post(server, body, path="/v1/completions", headers=AUTH, timeout=120):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server["url"] + path, content=content, timeout=timeout,
                      headers={"Content-Type": "application/json", **headers})


def raw_request(port: int, head: str, body_parts=(), read=True, timeout=30.0) -> tuple[int, dict]:
    """Sends head (request line and headers, without the blank line) and the body parts on one connection;
    returns (status, JSON body) of the answer, read as soon as it comes (the body may still be unsent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(f"{head}\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
        for part in body_parts:
            s.sendall(part)
        if not read:
            return 0, {}
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head_bytes, _, rest = data.partition(b"\r\n\r\n")
        lines = head_bytes.decode("latin-1").split("\r\n")
        length = next(int(v) for k, _, v in (x.partition(":") for x in lines[1:]) if k.lower() == "content-length")
        while len(rest) < length:
            rest += s.recv(65536)
        return int(lines[0].split()[1]), json.loads(rest)


def text_body(nbytes: int) -> bytes:
    """A /v1/completions body of exactly nbytes bytes: one long text prompt."""
    empty = json.dumps({"model": "m", "prompt": ""}).encode()
    return json.dumps({"model": "m", "prompt": "ab " * ((nbytes - len(empty)) // 3) + "x" *
                       ((nbytes - len(empty)) % 3)}).encode()


# ---- the body limit (item 2) ------------------------------------------------------------------------------

def test_the_body_limit_is_a_few_bytes_per_token_of_the_context_with_a_floor():
    from llaisys.server.app import BODY_BYTES_PER_TOKEN, MIN_BODY_LIMIT, body_limit

    assert body_limit(256) == body_limit(4096) == MIN_BODY_LIMIT == 256 << 10
    assert body_limit(8192) == 320 << 10 and body_limit(32768) == (1 << 20) + (64 << 10)
    assert BODY_BYTES_PER_TOKEN == 32
    for n in (256, 4096, 8192, 32768):  # a whole context of the widest token ids (151935: Qwen2.5's vocab) fits
        body = {"model": "qwen2.5-coder-0.5b-instruct", "prompt": [151935] * (n - 1), "max_tokens": 1,
                "temperature": 0.7, "top_p": 0.9, "stop": ["\n\n", "</s>"], "stream": True, "logprobs": 5}
        assert len(json.dumps(body)) < body_limit(n)
        msgs = [{"role": "user", "content": "这是一个测试" * (n // 8)}]  # Chinese, \uXXXX-escaped: ~10 bytes a token
        assert len(json.dumps({"model": "m", "messages": msgs})) < body_limit(n)


def test_a_content_length_over_the_limit_is_answered_413_before_the_body_is_sent(server):
    log = LogSince(server)
    # headers only: the answer must come without waiting for the 8 MiB it announces
    status, body = raw_request(server["port"], f"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json"
                                               f"\r\nContent-Length: {8 << 20}")
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert str(256 << 10) in body["error"]["message"]
    assert "413 rejected" in log.wait_for("413 rejected")


def test_a_chunked_body_is_refused_once_it_passes_the_limit(server):
    # 300 KiB sent chunked, then nothing more (no last chunk): the answer comes without the body's end
    part = b"x" * (300 << 10)
    status, body = raw_request(server["port"], "POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json"
                                               "\r\nTransfer-Encoding: chunked",
                               [f"{len(part):x}\r\n".encode() + part + b"\r\n"])
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_a_body_at_the_limit_is_read_and_one_byte_more_is_not(server):
    limit = 256 << 10
    r = post(server, text_body(limit))  # read, decoded and tokenized: its prompt is far over 256 tokens
    assert_openai_error(r, 400, "context_length_exceeded")
    r = post(server, text_body(limit + 1))
    assert_openai_error(r, 413, "request_too_large")
    r = post(server, {"model": "m", "prompt": "Hello", "max_tokens": 2})  # the connection pool still works
    assert r.status_code == 200, r.text


def test_large_bodies_leave_rss_flat_and_health_answering(server):
    pid, port = server["proc"].pid, server["port"]
    big = text_body(4 << 20)
    post(server, big)  # the first one's code paths
    before = _rss_mib(pid)
    lat, done = [], threading.Event()

    def poll():
        while not done.is_set():
            t = time.perf_counter()
            assert httpx.get(server["url"] + "/health", timeout=120).status_code == 200
            lat.append(time.perf_counter() - t)
            time.sleep(0.02)
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for i in range(20):  # the old code took ~15 s (and ~100 MB that stayed) per 4 MiB prompt
            head = "POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
            if i % 2:
                status, _ = raw_request(port, head + "Transfer-Encoding: chunked",
                                        [f"{len(big):x}\r\n".encode() + big + b"\r\n0\r\n\r\n"])
            else:
                status, _ = raw_request(port, head + f"Content-Length: {len(big)}", [big])
            assert status == 413
    finally:
        done.set()
        poller.join()
    after = _rss_mib(pid)
    assert after - before < 16, (before, after)
    assert lat and max(lat) < 2.0, sorted(lat)[-5:]


def test_health_answers_while_a_body_under_the_limit_is_tokenized(server):
    # ~250 KiB of text is tokenized before the prompt is found too long: that runs in a worker thread with
    # the GIL released (Tokenizer.encode through encode_batch), so /health keeps answering meanwhile
    body = text_body(250 << 10)
    took, lat, done = [], [], threading.Event()

    def poll():
        while not done.is_set():
            t = time.perf_counter()
            httpx.get(server["url"] + "/health", timeout=120)
            lat.append(time.perf_counter() - t)
            time.sleep(0.01)
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for _ in range(4):
            t = time.perf_counter()
            assert_openai_error(post(server, body), 400, "context_length_exceeded")
            took.append(time.perf_counter() - t)
    finally:
        done.set()
        poller.join()
    # holding the GIL, each /health waited for a whole tokenization: its median was the request's time
    assert statistics.median(lat) < max(0.05, 0.5 * statistics.median(took)), (sorted(lat), took)


def test_long_texts_are_tokenized_the_same_with_the_gil_released(ckpt):
    from llaisys.tokenizer import GIL_FREE_CHARS, Tokenizer

    tok = Tokenizer.from_hf_dir(ckpt)
    text = ("def f(x):\n    return x * 2  # café 你好 😀\n<|im_start|>user\nHi<|im_end|>\n" * 2000)
    assert len(text) > GIL_FREE_CHARS
    assert tok.encode(text) == tok.inner.encode(text, add_special_tokens=False).ids
    ticks, stop = [], threading.Event()

    def spin():
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            ticks.append(time.perf_counter() - t)
    spinner = threading.Thread(target=spin)
    spinner.start()
    t = time.perf_counter()
    tok.encode(text * 2)
    took = time.perf_counter() - t
    stop.set()
    spinner.join()
    assert max(ticks) < max(0.05, took / 2), (max(ticks), took)  # holding the GIL: one tick as long as encode


# ---- deep JSON (item 5) -----------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [900, 5000, 10000])
@pytest.mark.parametrize("where", ["prompt", "top", "content", "extra"])
def test_deeply_nested_json_is_a_400_without_a_traceback(server, depth, where):
    log = LogSince(server)
    deep = "[" * depth + "]" * depth
    body = {"prompt": '{"model": "m", "prompt": %s}' % deep,
            "top": deep,
            "content": '{"model": "m", "messages": [{"role": "user", "content": %s}]}' % deep,
            "extra": '{"model": "m", "prompt": "hi", "x": %s}' % deep}[where]
    path = "/v1/chat/completions" if where == "content" else "/v1/completions"
    assert_openai_error(post(server, body, path), 400)
    assert_no_errors(log.wait_for("400 rejected"))
    assert httpx.get(server["url"] + "/health", timeout=30).status_code == 200


# ---- clients that leave while sending (item 6) ------------------------------------------------------------

def test_clients_that_leave_while_sending_their_body_are_one_info_line_each(server):
    log = LogSince(server)
    n = 50
    for i in range(n):
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        raw_request(server["port"], f"POST {path} HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 1000",
                    [b'{"model": "m", "prompt": "Hel'], read=False)  # 29 of 1000 bytes, then the socket closes
    text = log.wait_for("disconnected while sending its body", n)
    time.sleep(0.5)  # anything else these requests would write
    text = log.text()
    assert text.count("disconnected while sending its body") == n, text[-3000:]
    assert text.count(" INFO ") == n, text[-3000:]
    assert_no_errors(text)
    assert "llaisys_requests_total{outcome=\"aborted\"}" in httpx.get(server["url"] + "/metrics", timeout=60).text


# ---- lone surrogates (item 9) -----------------------------------------------------------------------------

@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"model": "m", "prompt": "hi", "stop": "a\\udc80"}', "stop"),
    ("/v1/completions", '{"model": "m", "prompt": "hi", "stop": ["ok", "\\ud800b"]}', "stop"),
    ("/v1/completions", '{"model": "m", "prompt": "h\\udc80i"}', "prompt"),
    ("/v1/completions", '{"model": "m", "prompt": ["fine", "h\\udc80i"]}', "prompt"),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "h\\udc80i"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": '
                             '[{"type": "text", "text": "h\\udc80i"}]}]}', "messages.0.content"),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": "\\udfff"}',
     "stop"),
    ("/v1/completions", '{"model": "m", "prompt": "hi", "\\udc80x": 1}', None),
], ids=["stop", "stop-list", "prompt", "prompt-list", "content", "content-part", "chat-stop", "field-name"])
def test_a_lone_surrogate_in_any_text_is_a_400_naming_the_field(server, path, body, param):
    log = LogSince(server)
    err = assert_openai_error(post(server, body, path), 400, param=param)
    assert "not valid Unicode" in err["message"], err
    assert_no_errors(log.wait_for("400 rejected"))


# ---- the Authorization header (item 9) --------------------------------------------------------------------

@pytest.mark.parametrize("value,status", [
    (f"Bearer {KEY}", 200),
    (f"bearer {KEY}", 200),  # RFC 7235: the scheme is case-insensitive
    (f"BEARER {KEY}", 200),
    (f"Bearer   {KEY}", 200),  # RFC 6750: 1*SP before the token
    (f"Bearer {KEY}   ", 200),  # spaces at the end are not part of a header's value (RFC 9110 5.5)
    (f"Bearer {KEY}\xa0", 401),  # anything else after the key is: the key is compared exactly
    (f"Bearer {KEY}\x85", 401),
    (f"Bearer {KEY}x", 401),
    (f"Bearer {KEY[:-1]}", 401),
    (f"Bearer\t{KEY}", 401),
    (f"Bearer{KEY}", 401),
    (f"Basic {KEY}", 401),
    ("Bearer", 401),
])
def test_the_scheme_is_case_insensitive_and_the_key_exact(server, value, status):
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=30) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: "
                  + value.encode("latin-1") + b"\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert int(data.split()[1]) == status, (value, data[:300])


def test_an_api_key_no_header_can_carry_is_refused():
    from llaisys.server.app import check_api_key, create_app

    for key in ("", " key", "key ", "key\t", "key\n", "a\r\nb"):
        with pytest.raises(ValueError, match="API key"):
            create_app(object(), "m", key)  # checked before anything of the engine is used
    check_api_key(None)
    check_api_key("k\xe9y with inner spaces")


# ---- `llaisys serve`: the port and the arguments before the model (item 8) -----------------------------------

@pytest.fixture
def no_loading(monkeypatch):
    """Building an engine fails the test: whatever it checks must be checked before."""
    from llaisys.server import backend

    monkeypatch.delenv("LLAISYS_API_KEY", raising=False)
    def load(*args, **kwargs):
        raise AssertionError("the model is being loaded")
    monkeypatch.setattr(backend, "Engine", load)
    monkeypatch.setattr(backend, "EngineProcess", load)


def _serve(*args) -> int:
    from llaisys import cli

    return cli.main(["serve", "--model", "/nonexistent/model", "--device", "cpu", *args])


def test_serve_on_a_port_in_use_exits_3_before_loading(no_loading, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert _serve("--port", str(port)) == 3
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err and "nonexistent" not in err, err


def test_serve_binds_its_port_before_loading_and_frees_it_after(monkeypatch):
    from llaisys.server import backend

    monkeypatch.delenv("LLAISYS_API_KEY", raising=False)
    port = _free_port()
    seen = []

    def load(*args, **kwargs):  # the engine comes after the socket: nobody else can take the port meanwhile
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        seen.append(True)
        raise RuntimeError("stop here")
    monkeypatch.setattr(backend, "EngineProcess", load)
    assert _serve("--port", str(port)) == 2 and seen == [True]
    with socket.socket() as again:  # closed when serve ends
        again.bind(("127.0.0.1", port))


@pytest.mark.parametrize("args,words", [
    (["--api-key", "secret "], "API key"),
    (["--api-key", ""], "API key is empty"),
    (["--block-size", "4096"], "block_size"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    (["--gpu-memory-utilization", "nan"], "gpu_memory_utilization"),
])
def test_serve_checks_its_arguments_before_binding_or_loading(no_loading, capsys, args, words):
    with socket.socket() as busy:  # an argument error comes first, and nothing is bound
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert _serve("--port", str(busy.getsockname()[1]), *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("llaisys: error:") and words in err, err


def test_serve_on_a_port_in_use_fails_fast_from_the_command_line():
    # the real command: a model that does not exist would fail with exit 2 if anything tried to read it
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "llaisys", "serve", "--model", "/nonexistent/model", "--device",
                            "cpu", "--port", str(busy.getsockname()[1])], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert "Address already in use" in r.stderr and "nonexistent" not in r.stderr, r.stderr
    assert time.perf_counter() - t < 30


def test_the_body_benchmark_runs(ckpt, tmp_path):
    out = tmp_path / "bodies.json"
    script = os.path.join(os.path.dirname(__file__), "..", "bench", "server_bodies.py")
    r = subprocess.run([sys.executable, script, "--model", ckpt, "--max-seq-len", "256", "--count", "2",
                        "--body-mib", "1", "--server-arg=--num-kv-blocks", "--server-arg=256", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert r.returncode == 0, r.stdout + r.stderr
    results = {x["phase"]: x for x in json.loads(out.read_text())["results"]}
    assert results["413-length"]["statuses"] == results["413-chunked"]["statuses"] == {"413": 2}
    assert results["400-fits"]["statuses"] == {"400": 2} and 250 << 10 < results["400-fits"]["body_bytes"] <= 256 << 10
    assert "0 ERROR lines, 0 tracebacks" in r.stdout
