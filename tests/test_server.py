"""`llaisys serve` end to end: the real server process on the real default model (CPU), called with the
official `openai` client (an independent implementation of the protocol) and raw HTTP for bad requests.
References come from an Engine in this process: greedy text, token counts, and logprobs from score().

The module shares one server (loading the model twice costs more than all the requests): the SIGTERM
test stops it and so must stay last."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.slow  # the real default model, twice (server and reference engine)

MODEL = "qwen2.5-coder-0.5b-instruct"
KEY = "test-key-123"
MAX_SEQ_LEN = 1024
MAX_QUEUED = 36  # above the 32 concurrent clients; the 503 test fills it
ENGINE_ARGS = dict(device="cpu", max_seq_len=MAX_SEQ_LEN, cpu_kv_cache_bytes=96 << 20, max_num_seqs=40)
CHAT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_proc(tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    a = ENGINE_ARGS
    cmd = [sys.executable, "-m", "llaisys.server", "--model", MODEL, "--device", a["device"], "--port", str(port),
           "--max-seq-len", str(a["max_seq_len"]), "--cpu-kv-cache-bytes", str(a["cpu_kv_cache_bytes"]),
           "--max-num-seqs", str(a["max_num_seqs"]), "--max-queued-requests", str(MAX_QUEUED)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, LLAISYS_API_KEY=KEY))
    try:
        yield {"url": f"http://127.0.0.1:{port}", "proc": proc, "log": log}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def eng(server_proc):  # loads while the server process loads its own copy
    from llaisys.server.backend import Engine

    e = Engine(MODEL, progress=False, **ENGINE_ARGS)
    yield e
    e.close()


@pytest.fixture(scope="module")
def server(server_proc, eng):
    proc, log = server_proc["proc"], server_proc["log"]
    while True:  # loading takes a while on a busy CPU; a crash ends the wait
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read()[-3000:]}")
        try:
            if httpx.get(server_proc["url"] + "/health", timeout=5).status_code == 200:
                return server_proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=600)


def metrics(server) -> dict:
    text = httpx.get(server["url"] + "/metrics", timeout=600).text  # waits for the engine's step in progress
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}


def post(server, path: str, body, key=KEY, raw=False):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if raw else json.dumps(body)
    return httpx.post(server["url"] + path, content=content, headers=headers, timeout=600)


def chat_prompt_ids(eng, messages):
    from llaisys.server.backend import chat_ids

    return chat_ids(eng, messages)


# ---- chat and completions against the engine ------------------------------------------------------------

def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_greedy_matches_engine_and_usage_counts_tokens(client, eng):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=8)
    want = eng.chat(CHAT, temperature=0, max_new_tokens=8)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason == "length"
    assert r.usage.prompt_tokens == len(chat_prompt_ids(eng, CHAT))
    assert r.usage.completion_tokens == len(want.token_ids) == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=8, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id and c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_greedy_matches_engine_stream_and_not(client, eng):
    prompt = "def fibonacci(n):"
    want = eng.generate(prompt, temperature=0, max_new_tokens=8)
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    assert r.object == "text_completion" and r.choices[0].text == want.text
    assert r.usage.prompt_tokens == len(eng.tokenizer.encode(prompt, add_special_tokens=True))
    assert r.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_token_id_prompts_batch_and_echo(client, eng):
    ids = eng.tokenizer.encode("import numpy as", add_special_tokens=True)
    want = eng.generate(ids, temperature=0, max_new_tokens=4)
    other = eng.tokenizer.encode("import os", add_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt=[ids, other], temperature=0, max_tokens=4, echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == eng.tokenizer.decode(ids) + want.text
    assert r.choices[1].text.startswith("import os")
    assert r.usage.prompt_tokens == len(ids) + len(other)
    r = client.completions.create(model=MODEL, prompt=["import numpy as", "import os"], temperature=0, max_tokens=4)
    assert r.choices[0].text == want.text


def test_max_tokens_gives_length_and_stop_strings_end_the_text(client, eng):
    prompt = "Count: 1, 2, 3,"
    full = eng.generate(prompt, temperature=0, max_new_tokens=12).text
    stop = full[3:6]  # some text the reply will reach
    want = full[:full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stop=[stop, "@@"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop" and all(stop not in c.choices[0].text for c in chunks)
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


def test_n_choices_with_a_seed_are_reproducible(client):
    # a prompt over one KV block: choices 1 and 2 share choice 0's prompt blocks through the prefix cache
    msgs = [{"role": "system", "content": "You are a storyteller who writes one vivid sentence."},
            {"role": "user", "content": "Begin a story about a lighthouse."}]
    args = dict(model=MODEL, messages=msgs, temperature=1.0, max_tokens=6, seed=1234)
    a = client.chat.completions.create(n=3, **args)
    b = client.chat.completions.create(n=3, **args)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1  # each choice has its own seed stream
    assert a.usage.completion_tokens == 3 * 6
    one = client.chat.completions.create(n=1, **args)
    assert one.choices[0].message.content == texts[0]  # choice 0 uses the request's seed itself
    streamed = {}
    for c in client.chat.completions.create(n=3, stream=True, **args):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts


def test_32_concurrent_streams_each_get_what_they_get_alone(client):
    jobs = [dict(prompt=f"Item {i}: a short note about the number {i * 7}", seed=100 + i) for i in range(32)]

    # compared by content, not chunk boundaries: a stream that falls behind gets its waiting tokens in one chunk
    def run(job, out, i):
        s = client.completions.create(model=MODEL, temperature=1.0, max_tokens=4, stream=True, logprobs=0, **job)
        chunks = [c.choices[0] for c in s]
        out[i] = ({c.index for c in chunks}, "".join(c.text for c in chunks),
                  [t for c in chunks for t in c.logprobs.tokens], [c.finish_reason for c in chunks][-1],
                  all(c.finish_reason is None for c in chunks[:-1]))

    together = [None] * len(jobs)
    threads = [threading.Thread(target=run, args=(job, together, i)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    alone = [None] * len(jobs)
    for i, job in enumerate(jobs):
        run(job, alone, i)
    assert together == alone
    assert all(index == {0} and end in ("length", "stop") and only_last for index, _, _, end, only_last in together)
    assert all(1 <= len(tokens) <= 4 for _, _, tokens, _, _ in together)
    assert len({text for _, text, _, _, _ in together}) > 16  # no answer served twice


# ---- clients that leave, a full queue, bad requests, keys ------------------------------------------------

def wait_until_idle(server, what: str) -> dict:
    """Polls /metrics until no sequence runs and no KV block is held. The engine frees an aborted request's
    blocks before its next step; on a busy CPU the step in progress may take seconds, hence the long limit."""
    deadline = time.monotonic() + 60
    while True:
        m = metrics(server)
        if m["llaisys_kv_blocks_used"] == 0 and m["llaisys_num_requests_running"] == 0:
            return m
        assert time.monotonic() < deadline, f"{what}: blocks still held: {m}"
        time.sleep(0.05)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server, client):
    with httpx.stream("POST", server["url"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": "Write a long essay about the sea.", "max_tokens": 500,
                            "stream": True, "ignore_eos": True}, timeout=600) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert metrics(server)["llaisys_kv_blocks_used"] > 0
    m = wait_until_idle(server, "after a disconnect")
    assert m['llaisys_requests_total{outcome="aborted"}'] >= 1
    r = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=2)
    assert r.choices[0].finish_reason == "length"  # still serving


def test_a_full_queue_answers_503(server, client):
    socks = []
    try:
        body = json.dumps({"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 500, "stream": True})
        for _ in range(MAX_QUEUED):  # streams that are never read: they stay in flight until closed
            s = socket.create_connection(("127.0.0.1", int(server["url"].rsplit(":", 1)[1])))
            s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
            socks.append(s)
        while metrics(server)["llaisys_http_requests_in_flight"] < MAX_QUEUED:
            time.sleep(0.05)
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "one more", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy", r.text
    finally:
        for s in socks:
            s.close()
    wait_until_idle(server, "after closing the queued streams")
    assert client.completions.create(model=MODEL, prompt="Hi", temperature=0, max_tokens=1).choices


CHAT_OK = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
BAD_REQUESTS = [  # (path, body, status, words the message must contain)
    ("/v1/chat/completions", "{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", "[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", {**CHAT_OK, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT_OK, "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user"}]}, 400, "content"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "image_url"),
    ("/v1/chat/completions", {**CHAT_OK, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {**CHAT_OK, "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT_OK, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {**CHAT_OK, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {**CHAT_OK, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {**CHAT_OK, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**CHAT_OK, "top_logprobs": 3}, 400, "logprobs"),
    ("/v1/chat/completions", {**CHAT_OK, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT_OK, "stream_options": {"include_usage": True}}, 400, "stream"),
    ("/v1/chat/completions", {**CHAT_OK, "seed": 1.5}, 400, "seed"),
    ("/v1/chat/completions", {**CHAT_OK, "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    # finite in JSON, inf or 0 as the float32 the kernels read (issue 28: they failed every request of the step)
    ("/v1/chat/completions", {**CHAT_OK, "temperature": 1e39}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT_OK, "temperature": 1e-300}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1e-300}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 3.5e38}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * (2 * MAX_SEQ_LEN)}, 400, str(MAX_SEQ_LEN)),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "token id"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "echo"),
    ("/v1/chat/completions", {**CHAT_OK, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], "mixed"]}, 400, "list of token ids"),
    ("/v1/nothing-here", {}, 404, "/v1/nothing-here"),
]


@pytest.mark.parametrize("path, body, status, words", BAD_REQUESTS, ids=[f"{i}" for i in range(len(BAD_REQUESTS))])
def test_bad_requests_get_openai_errors(server, path, body, status, words):
    r = post(server, path, body, raw=isinstance(body, str))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and words in err["message"], err
    assert httpx.get(server["url"] + "/health").status_code == 200


def test_wrong_method_and_prompt_too_long_code(server):
    r = httpx.get(server["url"] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": list(range(MAX_SEQ_LEN))})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_api_key_is_needed_on_v1_only(server):
    for key in (None, "wrong", KEY + "x"):
        r = post(server, "/v1/chat/completions", CHAT_OK, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server["url"] + "/v1/models").status_code == 401
    assert httpx.get(server["url"] + "/health").json() == {"status": "ok"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server["url"] + "/v1", api_key="nope", max_retries=0).models.list()


# ---- need engine features the lead is adding: penalties, min_tokens, logprobs -----------------------------

def test_engine_feature_penalties_and_min_tokens_pass_through(client, eng):
    kw = dict(presence_penalty=1.5, frequency_penalty=0.5)
    want = eng.generate("List fruits: apple, apple,", temperature=0, max_new_tokens=6, min_tokens=3, **kw)
    r = client.completions.create(model=MODEL, prompt="List fruits: apple, apple,", temperature=0, max_tokens=6,
                                  extra_body={"min_tokens": 3}, **kw)
    assert r.choices[0].text == want.text


def log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_engine_feature_chat_logprobs_match_score(client, eng):
    from llaisys.server.backend import token_bytes

    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=4, logprobs=True,
                                       top_logprobs=5)
    prompt = chat_prompt_ids(eng, CHAT)
    out = eng.generate(prompt, temperature=0, max_new_tokens=4).token_ids
    content = r.choices[0].logprobs.content
    assert [bytes(e.bytes) for e in content] == [token_bytes(eng, t) for t in out]
    logits = eng.score(prompt + out)
    penalty = eng.generation_config.get("repetition_penalty") or 1.0  # the model's default applies here too
    for j, (e, t) in enumerate(zip(content, out)):
        row = logits[len(prompt) + j - 1].astype(np.float64)
        seen = np.array(sorted(set(prompt + out[:j])))
        row[seen] = np.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)  # HF's formula
        ref = log_softmax(row)
        # decode (one row) and score (a whole prefill) round bf16 differently: a few hundredths of a nat
        assert e.logprob == pytest.approx(ref[t], abs=0.1)
        tops = [x.logprob for x in e.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert tops[0] == pytest.approx(e.logprob)  # greedy: the chosen token is the most likely


def test_engine_feature_completion_logprobs_shape(client):
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", temperature=0, max_tokens=4, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset == sorted(lp.text_offset)
    assert all(len(top) <= 3 and max(top.values()) >= lp.token_logprobs[i] - 1e-6
               for i, top in enumerate(lp.top_logprobs))
    chunks = list(client.completions.create(model=MODEL, prompt="def add(a, b):", temperature=0, max_tokens=4,
                                            logprobs=3, stream=True))
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens


ECHO_PROMPT = "def add(a, b):\n    return a + b\n\n# café 你好, naïve"  # multi-byte characters too


def check_offsets(lp, text: str) -> None:
    """text_offset: one per token, in order, each token's text found at its offset (tokens holding part of
    a character show U+FFFD and are skipped)."""
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    whole = [(o, t) for o, t in zip(lp.text_offset, lp.tokens) if "\ufffd" not in t]
    assert len(whole) > len(lp.tokens) // 2
    assert all(text[o:o + len(t)] == t for o, t in whole), list(zip(lp.text_offset, lp.tokens))


def test_completion_echo_with_logprobs_gives_prompt_logprobs_from_score(client, eng):
    from llaisys.server.backend import token_bytes

    ids = eng.tokenize(ECHO_PROMPT)
    want = eng.generate(ECHO_PROMPT, temperature=0, max_new_tokens=4)
    r = client.completions.create(model=MODEL, prompt=ECHO_PROMPT, echo=True, logprobs=3, temperature=0, max_tokens=4)
    c, n = r.choices[0], len(ids)
    assert c.text == ECHO_PROMPT + want.text and r.usage.prompt_tokens == n
    lp = c.logprobs
    assert len(lp.tokens) == n + len(want.token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert lp.text_offset[n] == len(ECHO_PROMPT)  # the generated tokens start after the echoed prompt
    check_offsets(lp, c.text)
    # the prompt's logprobs: a float64 log-softmax of score()'s logits at the previous position
    ref = np.stack([log_softmax(row) for row in eng.score(ids)[:-1]])
    got = np.array(lp.token_logprobs[1:n], dtype=np.float64)
    # the server's score() and this one run the same batch of one through the same kernels
    np.testing.assert_allclose(got, ref[np.arange(n - 1), ids[1:]], rtol=0, atol=1e-6)
    for i in range(1, n):
        want_top = {}  # the 3 most likely, keyed by text: tokens with the same text keep the likelier one
        for t in np.argsort(-ref[i - 1], kind="stable")[:3]:
            want_top.setdefault(token_bytes(eng, int(t)).decode("utf-8", errors="replace"), ref[i - 1, t])
        top = lp.top_logprobs[i]
        assert top.keys() == want_top.keys() and list(top.values()) == pytest.approx(list(want_top.values()), abs=1e-6)
        assert max(top.values()) >= lp.token_logprobs[i] - 1e-9
    assert all(isinstance(x, float) for x in lp.token_logprobs[n:])  # the generated tokens', from the engine
    assert "".join(lp.tokens[n:]) == want.text

    chunks = list(client.completions.create(model=MODEL, prompt=ECHO_PROMPT, echo=True, logprobs=3, temperature=0,
                                            max_tokens=4, stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith(ECHO_PROMPT) and first.logprobs.token_logprobs[0] is None
    assert first.logprobs.tokens[:n] == lp.tokens[:n]  # the echoed prompt's logprobs come in the first chunk
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert [t for ch in chunks for t in ch.choices[0].logprobs.tokens] == lp.tokens
    assert [o for ch in chunks for o in ch.choices[0].logprobs.text_offset] == lp.text_offset


def test_completion_echo_with_max_tokens_0_returns_the_prompt_alone(client, eng):
    ids = eng.tokenize("import numpy as np")
    text = eng.tokenizer.decode(ids)
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=0, n=2)
    assert [(ch.text, ch.finish_reason) for ch in r.choices] == [(text, "length")] * 2
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and lp.top_logprobs[1:] == [{}] * (len(ids) - 1)  # logprobs=0: no top
    check_offsets(lp, text)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert [(ch.choices[0].text, ch.choices[0].finish_reason) for ch in chunks[:-1]] == [(text, "length")]
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 0


# ---- last: shutdown ---------------------------------------------------------------------------------------

def test_sigterm_ends_running_streams_with_an_error_chunk(server):
    with httpx.stream("POST", server["url"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": "Write a long essay.", "max_tokens": 500, "stream": True,
                            "ignore_eos": True}, timeout=600) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        server["proc"].send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][5:])["error"]["code"] == "server_shutdown"
    assert server["proc"].wait(timeout=120) in (0, -signal.SIGTERM)
